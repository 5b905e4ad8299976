// ReconnectingLink over loopback: back-off delays, dial + adopt, frames
// (valid and rejected) handed over in order, a broken stream and EOF
// reported, and wake() / shutdown() from another thread.
#include "zl/reconnecting_link.h"

#include <array>
#include <chrono>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "net_test_support.h"

namespace zl {
namespace {

using namespace std::chrono_literals;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;
using testing::test_key;
using testing::test_run;
using testing::value_or_fail;

TEST(BackoffTest, DoublesUpToTheMaximumAndResets) {
  Backoff backoff(10ms, 45ms);
  EXPECT_EQ(backoff.next(), 10ms);
  EXPECT_EQ(backoff.next(), 20ms);
  EXPECT_EQ(backoff.next(), 40ms);
  EXPECT_EQ(backoff.next(), 45ms);
  EXPECT_EQ(backoff.next(), 45ms);
  backoff.reset();
  EXPECT_EQ(backoff.next(), 10ms);
}

FrameExpectation expect_run() {
  FrameExpectation expect;
  expect.run_id = test_run();
  return expect;
}

LinkKeys client_keys() { return link_keys(test_key(), Channel::kData, 0, LinkEnd::kClient); }
LinkKeys server_keys() { return link_keys(test_key(), Channel::kData, 0, LinkEnd::kServer); }

// A listening peer and a link connected to it after the handshake; `peer` is
// the accepted end, `session` its end of the session.
struct Connected {
  Socket listener, peer;
  uint16_t port = 0;
  ReconnectingLink link{client_keys(), expect_run(), test_run(), 0};
  SessionState session;

  Connected() {
    ListeningSocket listening = value_or_fail(listen_tcp("127.0.0.1", 0));
    listener = std::move(listening.socket);
    port = listening.port;
    EXPECT_TRUE(link.open().ok());
    Socket sock = value_or_fail(ReconnectingLink::dial("127.0.0.1", port, 2000ms));
    peer = value_or_fail(accept_tcp(listener));
    std::thread server([&] {
      ASSERT_OK_AND_ASSIGN(const DecodeResult hello, read_frame(peer.fd(), server_keys().receive, {}, 2000ms));
      ASSERT_TRUE(hello.ok()) << hello.reason;
      std::array<uint8_t, kSessionHalfSize> half{};
      half.fill(0x42);
      ASSERT_OK_AND_ASSIGN(const Frame reply, server_handshake(hello.frame, test_run(), 1, half));
      session.id = reply.session;
      ASSERT_TRUE(write_frame(peer.fd(), reply, server_keys().send).ok());
    });
    const Result<SessionId> id = link.handshake(sock, 2000ms);
    server.join();
    EXPECT_TRUE(id.ok()) << id.status().message();
    if (!id.ok()) return;
    EXPECT_EQ(*id, session.id);
    link.adopt(std::move(sock), *id);
  }

  void send(const Frame& f) { ASSERT_TRUE(write_frame(peer.fd(), session.stamp(f), server_keys().send).ok()); }

  // Waits for input and reads what came, collecting every decoded frame.
  LinkReadResult read(std::vector<DecodeResult>* frames) {
    bool readable = false;
    for (int i = 0; i < 50 && !readable; ++i) {
      const Result<bool> waited = link.wait_for_input(Clock::now() + 100ms);
      EXPECT_TRUE(waited.ok()) << waited.status().message();
      readable = waited.ok() && *waited;
    }
    EXPECT_TRUE(readable);
    return link.read_frames([&](const DecodeResult& r) { frames->push_back(r); });
  }
};

TEST(ReconnectingLinkTest, DialFailsFastOnAClosedPort) {
  ASSERT_OK_AND_ASSIGN(ListeningSocket listening, listen_tcp("127.0.0.1", 0));
  listening.socket.close();  // nothing listens there now
  EXPECT_FALSE(ReconnectingLink::dial("127.0.0.1", listening.port, 500ms).ok());
}

TEST(ReconnectingLinkTest, HandsOverValidAndRejectedFramesInOrder) {
  Connected c;
  ASSERT_TRUE(c.link.connected());
  const Frame ack = make_control_frame(FrameType::kAck, test_run(), 1, 0, 5);
  const Frame foreign = make_control_frame(FrameType::kAck, test_run(9), 1, 0, 6);  // another run
  c.send(ack);
  c.send(foreign);
  ASSERT_OK_AND_ASSIGN(const std::vector<uint8_t> recorded, encode_frame(c.session.stamp(ack), server_keys().send));
  ASSERT_TRUE(send_all(c.peer.fd(), recorded.data(), recorded.size()).ok());
  ASSERT_TRUE(send_all(c.peer.fd(), recorded.data(), recorded.size()).ok());  // replayed
  SessionState other = c.session;
  other.id[31] ^= 1;
  ASSERT_TRUE(write_frame(c.peer.fd(), other.stamp(ack), server_keys().send).ok());  // another session
  c.send(ack);
  std::vector<DecodeResult> frames;
  for (int i = 0; i < 10 && frames.size() < 6; ++i) {
    const LinkReadResult r = c.read(&frames);
    EXPECT_FALSE(r.broken);
    EXPECT_TRUE(r.filled.ok()) << r.filled.message();
  }
  ASSERT_EQ(frames.size(), 6u);
  EXPECT_TRUE(frames[0].ok());
  EXPECT_EQ(frames[0].frame.micro_batch, 5u);
  EXPECT_EQ(frames[1].error, FrameError::kWrongRun);  // decoded and rejected, the stream stays usable
  EXPECT_TRUE(frames[2].ok());
  EXPECT_EQ(frames[3].error, FrameError::kReplay);
  EXPECT_EQ(frames[4].error, FrameError::kWrongSession);
  EXPECT_TRUE(frames[5].ok()) << frames[5].reason;
}

TEST(ReconnectingLinkTest, OutgoingFramesAreStampedWithTheSessionAndIncreasingSequenceNumbers) {
  Connected c;
  for (uint64_t mb = 0; mb < 3; ++mb) {
    ASSERT_TRUE(c.link.send_frame(make_control_frame(FrameType::kData, test_run(), 0, 0, mb), 1 << 20).ok());
  }
  for (uint64_t seq = 1; seq <= 3; ++seq) {
    ASSERT_OK_AND_ASSIGN(const DecodeResult r,
                         read_frame(c.peer.fd(), server_keys().receive, c.session.expect({}), 2000ms));
    ASSERT_TRUE(r.ok()) << r.reason;
    c.session.accepted = r.frame.seq;
    EXPECT_EQ(r.frame.seq, seq);
  }
}

TEST(ReconnectingLinkTest, TheHandshakeRejectsAServerHelloOfAnotherConnection) {
  ASSERT_OK_AND_ASSIGN(const ListeningSocket listening, listen_tcp("127.0.0.1", 0));
  ReconnectingLink link{client_keys(), expect_run(), test_run(), 0};
  ASSERT_OK_AND_ASSIGN(const Socket sock, ReconnectingLink::dial("127.0.0.1", listening.port, 2000ms));
  ASSERT_OK_AND_ASSIGN(const Socket peer, accept_tcp(listening.socket));
  std::thread server([&] {
    ASSERT_TRUE(read_frame(peer.fd(), server_keys().receive, {}, 2000ms).ok());
    Frame reply = make_control_frame(FrameType::kHello, test_run(), 1, 0, 0);
    reply.session.fill(0x33);  // a recorded HELLO: not this client's half
    ASSERT_TRUE(write_frame(peer.fd(), reply, server_keys().send).ok());
  });
  const Status s = link.handshake(sock, 2000ms).status();
  server.join();
  EXPECT_EQ(s.code(), StatusCode::kCorrupt);
  EXPECT_NE(s.message().find("bad_handshake"), std::string::npos) << s.message();
}

TEST(ReconnectingLinkTest, ReportsABrokenStreamAndEndOfStream) {
  Connected c;
  const std::vector<uint8_t> junk(64, 0xAB);  // no frame magic
  ASSERT_TRUE(send_all(c.peer.fd(), junk.data(), junk.size()).ok());
  std::vector<DecodeResult> frames;
  const LinkReadResult broken = c.read(&frames);
  EXPECT_TRUE(broken.broken);
  EXPECT_NE(broken.error, FrameError::kNone);
  EXPECT_TRUE(frames.empty());

  Connected d;
  d.peer.close();
  const LinkReadResult eof = d.read(&frames);
  EXPECT_FALSE(eof.broken);
  EXPECT_EQ(eof.filled.code(), StatusCode::kClosed);
}

TEST(ReconnectingLinkTest, WakeEndsAWaitEarly) {
  Connected c;
  std::thread waker([&] {
    std::this_thread::sleep_for(50ms);
    c.link.wake();
  });
  const auto start = Clock::now();
  // Capped at 1 s per call; a wake must end it well before.
  const Result<bool> readable = c.link.wait_for_input(start + 10s);
  waker.join();
  ASSERT_TRUE(readable.ok()) << readable.status().message();
  EXPECT_FALSE(*readable);
  EXPECT_LT(Clock::now() - start, 900ms);
}

TEST(ReconnectingLinkTest, ShutdownFromAnotherThreadEndsTheConnection) {
  Connected c;
  std::thread stopper([&] {
    std::this_thread::sleep_for(20ms);
    c.link.shutdown();
  });
  std::vector<DecodeResult> frames;
  const LinkReadResult r = c.read(&frames);  // the shutdown reads as end of stream
  stopper.join();
  EXPECT_FALSE(r.filled.ok());
  c.link.close();
  EXPECT_FALSE(c.link.connected());
}

}  // namespace
}  // namespace zl
