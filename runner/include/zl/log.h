// Minimal runner output: log lines (level, UTC timestamp, message) to
// stderr and JSON event lines ({"event": "listening", ...}) to stdout, each
// one write per line. Shared by every part of the runner core (transport,
// optimizer, checkpoints, ...).
//
// `zl_runner` has real stdio, which `adb shell` and the local backend
// redirect into runner.err / runner.out. An app process has none, so the
// app's StageSession also mirrors both streams into those files
// (set_output_mirror) for the host to read.
#pragma once

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <ctime>
#include <mutex>
#include <time.h>

namespace zl {

enum class LogLevel : int { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

namespace detail {
inline std::atomic<int>& log_threshold() {
  static std::atomic<int> level{static_cast<int>(LogLevel::kInfo)};
  return level;
}

/// Files that also receive event lines (`out`) and log lines (`err`).
struct OutputMirror {
  std::mutex mutex;
  std::FILE* out = nullptr;
  std::FILE* err = nullptr;
};
inline OutputMirror& output_mirror() {
  static OutputMirror mirror;
  return mirror;
}

inline void write_line(std::FILE* stream, std::FILE* OutputMirror::*mirrored, const char* line) {
  std::fprintf(stream, "%s\n", line);
  std::fflush(stream);
  OutputMirror& mirror = output_mirror();
  std::lock_guard<std::mutex> lock(mirror.mutex);
  if (std::FILE* file = mirror.*mirrored) {
    std::fprintf(file, "%s\n", line);
    std::fflush(file);
  }
}
}  // namespace detail

/// From now on, also append every event line to `out` and every log line to
/// `err` (either may be null: not mirrored). Returns the previous pair so
/// the caller can restore it and close its files; no line is written to a
/// file after it was replaced here.
inline void set_output_mirror(std::FILE* out, std::FILE* err, std::FILE** previous_out = nullptr,
                              std::FILE** previous_err = nullptr) {
  detail::OutputMirror& mirror = detail::output_mirror();
  std::lock_guard<std::mutex> lock(mirror.mutex);
  if (previous_out != nullptr) *previous_out = mirror.out;
  if (previous_err != nullptr) *previous_err = mirror.err;
  mirror.out = out;
  mirror.err = err;
}

/// printf-style JSON event line to stdout (and the mirror), e.g.
/// `zl::emit_event("{\"event\": \"listening\", \"port\": %u}", port)`.
/// Orchestrators read these; keep them one JSON object per line.
#if defined(__GNUC__)
__attribute__((format(printf, 1, 2)))
#endif
inline void emit_event(const char* fmt, ...) {
  char line[1024];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(line, sizeof(line), fmt, args);
  va_end(args);
  detail::write_line(stdout, &detail::OutputMirror::out, line);
}

/// Messages below `level` are dropped (default: kInfo).
inline void set_log_level(LogLevel level) {
  detail::log_threshold().store(static_cast<int>(level));
}

/// printf-style log line to stderr (and the mirror), e.g.
/// `zl::log(LogLevel::kWarn, "bad frame: %s", reason)`. Thread-safe: one
/// fprintf per line, so lines from threads do not interleave.
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
inline void log(LogLevel level, const char* fmt, ...) {
  if (static_cast<int>(level) < detail::log_threshold().load()) return;
  static const char* const kNames[] = {"D", "I", "W", "E"};
  char message[1024];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(message, sizeof(message), fmt, args);
  va_end(args);
  // clock_gettime, not timespec_get: the latter needs Android API 29.
  timespec now{};
  clock_gettime(CLOCK_REALTIME, &now);
  // The UTC time of day straight from the epoch seconds: glibc's gmtime_r
  // reads /etc/localtime first, which a static binary on a phone has not got.
  const long day_seconds = static_cast<long>(now.tv_sec % 86400);
  char line[1100];
  std::snprintf(line, sizeof(line), "%02ld:%02ld:%02ld.%03ld %s zl: %s", day_seconds / 3600, day_seconds / 60 % 60,
                day_seconds % 60, now.tv_nsec / 1000000L, kNames[static_cast<int>(level)], message);
  detail::write_line(stderr, &detail::OutputMirror::err, line);
}

}  // namespace zl
