// AdamW over the stage's LoRA parameters, with gradient accumulation over an
// update window of m micro-batches.
//
// Matches `torch.optim.AdamW` (decoupled weight decay, bias correction, fp32
// moments) step for step:
//
//   lr_t      = lr * schedule.factor(t)          t = steps already taken
//   g         = (sum of the window's micro-batch gradients) / k
//   p        *= 1 - lr_t * weight_decay
//   m         = lerp(m, g, 1 - beta1)           = beta1 m + (1 - beta1) g
//   v         = beta2 v + (1 - beta2) g^2
//   s         = t + 1
//   denom     = sqrt(v) / sqrt(1 - beta2^s) + eps
//   p        -= (lr_t / (1 - beta1^s)) * m / denom
//
// Accumulation uses the MEAN over the window (k = micro-batches accumulated,
// normally m; fewer only for a short last window), so the update size does
// not depend on the window length: a window of m micro-batches of batch B is
// one step on a batch of m*B samples whose per-micro-batch losses are means.
// The Python reference (tests/test_adamw.py) averages the same way.
//
// Scalars (lr, betas, eps, bias corrections) are computed in double and
// rounded to float where PyTorch rounds them, tensors are float32.
//
// State is allocated when first needed: the accumulator at the first
// accumulate(), the moments at the first step() (or a restore() of moments
// that are not all zero). Until then they read as zeros. A stage held still
// by lr 0 (docs/design#windows-and-adamw) accumulates and steps never, so it carries
// none of the 3 x numel floats (the moments and the accumulator).
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "zl/lr_schedule.h"
#include "zl/status.h"

namespace zl {

/// Hyper-parameters; names and defaults follow torch.optim.AdamW.
struct AdamWConfig {
  double lr = 1e-4;            ///< base learning rate (before the schedule)
  double beta1 = 0.9;          ///< first-moment decay
  double beta2 = 0.999;        ///< second-moment decay
  double eps = 1e-8;           ///< added to sqrt of the bias-corrected v
  double weight_decay = 0.01;  ///< decoupled: p *= 1 - lr_t * weight_decay
  LrSchedule schedule;

  /// lr > 0, betas in [0, 1), eps >= 0, weight_decay >= 0, valid schedule.
  Status validate() const;
};

/// A trainable float32 tensor owned by the caller (at run time: an ExecuTorch
/// parameter tensor of the stage program). AdamW updates `data` in place.
struct TrainableParam {
  std::string name;            ///< PEFT name, e.g. "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
  std::vector<int64_t> shape;  ///< e.g. {r, d_in} for lora_A
  float* data = nullptr;       ///< numel(shape) floats

  /// Product of `shape`.
  size_t numel() const;
};

/// AdamW with a gradient accumulator. Not thread-safe: one executor thread
/// accumulates and steps.
class AdamW {
 public:
  /// Validates `config` and `params` (non-null data, unique non-empty names,
  /// non-negative shapes). Moments and accumulator start as zeros, allocated
  /// when first written.
  static Result<std::unique_ptr<AdamW>> create(const AdamWConfig& config, std::vector<TrainableParam> params);

  /// Adds one micro-batch's gradients to the window accumulator.
  /// `grads[i]` points at numel(param(i)) floats, in the order of `params`.
  Status accumulate(const std::vector<const float*>& grads);

  /// Micro-batches accumulated since the last step.
  int64_t accumulated() const { return accumulated_; }

  /// Applies one AdamW update with the mean accumulated gradient, then clears
  /// the accumulator. Fails (changing nothing) if nothing was accumulated.
  /// Returns the scheduled learning rate this step used.
  Result<double> step();

  /// Counts one optimizer step that changes nothing: for a window of a stage
  /// held still (lr 0, docs/design#windows-and-adamw), which computes no gradients.
  /// The step count, and with it the schedule, advances as step() would
  /// (checkpoints record it); parameters and moments stay as they are (a real
  /// step at lr 0 leaves the parameters too, but moves the moments). Fails
  /// (changing nothing) if gradients were accumulated: skipping would drop
  /// them. Returns the scheduled learning rate of the skipped step.
  Result<double> skip_step();

  /// Drops the accumulated gradients without stepping (e.g. before a replay).
  void clear_accumulator();

  /// The window's gradient sum of parameter `i` so far (numel floats), for
  /// accumulator snapshots (docs/design#recovery-in-detail).
  const float* grad_sum(size_t i) const { return state_or_zeros(grad_sum_, i); }
  /// Sets the accumulator to a snapshot: `accumulated` micro-batches whose
  /// gradients sum to `grad_sums[i]` (numel(param(i)) floats each), exactly
  /// as accumulate() left it, so the window goes on bit for bit.
  Status restore_accumulator(int64_t accumulated, const std::vector<const float*>& grad_sums);

  /// Scheduled learning rate of optimizer step `t` (0-based).
  double lr_at(int64_t t) const { return config_.lr * config_.schedule.factor(t); }

  /// Optimizer steps taken (PyTorch's state["step"]).
  int64_t step_count() const { return step_count_; }

  const AdamWConfig& config() const { return config_; }
  size_t num_params() const { return params_.size(); }
  const TrainableParam& param(size_t i) const { return params_[i]; }
  /// Index of the parameter called `name`, or -1.
  int find(const std::string& name) const;

  /// Points parameter `i` at new storage of the same size (e.g. after the
  /// program was reloaded). The moments are kept.
  Status rebind(size_t i, float* data);

  /// Whether the moments are allocated: false until the first step() (or a
  /// restore() of moments not all zero), while they are all zero.
  bool has_moments() const { return moments_allocated_; }

  /// First / second moment of parameter `i` (numel floats), for checkpoints.
  const float* exp_avg(size_t i) const { return state_or_zeros(exp_avg_, i); }
  const float* exp_avg_sq(size_t i) const { return state_or_zeros(exp_avg_sq_, i); }

  /// Bytes of optimizer state allocated now: 0 until something was
  /// accumulated or a step taken, then 4 bytes per float of the accumulator
  /// and of the moments.
  size_t state_bytes() const;

  /// Restores state from a checkpoint: parameter values, moments (each
  /// numel(param(i)) floats; both lists empty: all zero) and the step count.
  /// The accumulator is cleared.
  Status restore(int64_t step_count, const std::vector<const float*>& params,
                 const std::vector<const float*>& exp_avg, const std::vector<const float*>& exp_avg_sq);

 private:
  AdamW(const AdamWConfig& config, std::vector<TrainableParam> params);

  /// One vector per parameter: numel floats each once allocated, empty before.
  using State = std::vector<std::vector<float>>;
  const float* state_or_zeros(const State& state, size_t i) const {
    return state[i].empty() ? zeros_.data() : state[i].data();
  }
  /// Gives every parameter its numel zeroed floats in each of `states`, once (`*done`).
  void allocate(std::initializer_list<State*> states, bool* done);

  AdamWConfig config_;
  std::vector<TrainableParam> params_;
  State exp_avg_;
  State exp_avg_sq_;
  State grad_sum_;
  bool moments_allocated_ = false;
  bool accumulator_allocated_ = false;
  std::vector<float> zeros_;  ///< numel floats of the largest parameter: what unallocated state reads as
  int64_t accumulated_ = 0;
  int64_t step_count_ = 0;
};

}  // namespace zl
