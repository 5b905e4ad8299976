// ControlClient against a fake coordinator on loopback (a TcpListener plus
// the frame codec): the session handshake, REGISTER then heartbeats with
// their fields, sealed under the stage's control key, events queued while the
// coordinator is down, the queue bound, START / STOP, bad and replayed
// frames, reconnects, and a prompt shutdown.
#include "zl/control_client.h"

#include <poll.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "net_test_support.h"
#include "temp_dir_support.h"

namespace zl {
namespace {

using namespace std::chrono_literals;
using std::chrono::milliseconds;
using nlohmann::json;
using testing::test_key;
using testing::test_run;
using testing::value_or_fail;
using Clock = std::chrono::steady_clock;

constexpr uint32_t kStage = 2;

/// The coordinator's keys for stage kStage's control channel.
LinkKeys coordinator_keys() { return link_keys(test_key(), Channel::kControl, kStage, LinkEnd::kServer); }

/// Plays the coordinator by hand: listens, accepts one connection at a time,
/// answers its HELLO, checks every frame the stage sends (tag under the
/// stage's key, run id, stage, session, sequence).
class FakeCoordinator {
 public:
  explicit FakeCoordinator(uint16_t port = 0) {
    ListeningSocket listening = value_or_fail(listen_tcp("127.0.0.1", port));
    listener_ = std::move(listening.socket);
    port_ = listening.port;
  }
  uint16_t port() const { return port_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }

  /// Waits for the stage to (re)connect and answers its HELLO; replaces any earlier connection.
  bool accept(milliseconds timeout = 2000ms) {
    pollfd p{listener_.fd(), POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(timeout.count())) <= 0) return false;
    Result<Socket> accepted = accept_tcp(listener_);
    if (!accepted.ok()) return false;
    conn_ = std::move(accepted).value();
    FrameExpectation expect;
    expect.run_id = test_run();
    expect.stage = kStage;
    const Result<DecodeResult> hello = read_frame(conn_.fd(), keys_.receive, expect, timeout);
    if (!hello.ok() || !hello->ok()) return false;
    std::array<uint8_t, kSessionHalfSize> half{};
    random_bytes(half.data(), half.size());
    session_ = SessionState{};
    const Result<Frame> reply = server_handshake(hello->frame, test_run(), kCoordinatorStage, half);
    if (!reply.ok()) return false;
    session_.id = reply->session;
    return write_frame(conn_.fd(), *reply, keys_.send).ok();
  }

  /// The next frame from the stage.
  ::testing::AssertionResult next(Frame* out, milliseconds timeout = 2000ms) {
    FrameExpectation expect;
    expect.run_id = test_run();
    expect.stage = kStage;
    std::vector<uint8_t> raw;
    const Result<DecodeResult> read = read_frame(conn_.fd(), keys_.receive, session_.expect(expect), timeout, &raw);
    if (!read.ok()) return ::testing::AssertionFailure() << "read: " << read.status().message();
    const DecodeResult& r = *read;
    if (!r.ok()) return ::testing::AssertionFailure() << "decode: " << r.reason;
    session_.accepted = r.frame.seq;
    // Sealed under this stage's key: the same bytes do not open under another.
    for (const FrameKey& other : {test_key(), keys_.send, test_key(99)}) {
      if (decode_frame(raw.data(), raw.size(), other).error != FrameError::kBadMac) {
        return ::testing::AssertionFailure() << "frame opens under a wrong key";
      }
    }
    *out = std::move(r.frame);
    return ::testing::AssertionSuccess();
  }

  /// Skips heartbeats up to the next frame of `type`; any other frame fails.
  ::testing::AssertionResult next_of(FrameType type, Frame* out, milliseconds timeout = 2000ms) {
    const auto deadline = Clock::now() + timeout;
    while (Clock::now() < deadline) {
      Frame f;
      auto ok = next(&f, std::chrono::duration_cast<milliseconds>(deadline - Clock::now()) + 1ms);
      if (!ok) return ok;
      if (f.type == type) {
        *out = std::move(f);
        return ::testing::AssertionSuccess();
      }
      if (f.type != FrameType::kHeartbeat) {
        return ::testing::AssertionFailure() << "got " << frame_type_name(static_cast<uint16_t>(f.type))
                                             << " while waiting for " << frame_type_name(static_cast<uint16_t>(type));
      }
    }
    return ::testing::AssertionFailure() << "timed out";
  }

  /// `f` in the session, with the next sequence number, sealed under `key` (default: the coordinator's).
  void send(const Frame& f, const FrameKey* key = nullptr) {
    ASSERT_TRUE(write_frame(conn_.fd(), session_.stamp(f), key ? *key : keys_.send).ok());
  }
  /// `f` as send() would seal it, for replays.
  std::vector<uint8_t> sealed(const Frame& f) {
    return value_or_fail(encode_frame(session_.stamp(f), keys_.send));
  }
  SessionState& session() { return session_; }
  void send_bytes(const std::string& bytes) {
    ASSERT_TRUE(send_all(conn_.fd(), reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()).ok());
  }
  int fd() const { return conn_.fd(); }

 private:
  // Members close in reverse order: the listener before the connection, so a
  // stage that reconnects the moment its connection drops finds nobody
  // listening, not the backlog of a coordinator that is going away (which
  // would count as one more connect).
  Socket conn_;
  Socket listener_;
  uint16_t port_ = 0;
  LinkKeys keys_ = coordinator_keys();
  SessionState session_;
};

Frame from_coordinator(FrameType type, const std::string& payload = "{}") {
  return make_control_frame(type, test_run(), kCoordinatorStage, 0, 0, payload);
}

json payload(const Frame& f) { return json::parse(f.json); }

/// A port nothing listens on (bound, then released).
uint16_t free_port() {
  FakeCoordinator probe;
  return probe.port();
}

ControlClientOptions client_options(uint16_t port) {
  ControlClientOptions o;
  o.coordinator = "127.0.0.1:" + std::to_string(port);
  o.run_id = test_run();
  o.key = test_key();
  o.stage = kStage;
  o.device = "test-device";
  o.listen = "127.0.0.1:7001";
  o.resume = true;
  o.micro_batches_done = 8;
  o.heartbeat_ms = 20ms;
  o.connect_timeout = 200ms;
  o.backoff_initial = 5ms;
  o.backoff_max = 20ms;
  o.flush_timeout = 300ms;
  return o;
}

template <typename Pred>
bool eventually(Pred pred, milliseconds timeout = 2000ms) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(2ms);
  }
  return pred();
}

TEST(ControlClientTest, RegistersThenSendsHeartbeatsWithProgressAndProbes) {
  zl_test::TempDir root;  // fake /proc and /sys: 2048 kB PSS, 36.5 °C (battery on Android, CPU zone on Linux)
  zl_test::write_text(root.file("proc/self/smaps_rollup"), "Rss: 4096 kB\nPss: 2048 kB\n");
  zl_test::write_text(root.file("sys/class/power_supply/battery/temp"), "365\n");
  zl_test::write_text(root.file("sys/class/thermal/thermal_zone0/type"), "x86_pkg_temp\n");
  zl_test::write_text(root.file("sys/class/thermal/thermal_zone0/temp"), "36500\n");
  FakeCoordinator coordinator;
  ControlClientOptions o = client_options(coordinator.port());
  o.probe_root = root.path();
  ControlClient client(o);
  ASSERT_TRUE(client.start().ok());
  ASSERT_TRUE(coordinator.accept());

  Frame reg;
  ASSERT_TRUE(coordinator.next(&reg));
  ASSERT_EQ(reg.type, FrameType::kRegister);
  EXPECT_EQ(reg.micro_batch, 8u);
  const json r = payload(reg);
  EXPECT_EQ(r["stage"], kStage);
  EXPECT_EQ(r["pid"], static_cast<int64_t>(::getpid()));
  EXPECT_EQ(r["device"], "test-device");
  EXPECT_EQ(r["listen"], "127.0.0.1:7001");
  EXPECT_EQ(r["resume"], true);
  EXPECT_EQ(r["micro_batches_done"], 8);
  EXPECT_EQ(r["reconnects"], 0);

  Frame hb;
  ASSERT_TRUE(coordinator.next(&hb));
  ASSERT_EQ(hb.type, FrameType::kHeartbeat);
  json h = payload(hb);
  EXPECT_EQ(h["phase"], "starting");
  EXPECT_TRUE(h["window"].is_null());

  client.update_progress(9, 2);
  ASSERT_TRUE(eventually([&] {
    if (!coordinator.next(&hb, 500ms)) return true;  // fail below
    h = payload(hb);
    return h["micro_batches_done"] == 9;
  }));
  EXPECT_EQ(hb.type, FrameType::kHeartbeat);
  EXPECT_EQ(h["micro_batches_done"], 9);
  EXPECT_EQ(h["window"], 2);
  EXPECT_EQ(hb.window, 2u);
  EXPECT_EQ(hb.micro_batch, 9u);
  EXPECT_DOUBLE_EQ(h["pss_mib"].get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(h["temperature_c"].get<double>(), 36.5);
  EXPECT_EQ(h["phase"], "running");
  EXPECT_GT(h["t_unix_ms"].get<int64_t>(), 1'600'000'000'000);
  EXPECT_TRUE(client.connected());
  EXPECT_EQ(client.stats().connects, 1u);
}

TEST(ControlClientTest, MissingSensorsAreNullNotMadeUp) {
  zl_test::TempDir root;  // an empty tree: no smaps, no battery, no thermal zone
  FakeCoordinator coordinator;
  ControlClientOptions o = client_options(coordinator.port());
  o.probe_root = root.path();
  ControlClient client(o);
  ASSERT_TRUE(client.start().ok());
  ASSERT_TRUE(coordinator.accept());
  Frame hb;
  ASSERT_TRUE(coordinator.next_of(FrameType::kRegister, &hb));
  ASSERT_TRUE(coordinator.next_of(FrameType::kHeartbeat, &hb));
  EXPECT_TRUE(payload(hb)["pss_mib"].is_null());
  EXPECT_TRUE(payload(hb)["temperature_c"].is_null());
}

TEST(ControlClientTest, EventsQueuedWhileCoordinatorIsDownArriveAfterItComesUp) {
  const uint16_t port = free_port();
  ControlClient client(client_options(port));
  ASSERT_TRUE(client.start().ok());  // the coordinator is not up: start() does not care
  WindowCommittedEvent e;
  e.window = 3;
  e.micro_batches_done = 16;
  e.mean_loss = 2.5;
  e.mean_task_loss = 2.0;
  e.mean_consistency_loss = 3.0;
  e.checkpoint_ms = 12.5;
  ASSERT_TRUE(client.window_committed(e).ok());
  ASSERT_TRUE(client.error("disk full").ok());
  std::this_thread::sleep_for(100ms);  // several failed connects and heartbeats
  EXPECT_EQ(client.stats().connects, 0u);
  EXPECT_GE(client.stats().queued, 3u);

  FakeCoordinator coordinator(port);
  ASSERT_TRUE(coordinator.accept());
  Frame f;
  ASSERT_TRUE(coordinator.next(&f));
  EXPECT_EQ(f.type, FrameType::kRegister);  // always first
  ASSERT_TRUE(coordinator.next_of(FrameType::kWindowCommitted, &f));
  EXPECT_EQ(f.window, 3u);
  EXPECT_EQ(f.micro_batch, 16u);
  const json c = payload(f);
  EXPECT_DOUBLE_EQ(c["mean_loss"].get<double>(), 2.5);
  EXPECT_DOUBLE_EQ(c["mean_task_loss"].get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(c["mean_consistency_loss"].get<double>(), 3.0);
  EXPECT_EQ(c["micro_batches_done"], 16);
  EXPECT_DOUBLE_EQ(c["checkpoint_ms"].get<double>(), 12.5);
  EXPECT_EQ(c["checkpointed"], true);
  ASSERT_TRUE(coordinator.next_of(FrameType::kError, &f));  // after the commit: order kept
  EXPECT_EQ(payload(f)["reason"], "disk full");
}

TEST(ControlClientTest, FullQueueDropsOldestHeartbeatsButNeverCommittedEvents) {
  const uint16_t port = free_port();
  ControlClientOptions o = client_options(port);
  o.max_queued = 3;
  o.heartbeat_ms = 5ms;
  ControlClient client(o);
  ASSERT_TRUE(client.start().ok());
  for (int w = 0; w < 5; ++w) {
    WindowCommittedEvent e;
    e.window = w;
    e.micro_batches_done = 4 * (w + 1);
    ASSERT_TRUE(client.window_committed(e).ok());
  }
  ASSERT_TRUE(eventually([&] { return client.stats().heartbeats_dropped >= 3; }));
  EXPECT_EQ(client.stats().queued, 5u + 3u);  // 5 commits (over the bound) + 3 heartbeats

  FakeCoordinator coordinator(port);
  ASSERT_TRUE(coordinator.accept());
  Frame f;
  ASSERT_TRUE(coordinator.next(&f));
  EXPECT_EQ(f.type, FrameType::kRegister);
  for (uint64_t w = 0; w < 5; ++w) {
    ASSERT_TRUE(coordinator.next_of(FrameType::kWindowCommitted, &f)) << "window " << w;
    EXPECT_EQ(f.window, w);
    EXPECT_EQ(payload(f)["checkpointed"], false);
    EXPECT_TRUE(payload(f)["checkpoint_ms"].is_null());
  }
}

TEST(ControlClientTest, StartReleasesWaitForStartAndStopSetsTheFlag) {
  FakeCoordinator coordinator;
  ControlClient client(client_options(coordinator.port()));
  ASSERT_TRUE(client.start().ok());
  ASSERT_TRUE(coordinator.accept());
  Frame f;
  ASSERT_TRUE(coordinator.next_of(FrameType::kRegister, &f));
  EXPECT_EQ(client.wait_for_start(30ms).code(), StatusCode::kTimeout);

  Status waited(StatusCode::kInternal, "not returned");
  std::thread waiter([&] { waited = client.wait_for_start(3000ms); });
  // Heartbeats say what the stage is doing meanwhile.
  ASSERT_TRUE(eventually([&] { return coordinator.next(&f, 500ms) && payload(f)["phase"] == "waiting_for_start"; }));
  coordinator.send(from_coordinator(FrameType::kStart, R"({"lr": 0.0002})"));
  waiter.join();
  EXPECT_TRUE(waited.ok()) << waited.message();
  EXPECT_EQ(json::parse(client.start_settings())["lr"], 0.0002);
  EXPECT_TRUE(client.wait_for_start(0ms).ok());  // already started

  EXPECT_FALSE(client.stop_flag()->load());
  coordinator.send(from_coordinator(FrameType::kStop, R"({"reason": "test"})"));
  ASSERT_TRUE(eventually([&] { return client.stop_flag()->load(); }));
  EXPECT_TRUE(client.stop_requested());
}

TEST(ControlClientTest, StopBeforeStartEndsWaitForStart) {
  FakeCoordinator coordinator;
  ControlClient client(client_options(coordinator.port()));
  ASSERT_TRUE(client.start().ok());
  ASSERT_TRUE(coordinator.accept());
  coordinator.send(from_coordinator(FrameType::kStop));
  const Status s = client.wait_for_start(2000ms);
  EXPECT_EQ(s.code(), StatusCode::kClosed) << s.message();
}

TEST(ControlClientTest, ChainedStopFlagIsMirrored) {
  std::atomic<bool> external{false};
  ControlClientOptions o = client_options(free_port());  // no coordinator at all
  o.chain_stop = &external;
  ControlClient client(o);
  ASSERT_TRUE(client.start().ok());
  EXPECT_FALSE(client.stop_flag()->load());
  external.store(true);
  EXPECT_TRUE(eventually([&] { return client.stop_flag()->load(); }, 500ms));
  EXPECT_EQ(client.wait_for_start(1000ms).code(), StatusCode::kClosed);
}

TEST(ControlClientTest, BadFramesAreRejectedAndTheClientKeepsRunning) {
  FakeCoordinator coordinator;
  ControlClient client(client_options(coordinator.port()));
  ASSERT_TRUE(client.start().ok());
  ASSERT_TRUE(coordinator.accept());
  Frame f;
  ASSERT_TRUE(coordinator.next_of(FrameType::kRegister, &f));

  // Under another key: bad tag, skipped; the stream stays in sync.
  const FrameKey wrong = test_key(99);
  coordinator.send(from_coordinator(FrameType::kStop), &wrong);
  ASSERT_TRUE(eventually([&] { return client.stats().rejected == 1; }));
  EXPECT_EQ(client.stats().last_reject_reason.rfind("bad_mac", 0), 0u) << client.stats().last_reject_reason;
  // From a stage rather than the coordinator, and from another run.
  coordinator.send(make_control_frame(FrameType::kStop, test_run(), 0, 0, 0));
  ASSERT_TRUE(eventually([&] { return client.stats().rejected == 2; }));
  EXPECT_EQ(client.stats().last_reject_reason.rfind("wrong_stage", 0), 0u) << client.stats().last_reject_reason;
  coordinator.send(make_control_frame(FrameType::kStop, test_run(5), kCoordinatorStage, 0, 0));
  ASSERT_TRUE(eventually([&] { return client.stats().rejected == 3; }));
  EXPECT_EQ(client.stats().last_reject_reason.rfind("wrong_run", 0), 0u) << client.stats().last_reject_reason;
  // A valid frame of a type the stage does not take is ignored.
  coordinator.send(from_coordinator(FrameType::kAck));
  ASSERT_TRUE(eventually([&] { return client.stats().ignored == 1; }));
  EXPECT_FALSE(client.stop_flag()->load());
  ASSERT_TRUE(coordinator.next_of(FrameType::kHeartbeat, &f));  // same connection still serves
  EXPECT_EQ(client.stats().connects, 1u);
  // Another session's STOP, and a sequence number used already (issue 12 item 3).
  SessionState saved = coordinator.session();
  coordinator.session().id[0] ^= 1;
  coordinator.send(from_coordinator(FrameType::kStop));
  ASSERT_TRUE(eventually([&] { return client.stats().rejected == 4; }));
  EXPECT_EQ(client.stats().last_reject_reason.rfind("wrong_session", 0), 0u) << client.stats().last_reject_reason;
  coordinator.session() = saved;
  coordinator.session().sent = 1;
  coordinator.send(from_coordinator(FrameType::kStop));
  ASSERT_TRUE(eventually([&] { return client.stats().rejected == 5; }));
  EXPECT_EQ(client.stats().last_reject_reason.rfind("replay", 0), 0u) << client.stats().last_reject_reason;
  coordinator.session() = saved;
  EXPECT_FALSE(client.stop_flag()->load());

  // Garbage: frame boundaries are lost, so the client reconnects and registers again.
  coordinator.send_bytes(std::string(80, 'x'));
  ASSERT_TRUE(eventually([&] { return client.stats().rejected == 6; }));
  EXPECT_EQ(client.stats().last_reject_reason.rfind("bad_magic", 0), 0u) << client.stats().last_reject_reason;
  ASSERT_TRUE(coordinator.accept());
  ASSERT_TRUE(coordinator.next(&f));
  EXPECT_EQ(f.type, FrameType::kRegister);
  EXPECT_EQ(payload(f)["reconnects"], 1);
  coordinator.send(from_coordinator(FrameType::kStop));
  EXPECT_TRUE(eventually([&] { return client.stop_flag()->load(); }));
}

// Issue 12 item 3: a STOP recorded on one connection, replayed on the next
// (a new session), does not stop the stage.
TEST(ControlClientTest, ACommandRecordedOnAnEarlierConnectionIsRejected) {
  const uint16_t port = free_port();
  ControlClient client(client_options(port));
  ASSERT_TRUE(client.start().ok());
  std::vector<uint8_t> recorded;
  {
    FakeCoordinator first(port);
    ASSERT_TRUE(first.accept());
    Frame f;
    ASSERT_TRUE(first.next_of(FrameType::kRegister, &f));
    recorded = first.sealed(from_coordinator(FrameType::kStop));  // what a STOP on that connection looked like
  }
  FakeCoordinator second(port);
  ASSERT_TRUE(second.accept());
  Frame f;
  ASSERT_TRUE(second.next_of(FrameType::kRegister, &f));
  second.send_bytes(std::string(recorded.begin(), recorded.end()));
  ASSERT_TRUE(eventually([&] { return client.stats().rejected == 1; }));
  EXPECT_EQ(client.stats().last_reject_reason.rfind("wrong_session", 0), 0u) << client.stats().last_reject_reason;
  EXPECT_FALSE(client.stop_flag()->load());
  second.send(from_coordinator(FrameType::kStop));
  EXPECT_TRUE(eventually([&] { return client.stop_flag()->load(); }));
}

TEST(ControlClientTest, ReRegistersAfterTheCoordinatorRestarts) {
  const uint16_t port = free_port();
  ControlClient client(client_options(port));
  ASSERT_TRUE(client.start().ok());
  {
    FakeCoordinator first(port);
    ASSERT_TRUE(first.accept());
    Frame f;
    ASSERT_TRUE(first.next_of(FrameType::kRegister, &f));
  }  // the coordinator goes away
  client.update_progress(12, 3);
  WindowCommittedEvent e;
  e.window = 2;
  e.micro_batches_done = 12;
  ASSERT_TRUE(client.window_committed(e).ok());
  std::this_thread::sleep_for(50ms);
  FakeCoordinator second(port);
  ASSERT_TRUE(second.accept());
  Frame f;
  ASSERT_TRUE(second.next(&f));
  ASSERT_EQ(f.type, FrameType::kRegister);
  EXPECT_EQ(payload(f)["micro_batches_done"], 12);
  EXPECT_EQ(payload(f)["reconnects"], 1);
  // The commit may have been written into the dead connection's buffer; if it
  // was not, it arrives here. Either way training went on and heartbeats flow.
  ASSERT_TRUE(eventually([&] { return second.next(&f, 500ms) && f.type == FrameType::kHeartbeat; }));
}

TEST(ControlClientTest, ShutdownFlushesCommittedEventsAndAFinalHeartbeat) {
  FakeCoordinator coordinator;
  ControlClientOptions o = client_options(coordinator.port());
  o.heartbeat_ms = 10'000ms;  // only the final heartbeat
  ControlClient client(o);
  ASSERT_TRUE(client.start().ok());
  ASSERT_TRUE(coordinator.accept());
  Frame f;
  ASSERT_TRUE(coordinator.next_of(FrameType::kRegister, &f));
  WindowCommittedEvent e;
  e.window = 7;
  e.micro_batches_done = 32;
  ASSERT_TRUE(client.window_committed(e).ok());
  client.update_progress(32, 7, ControlPhase::kDone);
  const auto t0 = Clock::now();
  client.shutdown();
  EXPECT_LT(Clock::now() - t0, 200ms);
  ASSERT_TRUE(coordinator.next(&f));
  EXPECT_EQ(f.type, FrameType::kWindowCommitted);
  EXPECT_EQ(f.window, 7u);
  ASSERT_TRUE(coordinator.next(&f));
  EXPECT_EQ(f.type, FrameType::kHeartbeat);
  EXPECT_EQ(payload(f)["phase"], "done");
  EXPECT_FALSE(coordinator.next(&f, 500ms));  // then the connection closes
  EXPECT_EQ(client.window_committed(e).code(), StatusCode::kClosed);
  EXPECT_EQ(client.error("late").code(), StatusCode::kClosed);
  client.shutdown();  // idempotent
}

TEST(ControlClientTest, ShutdownIsPromptWithTheCoordinatorDown) {
  ControlClientOptions o = client_options(free_port());
  o.flush_timeout = 150ms;
  {
    ControlClient client(o);
    ASSERT_TRUE(client.start().ok());
    const auto t0 = Clock::now();
    client.shutdown();  // nothing but heartbeats queued: nothing to wait for
    EXPECT_LT(Clock::now() - t0, 100ms);
  }
  ControlClient client(o);
  ASSERT_TRUE(client.start().ok());
  WindowCommittedEvent e;
  ASSERT_TRUE(client.window_committed(e).ok());
  const auto t0 = Clock::now();
  client.shutdown();  // tries to deliver the commit until flush_timeout
  const auto took = Clock::now() - t0;
  EXPECT_GE(took, 100ms);
  EXPECT_LT(took, 150ms + o.connect_timeout + 100ms);
}

TEST(ControlClientTest, StartRejectsBadOptions) {
  for (const char* address : {"", "nonsense", "host:0", "host:70000", ":7100", "host:", "host:7a"}) {
    ControlClientOptions o = client_options(1);
    o.coordinator = address;
    ControlClient client(o);
    EXPECT_EQ(client.start().code(), StatusCode::kInvalidArgument) << address;
  }
  ControlClientOptions o = client_options(1);
  o.heartbeat_ms = 0ms;
  EXPECT_EQ(ControlClient(o).start().code(), StatusCode::kInvalidArgument);

  RunnerConfig config;
  config.coordinator = "10.0.0.2:7100";
  config.run_id = "00112233445566778899aabbccddeeff";
  config.stage_index = 1;
  ASSERT_OK_AND_ASSIGN(const ControlClientOptions from, control_options_from_config(config, test_key()));
  EXPECT_EQ(from.coordinator, "10.0.0.2:7100");
  EXPECT_EQ(from.stage, 1u);
  EXPECT_EQ(to_hex(from.run_id.data(), from.run_id.size()), config.run_id);
  config.run_id = "xyz";
  EXPECT_EQ(control_options_from_config(config, test_key()).status().code(), StatusCode::kInvalidArgument);
  config.coordinator.clear();
  EXPECT_EQ(control_options_from_config(config, test_key()).status().code(), StatusCode::kInvalidArgument);
}

TEST(ControlClientTest, DescribesTheDevice) {
  const std::string d = describe_device();
  EXPECT_FALSE(d.empty());
  EXPECT_NE(d.find('('), std::string::npos) << d;
}

}  // namespace
}  // namespace zl
