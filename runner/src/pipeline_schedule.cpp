#include "zl/pipeline_schedule.h"

#include <algorithm>
#include <cstring>

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

}  // namespace

Result<PipelineSchedule> parse_pipeline_schedule(const std::string& name) {
  if (name == "zerolock") return PipelineSchedule::kZeroLock;
  if (name == "gpipe") return PipelineSchedule::kGPipe;
  if (name == "1f1b") return PipelineSchedule::kOneFOneB;
  if (name == "async") return PipelineSchedule::kAsync;
  return Status(StatusCode::kInvalidArgument,
                "schedule '" + name + "'; expected zerolock (local losses), gpipe, 1f1b or async (end-to-end backprop)");
}

const char* pipeline_schedule_name(PipelineSchedule schedule) {
  switch (schedule) {
    case PipelineSchedule::kZeroLock: return "zerolock";
    case PipelineSchedule::kGPipe: return "gpipe";
    case PipelineSchedule::kOneFOneB: return "1f1b";
    case PipelineSchedule::kAsync: return "async";
  }
  return "?";
}

std::vector<ScheduleOp> schedule_ops(PipelineSchedule schedule, int64_t stage, int64_t num_stages,
                                     const WindowPlan& plan, int64_t first_micro_batch) {
  std::vector<ScheduleOp> ops;
  const int64_t n = plan.num_micro_batches();
  if (first_micro_batch >= n) return ops;
  // 0 on the last stage (its forward and backward are one execution) and under zerolock (phase 2 follows phase 1).
  const int64_t warm = schedule == PipelineSchedule::kZeroLock ? 0 : num_stages - 1 - stage;
  if (schedule == PipelineSchedule::kAsync) {
    one_f_one_b(first_micro_batch, n, warm, &ops);
  } else {
    for (int64_t w = plan.window_of(first_micro_batch); w < plan.num_windows(); ++w) {
      const int64_t first = std::max(plan.first_micro_batch(w), first_micro_batch);
      const int64_t end = plan.end_micro_batch(w);
      // gpipe: every forward of the window first (the last stage has no warm-up under any schedule).
      one_f_one_b(first, end, schedule == PipelineSchedule::kGPipe && warm > 0 ? end - first : warm, &ops);
    }
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

int64_t forward_version(PipelineSchedule schedule, int64_t stage, int64_t num_stages, const WindowPlan& plan,
                        int64_t micro_batch) {
  const int64_t warm = schedule == PipelineSchedule::kAsync ? num_stages - 1 - stage : 0;
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
