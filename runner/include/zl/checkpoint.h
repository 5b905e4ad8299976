// Atomic per-window checkpoints of one stage: LoRA parameters, AdamW state
// and progress.
//
// Layout (one directory per committed window; names in checkpoint_layout.h):
//
//   <dir>/window_000012/adapter.safetensors    LoRA params under their PEFT names, F32
//   <dir>/window_000012/optimizer.safetensors  "<name>.exp_avg", "<name>.exp_avg_sq", F32;
//                                              or no tensor and metadata "moments": "zero" when
//                                              the optimizer never stepped (a stage held still
//                                              by lr 0, docs/design#windows-and-adamw: zeros, not written)
//   <dir>/window_000012/progress.json          see CheckpointProgress
//   <dir>/window_000012/weight_versions.safetensors   optional: "v<version>/<name>", F32, the older
//                                              weight versions micro-batches in flight still run on
//                                              (the async schedule, pipeline_schedule.h)
//
// A save writes into "<dir>/.tmp-window_000012-<pid>/", fsyncs every file and
// that directory, renames it to "window_000012", and fsyncs <dir>. So a
// window directory exists only complete: the latest checkpoint is the
// window_* directory with the highest number (no separate pointer file that
// could disagree), and a process killed mid-save leaves only a .tmp-* entry,
// which loads ignore and the next save removes. The oldest window
// directories beyond `keep_last` are deleted after each save.
//
// The gradient accumulator is not saved: checkpoints are taken right after
// the window's AdamW step, when it is empty.
//
// progress.json (all integers are JSON numbers):
//   {"format": "zl-checkpoint", "version": 1, "run_id": str, "stage": int,
//    "window": int        last committed window (0-based),
//    "last_micro_batch": int   id of the last micro-batch in that window,
//    "micro_batches_done": int micro-batches consumed so far (replay starts here),
//    "optimizer_step": int     AdamW steps taken,
//    "lr": float               learning rate of the last step,
//    "created_unix_ms": int,
//    "params": [{"name": str, "shape": [int]}],
//    "extra": {...}            whatever else the executor needs to resume}
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "zl/adamw.h"
#include "zl/checkpoint_layout.h"
#include "zl/safetensors.h"
#include "zl/status.h"

namespace zl {

/// Where training stands when a checkpoint is taken (progress.json).
struct CheckpointProgress {
  std::string run_id;
  int64_t stage = 0;
  int64_t window = -1;             ///< last committed window, 0-based
  int64_t last_micro_batch = -1;   ///< id of the last micro-batch in `window`
  int64_t micro_batches_done = 0;  ///< micro-batches consumed; a resume continues at this index
  int64_t optimizer_step = 0;      ///< AdamW steps taken (must equal AdamW::step_count())
  double lr = 0.0;                 ///< learning rate of the last step
  int64_t created_unix_ms = 0;     ///< filled in by save
  nlohmann::json extra = nlohmann::json::object();  ///< executor-defined resume data
};

/// Everything read back from one window directory, validated.
struct CheckpointData {
  CheckpointProgress progress;
  SafetensorsFile adapter;
  SafetensorsFile optimizer;  ///< no tensors when `zero_moments`
  bool zero_moments = false;  ///< the optimizer file says its moments are all zero ("moments": "zero")
};

/// Where and how often to checkpoint.
struct CheckpointOptions {
  std::string dir;        ///< checkpoint root; created on the first save
  int64_t interval = 1;   ///< save after every `interval`-th window (and the last one)
  int64_t keep_last = 2;  ///< complete checkpoints kept on disk (>= 1)
  /// Tests: called while save() replaces an existing window_N, after the new
  /// checkpoint is in place and before the old one is removed.
  std::function<void(const std::string& window_dir)> on_replace;
};

/// Reads `window_dir` and validates it against `expected` (names and shapes;
/// `data` is ignored): every file present and well-formed, dtype F32, exactly
/// the expected names, matching shapes (the optimizer file: or none, with
/// "moments": "zero"). Errors name the file and the problem.
Result<CheckpointData> read_checkpoint(const std::string& window_dir, const std::vector<TrainableParam>& expected);

/// Index of the first nan or inf among `count` floats at `data`, or -1 when all are finite. A checkpoint
/// holding one is a damaged run (read_checkpoint refuses it: kCorrupt); the runner checks its weights with it
/// before it checkpoints them.
int64_t first_non_finite(const float* data, int64_t count);

/// Saves and restores checkpoints of one stage under `options.dir`.
class CheckpointStore {
 public:
  explicit CheckpointStore(CheckpointOptions options) : options_(std::move(options)) {}

  /// Checks interval >= 1, keep_last >= 1 and a non-empty dir.
  Status validate() const;

  /// True if window `window` (0-based) should be checkpointed:
  /// (window + 1) % interval == 0, or it is the last window of the run.
  bool due(int64_t window, bool is_last_window) const;

  /// Writes parameters and state of `optimizer` with `progress` atomically as
  /// checkpoint `progress.window` (see the file comment), then prunes old
  /// ones. Replaces an existing directory of the same window.
  /// `extra`: tensors written to weight_versions.safetensors (none: no file).
  Status save(const AdamW& optimizer, const CheckpointProgress& progress,
              const std::vector<SafetensorsTensorRef>& extra = {});

  /// Window numbers of the complete checkpoints on disk, ascending.
  Result<std::vector<int64_t>> list_windows() const;

  /// Restores the newest checkpoint into `optimizer` (parameters in place,
  /// moments, step count) and returns its progress; nullopt, and nothing
  /// changes, when there is none. A newest checkpoint that fails validation is an error (its
  /// message says which file); older ones are not tried here, because
  /// whether one is an exact fallback depends on the stage's inputs
  /// (StageRunner::fall_back, docs/design#recovery-in-detail).
  Result<std::optional<CheckpointProgress>> load_latest(AdamW* optimizer) const;

  /// Restores checkpoint `window` into `optimizer` and returns its progress.
  Result<CheckpointProgress> load(int64_t window, AdamW* optimizer) const;

  const CheckpointOptions& options() const { return options_; }

 private:
  // save()'s last steps: staging directory `tmp` becomes window_<window>
  // (atomically where the filesystem can), then the oldest beyond keep_last go.
  Status publish(const CheckpointLayout& layout, const std::string& tmp, int64_t window, long pid) const;
  Status prune(const CheckpointLayout& layout) const;

  CheckpointOptions options_;
};

}  // namespace zl
