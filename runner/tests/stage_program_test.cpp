// Two-phase execution of real stage programs. Needs an export of at least
// three stages (a first, a middle and a last program):
//
//   ZL_CUSTOM_OPS_LIB=build/custom_ops/libzl_custom_ops.so \
//     .venv/bin/zl export --model tiny-random --num-stages 3 --seq-len 16 --out /tmp/zl3 --no-check
//   ZL_TEST_EXPORT_DIR=/tmp/zl3 build/runner/zl_runner_tests --gtest_filter='StageProgram*'
//
// tests/test_runner.py does exactly this with its session export. Without
// ZL_TEST_EXPORT_DIR the tests skip.
#include "zl/stage_program.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <zl/pipeline_marker.h>

#include "status_test_support.h"
#include "temp_dir_support.h"

namespace {

using zl::StageInputs;
using zl::StageProgram;
using zl::StageProgramOptions;
using zl::StageStepResult;

std::string export_dir() {
  const char* dir = std::getenv("ZL_TEST_EXPORT_DIR");
  return dir != nullptr ? dir : "";
}

/// Deterministic inputs of the program's shapes: tokens, a padded tail, an
/// ignored prefix, and a hidden state of moderate values.
struct Batch {
  std::vector<int64_t> ids, mask, labels;
  std::vector<float> hidden;

  Batch(const StageProgram& p, int seed) {
    const int64_t bs = p.batch() * p.seq_len();
    for (int64_t i = 0; i < bs; ++i) {
      const int64_t pos = i % p.seq_len();
      ids.push_back((i * 37 + seed * 11) % 250);
      mask.push_back(pos < p.seq_len() - 3 ? 1 : 0);
      labels.push_back(pos < 2 || mask.back() == 0 ? -100 : ids.back());
    }
    const int64_t d = p.hidden_size() > 0 ? p.hidden_size() : 1;
    for (int64_t i = 0; i < bs * d; ++i) hidden.push_back(0.5f * std::sin(0.37f * i + seed));
  }

  StageInputs inputs() const {
    StageInputs in;
    in.input_ids = ids.data();
    in.hidden = hidden.data();
    in.attention_mask = mask.data();
    in.labels = labels.data();
    return in;
  }
};

std::vector<std::vector<float>> copy_grads(const StageProgram& p, const StageStepResult& r) {
  std::vector<std::vector<float>> out;
  for (size_t i = 0; i < r.gradients.size(); ++i) {
    out.emplace_back(r.gradients[i], r.gradients[i] + p.parameters()[i].numel());
  }
  return out;
}

/// Gives lora_B nonzero values: with B = 0 (PEFT's init) every lora_A
/// gradient is exactly 0, which would hide a broken gradient read-out.
void perturb_lora_b(StageProgram* p) {
  for (const zl::TrainableParam& param : p->parameters()) {
    if (param.name.find("lora_B") == std::string::npos) continue;
    for (size_t i = 0; i < param.numel(); ++i) param.data[i] = 0.01f * std::cos(0.7f * i);
  }
}

class StageProgramTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (export_dir().empty()) GTEST_SKIP() << "set ZL_TEST_EXPORT_DIR to a `zl export --num-stages 3` directory";
  }

  std::unique_ptr<StageProgram> load(int stage) {
    StageProgramOptions options;
    options.program_path = export_dir() + "/stage_" + std::to_string(stage) + ".pte";
    return zl::testing::value_or_fail(StageProgram::load(options));
  }
};

TEST_F(StageProgramTest, ExposesLoraParametersUnderPeftNames) {
  for (int stage : {0, 1}) {
    auto p = load(stage);
    ASSERT_TRUE(p);
    EXPECT_EQ(p->stage_index(), stage);
    EXPECT_EQ(p->is_first(), stage == 0);
    EXPECT_FALSE(p->is_last());
    ASSERT_FALSE(p->parameters().empty());
    for (const zl::TrainableParam& param : p->parameters()) {
      // A readout translator (docs/design#loss-variants) is trained too, under its own names, not PEFT's.
      const std::string translator = "zl.translator.stage_" + std::to_string(stage) + ".";
      if (param.name.rfind(translator, 0) == 0) {
        EXPECT_NE(param.data, nullptr);
        EXPECT_EQ(param.shape.size(), param.name == translator + "scale" ? 1u : 2u) << param.name;
        continue;
      }
      // Global layer numbers (first_layer + local index), PEFT spelling.
      EXPECT_EQ(param.name.rfind("base_model.model.model.layers.", 0), 0u) << param.name;
      EXPECT_EQ(param.name.find(".default."), std::string::npos) << param.name;
      const std::string layer = "layers." + std::to_string(p->first_layer()) + ".";
      if (param.name.find(layer) == std::string::npos) {
        // Stages of several layers also hold later ones; all within range.
        bool in_range = false;
        for (int64_t l = p->first_layer(); l <= p->last_layer(); ++l) {
          in_range |= param.name.find("layers." + std::to_string(l) + ".") != std::string::npos;
        }
        EXPECT_TRUE(in_range) << param.name;
      }
      EXPECT_NE(param.data, nullptr);
      EXPECT_EQ(param.shape.size(), 2u);
    }
  }
}

TEST_F(StageProgramTest, BeginReturnsHiddenWhileForwardIsSuspended) {
  auto p = load(1);
  ASSERT_TRUE(p);
  Batch batch(*p, 1);
  const uint64_t calls_before = zl_pipeline_marker_call_count();
  std::vector<float> hidden;
  zl::Status status = p->begin(batch.inputs(), &hidden);
  ASSERT_TRUE(status.ok()) << status.message();
  EXPECT_EQ(zl_pipeline_marker_call_count(), calls_before + 1);
  EXPECT_EQ(p->last_marker_calls(), 1);
  EXPECT_EQ(hidden.size(), static_cast<size_t>(p->batch() * p->seq_len() * p->hidden_size()));
  // The method stays parked in the marker kernel until finish().
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_TRUE(p->suspended());
  // A second begin() while suspended is refused, and changes nothing.
  std::vector<float> other;
  EXPECT_FALSE(p->begin(batch.inputs(), &other).ok());
  EXPECT_TRUE(p->suspended());
  ASSERT_OK_AND_ASSIGN(const StageStepResult result, p->finish());
  EXPECT_FALSE(p->suspended());
  EXPECT_TRUE(std::isfinite(result.loss));
  EXPECT_EQ(result.gradients.size(), p->parameters().size());
}

TEST_F(StageProgramTest, TwoPhasesGiveThePlainExecutionsNumbers) {
  for (int stage : {0, 1, 2}) {
    auto p = load(stage);
    ASSERT_TRUE(p);
    perturb_lora_b(p.get());
    Batch batch(*p, stage + 3);
    std::vector<float> plain_hidden;
    ASSERT_OK_AND_ASSIGN(const StageStepResult plain, p->run(batch.inputs(), &plain_hidden));
    const auto plain_grads = copy_grads(*p, plain);

    std::vector<float> hidden;
    const zl::Status status = p->begin(batch.inputs(), &hidden);
    ASSERT_TRUE(status.ok()) << status.message();
    ASSERT_OK_AND_ASSIGN(const StageStepResult two_phase, p->finish());

    // Same program, same inputs, same kernels: bit-identical.
    EXPECT_EQ(two_phase.loss, plain.loss) << "stage " << stage;
    EXPECT_EQ(two_phase.task_loss, plain.task_loss);
    EXPECT_EQ(two_phase.consistency_loss, plain.consistency_loss);
    EXPECT_EQ(copy_grads(*p, two_phase), plain_grads);
    EXPECT_EQ(hidden, plain_hidden) << "the hook's copy differs from the program's hidden output";
    if (p->is_last()) {
      EXPECT_TRUE(hidden.empty());
      EXPECT_EQ(p->last_marker_calls(), 0);
    } else {
      EXPECT_FALSE(hidden.empty());
    }
    bool any_a_grad = false;
    for (size_t i = 0; i < plain_grads.size(); ++i) {
      if (p->parameters()[i].name.find("lora_A") == std::string::npos) continue;
      for (float g : plain_grads[i]) any_a_grad |= g != 0.0f;
    }
    EXPECT_TRUE(any_a_grad) << "lora_A gradients all zero with nonzero lora_B";
  }
}

TEST_F(StageProgramTest, HookFiresBeforeAnyGradientIsWritten) {
  // The gradients are the backward's outputs, the last thing the method
  // computes. Fill their (planned, fixed) memory with NaN, run phase 1, and
  // look while the method is parked at the marker: no gradient may hold its
  // final value yet. Phase-1 activations may reuse that memory, but they
  // cannot reproduce the exact gradients.
  for (int stage : {0, 1}) {
    auto p = load(stage);
    ASSERT_TRUE(p);
    perturb_lora_b(p.get());
    Batch batch(*p, 11 + stage);
    StageStepResult plain;
    ASSERT_OK_AND_ASSIGN(plain, p->run(batch.inputs()));
    const auto final_grads = copy_grads(*p, plain);
    for (size_t i = 0; i < plain.gradients.size(); ++i) {
      float* g = const_cast<float*>(plain.gradients[i]);
      std::fill(g, g + p->parameters()[i].numel(), std::nanf(""));
    }
    std::vector<float> hidden;
    ASSERT_TRUE(p->begin(batch.inputs(), &hidden).ok());
    ASSERT_TRUE(p->suspended());
    const auto during = copy_grads(*p, plain);  // same planned buffers
    for (size_t i = 0; i < during.size(); ++i) {
      EXPECT_NE(during[i], final_grads[i]) << "stage " << stage << ": gradient of " << p->parameters()[i].name
                                           << " was already computed when the marker fired";
    }
    StageStepResult two_phase;
    ASSERT_OK_AND_ASSIGN(two_phase, p->finish());
    ASSERT_EQ(two_phase.gradients, plain.gradients) << "gradient buffers moved between executions";
    EXPECT_EQ(copy_grads(*p, two_phase), final_grads);
  }
}

TEST_F(StageProgramTest, LastStageRunsEverythingInFinish) {
  auto p = load(2);
  ASSERT_TRUE(p);
  EXPECT_TRUE(p->is_last());
  Batch batch(*p, 5);
  std::vector<float> hidden = {1.0f};
  ASSERT_TRUE(p->begin(batch.inputs(), &hidden).ok());
  EXPECT_TRUE(hidden.empty());
  EXPECT_FALSE(p->suspended());
  StageStepResult result;
  ASSERT_OK_AND_ASSIGN(result, p->finish());
  EXPECT_TRUE(std::isfinite(result.loss));
}

TEST_F(StageProgramTest, ParameterWritesReachTheProgram) {
  auto p = load(0);
  ASSERT_TRUE(p);
  Batch batch(*p, 7);
  StageStepResult before, changed, restored;
  ASSERT_OK_AND_ASSIGN(before, p->run(batch.inputs()));
  std::vector<std::vector<float>> saved;
  for (const auto& param : p->parameters()) saved.emplace_back(param.data, param.data + param.numel());
  perturb_lora_b(p.get());
  std::vector<float> hidden;
  ASSERT_TRUE(p->begin(batch.inputs(), &hidden).ok());
  ASSERT_OK_AND_ASSIGN(changed, p->finish());
  EXPECT_NE(changed.loss, before.loss) << "writing lora_B did not change the program's loss";
  for (size_t i = 0; i < saved.size(); ++i) {
    std::copy(saved[i].begin(), saved[i].end(), p->parameters()[i].data);
  }
  ASSERT_OK_AND_ASSIGN(restored, p->run(batch.inputs()));
  EXPECT_EQ(restored.loss, before.loss);
}

TEST_F(StageProgramTest, FinishWithoutBeginFails) {
  auto p = load(1);
  ASSERT_TRUE(p);
  const zl::Status status = p->finish().status();
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("begin"), std::string::npos) << status.message();
}

TEST_F(StageProgramTest, DestroyingASuspendedProgramDoesNotHang) {
  auto p = load(0);
  ASSERT_TRUE(p);
  Batch batch(*p, 2);
  std::vector<float> hidden;
  ASSERT_TRUE(p->begin(batch.inputs(), &hidden).ok());
  ASSERT_TRUE(p->suspended());
  p.reset();  // stops the method at the marker, then joins the worker
  SUCCEED();
}

// A stage held still (lr 0) runs phase 1 only: abandon() stops the parked
// method at the marker. Many abandoned steps later, a whole step gives bit for
// bit what it gives on a freshly loaded program: nothing of a stopped step
// (planned memory, the method's position) leaks into the next one.
TEST_F(StageProgramTest, AbandonedStepsLeaveTheProgramAsFresh) {
  for (int stage : {0, 1}) {
    auto fresh = load(stage);
    auto used = load(stage);
    ASSERT_TRUE(fresh && used);
    perturb_lora_b(fresh.get());
    perturb_lora_b(used.get());
    const Batch batch(*fresh, 21 + stage);
    std::vector<float> fresh_hidden;
    ASSERT_TRUE(fresh->begin(batch.inputs(), &fresh_hidden).ok());
    ASSERT_OK_AND_ASSIGN(const StageStepResult expected, fresh->finish());
    const auto expected_grads = copy_grads(*fresh, expected);

    for (int round = 0; round < 3; ++round) {
      for (int i = 0; i < 8; ++i) {
        const Batch other(*used, 100 * round + i);
        std::vector<float> plain_hidden, hidden;
        ASSERT_OK_AND_ASSIGN(const StageStepResult plain, used->run(other.inputs(), &plain_hidden));
        (void)plain;
        ASSERT_TRUE(used->begin(other.inputs(), &hidden).ok());
        const zl::Status abandoned = used->abandon();
        ASSERT_TRUE(abandoned.ok()) << abandoned.message();
        EXPECT_FALSE(used->suspended());
        EXPECT_EQ(used->last_marker_calls(), 1);
        EXPECT_EQ(hidden, plain_hidden) << "stage " << stage << ": an abandoned step's hidden state differs";
      }
      std::vector<float> hidden;
      ASSERT_TRUE(used->begin(batch.inputs(), &hidden).ok()) << "stage " << stage << " round " << round;
      ASSERT_OK_AND_ASSIGN(const StageStepResult after, used->finish());
      EXPECT_EQ(hidden, fresh_hidden) << "stage " << stage << " round " << round;
      EXPECT_EQ(after.loss, expected.loss) << "stage " << stage << " round " << round;
      EXPECT_EQ(after.task_loss, expected.task_loss);
      EXPECT_EQ(after.consistency_loss, expected.consistency_loss);
      EXPECT_EQ(copy_grads(*used, after), expected_grads) << "stage " << stage << " round " << round;
    }
  }
}

TEST_F(StageProgramTest, AbandonEndsTheMethodWithoutItsPhaseTwo) {
  // The gradients are phase 2's last outputs. Fill their (planned, fixed)
  // memory with NaN, run a step and abandon it: no gradient may then hold the
  // value a whole step on that batch computes (phase-1 activations may reuse
  // that memory, but cannot reproduce the exact gradients).
  auto reference = load(1);
  auto p = load(1);
  ASSERT_TRUE(reference && p);
  perturb_lora_b(reference.get());
  perturb_lora_b(p.get());
  const Batch batch(*p, 4);
  StageStepResult whole;
  ASSERT_OK_AND_ASSIGN(whole, reference->run(batch.inputs()));
  const auto final_grads = copy_grads(*reference, whole);
  StageStepResult buffers;
  ASSERT_OK_AND_ASSIGN(buffers, p->run(Batch(*p, 3).inputs()));
  for (size_t i = 0; i < buffers.gradients.size(); ++i) {
    float* g = const_cast<float*>(buffers.gradients[i]);
    std::fill(g, g + p->parameters()[i].numel(), std::nanf(""));
  }
  std::vector<float> hidden;
  ASSERT_TRUE(p->begin(batch.inputs(), &hidden).ok());
  ASSERT_TRUE(p->abandon().ok());
  const auto after = copy_grads(*p, buffers);
  for (size_t i = 0; i < after.size(); ++i) {
    EXPECT_NE(after[i], final_grads[i]) << "phase 2 ran: the gradient of " << p->parameters()[i].name
                                        << " was computed";
  }
}

TEST_F(StageProgramTest, AbandonNeedsABegin) {
  auto p = load(1);
  ASSERT_TRUE(p);
  zl::Status status = p->abandon();
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("begin"), std::string::npos) << status.message();
  std::vector<float> hidden;
  ASSERT_TRUE(p->begin(Batch(*p, 1).inputs(), &hidden).ok());
  ASSERT_TRUE(p->abandon().ok());
  EXPECT_FALSE(p->abandon().ok()) << "a second abandon() of the same step";
  EXPECT_FALSE(p->finish().ok()) << "finish() after abandon()";
}

TEST_F(StageProgramTest, LastStageAbandonDropsTheStagedInputs) {
  auto p = load(2);
  ASSERT_TRUE(p);
  const Batch batch(*p, 6);
  ASSERT_OK_AND_ASSIGN(const StageStepResult plain, p->run(batch.inputs()));
  std::vector<float> hidden;
  ASSERT_TRUE(p->begin(Batch(*p, 9).inputs(), &hidden).ok());
  ASSERT_TRUE(p->abandon().ok());
  ASSERT_TRUE(p->begin(batch.inputs(), &hidden).ok());
  ASSERT_OK_AND_ASSIGN(const StageStepResult two_phase, p->finish());
  EXPECT_EQ(two_phase.loss, plain.loss);
}

TEST_F(StageProgramTest, RejectsAManifestOfAnotherExport) {
  zl_test::TempDir tmp;
  zl_test::write_text(tmp.file("manifest.json"),
                      R"({"stages": [{"index": 0, "file": "stage_0.pte", "layers": [0, 1],)"
                      R"( "outputs": [{"name": "hidden"}], "parameters": []}]})");
  StageProgramOptions options;
  options.program_path = export_dir() + "/stage_0.pte";
  options.manifest_path = tmp.file("manifest.json");
  zl::Status status = StageProgram::load(options).status();
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("manifest"), std::string::npos) << status.message();
  options.manifest_path = tmp.file("missing.json");
  status = StageProgram::load(options).status();
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("missing.json"), std::string::npos) << status.message();
}

/// Loads stage `stage` mapped (map_file) or read into heap memory.
std::unique_ptr<StageProgram> load_mode(int stage, bool map_file) {
  StageProgramOptions options;
  options.program_path = export_dir() + "/stage_" + std::to_string(stage) + ".pte";
  options.map_file = map_file;
  return zl::testing::value_or_fail(StageProgram::load(options));
}

TEST_F(StageProgramTest, MappedProgramTrainsBitIdenticallyToAHeapLoadedOne) {
  for (int stage : {0, 2}) {
    auto mapped = load_mode(stage, true);
    auto heap = load_mode(stage, false);
    ASSERT_TRUE(mapped && heap);
    perturb_lora_b(mapped.get());
    perturb_lora_b(heap.get());
    double first_loss = 0;
    for (int step = 0; step < 3; ++step) {
      Batch batch(*mapped, step);
      StageStepResult a, b;
      ASSERT_OK_AND_ASSIGN(a, mapped->run(batch.inputs()));
      ASSERT_OK_AND_ASSIGN(b, heap->run(batch.inputs()));
      EXPECT_EQ(a.loss, b.loss) << "stage " << stage << " step " << step;
      const auto ga = copy_grads(*mapped, a), gb = copy_grads(*heap, b);
      ASSERT_EQ(ga.size(), gb.size());
      for (size_t i = 0; i < ga.size(); ++i) EXPECT_EQ(ga[i], gb[i]) << mapped->parameters()[i].name;
      // An SGD step written through the parameters, as AdamW writes them: the
      // mapped program's LoRA weights must be writable and read back.
      for (size_t i = 0; i < ga.size(); ++i) {
        float* pa = mapped->parameters()[i].data;
        float* pb = heap->parameters()[i].data;
        for (size_t j = 0; j < ga[i].size(); ++j) {
          pa[j] -= 0.5f * ga[i][j];
          pb[j] -= 0.5f * gb[i][j];
        }
      }
      if (step == 0) first_loss = a.loss;
    }
    Batch batch(*mapped, 0);
    StageStepResult again;
    ASSERT_OK_AND_ASSIGN(again, mapped->run(batch.inputs()));
    EXPECT_NE(again.loss, first_loss) << "the updates did not reach the mapped program";
  }
}

TEST_F(StageProgramTest, RefusesATruncatedProgramInEitherLoadMode) {
  zl_test::TempDir tmp;
  std::ifstream in(export_dir() + "/stage_0.pte", std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GT(bytes.size(), 1000u);
  zl_test::write_text(tmp.file("stage_0.pte"), bytes.substr(0, bytes.size() - 512));
  for (bool map_file : {true, false}) {
    StageProgramOptions options;
    options.program_path = tmp.file("stage_0.pte");
    options.manifest_path = export_dir() + "/manifest.json";
    options.map_file = map_file;
    const zl::Status status = StageProgram::load(options).status();
    ASSERT_FALSE(status.ok()) << "map_file " << map_file;
    EXPECT_NE(status.message().find("truncated"), std::string::npos) << status.message();
    EXPECT_NE(status.message().find(options.program_path), std::string::npos) << status.message();
  }
}

}  // namespace
