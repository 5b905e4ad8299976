// zl_step_check: one training step through every stage of an export, in
// pipeline order, with the runner's StageProgram (two phases: begin() until
// the marker, finish() for readout, loss and backward), and every number it
// produced written to one safetensors file. tools/check_arm64.sh runs it built
// for x86 and, under qemu, built for aarch64, and compares the two files.
//
//   zl_step_check --export-dir DIR --out step.safetensors [--threads 1]
//
// Inputs are deterministic and need no data shard: tokens (i*37 + 11) % 250,
// the last 3 positions padded, labels ignored on the first 2 positions and on
// padding; lora_B set to 0.01*cos(0.7 i) (with PEFT's B = 0 every lora_A
// gradient is exactly 0 and would compare equal whatever the arithmetic).
// Stage k > 0 gets stage k-1's hidden state, as in the pipeline. One ExecuTorch
// thread by default; --threads N splits the kernels' work over N, which must
// give the same numbers (zl's GEMM panels are cut alike for any count,
// docs/design#kernels; build_phone_runner.sh compares 1 and 4 under qemu).
//
// Output tensors, for each stage k:
//   "stage<k>.loss", "stage<k>.task_loss", "stage<k>.consistency_loss"  F64 []
//   "stage<k>.hidden"        F32 (B, S, D), absent on the last stage
//   "stage<k>.grad.<name>"   F32, the gradient of LoRA parameter <name> (PEFT)
// The losses also go to stdout, one line per stage.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tool_args.h"
#include "zl/safetensors.h"
#include "zl/stage_program.h"

namespace {

constexpr const char* kUsage =
    "usage: zl_step_check --export-dir DIR --out STEP.safetensors [--threads N]\n"
    "Runs one step of every stage_<k>.pte in DIR in pipeline order on fixed inputs\n"
    "and writes losses, hidden states and LoRA gradients. See zl_step_check.cpp.\n";

int fail(const std::string& message) {
  std::fprintf(stderr, "zl_step_check: %s\n", message.c_str());
  return 1;
}

/// What one stage produced, owned (the program's gradient buffers are reused
/// by its next execution).
struct StageNumbers {
  double loss = 0, task_loss = 0, consistency_loss = 0;
  std::vector<float> hidden;  // (B, S, D), empty on the last stage
  std::vector<int64_t> hidden_shape;
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<std::vector<float>> grads;
};

zl::Status invalid(const std::string& message) { return zl::Status(zl::StatusCode::kInvalidArgument, message); }

/// One step of stage `k` (program `path`) on the fixed inputs, with
/// `upstream_hidden` (stage k-1's hidden state) for k > 0.
zl::Result<StageNumbers> step_stage(const std::string& path, int k, const std::vector<float>& upstream_hidden,
                                    int64_t threads) {
  zl::StageProgramOptions options;
  options.program_path = path;
  options.threads = threads;
  ZL_ASSIGN_OR_RETURN(const std::unique_ptr<zl::StageProgram> program, zl::StageProgram::load(options));
  if (program->stage_index() != k) return invalid(path + ": manifest says stage " + std::to_string(program->stage_index()));

  const int64_t bs = program->batch() * program->seq_len();  // B*S
  auto [ids, mask, labels] = zl::fixed_tokens(bs, program->seq_len());
  if (k > 0 && upstream_hidden.size() != static_cast<size_t>(bs * program->hidden_size())) {
    return invalid(path + ": stage " + std::to_string(k - 1) + " sent " + std::to_string(upstream_hidden.size()) +
                   " hidden values, this stage takes " + std::to_string(bs * program->hidden_size()));
  }
  for (const zl::TrainableParam& param : program->parameters()) {
    if (param.name.find("lora_B") == std::string::npos) continue;
    for (size_t i = 0; i < param.numel(); ++i) param.data[i] = 0.01f * std::cos(0.7f * i);
  }

  zl::StageInputs inputs;
  inputs.input_ids = ids.data();
  inputs.hidden = k > 0 ? upstream_hidden.data() : nullptr;
  inputs.attention_mask = mask.data();
  inputs.labels = labels.data();
  StageNumbers numbers;
  ZL_RETURN_IF_ERROR(program->begin(inputs, &numbers.hidden));
  ZL_ASSIGN_OR_RETURN(const zl::StageStepResult result, program->finish());
  numbers.hidden_shape = {program->batch(), program->seq_len(), program->hidden_size()};
  numbers.loss = result.loss;
  numbers.task_loss = result.task_loss;
  numbers.consistency_loss = result.consistency_loss;
  for (size_t i = 0; i < program->parameters().size(); ++i) {
    const zl::TrainableParam& param = program->parameters()[i];
    numbers.names.push_back(param.name);
    numbers.shapes.push_back(param.shape);
    numbers.grads.emplace_back(result.gradients[i], result.gradients[i] + param.numel());
  }
  return numbers;
}

/// Every stage's numbers under the names in the file comment.
zl::Status write_numbers(const std::string& path, const std::vector<StageNumbers>& stages) {
  std::vector<zl::SafetensorsTensorRef> tensors;
  for (size_t k = 0; k < stages.size(); ++k) {
    const StageNumbers& s = stages[k];
    const std::string prefix = "stage" + std::to_string(k) + ".";
    tensors.push_back({prefix + "loss", zl::SafetensorsDtype::kF64, {}, &s.loss});
    tensors.push_back({prefix + "task_loss", zl::SafetensorsDtype::kF64, {}, &s.task_loss});
    tensors.push_back({prefix + "consistency_loss", zl::SafetensorsDtype::kF64, {}, &s.consistency_loss});
    if (!s.hidden.empty()) {
      tensors.push_back({prefix + "hidden", zl::SafetensorsDtype::kF32, s.hidden_shape, s.hidden.data()});
    }
    for (size_t i = 0; i < s.names.size(); ++i) {
      tensors.push_back({prefix + "grad." + s.names[i], zl::SafetensorsDtype::kF32, s.shapes[i], s.grads[i].data()});
    }
  }
  return zl::write_safetensors(path, tensors);
}

bool file_exists(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return false;
  std::fclose(f);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> args;
  if (const int exit_code = zl::parse_tool_args(argc, argv, "zl_step_check", kUsage, {"export-dir", "out"}, &args); exit_code >= 0) {
    return exit_code;
  }
  int64_t threads = 1;
  if (args.count("threads")) {
    char* end = nullptr;
    threads = std::strtoll(args["threads"].c_str(), &end, 10);
    if (end == args["threads"].c_str() || *end != '\0' || threads < 1) {
      return fail("--threads '" + args["threads"] + "': a thread count of at least 1, e.g. --threads 4");
    }
  }

  std::vector<StageNumbers> stages;
  std::vector<float> upstream_hidden;
  for (int k = 0;; ++k) {
    const std::string path = args["export-dir"] + "/stage_" + std::to_string(k) + ".pte";
    if (!file_exists(path)) {
      if (k == 0) return fail("no stage_0.pte in '" + args["export-dir"] + "'; run `zl export` first");
      break;
    }
    zl::Result<StageNumbers> numbers = step_stage(path, k, upstream_hidden, threads);
    if (!numbers.ok()) return fail(numbers.status().message());
    std::printf("stage %d: loss %.9g task_loss %.9g consistency_loss %.9g (%zu gradients)\n", k, numbers->loss,
                numbers->task_loss, numbers->consistency_loss, numbers->grads.size());
    upstream_hidden = numbers->hidden;
    stages.push_back(std::move(numbers).value());
  }
  const zl::Status status = write_numbers(args["out"], stages);
  if (!status.ok()) return fail(status.message());
  return 0;
}
