// Minimal runner logging: one line per message to stderr, with level and a
// UTC timestamp. Shared by every part of the runner core (transport,
// optimizer, checkpoints, ...); `adb shell` and the Kotlin service both
// capture stderr, so no Android-specific sink is needed.
#pragma once

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <ctime>
#include <time.h>

namespace zl {

enum class LogLevel : int { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

namespace detail {
inline std::atomic<int>& log_threshold() {
  static std::atomic<int> level{static_cast<int>(LogLevel::kInfo)};
  return level;
}
}  // namespace detail

/// Messages below `level` are dropped (default: kInfo).
inline void set_log_level(LogLevel level) {
  detail::log_threshold().store(static_cast<int>(level));
}

/// printf-style log line to stderr, e.g. `zl::log(LogLevel::kWarn, "bad frame: %s", reason)`.
/// Thread-safe: one fprintf per line, so lines from threads do not interleave.
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
  std::tm utc{};
  gmtime_r(&now.tv_sec, &utc);
  std::fprintf(stderr, "%02d:%02d:%02d.%03ld %s zl: %s\n", utc.tm_hour, utc.tm_min, utc.tm_sec,
               now.tv_nsec / 1000000L, kNames[static_cast<int>(level)], message);
}

}  // namespace zl
