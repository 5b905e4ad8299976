#include "zl/reconnecting_link.h"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace zl {
namespace {

using SteadyClock = std::chrono::steady_clock;

/// poll() timeout until `until`, rounded up so the deadline has passed when
/// it returns, and capped at 1 s so the owner's loop re-checks its state.
int poll_timeout_ms(SteadyClock::time_point until) {
  const int64_t left = std::chrono::duration_cast<std::chrono::milliseconds>(until - SteadyClock::now()).count();
  return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(left + 1, 1000)));
}

}  // namespace

std::chrono::milliseconds Backoff::next() {
  const std::chrono::milliseconds delay = next_;
  next_ = std::min(next_ * 2, max_);
  return delay;
}

ReconnectingLink::ReconnectingLink(const LinkKeys& keys, const FrameExpectation& expect, const RunId& run_id,
                                   uint32_t stage)
    : keys_(keys), expect_(expect), run_id_(run_id), stage_(stage), reader_(expect.max_frame_bytes) {}

ReconnectingLink::~ReconnectingLink() { close_wake_pipe(wake_pipe_); }

Status ReconnectingLink::open() {
  if (!make_wake_pipe(wake_pipe_)) {
    return Status(StatusCode::kIoError, std::string("pipe: ") + std::strerror(errno));
  }
  return Status();
}

void ReconnectingLink::wake() { write_wake(wake_pipe_[1]); }

Result<Socket> ReconnectingLink::dial(const std::string& host, uint16_t port, std::chrono::milliseconds timeout) {
  ZL_ASSIGN_OR_RETURN(Socket sock, connect_tcp(host, port, timeout));
  const int one = 1;
  ::setsockopt(sock.fd(), SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  return sock;
}

Result<SessionId> ReconnectingLink::handshake(const Socket& sock, std::chrono::milliseconds timeout) const {
  return client_handshake(sock.fd(), keys_, run_id_, stage_, expect_, timeout);
}

void ReconnectingLink::adopt(Socket sock, const SessionId& session) {
  std::lock_guard<std::mutex> lock(conn_mutex_);
  conn_ = std::move(sock);
  reader_.clear();
  session_ = SessionState{};
  session_.id = session;
}

void ReconnectingLink::close() {
  std::lock_guard<std::mutex> lock(conn_mutex_);
  conn_.close();
  reader_.clear();
}

void ReconnectingLink::shutdown() {
  std::lock_guard<std::mutex> lock(conn_mutex_);
  conn_.shutdown();
}

Status ReconnectingLink::send_frame(const Frame& frame, size_t max_frame_bytes) {
  SessionState next = session_;
  ZL_ASSIGN_OR_RETURN(const std::vector<uint8_t> bytes, encode_frame(next.stamp(frame), keys_.send, max_frame_bytes));
  session_ = next;  // a frame that cannot be encoded uses no sequence number
  return send_all(conn_.fd(), bytes.data(), bytes.size());
}

Result<bool> ReconnectingLink::wait_for_input(SteadyClock::time_point until) {
  pollfd fds[2] = {{wake_pipe_[0], POLLIN, 0}, {conn_.valid() ? conn_.fd() : -1, POLLIN, 0}};
  const int rc = ::poll(fds, 2, poll_timeout_ms(until));
  if (rc < 0) {
    if (errno == EINTR) return false;
    return Status(StatusCode::kIoError, std::string("poll: ") + std::strerror(errno));
  }
  if (rc > 0 && fds[0].revents) drain_wake(wake_pipe_[0]);
  return rc > 0 && fds[1].fd >= 0 && (fds[1].revents & (POLLIN | POLLHUP | POLLERR)) != 0;
}

void ReconnectingLink::sleep(std::chrono::milliseconds duration) {
  pollfd p{wake_pipe_[0], POLLIN, 0};
  ::poll(&p, 1, static_cast<int>(duration.count()));
  drain_wake(wake_pipe_[0]);
}

LinkReadResult ReconnectingLink::read_frames(const std::function<void(const DecodeResult&)>& on_frame) {
  LinkReadResult result;
  result.filled = reader_.fill(conn_.fd());
  for (;;) {
    const FrameReader::Popped popped = reader_.pop();
    if (popped.next == FrameReader::Next::kNeedMore) break;
    if (popped.next == FrameReader::Next::kBroken) {
      result.broken = true;
      result.error = popped.error;
      result.reason = popped.reason;
      return result;
    }
    result.bytes += popped.frame.size();
    const DecodeResult r =
        decode_frame(popped.frame.data(), popped.frame.size(), keys_.receive, session_.expect(expect_));
    if (r.ok()) session_.accepted = r.frame.seq;
    on_frame(r);
  }
  return result;
}

}  // namespace zl
