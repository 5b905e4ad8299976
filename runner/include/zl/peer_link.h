// The data-plane link between neighbouring stages (docs/design#runner):
//
//   stage k  Sender  --DATA-->  Receiver  stage k+1
//                    <--ACK---            (ACK only after the entry is in the
//                                          receiver's durable InputLog)
//                    <--GRAD--            (Receiver::send_grad: the gradient of
//                                          an entry's hidden state, issue 39)
//
// Gradients flow control (PROTOCOL.md §7): the Sender is owed a gradient for
// every DATA entry it sent until the runner takes it (next_grad); at most G
// (SenderOptions::max_grads_in_flight) are owed at once, and send() blocks
// beyond that, so at most G GRAD frames are ever on their way to or queued at
// stage k. A GRAD for an entry that is not owed one is refused. The Receiver
// queues at most ReceiverOptions::max_grads_queued GRAD frames not yet
// written upstream; send_grad() blocks beyond that.
//
// Sender: at most D entries un-acknowledged (send() blocks beyond that),
// reconnects with exponential back-off (a ReconnectingLink) and re-sends
// every un-acknowledged entry, shapes the link by a LinkProfile.
// Receiver: validates every frame (tag, run, stage, session, sequence,
// shapes), logs before it acknowledges, drops duplicates by micro-batch id
// (acknowledging them again), and keeps listening after a bad frame or a
// broken connection.
//
// Every connection starts with the session handshake (PROTOCOL.md §6); the
// link's frames are sealed with keys derived from the run key for this link
// (the upstream stage k) and direction, so they are encrypted on the wire and
// cannot be replayed into another connection, link or direction.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <thread>
#include <vector>

#include "zl/frame.h"
#include "zl/input_log.h"
#include "zl/link_profile.h"
#include "zl/reconnecting_link.h"
#include "zl/status.h"
#include "zl/tcp_socket.h"

struct pollfd;  // <poll.h>, for Receiver's private poll set

namespace zl {

struct SenderOptions {
  std::string host = "127.0.0.1";  ///< downstream's listen address
  uint16_t port = 0;
  FrameKey key{};                  ///< the run key (the link's keys are derived from it)
  uint32_t stage = 0;              ///< this (upstream) stage's index k: the link k -> k+1
  std::optional<RunId> run_id;     ///< if set, ACKs from another run are rejected
  size_t max_in_flight = 2;        ///< D: un-acknowledged entries allowed on the link
  LinkProfile profile;             ///< shaping of the DATA going down (default: none)
  std::chrono::milliseconds connect_timeout{2000};
  std::chrono::milliseconds backoff_initial{20};  ///< first retry delay, doubled per failure
  std::chrono::milliseconds backoff_max{2000};
  size_t max_frame_bytes = kDefaultMaxFrameBytes;
  /// G: DATA entries whose gradient (a GRAD frame from downstream) has not
  /// been taken by next_grad() yet; send() blocks beyond it. 0: this link
  /// carries no gradients (every GRAD is refused), the default.
  size_t max_grads_in_flight = 0;
  /// The hidden state's B, S, D: a GRAD must carry exactly grad_hidden
  /// bfloat16/float32 [B,S,D] (else unexpected_tensor). Required when G > 0.
  int64_t batch = 0;
  int64_t seq_len = 0;
  int64_t hidden_size = 0;
};

struct SenderStats {
  uint64_t transmissions = 0;     ///< frames written, re-sends included
  uint64_t resends = 0;           ///< frames written again after a reconnect
  uint64_t acks = 0;              ///< ACKs that released an entry
  uint64_t connects = 0;          ///< successful connections
  size_t max_in_flight_seen = 0;  ///< never exceeds SenderOptions::max_in_flight
  uint64_t bytes_sent = 0;        ///< frames written downstream after the handshake, re-sends included
  uint64_t bytes_received = 0;    ///< frames read from downstream after the handshake (ACK, GRAD, ERROR)
  uint64_t rejected = 0;          ///< frames from downstream that failed validation (then ignored)
  uint64_t grads_received = 0;    ///< GRAD frames queued for next_grad()
  uint64_t grads_refused = 0;     ///< valid GRAD frames for an entry not owed a gradient
  size_t max_grads_owed_seen = 0; ///< owed + queued gradients; never exceeds max_grads_in_flight
  /// Gradient arrival delay in micro-batches: the newest micro-batch sent when
  /// a GRAD arrived minus the GRAD's own (0: it came back before the next was sent).
  uint64_t max_grad_delay = 0;
  uint64_t sum_grad_delay = 0;    ///< over grads_received, for the mean
  std::string last_reject_reason;
};

/// A gradient handed to stage k's runner (Sender::next_grad).
struct GradEntry {
  uint64_t window = 0;
  uint64_t micro_batch = 0;
  uint64_t delay = 0;  ///< micro-batches sent after this one before its GRAD arrived
  Frame frame;         ///< grad_hidden [B,S,D] bfloat16 or float32: widen with grad_hidden_f32
};

/// Upstream end of a link. Owns one I/O thread.
class Sender {
 public:
  explicit Sender(SenderOptions options);
  ~Sender();
  Sender(const Sender&) = delete;
  Sender& operator=(const Sender&) = delete;

  /// Starts the I/O thread; it connects (and keeps reconnecting) in the background.
  Status start();

  /// Queues a frame (normally DATA). Blocks while D entries are un-acknowledged;
  /// kTimeout if none is acknowledged within `timeout`, kClosed after stop().
  /// Returns once queued, not once delivered.
  Status send(const Frame& frame, std::chrono::milliseconds timeout);

  /// Waits until every queued entry is acknowledged; kTimeout otherwise.
  Status flush(std::chrono::milliseconds timeout);

  /// Takes the next gradient that arrived (in arrival order), which frees one
  /// of the G owed gradients for send(). kTimeout if none arrives in time,
  /// kClosed after stop(), kInvalidArgument when max_grads_in_flight is 0.
  Result<GradEntry> next_grad(std::chrono::milliseconds timeout);

  /// DATA entries sent whose gradient has not arrived yet.
  size_t grads_owed() const;

  /// Points the link at a new downstream (e.g. a spare device); un-acknowledged
  /// entries are re-sent there.
  void set_peer(const std::string& host, uint16_t port);

  size_t in_flight() const;
  bool connected() const;
  SenderStats stats() const;

  /// Stops the I/O thread; un-acknowledged entries are dropped. Idempotent.
  void stop();

 private:
  struct Entry {
    uint64_t window = 0;
    uint64_t micro_batch = 0;
    // Sealed at each transmission: a re-send after a reconnect goes out in
    // the new session with a new sequence number and nonce.
    std::shared_ptr<const Frame> frame;
    size_t wire_bytes = 0;
    SteadyClock::time_point queued_at;
    std::optional<SteadyClock::time_point> deliver_at;  // set once scheduled on the wire
    bool sent = false;
    bool sent_before = false;
  };

  // The next frame to put on the wire and when the emulated link delivers
  // it (in a second when there is none).
  struct NextSend {
    std::shared_ptr<const Frame> frame;  // null: nothing to send
    size_t wire_bytes = 0;
    SteadyClock::time_point deliver_at;
    bool resend = false;
  };

  // The I/O thread's loop, and its steps.
  void run();
  bool connect_once();
  std::optional<NextSend> next_to_send();  // nullopt: the peer changed, the link was closed
  void transmit(const NextSend& next);
  void drop_connection(const std::string& why);
  void handle_incoming();
  void handle_frame(const DecodeResult& r);
  void handle_grad(const Frame& grad);  // mutex_ held
  size_t grad_credit_used_locked() const { return owed_.size() + grads_.size(); }

  SenderOptions options_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Entry> queue_;  // un-acknowledged, in send order
  std::set<std::pair<uint64_t, uint64_t>> owed_;  // (window, micro_batch) sent, gradient not arrived
  std::deque<GradEntry> grads_;                   // arrived, not taken; owed_ + grads_ <= G
  std::optional<uint64_t> last_sent_micro_batch_;  // newest DATA micro-batch queued, for the delay
  SenderStats stats_;
  bool stopping_ = false;
  bool connected_ = false;
  bool peer_changed_ = false;
  std::thread thread_;
  ReconnectingLink link_;  // the connection downstream; driven by the I/O thread
  LinkShaper shaper_;
};

/// The most a connection may announce before its HELLO verified, by default:
/// a HELLO is kHelloFrameBytes (144: a header and a tag, no payload, no
/// tensors); 1 KiB leaves room for a HELLO payload in a later version.
constexpr size_t kDefaultPreAuthFrameBytes = 1024;

/// What connections that have not authenticated cost a Receiver's listener
/// (issue 28 item 2; PROTOCOL.md §7). A new connection first has to send a
/// HELLO sealed with the link's key; until that HELLO verified, it may
/// announce at most `max_frame_bytes` (a larger header is refused as
/// oversize and the connection closed at once), and its reader never holds
/// more than that plus one header. So all of them together hold at most
/// max_connections * (max_frame_bytes + 128) bytes of frame buffers: about
/// 4.5 KiB with the defaults, whatever they send.
///
/// After its HELLO a connection may send one frame of up to the link's
/// maximum (expect.max_frame_bytes: its first DATA), which makes it the
/// upstream once it decodes in the new session. Only one such handshaken
/// newcomer waits at a time (a newer one that completes its HELLO replaces
/// it), and newcomers that have not sent their HELLO never push it out, so
/// someone replaying a recorded HELLO holds at most one frame, and a flood of
/// strangers cannot displace a reconnecting upstream.
struct PreAuthBudget {
  /// Connections waiting for their HELLO, at most this many at a time (the
  /// oldest is closed for a newer one). At least 1.
  size_t max_connections = 4;
  /// The largest frame such a connection may announce; at least kHelloFrameBytes.
  size_t max_frame_bytes = kDefaultPreAuthFrameBytes;
  /// A connection whose HELLO is not complete this long after it was accepted
  /// is closed (a client sends it first thing; its own handshake timeout is
  /// SenderOptions::connect_timeout, 2 s by default).
  std::chrono::milliseconds hello_timeout{5000};
  /// A connection that is not the upstream this long after it was accepted
  /// (its first frame after the handshake has not arrived and decoded) is
  /// closed. Generous: that frame is a whole DATA entry on a possibly slow link.
  std::chrono::milliseconds auth_timeout{30000};
};

struct ReceiverOptions {
  std::string host = "127.0.0.1";  ///< listen address ("0.0.0.0" on a phone on Wi-Fi)
  uint16_t port = 0;               ///< 0: ephemeral, see Receiver::port()
  FrameKey key{};                  ///< the run key (the link's and the input log's keys are derived from it)
  /// Checked on every frame: run id, upstream stage index (required: the
  /// link's keys derive from it), B/S/D of DATA.
  FrameExpectation expect;
  uint32_t stage = 0;              ///< this stage's index, written into ACKs
  std::string log_dir;             ///< InputLog directory
  /// Entries logged but not yet taken by the consumer before the receiver
  /// stops reading from the socket (back-pressure onto the sender's D).
  size_t max_pending = 4;
  /// Next micro-batch id the consumer will take (after a restart: the first
  /// one after the restored checkpoint). Ids are consecutive integers.
  uint64_t first_micro_batch = 0;
  /// Last committed window, if any: log entries through it are deleted on start.
  std::optional<uint64_t> committed_window;
  /// A new connection replaces the current upstream only once it completed
  /// the handshake and its first frame after it decodes (tag, run, stage,
  /// session, shapes). Until then it is a candidate, within this budget.
  PreAuthBudget pre_auth;
  /// After an entry cannot be logged here (a full disk, an I/O error), the
  /// receiver closes the link unacknowledged and reads nothing from upstream
  /// for this long, doubling per consecutive failure up to the max (reset by
  /// the next entry logged), so a local error does not turn into a
  /// reconnect-and-resend loop as fast as the network allows.
  std::chrono::milliseconds local_error_backoff_initial{20};
  std::chrono::milliseconds local_error_backoff_max{2000};
  /// GRAD frames given to send_grad() and not yet written upstream (they
  /// wait while the upstream is disconnected); send_grad() blocks beyond it.
  size_t max_grads_queued = 4;
  /// Shaping of the GRAD frames this end writes upstream, as
  /// SenderOptions::profile shapes the DATA frames going down: a link's
  /// latency and bandwidth hold both ways. ACKs (under 200 bytes, one per
  /// entry) go at once. Default: none.
  LinkProfile profile;
  /// The server's half of each new session (16 bytes). Default: random
  /// (randombytes_buf); zl_frame_tool's fuzz mode injects known values.
  std::function<void(uint8_t* out, size_t size)> session_random;
};

struct ReceiverStats {
  uint64_t accepted = 0;     ///< new entries logged and acknowledged
  uint64_t duplicates = 0;   ///< dropped by micro-batch id, acknowledged again
  uint64_t rejected = 0;     ///< frames that failed validation
  uint64_t ignored = 0;      ///< valid frames of another type than DATA
  uint64_t connections = 0;  ///< accepted upstream connections
  /// Connections closed before their first valid frame: a PreAuthBudget
  /// deadline or cap, or replaced by a newer handshake.
  uint64_t candidates_dropped = 0;
  uint64_t local_errors = 0;  ///< entries that could not be logged here (then a pause, see local_error_backoff_*)
  uint64_t grads_sent = 0;      ///< GRAD frames written upstream
  uint64_t bytes_received = 0;  ///< frames read from upstream after the handshake
  uint64_t bytes_sent = 0;      ///< frames written upstream (ACK, GRAD, ERROR)
  std::string last_reject_reason;
  std::string last_local_error;
};

/// One entry handed to the consumer.
struct InputEntry {
  uint64_t window = 0;
  uint64_t micro_batch = 0;
  Frame frame;  ///< hidden [B,S,D] float32, attention_mask / labels [B,S] int64
};

/// Downstream end of a link. Owns one I/O thread and the InputLog.
class Receiver {
 public:
  explicit Receiver(ReceiverOptions options);
  ~Receiver();
  Receiver(const Receiver&) = delete;
  Receiver& operator=(const Receiver&) = delete;

  /// Opens the log (reporting corrupt files), listens and starts serving.
  Status start();

  /// The port actually listened on (valid after start()).
  uint16_t port() const { return port_; }

  /// Takes the next entry in micro-batch order (from the network or, after a
  /// restart, from the log). kTimeout if it does not arrive in time,
  /// kCorrupt if its log file no longer verifies, kClosed after stop().
  Result<InputEntry> next(std::chrono::milliseconds timeout);

  /// Queues `grad` (a GRAD frame, make_grad_frame) to be written upstream in
  /// this connection's session, sealed with the link's data-up key. Blocks
  /// while max_grads_queued are waiting; kTimeout then, kClosed after stop(),
  /// kInvalidArgument for another frame type, a grad_hidden that is not
  /// bfloat16/float32 [B,S,D] of expect, or a frame too large to encode.
  /// Returns once queued. A GRAD written on a connection that then breaks is
  /// not written again (gradient recovery is issue 39 item 4).
  Status send_grad(const Frame& grad, std::chrono::milliseconds timeout);

  /// Waits until every GRAD given to send_grad() is written upstream, so that
  /// a stage finishing its run does not stop with the upstream's last
  /// gradient still queued (and its stats count every GRAD sent). kTimeout
  /// while some are still queued, kClosed after stop().
  Status flush_grads(std::chrono::milliseconds timeout);

  /// The window's checkpoint is in place: deletes log entries at or before it.
  Status window_committed(uint64_t window);

  ReceiverStats stats() const;
  const InputLog& input_log() const { return log_; }

  /// Stops listening and serving. Idempotent.
  void stop();

 private:
  // A connection that has not yet sent a valid frame after its handshake.
  struct Candidate {
    Socket sock;  // closed (invalid) once dropped; erased at the next deadline sweep
    FrameReader reader;  // capped at pre_auth.max_frame_bytes until its HELLO verified
    SteadyClock::time_point accepted_at;
    std::optional<SessionState> session;  // set once its HELLO was answered
    SteadyClock::time_point deadline(const PreAuthBudget& budget) const {
      return accepted_at + (session ? budget.auth_timeout : std::min(budget.hello_timeout, budget.auth_timeout));
    }
  };

  // The I/O thread's loop, and its steps in the order it takes them.
  void run();
  int sweep_candidates(SteadyClock::time_point now, int timeout_ms);  // returns timeout_ms, cut to the next deadline
  void fill_poll_set(bool room, std::vector<pollfd>* fds) const;
  void read_upstream();
  void accept_newcomers();
  void serve_connection();
  void serve_candidate(size_t index);
  // The candidate's HELLO answered; true when its next frame may be read now.
  bool answer_hello(size_t index, const std::vector<uint8_t>& frame);
  // The candidate's first session frame decoded: it becomes the upstream.
  void promote_candidate(size_t index, const DecodeResult& first, const Status& filled);
  void drop_candidate(Candidate* c);
  void handle_frame(const std::vector<uint8_t>& bytes);
  void handle_decoded(const DecodeResult& r);
  void reject(const std::string& reason, bool send_error);
  void reject_on(Socket* sock, FrameReader* reader, const std::string& reason, SessionState* session);
  // Seals `frame` under the data-up key and writes it to `fd`, counting its bytes.
  Status write_up(int fd, const Frame& frame);
  // The queued GRAD frames due by now, on conn_ (I/O thread). Returns when the next one is due, if one waits.
  std::optional<SteadyClock::time_point> write_grads();
  void count_received(size_t bytes);
  size_t pending_locked() const;
  void wake();

  ReceiverOptions options_;
  LinkKeys keys_;
  InputLog log_;
  Socket listener_;
  Socket conn_;  // current (authenticated) upstream, I/O thread only
  FrameReader reader_;
  SessionState session_;  // conn_'s, I/O thread only
  std::vector<Candidate> candidates_;  // I/O thread only, oldest first
  uint16_t port_ = 0;
  mutable std::mutex mutex_;
  std::condition_variable arrived_;
  std::condition_variable grad_room_;  // a queued GRAD was written (or stop)
  // A GRAD given to send_grad(), until written.
  struct OutboundGrad {
    Frame frame;
    size_t wire_bytes = 0;
    SteadyClock::time_point queued_at;
    std::optional<SteadyClock::time_point> deliver_at;  // set once scheduled on the (shaped) wire
  };
  std::deque<OutboundGrad> grad_outbox_;  // send_grad() -> the I/O thread, at most max_grads_queued
  LinkShaper up_shaper_;                  // I/O thread only: the GRADs' wire (options_.profile)
  SteadyClock::time_point connected_at_{};  // I/O thread only: when conn_ became the upstream
  uint64_t next_micro_batch_ = 0;
  ReceiverStats stats_;
  bool stopping_ = false;
  std::thread thread_;
  int wake_pipe_[2] = {-1, -1};
  Backoff local_backoff_;                  // I/O thread only
  SteadyClock::time_point paused_until_{};  // I/O thread only: no reading before (a local error)
};

}  // namespace zl
