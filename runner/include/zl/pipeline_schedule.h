// The order in which a stage runs its micro-batches' forwards, backwards and
// window steps under every schedule (docs/design#backprop-schedules): one pure function
// per stage, which the runner's loops execute as it is. The source of these lists is the Python schedule table
// (zl_device/formats/schedule_table.py), which the torch runtime runs; its rows
// stand here again (`pipeline_schedules`), field for field, and the lists are made
// from a row by the same rules. tests/test_schedule_table.py checks through
// tools/zl_schedule_ops.cpp that both tables hold the same rows and that these
// functions give the same lists, versions and steps for every case.
//
//   gpipe   per window: every forward, then every backward, then the step
//           (a flush per window: exact backprop, every stage on one version)
//   1f1b    per window: K-1-k warm-up forwards, then one forward and one
//           backward alternately, the remaining backwards, the step (a flush
//           per window: the same numbers as gpipe, fewer inputs held)
//   async   PipeDream's: K-1-k warm-up forwards, then one forward and one
//           backward alternately over the whole run, no flush; the step after
//           the backward of a window's last micro-batch. A forward may run on
//           weights one step older than the step its backward lands in, so the
//           backward recomputes on the version its forward used (WeightVersions)
//   zerolock per micro-batch its phase 1 (F: the hidden state sent at the
//           marker) then its phase 2 on the local loss (B), the step after a
//           window's last; nothing crosses a link upstream
//
// The last stage (k = K-1) has no warm-up under every schedule: its forward
// and backward of a micro-batch are one execution of its program.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "zl/adamw.h"
#include "zl/safetensors.h"
#include "zl/status.h"
#include "zl/window_plan.h"

namespace zl {

/// One schedule: a row of the schedule table, the Python `ScheduleRule` field for field.
struct PipelineSchedule {
  /// How far a stage's forwards run ahead of its first backward: none (a forward and its backward back to
  /// back), pipeline (the K-1-k forwards the stages below need), window (every forward of the window). The
  /// last stage never runs ahead: its forward and backward are one execution.
  enum class WarmUp { kNone, kPipeline, kWindow };
  const char* name;  // the runner config's "schedule"
  bool backprop;     // the final loss's gradient crosses the links (else each stage steps on its local loss)
  bool flush;        // each window's forwards and backwards all finish before its step (exact backprop)
  WarmUp warm_up;
  bool operator==(const PipelineSchedule& o) const { return std::string(name) == o.name; }
};

/// Every schedule, in the Python table's order (zerolock first).
const std::vector<PipelineSchedule>& pipeline_schedules();

/// The row named `name` ("zerolock" | "gpipe" | "1f1b" | "async"); kInvalidArgument naming the value otherwise.
Result<PipelineSchedule> parse_pipeline_schedule(const std::string& name);

/// One operation of a stage: the forward (take the input, send the hidden
/// state) or the backward (take the gradient, compute, send grad_input) of a
/// micro-batch, or the optimizer step that ends a window (its micro_batch: the
/// window's last), which follows that micro-batch's backward.
struct ScheduleOp {
  enum class Kind { kForward, kBackward, kStep };
  Kind kind;
  int64_t micro_batch;
  bool operator==(const ScheduleOp& o) const { return kind == o.kind && micro_batch == o.micro_batch; }
};

/// Stage `stage` of `num_stages`'s operations for micro-batches
/// [first_micro_batch, n) of `plan`, in order (the file comment), made from
/// `schedule`'s row: with a flush, window by window, each a warm-up then one
/// forward and one backward alternately; without, the same over the whole run;
/// a kStep after the backward of each window's last micro-batch.
/// `first_micro_batch` is a window's first (a restart from its checkpoint).
std::vector<ScheduleOp> schedule_ops(const PipelineSchedule& schedule, int64_t stage, int64_t num_stages,
                                     const WindowPlan& plan, int64_t first_micro_batch = 0);

/// The most micro-batches forwarded and not yet backwarded at once in `ops`:
/// the inputs a stage holds, and the gradients it may be owed.
int64_t max_in_flight(const std::vector<ScheduleOp>& ops);

/// The weight version (optimizer steps taken) the forward of `micro_batch`
/// runs on under `schedule`: the steps before it in schedule_ops' order of an
/// uninterrupted run. Without a flush (async): window_of(mb - warm-up)
/// (0 in the first warm-up); with one: the micro-batch's own window. A restart re-runs its first
/// forwards on the older versions its checkpoint kept.
int64_t forward_version(const PipelineSchedule& schedule, int64_t stage, int64_t num_stages, const WindowPlan& plan,
                        int64_t micro_batch);

/// A stage's older weight versions while a micro-batch forwarded on them
/// still has its backward to run (weight stashing; LoRA only, the base is
/// frozen). A version is the optimizer's step count when the forward ran.
class WeightVersions {
 public:
  /// Records that `micro_batch`'s forward ran on version `version`.
  void forwarded(int64_t micro_batch, int64_t version) { versions_[micro_batch] = version; }
  /// The version `micro_batch`'s forward ran on (-1 if it has none).
  int64_t version_of(int64_t micro_batch) const;
  /// Before the step that ends version `current`: keeps a copy of `params`
  /// if a micro-batch forwarded on it still waits for its backward.
  void before_step(int64_t current, const std::vector<TrainableParam>& params);
  /// `micro_batch`'s backward ran: forgets it and the versions no one needs.
  void backwarded(int64_t micro_batch);
  /// The kept copy of `version` (one vector per parameter), or nullptr.
  const std::vector<std::vector<float>>* kept(int64_t version) const;
  size_t num_kept() const { return kept_.size(); }
  /// Micro-batches forwarded and not backwarded, oldest first, with versions.
  const std::map<int64_t, int64_t>& in_flight() const { return versions_; }
  /// The kept versions as checkpoint tensors "v<version>/<parameter name>",
  /// borrowing this object's memory (a checkpoint's weight_versions.safetensors).
  std::vector<SafetensorsTensorRef> tensors(const std::vector<TrainableParam>& params) const;
  /// Keeps every version `file` holds (a restart from a checkpoint taken with
  /// micro-batches in flight); kCorrupt naming a missing or mis-shaped tensor.
  Status restore(const SafetensorsFile& file, const std::vector<TrainableParam>& params, const std::string& path);

 private:
  std::map<int64_t, int64_t> versions_;                     // micro-batch -> version of its forward
  std::map<int64_t, std::vector<std::vector<float>>> kept_;  // version -> the weights, one vector per parameter
};

/// While alive, `params` hold `weights` (a kept version); the current values
/// come back on destruction. A null `weights` leaves them alone.
class WeightSwap {
 public:
  WeightSwap(const std::vector<TrainableParam>& params, const std::vector<std::vector<float>>* weights);
  ~WeightSwap();
  WeightSwap(const WeightSwap&) = delete;
  WeightSwap& operator=(const WeightSwap&) = delete;

 private:
  const std::vector<TrainableParam>& params_;
  std::vector<std::vector<float>> current_;
};

}  // namespace zl
