// The stage runner's main loop (docs/design#runner): one call runs this stage of
// the pipeline from its latest checkpoint (or the start) to the end of the
// run. Used by the `zl_runner` executable and by the Android JNI bridge.
//
// Per micro-batch i (ids 0..num_micro_batches-1, window w = i / window_size):
//   1. input:   stage 0 slices its shard (rows of micro-batch i, wrapping
//               around the shard); stage k>0 takes entry i from its Receiver
//               (durably logged before it was acknowledged upstream)
//   2. phase 1: StageProgram::begin, up to the pipeline marker
//   3. send:    the hidden state (plus mask and labels) to the downstream
//               Sender right away ("early forwarding"); with
//               early_forwarding = false only after phase 2
//   4. phase 2: StageProgram::finish, then accumulate the LoRA gradients;
//               a forward-only stage (lr 0, not the last: RunnerConfig::
//               forward_only) abandons the method at the marker instead
// At the end of window w:
//   5. AdamW step on the mean gradient (in place in the program); a
//      forward-only stage only counts it (AdamW::skip_step)
//   6. flush the Sender: every hidden state of window w is durable
//      downstream before w can be committed, because after the commit this
//      stage can never recompute it (its parameters have moved on)
//   7. checkpoint (when due), then COMMIT: input-log entries of windows <= w
//      are deleted
// Telemetry: one JSON line per micro-batch and per window (telemetry.h),
// plus "start", "listening" and "done" events.
//
// Recovery: with `resume`, the latest checkpoint is restored and the run
// continues with its micro_batches_done; stage 0 re-reads its shard, later
// stages replay their input log, and downstream drops the re-sent hidden
// states it already has by micro-batch id. Parameters change only at window
// ends, so the replay recomputes exactly what the lost window computed.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>

#include "zl/runner_config.h"
#include "zl/status.h"

namespace zl {

/// Where a running stage is, for a status display (the app's notification):
/// updated by run_stage as it loads, after every micro-batch and after every
/// committed window. Telemetry (metrics.jsonl) stays the record; this is
/// only the latest values.
struct StageProgress {
  std::string phase = "starting";  ///< starting | loading | running | done
  int64_t stage_index = -1;
  int64_t num_stages = 0;
  int64_t micro_batches_done = 0;  ///< including those restored from a checkpoint
  int64_t num_micro_batches = 0;
  int64_t window = -1;             ///< the window the last micro-batch belonged to
  int64_t committed_window = -1;   ///< the last window whose update was committed
  std::optional<double> loss;      ///< the last micro-batch's local loss
  std::optional<double> pss_mib;
  std::optional<double> temperature_c;
};

/// A StageProgress shared between the run (writer) and any thread that
/// shows it (reader).
class ProgressBoard {
 public:
  template <typename Update>
  void update(Update update) {
    std::lock_guard<std::mutex> lock(mutex_);
    update(&progress_);
  }
  StageProgress get() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return progress_;
  }

 private:
  mutable std::mutex mutex_;
  StageProgress progress_;
};

/// Exit status of a stage process (zl_runner) or app run for the result of
/// run_stage: 0 done, 3 stopped on request (resume later), 2 a failure a
/// restart cannot fix (kUnrecoverable, e.g. a corrupt newest checkpoint with
/// no exact fallback; the coordinator does not retry it), 1 failed. (2 is
/// also a bad command line or config, decided before run_stage.)
inline int stage_exit_code(const Status& status, bool stop_requested) {
  if (status.ok()) return 0;
  if (status.code() == StatusCode::kClosed && stop_requested) return 3;
  if (status.code() == StatusCode::kUnrecoverable) return 2;
  return 1;
}

/// A hot standby (docs/design#hot-standbys, `zl_runner --standby`): a replacement
/// that has its program mapped and its method loaded (memory planned, kernels
/// bound), its optimizer built and (stage 0) its shard read before the stage
/// it replaces fails, so a recovery pays none of that. With `standby` set,
/// run_stage does all of that, writes the `{"event": "standby"}` line on
/// stdout, then calls `wait_for_takeover` and only afterwards restores the
/// latest checkpoint, listens, connects and registers -- the stage it
/// replaces held the port, the checkpoint and the input log until it died.
/// `wait_for_takeover` returns ok to take over, or an error (kClosed when
/// stopped) that ends the run with it.
struct Standby {
  std::function<Status(const std::atomic<bool>* stop)> wait_for_takeover;
};

/// Runs this stage to the end of the run described by `config`.
///
/// `stop_requested` (may be null) is polled between micro-batches and while
/// waiting for input, acknowledgements or back-pressure; once it reads true
/// the runner stops without committing the current window and returns
/// kClosed ("stop requested"), so a later run with `resume` continues from
/// the last checkpoint.
///
/// Returns ok when every micro-batch was processed, the last window was
/// checkpointed and (stages < K-1) every hidden state was acknowledged
/// downstream. Errors carry a message naming the file, peer or value.
///
/// `progress` (may be null) receives the stage's progress as it runs.
/// `standby` (may be null): start as a hot standby (above).
Status run_stage(const RunnerConfig& config, const std::atomic<bool>* stop_requested,
                 ProgressBoard* progress = nullptr, const Standby* standby = nullptr);

}  // namespace zl
