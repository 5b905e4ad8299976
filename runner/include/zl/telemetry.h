// Runner telemetry: JSON lines, one record per micro-batch and one per update
// window (docs/design#runner), plus the probes for memory (PSS) and temperature.
//
// Micro-batch line (times in milliseconds, memory in MiB, temperature in °C):
//   {"type": "micro_batch", "t_unix_ms": ..., "stage": 1, "window": 3, "micro_batch": 14,
//    "phase1_ms": ..., "phase2_ms": ..., "queue_ms": ..., "send_ms": ..., "total_ms": ...,
//    "loss": ..., "task_loss": ..., "consistency_loss": ..., "pss_mib": ..., "temperature_c": ...}
// Window line:
//   {"type": "window", "t_unix_ms": ..., "stage": 1, "window": 3, "micro_batches": 4,
//    "mean_loss": ..., "mean_task_loss": ..., "mean_consistency_loss": ...,
//    "lr": ..., "step": 4, "checkpoint_ms": ..., "pss_mib": ..., "temperature_c": ...}
// Both carry "forward_only": true for a stage held still by lr 0
// (docs/design#windows-and-adamw), which runs phase 1 only: its phase2_ms is 0 and its losses null.
// A value that was not measured (no sensor, no smaps_rollup, a NaN loss) is
// written as null — never a made-up number.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "zl/status.h"

namespace zl {

/// One micro-batch through this stage.
struct MicroBatchRecord {
  int64_t stage = 0;
  int64_t window = 0;
  int64_t micro_batch = 0;
  double phase1_ms = 0;  ///< method start to the marker (hidden ready)
  double phase2_ms = 0;  ///< marker to method end (readout, loss, backward)
  double queue_ms = 0;   ///< waiting for input (shard read or inbound entry)
  double send_ms = 0;    ///< handing the hidden state to the link (incl. back-pressure)
  double total_ms = 0;   ///< whole micro-batch, wall clock
  double loss = 0;
  double task_loss = 0;
  double consistency_loss = 0;
  std::optional<double> pss_mib;
  std::optional<double> temperature_c;
  /// Phase 1 only (a stage held still by lr 0): phase2_ms 0, losses not computed (null).
  bool forward_only = false;
  /// Backprop schedules (docs/design#backprop-schedules): waiting for the micro-batch's
  /// gradient from downstream, and the weight version (optimizer steps) its
  /// forward and backward ran on; unset under zerolock.
  std::optional<double> grad_wait_ms;
  std::optional<int64_t> weight_version;
};

/// One update window (after its AdamW step and checkpoint).
struct WindowRecord {
  int64_t stage = 0;
  int64_t window = 0;
  int64_t micro_batches = 0;  ///< micro-batches averaged below
  double mean_loss = 0;
  double mean_task_loss = 0;
  double mean_consistency_loss = 0;
  double lr = 0;              ///< learning rate of this window's step
  int64_t step = 0;           ///< optimizer steps taken after this window
  std::optional<double> checkpoint_ms;  ///< empty when no checkpoint was due
  std::optional<double> pss_mib;
  std::optional<double> temperature_c;
  /// The window's micro-batches ran phase 1 only: mean losses null, the step changed nothing.
  bool forward_only = false;
};

/// The JSON object of a record (see file comment), with t_unix_ms stamped.
/// A JSON number, or null for a missing or non-finite value (telemetry never
/// writes a made-up number).
nlohmann::json number_or_null(double value);
nlohmann::json number_or_null(const std::optional<double>& value);

nlohmann::json to_json(const MicroBatchRecord& record);
nlohmann::json to_json(const WindowRecord& record);

/// Appends records as JSON lines. Thread-safe; each line is flushed so a
/// killed process loses at most the line being written.
class TelemetryWriter {
 public:
  /// Opens `path` for appending, creating it if needed.
  static Result<std::unique_ptr<TelemetryWriter>> open(const std::string& path);
  ~TelemetryWriter();
  TelemetryWriter(const TelemetryWriter&) = delete;
  TelemetryWriter& operator=(const TelemetryWriter&) = delete;

  Status write(const MicroBatchRecord& record);
  Status write(const WindowRecord& record);
  /// Writes any JSON object as one line (e.g. a "start" or "error" event).
  Status write_json(const nlohmann::json& object);

 private:
  explicit TelemetryWriter(std::FILE* file, std::string path) : file_(file), path_(std::move(path)) {}
  std::mutex mutex_;
  std::FILE* file_;
  std::string path_;
};

/// Proportional set size of this process in MiB: the `Pss:` line (kB) of
/// `<root>/proc/self/smaps_rollup`, or, on kernels without it (< 4.14), the
/// sum of the `Pss:` lines of `<root>/proc/self/smaps`. Empty if neither is
/// readable. `root` is "/" in production; tests point it at a fake tree.
std::optional<double> read_pss_mib(const std::string& root = "/");

/// Peak resident set of this process in MiB since it started (exec): the
/// `VmHWM:` line (kB) of `<root>/proc/self/status`. Empty if unreadable. Not
/// getrusage's ru_maxrss, which survives exec (a runner started by a big
/// parent, or forked from Android's zygote, would report the parent's peak).
std::optional<double> read_peak_rss_mib(const std::string& root = "/");

/// Battery temperature in °C from `<root>/sys/class/power_supply/battery/temp`
/// (tenths of a degree, the Android convention). Empty if absent or implausible.
std::optional<double> read_battery_temperature_c(const std::string& root = "/");

/// Temperature in °C of the first `<root>/sys/class/thermal/thermal_zone<N>`
/// (by N) whose `type` names a CPU/SoC/package sensor (contains "cpu", "soc",
/// "pkg", "package", "coretemp", "acpitz" or "tsens") and whose `temp`
/// (millidegrees) reads a plausible value. Empty if none.
std::optional<double> read_thermal_zone_temperature_c(const std::string& root = "/");

/// The device temperature the report uses: the battery on Android (the
/// paper's measure), the first plausible thermal zone on Linux. Where the
/// sensor file cannot be read (an app process is usually denied
/// /sys/class/power_supply by SELinux), the last value given to
/// report_temperature_c if it is at most kReportedTemperatureMaxAgeS old;
/// else empty.
std::optional<double> read_temperature_c(const std::string& root = "/");

/// How long a reported temperature stands in for the sensor file.
constexpr double kReportedTemperatureMaxAgeS = 120.0;

/// A temperature in °C read by someone who can (the Android app, from
/// BatteryManager's sticky ACTION_BATTERY_CHANGED); implausible values are
/// ignored. Thread-safe.
void report_temperature_c(double celsius);

/// Forgets the reported temperature (the reading is process-wide: a test
/// that reports one must clear it, or later readings of fake trees see it).
void clear_reported_temperature_c();

}  // namespace zl
