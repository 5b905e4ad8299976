// A stage run inside a long-lived process (the Android app): one run at a
// time, on a thread of its own, with a status that a UI can poll and the same
// files in the run folder that the orchestrator reads for the bare
// `zl_runner` (zl_device/devices/backend.py):
//
//   runner.pid    this process's pid, written when a run starts
//   runner.out    event lines ({"event": "listening", ...}), appended
//   runner.err    log lines, appended
//   runner.exit   the exit status once the run ended: 0 done, 1 failed,
//                 2 bad config, 3 stopped (as zl_runner); never written when
//                 the process is killed, which is how the host tells a crash
//
// The run folder is the config's `base_dir`, which must be absolute (the app
// sets it to the folder of the config file it was given).
//
// The JNI bridge (jni/zl_jni.cpp) is a thin translation of this class, so
// everything but the Java types is tested on the host (stage_session_test).
#pragma once

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <string>

#include <nlohmann/json.hpp>

#include "zl/runner.h"
#include "zl/runner_config.h"
#include "zl/status.h"

namespace zl {

/// File names in the run folder (shared with zl_device/devices/backend.py).
constexpr const char* kRunnerPidFile = "runner.pid";
constexpr const char* kRunnerOutFile = "runner.out";
constexpr const char* kRunnerErrFile = "runner.err";
constexpr const char* kRunnerExitFile = "runner.exit";

enum class SessionState { kIdle, kRunning, kStopping, kFinished, kStopped, kFailed };

/// "idle", "running", "stopping", "finished", "stopped", "failed".
const char* session_state_name(SessionState state);

/// A snapshot of the session: the last (or current) run.
struct SessionStatus {
  SessionState state = SessionState::kIdle;
  std::string run_dir;    ///< the run folder; empty before the first run
  StageProgress progress;
  int exit_code = -1;     ///< once ended: 0 done, 1 failed, 2 bad config, 3 stopped; -1 before
  Status error;           ///< why a run failed or stopped (ok otherwise)

  /// {"state", "run_dir", "stage", "num_stages", "micro_batches_done",
  ///  "num_micro_batches", "window", "committed_window", "loss", "pss_mib",
  ///  "temperature_c", "phase", "exit_code", "error", "error_code"}; unknown
  ///  numbers are null (never a made-up value).
  nlohmann::json to_json() const;
};

/// Lower-case name of a status code ("invalid_argument", ...), as the app
/// shows it and NativeRunnerException.code carries it.
const char* status_code_name(StatusCode code);

class StageSession {
 public:
  /// ExecuTorch runs the whole program on the run's thread; 16 MiB leaves
  /// room for kernels' stack use beyond a default thread stack.
  static constexpr size_t kDefaultStackBytes = size_t{16} << 20;

  explicit StageSession(size_t stack_bytes = kDefaultStackBytes) : stack_bytes_(stack_bytes) {}
  /// Stops a run in progress and waits for it.
  ~StageSession();

  StageSession(const StageSession&) = delete;
  StageSession& operator=(const StageSession&) = delete;

  /// Starts a run of the stage described by `config_json` (the zl_runner
  /// config with an absolute `base_dir`; its "resume" field decides whether
  /// the latest checkpoint is restored).
  ///
  /// Returns once the run's thread is started, or with an error:
  ///  - kInternal "already running": a run is in progress (nothing touched);
  ///  - kInvalidArgument: not JSON, or no absolute `base_dir` (nothing
  ///    written: there is no run folder to write to);
  ///  - kIoError: the run folder cannot be written;
  ///  - kInvalidArgument naming the field: the config is invalid; the run
  ///    folder then holds runner.pid, the message in runner.err and
  ///    runner.exit 2, as zl_runner would leave it.
  Status start(const std::string& config_json);

  /// Asks the run to stop at its next check (between micro-batches and
  /// while waiting); it then ends with exit status 3. Returns whether a run
  /// was in progress.
  bool stop();

  /// Whether a run is in progress (started and not yet ended).
  bool running() const;

  SessionStatus status() const;

  /// Waits until no run is in progress; false on timeout.
  bool wait(std::chrono::milliseconds timeout) const;

 private:
  // start()'s steps; the caller holds mutex_ (`lock`, which a failed
  // thread start releases to report the failure).
  Status open_run_dir_locked(const std::string& run_dir);
  Status start_thread_locked(std::unique_lock<std::mutex>& lock);
  static void* thread_main(void* self);
  void run();
  void finish(const Status& status, int exit_code);
  void join();

  const size_t stack_bytes_;
  mutable std::mutex mutex_;
  SessionStatus status_;       // guarded by mutex_, except progress (the board)
  ProgressBoard board_;
  std::atomic<bool> stop_requested_{false};
  RunnerConfig config_;        // the run's; written before the thread starts
  std::FILE* out_ = nullptr;   // runner.out / runner.err of the current run
  std::FILE* err_ = nullptr;
  pthread_t thread_{};
  bool joinable_ = false;      // guarded by mutex_
};

}  // namespace zl
