// Telemetry: JSON-lines records, and the PSS / temperature probes read from
// a fake /proc and /sys tree.
#include "zl/telemetry.h"

#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "status_test_support.h"
#include "temp_dir_support.h"

namespace {

using nlohmann::json;
using zl_test::write_text;

TEST(Pss, ReadsThePssLineOfSmapsRollup) {
  zl_test::TempDir root;
  write_text(root.file("proc/self/smaps_rollup"),
             "00400000-7fff0000 ---p 00000000 00:00 0   [rollup]\n"
             "Rss:              409600 kB\n"
             "Pss:              204800 kB\n"
             "Pss_Anon:         100000 kB\n"
             "Pss_File:         104800 kB\n");
  auto pss = zl::read_pss_mib(root.path());
  ASSERT_TRUE(pss.has_value());
  EXPECT_DOUBLE_EQ(*pss, 200.0);
}

TEST(Pss, FallsBackToSummingSmaps) {
  zl_test::TempDir root;
  write_text(root.file("proc/self/smaps"),
             "00400000-00452000 r-xp 00000000 08:02 173521 /usr/bin/x\n"
             "Pss:                512 kB\n"
             "Pss_Dirty:          100 kB\n"
             "7f0000000000-7f0000100000 rw-p 00000000 00:00 0\n"
             "Pss:                512 kB\n");
  auto pss = zl::read_pss_mib(root.path());
  ASSERT_TRUE(pss.has_value());
  EXPECT_DOUBLE_EQ(*pss, 1.0);
}

TEST(Pss, AbsentOrGarbledIsEmpty) {
  zl_test::TempDir root;
  EXPECT_FALSE(zl::read_pss_mib(root.path()).has_value());
  write_text(root.file("proc/self/smaps_rollup"), "Rss: 10 kB\n");
  EXPECT_FALSE(zl::read_pss_mib(root.path()).has_value());
  write_text(root.file("proc/self/smaps_rollup"), "Pss: lots kB\n");
  EXPECT_FALSE(zl::read_pss_mib(root.path()).has_value());
}

TEST(PeakRss, ReadsVmHwmOfStatus) {
  zl_test::TempDir root;
  EXPECT_FALSE(zl::read_peak_rss_mib(root.path()).has_value());
  write_text(root.file("proc/self/status"),
             "Name:\tzl_runner\n"
             "VmPeak:\t 2000000 kB\n"
             "VmHWM:\t  307200 kB\n"
             "VmRSS:\t  102400 kB\n");
  auto peak = zl::read_peak_rss_mib(root.path());
  ASSERT_TRUE(peak.has_value());
  EXPECT_DOUBLE_EQ(*peak, 300.0);
  write_text(root.file("proc/self/status"), "VmRSS:\t 10 kB\n");
  EXPECT_FALSE(zl::read_peak_rss_mib(root.path()).has_value());
}

TEST(PeakRss, CountsWhatThisProcessTouches) {
  auto before = zl::read_peak_rss_mib();
  if (!before) GTEST_SKIP() << "no /proc/self/status VmHWM here";
  std::vector<char> touched(64u << 20, 1);  // 64 MiB, resident
  auto after = zl::read_peak_rss_mib();
  ASSERT_TRUE(after.has_value());
  EXPECT_GE(*after, *before + 60.0 * (touched[touched.size() / 2] == 1));
}

TEST(Pss, ReadsThisProcess) {
  // The real /proc of the test process (Linux CI): some positive value.
  auto pss = zl::read_pss_mib();
  if (!pss) GTEST_SKIP() << "no /proc/self/smaps_rollup or smaps here";
  EXPECT_GT(*pss, 0.0);
}

TEST(Temperature, BatteryIsInTenthsOfADegree) {
  zl_test::TempDir root;
  EXPECT_FALSE(zl::read_battery_temperature_c(root.path()).has_value());
  write_text(root.file("sys/class/power_supply/battery/temp"), "372\n");
  auto t = zl::read_battery_temperature_c(root.path());
  ASSERT_TRUE(t.has_value());
  EXPECT_DOUBLE_EQ(*t, 37.2);
  write_text(root.file("sys/class/power_supply/battery/temp"), "-2731\n");  // no sensor
  EXPECT_FALSE(zl::read_battery_temperature_c(root.path()).has_value());
}

TEST(Temperature, FirstPlausibleThermalZoneByIndex) {
  zl_test::TempDir root;
  const std::string base = root.file("sys/class/thermal/");
  write_text(base + "thermal_zone0/type", "iwlwifi_1\n");  // not a CPU/SoC sensor
  write_text(base + "thermal_zone0/temp", "45000\n");
  write_text(base + "thermal_zone2/type", "x86_pkg_temp\n");
  write_text(base + "thermal_zone2/temp", "61000\n");
  write_text(base + "thermal_zone10/type", "cpu-thermal\n");
  write_text(base + "thermal_zone10/temp", "70000\n");
  write_text(base + "thermal_zone1/type", "acpitz\n");
  write_text(base + "thermal_zone1/temp", "-273000\n");  // implausible: skipped
  write_text(base + "cooling_device0/type", "Processor\n");
  auto t = zl::read_thermal_zone_temperature_c(root.path());
  ASSERT_TRUE(t.has_value());
  EXPECT_DOUBLE_EQ(*t, 61.0);
}

TEST(Temperature, NoSensorIsEmptyNotInvented) {
  zl_test::TempDir root;
  EXPECT_FALSE(zl::read_thermal_zone_temperature_c(root.path()).has_value());
  write_text(root.file("sys/class/thermal/thermal_zone0/type"), "battery_charger\n");
  write_text(root.file("sys/class/thermal/thermal_zone0/temp"), "30000\n");
  EXPECT_FALSE(zl::read_thermal_zone_temperature_c(root.path()).has_value());
  EXPECT_FALSE(zl::read_temperature_c(root.path()).has_value());
}

std::vector<json> read_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<json> out;
  std::string line;
  while (std::getline(in, line)) out.push_back(json::parse(line));
  return out;
}

TEST(TelemetryWriter, WritesOneJsonObjectPerLineWithNulls) {
  zl_test::TempDir dir;
  const std::string path = dir.file("metrics.jsonl");
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<zl::TelemetryWriter> writer, zl::TelemetryWriter::open(path));
  zl::MicroBatchRecord mb;
  mb.stage = 1;
  mb.window = 2;
  mb.micro_batch = 9;
  mb.phase1_ms = 12.5;
  mb.loss = 3.25;
  mb.consistency_loss = std::numeric_limits<double>::quiet_NaN();
  mb.pss_mib = 812.0;
  ASSERT_TRUE(writer->write(mb).ok());
  zl::WindowRecord w;
  w.stage = 1;
  w.window = 2;
  w.micro_batches = 4;
  w.mean_loss = 3.0;
  w.lr = 1e-4;
  w.step = 3;
  w.checkpoint_ms = 41.0;
  w.temperature_c = 36.5;
  ASSERT_TRUE(writer->write(w).ok());
  writer.reset();
  // Reopening appends.
  ASSERT_OK_AND_ASSIGN(writer, zl::TelemetryWriter::open(path));
  ASSERT_TRUE(writer->write_json({{"type", "stop"}}).ok());

  auto lines = read_lines(path);
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0]["type"], "micro_batch");
  EXPECT_EQ(lines[0]["micro_batch"], 9);
  EXPECT_DOUBLE_EQ(lines[0]["phase1_ms"].get<double>(), 12.5);
  EXPECT_DOUBLE_EQ(lines[0]["loss"].get<double>(), 3.25);
  EXPECT_TRUE(lines[0]["consistency_loss"].is_null());
  EXPECT_TRUE(lines[0]["temperature_c"].is_null());
  EXPECT_DOUBLE_EQ(lines[0]["pss_mib"].get<double>(), 812.0);
  for (const char* key : {"stage", "window", "phase2_ms", "queue_ms", "send_ms", "total_ms", "task_loss", "t_unix_ms"}) {
    EXPECT_TRUE(lines[0].contains(key)) << key;
  }
  EXPECT_EQ(lines[1]["type"], "window");
  EXPECT_EQ(lines[1]["step"], 3);
  EXPECT_DOUBLE_EQ(lines[1]["checkpoint_ms"].get<double>(), 41.0);
  EXPECT_DOUBLE_EQ(lines[1]["temperature_c"].get<double>(), 36.5);
  EXPECT_TRUE(lines[1]["pss_mib"].is_null());
  EXPECT_EQ(lines[2]["type"], "stop");
}

TEST(TelemetryWriter, ForwardOnlyRecordsHaveNullLossesAndTheMarker) {
  zl::MicroBatchRecord mb;
  mb.phase1_ms = 4.0;
  mb.loss = 3.25;  // stale values must not show
  mb.forward_only = true;
  const json line = zl::to_json(mb);
  EXPECT_EQ(line["forward_only"], true);
  EXPECT_DOUBLE_EQ(line["phase2_ms"].get<double>(), 0.0);
  for (const char* key : {"loss", "task_loss", "consistency_loss"}) EXPECT_TRUE(line[key].is_null()) << key;
  zl::WindowRecord w;
  w.mean_loss = 2.0;
  w.lr = 0.0;
  w.step = 5;
  w.forward_only = true;
  const json window = zl::to_json(w);
  EXPECT_EQ(window["forward_only"], true);
  EXPECT_EQ(window["step"], 5);
  for (const char* key : {"mean_loss", "mean_task_loss", "mean_consistency_loss"}) {
    EXPECT_TRUE(window[key].is_null()) << key;
  }
  zl::MicroBatchRecord whole;
  whole.loss = 1.5;
  EXPECT_EQ(zl::to_json(whole)["forward_only"], false);
  EXPECT_DOUBLE_EQ(zl::to_json(whole)["loss"].get<double>(), 1.5);
}

TEST(TelemetryWriter, UnwritableDirectoryIsAnError) {
  const zl::Status s = zl::TelemetryWriter::open("/nonexistent/zl/metrics.jsonl").status();
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("/nonexistent/zl/metrics.jsonl"), std::string::npos);
}

}  // namespace
