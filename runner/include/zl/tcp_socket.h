// Thin POSIX TCP helpers for the peer links and the control channel: an
// owning socket, listen/connect with timeouts, and frame-sized reads/writes.
// No exceptions; SIGPIPE is avoided per call (MSG_NOSIGNAL).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "zl/frame.h"
#include "zl/status.h"

namespace zl {

/// Owns one file descriptor; closes it on destruction.
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() { close(); }
  Socket(Socket&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  Socket& operator=(Socket&& other) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void close();
  /// shutdown(SHUT_RDWR): wakes a thread blocked in send/recv/poll on it.
  void shutdown();

 private:
  int fd_ = -1;
};

/// A listening socket and the port it is bound to.
struct ListeningSocket {
  Socket socket;
  uint16_t port = 0;  ///< the actual port (the ephemeral one chosen for port 0)
};

/// Binds and listens on host:port (port 0: ephemeral). SO_REUSEADDR is set
/// so a restarted receiver can take its port back.
Result<ListeningSocket> listen_tcp(const std::string& host, uint16_t port);

/// Connects to host:port within `timeout`; the socket is blocking, TCP_NODELAY.
Result<Socket> connect_tcp(const std::string& host, uint16_t port, std::chrono::milliseconds timeout);

/// Accepts one pending connection (call after poll says the listener is
/// readable). On error errno is still accept's (EAGAIN: none was pending).
Result<Socket> accept_tcp(const Socket& listener);

/// Writes all `size` bytes (blocking). kIoError names errno.
Status send_all(int fd, const uint8_t* data, size_t size);

/// Encodes and writes one frame.
Status write_frame(int fd, const Frame& frame, const FrameKey& key);

/// Reads exactly one frame within `timeout` and decodes it. Transport errors
/// come back as Status (kTimeout, kClosed, kIoError); a frame that arrives but
/// fails validation comes back as a DecodeResult with `error` set. A framing
/// error (bad magic/version, oversize) leaves the stream unusable: close it.
/// The buffer grows with the bytes that arrive (at most twice what arrived),
/// not with the length the header announces. `raw` (optional) also receives
/// the sealed bytes as read, for callers that keep or re-check them.
Result<DecodeResult> read_frame(int fd, const FrameKey& key, const FrameExpectation& expect,
                                std::chrono::milliseconds timeout, std::vector<uint8_t>* raw = nullptr);

/// A HELLO on the wire: a header and a tag, no payload, no tensors (PROTOCOL.md §6).
constexpr size_t kHelloFrameBytes = kFrameHeaderSize + kFrameTagSize;
/// The most a client reads as the server's answer to its HELLO, before that
/// answer verified: a HELLO (144 bytes) or the ERROR refusing the connection,
/// whose reason is a few hundred bytes (PROTOCOL.md §7).
constexpr size_t kMaxHandshakeReplyBytes = 4096;

/// The client side of a connection's handshake (PROTOCOL.md §6), on a
/// connected blocking socket: sends HELLO (stage `stage`, session = 16 fresh
/// random bytes + 16 zero bytes, sequence 0) sealed with `keys.send`, then
/// waits up to `timeout` for the server's HELLO, opened with `keys.receive`
/// and checked against `expect`, which must echo the client's half. The
/// server is not authenticated until that reply verifies, so the reply may
/// announce at most kMaxHandshakeReplyBytes (less if `expect` says so).
/// Returns the session both ends then stamp on every frame. kTimeout,
/// kClosed, kIoError from the socket; kCorrupt when the server's reply is not
/// a valid HELLO of this connection (or is its ERROR), naming why.
Result<SessionId> client_handshake(int fd, const LinkKeys& keys, const RunId& run_id, uint32_t stage,
                                   const FrameExpectation& expect, std::chrono::milliseconds timeout);

/// The server side: `hello` decoded and authenticated, the first frame of a
/// new connection. Returns the server's HELLO (stage `stage`, session = the
/// client's half + `server_half`, sequence 0); its `session` is the
/// connection's from then on. kCorrupt (not a HELLO, or not sequence 0)
/// with why the connection must be refused (reason name bad_handshake).
Result<Frame> server_handshake(const Frame& hello, const RunId& run_id, uint32_t stage,
                               const std::array<uint8_t, kSessionHalfSize>& server_half);

/// Stamps the next frames of one end of a session: its id and its sequence
/// numbers (1, 2, ...; HELLO was 0); checks incoming ones against both.
struct SessionState {
  SessionId id{};
  uint64_t sent = 0;      ///< last sequence number stamped on an outgoing frame
  uint64_t accepted = 0;  ///< last sequence number accepted from the peer
  /// `frame` with the session and the next sequence number.
  Frame stamp(Frame frame) {
    frame.session = id;
    frame.seq = ++sent;
    return frame;
  }
  /// `base` plus this session and the lowest sequence number still new.
  FrameExpectation expect(FrameExpectation base) const {
    base.session = id;
    base.min_seq = accepted + 1;
    return base;
  }
};

/// A self-pipe lets other threads wake an I/O thread blocked in poll():
/// `fds[0]` goes into the poll set, `fds[1]` is written by write_wake(). Both
/// ends are non-blocking and close-on-exec. False (errno set) if pipe() fails.
[[nodiscard]] bool make_wake_pipe(int fds[2]);
/// Closes both ends (if open) and sets them to -1.
void close_wake_pipe(int fds[2]);
/// Writes one byte to the write end; a full pipe already means "wake up".
void write_wake(int fd);
/// Empties the read end after poll() reported it readable.
void drain_wake(int fd);

/// Accumulates bytes from a non-blocking read loop and splits them into frames.
/// It never holds more than `max_frame_bytes` + one header of unconsumed
/// bytes (one maximal frame and the next one's header), whatever a header
/// announces: memory follows the bytes that arrived, bounded by the cap.
class FrameReader {
 public:
  explicit FrameReader(size_t max_frame_bytes = kDefaultMaxFrameBytes)
      : max_frame_bytes_(max_frame_bytes) {}

  enum class Next { kNeedMore, kFrame, kBroken };

  /// recv()s what is available without blocking, up to the bound above (what
  /// is left stays in the socket until the consumer pops). kClosed on orderly EOF.
  Status fill(int fd);
  /// The largest frame next() accepts (oversize above it). A Receiver raises
  /// it from the pre-auth cap once a connection's HELLO verified.
  void set_max_frame_bytes(size_t max_frame_bytes) { max_frame_bytes_ = max_frame_bytes; }
  size_t max_frame_bytes() const { return max_frame_bytes_; }
  /// Pops the next complete frame's bytes into `*frame`. kBroken means the
  /// stream cannot be re-synchronized (`*error`, `*reason` say why).
  [[nodiscard]] Next next(std::vector<uint8_t>* frame, FrameError* error, std::string* reason);

  /// next() as one value, for read loops.
  struct Popped {
    Next next = Next::kNeedMore;
    std::vector<uint8_t> frame;
    FrameError error = FrameError::kNone;
    std::string reason;
  };
  [[nodiscard]] Popped pop() {
    Popped p;
    p.next = next(&p.frame, &p.error, &p.reason);
    return p;
  }
  void clear() {
    buffer_.clear();
    start_ = 0;
  }
  /// Bytes received and not yet popped.
  size_t buffered() const { return buffer_.size() - start_; }

 private:
  size_t max_frame_bytes_;
  // Unconsumed bytes are buffer_[start_, size()): popping a frame advances
  // start_ (O(frame)); the consumed prefix is dropped once it is at least half
  // the buffer, so each byte is moved O(1) times (issue 12 item 12).
  std::vector<uint8_t> buffer_;
  size_t start_ = 0;
};

}  // namespace zl
