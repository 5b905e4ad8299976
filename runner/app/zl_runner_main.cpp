// zl_runner: one pipeline stage as a process (docs/design#runner).
//
//   zl_runner --config stage1.json            run (resuming if the config says so, the default)
//   zl_runner --config stage1.json --resume   restore the latest checkpoint even if "resume": false
//   zl_runner --config stage1.json --standby  a hot standby: load, then wait for SIGUSR1 to take over
//   zl_runner --help                          usage and every config field
//   zl_runner --config-fields                 the config's field table as JSON (for tools that write configs)
//   zl_runner --version                       zl's and ExecuTorch's versions, the build (static or not), the kernel path
//
// Stdout gets JSON event lines ({"event": "listening", "port": ...},
// {"event": "done", ...}); diagnostics go to stderr; telemetry to the
// config's log_path. Exit status: 0 done, 1 failed, 2 bad usage or config,
// 3 stopped by SIGINT/SIGTERM (resume later with --resume).
#include <pthread.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>

#include "zl/cpu_cores.h"
#include "zl/cpu_features.h"
#include "zl/log.h"
#include "zl/runner.h"
#include "zl/runner_config.h"
#include "zl/thread_pool.h"

#include "zl/executorch_version.h"

// Where the ExecuTorch install has no version header (the pip wheel), CMake's
// package version (or "unknown") stands in.
#if defined(ET_VERSION)
#define ZL_RUNNER_ET_VERSION ET_VERSION
#elif defined(ZL_EXECUTORCH_VERSION)
#define ZL_RUNNER_ET_VERSION ZL_EXECUTORCH_VERSION
#else
#define ZL_RUNNER_ET_VERSION "unknown"
#endif
#ifndef ZL_VERSION
#define ZL_VERSION "unknown"
#endif

namespace {

std::atomic<bool> g_stop{false};

extern "C" void on_signal(int) { g_stop.store(true); }

constexpr const char* kUsage =
    "usage: zl_runner --config FILE [--resume] [--standby] [--verbose]\n"
    "       zl_runner --help | --version | --config-fields\n"
    "\n"
    "Runs one stage of a zl pipeline: reads its input (stage 0: the data shard; later\n"
    "stages: hidden states from upstream), trains the stage's LoRA parameters with its\n"
    "local loss, forwards hidden states downstream and checkpoints every window.\n"
    "\n"
    "  --config FILE  the stage's JSON config (fields below)\n"
    "  --resume       restore the latest checkpoint in checkpoint_dir and replay after it\n"
    "                 (also the default unless the config sets \"resume\": false)\n"
    "  --standby      a hot standby for this stage: map the program, load the method and\n"
    "                 the optimizer, print {\"event\": \"standby\"}, then wait for SIGUSR1 and\n"
    "                 only then take over as with --resume (checkpoint, input log, port);\n"
    "                 SIGINT/SIGTERM end it (exit 3). It never parks (hold_at_micro_batch)\n"
    "  --verbose      debug logging\n"
    "  --config-fields  print the config's fields (path, type, required, default) as JSON\n"
    "\n"
    "Example:\n"
    "  zl_runner --config runs/demo/stage1.json --resume\n"
    "\n";

struct Args {
  std::string config_path;
  bool resume = false;
  bool standby = false;
};

// The command line; an exit code when the process ends here (--help: 0, a
// bad argument: 2).
std::optional<int> parse_args(int argc, char** argv, Args* args) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      std::fputs(zl::runner_config_help().c_str(), stdout);
      return 0;
    } else if (arg == "--config-fields") {
      std::printf("%s\n", zl::runner_config_fields().dump(1).c_str());
      return 0;
    } else if (arg == "--version") {
      // One line a deployer can check on the device (which binary, which
      // runtime, which kernel path this CPU gets and, on arm64, the
      // extensions its hwcaps name; the threads "threads": 0 gives here, 1
      // in a build without ExecuTorch's thread pool).
      const std::string threads = zl::has_thread_pool()
                                      ? std::to_string(zl::device_default_threads())
                                      : std::string("1(no-pool)");
      std::printf("zl_runner %s executorch %s %s %s kernels=%s%s threads=%s\n", ZL_VERSION, ZL_RUNNER_ET_VERSION,
#if defined(__aarch64__)
                  "aarch64",
#elif defined(__x86_64__)
                  "x86_64",
#else
                  "other-arch",
#endif
#ifdef ZL_STATIC_BINARY
                  "static",
#else
                  "dynamic",
#endif
                  zl::kernel_path_name(zl::kernel_path()),
#if defined(__aarch64__)
                  (" cpu=" + zl::cpu_features_str(zl::cpu_features())).c_str(),
#else
                  "",
#endif
                  threads.c_str());
      return 0;
    } else if (arg == "--config" && i + 1 < argc) {
      args->config_path = argv[++i];
    } else if (arg.rfind("--config=", 0) == 0) {
      args->config_path = arg.substr(std::strlen("--config="));
    } else if (arg == "--resume") {
      args->resume = true;
    } else if (arg == "--standby") {
      args->standby = true;
    } else if (arg == "--verbose") {
      zl::set_log_level(zl::LogLevel::kDebug);
    } else {
      std::fprintf(stderr, "zl_runner: unknown argument '%s'\n%s", arg.c_str(), kUsage);
      return 2;
    }
  }
  if (args->config_path.empty()) {
    std::fprintf(stderr, "zl_runner: --config FILE is required\n%s", kUsage);
    return 2;
  }
  return std::nullopt;
}

// A standby's wait for SIGUSR1 (blocked in `takeover_signal`, which must
// outlive the hook), polling the stop flag.
zl::Standby takeover_hook(const sigset_t* takeover_signal) {
  zl::Standby hook;
  hook.wait_for_takeover = [takeover_signal](const std::atomic<bool>* stop) {
    const timespec slice{0, 200 * 1000 * 1000};  // the stop flag is polled this often
    while (stop == nullptr || !stop->load()) {
      if (sigtimedwait(takeover_signal, nullptr, &slice) == SIGUSR1) return zl::Status();
      if (errno != EAGAIN && errno != EINTR) {
        return zl::Status(zl::StatusCode::kIoError, std::string("sigtimedwait: ") + std::strerror(errno));
      }
    }
    return zl::Status(zl::StatusCode::kClosed, "stop requested (standing by)");
  };
  return hook;
}

void install_stop_handlers() {
  struct sigaction action;
  std::memset(&action, 0, sizeof(action));
  action.sa_handler = on_signal;
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  std::signal(SIGPIPE, SIG_IGN);
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  if (const std::optional<int> exit_code = parse_args(argc, argv, &args)) return *exit_code;
  zl::Result<zl::RunnerConfig> loaded = zl::load_runner_config(args.config_path);
  if (!loaded.ok()) {
    std::fprintf(stderr, "zl_runner: %s\n", loaded.status().message().c_str());
    return 2;
  }
  zl::RunnerConfig config = std::move(loaded).value();
  if (args.resume || args.standby) config.resume = true;
  // A standby replaces a stage that failed: failure injection parks a stage
  // once (the coordinator also drops the field before a restart).
  if (args.standby) config.hold_at_micro_batch = -1;

  // The takeover signal stays pending until the standby waits for it: blocked
  // here, before any thread exists, so every thread inherits the mask.
  sigset_t takeover_signal;
  sigemptyset(&takeover_signal);
  sigaddset(&takeover_signal, SIGUSR1);
  if (args.standby) pthread_sigmask(SIG_BLOCK, &takeover_signal, nullptr);
  const zl::Standby standby_hook = takeover_hook(&takeover_signal);
  install_stop_handlers();

  const zl::Status status = zl::run_stage(config, &g_stop, nullptr, args.standby ? &standby_hook : nullptr);
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
