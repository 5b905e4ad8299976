// Sender/Receiver over loopback (127.0.0.1, ephemeral ports): delivery in
// order, log-before-ack, duplicates, bad frames, the in-flight bound D under
// a stalled downstream, reconnect/re-send, and link shaping (lower bounds only).
#include "zl/peer_link.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <memory>
#include <cstring>
#include <thread>

#include <gtest/gtest.h>

#include "peer_link_test_support.h"
#include "zl/durable_file.h"

namespace zl {
namespace {

using namespace std::chrono_literals;
using std::chrono::milliseconds;
using namespace testing;  // zl::testing: the ends of peer_link_test_support.h

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

TEST(PeerLinkTest, DeliversEntriesInMicroBatchOrder) {
  TempDir dir;
  Receiver receiver(receiver_options(dir.path()));
  ASSERT_TRUE(receiver.start().ok());
  Sender sender(sender_options(receiver.port(), 2));
  ASSERT_TRUE(sender.start().ok());
  for (uint64_t mb = 0; mb < 6; ++mb) ASSERT_TRUE(sender.send(data_frame(mb / 3, mb), 2000ms).ok());
  for (uint64_t mb = 0; mb < 6; ++mb) {
    ASSERT_OK_AND_ASSIGN(const InputEntry e, receiver.next(2000ms));
    EXPECT_EQ(e.micro_batch, mb);
    EXPECT_EQ(e.window, mb / 3);
    EXPECT_EQ(e.frame.find("hidden")->data, data_frame(mb / 3, mb).find("hidden")->data);
  }
  ASSERT_TRUE(sender.flush(2000ms).ok());
  EXPECT_EQ(sender.stats().acks, 6u);
  EXPECT_LE(sender.stats().max_in_flight_seen, 2u);
  EXPECT_EQ(receiver.stats().accepted, 6u);
  EXPECT_EQ(receiver.next(50ms).status().code(), StatusCode::kTimeout);
}

TEST(PeerLinkTest, EntryIsInTheLogWhenItsAckArrives) {
  TempDir dir;
  Receiver receiver(receiver_options(dir.path()));
  ASSERT_TRUE(receiver.start().ok());
  RawUpstream up(receiver.port());
  for (uint64_t mb = 0; mb < 3; ++mb) {
    up.send(data_frame(7, mb));
    Status s;
    const DecodeResult ack = up.reply(&s);
    ASSERT_TRUE(s.ok()) << s.message();
    ASSERT_TRUE(ack.ok()) << ack.reason;
    EXPECT_EQ(ack.frame.type, FrameType::kAck);
    EXPECT_EQ(ack.frame.micro_batch, mb);
    EXPECT_EQ(ack.frame.window, 7u);
    EXPECT_EQ(ack.frame.stage, 1u);
    EXPECT_TRUE(file_exists(receiver.input_log().path_for(7, mb))) << "ACK before the entry was durable";
  }
}

TEST(PeerLinkTest, DuplicatesAreDroppedAndAcknowledgedAgain) {
  TempDir dir;
  Receiver receiver(receiver_options(dir.path()));
  ASSERT_TRUE(receiver.start().ok());
  RawUpstream up(receiver.port());
  Status s;
  up.send(data_frame(0, 0));
  ASSERT_EQ(up.reply(&s).frame.type, FrameType::kAck);
  InputEntry e;
  ASSERT_OK_AND_ASSIGN(e, receiver.next(1000ms));  // mb 0 consumed
  up.send(data_frame(0, 1));
  ASSERT_EQ(up.reply(&s).frame.micro_batch, 1u);
  up.send(data_frame(0, 1));  // still in the log
  const DecodeResult again1 = up.reply(&s);
  EXPECT_EQ(again1.frame.type, FrameType::kAck);
  EXPECT_EQ(again1.frame.micro_batch, 1u);
  up.send(data_frame(0, 0));  // already consumed
  EXPECT_EQ(up.reply(&s).frame.micro_batch, 0u);
  EXPECT_EQ(receiver.stats().duplicates, 2u);
  EXPECT_EQ(receiver.stats().accepted, 2u);
  ASSERT_OK_AND_ASSIGN(e, receiver.next(1000ms));
  EXPECT_EQ(e.micro_batch, 1u);
  EXPECT_EQ(receiver.next(50ms).status().code(), StatusCode::kTimeout);
}

TEST(PeerLinkTest, BadFramesAreRejectedAndTheReceiverKeepsServing) {
  TempDir dir;
  Receiver receiver(receiver_options(dir.path()));
  ASSERT_TRUE(receiver.start().ok());
  struct Case {
    std::string name;
    std::vector<uint8_t> bytes;
    std::string reason;
  };
  std::vector<Case> cases;
  const FrameKey wrong_key = test_key(9);
  const FrameKey other_direction = upstream_keys().receive;
  cases.push_back({"wrong key", {}, "bad_mac"});
  cases.push_back({"key of the other direction", {}, "bad_mac"});
  cases.push_back({"wrong shape", {}, "unexpected_tensor"});
  cases.push_back({"wrong run", {}, "wrong_run"});
  cases.push_back({"garbage", std::vector<uint8_t>(100, 'x'), "bad_magic"});
  cases.push_back({"another session", {}, "wrong_session"});
  cases.push_back({"a used sequence number", {}, "replay"});
  for (size_t i = 0; i < cases.size(); ++i) {
    RawUpstream bad(receiver.port());
    if (i == 0) cases[i].bytes = bad.sealed(data_frame(0, 0), &wrong_key);
    if (i == 1) cases[i].bytes = bad.sealed(data_frame(0, 0), &other_direction);
    if (i == 2) cases[i].bytes = bad.sealed(data_frame(0, 0, 1, 3, 8));
    if (i == 3) cases[i].bytes = bad.sealed(data_frame(0, 0, kB, kS, kD, 0, test_run(2)));
    if (i == 5) {
      bad.session.id[20] ^= 1;
      cases[i].bytes = bad.sealed(data_frame(0, 0));
    }
    if (i == 6) {
      bad.session.sent = -1;  // the next one stamped is 0, the HELLO's
      cases[i].bytes = bad.sealed(data_frame(0, 0));
    }
    bad.send_bytes(cases[i].bytes);
    Status s;
    const DecodeResult r = bad.reply(&s);
    // The receiver explains (ERROR frame) and then closes the connection.
    if (s.ok() && r.ok()) {
      EXPECT_EQ(r.frame.type, FrameType::kError) << cases[i].name;
      EXPECT_NE(r.frame.json.find(cases[i].reason), std::string::npos) << r.frame.json;
    }
    EXPECT_EQ(receiver.stats().rejected, i + 1) << cases[i].name;
    EXPECT_NE(receiver.stats().last_reject_reason.find(cases[i].reason), std::string::npos)
        << cases[i].name << ": " << receiver.stats().last_reject_reason;
  }
  // A good frame on a new connection is accepted.
  RawUpstream good(receiver.port());
  good.send(data_frame(0, 0));
  Status s;
  EXPECT_EQ(good.reply(&s).frame.type, FrameType::kAck);
  InputEntry e;
  ASSERT_OK_AND_ASSIGN(e, receiver.next(1000ms));
  EXPECT_EQ(e.micro_batch, 0u);
  EXPECT_EQ(receiver.stats().accepted, 1u);
}

// Issue 12 item 8: a frame with a valid MAC and a tensor name that is not
// UTF-8 used to abort the receiver (its reason went into a JSON dump).
TEST(PeerLinkTest, SignedFrameWithAnInvalidUtf8NameIsRejectedWithoutACrash) {
  TempDir dir;
  Receiver receiver(receiver_options(dir.path()));
  ASSERT_TRUE(receiver.start().ok());
  for (const std::string name : {std::string("\xff\xfe"), std::string("hidden\xc3")}) {
    // encode_frame refuses such a name: encode a placeholder of its length,
    // overwrite it and re-sign, as a key holder could.
    Frame f = data_frame(0, 0);
    f.tensors[0].name = std::string(name.size(), 'h');
    RawUpstream bad(receiver.port());
    std::vector<uint8_t> bytes = bad.sealed(f);
    ASSERT_TRUE(open_frame(bytes.data(), bytes.size(), bad.keys.send));
    std::memcpy(bytes.data() + kFrameHeaderSize + kTensorRecordHeaderSize, name.data(), name.size());
    // And a first dim of 2 that its bytes do not fill: the old reason ("tensor
    // '<raw name>' has shape [2,3,4] ...") went into a JSON dump and threw.
    bytes[kFrameHeaderSize + kTensorRecordHeaderSize + name.size()] = 2;
    testing::reseal(&bytes, bad.keys.send);
    bad.send_bytes(bytes);
    Status s;
    const DecodeResult r = bad.reply(&s);
    if (s.ok() && r.ok()) EXPECT_EQ(r.frame.type, FrameType::kError);
  }
  EXPECT_EQ(receiver.stats().rejected, 2u);
  for (unsigned char c : receiver.stats().last_reject_reason) EXPECT_TRUE(c >= 0x20 && c < 0x7f);
  RawUpstream good(receiver.port());
  good.send(data_frame(0, 0));
  Status s;
  EXPECT_EQ(good.reply(&s).frame.type, FrameType::kAck);
}

// Issue 12 item 11: every accepted connection used to replace the upstream,
// so anyone who could connect broke the link. Now a newcomer replaces it only
// after its first frame decodes.
TEST(PeerLinkTest, UnauthenticatedConnectionsDoNotReplaceTheUpstream) {
  TempDir dir;
  ReceiverOptions ro = receiver_options(dir.path());
  ro.max_pending = 64;
  Receiver receiver(ro);
  ASSERT_TRUE(receiver.start().ok());
  RawUpstream upstream(receiver.port());
  upstream.send(data_frame(0, 0));
  Status s;
  ASSERT_EQ(upstream.reply(&s).frame.type, FrameType::kAck) << s.message();
  // A flood of connections: silent, garbage, and signed under another key.
  std::vector<std::unique_ptr<RawUpstream>> flood;
  for (int i = 0; i < 30; ++i) {
    flood.push_back(std::make_unique<RawUpstream>(receiver.port(), /*handshake=*/false));
    std::vector<uint8_t> bytes(80, 'x');
    if (i % 3 == 2) {
      ASSERT_OK_AND_ASSIGN(bytes, encode_frame(data_frame(0, 50), test_key(9)));
    }
    // The receiver may already have closed it (the oldest waiting are dropped).
    if (i % 3 != 0) (void)send_all(flood.back()->sock.fd(), bytes.data(), bytes.size());
  }
  std::this_thread::sleep_for(100ms);
  // The upstream's connection still works, frame after frame.
  for (uint64_t mb = 1; mb < 5; ++mb) {
    upstream.send(data_frame(0, mb));
    const DecodeResult r = upstream.reply(&s);
    ASSERT_TRUE(s.ok()) << s.message();
    EXPECT_EQ(r.frame.type, FrameType::kAck);
    EXPECT_EQ(r.frame.micro_batch, mb);
  }
  EXPECT_EQ(receiver.stats().accepted, 5u);
  EXPECT_GE(receiver.stats().rejected + receiver.stats().candidates_dropped, 20u);
  // A newcomer with the key does take over (a reconnecting upstream).
  RawUpstream again(receiver.port());
  again.send(data_frame(0, 5));
  EXPECT_EQ(again.reply(&s).frame.type, FrameType::kAck);
  EXPECT_EQ(receiver.stats().accepted, 6u);
}

TEST(PeerLinkTest, NewcomersThatNeverAuthenticateAreClosed) {
  TempDir dir;
  ReceiverOptions ro = receiver_options(dir.path());
  ro.pre_auth.hello_timeout = 200ms;
  ro.pre_auth.max_connections = 2;
  Receiver receiver(ro);
  ASSERT_TRUE(receiver.start().ok());
  RawUpstream silent(receiver.port(), /*handshake=*/false);
  // Half a frame header: it never completes.
  silent.send_bytes(std::vector<uint8_t>(kFrameMagic.begin(), kFrameMagic.end()));
  pollfd p{silent.sock.fd(), POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 3000), 1) << "the receiver did not close a silent connection";
  uint8_t b = 0;
  EXPECT_EQ(::recv(silent.sock.fd(), &b, 1, 0), 0);
  // Over the cap the oldest waiting connection goes first.
  RawUpstream a(receiver.port(), false), b2(receiver.port(), false), c(receiver.port());
  pollfd pa{a.sock.fd(), POLLIN, 0};
  ASSERT_EQ(::poll(&pa, 1, 2000), 1) << "the oldest waiting connection was not dropped";
  EXPECT_EQ(::recv(a.sock.fd(), &b, 1, 0), 0);
  EXPECT_GE(receiver.stats().candidates_dropped, 2u);
  c.send(data_frame(0, 0));
  Status s;
  EXPECT_EQ(c.reply(&s).frame.type, FrameType::kAck);
}

// A downstream that reads frames and never acknowledges them.
class SilentDownstream {
 public:
  SilentDownstream() {
    ListeningSocket listening = value_or_fail(listen_tcp("127.0.0.1", 0));
    listener_ = std::move(listening.socket);
    port_ = listening.port;
    thread_ = std::thread([this] {
      Result<Socket> accepted = accept_tcp(listener_);
      if (!accepted.ok()) return;
      const Socket conn = std::move(accepted).value();
      SessionState session;
      if (!accept_handshake(conn, &session)) return;
      while (!stop_) {
        const Result<DecodeResult> r = read_frame(conn.fd(), downstream_keys().receive, {}, 50ms);
        if (r.status().code() == StatusCode::kTimeout) continue;
        if (!r.ok()) return;
        if (r->ok()) ++frames_;
      }
    });
  }
  ~SilentDownstream() {
    stop_ = true;
    listener_.shutdown();
    thread_.join();
  }
  uint16_t port() const { return port_; }
  int frames() const { return frames_; }

 private:
  Socket listener_;
  uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> frames_{0};
  std::thread thread_;
};

TEST(PeerLinkTest, ALocalErrorPausesTheReceiverInsteadOfAReconnectLoop) {
  // The input log cannot be written (its folder became a file; a full disk behaves alike): every entry
  // fails to log, the link closes unacknowledged and the sender reconnects and re-sends. Without a pause
  // that cycle ran as fast as the network allowed (1,912 times in 3 s on a full disk).
  TempDir dir;
  const std::string log_dir = dir.path() + "/log";
  Receiver receiver(receiver_options(log_dir));
  ASSERT_TRUE(receiver.start().ok());
  ASSERT_TRUE(remove_tree(log_dir).ok());
  ASSERT_TRUE(write_file_synced(log_dir, "x", 1).ok());
  Sender sender(sender_options(receiver.port(), 2));
  ASSERT_TRUE(sender.start().ok());
  ASSERT_TRUE(sender.send(data_frame(0, 0), 2000ms).ok());
  std::this_thread::sleep_for(1500ms);
  const ReceiverStats stats = receiver.stats();
  EXPECT_EQ(stats.accepted, 0u);
  EXPECT_GE(stats.local_errors, 2u);
  // 20 + 40 + 80 + 160 + 320 + 640 ms of pauses: at most 7 failures in 1.5 s.
  EXPECT_LE(stats.local_errors, 8u) << "connections: " << stats.connections;
  EXPECT_NE(stats.last_local_error.find(log_dir), std::string::npos) << stats.last_local_error;
  // The folder is back: the next try after the pause logs the entry.
  ASSERT_TRUE(remove_tree(log_dir).ok());
  ASSERT_TRUE(make_directories(log_dir).ok());
  ASSERT_OK_AND_ASSIGN(const InputEntry e, receiver.next(5000ms));
  EXPECT_EQ(e.micro_batch, 0u);
}

TEST(PeerLinkTest, AFullDiskIsReportedAsOne) {
  const Status s = write_file_synced("/dev/full", "x", 1);  // every write fails with ENOSPC
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("the disk is full"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("free space on this device"), std::string::npos) << s.message();
}

TEST(PeerLinkTest, InFlightBoundHoldsWhenDownstreamDoesNotAck) {
  SilentDownstream downstream;
  Sender sender(sender_options(downstream.port(), 3));
  ASSERT_TRUE(sender.start().ok());
  for (uint64_t mb = 0; mb < 3; ++mb) ASSERT_TRUE(sender.send(data_frame(0, mb), 1000ms).ok());
  const auto t0 = SteadyClock::now();
  const Status s = sender.send(data_frame(0, 3), 200ms);
  EXPECT_EQ(s.code(), StatusCode::kTimeout) << s.message();
  EXPECT_GE(SteadyClock::now() - t0, 200ms);
  EXPECT_NE(s.message().find("D = 3"), std::string::npos) << s.message();
  EXPECT_EQ(sender.in_flight(), 3u);
  EXPECT_EQ(sender.stats().max_in_flight_seen, 3u);
  for (int i = 0; i < 100 && downstream.frames() < 3; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(downstream.frames(), 3);  // the fourth never went out
  sender.stop();
}

TEST(PeerLinkTest, StalledConsumerBackPressuresTheSender) {
  TempDir dir;
  ReceiverOptions ro = receiver_options(dir.path());
  ro.max_pending = 2;
  Receiver receiver(ro);
  ASSERT_TRUE(receiver.start().ok());
  Sender sender(sender_options(receiver.port(), 2));
  ASSERT_TRUE(sender.start().ok());
  // 2 logged but not consumed + 2 un-acknowledged on the link, then it blocks.
  uint64_t queued = 0;
  while (queued < 10 && sender.send(data_frame(0, queued), 300ms).ok()) ++queued;
  EXPECT_EQ(queued, 4u);
  EXPECT_EQ(sender.in_flight(), 2u);
  EXPECT_EQ(receiver.input_log().size(), 2u);
  EXPECT_LE(sender.stats().max_in_flight_seen, 2u);
  // Consuming releases the pipeline.
  for (uint64_t mb = 0; mb < 4; ++mb) {
    InputEntry e;
    ASSERT_OK_AND_ASSIGN(e, receiver.next(2000ms));
    EXPECT_EQ(e.micro_batch, mb);
  }
  EXPECT_TRUE(sender.flush(2000ms).ok());
}

TEST(PeerLinkTest, TheHandshakeIsAnsweredWhileTheConsumerIsBehind) {
  TempDir dir;
  ReceiverOptions ro = receiver_options(dir.path());
  ro.max_pending = 1;
  Receiver receiver(ro);
  ASSERT_TRUE(receiver.start().ok());
  RawUpstream first(receiver.port());
  first.send(data_frame(0, 0));
  Status s;
  ASSERT_EQ(first.reply(&s).frame.type, FrameType::kAck);  // now 1 entry pending: no room
  const auto t0 = SteadyClock::now();
  RawUpstream second(receiver.port());  // a reconnecting upstream: its HELLO is answered at once
  EXPECT_LT(SteadyClock::now() - t0, 1000ms);
  second.send(data_frame(0, 1));  // but its DATA waits for room
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(receiver.stats().accepted, 1u);
  InputEntry e;
  ASSERT_OK_AND_ASSIGN(e, receiver.next(1000ms));
  EXPECT_EQ(second.reply(&s).frame.type, FrameType::kAck) << s.message();
  EXPECT_EQ(receiver.stats().accepted, 2u);
}

TEST(PeerLinkTest, ReconnectsAfterTheReceiverRestartsAndResendsUnacked) {
  TempDir dir;
  uint16_t port = 0;
  auto sender_holder = std::unique_ptr<Sender>();
  {
    Receiver first(receiver_options(dir.path()));
    ASSERT_TRUE(first.start().ok());
    port = first.port();
    sender_holder = std::make_unique<Sender>(sender_options(port, 4));
    ASSERT_TRUE(sender_holder->start().ok());
    for (uint64_t mb = 0; mb < 2; ++mb) ASSERT_TRUE(sender_holder->send(data_frame(0, mb), 1000ms).ok());
    ASSERT_TRUE(sender_holder->flush(2000ms).ok());
  }  // receiver "crashes": nothing consumed yet
  Sender& sender = *sender_holder;
  ASSERT_TRUE(sender.send(data_frame(1, 2), 1000ms).ok());
  ASSERT_TRUE(sender.send(data_frame(1, 3), 1000ms).ok());
  std::this_thread::sleep_for(100ms);  // sender retries with back-off meanwhile
  EXPECT_EQ(sender.in_flight(), 2u);

  Receiver second(receiver_options(dir.path(), port));
  ASSERT_TRUE(second.start().ok());
  EXPECT_EQ(second.input_log().size(), 2u);  // replayable from the log
  ASSERT_TRUE(sender.flush(3000ms).ok());
  for (uint64_t mb = 0; mb < 4; ++mb) {
    InputEntry e;
    ASSERT_OK_AND_ASSIGN(e, second.next(2000ms));
    EXPECT_EQ(e.micro_batch, mb);
  }
  EXPECT_GE(sender.stats().connects, 2u);
}

TEST(PeerLinkTest, UnackedEntriesAreResentAfterTheConnectionDrops) {
  TempDir dir;
  ASSERT_OK_AND_ASSIGN(ListeningSocket listening, listen_tcp("127.0.0.1", 0));
  Socket& listener = listening.socket;
  const uint16_t port = listening.port;
  Sender sender(sender_options(port, 3));
  ASSERT_TRUE(sender.start().ok());
  {
    // First downstream reads two frames, never acknowledges, and dies.
    ASSERT_OK_AND_ASSIGN(const Socket conn, accept_tcp(listener));
    SessionState session;
    ASSERT_TRUE(accept_handshake(conn, &session));
    for (uint64_t mb = 0; mb < 2; ++mb) ASSERT_TRUE(sender.send(data_frame(0, mb), 1000ms).ok());
    for (int i = 0; i < 2; ++i) {
      ASSERT_OK_AND_ASSIGN(const DecodeResult r, read_frame(conn.fd(), downstream_keys().receive, {}, 1000ms));
      ASSERT_TRUE(r.ok());
    }
    listener.close();
  }
  Receiver receiver(receiver_options(dir.path(), port));
  ASSERT_TRUE(receiver.start().ok());
  ASSERT_TRUE(sender.flush(3000ms).ok());
  EXPECT_GE(sender.stats().resends, 2u);
  InputEntry e;
  ASSERT_OK_AND_ASSIGN(e, receiver.next(1000ms));
  EXPECT_EQ(e.micro_batch, 0u);
}

TEST(PeerLinkTest, RestartReplaysFromTheLogAfterTheCheckpoint) {
  TempDir dir;
  {
    // Stage 1's log, as its Receiver wrote it before a restart.
    InputLog log(dir.path(), derive_frame_key(test_key(), KeyPurpose::kInputLog, 1));
    ASSERT_TRUE(log.open().ok());
    for (uint64_t mb = 0; mb < 6; ++mb) ASSERT_TRUE(log.append_frame(data_frame(mb / 2, mb)).ok());
  }
  // Checkpoint of window 0 is in place (micro-batches 0, 1): replay from 2.
  ReceiverOptions ro = receiver_options(dir.path());
  ro.committed_window = 0;
  ro.first_micro_batch = 2;
  ro.max_pending = 8;
  Receiver receiver(ro);
  ASSERT_TRUE(receiver.start().ok());
  EXPECT_EQ(receiver.input_log().size(), 4u);
  InputEntry e;
  ASSERT_OK_AND_ASSIGN(e, receiver.next(1000ms));
  EXPECT_EQ(e.micro_batch, 2u);
  ASSERT_OK_AND_ASSIGN(e, receiver.next(1000ms));
  EXPECT_EQ(e.micro_batch, 3u);
  ASSERT_TRUE(receiver.window_committed(1).ok());
  EXPECT_FALSE(file_exists(receiver.input_log().path_for(1, 3)));
  EXPECT_TRUE(file_exists(receiver.input_log().path_for(2, 4)));
  EXPECT_EQ(receiver.input_log().size(), 2u);
}

// Issue 12 item 1: what the receiver logs is encrypted at rest too, under its
// own key, and a restarted receiver (new sessions) still replays it.
TEST(PeerLinkTest, TheInputLogIsEncryptedAndSurvivesARestart) {
  TempDir dir;
  const Frame f = data_frame(0, 0);
  {
    Receiver receiver(receiver_options(dir.path()));
    ASSERT_TRUE(receiver.start().ok());
    RawUpstream up(receiver.port());
    up.send(f);
    Status s;
    ASSERT_EQ(up.reply(&s).frame.type, FrameType::kAck) << s.message();
  }
  ASSERT_OK_AND_ASSIGN(const std::vector<uint8_t> stored,
                       read_file_bytes(dir.path() + "/" + "entry-00000000000000000000-w00000000000000000000.zlf"));
  const std::vector<uint8_t>& labels = f.find("labels")->data;
  EXPECT_EQ(std::search(stored.begin(), stored.end(), labels.begin(), labels.end()), stored.end());
  EXPECT_EQ(decode_frame(stored.data(), stored.size(), upstream_keys().send).error, FrameError::kBadMac);
  Receiver again(receiver_options(dir.path()));
  ASSERT_TRUE(again.start().ok());
  InputEntry e;
  ASSERT_OK_AND_ASSIGN(e, again.next(1000ms));
  EXPECT_EQ(e.frame.find("labels")->data, labels);
  EXPECT_EQ(e.frame.find("hidden")->data, f.find("hidden")->data);
}

// Issue 12 item 3: what an upstream sent, recorded and replayed on a new
// connection, is of another session: rejected, and the real upstream keeps
// the link. (Before, the replayed DATA frame authenticated the newcomer,
// which then replaced the upstream's connection.)
TEST(PeerLinkTest, ARecordedUpstreamReplayedOnANewConnectionTakesNothingOver) {
  TempDir dir;
  ReceiverOptions ro = receiver_options(dir.path());
  ro.max_pending = 64;
  Receiver receiver(ro);
  ASSERT_TRUE(receiver.start().ok());
  RawUpstream real(receiver.port());
  real.send(data_frame(0, 0));
  Status s;
  ASSERT_EQ(real.reply(&s).frame.type, FrameType::kAck) << s.message();
  // The recording starts after the HELLO: replay the HELLO too, then the DATA frame.
  ASSERT_OK_AND_ASSIGN(const Socket replay, connect_tcp("127.0.0.1", receiver.port(), 1000ms));
  std::vector<uint8_t> hello;
  {
    Frame h = make_control_frame(FrameType::kHello, test_run(), 0, 0, 0);
    std::copy(real.session.id.begin(), real.session.id.begin() + kSessionHalfSize, h.session.begin());
    ASSERT_OK_AND_ASSIGN(hello, encode_frame(h, real.keys.send));
  }
  ASSERT_TRUE(send_all(replay.fd(), hello.data(), hello.size()).ok());
  ASSERT_OK_AND_ASSIGN(const DecodeResult answer, read_frame(replay.fd(), real.keys.receive, {}, 2000ms));
  ASSERT_TRUE(answer.ok()) << answer.reason;
  EXPECT_NE(answer.frame.session, real.session.id);  // a fresh server half
  ASSERT_TRUE(send_all(replay.fd(), real.sent.data(), real.sent.size()).ok());
  for (int i = 0; i < 200 && receiver.stats().rejected == 0; ++i) std::this_thread::sleep_for(5ms);
  EXPECT_EQ(receiver.stats().rejected, 1u);
  EXPECT_NE(receiver.stats().last_reject_reason.find("wrong_session"), std::string::npos)
      << receiver.stats().last_reject_reason;
  EXPECT_EQ(receiver.stats().duplicates, 0u);
  // The real upstream's connection is still the link.
  const std::vector<uint8_t> second = real.sealed(data_frame(0, 1));
  real.send_bytes(second);
  const DecodeResult ack = real.reply(&s);
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_EQ(ack.frame.type, FrameType::kAck);
  EXPECT_EQ(ack.frame.micro_batch, 1u);
  // And inside its own connection the same frame again is a replay.
  real.send_bytes(second);
  for (int i = 0; i < 200 && receiver.stats().rejected < 2; ++i) std::this_thread::sleep_for(5ms);
  EXPECT_NE(receiver.stats().last_reject_reason.find("replay"), std::string::npos)
      << receiver.stats().last_reject_reason;
}

// Issue 12 item 3: the sender's ACK check looked only at the run id, so an ACK
// recorded earlier released an entry the receiver never logged. ACKs are now
// bound to the connection's session and sequence numbers.
TEST(PeerLinkTest, AReplayedAckDoesNotReleaseAnEntry) {
  ASSERT_OK_AND_ASSIGN(const ListeningSocket listening, listen_tcp("127.0.0.1", 0));
  const Socket& listener = listening.socket;
  const uint16_t port = listening.port;
  Sender sender(sender_options(port, 3));
  ASSERT_TRUE(sender.start().ok());
  std::vector<uint8_t> recorded_ack;
  {
    ASSERT_OK_AND_ASSIGN(const Socket conn, accept_tcp(listener));
    SessionState session;
    ASSERT_TRUE(accept_handshake(conn, &session));
    ASSERT_TRUE(sender.send(data_frame(0, 0), 1000ms).ok());
    ASSERT_OK_AND_ASSIGN(const DecodeResult r, read_frame(conn.fd(), downstream_keys().receive, {}, 1000ms));
    ASSERT_TRUE(r.ok()) << r.reason;
    ASSERT_OK_AND_ASSIGN(recorded_ack, encode_frame(session.stamp(make_control_frame(FrameType::kAck, test_run(), 1, 0, 0)),
                                                    downstream_keys().send));
    ASSERT_TRUE(send_all(conn.fd(), recorded_ack.data(), recorded_ack.size()).ok());
    ASSERT_TRUE(sender.flush(2000ms).ok());
    // Micro-batch 0 goes out again (the stage restarted from an earlier
    // checkpoint): the recorded ACK, replayed in the same session, is refused.
    ASSERT_TRUE(sender.send(data_frame(0, 0), 1000ms).ok());
    ASSERT_TRUE(read_frame(conn.fd(), downstream_keys().receive, {}, 1000ms).ok());
    ASSERT_TRUE(send_all(conn.fd(), recorded_ack.data(), recorded_ack.size()).ok());
    std::this_thread::sleep_for(100ms);
    EXPECT_EQ(sender.in_flight(), 1u) << "a replayed ACK released the entry";
  }
  // A new connection (new session): the recorded ACK again.
  ASSERT_OK_AND_ASSIGN(const Socket conn, accept_tcp(listener));
  SessionState session;
  ASSERT_TRUE(accept_handshake(conn, &session, 0x77));
  ASSERT_OK_AND_ASSIGN(const DecodeResult r, read_frame(conn.fd(), downstream_keys().receive, {}, 2000ms));  // the re-send
  ASSERT_TRUE(r.ok()) << r.reason;
  EXPECT_EQ(r.frame.session, session.id);
  ASSERT_TRUE(send_all(conn.fd(), recorded_ack.data(), recorded_ack.size()).ok());
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(sender.in_flight(), 1u) << "an ACK of an earlier connection released the entry";
  // The real ACK of this session does.
  ASSERT_OK_AND_ASSIGN(const std::vector<uint8_t> ack,
                       encode_frame(session.stamp(make_control_frame(FrameType::kAck, test_run(), 1, 0, 0)),
                                    downstream_keys().send));
  ASSERT_TRUE(send_all(conn.fd(), ack.data(), ack.size()).ok());
  EXPECT_TRUE(sender.flush(2000ms).ok());
}

TEST(PeerLinkTest, LinkShapingAddsLatencyAndSerializationDelay) {
  TempDir dir;
  Receiver receiver(receiver_options(dir.path()));
  ASSERT_TRUE(receiver.start().ok());

  SenderOptions so = sender_options(receiver.port(), 4);
  ASSERT_OK_AND_ASSIGN(so.profile, link_profile_from_name("constrained"));
  Sender sender(so);
  ASSERT_TRUE(sender.start().ok());
  for (int i = 0; i < 100 && !sender.connected(); ++i) std::this_thread::sleep_for(5ms);
  auto t0 = SteadyClock::now();
  ASSERT_TRUE(sender.send(data_frame(0, 0), 1000ms).ok());
  ASSERT_TRUE(sender.flush(2000ms).ok());
  EXPECT_GE(SteadyClock::now() - t0, 30ms);  // one-way latency of `constrained`
  sender.stop();

  // Bandwidth only: 2 frames of 1 + 131,072 floats (~512 KiB) at 80 Mbit/s
  // need >= 2 * 52 ms on the wire.
  ReceiverOptions ro = receiver_options(dir.path() + "/big");
  ro.expect.batch = 1;
  ro.expect.seq_len = 128;
  ro.expect.hidden_size = 1024;
  Receiver big(ro);
  ASSERT_TRUE(big.start().ok());
  SenderOptions bo = sender_options(big.port(), 4);
  bo.profile.name = "test";
  bo.profile.bandwidth_bits_per_s = 80'000'000;
  Sender bulk(bo);
  ASSERT_TRUE(bulk.start().ok());
  for (int i = 0; i < 100 && !bulk.connected(); ++i) std::this_thread::sleep_for(5ms);
  t0 = SteadyClock::now();
  for (uint64_t mb = 0; mb < 2; ++mb) ASSERT_TRUE(bulk.send(data_frame(0, mb, 1, 128, 1024), 1000ms).ok());
  ASSERT_TRUE(bulk.flush(3000ms).ok());
  EXPECT_GE(SteadyClock::now() - t0, 104ms);
}

TEST(PeerLinkTest, StopUnblocksAWaitingSendAndNext) {
  TempDir dir;
  Receiver receiver(receiver_options(dir.path()));
  ASSERT_TRUE(receiver.start().ok());
  SilentDownstream downstream;
  Sender sender(sender_options(downstream.port(), 1));
  ASSERT_TRUE(sender.start().ok());
  ASSERT_TRUE(sender.send(data_frame(0, 0), 1000ms).ok());
  std::thread stopper([&] {
    std::this_thread::sleep_for(50ms);
    sender.stop();
    receiver.stop();
  });
  EXPECT_EQ(sender.send(data_frame(0, 1), 5000ms).code(), StatusCode::kClosed);
  EXPECT_EQ(receiver.next(5000ms).status().code(), StatusCode::kClosed);
  stopper.join();
}

}  // namespace
}  // namespace zl
