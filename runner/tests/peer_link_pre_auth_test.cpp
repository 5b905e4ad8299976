// Issue 28 item 2: what a stranger (no run key) can make a stage's Receiver
// hold. Three connections that each announced a 64 MiB frame and then sent
// 63 MiB took a stage from 10 to 237 MiB RSS, for 30 s per connection: the
// receiver sized every unauthenticated connection's reader for the full
// frame maximum. These tests replay that attack on loopback, measure this
// process's RSS, and check that a legitimate upstream still gets through.
#include "zl/peer_link.h"

#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "peer_link_test_support.h"

namespace zl {
namespace {

using namespace std::chrono_literals;
using std::chrono::milliseconds;
using namespace testing;  // zl::testing: the ends of peer_link_test_support.h
constexpr size_t kMiB = size_t{1} << 20;

ReceiverOptions receiver_options(const std::string& log_dir) {
  ReceiverOptions o = testing::receiver_options(log_dir);
  o.max_pending = 64;
  return o;
}

/// This process's resident set (VmRSS in /proc/self/status), in bytes.
size_t rss_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    size_t kib = 0;
    if (std::sscanf(line.c_str(), "VmRSS: %zu kB", &kib) == 1) return kib * 1024;
  }
  ADD_FAILURE() << "no VmRSS in /proc/self/status";
  return 0;
}

/// The attack's header: a well-formed version 2 DATA header announcing
/// `total` bytes (64 MiB, the receiver's frame maximum, so only a pre-auth
/// limit refuses it), everything else zero. No key is needed to write it.
std::vector<uint8_t> header_claiming(uint32_t total) {
  std::vector<uint8_t> h(kFrameHeaderSize, 0);
  std::memcpy(h.data(), kFrameMagic.data(), kFrameMagic.size());
  const uint16_t version = kFrameVersion, type = static_cast<uint16_t>(FrameType::kData);
  std::memcpy(h.data() + 4, &version, 2);  // little-endian hosts only, like the tests' other raw frames
  std::memcpy(h.data() + 6, &type, 2);
  std::memcpy(h.data() + 8, &total, 4);
  return h;
}

/// Writes up to `bytes` of junk to `fd` within `timeout`; stops early, without
/// failing, once the peer closes or resets the connection. Returns what was written.
size_t stream_junk(int fd, size_t bytes, milliseconds timeout) {
  const std::vector<uint8_t> chunk(256 * 1024, 0xa5);
  const auto deadline = SteadyClock::now() + timeout;
  size_t sent = 0;
  while (sent < bytes && SteadyClock::now() < deadline) {
    pollfd p{fd, POLLOUT, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    if (p.revents & (POLLERR | POLLHUP)) break;
    const ssize_t n = ::send(fd, chunk.data(), std::min(chunk.size(), bytes - sent), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
      break;  // EPIPE, ECONNRESET: the receiver closed it
    }
    sent += static_cast<size_t>(n);
  }
  return sent;
}

/// True once the peer has closed `fd` (EOF or reset), reading and dropping
/// whatever it sent before (an ERROR frame), within `timeout`.
bool closed_by_peer_within(int fd, milliseconds timeout) {
  const auto deadline = SteadyClock::now() + timeout;
  uint8_t buf[4096];
  for (;;) {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - SteadyClock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (n == 0) return true;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return true;
  }
}

TEST(PeerLinkPreAuthTest, ThreeConnectionsAnnouncing64MiBDoNotGrowTheStage) {
  TempDir dir;
  Receiver receiver(receiver_options(dir.path()));
  ASSERT_TRUE(receiver.start().ok());
  std::this_thread::sleep_for(50ms);  // the I/O thread's first allocations are not the attack's
  const size_t before = rss_bytes();

  constexpr size_t kStreamed = 16 * kMiB;  // per connection, after the header
  std::vector<Socket> attackers(3);
  const std::vector<uint8_t> header = header_claiming(static_cast<uint32_t>(kDefaultMaxFrameBytes));
  for (auto& sock : attackers) {
    ASSERT_OK_AND_ASSIGN(sock, connect_tcp("127.0.0.1", receiver.port(), 1000ms));
    ASSERT_TRUE(send_all(sock.fd(), header.data(), header.size()).ok());
  }
  size_t streamed = 0;
  for (auto& sock : attackers) streamed += stream_junk(sock.fd(), kStreamed, 3000ms);
  // What the kernel buffered is read by the receiver's I/O thread soon after.
  size_t peak = rss_bytes();
  for (int i = 0; i < 20; ++i) {
    std::this_thread::sleep_for(25ms);
    peak = std::max(peak, rss_bytes());
  }
  const double growth_mib = (static_cast<double>(peak) - static_cast<double>(before)) / kMiB;
  std::printf("[ rss      ] before %.1f MiB, peak %.1f MiB, growth %.1f MiB (%.1f MiB streamed by 3 connections)\n",
              static_cast<double>(before) / kMiB, static_cast<double>(peak) / kMiB, growth_mib,
              static_cast<double>(streamed) / kMiB);
  EXPECT_LT(growth_mib, 8.0) << "three unauthenticated connections made the receiver hold memory";
  // Each was refused and closed on its header, not after an auth timeout.
  for (auto& sock : attackers) {
    EXPECT_TRUE(closed_by_peer_within(sock.fd(), 1000ms)) << "a connection announcing 64 MiB was kept open";
  }
  EXPECT_GE(receiver.stats().rejected, 3u);
  EXPECT_NE(receiver.stats().last_reject_reason.find("oversize"), std::string::npos)
      << receiver.stats().last_reject_reason;
}

TEST(PeerLinkPreAuthTest, AnOversizePreAuthHeaderIsRefusedAtOnce) {
  TempDir dir;
  Receiver receiver(receiver_options(dir.path()));
  ASSERT_TRUE(receiver.start().ok());
  // Anything a HELLO cannot be: just above the pre-auth cap, and the 64 MiB of the attack.
  for (uint32_t total : {static_cast<uint32_t>(kDefaultPreAuthFrameBytes + 1), static_cast<uint32_t>(64 * kMiB)}) {
    ASSERT_OK_AND_ASSIGN(const Socket sock, connect_tcp("127.0.0.1", receiver.port(), 1000ms));
    const std::vector<uint8_t> header = header_claiming(total);
    ASSERT_TRUE(send_all(sock.fd(), header.data(), header.size()).ok());
    const auto t0 = SteadyClock::now();
    EXPECT_TRUE(closed_by_peer_within(sock.fd(), 1000ms)) << "announced " << total << " bytes";
    EXPECT_LT(SteadyClock::now() - t0, 1000ms);
    EXPECT_NE(receiver.stats().last_reject_reason.find("oversize"), std::string::npos)
        << receiver.stats().last_reject_reason;
  }
}

TEST(PeerLinkPreAuthTest, ALegitimateUpstreamDeliversDuringTheAttack) {
  TempDir dir;
  Receiver receiver(receiver_options(dir.path()));
  ASSERT_TRUE(receiver.start().ok());
  // Three attackers that reconnect as soon as they are closed, each sending
  // the 64 MiB header and then junk, for as long as the upstream works.
  std::atomic<bool> done{false};
  std::atomic<uint64_t> attack_connections{0};
  std::vector<std::thread> attackers;
  for (int a = 0; a < 3; ++a) {
    attackers.emplace_back([&] {
      const std::vector<uint8_t> header = header_claiming(static_cast<uint32_t>(kDefaultMaxFrameBytes));
      while (!done) {
        Result<Socket> connected = connect_tcp("127.0.0.1", receiver.port(), 1000ms);
        if (!connected.ok()) continue;
        const Socket sock = std::move(connected).value();
        ++attack_connections;
        if (!send_all(sock.fd(), header.data(), header.size()).ok()) continue;
        stream_junk(sock.fd(), 4 * kMiB, 500ms);
      }
    });
  }
  SenderOptions so;
  so.port = receiver.port();
  so.key = test_key();
  so.run_id = test_run();
  so.max_in_flight = 2;
  so.backoff_initial = 10ms;
  so.backoff_max = 100ms;
  Sender sender(so);
  ASSERT_TRUE(sender.start().ok());
  // The memory is measured past a warm-up: by then every thread, its stack and
  // its malloc arena exist and every code path has run once (under qemu-user
  // the translated code counts in RSS too), so what grows after is what the
  // attack makes the receiver hold: a buffer per connection would be MiBs each.
  constexpr uint64_t kWarmUp = 5, kFrames = 25;
  size_t before = 0;
  uint64_t attacks_before = 0;
  for (uint64_t mb = 0; mb < kFrames; ++mb) {
    if (mb == kWarmUp) {
      before = rss_bytes();
      attacks_before = attack_connections.load();
    }
    ASSERT_TRUE(sender.send(data_frame(0, mb), 5000ms).ok());
    ASSERT_OK_AND_ASSIGN(const InputEntry e, receiver.next(5000ms));
    EXPECT_EQ(e.micro_batch, mb);
  }
  EXPECT_TRUE(sender.flush(5000ms).ok());
  const size_t after = rss_bytes();
  const uint64_t measured_attacks = attack_connections.load() - attacks_before;
  done = true;
  for (auto& t : attackers) t.join();
  sender.stop();
  EXPECT_EQ(receiver.stats().accepted, kFrames);
  EXPECT_EQ(sender.stats().connects, 1u) << "the upstream's link was disturbed";
  EXPECT_GE(measured_attacks, 3u) << "too few attack connections while the memory was measured";
  const double growth_mib = (static_cast<double>(after) - static_cast<double>(before)) / kMiB;
  std::printf("[ rss      ] growth %.1f MiB during %llu attack connections (after %llu warm-up ones)\n", growth_mib,
              static_cast<unsigned long long>(measured_attacks), static_cast<unsigned long long>(attacks_before));
  EXPECT_LT(growth_mib, 8.0);
}

TEST(PeerLinkPreAuthTest, StrangersNeverPushOutANewcomerPastItsHello) {
  TempDir dir;
  ReceiverOptions ro = receiver_options(dir.path());
  ro.pre_auth.max_connections = 2;
  Receiver receiver(ro);
  ASSERT_TRUE(receiver.start().ok());
  RawUpstream upstream(receiver.port());  // reconnected, its first DATA not sent yet
  std::vector<std::unique_ptr<RawUpstream>> strangers;
  for (int i = 0; i < 10; ++i) strangers.push_back(std::make_unique<RawUpstream>(receiver.port(), false));
  for (int i = 0; i < 8; ++i) {  // the budget holds 2: the 8 oldest are closed, at once
    EXPECT_TRUE(closed_by_peer_within(strangers[i]->sock.fd(), 1000ms)) << "stranger " << i;
  }
  Status s;
  const DecodeResult ack = upstream.send_and_reply(data_frame(0, 0), &s);
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_EQ(ack.frame.type, FrameType::kAck);
  EXPECT_EQ(receiver.stats().accepted, 1u);
  EXPECT_GE(receiver.stats().candidates_dropped, 8u);
}

TEST(PeerLinkPreAuthTest, ARecordedHelloHoldsAtMostOneFrameAndTheNewestHandshakeWins) {
  TempDir dir;
  Receiver receiver(receiver_options(dir.path()));
  ASSERT_TRUE(receiver.start().ok());
  // Someone replays a HELLO recorded from the real upstream: it verifies (it
  // was sealed with the key) and is answered, so the replayer may announce a
  // whole frame; but only one handshaken newcomer waits at a time.
  RawUpstream real(receiver.port());
  std::vector<uint8_t> recorded;
  {
    Frame h = make_control_frame(FrameType::kHello, test_run(), 0, 0, 0);
    std::copy(real.session.id.begin(), real.session.id.begin() + kSessionHalfSize, h.session.begin());
    ASSERT_OK_AND_ASSIGN(recorded, encode_frame(h, upstream_keys().send));
  }
  std::vector<Socket> replays(3);
  for (auto& r : replays) {
    ASSERT_OK_AND_ASSIGN(r, connect_tcp("127.0.0.1", receiver.port(), 1000ms));
    ASSERT_TRUE(send_all(r.fd(), recorded.data(), recorded.size()).ok());
    ASSERT_OK_AND_ASSIGN(const DecodeResult answer, read_frame(r.fd(), upstream_keys().receive, {}, 2000ms));
    ASSERT_EQ(answer.frame.type, FrameType::kHello) << answer.reason;
  }
  // Each newer handshake closed the one before it: the real upstream's first, then each replay but the last.
  EXPECT_TRUE(closed_by_peer_within(real.sock.fd(), 1000ms));
  for (size_t i = 0; i + 1 < replays.size(); ++i) EXPECT_TRUE(closed_by_peer_within(replays[i].fd(), 1000ms)) << i;
  EXPECT_FALSE(closed_by_peer_within(replays.back().fd(), 100ms));
  // The real upstream reconnects, and its handshake is the newest.
  RawUpstream again(receiver.port());
  EXPECT_TRUE(closed_by_peer_within(replays.back().fd(), 1000ms));
  Status s;
  EXPECT_EQ(again.send_and_reply(data_frame(0, 0), &s).frame.type, FrameType::kAck) << s.message();
}

TEST(PeerLinkPreAuthTest, AConnectionWithoutAHelloIsClosedAfterTheHelloTimeout) {
  TempDir dir;
  ReceiverOptions ro = receiver_options(dir.path());
  ro.pre_auth.hello_timeout = 200ms;  // the first frame after the handshake keeps auth_timeout (30 s)
  Receiver receiver(ro);
  ASSERT_TRUE(receiver.start().ok());
  RawUpstream silent(receiver.port(), false);
  RawUpstream handshaken(receiver.port());
  const auto t0 = SteadyClock::now();
  EXPECT_TRUE(closed_by_peer_within(silent.sock.fd(), 2000ms));
  EXPECT_LT(SteadyClock::now() - t0, 1500ms);
  std::this_thread::sleep_for(300ms);  // past the HELLO deadline: the handshaken one still waits
  Status s;
  EXPECT_EQ(handshaken.send_and_reply(data_frame(0, 0), &s).frame.type, FrameType::kAck) << s.message();
}

TEST(PeerLinkPreAuthTest, StartRefusesABudgetWithoutRoomForAHello) {
  TempDir dir;
  ReceiverOptions no_room = receiver_options(dir.path());
  no_room.pre_auth.max_frame_bytes = kHelloFrameBytes - 1;
  Receiver a(no_room);
  const Status sa = a.start();
  EXPECT_EQ(sa.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(sa.message().find("pre_auth.max_frame_bytes is 143"), std::string::npos) << sa.message();
  ReceiverOptions no_slot = receiver_options(dir.path());
  no_slot.pre_auth.max_connections = 0;
  Receiver b(no_slot);
  EXPECT_EQ(b.start().code(), StatusCode::kInvalidArgument);
}

// The same pattern on the client side: until the server's HELLO verified, the
// client (a Sender, a ControlClient) reads only what a HELLO or an ERROR can be.
TEST(PeerLinkPreAuthTest, TheClientHandshakeReadsNoMoreThanAReplyFromAnUnverifiedServer) {
  ASSERT_OK_AND_ASSIGN(const ListeningSocket listening, listen_tcp("127.0.0.1", 0));
  const Socket& listener = listening.socket;
  const uint16_t port = listening.port;
  std::atomic<bool> done{false};
  std::thread fake_server([&] {
    Result<Socket> accepted = accept_tcp(listener);
    if (!accepted.ok()) return;
    const Socket conn = std::move(accepted).value();
    std::vector<uint8_t> hello(kHelloFrameBytes);
    if (::recv(conn.fd(), hello.data(), hello.size(), MSG_WAITALL) != static_cast<ssize_t>(hello.size())) return;
    const std::vector<uint8_t> header = header_claiming(static_cast<uint32_t>(kDefaultMaxFrameBytes));
    (void)send_all(conn.fd(), header.data(), header.size());
    stream_junk(conn.fd(), 4 * kMiB, 1000ms);
    while (!done) std::this_thread::sleep_for(10ms);  // holds the connection open
  });
  ASSERT_OK_AND_ASSIGN(Socket sock, connect_tcp("127.0.0.1", port, 1000ms));
  FrameExpectation expect;  // the link's maximum is 64 MiB
  const auto t0 = SteadyClock::now();
  const Status s = client_handshake(sock.fd(), upstream_keys(), test_run(), 0, expect, 3000ms).status();
  EXPECT_LT(SteadyClock::now() - t0, 1000ms) << s.message();
  EXPECT_EQ(s.code(), StatusCode::kCorrupt) << s.message();
  EXPECT_NE(s.message().find("oversize"), std::string::npos) << s.message();
  done = true;
  sock.close();
  fake_server.join();
}

}  // namespace
}  // namespace zl
