// The ends every peer-link test starts from: stage 0's sender and stage 1's
// receiver of a link 0 -> 1 with (kB, kS, kD) hidden states, and an upstream
// and a downstream played by hand. A test file takes them all with
// `using namespace testing;` inside its `namespace zl`.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "net_test_support.h"
#include "zl/peer_link.h"

namespace zl::testing {

constexpr int64_t kB = 1, kS = 3, kD = 4;  // batch, sequence length, hidden size of the test frames

inline ReceiverOptions receiver_options(const std::string& log_dir, uint16_t port = 0) {
  ReceiverOptions o;
  o.port = port;
  o.key = test_key();
  o.expect.run_id = test_run();
  o.expect.stage = 0;  // frames come from stage 0
  o.expect.batch = kB;
  o.expect.seq_len = kS;
  o.expect.hidden_size = kD;
  o.stage = 1;
  o.log_dir = log_dir;
  return o;
}

inline SenderOptions sender_options(uint16_t port, size_t d = 2) {
  SenderOptions o;
  o.port = port;
  o.key = test_key();
  o.run_id = test_run();
  o.max_in_flight = d;
  o.backoff_initial = std::chrono::milliseconds(10);
  o.backoff_max = std::chrono::milliseconds(100);
  return o;
}

/// The keys of the link 0 -> 1 at its upstream (client) end.
inline LinkKeys upstream_keys() { return link_keys(test_key(), Channel::kData, 0, LinkEnd::kClient); }

/// The keys of the link 0 -> 1 at its downstream (server) end.
inline LinkKeys downstream_keys() { return link_keys(test_key(), Channel::kData, 0, LinkEnd::kServer); }

/// Plays a downstream by hand on an accepted connection: the server's
/// handshake; then `session` stamps its frames.
inline bool accept_handshake(const Socket& conn, SessionState* session, uint8_t server_half = 0x5e) {
  const Result<DecodeResult> hello = read_frame(conn.fd(), downstream_keys().receive, {}, std::chrono::milliseconds(2000));
  if (!hello.ok() || !hello->ok()) return false;
  std::array<uint8_t, kSessionHalfSize> half{};
  half.fill(server_half);
  const Result<Frame> reply = server_handshake(hello->frame, test_run(), 1, half);
  if (!reply.ok()) return false;
  session->id = reply->session;
  return write_frame(conn.fd(), *reply, downstream_keys().send).ok();
}

/// Plays an upstream by hand: one raw connection to the receiver, after the
/// client handshake (unless `handshake` is false) frames stamped with its session.
struct RawUpstream {
  Socket sock;
  SessionState session;
  LinkKeys keys = upstream_keys();
  std::vector<uint8_t> sent;  // every byte written, for replay tests
  explicit RawUpstream(uint16_t port, bool handshake = true) {
    using namespace std::chrono_literals;
    sock = value_or_fail(connect_tcp("127.0.0.1", port, 1000ms));
    if (handshake) session.id = value_or_fail(client_handshake(sock.fd(), keys, test_run(), 0, {}, 2000ms));
  }
  void send_bytes(const std::vector<uint8_t>& b) {
    sent.insert(sent.end(), b.begin(), b.end());
    ASSERT_TRUE(send_all(sock.fd(), b.data(), b.size()).ok());
  }
  /// `f` stamped with the session and the next sequence number, sealed under `key`.
  std::vector<uint8_t> sealed(const Frame& f, const FrameKey* key = nullptr) {
    return value_or_fail(encode_frame(session.stamp(f), key ? *key : keys.send));
  }
  void send(const Frame& f) { send_bytes(sealed(f)); }
  /// The receiver's next frame to this upstream, or (in `status`) why none came.
  DecodeResult reply(Status* status) {
    using namespace std::chrono_literals;
    Result<DecodeResult> r = read_frame(sock.fd(), keys.receive, {}, 2000ms);
    *status = r.status();
    return r.ok() ? std::move(r).value() : DecodeResult{};
  }
  /// Sends `f` in the session; the receiver's answer (an ACK), or why none came.
  DecodeResult send_and_reply(const Frame& f, Status* status) {
    *status = write_frame(sock.fd(), session.stamp(f), keys.send);
    return status->ok() ? reply(status) : DecodeResult{};
  }
};

}  // namespace zl::testing
