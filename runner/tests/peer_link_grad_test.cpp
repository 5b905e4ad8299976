// GRAD frames on the link (issue 39 item 2): stage k+1's Receiver sends the
// hidden state's gradient upstream (send_grad), stage k's Sender reads it
// beside the ACKs into a queue its runner pops (next_grad); at most G
// gradients are owed at once; frames under another key or session, of
// another shape, or for an entry not owed a gradient are refused; bytes are
// counted each way.
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "peer_link_test_support.h"

namespace zl {
namespace {

using namespace std::chrono_literals;
using namespace testing;  // zl::testing: the ends of peer_link_test_support.h

SenderOptions grad_sender_options(uint16_t port, size_t g, size_t d = 4) {
  SenderOptions o = testing::sender_options(port, d);
  o.max_grads_in_flight = g;
  o.batch = kB;
  o.seq_len = kS;
  o.hidden_size = kD;
  return o;
}

std::vector<float> grad_values(uint64_t mb) {
  std::vector<float> g(kB * kS * kD);
  for (size_t i = 0; i < g.size(); ++i) g[i] = (static_cast<float>(mb) + 0.1f * static_cast<float>(i)) * 1.0e-3f + 1e-7f;
  return g;
}

Frame grad_frame(uint64_t window, uint64_t mb, DType wire = kDefaultGradWireDType) {
  const std::vector<float> g = grad_values(mb);
  return value_or_fail(make_grad_frame(test_run(), 1, window, mb, kB, kS, kD, g.data(), wire));
}

// Sends micro-batches [0, n) and lets the receiver's consumer take them.
void forward(Sender* sender, Receiver* receiver, uint64_t n) {
  for (uint64_t mb = 0; mb < n; ++mb) ASSERT_TRUE(sender->send(data_frame(0, mb), 2000ms).ok());
  for (uint64_t mb = 0; mb < n; ++mb) ASSERT_TRUE(receiver->next(2000ms).ok());
}

TEST(PeerLinkGradTest, AGradSentDownstreamArrivesUpstreamIntact) {
  TempDir dir;
  Receiver receiver(receiver_options(dir.path()));
  ASSERT_TRUE(receiver.start().ok());
  Sender sender(grad_sender_options(receiver.port(), 2));
  ASSERT_TRUE(sender.start().ok());
  forward(&sender, &receiver, 2);
  ASSERT_TRUE(receiver.send_grad(grad_frame(0, 1, DType::kFloat32), 1000ms).ok());  // out of order, f32
  ASSERT_TRUE(receiver.send_grad(grad_frame(0, 0), 1000ms).ok());                   // bf16
  for (const uint64_t mb : {1u, 0u}) {
    ASSERT_OK_AND_ASSIGN(const GradEntry e, sender.next_grad(2000ms));
    EXPECT_EQ(e.micro_batch, mb);
    EXPECT_EQ(e.window, 0u);
    EXPECT_EQ(e.delay, 1u - mb);  // micro-batch 1 was the newest sent when both came back
    const std::vector<float> got = value_or_fail(grad_hidden_f32(e.frame, kB, kS, kD));
    const std::vector<float> sent = grad_values(mb);
    for (size_t i = 0; i < sent.size(); ++i) {
      EXPECT_EQ(got[i], mb == 1 ? sent[i] : f32_from_bf16(bf16_from_f32(sent[i]))) << i;
    }
  }
  ASSERT_TRUE(sender.flush(2000ms).ok());
  EXPECT_EQ(sender.grads_owed(), 0u);
  // Each end counts once its I/O thread is done with a frame: wait for both.
  const size_t data_bytes = value_or_fail(encoded_frame_size(data_frame(0, 0), kDefaultMaxFrameBytes));
  const size_t grads_bytes = 2 * 195 + kB * kS * kD * (2 + 4);  // framing, one bf16 and one f32 gradient
  const size_t up_bytes = 2 * 144 + grads_bytes;  // 2 ACKs and 2 GRADs
  const auto deadline = std::chrono::steady_clock::now() + 2s;
  while ((sender.stats().bytes_received != up_bytes || sender.stats().bytes_sent != 2 * data_bytes ||
          receiver.stats().bytes_sent != up_bytes || receiver.stats().grads_sent != 2) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(5ms);
  }
  const SenderStats up = sender.stats();
  const ReceiverStats down = receiver.stats();
  EXPECT_EQ(up.grads_received, 2u);
  EXPECT_EQ(down.grads_sent, 2u);
  EXPECT_EQ(up.max_grad_delay, 1u);
  // Bytes each way, as both ends count them: 2 DATA down; 2 ACKs (144 each) and 2 GRADs up.
  EXPECT_EQ(up.bytes_sent, 2 * data_bytes);
  EXPECT_EQ(down.bytes_received, up.bytes_sent);
  EXPECT_EQ(down.bytes_sent, up_bytes);
  EXPECT_EQ(up.bytes_received, down.bytes_sent);
}

TEST(PeerLinkGradTest, AtMostGGradientsAreOwedAndUnowedGradsAreRefused) {
  TempDir dir;
  Receiver receiver(receiver_options(dir.path()));
  ASSERT_TRUE(receiver.start().ok());
  Sender sender(grad_sender_options(receiver.port(), 2, 8));
  ASSERT_TRUE(sender.start().ok());
  forward(&sender, &receiver, 2);
  // Two gradients owed (G = 2): a third DATA waits although D = 8 has room.
  const Status blocked = sender.send(data_frame(0, 2), 200ms);
  EXPECT_EQ(blocked.code(), StatusCode::kTimeout);
  EXPECT_NE(blocked.message().find("2 gradients owed"), std::string::npos) << blocked.message();
  // A gradient that arrived but was not taken still holds its credit.
  ASSERT_TRUE(receiver.send_grad(grad_frame(0, 0), 1000ms).ok());
  const auto deadline = std::chrono::steady_clock::now() + 2s;
  while (sender.grads_owed() != 1 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(5ms);
  ASSERT_EQ(sender.grads_owed(), 1u);
  EXPECT_EQ(sender.send(data_frame(0, 2), 100ms).code(), StatusCode::kTimeout);
  // A second GRAD for micro-batch 0, and one for a micro-batch never sent: refused, never queued.
  ASSERT_TRUE(receiver.send_grad(grad_frame(0, 0), 1000ms).ok());
  ASSERT_TRUE(receiver.send_grad(grad_frame(0, 9), 1000ms).ok());
  while (sender.stats().grads_refused < 2 && std::chrono::steady_clock::now() < deadline + 2s) {
    std::this_thread::sleep_for(5ms);
  }
  EXPECT_EQ(sender.stats().grads_refused, 2u);
  EXPECT_NE(sender.stats().last_reject_reason.find("micro-batch 9, which is not owed a gradient"), std::string::npos);
  ASSERT_OK_AND_ASSIGN(const GradEntry first, sender.next_grad(1000ms));
  EXPECT_EQ(first.micro_batch, 0u);
  EXPECT_EQ(sender.next_grad(100ms).status().code(), StatusCode::kTimeout);
  // Taking it frees the credit.
  ASSERT_TRUE(sender.send(data_frame(0, 2), 1000ms).ok());
  EXPECT_EQ(sender.stats().max_grads_owed_seen, 2u);
  EXPECT_EQ(sender.stats().grads_received, 1u);
}

TEST(PeerLinkGradTest, GradsUnderAnotherKeyOrSessionOrOfAnotherShapeAreRefused) {
  ASSERT_OK_AND_ASSIGN(const ListeningSocket listening, listen_tcp("127.0.0.1", 0));
  Sender sender(grad_sender_options(listening.port, 2));
  ASSERT_TRUE(sender.start().ok());
  ASSERT_OK_AND_ASSIGN(const Socket conn, accept_tcp(listening.socket));
  // Play the downstream by hand: the server's handshake, then its frames.
  const LinkKeys down = testing::downstream_keys();
  SessionState session;
  ASSERT_TRUE(testing::accept_handshake(conn, &session));
  ASSERT_TRUE(sender.send(data_frame(0, 0), 1000ms).ok());
  ASSERT_OK_AND_ASSIGN(const DecodeResult data, read_frame(conn.fd(), down.receive, {}, 2000ms));
  ASSERT_TRUE(data.ok()) << data.reason;
  {  // Its ACK (sequence number 1) is accepted: a GRAD stamped 1 again is a replay.
    const std::vector<uint8_t> ack =
        value_or_fail(encode_frame(session.stamp(make_control_frame(FrameType::kAck, test_run(), 1, 0, 0)), down.send));
    ASSERT_TRUE(send_all(conn.fd(), ack.data(), ack.size()).ok());
    ASSERT_TRUE(sender.flush(2000ms).ok());
  }

  const auto send = [&](const Frame& f, const FrameKey& key) {
    const std::vector<uint8_t> bytes = value_or_fail(encode_frame(f, key));
    ASSERT_TRUE(send_all(conn.fd(), bytes.data(), bytes.size()).ok());
  };
  const FrameKey other_run = link_keys(test_key(99), Channel::kData, 0, LinkEnd::kServer).send;
  SessionState stranger;
  stranger.id.fill(0x42);
  send(session.stamp(grad_frame(0, 0)), down.receive);   // the data-down key: the wrong direction
  send(session.stamp(grad_frame(0, 0)), other_run);      // another run's data-up key
  send(session.stamp(grad_frame(0, 0)), link_keys(test_key(), Channel::kData, 1, LinkEnd::kServer).send);  // link 1's
  send(stranger.stamp(grad_frame(0, 0)), down.send);     // another connection's session
  Frame wrong_shape = grad_frame(0, 0);
  wrong_shape.tensors[0].shape = {kB, kD, kS};
  send(session.stamp(wrong_shape), down.send);           // (B, D, S): unexpected_tensor
  const Frame good = session.stamp(grad_frame(0, 0));
  const std::vector<uint8_t> good_bytes = value_or_fail(encode_frame(good, down.send));
  Frame stale = good;
  stale.seq = 1;  // the ACK's: a replay
  send(stale, down.send);
  const auto deadline = std::chrono::steady_clock::now() + 2s;
  while (sender.stats().rejected < 6 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(5ms);
  const SenderStats refused = sender.stats();
  EXPECT_EQ(refused.rejected, 6u) << refused.last_reject_reason;
  EXPECT_NE(refused.last_reject_reason.find("replay"), std::string::npos) << refused.last_reject_reason;
  EXPECT_EQ(sender.next_grad(100ms).status().code(), StatusCode::kTimeout) << "a refused GRAD reached the runner";
  EXPECT_EQ(sender.grads_owed(), 1u);
  // The real one, in this session under the data-up key, gets through (the stream stayed in sync).
  ASSERT_TRUE(send_all(conn.fd(), good_bytes.data(), good_bytes.size()).ok());
  ASSERT_OK_AND_ASSIGN(const GradEntry e, sender.next_grad(2000ms));
  EXPECT_EQ(e.micro_batch, 0u);
  EXPECT_TRUE(sender.connected()) << "refused frames must not cost the connection";
}

TEST(PeerLinkGradTest, SendGradChecksTheFrameAndBoundsItsQueue) {
  TempDir dir;
  ReceiverOptions options = receiver_options(dir.path());
  options.max_grads_queued = 2;
  Receiver receiver(options);
  ASSERT_TRUE(receiver.start().ok());
  const Status not_grad = receiver.send_grad(data_frame(0, 0), 100ms);
  EXPECT_EQ(not_grad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(not_grad.message().find("not DATA"), std::string::npos) << not_grad.message();
  Frame wrong = grad_frame(0, 0);
  wrong.tensors[0].dtype = DType::kFloat16;
  const Status f16 = receiver.send_grad(wrong, 100ms);
  EXPECT_EQ(f16.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(f16.message().find("dtype float16, expected bfloat16 or float32"), std::string::npos) << f16.message();
  // Nobody upstream: two wait to be written, the third finds no room.
  ASSERT_TRUE(receiver.send_grad(grad_frame(0, 0), 100ms).ok());
  ASSERT_TRUE(receiver.send_grad(grad_frame(0, 0, DType::kFloat32), 100ms).ok());
  const Status full = receiver.send_grad(grad_frame(0, 2), 100ms);
  EXPECT_EQ(full.code(), StatusCode::kTimeout);
  EXPECT_NE(full.message().find("2 GRAD frames still not written upstream"), std::string::npos) << full.message();
  const Status unwritten = receiver.flush_grads(100ms);
  EXPECT_EQ(unwritten.code(), StatusCode::kTimeout);
  EXPECT_NE(unwritten.message().find("2 GRAD frames still not written upstream"), std::string::npos)
      << unwritten.message();
  // Once the upstream connects (its first DATA), the queued ones go out to
  // it: the first is taken, the second (micro-batch 0 again) refused.
  Sender sender(grad_sender_options(receiver.port(), 2));
  ASSERT_TRUE(sender.start().ok());
  forward(&sender, &receiver, 1);
  ASSERT_OK_AND_ASSIGN(const GradEntry e, sender.next_grad(2000ms));
  EXPECT_EQ(e.micro_batch, 0u);
  EXPECT_EQ(e.frame.tensors[0].dtype, DType::kBFloat16);
  // flush_grads returns once both are written, and the stats count them then.
  ASSERT_TRUE(receiver.flush_grads(2000ms).ok());
  EXPECT_EQ(receiver.stats().grads_sent, 2u);
  ASSERT_TRUE(receiver.send_grad(grad_frame(0, 2), 100ms).ok()) << "a written GRAD must free its room";
  SenderOptions bad = grad_sender_options(receiver.port(), 1);
  bad.hidden_size = 0;
  Sender shapeless(bad);
  const Status s = shapeless.start();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("needs the hidden shape"), std::string::npos) << s.message();
}

// A link's emulated network holds both ways: GRADs going up wait out the
// profile's latency and serialize at its bandwidth, as DATA going down does.
TEST(PeerLinkGradTest, GradsGoingUpAreShapedByTheLinkProfile) {
  TempDir dir;
  ReceiverOptions options = receiver_options(dir.path());
  ASSERT_OK_AND_ASSIGN(options.profile, link_profile_from_name("constrained"));
  Receiver receiver(options);
  ASSERT_TRUE(receiver.start().ok());
  Sender sender(grad_sender_options(receiver.port(), 2));
  ASSERT_TRUE(sender.start().ok());
  forward(&sender, &receiver, 2);
  auto t0 = SteadyClock::now();
  ASSERT_TRUE(receiver.send_grad(grad_frame(0, 0), 1000ms).ok());
  ASSERT_TRUE(sender.next_grad(2000ms).ok());
  EXPECT_GE(SteadyClock::now() - t0, 30ms);  // one-way latency of `constrained`
  ASSERT_TRUE(receiver.flush_grads(2000ms).ok());

  // Bandwidth: 3 f32 GRADs of ~243 bytes each at 64 kbit/s need >= 3 * 30 ms on the wire, queued behind each other.
  TempDir slow_dir;
  ReceiverOptions slow = receiver_options(slow_dir.path());
  slow.profile.name = "test";
  slow.profile.bandwidth_bits_per_s = 64'000;
  Receiver narrow(slow);
  ASSERT_TRUE(narrow.start().ok());
  Sender up(grad_sender_options(narrow.port(), 3));
  ASSERT_TRUE(up.start().ok());
  forward(&up, &narrow, 3);
  const size_t grad_bytes = value_or_fail(encoded_frame_size(grad_frame(0, 0, DType::kFloat32), kDefaultMaxFrameBytes));
  ASSERT_GE(grad_bytes * 8 * 1000 / 64'000, 30u);
  t0 = SteadyClock::now();
  for (uint64_t mb = 0; mb < 3; ++mb) ASSERT_TRUE(narrow.send_grad(grad_frame(0, mb, DType::kFloat32), 1000ms).ok());
  for (uint64_t mb = 0; mb < 3; ++mb) {
    ASSERT_OK_AND_ASSIGN(const GradEntry e, up.next_grad(2000ms));
    EXPECT_EQ(e.micro_batch, mb);
  }
  EXPECT_GE(SteadyClock::now() - t0, 90ms);
}

}  // namespace
}  // namespace zl
