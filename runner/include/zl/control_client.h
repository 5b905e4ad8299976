// The stage's end of the control channel (docs/design#coordinator): one TCP connection
// from a runner to the coordinator, the frames of the data plane (frame.h)
// sealed with this stage's control keys (derived from the run key; one per
// direction). The coordinator's frames carry stage kCoordinatorStage.
//
//   stage --HELLO-->  <--HELLO-- after every (re)connect: a fresh session
//                                (PROTOCOL.md §6) every later frame is bound to
//         --REGISTER-->          first frame of the session, before anything else
//         --HEARTBEAT-->         every heartbeat_ms, also while disconnected (queued)
//         --WINDOW_COMMITTED-->  one per window end, queued, never dropped
//         --ERROR-->             queued
//         <--START--             releases wait_for_start()
//         <--STOP---             sets stop_flag()
//         <--ERROR--             logged
//
// Payloads (JSON; times in ms, memory in MiB, temperature in °C; a value
// that was not measured is null, never a made-up number):
//   REGISTER          header window = current window (0 if none), micro_batch = micro_batches_done
//     {"stage": 1, "pid": 4242, "device": "Google Pixel 7 (Android aarch64)",
//      "listen": "0.0.0.0:7001" | null, "resume": true, "micro_batches_done": 8,
//      "reconnects": 0}             (reconnects: earlier connections of this process)
//   HEARTBEAT         header as REGISTER
//     {"micro_batches_done": 9, "window": 2 | null, "pss_mib": 3512.4 | null,
//      "temperature_c": 36.5 | null, "phase": "running", "t_unix_ms": ...}
//     phase: "starting" | "waiting_for_start" | "running" | "stopped" | "done" | "failed"
//   WINDOW_COMMITTED  header window = the window id, micro_batch = micro_batches_done
//     {"mean_loss": ..., "mean_task_loss": ..., "mean_consistency_loss": ...,
//      "micro_batches_done": 12, "checkpoint_ms": 41.0 | null, "checkpointed": true}
//     (the losses are null for a forward-only stage, docs/design#windows-and-adamw)
//   ERROR             {"reason": "..."}
//
// Delivery: frames queued while the coordinator is unreachable go out, in
// order, after the next REGISTER. The queue holds at most max_queued
// heartbeats and errors (oldest heartbeats are dropped first, then oldest
// errors); WINDOW_COMMITTED events are never dropped. "Sent" means written to
// the socket: the coordinator does not acknowledge control frames, so a
// coordinator that dies with frames in its receive buffer loses them and
// learns the progress again from the next REGISTER.
//
// A coordinator that is not up yet, restarts, or sends bad frames never stops
// training: the client reconnects with exponential back-off in its own
// thread (a ReconnectingLink, as the data plane's Sender), and rejects bad frames with a logged reason (frame_error_name).
//
// How the runner uses it (StageRunner, src/stage_runner.h, has a member
// `std::unique_ptr<ControlClient> control_;`):
//
//   // setup(), at the end (after the Receiver listens, so "listen" has the real port):
//   if (!c.coordinator.empty()) {
//     ZL_ASSIGN_OR_RETURN(ControlClientOptions o, control_options_from_config(c, key_));
//     if (receiver_) { ZL_ASSIGN_OR_RETURN(o.listen, with_port(c.listen, receiver_->port())); }
//     o.resume = restored_window_.has_value();
//     o.micro_batches_done = start_mb_;
//     o.chain_stop = stop_;                  // the caller's flag (JNI stopNative, signals) keeps working
//     control_.reset(new ControlClient(o));
//     ZL_RETURN_IF_ERROR(control_->start()); // returns at once; connects in the background
//     stop_ = control_->stop_flag();         // true on STOP or when the chained flag is set
//     if (c.wait_for_start) {                // (a config field runner_config does not have yet)
//       ZL_RETURN_IF_ERROR(control_->wait_for_start(
//           std::chrono::seconds(c.input_timeout_s > 0 ? c.input_timeout_s : 86400)));
//     }
//     control_->set_phase(ControlPhase::kRunning);
//   }
//
//   // loop(), after each micro-batch (cheap: takes a mutex, no I/O):
//   if (control_) control_->update_progress(mb + 1, window);
//
//   // end_window(), after the checkpoint, for every window (checkpointed or not);
//   // build the WindowRecord outside `if (telemetry_)`:
//   if (control_) (void)control_->window_committed(WindowCommittedEvent::from(record, last_mb + 1));
//
//   // run(): every exit path, setup failures included:
//   Status status = setup();
//   if (status.ok()) status = loop();
//   if (control_) {
//     if (!status.ok() && status.code() != StatusCode::kClosed) (void)control_->error(status.message());
//     control_->set_phase(status.ok() ? ControlPhase::kDone
//                         : status.code() == StatusCode::kClosed ? ControlPhase::kStopped
//                                                                : ControlPhase::kFailed);
//     control_->shutdown();                  // sends queued WINDOW_COMMITTED / ERROR + a last
//   }                                        // heartbeat, for at most flush_timeout
//   shutdown();
//   return status;
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "zl/frame.h"
#include "zl/reconnecting_link.h"
#include "zl/runner_config.h"
#include "zl/status.h"
#include "zl/tcp_socket.h"
#include "zl/telemetry.h"

namespace zl {

/// The `stage` field of every frame the coordinator sends.
constexpr uint32_t kCoordinatorStage = 0xFFFFFFFFu;

/// What the stage is doing, as reported in heartbeats.
enum class ControlPhase : int {
  kStarting = 0,     ///< loading, restoring, connecting links
  kWaitingForStart,  ///< blocked in wait_for_start()
  kRunning,          ///< processing micro-batches
  kStopped,          ///< stopped on request (STOP or the chained flag); resumable
  kDone,             ///< every micro-batch processed, last window checkpointed
  kFailed,           ///< ended with an error (an ERROR event says why)
};

/// "starting", "waiting_for_start", "running", "stopped", "done", "failed".
const char* control_phase_name(ControlPhase phase);

struct ControlClientOptions {
  std::string coordinator;  ///< "host:port" of the coordinator (port 1..65535)
  RunId run_id{};
  FrameKey key{};           ///< the run key (the channel's keys are derived from it)
  uint32_t stage = 0;       ///< this stage's index, written into every frame
  int64_t pid = 0;          ///< 0: getpid()
  std::string device;       ///< empty: describe_device()
  std::string listen;       ///< this stage's DATA listen address "host:port"; empty (stage 0): null
  bool resume = false;      ///< this process restored a checkpoint
  int64_t micro_batches_done = 0;  ///< progress at start (the restored checkpoint's)
  std::chrono::milliseconds heartbeat_ms{1000};   ///< heartbeat period
  std::chrono::milliseconds connect_timeout{500};
  std::chrono::milliseconds backoff_initial{50};  ///< first retry delay, doubled per failure
  std::chrono::milliseconds backoff_max{2000};
  /// shutdown() waits this long for queued WINDOW_COMMITTED / ERROR frames
  /// to go out (plus, at worst, one connect_timeout already under way).
  std::chrono::milliseconds flush_timeout{1000};
  size_t max_queued = 64;   ///< heartbeats + errors kept while disconnected
  /// If set, stop_flag() also turns true when this flag does (checked every
  /// 50 ms), so the runner polls one flag for STOP and its own stop request.
  const std::atomic<bool>* chain_stop = nullptr;
  /// Root for the PSS / temperature probes ("/" in production; tests use a fake tree).
  std::string probe_root = "/";
  /// Control frames are small JSON objects; the largest the coordinator may send (or accept) is a header, 1 MiB
  /// of JSON and the tag (MAX_CONTROL_FRAME_BYTES in zl_device/executorch/control.py).
  size_t max_frame_bytes = kFrameHeaderSize + kMaxFrameJsonBytes + kFrameTagSize;
};

/// Options with coordinator, run_id (parsed from hex), key and stage taken
/// from the stage config, the rest at their defaults. kInvalidArgument if
/// `coordinator` is empty or run_id is not 32 hex chars.
Result<ControlClientOptions> control_options_from_config(const RunnerConfig& config, const FrameKey& key);

/// "Google Pixel 7 (Android aarch64)" on Android (ro.product.*), otherwise
/// "<hostname> (Linux x86_64)" from uname().
std::string describe_device();

/// One update window's end, as reported to the coordinator.
struct WindowCommittedEvent {
  int64_t window = 0;
  int64_t micro_batches_done = 0;  ///< after this window
  /// Empty (null on the wire) for a stage held still by lr 0: it computes no loss.
  std::optional<double> mean_loss;
  std::optional<double> mean_task_loss;
  std::optional<double> mean_consistency_loss;
  /// Empty when no checkpoint was due for this window (checkpoint_interval > 1):
  /// its update is then not durable on its own ("checkpointed": false).
  std::optional<double> checkpoint_ms;

  /// From the window's telemetry record.
  static WindowCommittedEvent from(const WindowRecord& record, int64_t micro_batches_done);
};

struct ControlClientStats {
  uint64_t connects = 0;           ///< successful connections (each followed by a REGISTER)
  uint64_t heartbeats_sent = 0;
  uint64_t heartbeats_dropped = 0; ///< dropped from a full queue while disconnected
  uint64_t errors_dropped = 0;
  uint64_t events_sent = 0;        ///< WINDOW_COMMITTED + ERROR frames written
  uint64_t rejected = 0;           ///< coordinator frames that failed validation
  uint64_t ignored = 0;            ///< valid frames of a type the stage does not take
  std::string last_reject_reason;  ///< "bad_mac: ...", as frame_error_name + detail
  size_t queued = 0;               ///< frames waiting for a connection
};

/// Owns the control connection and its I/O thread. Every public method is
/// thread-safe; none blocks on the network (except wait_for_start and shutdown).
class ControlClient {
 public:
  explicit ControlClient(ControlClientOptions options);
  /// shutdown().
  ~ControlClient();
  ControlClient(const ControlClient&) = delete;
  ControlClient& operator=(const ControlClient&) = delete;

  /// Validates the options and starts the I/O thread, which connects (and
  /// keeps reconnecting) in the background. Returns without waiting for the
  /// coordinator. kInvalidArgument for a bad address or heartbeat period.
  Status start();

  /// True once STOP arrived (or the chained flag turned true). Valid for the
  /// client's lifetime; pass it where the runner polls its stop request.
  const std::atomic<bool>* stop_flag() const { return &stop_; }
  bool stop_requested() const { return stop_.load(); }

  /// Blocks until START arrives (ok immediately if it already has). kTimeout
  /// after `timeout`, kClosed on STOP, a chained stop or shutdown(). Heartbeats
  /// say "waiting_for_start" meanwhile.
  Status wait_for_start(std::chrono::milliseconds timeout);
  /// The JSON payload of the START frame ("" before it arrives).
  std::string start_settings() const;

  /// Progress for the next heartbeat: micro-batches done in the whole run
  /// (the next id to process) and the current window.
  void update_progress(int64_t micro_batches_done, int64_t window,
                       ControlPhase phase = ControlPhase::kRunning);
  void set_phase(ControlPhase phase);

  /// Queues a WINDOW_COMMITTED frame. kClosed after shutdown().
  Status window_committed(const WindowCommittedEvent& event);
  /// Queues an ERROR frame {"reason": reason}. kClosed after shutdown().
  Status error(const std::string& reason);

  /// Sends what is queued (WINDOW_COMMITTED, ERROR, then one last heartbeat
  /// with the current phase), reconnecting if needed, for at most
  /// flush_timeout; then closes the connection and joins the thread.
  /// Undelivered events are logged. Idempotent.
  void shutdown();

  bool connected() const;
  ControlClientStats stats() const;

 private:
  struct Outgoing {
    uint64_t seq = 0;  // identifies the entry while the I/O thread sends it unlocked
    Frame frame;
  };

  // What run() carries from one turn of its loop to the next (I/O thread only).
  struct LoopState {
    std::chrono::steady_clock::time_point next_connect;
    std::chrono::steady_clock::time_point next_heartbeat;
    bool final_heartbeat_queued = false;
  };

  // The I/O thread's loop, and its steps in the order it takes them.
  void run();
  bool queue_heartbeat(LoopState* state, bool closing);  // true: the loop exits
  void connect_if_due(LoopState* state, Backoff* backoff, bool closing);
  void wait_for_work(const LoopState& state, bool closing);
  bool connect_once(std::chrono::milliseconds timeout);
  void drop_connection(const std::string& why);
  Status send_frame(const Frame& frame);
  void drain_queue();
  void handle_incoming();
  void handle_frame(const Frame& frame);
  void reject(const std::string& reason);
  void enqueue_locked(Frame frame);
  Frame heartbeat_locked(std::optional<double> pss_mib, std::optional<double> temperature_c) const;
  Frame register_locked() const;
  Frame control_frame_locked(FrameType type, uint64_t window, std::string json) const;
  void mirror_chain_stop();

  ControlClientOptions options_;
  std::string host_;
  uint16_t port_ = 0;

  mutable std::mutex mutex_;
  std::condition_variable changed_;  // START, STOP, thread exit
  std::deque<Outgoing> queue_;
  ControlClientStats stats_;
  int64_t micro_batches_done_ = 0;
  std::optional<int64_t> window_;
  ControlPhase phase_ = ControlPhase::kStarting;
  bool started_ = false;       // START received
  std::string start_settings_;
  bool closing_ = false;       // shutdown() called: flush, then exit
  bool force_exit_ = false;    // flush deadline passed
  bool thread_done_ = false;
  std::chrono::steady_clock::time_point close_deadline_;
  uint64_t next_seq_ = 0;
  bool unreachable_logged_ = false;  // one log line per outage, not per retry
  bool connected_ = false;

  std::atomic<bool> stop_{false};
  std::mutex shutdown_mutex_;  // serializes concurrent shutdown() calls
  std::thread thread_;
  ReconnectingLink link_;  // the connection to the coordinator; driven by the I/O thread
};

}  // namespace zl
