// Learning-rate schedules for the window-level AdamW step.
//
// `t` counts optimizer steps already taken (0 for the first update, i.e. the
// end of window 0). The learning rate of update t is lr * factor(t):
//
//   constant:       factor(t) = 1
//   warmup_cosine:  W = warmup_steps, T = total_steps, r = min_lr_ratio
//     t <  W:       factor(t) = (t + 1) / W                  linear warm-up, reaches 1 at t = W-1
//     t >= W:       p = clamp((t - W) / max(1, T - W), 0, 1)
//                   factor(t) = r + (1 - r) * 0.5 * (1 + cos(pi * p))
//                   so factor(W) = 1, factor(T) = r, and factor stays r after T.
//
// The warm-up starts at 1/W rather than 0 (as Hugging Face's
// get_cosine_schedule_with_warmup does) so that no window — minutes of phone
// time — is spent on a zero-size update. PyTorch reproduces it exactly with
// `LambdaLR(opt, lambda t: factor(t))`, stepping the scheduler once per
// optimizer step (tests/test_adamw.py does this).
#pragma once

#include <cstdint>
#include <string>

#include "zl/status.h"

namespace zl {

/// Which formula `LrSchedule::factor` applies.
enum class LrScheduleKind { kConstant, kWarmupCosine };

/// Multiplier on the base learning rate per optimizer step (see file comment).
struct LrSchedule {
  LrScheduleKind kind = LrScheduleKind::kConstant;
  int64_t warmup_steps = 0;  ///< W, in optimizer steps (windows); 0 = no warm-up
  int64_t total_steps = 0;   ///< T, step at which the cosine reaches the floor
  double min_lr_ratio = 0.0; ///< r in [0, 1]: floor as a fraction of the base lr

  /// Multiplier for optimizer step `t` (0-based); t < 0 is treated as 0.
  double factor(int64_t t) const;

  /// Checks the settings: warmup_steps >= 0, total_steps >= warmup_steps for
  /// warmup_cosine, min_lr_ratio in [0, 1]. The message names the bad value.
  Status validate() const;
};

/// "constant" / "warmup_cosine".
const char* lr_schedule_kind_name(LrScheduleKind kind);
/// Parses "constant" / "warmup_cosine"; false for anything else.
[[nodiscard]] bool parse_lr_schedule_kind(const std::string& text, LrScheduleKind* out);

}  // namespace zl
