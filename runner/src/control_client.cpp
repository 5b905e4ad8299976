#include "zl/control_client.h"

#include <unistd.h>

#include <algorithm>

#include <nlohmann/json.hpp>

#include "zl/host_port.h"
#include "zl/log.h"

namespace zl {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using nlohmann::json;

/// The coordinator shows ERROR reasons in logs and reports; a runaway message
/// must not make a frame that cannot be encoded.
constexpr size_t kMaxReasonChars = 4000;

/// How often the I/O thread looks at ControlClientOptions::chain_stop.
constexpr milliseconds kChainStopPoll{50};

int64_t now_unix_ms() {
  return std::chrono::duration_cast<milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

json optional_json(const std::optional<double>& v) { return v ? json(*v) : json(nullptr); }

/// Never throws: invalid UTF-8 (e.g. in an error reason) becomes U+FFFD, NaN becomes null.
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

/// What the client accepts: frames of its run from the coordinator.
FrameExpectation control_expectation(const ControlClientOptions& options) {
  FrameExpectation expect;
  expect.run_id = options.run_id;
  expect.stage = kCoordinatorStage;
  expect.max_frame_bytes = options.max_frame_bytes;
  return expect;
}

}  // namespace

// ---------------------------------------------------------------- public API

ControlClient::ControlClient(ControlClientOptions options)
    : options_(std::move(options)),
      micro_batches_done_(options_.micro_batches_done),
      link_(link_keys(options_.key, Channel::kControl, options_.stage, LinkEnd::kClient), control_expectation(options_),
            options_.run_id, options_.stage) {}

ControlClient::~ControlClient() { shutdown(); }

Status ControlClient::start() {
  const Result<HostPort> coordinator = parse_host_port(options_.coordinator);
  if (!coordinator.ok()) {
    return Status(StatusCode::kInvalidArgument, "coordinator address \"" + options_.coordinator +
                                                    "\" is not host:port with a port in 1..65535 "
                                                    "(e.g. 192.168.1.10:7100)");
  }
  host_ = coordinator->host;
  port_ = coordinator->port;
  if (options_.heartbeat_ms.count() <= 0) {
    return Status(StatusCode::kInvalidArgument,
                  "heartbeat_ms is " + std::to_string(options_.heartbeat_ms.count()) + "; it must be > 0");
  }
  if (options_.max_queued == 0) {
    return Status(StatusCode::kInvalidArgument, "max_queued is 0; it must be at least 1");
  }
  if (options_.stage == kCoordinatorStage) {
    return Status(StatusCode::kInvalidArgument, "stage 0xFFFFFFFF is reserved for the coordinator");
  }
  if (options_.pid == 0) options_.pid = static_cast<int64_t>(::getpid());
  if (options_.device.empty()) options_.device = describe_device();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (thread_.joinable() || closing_) {
      return Status(StatusCode::kInvalidArgument, "control client already started or shut down");
    }
  }
  ZL_RETURN_IF_ERROR(link_.open());
  std::lock_guard<std::mutex> lock(mutex_);
  thread_ = std::thread([this] { run(); });
  return Status();
}

Status ControlClient::wait_for_start(milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  const ControlPhase before = phase_;
  if (!started_) phase_ = ControlPhase::kWaitingForStart;
  const auto deadline = Clock::now() + timeout;
  auto stopped = [this] {
    return closing_ || stop_.load() || (options_.chain_stop != nullptr && options_.chain_stop->load());
  };
  // Sliced so a chained stop flag is seen even before the I/O thread mirrors it.
  while (!started_ && !stopped() && Clock::now() < deadline) {
    changed_.wait_until(lock, std::min(deadline, Clock::now() + kChainStopPoll));
  }
  if (phase_ == ControlPhase::kWaitingForStart) phase_ = before;
  if (started_) return Status();
  if (stopped()) return Status(StatusCode::kClosed, "stop requested while waiting for START from the coordinator");
  return Status(StatusCode::kTimeout, "no START from the coordinator " + options_.coordinator + " within " +
                                          std::to_string(timeout.count()) + " ms");
}

std::string ControlClient::start_settings() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return start_settings_;
}

void ControlClient::update_progress(int64_t micro_batches_done, int64_t window, ControlPhase phase) {
  std::lock_guard<std::mutex> lock(mutex_);
  micro_batches_done_ = micro_batches_done;
  window_ = window;
  phase_ = phase;
}

void ControlClient::set_phase(ControlPhase phase) {
  std::lock_guard<std::mutex> lock(mutex_);
  phase_ = phase;
}

Status ControlClient::window_committed(const WindowCommittedEvent& event) {
  const json payload = {{"mean_loss", optional_json(event.mean_loss)},
                        {"mean_task_loss", optional_json(event.mean_task_loss)},
                        {"mean_consistency_loss", optional_json(event.mean_consistency_loss)},
                        {"micro_batches_done", event.micro_batches_done},
                        {"checkpoint_ms", optional_json(event.checkpoint_ms)},
                        {"checkpointed", event.checkpoint_ms.has_value()}};
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closing_) return Status(StatusCode::kClosed, "control client is shut down");
    if (event.window < 0) {
      return Status(StatusCode::kInvalidArgument, "window " + std::to_string(event.window) + " is negative");
    }
    Frame f = control_frame_locked(FrameType::kWindowCommitted, static_cast<uint64_t>(event.window), dump(payload));
    f.micro_batch = static_cast<uint64_t>(std::max<int64_t>(0, event.micro_batches_done));
    enqueue_locked(std::move(f));
  }
  link_.wake();
  return Status();
}

Status ControlClient::error(const std::string& reason) {
  const std::string text =
      reason.size() > kMaxReasonChars ? reason.substr(0, kMaxReasonChars) + "..." : reason;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closing_) return Status(StatusCode::kClosed, "control client is shut down");
    enqueue_locked(control_frame_locked(FrameType::kError, window_.value_or(0), dump(json{{"reason", text}})));
  }
  link_.wake();
  return Status();
}

void ControlClient::shutdown() {
  std::lock_guard<std::mutex> serial(shutdown_mutex_);
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!closing_) {
      closing_ = true;
      close_deadline_ = Clock::now() + options_.flush_timeout;
    }
    changed_.notify_all();  // releases wait_for_start()
    if (!thread_.joinable()) return;
  }
  link_.wake();
  {
    std::unique_lock<std::mutex> lock(mutex_);
    // The I/O thread leaves by close_deadline_ on its own unless it is stuck
    // in a connect (bounded by connect_timeout) or in send() to a coordinator
    // that stopped reading; shutting the socket down ends the latter.
    const bool done = changed_.wait_until(lock, close_deadline_ + milliseconds(100), [this] { return thread_done_; });
    if (!done) {
      force_exit_ = true;
      link_.shutdown();
    }
  }
  link_.wake();
  thread_.join();
  std::lock_guard<std::mutex> lock(mutex_);
  link_.close();
  connected_ = false;
}

bool ControlClient::connected() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return connected_;
}

ControlClientStats ControlClient::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  ControlClientStats s = stats_;
  s.queued = queue_.size();
  return s;
}

// ---------------------------------------------------------------- frames

Frame ControlClient::control_frame_locked(FrameType type, uint64_t window, std::string payload) const {
  return make_control_frame(type, options_.run_id, options_.stage, window,
                            static_cast<uint64_t>(std::max<int64_t>(0, micro_batches_done_)), std::move(payload));
}

Frame ControlClient::heartbeat_locked(std::optional<double> pss_mib, std::optional<double> temperature_c) const {
  const json payload = {{"micro_batches_done", micro_batches_done_},
                        {"window", window_ ? json(*window_) : json(nullptr)},
                        {"pss_mib", optional_json(pss_mib)},
                        {"temperature_c", optional_json(temperature_c)},
                        {"phase", control_phase_name(phase_)},
                        {"t_unix_ms", now_unix_ms()}};
  return control_frame_locked(FrameType::kHeartbeat, window_.value_or(0), dump(payload));
}

Frame ControlClient::register_locked() const {
  const json payload = {{"stage", options_.stage},
                        {"pid", options_.pid},
                        {"device", options_.device},
                        {"listen", options_.listen.empty() ? json(nullptr) : json(options_.listen)},
                        {"resume", options_.resume},
                        {"micro_batches_done", micro_batches_done_},
                        {"reconnects", stats_.connects}};
  return control_frame_locked(FrameType::kRegister, window_.value_or(0), dump(payload));
}

void ControlClient::enqueue_locked(Frame frame) {
  queue_.push_back(Outgoing{next_seq_++, std::move(frame)});
  // Over the bound: the oldest heartbeat goes first (a newer one says more),
  // then the oldest error; WINDOW_COMMITTED is never dropped, so a queue of
  // only committed events may exceed the bound (one per window at most).
  size_t droppable = 0;
  for (const auto& o : queue_) droppable += o.frame.type != FrameType::kWindowCommitted;
  while (droppable > options_.max_queued) {
    auto victim = std::find_if(queue_.begin(), queue_.end(),
                               [](const Outgoing& o) { return o.frame.type == FrameType::kHeartbeat; });
    if (victim != queue_.end()) {
      ++stats_.heartbeats_dropped;
    } else {
      victim = std::find_if(queue_.begin(), queue_.end(),
                            [](const Outgoing& o) { return o.frame.type == FrameType::kError; });
      if (victim == queue_.end()) break;
      ++stats_.errors_dropped;
      log(LogLevel::kWarn, "control: queue full while the coordinator is unreachable; dropped ERROR %s",
          victim->frame.json.c_str());
    }
    queue_.erase(victim);
    --droppable;
  }
}

// ---------------------------------------------------------------- I/O thread

void ControlClient::mirror_chain_stop() {
  if (options_.chain_stop == nullptr || stop_.load() || !options_.chain_stop->load()) return;
  std::lock_guard<std::mutex> lock(mutex_);
  stop_.store(true);
  changed_.notify_all();
}

Status ControlClient::send_frame(const Frame& frame) {
  // kInvalidArgument: the frame itself is bad
  return link_.send_frame(frame, options_.max_frame_bytes);
}

bool ControlClient::connect_once(milliseconds timeout) {
  Result<Socket> sock = ReconnectingLink::dial(host_, port_, timeout);
  if (!sock.ok()) {
    // One line per outage at info level; every retry only at debug.
    std::lock_guard<std::mutex> lock(mutex_);
    log(unreachable_logged_ ? LogLevel::kDebug : LogLevel::kInfo,
        "control: coordinator %s not reachable (%s); retrying with back-off", options_.coordinator.c_str(),
        sock.status().message().c_str());
    unreachable_logged_ = true;
    return false;
  }
  // The handshake gives the connection a fresh session: the REGISTER below is
  // bound to the coordinator's challenge, so a recorded one cannot be replayed.
  const Result<SessionId> session = link_.handshake(*sock, timeout);
  if (!session.ok()) {
    log(LogLevel::kWarn, "control: coordinator %s: %s", options_.coordinator.c_str(),
        session.status().message().c_str());
    return false;
  }
  std::unique_lock<std::mutex> lock(mutex_);
  if (force_exit_) return false;
  const Frame reg = register_locked();
  link_.adopt(std::move(sock).value(), *session);
  lock.unlock();
  // REGISTER goes first on every connection: a restarted coordinator learns
  // who this is and how far it got before any queued event arrives.
  const Status s = send_frame(reg);
  lock.lock();
  if (!s.ok()) {
    log(LogLevel::kWarn, "control: REGISTER to %s failed: %s", options_.coordinator.c_str(), s.message().c_str());
    link_.close();
    return false;
  }
  connected_ = true;
  unreachable_logged_ = false;
  ++stats_.connects;
  log(LogLevel::kInfo, "control: registered with coordinator %s as stage %u (%zu frames queued)",
      options_.coordinator.c_str(), options_.stage, queue_.size());
  return true;
}

void ControlClient::drop_connection(const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (link_.connected() && !closing_) {
    log(LogLevel::kWarn, "control: connection to coordinator %s lost (%s); reconnecting", options_.coordinator.c_str(),
        why.c_str());
  }
  link_.close();
  connected_ = false;
}

void ControlClient::drain_queue() {
  while (link_.connected()) {
    Outgoing next;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (queue_.empty() || force_exit_) return;
      next = queue_.front();
    }
    const Status s = send_frame(next.frame);
    if (!s.ok() && s.code() != StatusCode::kInvalidArgument) {
      drop_connection(s.message());  // the entry stays queued for the next connection
      return;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    // Another thread may have dropped it from a full queue meanwhile: find it by seq.
    auto it = std::find_if(queue_.begin(), queue_.end(), [&](const Outgoing& o) { return o.seq == next.seq; });
    if (it != queue_.end()) queue_.erase(it);
    if (!s.ok()) {
      log(LogLevel::kError, "control: cannot encode %s frame, dropped: %s",
          frame_type_name(static_cast<uint16_t>(next.frame.type)), s.message().c_str());
    } else if (next.frame.type == FrameType::kHeartbeat) {
      ++stats_.heartbeats_sent;
    } else {
      ++stats_.events_sent;
    }
  }
}

void ControlClient::reject(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++stats_.rejected;
  stats_.last_reject_reason = reason;
  log(LogLevel::kWarn, "control: rejected a frame from the coordinator: %s", reason.c_str());
}

void ControlClient::handle_frame(const Frame& frame) {
  switch (frame.type) {
    case FrameType::kStop: {
      log(LogLevel::kInfo, "control: STOP from the coordinator %s", frame.json.c_str());
      std::lock_guard<std::mutex> lock(mutex_);
      stop_.store(true);
      changed_.notify_all();
      return;
    }
    case FrameType::kStart: {
      log(LogLevel::kInfo, "control: START from the coordinator %s", frame.json.c_str());
      std::lock_guard<std::mutex> lock(mutex_);
      started_ = true;
      start_settings_ = frame.json;
      changed_.notify_all();
      return;
    }
    case FrameType::kError:
      log(LogLevel::kWarn, "control: the coordinator reports an error: %s", frame.json.c_str());
      return;
    default: {
      log(LogLevel::kWarn, "control: ignoring %s frame from the coordinator",
          frame_type_name(static_cast<uint16_t>(frame.type)));
      std::lock_guard<std::mutex> lock(mutex_);
      ++stats_.ignored;
      return;
    }
  }
}

void ControlClient::handle_incoming() {
  const LinkReadResult read = link_.read_frames([this](const DecodeResult& r) {
    // A frame that fails its MAC or ids is skipped; its length was sound, so
    // the stream stays in sync and the connection is kept.
    if (!r.ok()) {
      reject(r.reason);
      return;
    }
    handle_frame(r.frame);
  });
  if (read.broken) {
    // Frame boundaries are lost: only a new connection can re-synchronize.
    reject(std::string(frame_error_name(read.error)) + ": " + read.reason);
    drop_connection("unreadable stream from the coordinator");
    return;
  }
  if (!read.filled.ok()) drop_connection(read.filled.message());
}

bool ControlClient::queue_heartbeat(LoopState* state, bool closing) {
  // Probes read files (smaps_rollup, sysfs): outside the lock, so the
  // training thread's update_progress() never waits on them.
  const bool heartbeat_due = Clock::now() >= state->next_heartbeat;
  std::optional<double> pss, temperature;
  if (heartbeat_due || (closing && !state->final_heartbeat_queued)) {
    pss = read_pss_mib(options_.probe_root);
    temperature = read_temperature_c(options_.probe_root);
  }

  const Clock::time_point now = Clock::now();
  size_t undelivered_events = 0;
  std::lock_guard<std::mutex> lock(mutex_);
  if (closing && !state->final_heartbeat_queued) {
    // Queued heartbeats are stale now; one last one carries the final phase.
    queue_.erase(std::remove_if(queue_.begin(), queue_.end(),
                                [](const Outgoing& o) { return o.frame.type == FrameType::kHeartbeat; }),
                 queue_.end());
    queue_.push_back(Outgoing{next_seq_++, heartbeat_locked(pss, temperature)});
    state->final_heartbeat_queued = true;
  } else if (!closing && heartbeat_due) {
    enqueue_locked(heartbeat_locked(pss, temperature));
    state->next_heartbeat += options_.heartbeat_ms;
    if (state->next_heartbeat <= now) state->next_heartbeat = now + options_.heartbeat_ms;
  }
  for (const auto& o : queue_) undelivered_events += o.frame.type != FrameType::kHeartbeat;
  if (!closing) return false;
  if (force_exit_ || now >= close_deadline_) {
    if (undelivered_events > 0) {
      log(LogLevel::kWarn, "control: shutting down with %zu WINDOW_COMMITTED/ERROR frames not delivered to %s",
          undelivered_events, options_.coordinator.c_str());
    }
    return true;
  }
  // All sent, or only the last heartbeat left and no connection for it.
  return queue_.empty() || (undelivered_events == 0 && !link_.connected());
}

void ControlClient::connect_if_due(LoopState* state, Backoff* backoff, bool closing) {
  const Clock::time_point now = Clock::now();
  if (link_.connected() || now < state->next_connect) return;
  milliseconds timeout = options_.connect_timeout;
  if (closing) {
    timeout = std::min(timeout, std::chrono::duration_cast<milliseconds>(close_deadline_ - now) + milliseconds(1));
  }
  if (connect_once(timeout)) {
    backoff->reset();
  } else {
    state->next_connect = Clock::now() + backoff->next();
  }
}

void ControlClient::wait_for_work(const LoopState& state, bool closing) {
  Clock::time_point wake_at = closing ? close_deadline_ : state.next_heartbeat;
  if (!link_.connected()) wake_at = std::min(wake_at, state.next_connect);
  if (options_.chain_stop != nullptr) wake_at = std::min(wake_at, Clock::now() + kChainStopPoll);
  if (closing) {
    // Re-check the exit conditions at once when the flush has nothing left to wait for.
    std::lock_guard<std::mutex> lock(mutex_);
    const bool events_left = std::any_of(queue_.begin(), queue_.end(), [](const Outgoing& o) {
      return o.frame.type != FrameType::kHeartbeat;
    });
    if (queue_.empty() || (!events_left && !link_.connected())) return;
  }
  const Result<bool> readable = link_.wait_for_input(wake_at);
  if (!readable.ok()) {
    log(LogLevel::kError, "control: %s", readable.status().message().c_str());
    drop_connection(readable.status().message());
    return;
  }
  if (*readable) handle_incoming();
}

void ControlClient::run() {
  Backoff backoff(options_.backoff_initial, options_.backoff_max);
  LoopState state;
  state.next_connect = Clock::now();
  state.next_heartbeat = Clock::now() + options_.heartbeat_ms;
  for (;;) {
    mirror_chain_stop();
    bool closing = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      closing = closing_;
    }
    if (queue_heartbeat(&state, closing)) break;
    connect_if_due(&state, &backoff, closing);
    if (link_.connected()) drain_queue();
    wait_for_work(state, closing);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  link_.close();
  connected_ = false;
  thread_done_ = true;
  changed_.notify_all();
}

}  // namespace zl
