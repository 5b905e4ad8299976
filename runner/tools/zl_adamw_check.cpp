// zl_adamw_check: runs the runner's AdamW (zl/adamw.h) on parameters and
// gradients from safetensors files and writes the parameter trajectory, so
// tests/test_adamw.py can compare it with torch.optim.AdamW. With
// --checkpoint-dir it also saves a runner checkpoint after every window,
// which tests/test_checkpoint_format.py reads with the safetensors package.
//
//   zl_adamw_check --params params.safetensors --grads grads.safetensors \
//       --config config.json --out trajectory.safetensors [--checkpoint-dir DIR]
//
// params.safetensors: the initial parameters, F32, under their names.
// grads.safetensors:  "<name>@<k>" = gradient of micro-batch k (0-based), F32.
// config.json:        {"num_micro_batches": n, "window_size": m,
//                      "optimizer": {...}}   (the stage config's "optimizer" object)
// trajectory:         "<name>" = [steps, *shape], the parameter after each step,
//                     "__lr__" = [steps] F64, the learning rate of each step,
//                     where steps = ceil(n / m); the last window may be short.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "zl/adamw.h"
#include "zl/checkpoint.h"
#include "zl/durable_file.h"
#include "zl/runner_config.h"
#include "tool_args.h"
#include "zl/safetensors.h"
#include "zl/window_plan.h"

namespace {

constexpr const char* kUsage =
    "usage: zl_adamw_check --params P.safetensors --grads G.safetensors --config C.json\n"
    "                      --out T.safetensors [--checkpoint-dir DIR] [--keep-last K]\n"
    "Runs the runner's AdamW over n micro-batch gradients in windows of m and writes\n"
    "the parameter after every step. See the comment at the top of zl_adamw_check.cpp.\n";

int fail(const std::string& message) {
  std::fprintf(stderr, "zl_adamw_check: %s\n", message.c_str());
  return 1;
}

zl::Status invalid(const std::string& message) { return zl::Status(zl::StatusCode::kInvalidArgument, message); }

int64_t json_int(const nlohmann::json& j, const char* key, int64_t fallback) {
  auto it = j.find(key);
  return it != j.end() && it->is_number_integer() ? it->get<int64_t>() : fallback;
}

// config.json read: n micro-batches in windows of m, and the optimizer.
struct CheckConfig {
  zl::WindowPlan plan;
  zl::AdamWConfig adamw;
};

zl::Result<CheckConfig> read_config(const std::string& path) {
  ZL_ASSIGN_OR_RETURN(const std::string text, zl::read_file(path));
  nlohmann::json config = nlohmann::json::parse(text, nullptr, false);
  if (config.is_discarded() || !config.is_object()) return invalid("config '" + path + "' is not a JSON object");
  const int64_t n = json_int(config, "num_micro_batches", 0);
  const int64_t m = json_int(config, "window_size", 0);
  if (n < 1 || m < 1) return invalid("config needs integers num_micro_batches >= 1 and window_size >= 1");
  const zl::WindowPlan plan(n, m);
  // As in the stage config, a warmup_cosine total_steps of 0 (or none) means
  // "the number of windows"; fill it in before validation checks T >= W.
  nlohmann::json optimizer_json = config.value("optimizer", nlohmann::json::object());
  if (optimizer_json.is_object() && optimizer_json.contains("schedule") && optimizer_json["schedule"].is_object()) {
    nlohmann::json& schedule = optimizer_json["schedule"];
    const bool cosine = schedule.value("kind", "") == "warmup_cosine";
    if (cosine && json_int(schedule, "total_steps", 0) == 0) schedule["total_steps"] = plan.num_windows();
  }
  ZL_ASSIGN_OR_RETURN(zl::AdamWConfig adamw, zl::parse_optimizer_config(optimizer_json));
  return CheckConfig{plan, adamw};
}

// The parameters, copied into buffers of their own (stand-ins for the
// program's tensors), in name order.
struct Parameters {
  std::vector<std::string> names;
  std::vector<std::vector<float>> buffers;
  std::vector<zl::TrainableParam> params;
};

zl::Result<Parameters> load_parameters(const zl::SafetensorsFile& file) {
  Parameters p;
  for (const auto& entry : file.tensors) {
    if (entry.second.dtype != zl::SafetensorsDtype::kF32) return invalid("parameter '" + entry.first + "' is not F32");
    p.names.push_back(entry.first);
    p.buffers.emplace_back(entry.second.f32(), entry.second.f32() + entry.second.numel());
  }
  for (size_t i = 0; i < p.names.size(); ++i) {
    p.params.push_back({p.names[i], file.tensors.at(p.names[i]).shape, p.buffers[i].data()});
  }
  return p;
}

// Micro-batch k's gradients "<name>@<k>", in parameter order.
zl::Result<std::vector<const float*>> gradients_of(const zl::SafetensorsFile& grads_file, const Parameters& p,
                                                   int64_t k) {
  std::vector<const float*> grads;
  for (size_t i = 0; i < p.names.size(); ++i) {
    const std::string key = p.names[i] + "@" + std::to_string(k);
    auto it = grads_file.tensors.find(key);
    if (it == grads_file.tensors.end()) return invalid("grads file lacks '" + key + "'");
    if (it->second.dtype != zl::SafetensorsDtype::kF32 || it->second.shape != p.params[i].shape) {
      return invalid("gradient '" + key + "' must be F32 with the parameter's shape");
    }
    grads.push_back(it->second.f32());
  }
  return grads;
}

// The parameters after each step ([steps, *shape] per name) and each step's lr.
struct Trajectory {
  std::vector<std::vector<float>> params;
  std::vector<double> lrs;
};

// Accumulates every micro-batch and steps at each window's end, recording the
// trajectory and (with `store`) saving a checkpoint after every window.
zl::Result<Trajectory> train(const zl::WindowPlan& plan, const zl::SafetensorsFile& grads_file, const Parameters& p,
                             zl::AdamW* optimizer, zl::CheckpointStore* store) {
  Trajectory t;
  t.params.resize(p.names.size());
  for (int64_t k = 0; k < plan.num_micro_batches(); ++k) {
    ZL_ASSIGN_OR_RETURN(const std::vector<const float*> grads, gradients_of(grads_file, p, k));
    ZL_RETURN_IF_ERROR(optimizer->accumulate(grads));
    if (!plan.is_last_of_window(k)) continue;
    ZL_ASSIGN_OR_RETURN(const double lr, optimizer->step());
    t.lrs.push_back(lr);
    for (size_t i = 0; i < p.names.size(); ++i) {
      t.params[i].insert(t.params[i].end(), p.buffers[i].begin(), p.buffers[i].end());
    }
    if (store) {
      zl::CheckpointProgress progress;
      progress.run_id = "zl_adamw_check";
      progress.window = plan.window_of(k);
      progress.last_micro_batch = k;
      progress.micro_batches_done = k + 1;
      progress.optimizer_step = optimizer->step_count();
      progress.lr = lr;
      ZL_RETURN_IF_ERROR(store->save(*optimizer, progress));
    }
  }
  return t;
}

zl::Status write_trajectory(const std::string& path, const Parameters& p, const Trajectory& t, int64_t steps) {
  std::vector<zl::SafetensorsTensorRef> out;
  for (size_t i = 0; i < p.names.size(); ++i) {
    std::vector<int64_t> shape = {steps};
    shape.insert(shape.end(), p.params[i].shape.begin(), p.params[i].shape.end());
    out.push_back({p.names[i], zl::SafetensorsDtype::kF32, shape, t.params[i].data()});
  }
  out.push_back({"__lr__", zl::SafetensorsDtype::kF64, {steps}, t.lrs.data()});
  return zl::write_safetensors(path, out, {{"format", "pt"}});
}

zl::Status run(std::map<std::string, std::string>& args) {
  ZL_ASSIGN_OR_RETURN(const CheckConfig config, read_config(args["config"]));
  ZL_ASSIGN_OR_RETURN(const zl::SafetensorsFile params_file, zl::read_safetensors(args["params"]));
  ZL_ASSIGN_OR_RETURN(const zl::SafetensorsFile grads_file, zl::read_safetensors(args["grads"]));
  ZL_ASSIGN_OR_RETURN(const Parameters p, load_parameters(params_file));
  ZL_ASSIGN_OR_RETURN(std::unique_ptr<zl::AdamW> optimizer, zl::AdamW::create(config.adamw, p.params));
  std::unique_ptr<zl::CheckpointStore> store;
  if (args.count("checkpoint-dir") != 0) {
    const int64_t keep = args.count("keep-last") != 0 ? std::atoll(args["keep-last"].c_str()) : 2;
    store.reset(new zl::CheckpointStore({args["checkpoint-dir"], 1, keep}));
    ZL_RETURN_IF_ERROR(store->validate());
  }
  ZL_ASSIGN_OR_RETURN(const Trajectory t, train(config.plan, grads_file, p, optimizer.get(), store.get()));
  return write_trajectory(args["out"], p, t, config.plan.num_windows());
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> args;
  if (const int exit_code = zl::parse_tool_args(argc, argv, "zl_adamw_check", kUsage, {"params", "grads", "config", "out"}, &args); exit_code >= 0) {
    return exit_code;
  }
  const zl::Status status = run(args);
  return status.ok() ? 0 : fail(status.message());
}
