#include "zl/telemetry.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <utility>
#include <vector>

#include "zl/durable_file.h"

namespace zl {
namespace {

using nlohmann::json;

std::string join(const std::string& root, const char* relative) {
  if (root.empty()) return std::string("/") + relative;
  return root.back() == '/' ? root + relative : root + "/" + relative;
}

int64_t now_unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string trim(const std::string& s) {
  size_t begin = 0, end = s.size();
  while (begin < end && std::isspace(static_cast<unsigned char>(s[begin]))) ++begin;
  while (end > begin && std::isspace(static_cast<unsigned char>(s[end - 1]))) --end;
  return s.substr(begin, end - begin);
}

// Whole-string integer parse of a sysfs value ("36500\n").
bool parse_integer(const std::string& text, long long* out) {
  const std::string t = trim(text);
  if (t.empty()) return false;
  errno = 0;
  char* end = nullptr;
  long long value = std::strtoll(t.c_str(), &end, 10);
  if (errno != 0 || end != t.c_str() + t.size()) return false;
  *out = value;
  return true;
}

// Sensors report junk when absent or failing (-273000, 0x7fffffff, 0 on some
// boards is real): accept what a working device could read.
bool plausible_celsius(double c) { return c > -40.0 && c < 150.0; }

// Sum of "Pss:" lines (kB); smaps_rollup has one, smaps one per mapping.
// "Pss_Anon:" etc. do not match because the key must end at the colon.
/// The sum of the values (kB) of the lines that start with `field` (e.g. "Pss:"); empty if none, or one is garbled.
std::optional<double> sum_field_kib(const std::string& text, const std::string& field) {
  std::istringstream lines(text);
  std::string line;
  bool found = false;
  double total_kib = 0;
  while (std::getline(lines, line)) {
    if (line.compare(0, field.size(), field) != 0) continue;
    long long kib = 0;
    std::string rest = trim(line.substr(field.size()));
    const size_t space = rest.find(' ');
    if (space != std::string::npos) rest = rest.substr(0, space);
    if (!parse_integer(rest, &kib)) return std::nullopt;
    total_kib += static_cast<double>(kib);
    found = true;
  }
  if (!found) return std::nullopt;
  return total_kib;
}

bool plausible_zone_type(std::string type) {
  std::transform(type.begin(), type.end(), type.begin(),
                 [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
  for (const char* key : {"cpu", "soc", "pkg", "package", "coretemp", "acpitz", "tsens"}) {
    if (type.find(key) != std::string::npos) return true;
  }
  return false;
}

}  // namespace

json number_or_null(double value) { return std::isfinite(value) ? json(value) : json(nullptr); }
json number_or_null(const std::optional<double>& value) {
  return value.has_value() ? number_or_null(*value) : json(nullptr);
}

json to_json(const MicroBatchRecord& r) {
  // A forward-only micro-batch computed no loss: null, not the record's zeros.
  const auto loss = [&](double value) { return r.forward_only ? json(nullptr) : number_or_null(value); };
  json line = {{"type", "micro_batch"},
          {"t_unix_ms", now_unix_ms()},
          {"stage", r.stage},
          {"window", r.window},
          {"micro_batch", r.micro_batch},
          {"phase1_ms", number_or_null(r.phase1_ms)},
          {"phase2_ms", number_or_null(r.phase2_ms)},
          {"queue_ms", number_or_null(r.queue_ms)},
          {"send_ms", number_or_null(r.send_ms)},
          {"total_ms", number_or_null(r.total_ms)},
          {"loss", loss(r.loss)},
          {"task_loss", loss(r.task_loss)},
          {"consistency_loss", loss(r.consistency_loss)},
          {"pss_mib", number_or_null(r.pss_mib)},
          {"temperature_c", number_or_null(r.temperature_c)},
          {"forward_only", r.forward_only}};
  if (r.grad_wait_ms) line["grad_wait_ms"] = *r.grad_wait_ms;
  if (r.weight_version) line["weight_version"] = *r.weight_version;
  return line;
}

json to_json(const WindowRecord& r) {
  const auto loss = [&](double value) { return r.forward_only ? json(nullptr) : number_or_null(value); };
  return {{"type", "window"},
          {"t_unix_ms", now_unix_ms()},
          {"stage", r.stage},
          {"window", r.window},
          {"micro_batches", r.micro_batches},
          {"mean_loss", loss(r.mean_loss)},
          {"mean_task_loss", loss(r.mean_task_loss)},
          {"mean_consistency_loss", loss(r.mean_consistency_loss)},
          {"lr", number_or_null(r.lr)},
          {"step", r.step},
          {"checkpoint_ms", number_or_null(r.checkpoint_ms)},
          {"pss_mib", number_or_null(r.pss_mib)},
          {"temperature_c", number_or_null(r.temperature_c)},
          {"forward_only", r.forward_only}};
}

Result<std::unique_ptr<TelemetryWriter>> TelemetryWriter::open(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "ae");  // "e": O_CLOEXEC (glibc and bionic)
  if (file == nullptr) {
    return Status(errno == ENOENT ? StatusCode::kNotFound : StatusCode::kIoError,
                  "cannot open telemetry log '" + path + "': " + std::strerror(errno));
  }
  return std::unique_ptr<TelemetryWriter>(new TelemetryWriter(file, path));
}

TelemetryWriter::~TelemetryWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

Status TelemetryWriter::write(const MicroBatchRecord& record) { return write_json(to_json(record)); }
Status TelemetryWriter::write(const WindowRecord& record) { return write_json(to_json(record)); }

Status TelemetryWriter::write_json(const json& object) {
  // Invalid UTF-8 in a string (e.g. an error message) is replaced, not thrown.
  const std::string line = object.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
  std::lock_guard<std::mutex> lock(mutex_);
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0) {
    return Status(StatusCode::kIoError, "cannot write telemetry log '" + path_ + "': " + std::strerror(errno));
  }
  return Status();
}

std::optional<double> read_pss_mib(const std::string& root) {
  std::optional<double> kib;
  if (const Result<std::string> rollup = read_file(join(root, "proc/self/smaps_rollup")); rollup.ok()) {
    kib = sum_field_kib(*rollup, "Pss:");
  } else if (const Result<std::string> smaps = read_file(join(root, "proc/self/smaps")); smaps.ok()) {
    kib = sum_field_kib(*smaps, "Pss:");
  }
  if (!kib) return std::nullopt;
  return *kib / 1024.0;
}

std::optional<double> read_peak_rss_mib(const std::string& root) {
  const Result<std::string> text = read_file(join(root, "proc/self/status"));
  if (!text.ok()) return std::nullopt;
  const std::optional<double> kib = sum_field_kib(*text, "VmHWM:");
  if (!kib) return std::nullopt;
  return *kib / 1024.0;
}

std::optional<double> read_battery_temperature_c(const std::string& root) {
  const Result<std::string> text = read_file(join(root, "sys/class/power_supply/battery/temp"));
  long long tenths = 0;
  if (!text.ok() || !parse_integer(*text, &tenths)) {
    return std::nullopt;
  }
  const double celsius = static_cast<double>(tenths) / 10.0;
  if (!plausible_celsius(celsius)) return std::nullopt;
  return celsius;
}

std::optional<double> read_thermal_zone_temperature_c(const std::string& root) {
  const std::string dir = join(root, "sys/class/thermal");
  const Result<std::vector<std::string>> names = list_directory(dir);
  if (!names.ok()) return std::nullopt;
  std::vector<std::pair<long long, std::string>> zones;
  const std::string prefix = "thermal_zone";
  for (const auto& name : *names) {
    long long index = 0;
    if (name.compare(0, prefix.size(), prefix) == 0 && parse_integer(name.substr(prefix.size()), &index)) {
      zones.emplace_back(index, name);
    }
  }
  std::sort(zones.begin(), zones.end());
  for (const auto& zone : zones) {
    long long millis = 0;
    const Result<std::string> type = read_file(dir + "/" + zone.second + "/type");
    if (!type.ok() || !plausible_zone_type(trim(*type))) continue;
    const Result<std::string> temp = read_file(dir + "/" + zone.second + "/temp");
    if (!temp.ok() || !parse_integer(*temp, &millis)) continue;
    const double celsius = static_cast<double>(millis) / 1000.0;
    if (plausible_celsius(celsius)) return celsius;
  }
  return std::nullopt;
}

namespace {

struct ReportedTemperature {
  std::mutex mutex;
  std::optional<double> celsius;
  std::chrono::steady_clock::time_point at;
};

ReportedTemperature& reported_temperature() {
  static ReportedTemperature reported;
  return reported;
}

}  // namespace

void report_temperature_c(double celsius) {
  if (!plausible_celsius(celsius)) return;
  ReportedTemperature& r = reported_temperature();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.celsius = celsius;
  r.at = std::chrono::steady_clock::now();
}

void clear_reported_temperature_c() {
  ReportedTemperature& r = reported_temperature();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.celsius.reset();
}

std::optional<double> read_temperature_c(const std::string& root) {
#if defined(__ANDROID__)
  std::optional<double> sensor = read_battery_temperature_c(root);
#else
  std::optional<double> sensor = read_thermal_zone_temperature_c(root);
#endif
  if (sensor) return sensor;
  ReportedTemperature& r = reported_temperature();
  std::lock_guard<std::mutex> lock(r.mutex);
  const double age_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - r.at).count();
  if (r.celsius && age_s <= kReportedTemperatureMaxAgeS) return r.celsius;
  return std::nullopt;
}

}  // namespace zl
