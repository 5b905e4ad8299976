// StageSession: the app's way to run a stage (zl/stage_session.h). What the
// host orchestrator relies on is checked here without a JVM: the files in
// the run folder (runner.pid/.out/.err/.exit), the exit statuses, the status
// JSON and the refusals. A real run through the session is checked by
// tests/test_runner.py (a pipeline stage driven through the JNI library).
#include "zl/stage_session.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <string>

#include "temp_dir_support.h"
#include "zl/durable_file.h"
#include "zl/runner.h"
#include "zl/telemetry.h"

namespace {

using std::chrono::seconds;
using zl::SessionState;
using zl::StageSession;
using zl::StatusCode;

std::string read_or_empty(const std::string& path) {
  zl::Result<std::string> text = zl::read_file(path);
  return text.ok() ? std::move(text).value() : "";
}

/// A config that parses; `extra` is spliced in as more fields.
std::string config_json(const std::string& base_dir, const std::string& extra = "") {
  return "{\"base_dir\": \"" + base_dir + "\", \"program\": \"stage_1.pte\", \"stage_index\": 1," +
         " \"num_stages\": 3, \"listen\": \"127.0.0.1:0\", \"downstream\": \"127.0.0.1:9\"," +
         " \"run_key_file\": \"run.key\", \"run_id\": \"00112233445566778899aabbccddeeff\"," +
         " \"window_size\": 2, \"num_micro_batches\": 4, \"checkpoint_dir\": \"ckpt\"" + extra + "}";
}

TEST(StageSession, RefusesTextWithoutAnAbsoluteBaseDirAndWritesNothing) {
  zl_test::TempDir dir;
  StageSession session;
  zl::Status status = session.start("not json");
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("not a JSON object"), std::string::npos) << status.message();

  status = session.start("{\"program\": \"a.pte\"}");
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("'base_dir'"), std::string::npos) << status.message();

  status = session.start(config_json("relative/dir"));
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("\"relative/dir\""), std::string::npos) << status.message();

  EXPECT_EQ(session.status().state, SessionState::kIdle);
  EXPECT_FALSE(session.running());
  EXPECT_FALSE(session.stop());
}

TEST(StageSession, InvalidConfigLeavesWhatZlRunnerWouldExit2) {
  zl_test::TempDir dir;
  const std::string run = dir.file("run");
  zl_test::write_text(dir.file("run/runner.exit"), "0\n");  // a stale one from an earlier run
  StageSession session;
  const zl::Status status = session.start(config_json(run, ", \"window_size\": \"two\""));
  ASSERT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("window_size"), std::string::npos) << status.message();

  EXPECT_EQ(read_or_empty(run + "/runner.pid"), std::to_string(::getpid()) + "\n");
  EXPECT_EQ(read_or_empty(run + "/runner.exit"), "2\n");
  EXPECT_NE(read_or_empty(run + "/runner.err").find("window_size"), std::string::npos);

  const zl::SessionStatus s = session.status();
  EXPECT_EQ(s.state, SessionState::kFailed);
  EXPECT_EQ(s.exit_code, 2);
  const nlohmann::json j = s.to_json();
  EXPECT_EQ(j["state"], "failed");
  EXPECT_EQ(j["exit_code"], 2);
  EXPECT_EQ(j["error_code"], "invalid_argument");
  EXPECT_TRUE(j["loss"].is_null());
  EXPECT_TRUE(j["stage"].is_null());
}

TEST(StageSession, RunFailureIsReportedAsExit1AndTheSessionCanStartAgain) {
  zl_test::TempDir dir;
  const std::string run = dir.file("run");
  zl_test::write_text(run + "/run.key", std::string(64, 'a') + "\n");
  StageSession session;
  // Parses, but the program does not exist: run_stage fails on its thread.
  ASSERT_TRUE(session.start(config_json(run)).ok());
  ASSERT_TRUE(session.wait(std::chrono::milliseconds(30000)));
  zl::SessionStatus s = session.status();
  EXPECT_EQ(s.state, SessionState::kFailed);
  EXPECT_EQ(s.exit_code, 1);
  EXPECT_EQ(s.run_dir, run);
  EXPECT_NE(s.error.message().find(run + "/manifest.json"), std::string::npos) << s.error.message();
  EXPECT_EQ(s.progress.stage_index, 1);
  EXPECT_EQ(s.progress.num_micro_batches, 4);
  EXPECT_EQ(s.progress.phase, "loading");
  EXPECT_EQ(read_or_empty(run + "/runner.exit"), "1\n");
  const std::string err = read_or_empty(run + "/runner.err");
  EXPECT_NE(err.find("stage 1 failed"), std::string::npos) << err;
  EXPECT_NE(err.find("app: stage 1 of 3 in " + run), std::string::npos) << err;

  // Not stuck: a second run starts (and fails the same way), appending to runner.err.
  ASSERT_TRUE(session.start(config_json(run)).ok());
  ASSERT_TRUE(session.wait(std::chrono::milliseconds(30000)));
  EXPECT_EQ(session.status().exit_code, 1);
  const std::string err2 = read_or_empty(run + "/runner.err");
  EXPECT_GT(err2.size(), err.size());
  EXPECT_EQ(err2.compare(0, err.size(), err), 0);
}

TEST(StageExitCode, UnrecoverableIsExit2SoTheCoordinatorDoesNotRetry) {
  EXPECT_EQ(zl::stage_exit_code(zl::Status(zl::StatusCode::kUnrecoverable, "corrupt checkpoint"), false), 2);
  EXPECT_EQ(zl::stage_exit_code(zl::Status(zl::StatusCode::kCorrupt, "bad frame"), false), 1);
  EXPECT_EQ(zl::stage_exit_code(zl::Status(zl::StatusCode::kClosed, "stop requested"), true), 3);
  EXPECT_EQ(zl::stage_exit_code(zl::Status(), false), 0);
}

TEST(StageSession, UnwritableRunFolderIsAnIoError) {
  zl_test::TempDir dir;
  zl_test::write_text(dir.file("file"), "x");
  StageSession session;
  const zl::Status status = session.start(config_json(dir.file("file/run")));
  EXPECT_NE(status.code(), StatusCode::kOk);
  EXPECT_NE(status.message().find(dir.file("file/run")), std::string::npos) << status.message();
  EXPECT_FALSE(session.running());
}

TEST(Telemetry, ReportedTemperatureStandsInOnlyWhereTheSensorIsUnreadable) {
  // The reading is process-wide: forget it afterwards, or tests of fake trees that run later in this
  // process (ControlClientTest.MissingSensorsAreNullNotMadeUp) would see it.
  struct Forget {
    ~Forget() { zl::clear_reported_temperature_c(); }
  } forget;
  zl_test::TempDir empty;  // no /sys under it: no sensor
  zl::report_temperature_c(1000.0);  // implausible: ignored
  const auto before = zl::read_temperature_c(empty.path());
  EXPECT_TRUE(!before || *before != 1000.0);
  zl::report_temperature_c(31.5);
  ASSERT_TRUE(zl::read_temperature_c(empty.path()).has_value());
  EXPECT_DOUBLE_EQ(*zl::read_temperature_c(empty.path()), 31.5);
  zl::clear_reported_temperature_c();
  EXPECT_FALSE(zl::read_temperature_c(empty.path()).has_value());

  zl::report_temperature_c(31.5);  // the sensor file still wins over it

  zl_test::TempDir sensor;
#if defined(__ANDROID__)
  zl_test::write_text(sensor.file("sys/class/power_supply/battery/temp"), "402\n");
  EXPECT_DOUBLE_EQ(*zl::read_temperature_c(sensor.path()), 40.2);
#else
  zl_test::write_text(sensor.file("sys/class/thermal/thermal_zone0/type"), "x86_pkg_temp\n");
  zl_test::write_text(sensor.file("sys/class/thermal/thermal_zone0/temp"), "40200\n");
  EXPECT_DOUBLE_EQ(*zl::read_temperature_c(sensor.path()), 40.2);
#endif
}

}  // namespace
