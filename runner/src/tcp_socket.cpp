#include "zl/tcp_socket.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

namespace zl {
namespace {

using SteadyClock = std::chrono::steady_clock;

Status errno_status(const std::string& what) {
  return Status(StatusCode::kIoError, what + ": " + std::strerror(errno));
}

// A resolved socket address (the first getaddrinfo gives).
struct Address {
  sockaddr_storage addr{};
  socklen_t len = 0;
};

Result<Address> resolve(const std::string& host, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  std::string name = host;
#ifdef ZL_STATIC_BINARY
  // A static glibc resolves names through NSS modules it would dlopen, which
  // a phone does not have: numeric addresses only (the host resolves names
  // before it writes a config), "localhost" being the loopback address.
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  if (name == "localhost") name = "127.0.0.1";
#endif
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  const int rc = getaddrinfo(name.c_str(), service.c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
#ifdef ZL_STATIC_BINARY
    return Status(StatusCode::kInvalidArgument,
                  "cannot use host '" + host + "': this static zl_runner takes numeric addresses only "
                  "(e.g. 192.168.1.20 or ::1): " + gai_strerror(rc));
#else
    return Status(StatusCode::kInvalidArgument,
                  "cannot resolve host '" + host + "': " + gai_strerror(rc));
#endif
  }
  Address address;
  std::memcpy(&address.addr, res->ai_addr, res->ai_addrlen);
  address.len = res->ai_addrlen;
  freeaddrinfo(res);
  return address;
}

// Waits until `fd` is readable/writable or `deadline` passes.
Status wait_fd(int fd, short events, SteadyClock::time_point deadline) {
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - SteadyClock::now());
    if (left.count() < 0) return Status(StatusCode::kTimeout, "timed out");
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, static_cast<int>(left.count()) + 1);
    if (rc < 0 && errno == EINTR) continue;
    if (rc < 0) return errno_status("poll");
    if (rc == 0) continue;  // re-check the deadline
    return Status();
  }
}

Status recv_exact(int fd, uint8_t* out, size_t size, SteadyClock::time_point deadline) {
  size_t got = 0;
  while (got < size) {
    ZL_RETURN_IF_ERROR(wait_fd(fd, POLLIN, deadline));
    const ssize_t n = ::recv(fd, out + got, size - got, MSG_DONTWAIT);
    if (n == 0) return Status(StatusCode::kClosed, "connection closed by peer");
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return errno_status("recv");
    }
    got += static_cast<size_t>(n);
  }
  return Status();
}

}  // namespace

Socket& Socket::operator=(Socket&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

void Socket::close() {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

void Socket::shutdown() {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

Result<ListeningSocket> listen_tcp(const std::string& host, uint16_t port) {
  ZL_ASSIGN_OR_RETURN(Address address, resolve(host, port));
  sockaddr_storage& addr = address.addr;
  const socklen_t len = address.len;
  Socket sock(::socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!sock.valid()) return errno_status("socket");
  const int one = 1;
  ::setsockopt(sock.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(sock.fd(), reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    return errno_status("bind " + host + ":" + std::to_string(port));
  }
  if (::listen(sock.fd(), 64) != 0) return errno_status("listen");
  sockaddr_storage bound{};
  socklen_t bound_len = sizeof(bound);
  ::getsockname(sock.fd(), reinterpret_cast<sockaddr*>(&bound), &bound_len);
  const uint16_t bound_port = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                                : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  return ListeningSocket{std::move(sock), bound_port};
}

Result<Socket> connect_tcp(const std::string& host, uint16_t port, std::chrono::milliseconds timeout) {
  ZL_ASSIGN_OR_RETURN(Address address, resolve(host, port));
  sockaddr_storage& addr = address.addr;
  const socklen_t len = address.len;
  Socket sock(::socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!sock.valid()) return errno_status("socket");
  const int flags = ::fcntl(sock.fd(), F_GETFL, 0);
  ::fcntl(sock.fd(), F_SETFL, flags | O_NONBLOCK);
  const std::string where = host + ":" + std::to_string(port);
  if (::connect(sock.fd(), reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    if (errno != EINPROGRESS) return errno_status("connect " + where);
    ZL_RETURN_IF_ERROR_WITH_PREFIX(wait_fd(sock.fd(), POLLOUT, SteadyClock::now() + timeout), "connect " + where + ": ");
    int err = 0;
    socklen_t err_len = sizeof(err);
    ::getsockopt(sock.fd(), SOL_SOCKET, SO_ERROR, &err, &err_len);
    if (err != 0) {
      errno = err;
      return errno_status("connect " + where);
    }
  }
  ::fcntl(sock.fd(), F_SETFL, flags & ~O_NONBLOCK);
  const int one = 1;
  ::setsockopt(sock.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return sock;
}

Result<Socket> accept_tcp(const Socket& listener) {
  const int fd = ::accept(listener.fd(), nullptr, nullptr);
  if (fd < 0) return errno_status("accept");
  ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return Socket(fd);
}

Status send_all(int fd, const uint8_t* data, size_t size) {
  size_t sent = 0;
  while (sent < size) {
    const ssize_t n = ::send(fd, data + sent, size - sent, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno_status("send");
    }
    sent += static_cast<size_t>(n);
  }
  return Status();
}

Status write_frame(int fd, const Frame& frame, const FrameKey& key) {
  ZL_ASSIGN_OR_RETURN(const std::vector<uint8_t> bytes, encode_frame(frame, key));
  return send_all(fd, bytes.data(), bytes.size());
}

Result<DecodeResult> read_frame(int fd, const FrameKey& key, const FrameExpectation& expect,
                                std::chrono::milliseconds timeout, std::vector<uint8_t>* raw) {
  const auto deadline = SteadyClock::now() + timeout;
  std::vector<uint8_t> bytes(kFrameHeaderSize);
  ZL_RETURN_IF_ERROR(recv_exact(fd, bytes.data(), kFrameHeaderSize, deadline));
  size_t total = 0;
  std::string reason;
  const FrameError e =
      peek_frame_length(bytes.data(), bytes.size(), expect.max_frame_bytes, &total, &reason);
  if (e != FrameError::kNone) {
    DecodeResult broken;
    broken.error = e;
    broken.reason = std::string(frame_error_name(e)) + ": " + reason;
    return broken;
  }
  // Grown as the bytes arrive, never to the announced length up front: a
  // peer that announces 64 MiB and sends 200 bytes costs 64 KiB, not 64 MiB.
  constexpr size_t kFirstStep = 64 * 1024;
  size_t have = kFrameHeaderSize;
  while (have < total) {
    const size_t step = std::min(total - have, std::max(have, kFirstStep));
    bytes.resize(have + step);
    ZL_RETURN_IF_ERROR(recv_exact(fd, bytes.data() + have, step, deadline));
    have += step;
  }
  DecodeResult decoded = decode_frame(bytes.data(), bytes.size(), key, expect);
  if (raw) *raw = std::move(bytes);
  return decoded;
}

Result<SessionId> client_handshake(int fd, const LinkKeys& keys, const RunId& run_id, uint32_t stage,
                                   const FrameExpectation& expect, std::chrono::milliseconds timeout) {
  Frame hello = make_control_frame(FrameType::kHello, run_id, stage, 0, 0);
  random_bytes(hello.session.data(), kSessionHalfSize);
  ZL_RETURN_IF_ERROR_WITH_PREFIX(write_frame(fd, hello, keys.send), "handshake: ");
  // Until the reply verifies, the server is a stranger: it gets a HELLO's
  // worth of bytes (or an ERROR's), not the link's frame maximum.
  FrameExpectation pre_auth = expect;
  pre_auth.max_frame_bytes = std::min(expect.max_frame_bytes, kMaxHandshakeReplyBytes);
  Result<DecodeResult> reply = read_frame(fd, keys.receive, pre_auth, timeout);
  ZL_RETURN_IF_ERROR_WITH_PREFIX(reply, "handshake: ");
  const DecodeResult& r = *reply;
  if (!r.ok()) return Status(StatusCode::kCorrupt, "handshake: the server's reply was rejected: " + r.reason);
  const Frame& f = r.frame;
  if (f.type == FrameType::kError) {
    return Status(StatusCode::kCorrupt, "handshake: the server refused the connection: " + escape_bytes(f.json, 2000));
  }
  if (f.type != FrameType::kHello || f.seq != 0 ||
      std::memcmp(f.session.data(), hello.session.data(), kSessionHalfSize) != 0) {
    const char* type = frame_type_name(static_cast<uint16_t>(f.type));
    return Status(StatusCode::kCorrupt,
                  std::string("handshake: bad_handshake: expected the server's HELLO for this connection, got ") +
                      (type ? type : "?") + " (sequence " + std::to_string(f.seq) + ", session " +
                      to_hex(f.session.data(), kSessionSize) + ")");
  }
  return f.session;
}

Result<Frame> server_handshake(const Frame& hello, const RunId& run_id, uint32_t stage,
                               const std::array<uint8_t, kSessionHalfSize>& server_half) {
  if (hello.type != FrameType::kHello) {
    const char* type = frame_type_name(static_cast<uint16_t>(hello.type));
    return Status(StatusCode::kCorrupt,
                  std::string("bad_handshake: the first frame of a connection must be HELLO, not ") + (type ? type : "?"));
  }
  if (hello.seq != 0) {
    return Status(StatusCode::kCorrupt,
                  "bad_handshake: HELLO with sequence number " + std::to_string(hello.seq) + ", expected 0");
  }
  SessionId id{};
  std::memcpy(id.data(), hello.session.data(), kSessionHalfSize);
  std::memcpy(id.data() + kSessionHalfSize, server_half.data(), kSessionHalfSize);
  Frame reply = make_control_frame(FrameType::kHello, run_id, stage, 0, 0);
  reply.session = id;
  return reply;
}

bool make_wake_pipe(int fds[2]) {
  if (::pipe(fds) != 0) return false;
  for (int i = 0; i < 2; ++i) {
    ::fcntl(fds[i], F_SETFL, ::fcntl(fds[i], F_GETFL, 0) | O_NONBLOCK);
    ::fcntl(fds[i], F_SETFD, FD_CLOEXEC);
  }
  return true;
}

void close_wake_pipe(int fds[2]) {
  for (int i = 0; i < 2; ++i) {
    if (fds[i] >= 0) ::close(fds[i]);
    fds[i] = -1;
  }
}

void write_wake(int fd) {
  if (fd < 0) return;
  const uint8_t b = 1;
  (void)!::write(fd, &b, 1);  // EAGAIN (pipe full) is fine: a wake-up is pending
}

void drain_wake(int fd) {
  uint8_t buf[64];
  while (::read(fd, buf, sizeof(buf)) > 0) {
  }
}

Status FrameReader::fill(int fd) {
  uint8_t chunk[64 * 1024];
  // One maximal frame and the next header: then next() can always pop a frame
  // or say the stream is broken, so stopping here never stalls the reader.
  const size_t limit = max_frame_bytes_ + kFrameHeaderSize;
  for (;;) {
    if (buffered() >= limit) return Status();
    const ssize_t n = ::recv(fd, chunk, std::min(sizeof(chunk), limit - buffered()), MSG_DONTWAIT);
    if (n == 0) return Status(StatusCode::kClosed, "connection closed by peer");
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return Status();
      return errno_status("recv");
    }
    if (start_ > 0 && start_ >= buffer_.size() / 2) {
      buffer_.erase(buffer_.begin(), buffer_.begin() + static_cast<std::ptrdiff_t>(start_));
      start_ = 0;
    }
    buffer_.insert(buffer_.end(), chunk, chunk + n);
  }
}

FrameReader::Next FrameReader::next(std::vector<uint8_t>* frame, FrameError* error,
                                    std::string* reason) {
  const uint8_t* head = buffer_.data() + start_;
  const size_t have = buffered();
  if (have < kFrameHeaderSize) {
    // The magic can be checked early, so garbage is rejected without waiting.
    if (have >= 4 && std::memcmp(head, kFrameMagic.data(), kFrameMagic.size()) != 0) {
      size_t unused = 0;
      *error = peek_frame_length(head, have, max_frame_bytes_, &unused, reason);
      return Next::kBroken;
    }
    return Next::kNeedMore;
  }
  size_t total = 0;
  *error = peek_frame_length(head, have, max_frame_bytes_, &total, reason);
  if (*error != FrameError::kNone) return Next::kBroken;
  if (have < total) return Next::kNeedMore;
  frame->assign(head, head + total);
  start_ += total;
  if (start_ == buffer_.size()) clear();
  return Next::kFrame;
}

}  // namespace zl
