// Accumulator snapshots (docs/design#recovery-in-detail, "Accumulator snapshots"): after
// every micro-batch but a window's last, the window's gradient sum so far is
// saved to <checkpoint_dir>/accumulator.safetensors by a background thread,
// so a restart continues the window from it instead of replaying every
// micro-batch since the last checkpoint. A snapshot is an optimization: one
// that is missing, torn, of another window or run is ignored, and the replay
// from the checkpoint is exact anyway.
//
// File: one F32 tensor per LoRA parameter, named as the parameter, holding
// the sum of the window's micro-batch gradients, or no tensor at all for a
// stage that runs forward only (docs/design#windows-and-adamw: its sums are zeros, and writing them
// cost it numel floats a micro-batch); string metadata: format
// "zl-accumulator", version "1", run_id, stage, window, micro_batches_done
// (the next micro-batch to run), accumulated (micro-batches in the sum),
// loss_sum, task_loss_sum, consistency_loss_sum (for the window's telemetry
// line; %.17g, exact). Written as accumulator.safetensors.tmp, fsynced,
// renamed over the old one.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "zl/adamw.h"
#include "zl/status.h"

namespace zl {

struct AccumulatorSnapshot {
  std::string run_id;
  int64_t stage = 0;
  int64_t window = 0;
  int64_t micro_batches_done = 0;
  int64_t accumulated = 0;
  double loss_sum = 0, task_loss_sum = 0, consistency_loss_sum = 0;
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<std::vector<float>> sums;

  /// The optimizer's accumulator as it is now: its count, and with
  /// `with_sums` a copy of the sums (without: a forward-only stage's, which
  /// records only how far the window got).
  static AccumulatorSnapshot of(const AdamW& optimizer, bool with_sums);
};

/// <checkpoint_dir>/accumulator.safetensors
std::string accumulator_snapshot_path(const std::string& checkpoint_dir);

/// Writes `snapshot` to `path` via `path`.tmp, fsync and rename.
Status write_accumulator_snapshot(const std::string& path, const AccumulatorSnapshot& snapshot);

/// Reads a snapshot; kNotFound when there is none, kCorrupt for a file that
/// does not parse or lacks a field.
Result<AccumulatorSnapshot> read_accumulator_snapshot(const std::string& path);

/// Checks that `snapshot` continues `window` of this run and stage with the
/// optimizer's parameters: its window and ids match, 0 < accumulated <
/// micro-batches of the window, micro_batches_done = first + accumulated,
/// and one sum of the right shape per parameter, or none (a forward-only
/// stage's snapshot). Errors say what differs.
Status check_accumulator_snapshot(const AccumulatorSnapshot& snapshot, const std::string& run_id, int64_t stage,
                                  int64_t window, int64_t first_micro_batch, int64_t end_micro_batch,
                                  const AdamW& optimizer);

/// Writes submitted snapshots on its own thread; a newer submission replaces
/// one not yet written (the newest is all that matters).
class AccumulatorSnapshotWriter {
 public:
  explicit AccumulatorSnapshotWriter(std::string path);
  ~AccumulatorSnapshotWriter();
  AccumulatorSnapshotWriter(const AccumulatorSnapshotWriter&) = delete;
  AccumulatorSnapshotWriter& operator=(const AccumulatorSnapshotWriter&) = delete;

  void submit(AccumulatorSnapshot snapshot);
  /// Waits until everything submitted is written (tests).
  void drain();
  /// Stops the thread; a snapshot not yet written is dropped.
  void stop();
  /// Snapshots that could not be written, and the last reason.
  int64_t failures() const;
  std::string last_error() const;

 private:
  void run();

  const std::string path_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::optional<AccumulatorSnapshot> pending_;
  bool writing_ = false;
  bool stopping_ = false;
  int64_t failures_ = 0;
  std::string last_error_;
  std::thread thread_;
};

}  // namespace zl
