// The client end of a framed TCP link that outlives its peer. Sender (the
// data plane, peer_link.h) and ControlClient (the control channel,
// control_client.h) each own one and drive it from their I/O thread; what
// they send, when, and what a frame means stays with them. This holds what
// both need:
//   - a wake pipe, so other threads can cut the I/O thread's wait short;
//   - the connection: dialled with a timeout and SO_KEEPALIVE, opened with
//     the client's handshake (a fresh session, PROTOCOL.md §6), replaced on
//     every reconnect;
//   - the session: every outgoing frame stamped with it and the next
//     sequence number and sealed with the link's send key; every incoming one
//     opened with its receive key and rejected unless it belongs to this
//     session and has a sequence number not seen yet (no replays);
//   - exponential back-off between failed connects (Backoff);
//   - the read loop: bytes from the socket split into frames, each decoded
//     against the link's key and expectation and handed to the owner.
//
// Threading: everything is for the owner's I/O thread, except wake() and
// shutdown(), which any thread may call (stop/shutdown paths).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>

#include "zl/frame.h"
#include "zl/status.h"
#include "zl/tcp_socket.h"

namespace zl {

/// Delays between connect attempts: `initial`, doubled after each failure up
/// to `max`, back to `initial` after a success.
class Backoff {
 public:
  Backoff(std::chrono::milliseconds initial, std::chrono::milliseconds max)
      : initial_(initial), max_(max), next_(initial) {}
  /// The delay before the next attempt (and doubles the one after).
  std::chrono::milliseconds next();
  void reset() { next_ = initial_; }

 private:
  std::chrono::milliseconds initial_, max_, next_;
};

/// What read_frames() met besides frames.
struct LinkReadResult {
  /// The stream cannot be re-synchronized (bad magic, oversize, ...): only a
  /// new connection helps. `error` and `reason` say why.
  bool broken = false;
  FrameError error = FrameError::kNone;
  std::string reason;
  /// Reading the socket: kClosed on EOF, kIoError on a failure. Frames that
  /// arrived before it were handed over already.
  Status filled;
  /// Bytes of the whole frames handed over (valid or not), for telemetry.
  uint64_t bytes = 0;
};

class ReconnectingLink {
 public:
  /// Outgoing frames are sealed with `keys.send`; incoming ones are opened
  /// with `keys.receive` and checked against `expect` (plus the session),
  /// whose max_frame_bytes also bounds the read buffer. `run_id` and `stage`
  /// go into this end's HELLO.
  ReconnectingLink(const LinkKeys& keys, const FrameExpectation& expect, const RunId& run_id, uint32_t stage);
  /// Closes the wake pipe: the owner has joined its I/O thread by then.
  ~ReconnectingLink();
  ReconnectingLink(const ReconnectingLink&) = delete;
  ReconnectingLink& operator=(const ReconnectingLink&) = delete;

  /// Creates the wake pipe; call before the I/O thread starts. kIoError.
  Status open();
  /// Any thread: ends the I/O thread's current wait_for_input() or sleep().
  void wake();

  /// Connects to host:port within `timeout` (blocking socket, TCP_NODELAY,
  /// SO_KEEPALIVE so a peer that vanished is noticed on an idle link).
  static Result<Socket> dial(const std::string& host, uint16_t port, std::chrono::milliseconds timeout);
  /// The client handshake on a freshly dialled `sock` (client_handshake,
  /// within `timeout`); returns the new session.
  Result<SessionId> handshake(const Socket& sock, std::chrono::milliseconds timeout) const;
  /// Makes `sock` (handshake done) the connection with `session`; bytes
  /// buffered from an earlier one are dropped, sequence numbers start over.
  void adopt(Socket sock, const SessionId& session);
  /// Closes the connection (if any) and drops buffered bytes.
  void close();
  /// Any thread: shuts the connection down, which ends a send() blocked on a
  /// peer that stopped reading; the I/O thread then sees the error.
  void shutdown();
  bool connected() const { return conn_.valid(); }

  /// Stamps `frame` with the session and the next sequence number, seals it
  /// and writes it (blocking). kInvalidArgument if it cannot be encoded
  /// (then nothing was written), else what the socket says.
  Status send_frame(const Frame& frame, size_t max_frame_bytes);

  /// Waits until `until` (at most 1 s, so the owner re-checks its state), a
  /// wake(), or input (or a hang-up) on the connection; true for the latter.
  /// kIoError "poll: ..." if the wait itself fails.
  Result<bool> wait_for_input(std::chrono::steady_clock::time_point until);
  /// Sleeps for `duration` unless woken.
  void sleep(std::chrono::milliseconds duration);

  /// Reads what the socket has without blocking and hands every complete
  /// frame to `on_frame`, decoded, also those that fail validation
  /// (DecodeResult::ok() false): their length was sound, so the stream stays
  /// in sync. Stops at a broken stream (see LinkReadResult).
  LinkReadResult read_frames(const std::function<void(const DecodeResult&)>& on_frame);

 private:
  const LinkKeys keys_;
  const FrameExpectation expect_;
  const RunId run_id_;
  const uint32_t stage_;
  SessionState session_;  // the I/O thread's
  // Guards conn_ between the I/O thread's adopt()/close() and shutdown() from
  // other threads; the I/O thread, its only writer, reads it without.
  std::mutex conn_mutex_;
  Socket conn_;
  FrameReader reader_;
  int wake_pipe_[2] = {-1, -1};
};

}  // namespace zl
