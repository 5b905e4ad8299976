#include "zl/stage_session.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <thread>

#include "zl/durable_file.h"
#include "zl/log.h"
#include "zl/telemetry.h"

namespace zl {
namespace {

using nlohmann::json;

json index_or_null(int64_t value) { return value >= 0 ? json(value) : json(nullptr); }

/// The run folder named by the config text: its `base_dir`, which must be an
/// absolute path (the app passes config text, so there is no file to be
/// relative to).
Result<std::string> run_dir_of(const std::string& config_json) {
  const json root = json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return Status(StatusCode::kInvalidArgument, "config: not a JSON object");
  }
  const auto it = root.find("base_dir");
  if (it == root.end() || !it->is_string() || it->get<std::string>().empty() ||
      it->get<std::string>()[0] != '/') {
    return Status(StatusCode::kInvalidArgument,
                  "config: field 'base_dir' must be the absolute folder the run uses (where its relative paths "
                  "resolve and runner.pid/.out/.err/.exit go), got " +
                      (it == root.end() ? std::string("nothing") : it->dump()));
  }
  std::string run_dir = it->get<std::string>();
  while (run_dir.size() > 1 && run_dir.back() == '/') run_dir.pop_back();
  return run_dir;
}

Status write_text(const std::string& path, const std::string& text) {
  return write_file_synced(path, text.data(), text.size());
}

}  // namespace

const char* session_state_name(SessionState state) {
  switch (state) {
    case SessionState::kIdle: return "idle";
    case SessionState::kRunning: return "running";
    case SessionState::kStopping: return "stopping";
    case SessionState::kFinished: return "finished";
    case SessionState::kStopped: return "stopped";
    case SessionState::kFailed: return "failed";
  }
  return "unknown";
}

const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid_argument";
    case StatusCode::kNotFound: return "not_found";
    case StatusCode::kIoError: return "io_error";
    case StatusCode::kCorrupt: return "corrupt";
    case StatusCode::kTimeout: return "timeout";
    case StatusCode::kClosed: return "closed";
    case StatusCode::kInternal: return "internal";
    case StatusCode::kUnrecoverable: return "unrecoverable";
  }
  return "unknown";
}

json SessionStatus::to_json() const {
  const StageProgress& p = progress;
  return {{"state", session_state_name(state)},
          {"run_dir", run_dir},
          {"phase", p.phase},
          {"stage", index_or_null(p.stage_index)},
          {"num_stages", p.num_stages},
          {"micro_batches_done", p.micro_batches_done},
          {"num_micro_batches", p.num_micro_batches},
          {"window", index_or_null(p.window)},
          {"committed_window", index_or_null(p.committed_window)},
          {"loss", number_or_null(p.loss)},
          {"pss_mib", number_or_null(p.pss_mib)},
          {"temperature_c", number_or_null(p.temperature_c)},
          {"exit_code", exit_code >= 0 ? json(exit_code) : json(nullptr)},
          {"error", error.ok() ? json(nullptr) : json(error.message())},
          {"error_code", error.ok() ? json(nullptr) : json(status_code_name(error.code()))}};
}

StageSession::~StageSession() {
  stop();
  join();
}

Status StageSession::start(const std::string& config_json) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (status_.state == SessionState::kRunning || status_.state == SessionState::kStopping) {
    return Status(StatusCode::kInternal, "a stage is already running in this process (" + status_.run_dir +
                                             "); stop it before starting another");
  }
  ZL_ASSIGN_OR_RETURN(const std::string run_dir, run_dir_of(config_json));
  lock.unlock();
  join();  // the previous run's thread has ended (its state says so); reap it
  lock.lock();
  ZL_RETURN_IF_ERROR(open_run_dir_locked(run_dir));

  status_ = SessionStatus();
  status_.run_dir = run_dir;
  board_.update([](StageProgress* p) { *p = StageProgress(); });
  stop_requested_.store(false);
  set_output_mirror(out_, err_);

  Result<RunnerConfig> parsed = parse_runner_config(config_json, "");
  if (!parsed.ok()) {
    // What zl_runner does with a bad config: say why, exit 2.
    const Status status = parsed.status();
    log(LogLevel::kError, "%s", status.message().c_str());
    lock.unlock();
    finish(status, 2);
    return status;
  }
  config_ = std::move(parsed).value();
  log(LogLevel::kInfo, "app: stage %lld of %lld in %s%s", static_cast<long long>(config_.stage_index),
      static_cast<long long>(config_.num_stages), run_dir.c_str(), config_.resume ? " (resume)" : "");
  return start_thread_locked(lock);
}

Status StageSession::open_run_dir_locked(const std::string& run_dir) {
  ZL_RETURN_IF_ERROR_WITH_PREFIX(make_directories(run_dir), "run folder " + run_dir + ": ");
  const std::string exit_path = run_dir + "/" + kRunnerExitFile;
  if (::unlink(exit_path.c_str()) != 0 && errno != ENOENT) {
    return Status(StatusCode::kIoError, "cannot remove the old " + exit_path + ": " + std::strerror(errno));
  }
  out_ = std::fopen((run_dir + "/" + kRunnerOutFile).c_str(), "a");
  err_ = std::fopen((run_dir + "/" + kRunnerErrFile).c_str(), "a");
  const Status status = write_text(run_dir + "/" + kRunnerPidFile, std::to_string(::getpid()) + "\n");
  if (out_ == nullptr || err_ == nullptr || !status.ok()) {
    const std::string why = status.ok() ? std::strerror(errno) : status.message();
    if (out_ != nullptr) std::fclose(out_);
    if (err_ != nullptr) std::fclose(err_);
    out_ = err_ = nullptr;
    return Status(StatusCode::kIoError, "run folder " + run_dir + " is not writable: " + why);
  }
  return Status();
}

Status StageSession::start_thread_locked(std::unique_lock<std::mutex>& lock) {
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, stack_bytes_);
  status_.state = SessionState::kRunning;
  const int rc = pthread_create(&thread_, &attr, &StageSession::thread_main, this);
  pthread_attr_destroy(&attr);
  if (rc != 0) {
    const Status status(StatusCode::kInternal, std::string("cannot start the stage thread: ") + std::strerror(rc));
    log(LogLevel::kError, "%s", status.message().c_str());
    lock.unlock();
    finish(status, 1);
    return status;
  }
  joinable_ = true;
  return Status();
}

void* StageSession::thread_main(void* self) {
  static_cast<StageSession*>(self)->run();
  return nullptr;
}

void StageSession::run() {
  const Status status = run_stage(config_, &stop_requested_, &board_);
  const int code = stage_exit_code(status, stop_requested_.load());
  if (code == 3) {
    log(LogLevel::kWarn, "stage %lld stopped: %s", static_cast<long long>(config_.stage_index),
        status.message().c_str());
  } else if (code != 0) {
    log(LogLevel::kError, "stage %lld failed: %s", static_cast<long long>(config_.stage_index),
        status.message().c_str());
  }
  finish(status, code);
}

void StageSession::finish(const Status& status, int exit_code) {
  std::lock_guard<std::mutex> lock(mutex_);
  // runner.exit comes last: once the host sees it, runner.err is complete.
  set_output_mirror(nullptr, nullptr);
  std::fclose(out_);
  std::fclose(err_);
  out_ = err_ = nullptr;
  const Status written = write_text(status_.run_dir + "/" + kRunnerExitFile, std::to_string(exit_code) + "\n");
  if (!written.ok()) log(LogLevel::kError, "cannot record the exit status: %s", written.message().c_str());
  status_.exit_code = exit_code;
  status_.error = status;
  status_.state = exit_code == 0   ? SessionState::kFinished
                  : exit_code == 3 ? SessionState::kStopped
                                   : SessionState::kFailed;
}

bool StageSession::stop() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (status_.state != SessionState::kRunning && status_.state != SessionState::kStopping) return false;
  stop_requested_.store(true);
  status_.state = SessionState::kStopping;
  return true;
}

bool StageSession::running() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return status_.state == SessionState::kRunning || status_.state == SessionState::kStopping;
}

SessionStatus StageSession::status() const {
  SessionStatus snapshot;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    snapshot = status_;
  }
  snapshot.progress = board_.get();
  return snapshot;
}

bool StageSession::wait(std::chrono::milliseconds timeout) const {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (running()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

void StageSession::join() {
  pthread_t thread;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!joinable_) return;
    joinable_ = false;
    thread = thread_;
  }
  pthread_join(thread, nullptr);
}

}  // namespace zl
