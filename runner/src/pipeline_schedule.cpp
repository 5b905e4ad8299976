#include "zl/pipeline_schedule.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace zl {
namespace {

using Kind = ScheduleOp::Kind;

/// [first, end): `warm` forwards, then one forward and one backward alternately, then the remaining backwards.
void one_f_one_b(int64_t first, int64_t end, int64_t warm, std::vector<ScheduleOp>* ops) {
  warm = std::min(warm, end - first);
  for (int64_t mb = first; mb < first + warm; ++mb) ops->push_back({Kind::kForward, mb});
  for (int64_t mb = first + warm; mb < end; ++mb) {
    ops->push_back({Kind::kForward, mb});
    ops->push_back({Kind::kBackward, mb - warm});
  }
  for (int64_t mb = end - warm; mb < end; ++mb) ops->push_back({Kind::kBackward, mb});
}

/// The forwards stage `stage` runs ahead of its first backward over `window_len` micro-batches (the file comment
/// of the header, and the Python table's `_warm_up`).
int64_t warm_up(const PipelineSchedule& schedule, int64_t stage, int64_t num_stages, int64_t window_len) {
  if (stage == num_stages - 1 || schedule.warm_up == PipelineSchedule::WarmUp::kNone) return 0;
  return schedule.warm_up == PipelineSchedule::WarmUp::kWindow ? window_len : num_stages - 1 - stage;
}

}  // namespace

const std::vector<PipelineSchedule>& pipeline_schedules() {
  using WarmUp = PipelineSchedule::WarmUp;
  static const std::vector<PipelineSchedule> table = {
      {"zerolock", /*backprop=*/false, /*flush=*/true, WarmUp::kNone},
      {"gpipe", /*backprop=*/true, /*flush=*/true, WarmUp::kWindow},
      {"1f1b", /*backprop=*/true, /*flush=*/true, WarmUp::kPipeline},
      {"async", /*backprop=*/true, /*flush=*/false, WarmUp::kPipeline},
  };
  return table;
}

Result<PipelineSchedule> parse_pipeline_schedule(const std::string& name) {
  for (const PipelineSchedule& s : pipeline_schedules()) {
    if (name == s.name) return s;
  }
  std::string names;
  const std::vector<PipelineSchedule>& table = pipeline_schedules();
  for (size_t i = 0; i < table.size(); ++i) {
    names += std::string(i == 0 ? "" : i + 1 == table.size() ? " or " : ", ") + table[i].name;
  }
  return Status(StatusCode::kInvalidArgument, "schedule '" + name + "'; expected " + names +
                                                  " (zerolock: local losses; the others: end-to-end backprop)");
}

std::vector<ScheduleOp> schedule_ops(const PipelineSchedule& schedule, int64_t stage, int64_t num_stages,
                                     const WindowPlan& plan, int64_t first_micro_batch) {
  std::vector<ScheduleOp> ops;
  const int64_t n = plan.num_micro_batches();
  if (first_micro_batch >= n) return ops;
  if (schedule.flush) {
    for (int64_t w = plan.window_of(first_micro_batch); w < plan.num_windows(); ++w) {
      const int64_t first = std::max(plan.first_micro_batch(w), first_micro_batch);
      const int64_t end = plan.end_micro_batch(w);
      one_f_one_b(first, end, warm_up(schedule, stage, num_stages, end - first), &ops);
    }
  } else {
    one_f_one_b(first_micro_batch, n, warm_up(schedule, stage, num_stages, n), &ops);
  }
  std::vector<ScheduleOp> with_steps;
  with_steps.reserve(ops.size() + static_cast<size_t>(plan.num_windows()));
  for (const ScheduleOp& op : ops) {
    with_steps.push_back(op);
    if (op.kind == Kind::kBackward && plan.is_last_of_window(op.micro_batch)) {
      with_steps.push_back({Kind::kStep, op.micro_batch});
    }
  }
  return with_steps;
}

int64_t max_in_flight(const std::vector<ScheduleOp>& ops) {
  int64_t now = 0, most = 0;
  for (const ScheduleOp& op : ops) {
    if (op.kind != Kind::kStep) now += op.kind == Kind::kForward ? 1 : -1;
    most = std::max(most, now);
  }
  return most;
}

int64_t forward_version(const PipelineSchedule& schedule, int64_t stage, int64_t num_stages, const WindowPlan& plan,
                        int64_t micro_batch) {
  const int64_t warm = schedule.flush ? 0 : warm_up(schedule, stage, num_stages, plan.num_micro_batches());
  return micro_batch >= warm ? plan.window_of(micro_batch - warm) : 0;
}

std::vector<SafetensorsTensorRef> WeightVersions::tensors(const std::vector<TrainableParam>& params) const {
  std::vector<SafetensorsTensorRef> out;
  for (const auto& [version, weights] : kept_) {
    for (size_t i = 0; i < params.size(); ++i) {
      out.push_back({"v" + std::to_string(version) + "/" + params[i].name, SafetensorsDtype::kF32, params[i].shape,
                     weights[i].data()});
    }
  }
  return out;
}

Status WeightVersions::restore(const SafetensorsFile& file, const std::vector<TrainableParam>& params,
                               const std::string& path) {
  std::map<int64_t, std::vector<std::vector<float>>> read;
  for (const auto& [name, tensor] : file.tensors) {
    const size_t slash = name.find('/');
    int64_t version = -1;
    if (name.size() > 1 && name[0] == 'v' && slash != std::string::npos) {
      try {
        version = std::stoll(name.substr(1, slash - 1));
      } catch (const std::exception&) {
        version = -1;
      }
    }
    const std::string param = slash == std::string::npos ? "" : name.substr(slash + 1);
    const auto it = std::find_if(params.begin(), params.end(), [&](const TrainableParam& p) { return p.name == param; });
    if (version < 0 || it == params.end() || tensor.dtype != SafetensorsDtype::kF32 || tensor.shape != it->shape) {
      return Status(StatusCode::kCorrupt, "weight versions " + path + ": tensor '" + name +
                                              "' is not v<version>/<a LoRA parameter of this stage> with its shape, "
                                              "F32; the checkpoint is damaged or of another export");
    }
    auto& weights = read[version];
    weights.resize(params.size());
    weights[static_cast<size_t>(it - params.begin())].assign(tensor.f32(), tensor.f32() + tensor.numel());
  }
  for (auto& [version, weights] : read) {
    for (size_t i = 0; i < params.size(); ++i) {
      if (weights[i].size() != params[i].numel()) {
        return Status(StatusCode::kCorrupt, "weight versions " + path + ": version " + std::to_string(version) +
                                                " lacks " + params[i].name);
      }
    }
    kept_[version] = std::move(weights);
  }
  return Status();
}

int64_t WeightVersions::version_of(int64_t micro_batch) const {
  const auto it = versions_.find(micro_batch);
  return it == versions_.end() ? -1 : it->second;
}

void WeightVersions::before_step(int64_t current, const std::vector<TrainableParam>& params) {
  const bool needed = std::any_of(versions_.begin(), versions_.end(),
                                  [&](const auto& entry) { return entry.second == current; });
  if (!needed || kept_.count(current) != 0) return;
  std::vector<std::vector<float>> copy;
  copy.reserve(params.size());
  for (const TrainableParam& p : params) copy.emplace_back(p.data, p.data + p.numel());
  kept_[current] = std::move(copy);
}

void WeightVersions::backwarded(int64_t micro_batch) {
  versions_.erase(micro_batch);
  for (auto it = kept_.begin(); it != kept_.end();) {
    const int64_t version = it->first;
    const bool needed = std::any_of(versions_.begin(), versions_.end(),
                                    [&](const auto& entry) { return entry.second == version; });
    it = needed ? std::next(it) : kept_.erase(it);
  }
}

const std::vector<std::vector<float>>* WeightVersions::kept(int64_t version) const {
  const auto it = kept_.find(version);
  return it == kept_.end() ? nullptr : &it->second;
}

WeightSwap::WeightSwap(const std::vector<TrainableParam>& params, const std::vector<std::vector<float>>* weights)
    : params_(params) {
  if (weights == nullptr) return;
  current_.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const TrainableParam& p = params[i];
    current_.emplace_back(p.data, p.data + p.numel());
    std::memcpy(p.data, (*weights)[i].data(), p.numel() * sizeof(float));
  }
}

WeightSwap::~WeightSwap() {
  for (size_t i = 0; i < current_.size(); ++i) {
    std::memcpy(params_[i].data, current_[i].data(), current_[i].size() * sizeof(float));
  }
}

}  // namespace zl
