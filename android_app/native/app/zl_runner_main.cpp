// zl_runner: one pipeline stage as a process (docs/design.md §4).
//
//   zl_runner --config stage1.json            run (resuming if the config says so, the default)
//   zl_runner --config stage1.json --resume   restore the latest checkpoint even if "resume": false
//   zl_runner --help                          usage and every config field
//
// Stdout gets JSON event lines ({"event": "listening", "port": ...},
// {"event": "done", ...}); diagnostics go to stderr; telemetry to the
// config's log_path. Exit status: 0 done, 1 failed, 2 bad usage or config,
// 3 stopped by SIGINT/SIGTERM (resume later with --resume).
#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>

#include "zl/log.h"
#include "zl/runner.h"
#include "zl/runner_config.h"

namespace {

std::atomic<bool> g_stop{false};

extern "C" void on_signal(int) { g_stop.store(true); }

constexpr const char* kUsage =
    "usage: zl_runner --config FILE [--resume] [--verbose]\n"
    "       zl_runner --help\n"
    "\n"
    "Runs one stage of a zl pipeline: reads its input (stage 0: the data shard; later\n"
    "stages: hidden states from upstream), trains the stage's LoRA parameters with its\n"
    "local loss, forwards hidden states downstream and checkpoints every window.\n"
    "\n"
    "  --config FILE  the stage's JSON config (fields below)\n"
    "  --resume       restore the latest checkpoint in checkpoint_dir and replay after it\n"
    "                 (also the default unless the config sets \"resume\": false)\n"
    "  --verbose      debug logging\n"
    "\n"
    "Example:\n"
    "  zl_runner --config runs/demo/stage1.json --resume\n"
    "\n";

}  // namespace

int main(int argc, char** argv) {
  std::string config_path;
  bool resume = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      std::fputs(zl::runner_config_help().c_str(), stdout);
      return 0;
    } else if (arg == "--config" && i + 1 < argc) {
      config_path = argv[++i];
    } else if (arg.rfind("--config=", 0) == 0) {
      config_path = arg.substr(std::strlen("--config="));
    } else if (arg == "--resume") {
      resume = true;
    } else if (arg == "--verbose") {
      zl::set_log_level(zl::LogLevel::kDebug);
    } else {
      std::fprintf(stderr, "zl_runner: unknown argument '%s'\n%s", arg.c_str(), kUsage);
      return 2;
    }
  }
  if (config_path.empty()) {
    std::fprintf(stderr, "zl_runner: --config FILE is required\n%s", kUsage);
    return 2;
  }
  zl::RunnerConfig config;
  zl::Status status = zl::load_runner_config(config_path, &config);
  if (!status.ok()) {
    std::fprintf(stderr, "zl_runner: %s\n", status.message().c_str());
    return 2;
  }
  if (resume) config.resume = true;

  struct sigaction action;
  std::memset(&action, 0, sizeof(action));
  action.sa_handler = on_signal;
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  std::signal(SIGPIPE, SIG_IGN);

  status = zl::run_stage(config, &g_stop);
  const int code = zl::stage_exit_code(status, g_stop.load());
  if (code == 3) {
    zl::log(zl::LogLevel::kWarn, "stage %lld stopped: %s", static_cast<long long>(config.stage_index),
            status.message().c_str());
  } else if (code != 0) {
    std::fprintf(stderr, "zl_runner: stage %lld failed: %s\n", static_cast<long long>(config.stage_index),
                 status.message().c_str());
  }
  return code;
}
