// The stage runner's state and steps (runner.h describes what a run does):
// private to runner.cpp (the loop: micro-batches and window ends) and
// stage_runner_setup.cpp (everything before the first micro-batch).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "zl/accumulator_snapshot.h"
#include "zl/adamw.h"
#include "zl/checkpoint.h"
#include "zl/control_client.h"
#include "zl/data_shard.h"
#include "zl/frame.h"
#include "zl/peer_link.h"
#include "zl/pipeline_schedule.h"
#include "zl/runner.h"
#include "zl/stage_program.h"
#include "zl/status.h"
#include "zl/telemetry.h"
#include "zl/window_plan.h"

namespace zl::internal {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

/// Waits are sliced so a stop request is seen within this time.
inline constexpr milliseconds kPollSlice{200};

inline double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

inline int64_t unix_ms_now() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch()).count();
}

/// This process's CPU time (user + system), in seconds.
double process_cpu_s();

inline bool stopping(const std::atomic<bool>* stop) { return stop != nullptr && stop->load(); }

inline Status stop_status(const std::string& where) {
  return Status(StatusCode::kClosed, "stop requested (" + where + ")");
}

/// Repeats `attempt(slice)` while it times out, until the stop flag is set or
/// `timeout_s` (0 = forever) has passed.
template <typename Attempt>
Status wait_sliced(Attempt attempt, const std::atomic<bool>* stop, int64_t timeout_s, const std::string& what) {
  const Clock::time_point start = Clock::now();
  while (true) {
    if (stopping(stop)) return stop_status(what);
    Status status = attempt(kPollSlice);
    if (status.code() != StatusCode::kTimeout) return status;
    if (timeout_s > 0 && ms_since(start) >= 1000.0 * static_cast<double>(timeout_s)) {
      return Status(StatusCode::kTimeout, what + ": nothing after " + std::to_string(timeout_s) +
                                              " s (input_timeout_s); is the neighbouring stage running?");
    }
  }
}

/// Running sums for one window's telemetry line.
struct WindowSums {
  int64_t count = 0;
  double loss = 0, task = 0, consistency = 0;
  void add(const StageStepResult& r) {
    ++count;
    loss += r.loss;
    task += r.task_loss;
    consistency += r.consistency_loss;
  }
  /// A forward-only micro-batch: counted, no loss.
  void add_forward_only() { ++count; }
};

/// Everything one stage process holds while it runs.
class StageRunner {
 public:
  StageRunner(const RunnerConfig& config, const std::atomic<bool>* stop, ProgressBoard* progress,
              const Standby* standby)
      : config_(config),
        plan_(config.window_plan()),
        stop_(stop),
        progress_(progress),
        standby_(standby),
        forward_only_(config.forward_only()),
        schedule_(parse_pipeline_schedule(config.schedule).value_or(pipeline_schedules().front())) {}

  /// Loads, restores and connects (setup), runs the remaining micro-batches
  /// (loop), then reports the outcome to the coordinator and stops the links.
  Status run();

 private:
  // setup(): everything before the first micro-batch, in this order.
  Status setup();
  Status load_program();
  StageProgramOptions program_options() const;  // the config's program, for program_ and every instance
  Status stand_by();
  Status restore();
  Status restore_weight_versions(int64_t window);
  void resume_accumulator(int64_t window);
  void snapshot_accumulator(int64_t mb, const WindowSums& sums);
  Status fall_back(const std::vector<int64_t>& windows, const Status& why, CheckpointProgress* progress,
                   bool* found);
  Status start_receiver();
  Status start_sender();
  void write_start_line();
  Status start_control();

  // loop(): the zerolock list of schedule_ops (per micro-batch phase 1, phase 2; the window's end after its last);
  // finish_run() after the last.
  Status loop();
  void report_running();  // the progress board: running from start_mb_
  /// The progress board and the coordinator: micro-batch `mb` done (`loss`: none on a stage without one).
  void report_done(int64_t mb, bool window_end, const MicroBatchRecord& record, std::optional<double> loss);
  // loop_backprop(): a backprop schedule's operations (backprop_loop.cpp).
  bool backprop() const { return schedule_.backprop; }
  Status check_program_kind() const;
  Status load_instances();  // keep_activations: the program instances, one per micro-batch in flight
  /// An idle instance with `weights` (nullptr: program_'s current ones) copied in.
  Result<StageProgram*> take_instance(int64_t mb, const std::vector<std::vector<float>>* weights);
  Status loop_backprop();
  Status forward_op(int64_t mb);
  Status backward_op(int64_t mb, MicroBatchRecord* record, StageStepResult* result);
  Status inputs_of(int64_t mb, const InputEntry& entry, StageInputs* inputs);
  Status take_grad(int64_t mb, double* wait_ms);
  /// The kept weights micro-batch `mb` runs on at `version` (nullptr: the current ones); kInternal if not kept.
  Result<const std::vector<std::vector<float>>*> weights_of(int64_t version, int64_t mb) const;
  Status send_grad(int64_t mb, const float* grad_input);
  /// zerolock: a micro-batch from its forward (phase 1: input taken, hidden state sent at the marker unless
  /// early_forwarding is off) to its backward (phase 2 on the local loss, or the stop at the marker of a stage
  /// held still; the late send; the gradient accumulated).
  struct ZeroLockStep {
    int64_t micro_batch = -1;
    InputEntry entry;  // a later stage's input, until its hidden state is sent
    StageInputs inputs;
    Clock::time_point start;
  };
  Status phase_one(int64_t mb, ZeroLockStep* step, MicroBatchRecord* record);
  Status phase_two(ZeroLockStep* step, MicroBatchRecord* record, StageStepResult* result);
  Status take_input(int64_t mb, InputEntry* entry, StageInputs* inputs, double* queue_ms);
  Status begin_micro_batch(int64_t mb, const StageInputs& inputs, MicroBatchRecord* record,
                           StageProgram* program = nullptr);
  Status send_hidden(int64_t mb, const StageInputs& inputs, const std::vector<float>& hidden);
  Status hold(int64_t mb);
  void abandon_step(StageProgram* program = nullptr);
  void write_micro_batch(MicroBatchRecord* record);
  Status end_window(int64_t window, int64_t last_mb, const WindowSums& sums);
  /// kUnrecoverable naming the stage, `window`, `what` went non-finite and the last good checkpoint kept.
  Status damaged_run(int64_t window, const std::string& what) const;
  void finish_run(int64_t micro_batches, double wall_s, double cpu_s);
  void shutdown();
  template <typename Update>
  void report(Update update) {
    if (progress_ != nullptr) progress_->update(update);
  }

  const RunnerConfig& config_;
  const WindowPlan plan_;
  const std::atomic<bool>* stop_;
  ProgressBoard* progress_;
  const Standby* standby_;  // null unless a hot standby (runner.h)
  // Setup times for the start line (docs/design#telemetry), on the system clock.
  int64_t setup_start_unix_ms_ = 0;
  int64_t program_loaded_unix_ms_ = 0;
  double program_load_ms_ = 0;
  std::optional<int64_t> took_over_unix_ms_;  // a standby: when it was told to take over
  FrameKey key_{};
  RunId run_id_{};
  std::unique_ptr<TelemetryWriter> telemetry_;
  std::unique_ptr<StageProgram> program_;
  std::unique_ptr<AdamW> optimizer_;
  std::unique_ptr<CheckpointStore> store_;
  std::unique_ptr<Receiver> receiver_;
  std::unique_ptr<Sender> sender_;
  std::unique_ptr<ControlClient> control_;
  DataShard shard_;
  std::vector<float> hidden_;  // the current micro-batch's hidden state (B*S*D), reused
  int64_t start_mb_ = 0;
  std::optional<int64_t> restored_window_;
  std::unique_ptr<AccumulatorSnapshotWriter> snapshots_;
  WindowSums resumed_sums_;                    // the window so far, from an accumulator snapshot
  int64_t resumed_accumulated_ = 0;            // micro-batches that snapshot held (0: none used)
  const bool forward_only_;                    // config_.forward_only(): phase 1 only (docs/design#windows-and-adamw)
  const PipelineSchedule schedule_;            // config_.schedule (validated with the config)
  // A backprop schedule's micro-batches forwarded, their backward not run yet.
  struct InFlight {
    InputEntry entry;  // stages > 0: the input received (stage 0 re-reads its shard)
    double queue_ms = 0, forward_ms = 0, send_ms = 0;
    StageProgram* kept = nullptr;  // keep_activations: the instance suspended at this micro-batch's marker
  };
  // keep_activations (docs/design#backprop-schedules): one instance of the program per micro-batch in flight, each
  // parked at its marker from the forward to the backward on a copy of the weights it forwarded with; program_ holds
  // the weights AdamW steps and runs nothing.
  std::vector<std::unique_ptr<StageProgram>> instances_;
  std::vector<StageProgram*> idle_instances_;
  std::map<int64_t, InFlight> in_flight_;
  WeightVersions versions_;
  std::vector<float> grad_hidden_;  // the gradient taken for the current backward (B*S*D), reused
  int64_t max_versions_kept_ = 0;   // for the done line
};

}  // namespace zl::internal
