#include "zl/adamw.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>

namespace zl {

Status AdamWConfig::validate() const {
  auto bad = [](const std::string& what, double value, const std::string& expected) {
    return Status(StatusCode::kInvalidArgument,
                  "optimizer." + what + " = " + std::to_string(value) + " is invalid; expected " + expected);
  };
  // lr 0 is a stage that computes but does not move (zl train --stage-lr 0,0,1: the last stage alone trains):
  // every term of the update is scaled by the lr, weight decay too, so its weights stay bit for bit.
  if (!(lr >= 0.0) || !std::isfinite(lr)) return bad("lr", lr, "a finite value >= 0");
  if (!(beta1 >= 0.0 && beta1 < 1.0)) return bad("betas[0]", beta1, "a value in [0, 1)");
  if (!(beta2 >= 0.0 && beta2 < 1.0)) return bad("betas[1]", beta2, "a value in [0, 1)");
  if (!(eps >= 0.0) || !std::isfinite(eps)) return bad("eps", eps, "a finite value >= 0");
  if (!(weight_decay >= 0.0) || !std::isfinite(weight_decay)) return bad("weight_decay", weight_decay, "a finite value >= 0");
  return schedule.validate();
}

size_t TrainableParam::numel() const {
  size_t n = 1;
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  return n;
}

AdamW::AdamW(const AdamWConfig& config, std::vector<TrainableParam> params)
    : config_(config),
      params_(std::move(params)),
      exp_avg_(params_.size()),
      exp_avg_sq_(params_.size()),
      grad_sum_(params_.size()) {
  size_t largest = 0;
  for (const auto& p : params_) largest = std::max(largest, p.numel());
  zeros_.assign(largest, 0.0f);
}

void AdamW::allocate(std::initializer_list<State*> states, bool* done) {
  if (*done) return;
  for (State* state : states) {
    for (size_t i = 0; i < params_.size(); ++i) (*state)[i].assign(params_[i].numel(), 0.0f);
  }
  *done = true;
}

size_t AdamW::state_bytes() const {
  size_t floats = 0;
  for (const State* state : {&exp_avg_, &exp_avg_sq_, &grad_sum_}) {
    for (const auto& v : *state) floats += v.capacity();
  }
  return floats * sizeof(float);
}

Result<std::unique_ptr<AdamW>> AdamW::create(const AdamWConfig& config, std::vector<TrainableParam> params) {
  ZL_RETURN_IF_ERROR(config.validate());
  std::set<std::string> names;
  for (const auto& p : params) {
    if (p.name.empty()) return Status(StatusCode::kInvalidArgument, "AdamW: a parameter has an empty name");
    if (!names.insert(p.name).second) {
      return Status(StatusCode::kInvalidArgument, "AdamW: duplicate parameter name '" + p.name + "'");
    }
    for (int64_t d : p.shape) {
      if (d < 0) return Status(StatusCode::kInvalidArgument, "AdamW: parameter '" + p.name + "' has a negative dimension");
    }
    if (p.data == nullptr && p.numel() > 0) {
      return Status(StatusCode::kInvalidArgument, "AdamW: parameter '" + p.name + "' has no data");
    }
  }
  return std::unique_ptr<AdamW>(new AdamW(config, std::move(params)));
}

Status AdamW::accumulate(const std::vector<const float*>& grads) {
  if (grads.size() != params_.size()) {
    return Status(StatusCode::kInvalidArgument, "AdamW::accumulate: got " + std::to_string(grads.size()) +
                                                    " gradients for " + std::to_string(params_.size()) + " parameters");
  }
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i] == nullptr && params_[i].numel() > 0) {
      return Status(StatusCode::kInvalidArgument, "AdamW::accumulate: null gradient for '" + params_[i].name + "'");
    }
  }
  allocate({&grad_sum_}, &accumulator_allocated_);
  for (size_t i = 0; i < grads.size(); ++i) {
    float* sum = grad_sum_[i].data();
    const float* g = grads[i];
    const size_t n = grad_sum_[i].size();
    for (size_t j = 0; j < n; ++j) sum[j] += g[j];
  }
  ++accumulated_;
  return Status();
}

Status AdamW::restore_accumulator(int64_t accumulated, const std::vector<const float*>& grad_sums) {
  if (accumulated < 0 || grad_sums.size() != params_.size()) {
    return Status(StatusCode::kInvalidArgument, "AdamW::restore_accumulator: " + std::to_string(grad_sums.size()) +
                                                    " sums for " + std::to_string(params_.size()) +
                                                    " parameters, " + std::to_string(accumulated) + " micro-batches");
  }
  for (size_t i = 0; i < grad_sums.size(); ++i) {
    if (grad_sums[i] == nullptr && params_[i].numel() > 0) {
      return Status(StatusCode::kInvalidArgument, "AdamW::restore_accumulator: no sum for '" + params_[i].name + "'");
    }
  }
  allocate({&grad_sum_}, &accumulator_allocated_);
  for (size_t i = 0; i < grad_sums.size(); ++i) {
    std::copy(grad_sums[i], grad_sums[i] + grad_sum_[i].size(), grad_sum_[i].begin());
  }
  accumulated_ = accumulated;
  return Status();
}

void AdamW::clear_accumulator() {
  // Before the first accumulate() there is nothing allocated to clear.
  for (auto& sum : grad_sum_) std::fill(sum.begin(), sum.end(), 0.0f);
  accumulated_ = 0;
}

Result<double> AdamW::step() {
  if (accumulated_ == 0) {
    return Status(StatusCode::kInvalidArgument, "AdamW::step: no micro-batch gradients accumulated since the last step");
  }
  const double lr = lr_at(step_count_);
  const double s = static_cast<double>(step_count_ + 1);
  // Scalars in double, rounded to float where PyTorch's CPU kernels do.
  const float decay = static_cast<float>(1.0 - lr * config_.weight_decay);
  const float count = static_cast<float>(accumulated_);
  const float w1 = static_cast<float>(1.0 - config_.beta1);
  const float beta2 = static_cast<float>(config_.beta2);
  const float one_minus_beta2 = static_cast<float>(1.0 - config_.beta2);
  const double bias1 = 1.0 - std::pow(config_.beta1, s);
  const double bias2 = 1.0 - std::pow(config_.beta2, s);
  const float neg_step_size = static_cast<float>(-(lr / bias1));
  const float bias2_sqrt = static_cast<float>(std::pow(bias2, 0.5));
  const float eps = static_cast<float>(config_.eps);
  const bool small_w1 = std::fabs(w1) < 0.5f;
  allocate({&exp_avg_, &exp_avg_sq_}, &moments_allocated_);

  for (size_t i = 0; i < params_.size(); ++i) {
    float* p = params_[i].data;
    float* m = exp_avg_[i].data();
    float* v = exp_avg_sq_[i].data();
    const float* sum = grad_sum_[i].data();
    const size_t n = params_[i].numel();
    for (size_t j = 0; j < n; ++j) {
      const float g = sum[j] / count;
      if (config_.weight_decay != 0.0) p[j] *= decay;
      // torch.lerp's two forms, chosen by the weight as ATen does.
      m[j] = small_w1 ? m[j] + w1 * (g - m[j]) : g - (g - m[j]) * (1.0f - w1);
      v[j] = v[j] * beta2 + one_minus_beta2 * g * g;
      const float denom = std::sqrt(v[j]) / bias2_sqrt + eps;
      p[j] = p[j] + neg_step_size * m[j] / denom;
    }
  }
  ++step_count_;
  clear_accumulator();
  return lr;
}

Result<double> AdamW::skip_step() {
  if (accumulated_ != 0) {
    return Status(StatusCode::kInvalidArgument, "AdamW::skip_step: " + std::to_string(accumulated_) +
                                                    " micro-batch gradients accumulated; step() applies them");
  }
  const double lr = lr_at(step_count_);
  ++step_count_;
  return lr;
}

int AdamW::find(const std::string& name) const {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].name == name) return static_cast<int>(i);
  }
  return -1;
}

Status AdamW::rebind(size_t i, float* data) {
  if (i >= params_.size()) return Status(StatusCode::kInvalidArgument, "AdamW::rebind: index out of range");
  if (data == nullptr && params_[i].numel() > 0) {
    return Status(StatusCode::kInvalidArgument, "AdamW::rebind: null data for '" + params_[i].name + "'");
  }
  params_[i].data = data;
  return Status();
}

Status AdamW::restore(int64_t step_count, const std::vector<const float*>& params,
                      const std::vector<const float*>& exp_avg, const std::vector<const float*>& exp_avg_sq) {
  if (step_count < 0) return Status(StatusCode::kInvalidArgument, "AdamW::restore: negative step count");
  const bool zero_moments = exp_avg.empty() && exp_avg_sq.empty();
  if (params.size() != params_.size() ||
      (!zero_moments && (exp_avg.size() != params_.size() || exp_avg_sq.size() != params_.size()))) {
    return Status(StatusCode::kInvalidArgument, "AdamW::restore: expected " + std::to_string(params_.size()) +
                                                    " entries per list (or no moments: zeros)");
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const size_t n = params_[i].numel();
    if (n == 0) continue;
    if (params[i] == nullptr || (!zero_moments && (exp_avg[i] == nullptr || exp_avg_sq[i] == nullptr))) {
      return Status(StatusCode::kInvalidArgument, "AdamW::restore: missing data for '" + params_[i].name + "'");
    }
  }
  // Moments that are all zero (a stage that never stepped: held still by lr 0) stay unallocated.
  bool moments = moments_allocated_;
  for (size_t i = 0; i < params_.size() && !moments && !zero_moments; ++i) {
    const size_t n = params_[i].numel();
    auto nonzero = [](float x) { return x != 0.0f; };
    moments = n > 0 && (std::any_of(exp_avg[i], exp_avg[i] + n, nonzero) ||
                        std::any_of(exp_avg_sq[i], exp_avg_sq[i] + n, nonzero));
  }
  if (moments) allocate({&exp_avg_, &exp_avg_sq_}, &moments_allocated_);
  for (size_t i = 0; i < params_.size(); ++i) {
    const size_t n = params_[i].numel();
    if (n == 0) continue;
    std::memcpy(params_[i].data, params[i], n * sizeof(float));
    if (!moments) continue;
    std::memcpy(exp_avg_[i].data(), zero_moments ? zeros_.data() : exp_avg[i], n * sizeof(float));
    std::memcpy(exp_avg_sq_[i].data(), zero_moments ? zeros_.data() : exp_avg_sq[i], n * sizeof(float));
  }
  step_count_ = step_count;
  clear_accumulator();
  return Status();
}

}  // namespace zl
