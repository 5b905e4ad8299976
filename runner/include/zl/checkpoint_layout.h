// Where a stage's checkpoints live on disk: the one place that knows the
// names (docs/design#runner; the Python side mirrors them in its own module).
//
//   <root>/window_000012/adapter.safetensors     a complete checkpoint of window 12
//   <root>/window_000012/optimizer.safetensors
//   <root>/window_000012/progress.json
//   <root>/.tmp-window_000012-<pid>/             a save in progress (or killed)
//   <root>/.tmp-old-window_000012-<pid>/         window 12's previous copy, being replaced
//
// Six digits keep `ls` in window order for any run this project makes;
// larger windows still work (the name grows, parsing takes any digits).
#pragma once

#include <cstdint>
#include <string>

namespace zl {

/// File names inside a window directory.
inline constexpr const char* kAdapterFile = "adapter.safetensors";
inline constexpr const char* kOptimizerFile = "optimizer.safetensors";
/// Older weight versions micro-batches in flight still run on (the async schedule; optional).
inline constexpr const char* kWeightVersionsFile = "weight_versions.safetensors";
inline constexpr const char* kProgressFile = "progress.json";
/// Metadata of an optimizer file that holds no tensor because its moments are all zero (checkpoint.h).
inline constexpr const char* kZeroMomentsKey = "moments";
inline constexpr const char* kZeroMomentsValue = "zero";

/// "window_000012" for window 12.
std::string checkpoint_dir_name(int64_t window);

/// "window_<digits>" -> its window number; false for anything else (.tmp-*,
/// files, other names, numbers beyond int64).
[[nodiscard]] bool parse_checkpoint_dir_name(const std::string& name, int64_t* window);

/// True for the ".tmp-*" entries a save leaves while it runs (or when killed).
[[nodiscard]] bool is_checkpoint_staging_name(const std::string& name);

/// Paths under one checkpoint root.
class CheckpointLayout {
 public:
  explicit CheckpointLayout(std::string root) : root_(std::move(root)) {}

  const std::string& root() const { return root_; }
  /// <root>/<name>
  std::string entry(const std::string& name) const { return root_ + "/" + name; }
  /// <root>/window_000012
  std::string window_dir(int64_t window) const { return entry(checkpoint_dir_name(window)); }
  /// Where a save of `window` by process `pid` writes before the rename.
  std::string staging_dir(int64_t window, long pid) const;
  /// Where an existing copy of `window` is moved while a new one replaces it.
  std::string replaced_dir(int64_t window, long pid) const;

 private:
  std::string root_;
};

}  // namespace zl
