#include "zl/peer_link.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include <nlohmann/json.hpp>

#include "zl/log.h"

namespace zl {
// ---------------------------------------------------------------- Sender

namespace {

/// The largest frame without tensors: a header, a payload at the JSON limit, the tag.
constexpr size_t kMaxTensorlessFrameBytes = kFrameHeaderSize + kMaxFrameJsonBytes + kFrameTagSize;

/// What the Sender accepts from downstream: ACKs (and ERRORs) of its run,
/// and GRAD frames of [B,S,D] when it is owed gradients. ACK and ERROR carry
/// no tensors, so without gradients nothing larger than that is read from
/// the downstream, whatever the DATA maximum (options.max_frame_bytes) is.
FrameExpectation sender_expectation(const SenderOptions& options) {
  FrameExpectation expect;
  expect.run_id = options.run_id;
  const bool grads = options.max_grads_in_flight > 0;
  expect.max_frame_bytes = grads ? options.max_frame_bytes : std::min(options.max_frame_bytes, kMaxTensorlessFrameBytes);
  if (grads) {
    expect.batch = options.batch;
    expect.seq_len = options.seq_len;
    expect.hidden_size = options.hidden_size;
  }
  return expect;
}

}  // namespace

Sender::Sender(SenderOptions options)
    : options_(std::move(options)),
      link_(link_keys(options_.key, Channel::kData, options_.stage, LinkEnd::kClient), sender_expectation(options_),
            options_.run_id.value_or(RunId{}), options_.stage),
      shaper_(options_.profile) {}

Sender::~Sender() { stop(); }

Status Sender::start() {
  if (options_.max_in_flight == 0) {
    return Status(StatusCode::kInvalidArgument, "max_in_flight (D) is 0; it must be at least 1");
  }
  if (options_.max_grads_in_flight > 0 && (options_.batch <= 0 || options_.seq_len <= 0 || options_.hidden_size <= 0)) {
    return Status(StatusCode::kInvalidArgument,
                  "max_grads_in_flight is " + std::to_string(options_.max_grads_in_flight) + " but B, S, D are " +
                      std::to_string(options_.batch) + ", " + std::to_string(options_.seq_len) + ", " +
                      std::to_string(options_.hidden_size) + "; a link carrying gradients needs the hidden shape");
  }
  if (thread_.joinable()) return Status(StatusCode::kInvalidArgument, "sender already started");
  ZL_RETURN_IF_ERROR(link_.open());
  thread_ = std::thread([this] { run(); });
  return Status();
}

Status Sender::send(const Frame& frame, std::chrono::milliseconds timeout) {
  ZL_ASSIGN_OR_RETURN(const size_t wire_bytes, encoded_frame_size(frame, options_.max_frame_bytes));
  // A DATA entry owes a gradient when the link carries them: one of G credits.
  const bool owes = options_.max_grads_in_flight > 0 && frame.type == FrameType::kData;
  std::unique_lock<std::mutex> lock(mutex_);
  const bool room = changed_.wait_for(lock, timeout, [this, owes] {
    return stopping_ || (queue_.size() < options_.max_in_flight &&
                         (!owes || grad_credit_used_locked() < options_.max_grads_in_flight));
  });
  if (stopping_) return Status(StatusCode::kClosed, "sender is stopped");
  if (!room && queue_.size() >= options_.max_in_flight) {
    return Status(StatusCode::kTimeout,
                  std::to_string(queue_.size()) + " entries (D = " +
                      std::to_string(options_.max_in_flight) + ") still un-acknowledged after " +
                      std::to_string(timeout.count()) + " ms; downstream stalled?");
  }
  if (!room) {
    return Status(StatusCode::kTimeout,
                  std::to_string(owed_.size()) + " gradients owed and " + std::to_string(grads_.size()) +
                      " not taken (G = " + std::to_string(options_.max_grads_in_flight) + ") after " +
                      std::to_string(timeout.count()) +
                      " ms; downstream not sending GRAD frames, or next_grad() not called?");
  }
  if (owes) {
    owed_.emplace(frame.window, frame.micro_batch);
    stats_.max_grads_owed_seen = std::max(stats_.max_grads_owed_seen, grad_credit_used_locked());
  }
  if (frame.type == FrameType::kData) {
    last_sent_micro_batch_ = std::max(last_sent_micro_batch_.value_or(0), frame.micro_batch);
  }
  Entry e;
  e.window = frame.window;
  e.micro_batch = frame.micro_batch;
  e.frame = std::make_shared<const Frame>(frame);
  e.wire_bytes = wire_bytes;
  e.queued_at = SteadyClock::now();
  queue_.push_back(std::move(e));
  stats_.max_in_flight_seen = std::max(stats_.max_in_flight_seen, queue_.size());
  lock.unlock();
  link_.wake();
  return Status();
}

Status Sender::flush(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!changed_.wait_for(lock, timeout, [this] { return stopping_ || queue_.empty(); })) {
    return Status(StatusCode::kTimeout, std::to_string(queue_.size()) +
                                            " entries still un-acknowledged after " +
                                            std::to_string(timeout.count()) + " ms");
  }
  if (!queue_.empty()) return Status(StatusCode::kClosed, "sender stopped before flush completed");
  return Status();
}

Result<GradEntry> Sender::next_grad(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (options_.max_grads_in_flight == 0) {
    return Status(StatusCode::kInvalidArgument,
                  "this link carries no gradients (SenderOptions::max_grads_in_flight is 0)");
  }
  const bool ready = changed_.wait_for(lock, timeout, [this] { return stopping_ || !grads_.empty(); });
  if (stopping_) return Status(StatusCode::kClosed, "sender is stopped");
  if (!ready) {
    return Status(StatusCode::kTimeout, "no GRAD frame within " + std::to_string(timeout.count()) + " ms (" +
                                            std::to_string(owed_.size()) + " micro-batches owed a gradient)");
  }
  GradEntry e = std::move(grads_.front());
  grads_.pop_front();
  lock.unlock();
  changed_.notify_all();  // a gradient credit is free for send()
  return e;
}

size_t Sender::grads_owed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return owed_.size();
}

void Sender::set_peer(const std::string& host, uint16_t port) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    options_.host = host;
    options_.port = port;
    peer_changed_ = true;
  }
  link_.wake();
}

size_t Sender::in_flight() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return queue_.size();
}

bool Sender::connected() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return connected_;
}

SenderStats Sender::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void Sender::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    // Unblocks a send_all() stuck on a peer that stopped reading.
    link_.shutdown();
  }
  changed_.notify_all();
  link_.wake();
  if (thread_.joinable()) thread_.join();
}

bool Sender::connect_once() {
  std::string host;
  uint16_t port = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    host = options_.host;
    port = options_.port;
    peer_changed_ = false;
  }
  Result<Socket> sock = ReconnectingLink::dial(host, port, options_.connect_timeout);
  if (!sock.ok()) {
    log(LogLevel::kDebug, "sender: %s", sock.status().message().c_str());
    return false;
  }
  const Result<SessionId> session = link_.handshake(*sock, options_.connect_timeout);
  if (!session.ok()) {
    log(LogLevel::kWarn, "sender: %s:%u: %s", host.c_str(), static_cast<unsigned>(port),
        session.status().message().c_str());
    return false;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (stopping_) return false;
  link_.adopt(std::move(sock).value(), *session);
  connected_ = true;
  ++stats_.connects;
  shaper_.reset();
  // Everything not yet acknowledged goes out again, in order.
  for (auto& e : queue_) {
    e.sent_before = e.sent_before || e.sent;
    e.sent = false;
    e.deliver_at.reset();
  }
  log(LogLevel::kInfo, "sender: connected to %s:%u (%zu entries to (re)send)", host.c_str(),
      static_cast<unsigned>(port), queue_.size());
  return true;
}

void Sender::drop_connection(const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (link_.connected() && !stopping_) {
    log(LogLevel::kWarn, "sender: connection to %s:%u lost (%s); reconnecting",
        options_.host.c_str(), static_cast<unsigned>(options_.port), why.c_str());
  }
  link_.close();
  connected_ = false;
  for (auto& e : queue_) {
    e.sent_before = e.sent_before || e.sent;
    e.sent = false;
    e.deliver_at.reset();
  }
}

void Sender::handle_incoming() {
  const LinkReadResult read = link_.read_frames([this](const DecodeResult& r) { handle_frame(r); });
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.bytes_received += read.bytes;
  }
  if (read.broken) {
    log(LogLevel::kWarn, "sender: unreadable stream from downstream: %s: %s", frame_error_name(read.error),
        read.reason.c_str());
    drop_connection("bad frame from downstream");
    return;
  }
  if (!read.filled.ok()) drop_connection(read.filled.message());
}

void Sender::handle_frame(const DecodeResult& r) {
  if (!r.ok()) {
    log(LogLevel::kWarn, "sender: rejected frame from downstream: %s", r.reason.c_str());
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.rejected;
    stats_.last_reject_reason = r.reason;
    return;
  }
  if (r.frame.type == FrameType::kGrad) {
    std::lock_guard<std::mutex> lock(mutex_);
    handle_grad(r.frame);
    return;
  }
  if (r.frame.type == FrameType::kAck) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = queue_.begin(); it != queue_.end(); ++it) {
      if (it->micro_batch == r.frame.micro_batch && it->window == r.frame.window) {
        queue_.erase(it);
        ++stats_.acks;
        changed_.notify_all();
        break;
      }
    }
  } else if (r.frame.type == FrameType::kError) {
    log(LogLevel::kWarn, "sender: downstream reports an error: %s", r.frame.json.c_str());
  } else {
    log(LogLevel::kWarn, "sender: ignoring %s frame on the data link",
        frame_type_name(static_cast<uint16_t>(r.frame.type)));
  }
}

void Sender::handle_grad(const Frame& grad) {
  const auto key = std::make_pair(grad.window, grad.micro_batch);
  if (owed_.erase(key) == 0) {
    // Never sent, or its gradient came already (a downstream that restarted
    // and sent it again): nothing waits for it, and taking it would let
    // GRADs outgrow the bound G.
    ++stats_.grads_refused;
    stats_.last_reject_reason =
        options_.max_grads_in_flight == 0
            ? std::string("GRAD frame on a link that carries no gradients (max_grads_in_flight 0)")
            : "GRAD for window " + std::to_string(grad.window) + ", micro-batch " + std::to_string(grad.micro_batch) +
                  ", which is not owed a gradient (never sent, or its gradient arrived already)";
    log(LogLevel::kWarn, "sender: refused: %s", stats_.last_reject_reason.c_str());
    return;
  }
  GradEntry e;
  e.window = grad.window;
  e.micro_batch = grad.micro_batch;
  const uint64_t newest = last_sent_micro_batch_.value_or(grad.micro_batch);
  e.delay = newest > grad.micro_batch ? newest - grad.micro_batch : 0;
  e.frame = grad;
  ++stats_.grads_received;
  stats_.sum_grad_delay += e.delay;
  stats_.max_grad_delay = std::max(stats_.max_grad_delay, e.delay);
  grads_.push_back(std::move(e));
  changed_.notify_all();
}

std::optional<Sender::NextSend> Sender::next_to_send() {
  NextSend next;
  next.deliver_at = SteadyClock::now() + std::chrono::seconds(1);
  std::lock_guard<std::mutex> lock(mutex_);
  if (peer_changed_) {
    link_.close();
    connected_ = false;
    return std::nullopt;
  }
  for (auto& e : queue_) {
    if (e.sent) continue;
    if (!e.deliver_at) {
      const auto handed_over = e.sent_before ? SteadyClock::now() : e.queued_at;
      e.deliver_at = shaper_.schedule(e.wire_bytes, handed_over);
    }
    next.frame = e.frame;
    next.wire_bytes = e.wire_bytes;
    next.deliver_at = *e.deliver_at;
    next.resend = e.sent_before;
    break;
  }
  return next;
}

void Sender::transmit(const NextSend& next) {
  const Status s = link_.send_frame(*next.frame, options_.max_frame_bytes);
  if (!s.ok()) {
    drop_connection(s.message());
    return;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& e : queue_) {
    if (e.frame == next.frame) {
      e.sent = true;
      break;
    }
  }
  ++stats_.transmissions;
  stats_.bytes_sent += next.wire_bytes;
  if (next.resend) ++stats_.resends;
}

void Sender::run() {
  Backoff backoff(options_.backoff_initial, options_.backoff_max);
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) break;
    }
    if (!link_.connected()) {
      if (!connect_once()) {
        link_.sleep(backoff.next());
        continue;
      }
      backoff.reset();
    }
    const std::optional<NextSend> next = next_to_send();
    if (!next) continue;  // the peer changed: connect to the new one

    const Result<bool> readable = link_.wait_for_input(next->deliver_at);
    if (!readable.ok()) {
      drop_connection(readable.status().message());
      continue;
    }
    if (*readable) {
      handle_incoming();
      if (!link_.connected()) continue;
    }
    if (!next->frame || SteadyClock::now() < next->deliver_at) continue;
    transmit(*next);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  link_.close();
  connected_ = false;
}

// ---------------------------------------------------------------- Receiver

namespace {

/// Input log entries are sealed under the stage's own log key, outside any session.
FrameExpectation input_log_expectation(FrameExpectation expect) {
  expect.session = SessionId{};
  expect.min_seq = 0;
  return expect;
}

}  // namespace

Receiver::Receiver(ReceiverOptions options)
    : options_(std::move(options)),
      keys_(link_keys(options_.key, Channel::kData, options_.expect.stage.value_or(0), LinkEnd::kServer)),
      log_(options_.log_dir, derive_frame_key(options_.key, KeyPurpose::kInputLog, options_.stage),
           input_log_expectation(options_.expect)),
      reader_(options_.expect.max_frame_bytes),
      up_shaper_(options_.profile),
      next_micro_batch_(options_.first_micro_batch),
      local_backoff_(options_.local_error_backoff_initial, options_.local_error_backoff_max) {}

Receiver::~Receiver() {
  stop();
  close_wake_pipe(wake_pipe_);
}

Status Receiver::start() {
  if (options_.log_dir.empty()) {
    return Status(StatusCode::kInvalidArgument, "receiver needs a log_dir for its input log");
  }
  if (options_.max_pending == 0) {
    return Status(StatusCode::kInvalidArgument, "max_pending is 0; it must be at least 1");
  }
  if (!options_.expect.stage) {
    return Status(StatusCode::kInvalidArgument,
                  "receiver needs expect.stage, the upstream stage k of the link k -> k+1: the link's keys "
                  "derive from it");
  }
  if (options_.pre_auth.max_connections == 0) {
    return Status(StatusCode::kInvalidArgument,
                  "pre_auth.max_connections is 0; it must be at least 1 (a reconnecting upstream needs one)");
  }
  if (options_.pre_auth.max_frame_bytes < kHelloFrameBytes) {
    return Status(StatusCode::kInvalidArgument,
                  "pre_auth.max_frame_bytes is " + std::to_string(options_.pre_auth.max_frame_bytes) +
                      "; it must be at least " + std::to_string(kHelloFrameBytes) + ", the size of a HELLO");
  }
  ZL_RETURN_IF_ERROR(log_.open());
  for (const auto& c : log_.corrupt()) {
    log(LogLevel::kError, "receiver: input log entry %s unusable: %s", c.path.c_str(),
        c.reason.c_str());
  }
  if (options_.committed_window) {
    ZL_RETURN_IF_ERROR(log_.delete_through(*options_.committed_window));
  }
  ZL_ASSIGN_OR_RETURN(ListeningSocket listening, listen_tcp(options_.host, options_.port));
  listener_ = std::move(listening.socket);
  port_ = listening.port;
  ::fcntl(listener_.fd(), F_SETFL, ::fcntl(listener_.fd(), F_GETFL, 0) | O_NONBLOCK);
  if (!make_wake_pipe(wake_pipe_)) {
    return Status(StatusCode::kIoError, std::string("pipe: ") + std::strerror(errno));
  }
  log(LogLevel::kInfo, "receiver: stage %u listening on %s:%u, %zu logged entries to replay",
      options_.stage, options_.host.c_str(), static_cast<unsigned>(port_), log_.size());
  thread_ = std::thread([this] { run(); });
  return Status();
}

void Receiver::wake() { write_wake(wake_pipe_[1]); }

size_t Receiver::pending_locked() const {
  size_t n = 0;
  for (const auto& e : log_.entries()) {
    if (e.micro_batch >= next_micro_batch_) ++n;
  }
  return n;
}

Result<InputEntry> Receiver::next(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  const uint64_t mb = next_micro_batch_;
  const bool ready = arrived_.wait_for(lock, timeout, [&] {
    return stopping_ || log_.contains(mb);
  });
  if (stopping_) return Status(StatusCode::kClosed, "receiver is stopped");
  if (!ready) {
    return Status(StatusCode::kTimeout, "micro-batch " + std::to_string(mb) +
                                            " did not arrive within " +
                                            std::to_string(timeout.count()) + " ms");
  }
  lock.unlock();
  ZL_ASSIGN_OR_RETURN(Frame frame, log_.read(mb));
  lock.lock();
  ++next_micro_batch_;
  lock.unlock();
  wake();  // room for one more pending entry
  InputEntry entry;
  entry.window = frame.window;
  entry.micro_batch = frame.micro_batch;
  entry.frame = std::move(frame);
  return entry;
}

Status Receiver::send_grad(const Frame& grad, std::chrono::milliseconds timeout) {
  if (grad.type != FrameType::kGrad) {
    const char* seen = frame_type_name(static_cast<uint16_t>(grad.type));
    return Status(StatusCode::kInvalidArgument,
                  std::string("send_grad sends GRAD frames, not ") + (seen ? seen : "an unknown type"));
  }
  const FrameExpectation& e = options_.expect;
  if (e.batch > 0 && e.seq_len > 0 && e.hidden_size > 0) {
    if (const std::string bad = check_grad_frame(grad, e.batch, e.seq_len, e.hidden_size); !bad.empty()) {
      return Status(StatusCode::kInvalidArgument, bad + " (window " + std::to_string(grad.window) +
                                                      ", micro-batch " + std::to_string(grad.micro_batch) + ")");
    }
  }
  ZL_ASSIGN_OR_RETURN(const size_t wire_bytes, encoded_frame_size(grad, e.max_frame_bytes));
  std::unique_lock<std::mutex> lock(mutex_);
  const bool room = grad_room_.wait_for(lock, timeout, [this] {
    return stopping_ || grad_outbox_.size() < std::max<size_t>(options_.max_grads_queued, 1);
  });
  if (stopping_) return Status(StatusCode::kClosed, "receiver is stopped");
  if (!room) {
    return Status(StatusCode::kTimeout, std::to_string(grad_outbox_.size()) +
                                            " GRAD frames still not written upstream after " +
                                            std::to_string(timeout.count()) + " ms; upstream disconnected?");
  }
  grad_outbox_.push_back(OutboundGrad{grad, wire_bytes, SteadyClock::now(), std::nullopt});
  lock.unlock();
  wake();
  return Status();
}

Status Receiver::flush_grads(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  const bool written = grad_room_.wait_for(lock, timeout, [this] { return stopping_ || grad_outbox_.empty(); });
  if (stopping_) return Status(StatusCode::kClosed, "receiver is stopped");
  if (!written) {
    return Status(StatusCode::kTimeout, std::to_string(grad_outbox_.size()) +
                                            " GRAD frames still not written upstream after " +
                                            std::to_string(timeout.count()) + " ms");
  }
  return Status();
}

std::optional<SteadyClock::time_point> Receiver::write_grads() {
  while (conn_.valid()) {
    Frame grad;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (grad_outbox_.empty()) return std::nullopt;
      OutboundGrad& next = grad_outbox_.front();
      if (!next.deliver_at) {
        // On the wire from when it was queued, or from when this connection came (it waited for one).
        next.deliver_at = up_shaper_.schedule(next.wire_bytes, std::max(next.queued_at, connected_at_));
      }
      if (SteadyClock::now() < *next.deliver_at) return next.deliver_at;
      grad = next.frame;
    }
    // In the data-up direction's sequence, between the ACKs.
    const Status s = write_up(conn_.fd(), session_.stamp(std::move(grad)));
    if (!s.ok()) {
      // Still queued: it goes out on the upstream's next connection.
      log(LogLevel::kWarn, "receiver: cannot send GRAD: %s", s.message().c_str());
      conn_.close();
      reader_.clear();
      return std::nullopt;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      grad_outbox_.pop_front();
      ++stats_.grads_sent;
    }
    grad_room_.notify_all();
  }
  return std::nullopt;
}

Status Receiver::write_up(int fd, const Frame& frame) {
  ZL_ASSIGN_OR_RETURN(const std::vector<uint8_t> bytes, encode_frame(frame, keys_.send, options_.expect.max_frame_bytes));
  ZL_RETURN_IF_ERROR(send_all(fd, bytes.data(), bytes.size()));
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.bytes_sent += bytes.size();
  return Status();
}

void Receiver::count_received(size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.bytes_received += bytes;
}

Status Receiver::window_committed(uint64_t window) { return log_.delete_through(window); }

ReceiverStats Receiver::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void Receiver::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
  }
  arrived_.notify_all();
  grad_room_.notify_all();
  wake();
  if (thread_.joinable()) thread_.join();
  conn_.close();
  listener_.close();
}

void Receiver::reject(const std::string& reason, bool send_error) {
  if (send_error) {
    reject_on(&conn_, &reader_, reason, &session_);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.rejected;
    stats_.last_reject_reason = reason;
  }
  log(LogLevel::kWarn, "receiver: stage %u rejected a frame: %s", options_.stage, reason.c_str());
  conn_.close();
  reader_.clear();
}

void Receiver::reject_on(Socket* sock, FrameReader* reader, const std::string& reason, SessionState* session) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.rejected;
    stats_.last_reject_reason = reason;
  }
  log(LogLevel::kWarn, "receiver: stage %u rejected a frame: %s", options_.stage, reason.c_str());
  if (sock->valid()) {
    // Best effort: tells an honest but misconfigured upstream why (in its
    // session once there is one; before the handshake it goes out with none).
    Frame err = make_control_frame(FrameType::kError, options_.expect.run_id.value_or(RunId{}),
                                   options_.stage, 0, 0,
                                   nlohmann::json{{"reason", reason}}.dump(
                                       -1, ' ', false, nlohmann::json::error_handler_t::replace));
    if (session != nullptr) err = session->stamp(std::move(err));
    (void)write_up(sock->fd(), err);
  }
  sock->close();
  reader->clear();
}

void Receiver::handle_frame(const std::vector<uint8_t>& bytes) {
  count_received(bytes.size());
  const DecodeResult r =
      decode_frame(bytes.data(), bytes.size(), keys_.receive, session_.expect(options_.expect));
  if (r.ok()) session_.accepted = r.frame.seq;
  handle_decoded(r);
}

void Receiver::handle_decoded(const DecodeResult& r) {
  if (!r.ok()) {
    reject(r.reason, true);
    return;
  }
  if (r.frame.type != FrameType::kData) {
    log(LogLevel::kWarn, "receiver: ignoring %s frame on the data link",
        frame_type_name(static_cast<uint16_t>(r.frame.type)));
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.ignored;
    return;
  }
  const uint64_t mb = r.frame.micro_batch;
  const uint64_t window = r.frame.window;
  bool duplicate = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    duplicate = mb < next_micro_batch_ || log_.contains(mb);
  }
  if (duplicate) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.duplicates;
  } else {
    // Durable before acknowledged: the ACK releases the sender's copy. The
    // entry is sealed again under the log key, outside the session, so a
    // restarted stage can still open it.
    const Status s = log_.append_frame(r.frame);
    if (!s.ok()) {
      // A local error: retrying at once would only loop (reconnect, re-send, fail again), so pause.
      const std::chrono::milliseconds pause = local_backoff_.next();
      paused_until_ = SteadyClock::now() + pause;
      log(LogLevel::kError, "receiver: cannot log micro-batch %llu: %s; not reading from upstream for %lld ms",
          static_cast<unsigned long long>(mb), s.message().c_str(), static_cast<long long>(pause.count()));
      {
        std::lock_guard<std::mutex> lock(mutex_);
        ++stats_.local_errors;
        stats_.last_local_error = s.message();
      }
      conn_.close();  // no ACK: the sender re-sends after reconnecting
      reader_.clear();
      return;
    }
    local_backoff_.reset();
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.accepted;
    arrived_.notify_all();
  }
  const Frame ack = session_.stamp(make_control_frame(FrameType::kAck, r.frame.run_id, options_.stage, window, mb));
  const Status s = write_up(conn_.fd(), ack);
  if (!s.ok()) {
    log(LogLevel::kWarn, "receiver: cannot send ACK: %s", s.message().c_str());
    conn_.close();
    reader_.clear();
  }
}

void Receiver::serve_connection() {
  // Frames already buffered are handled only while there is room, so a
  // stalled consumer stops the acknowledgements (back-pressure).
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_ || pending_locked() >= options_.max_pending) return;
    }
    if (!conn_.valid()) return;
    const FrameReader::Popped popped = reader_.pop();
    if (popped.next == FrameReader::Next::kNeedMore) return;
    if (popped.next == FrameReader::Next::kBroken) {
      reject(std::string(frame_error_name(popped.error)) + ": " + popped.reason, true);
      return;
    }
    handle_frame(popped.frame);
  }
}

void Receiver::serve_candidate(size_t index) {
  Candidate& c = candidates_[index];
  const Status filled = c.reader.fill(c.sock.fd());
  for (;;) {
    const FrameReader::Popped popped = c.reader.pop();
    if (popped.next == FrameReader::Next::kBroken) {
      reject_on(&c.sock, &c.reader, std::string(frame_error_name(popped.error)) + ": " + popped.reason,
                c.session ? &*c.session : nullptr);
      candidates_.erase(candidates_.begin() + static_cast<std::ptrdiff_t>(index));
      return;
    }
    if (popped.next == FrameReader::Next::kNeedMore) {
      if (!filled.ok()) {  // closed (or failed) before a whole first frame
        candidates_.erase(candidates_.begin() + static_cast<std::ptrdiff_t>(index));
      }
      return;
    }
    if (!c.session) {
      if (!answer_hello(index, popped.frame)) return;
      continue;
    }
    const DecodeResult r = decode_frame(popped.frame.data(), popped.frame.size(), keys_.receive,
                                        c.session->expect(options_.expect));
    if (!r.ok()) {
      // An unauthenticated, replayed (or misconfigured) newcomer: the current upstream stays.
      reject_on(&c.sock, &c.reader, r.reason, &*c.session);
      candidates_.erase(candidates_.begin() + static_cast<std::ptrdiff_t>(index));
      return;
    }
    count_received(popped.frame.size());
    promote_candidate(index, r, filled);
    return;
  }
}

bool Receiver::answer_hello(size_t index, const std::vector<uint8_t>& frame) {
  Candidate& c = candidates_[index];
  // The handshake (PROTOCOL.md §6): the client's HELLO, answered with a
  // fresh server half, so nothing recorded from another connection can
  // pass for this one.
  const DecodeResult hello = decode_frame(frame.data(), frame.size(), keys_.receive, options_.expect);
  Result<Frame> reply = Status(StatusCode::kCorrupt, hello.reason);
  if (hello.ok()) {
    std::array<uint8_t, kSessionHalfSize> half{};
    if (options_.session_random) {
      options_.session_random(half.data(), half.size());
    } else {
      random_bytes(half.data(), half.size());
    }
    reply = server_handshake(hello.frame, options_.expect.run_id.value_or(RunId{}), options_.stage, half);
  }
  if (!reply.ok()) {
    reject_on(&c.sock, &c.reader, reply.status().message(), nullptr);
    candidates_.erase(candidates_.begin() + static_cast<std::ptrdiff_t>(index));
    return false;
  }
  if (!write_frame(c.sock.fd(), *reply, keys_.send).ok()) {
    candidates_.erase(candidates_.begin() + static_cast<std::ptrdiff_t>(index));
    return false;
  }
  c.session = SessionState{};
  c.session->id = reply->session;
  // Its first frame in the session may be a whole DATA entry. One such
  // newcomer at a time: an older one (a stale attempt of the upstream's, or
  // a replayed HELLO) goes, so a recorded HELLO buys at most one frame.
  c.reader.set_max_frame_bytes(options_.expect.max_frame_bytes);
  for (size_t j = 0; j < candidates_.size(); ++j) {
    if (j != index && candidates_[j].session && candidates_[j].sock.valid()) {
      log(LogLevel::kInfo, "receiver: a newer connection completed its HELLO; closing the older one");
      drop_candidate(&candidates_[j]);
    }
  }
  {
    // The handshake needs no room; what follows it does (back-pressure).
    std::lock_guard<std::mutex> lock(mutex_);
    if (pending_locked() >= options_.max_pending) return false;
  }
  return SteadyClock::now() >= paused_until_;
}

void Receiver::promote_candidate(size_t index, const DecodeResult& first, const Status& filled) {
  Candidate& c = candidates_[index];
  // The newcomer holds the link's key and answered this session: it becomes the upstream.
  if (conn_.valid()) {
    log(LogLevel::kInfo, "receiver: upstream reconnected; dropping its old connection");
  }
  conn_ = std::move(c.sock);
  reader_ = std::move(c.reader);
  session_ = *c.session;
  // A new connection's wire is empty: the GRADs still queued go out on it from now.
  connected_at_ = SteadyClock::now();
  up_shaper_.reset();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (OutboundGrad& g : grad_outbox_) g.deliver_at.reset();
  }
  session_.accepted = first.frame.seq;
  candidates_.erase(candidates_.begin() + static_cast<std::ptrdiff_t>(index));
  handle_decoded(first);
  serve_connection();  // frames buffered behind the first one
  if (!filled.ok() && conn_.valid()) {
    conn_.close();
    reader_.clear();
  }
}

void Receiver::drop_candidate(Candidate* c) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.candidates_dropped;  // counted before the peer can see the close
  }
  c->sock.close();
  c->reader = FrameReader(options_.pre_auth.max_frame_bytes);  // frees what it buffered
}

int Receiver::sweep_candidates(SteadyClock::time_point now, int timeout_ms) {
  // Newcomers that did not authenticate in time are closed (and those dropped already, erased).
  for (size_t i = candidates_.size(); i-- > 0;) {
    Candidate& c = candidates_[i];
    const SteadyClock::time_point deadline = c.deadline(options_.pre_auth);
    if (c.sock.valid() && deadline <= now) {
      log(LogLevel::kWarn, "receiver: a new connection sent no valid %s within %lld ms; closing it",
          c.session ? "frame after its HELLO" : "HELLO",
          static_cast<long long>(
              std::chrono::duration_cast<std::chrono::milliseconds>(deadline - c.accepted_at).count()));
      drop_candidate(&c);
    }
    if (!c.sock.valid()) {
      candidates_.erase(candidates_.begin() + static_cast<std::ptrdiff_t>(i));
      continue;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now);
    timeout_ms = std::min<int>(timeout_ms, static_cast<int>(left.count()) + 1);
  }
  return timeout_ms;
}

void Receiver::fill_poll_set(bool room, std::vector<pollfd>* fds) const {
  fds->assign({{wake_pipe_[0], POLLIN, 0},
               {listener_.fd(), POLLIN, 0},
               {room && conn_.valid() ? conn_.fd() : -1, POLLIN, 0}});
  // A candidate's HELLO is answered even while there is no room, so a
  // reconnecting sender's handshake does not wait for the consumer.
  for (const auto& c : candidates_) fds->push_back({room || !c.session ? c.sock.fd() : -1, POLLIN, 0});
}

void Receiver::read_upstream() {
  const Status filled = reader_.fill(conn_.fd());
  serve_connection();
  if (!filled.ok() && conn_.valid()) {
    // Frames already buffered were handled above (as far as room allowed).
    if (filled.code() != StatusCode::kClosed) {
      log(LogLevel::kWarn, "receiver: upstream connection: %s", filled.message().c_str());
    }
    conn_.close();
    reader_.clear();
  }
}

void Receiver::accept_newcomers() {
  // Every pending connection (the listener is non-blocking), so a burst of
  // connections cannot fill the accept queue between two polls.
  for (int accepted = 0; accepted < 64; ++accepted) {
    Result<Socket> incoming = accept_tcp(listener_);
    if (!incoming.ok() && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (!incoming.ok()) {
      log(LogLevel::kWarn, "receiver: %s", incoming.status().message().c_str());
      break;
    }
    // The budget counts connections still waiting for their HELLO; the
    // oldest of them makes room (never a newcomer past its HELLO).
    size_t waiting = 0;
    for (const auto& c : candidates_) waiting += c.sock.valid() && !c.session;
    if (waiting >= options_.pre_auth.max_connections) {
      log(LogLevel::kWarn, "receiver: %zu connections waiting for their HELLO; closing the oldest", waiting);
      for (auto& c : candidates_) {
        if (c.sock.valid() && !c.session) {
          drop_candidate(&c);
          break;
        }
      }
    }
    candidates_.push_back(Candidate{std::move(incoming).value(), FrameReader(options_.pre_auth.max_frame_bytes),
                                    SteadyClock::now(), {}});
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.connections;
  }
}

void Receiver::run() {
  std::vector<pollfd> fds;
  for (;;) {
    bool room = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) break;
      room = pending_locked() < options_.max_pending;
    }
    const auto now = SteadyClock::now();
    int timeout_ms = 1000;
    if (now < paused_until_) {  // after a local error (handle_decoded): read nothing until then
      room = false;
      timeout_ms = static_cast<int>(
                       std::chrono::duration_cast<std::chrono::milliseconds>(paused_until_ - now).count()) + 1;
    }
    if (room && conn_.valid()) serve_connection();
    // Gradients go upstream whether or not there is room for DATA; one not yet due on the shaped wire cuts the wait.
    if (const std::optional<SteadyClock::time_point> due = write_grads()) {
      const auto wait = std::chrono::ceil<std::chrono::milliseconds>(*due - SteadyClock::now()).count();
      timeout_ms = std::min<int>(timeout_ms, static_cast<int>(std::max<int64_t>(wait, 0)));
    }
    timeout_ms = sweep_candidates(now, timeout_ms);

    fill_poll_set(room, &fds);
    const size_t num_candidates = candidates_.size();
    const int rc = ::poll(fds.data(), static_cast<nfds_t>(fds.size()), timeout_ms);
    if (rc < 0) {
      if (errno == EINTR) continue;
      log(LogLevel::kError, "receiver: poll: %s", std::strerror(errno));
      break;
    }
    if (fds[0].revents) drain_wake(wake_pipe_[0]);
    if (fds[2].fd >= 0 && (fds[2].revents & (POLLIN | POLLHUP | POLLERR))) read_upstream();
    // Candidates, newest first so that erasing keeps the lower indices valid.
    // One that another dropped meanwhile (a newer HELLO) is skipped and erased at the next sweep.
    for (size_t i = num_candidates; i-- > 0;) {
      const pollfd& p = fds[3 + i];
      if (p.fd >= 0 && candidates_[i].sock.valid() && (p.revents & (POLLIN | POLLHUP | POLLERR))) serve_candidate(i);
    }
    if (fds[1].revents & POLLIN) accept_newcomers();
  }
  candidates_.clear();
}

}  // namespace zl
