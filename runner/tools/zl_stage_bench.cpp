// zl_stage_bench: train one stage program for a few steps, alone, and print
// each step's time and loss as JSON lines; tools/bench_memory.py runs it and
// reads the process's PSS from /proc/<pid>/smaps_rollup meanwhile.
//
//   zl_stage_bench --program DIR/stage_0.pte [--load-mode mmap|file] [--steps 4] [--threads 1]
//
// Each step runs the whole method (forward, readout, loss, backward) on fixed
// inputs (zl_step_check's: tokens (i*37 + 11) % 250, or a hidden state of
// moderate values on later stages) and then writes an SGD update through the
// LoRA parameters, as AdamW does, so the written pages are the runner's.
// Stdout: {"event":"loaded","load_ms":..} then {"event":"step","step":i,"ms":..,"loss":..}.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tool_args.h"
#include "zl/stage_program.h"

namespace {

constexpr const char* kUsage =
    "usage: zl_stage_bench --program STAGE.pte [--load-mode mmap|file] [--steps N] [--threads T]\n"
    "Trains one stage program for N steps on fixed inputs; prints step times as JSON lines.\n";

int fail(const std::string& message) {
  std::fprintf(stderr, "zl_stage_bench: %s\n", message.c_str());
  return 1;
}

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> args;
  if (const int code = zl::parse_tool_args(argc, argv, "zl_stage_bench", kUsage, {"program"}, &args); code >= 0) {
    return code;
  }
  const std::string mode = args.count("load-mode") ? args["load-mode"] : "mmap";
  if (mode != "mmap" && mode != "file") return fail("--load-mode '" + mode + "': expected mmap or file");
  const int steps = args.count("steps") ? std::stoi(args["steps"]) : 4;
  zl::StageProgramOptions options;
  options.program_path = args["program"];
  options.threads = args.count("threads") ? std::stoll(args["threads"]) : 1;
  options.map_file = mode == "mmap";
  const auto load_start = std::chrono::steady_clock::now();
  zl::Result<std::unique_ptr<zl::StageProgram>> loaded = zl::StageProgram::load(options);
  if (!loaded.ok()) return fail(loaded.status().message());
  const std::unique_ptr<zl::StageProgram> program = std::move(loaded).value();
  std::printf("{\"event\": \"loaded\", \"load_ms\": %.1f}\n", ms_since(load_start));
  std::fflush(stdout);

  const int64_t bs = program->batch() * program->seq_len();  // B*S
auto [ids, mask, labels] = zl::fixed_tokens(bs, program->seq_len());
  std::vector<float> hidden(static_cast<size_t>(bs * program->hidden_size()));
  for (size_t i = 0; i < hidden.size(); ++i) hidden[i] = 0.5f * std::sin(0.37f * static_cast<float>(i));
  zl::StageInputs inputs;
  inputs.input_ids = ids.data();
  inputs.hidden = hidden.data();
  inputs.attention_mask = mask.data();
  inputs.labels = labels.data();

  for (int step = 0; step < steps; ++step) {
    const auto start = std::chrono::steady_clock::now();
    const zl::Result<zl::StageStepResult> step_result = program->run(inputs);
    if (!step_result.ok()) return fail(step_result.status().message());
    const zl::StageStepResult& result = *step_result;
    for (size_t i = 0; i < program->parameters().size(); ++i) {
      const zl::TrainableParam& param = program->parameters()[i];
      for (size_t j = 0; j < param.numel(); ++j) param.data[j] -= 1e-3f * result.gradients[i][j];
    }
    std::printf("{\"event\": \"step\", \"step\": %d, \"ms\": %.1f, \"loss\": %.9g}\n", step, ms_since(start),
                result.loss);
    std::fflush(stdout);
  }
  return 0;
}
