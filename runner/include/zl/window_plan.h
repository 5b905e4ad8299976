// How a run's micro-batches fall into update windows (docs/design#runner): ids
// 0..n-1, window w holds [w*m, min((w+1)*m, n)), so every window has m
// micro-batches but the last, which may be short. One AdamW step per window.
// The one place this arithmetic is written; the runner, the config
// (num_windows for the LR schedule) and tools ask it.
#pragma once

#include <algorithm>
#include <cstdint>

namespace zl {

class WindowPlan {
 public:
  /// `num_micro_batches` n and `window_size` m as in the stage config. A plan
  /// with m < 1 (a config not yet validated) has no windows.
  WindowPlan(int64_t num_micro_batches, int64_t window_size)
      : num_micro_batches_(num_micro_batches), window_size_(window_size) {}

  int64_t num_micro_batches() const { return num_micro_batches_; }
  int64_t window_size() const { return window_size_; }

  /// ceil(n / m): the number of AdamW steps of the run.
  int64_t num_windows() const {
    return window_size_ > 0 ? (num_micro_batches_ + window_size_ - 1) / window_size_ : 0;
  }

  /// The window micro-batch `mb` belongs to.
  int64_t window_of(int64_t mb) const { return mb / window_size_; }

  /// First micro-batch id of window `w`.
  int64_t first_micro_batch(int64_t w) const { return w * window_size_; }

  /// One past the last micro-batch id of window `w` (the run's end for the
  /// last window): micro-batches done once `w` is committed.
  int64_t end_micro_batch(int64_t w) const { return std::min((w + 1) * window_size_, num_micro_batches_); }

  /// True if `mb` closes its window: the AdamW step follows it.
  bool is_last_of_window(int64_t mb) const {
    return (mb + 1) % window_size_ == 0 || mb + 1 == num_micro_batches_;
  }

  /// True if `mb` is the run's last micro-batch (or past it).
  bool is_last_of_run(int64_t mb) const { return mb + 1 >= num_micro_batches_; }

 private:
  int64_t num_micro_batches_;
  int64_t window_size_;
};

}  // namespace zl
