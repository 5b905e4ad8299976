#include "zl/checkpoint_layout.h"

#include <cinttypes>
#include <cstdint>
#include <cstdio>

namespace zl {
namespace {

constexpr const char* kWindowPrefix = "window_";
// Staging entries start with a dot so listings of window_* never see them.
constexpr const char* kStagingPrefix = ".tmp-";

}  // namespace

std::string checkpoint_dir_name(int64_t window) {
  char buffer[40];
  std::snprintf(buffer, sizeof(buffer), "%s%06" PRId64, kWindowPrefix, window);
  return buffer;
}

bool parse_checkpoint_dir_name(const std::string& name, int64_t* window) {
  const std::string prefix = kWindowPrefix;
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) return false;
  int64_t value = 0;
  for (size_t i = prefix.size(); i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || value > (INT64_MAX - 9) / 10) return false;
    value = value * 10 + (name[i] - '0');
  }
  *window = value;
  return true;
}

bool is_checkpoint_staging_name(const std::string& name) {
  const std::string prefix = kStagingPrefix;
  return name.compare(0, prefix.size(), prefix) == 0;
}

std::string CheckpointLayout::staging_dir(int64_t window, long pid) const {
  return entry(std::string(kStagingPrefix) + checkpoint_dir_name(window) + "-" + std::to_string(pid));
}

std::string CheckpointLayout::replaced_dir(int64_t window, long pid) const {
  return entry(std::string(kStagingPrefix) + "old-" + checkpoint_dir_name(window) + "-" + std::to_string(pid));
}

}  // namespace zl
