// One stage's ExecuTorch training program, run in two phases (docs/design#stage-program, #runner).
//
//   begin(inputs)  runs `forward` on the program's worker thread until the
//                  `zerolock::pipeline_marker` kernel fires; the marker hook
//                  copies the hidden state (B, S, D) float32 and then holds the
//                  method suspended inside the kernel. begin returns the copy.
//   finish()       lets the method go on (readout, local loss, backward) and
//                  returns the losses and the LoRA gradients.
//   abandon()      instead of finish(): ends the method at the marker (the
//                  hook tells the kernel to stop it, zl::kPipelineMarkerStopped);
//                  no phase 2, no losses, no gradients. For a stage held still
//                  (lr 0, docs/design#windows-and-adamw), and for a step that must not go
//                  on (a failed send, a stop).
//
// So the runner can send the hidden state downstream while phase 2 has not
// even started, and phase 2 runs while the link carries it. The last stage's
// program has no marker (it has no downstream): there begin() only stages the
// inputs and finish() runs the whole method.
//
// The parameters are the program's own LoRA tensors (ExecuTorch's training
// convention: `forward` returns user outputs, then gradients, then the
// parameters, sliced by `__et_training_gradients_index_forward` /
// `__et_training_parameters_index_forward`, named by `__et_training_fqn_forward`).
// They are exposed under their PEFT names (from the export's manifest.json),
// pointing into the program's memory, so AdamW updates them in place and the
// next execution uses the new values.
//
// Threading: the marker hook is thread-local, so the program owns one worker
// thread that installs the hook and executes every `forward`. All public
// methods are for one caller thread; the ExecuTorch Module is only ever
// touched by one thread at a time (the caller waits while the worker runs).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "zl/adamw.h"
#include "zl/status.h"

namespace zl {

/// How to load a stage program.
struct StageProgramOptions {
  std::string program_path;   ///< stage_<k>.pte written by `zl export`
  /// The export's manifest.json (PEFT names, layer range); empty = the
  /// manifest.json next to the program.
  std::string manifest_path;
  /// ExecuTorch CPU threads: 0 = the device's performance cores
  /// (zl/cpu_cores.h), n >= 1 = n; the process-wide pool is resized to it
  /// (one pool per process).
  int64_t threads = 0;
  /// true: map the program file (ExecuTorch's Mmap mode), so the frozen
  /// weights are file-backed pages the kernel can drop and read again; false:
  /// read every segment into heap memory (LoadMode::File). The LoRA weights
  /// are in the method's planned memory either way (docs/design#frozen-weights).
  bool map_file = true;
};

/// Inputs of one micro-batch. Stage 0 sets `input_ids`, later stages
/// `hidden`; `attention_mask` and `labels` always. Pointers hold B*S int64
/// resp. B*S*D float32 values and are read (copied) by begin()/run() only.
struct StageInputs {
  const int64_t* input_ids = nullptr;       ///< (B, S) int64, stage 0
  const float* hidden = nullptr;            ///< (B, S, D) float32, stages > 0
  const int64_t* attention_mask = nullptr;  ///< (B, S) int64, 1 = token, 0 = padding
  const int64_t* labels = nullptr;          ///< (B, S) int64, -100 = ignored
  /// (B, S, D) float32, the gradient of the stage's output: a backprop
  /// program's fourth input on stages before the last (docs/design#backprop-program).
  /// nullptr gives zeros, for a forward that stops at the marker.
  const float* grad_hidden = nullptr;
};

/// What one finished step yields.
struct StageStepResult {
  double loss = 0;              ///< α·CE + (1-α)·KL, the differentiated one (backprop: docs/design#backprop-program)
  double task_loss = 0;         ///< CE (backprop: the last stage's CE, an upstream stage's local loss or 0)
  double consistency_loss = 0;  ///< KL (backprop: 0)
  /// A backprop program on stages > 0: the gradient of the stage's input
  /// (B*S*D floats, valid until the next begin()/run()), to send upstream.
  const float* grad_input = nullptr;
  /// One pointer per parameter (order of parameters()), numel floats each,
  /// in the method's planned memory: valid until the next begin()/run().
  std::vector<const float*> gradients;
};

/// A loaded stage program (see the file comment).
class StageProgram {
 public:
  /// Loads the program (mapped or read, see StageProgramOptions::map_file),
  /// checks it against the manifest (stage entry by file name,
  /// parameter names, order and shapes, input shapes) and starts the worker.
  /// Errors name the file and the mismatch.
  static Result<std::unique_ptr<StageProgram>> load(const StageProgramOptions& options);

  /// Abandons a suspended method (see abandon()), then stops the worker thread.
  ~StageProgram();
  StageProgram(const StageProgram&) = delete;
  StageProgram& operator=(const StageProgram&) = delete;

  /// Phase 1: runs `forward` until the marker and copies the hidden state
  /// (B*S*D floats) into `*hidden`; the method stays suspended until
  /// finish() or abandon(). On the last stage only stores the inputs and clears `*hidden`.
  /// Fails if a step is already in progress, or if the method ends (or
  /// fails) without the marker firing; the method is then complete and no
  /// finish() is due.
  Status begin(const StageInputs& inputs, std::vector<float>* hidden);

  /// Phase 2: resumes the method suspended by begin() (or, on the last stage,
  /// runs the whole method) and returns losses and gradients.
  Result<StageStepResult> finish();

  /// Phase 2 of a backprop program's step whose gradient arrived after
  /// begin() (a stage before the last that keeps its activations,
  /// docs/design#backprop-schedules): writes `grad_hidden` (B*S*D float32) into the
  /// suspended method's grad_hidden input, then resumes it as finish() does.
  /// The exporter orders the graph so that nothing before the marker reads
  /// grad_hidden, so phase 1 ran as it would have with these values, and the
  /// step is the one run() gives on the same inputs. Fails without a
  /// suspended begin() or on a program that takes no gradient.
  Result<StageStepResult> finish(const float* grad_hidden);

  /// Ends the step begun by begin() without phase 2: the method suspended at
  /// the marker stops there (its kernel fails it with
  /// zl::kPipelineMarkerStopped, which is what was asked, not an error). The
  /// program is idle afterwards and runs the next begin()/run() as a freshly
  /// loaded one would: nothing of a stopped step but the hidden state begin()
  /// returned is computed. On the last stage it drops the staged inputs.
  /// Fails without a successful begin(), or if the method did not end with the
  /// stop (another error, or it ran to its end).
  Status abandon();

  /// One plain execution on the calling thread, no marker hook involved (the
  /// reference begin()+finish() must match). `hidden` (optional) receives the
  /// program's `hidden` output on stages with one.
  Result<StageStepResult> run(const StageInputs& inputs, std::vector<float>* hidden = nullptr);

  /// The LoRA parameters under their PEFT names, in gradient order; `data`
  /// points into the program. Do not write while a step is in progress.
  const std::vector<TrainableParam>& parameters() const { return params_; }

  int64_t stage_index() const { return stage_index_; }
  /// The threads the kernels split their work over (1 in a build without
  /// ExecuTorch's thread pool).
  int64_t threads() const { return threads_; }
  int64_t first_layer() const { return first_layer_; }
  int64_t last_layer() const { return last_layer_; }
  bool is_first() const { return is_first_; }
  /// True when the program has no `hidden` output (and no marker).
  bool is_last() const { return is_last_; }
  /// A backprop program (manifest "program.kind"): it takes grad_hidden
  /// (but on the last stage) and gives grad_input (but on stage 0).
  bool is_backprop() const { return backprop_; }
  /// A backprop program before the last stage: StageInputs::grad_hidden is read.
  bool takes_gradient() const { return backprop_ && !is_last_; }
  /// A backprop program after stage 0: StageStepResult::grad_input is set.
  bool gives_gradient() const { return backprop_ && !is_first_; }
  int64_t batch() const { return batch_; }
  int64_t seq_len() const { return seq_len_; }
  int64_t hidden_size() const { return hidden_size_; }
  const std::string& path() const { return path_; }

  /// Marker hook calls seen since the last begin() (1 on stages with a marker).
  int64_t last_marker_calls() const;

  /// True between a successful begin() and finish() or abandon() on a stage
  /// with a marker: the method is parked inside the marker kernel.
  bool suspended() const;

 private:
  // kStopping: abandon() asked the parked method to stop at the marker.
  enum class State { kIdle, kDeferred, kPhase1, kSuspended, kPhase2, kStopping, kDone };
  struct Impl;

  StageProgram();
  /// The outputs before the gradients: [hidden,] and the losses; a backprop
  /// program's [hidden,] loss, [local_loss,] [grad_input] (docs/design#backprop-program).
  size_t user_outputs() const {
    if (!backprop_) return is_last_ ? 3 : 4;
    return (is_last_ ? 0 : 1) + 1 + (local_loss_ ? 1 : 0) + (is_first_ ? 0 : 1);
  }
  Status stage_inputs(const StageInputs& inputs);
  Result<StageStepResult> collect(std::vector<float>* hidden_from_output);
  void worker_main();
  // Called by the marker hook on the worker thread with the kernel's `out`
  // tensor (an executorch::aten::Tensor, kept out of this header); parks the
  // method until finish() (returns true: go on) or abandon() (false: stop).
  bool on_marker(const void* hidden_tensor);
  // Waits for the worker to end the method; then idle. Caller holds `lock`.
  void wait_done(std::unique_lock<std::mutex>& lock);
  friend struct StageProgramHook;
  friend struct StageProgramLoader;  // load()'s steps (stage_program.cpp)

  std::unique_ptr<Impl> impl_;  // ExecuTorch objects (kept out of this header)
  std::string path_;
  int64_t threads_ = 1;
  int64_t stage_index_ = 0;
  int64_t first_layer_ = 0;
  int64_t last_layer_ = 0;
  bool is_first_ = false;
  bool is_last_ = false;
  bool backprop_ = false;
  bool local_loss_ = false;  // a backprop program's upstream stage with a local loss (local_weight > 0)
  int64_t batch_ = 0;
  int64_t seq_len_ = 0;
  int64_t hidden_size_ = 0;
  size_t grad_start_ = 0;
  size_t param_start_ = 0;
  std::vector<TrainableParam> params_;

  // Two-phase hand-off between the caller and the worker (guarded by mutex_).
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  State state_ = State::kIdle;
  bool shutdown_ = false;
  std::vector<float>* hidden_out_ = nullptr;
  int64_t marker_calls_ = 0;
  std::string marker_error_;
  std::thread worker_;
};

}  // namespace zl
