#include "zl/lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace zl {
namespace {
// Same double as Python's math.pi, so the schedule matches the reference bit for bit.
constexpr double kPi = 3.141592653589793;
}  // namespace

double LrSchedule::factor(int64_t t) const {
  if (kind == LrScheduleKind::kConstant) return 1.0;
  t = std::max<int64_t>(t, 0);
  if (t < warmup_steps) return static_cast<double>(t + 1) / static_cast<double>(warmup_steps);
  const double span = static_cast<double>(std::max<int64_t>(1, total_steps - warmup_steps));
  const double progress = std::min(1.0, std::max(0.0, static_cast<double>(t - warmup_steps) / span));
  return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + std::cos(kPi * progress));
}

Status LrSchedule::validate() const {
  if (kind == LrScheduleKind::kConstant) return Status();
  if (warmup_steps < 0) {
    return Status(StatusCode::kInvalidArgument,
                  "schedule.warmup_steps must be >= 0, got " + std::to_string(warmup_steps));
  }
  if (total_steps < warmup_steps) {
    return Status(StatusCode::kInvalidArgument,
                  "schedule.total_steps (" + std::to_string(total_steps) + ") must be >= warmup_steps (" +
                      std::to_string(warmup_steps) + ")");
  }
  if (!(min_lr_ratio >= 0.0 && min_lr_ratio <= 1.0)) {
    return Status(StatusCode::kInvalidArgument,
                  "schedule.min_lr_ratio must be in [0, 1], got " + std::to_string(min_lr_ratio));
  }
  return Status();
}

const char* lr_schedule_kind_name(LrScheduleKind kind) {
  return kind == LrScheduleKind::kConstant ? "constant" : "warmup_cosine";
}

bool parse_lr_schedule_kind(const std::string& text, LrScheduleKind* out) {
  if (text == "constant") {
    *out = LrScheduleKind::kConstant;
    return true;
  }
  if (text == "warmup_cosine") {
    *out = LrScheduleKind::kWarmupCosine;
    return true;
  }
  return false;
}

}  // namespace zl
