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

int64_t json_int(const nlohmann::json& j, const char* key, int64_t fallback) {
  auto it = j.find(key);
  return it != j.end() && it->is_number_integer() ? it->get<int64_t>() : fallback;
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> args;
  if (const int exit_code = zl::parse_tool_args(argc, argv, "zl_adamw_check", kUsage, {"params", "grads", "config", "out"}, &args); exit_code >= 0) {
    return exit_code;
  }

  std::string config_text;
  zl::Status status = zl::read_file(args["config"], &config_text);
  if (!status.ok()) return fail(status.message());
  nlohmann::json config = nlohmann::json::parse(config_text, nullptr, false);
  if (config.is_discarded() || !config.is_object()) return fail("config '" + args["config"] + "' is not a JSON object");
  const int64_t n = json_int(config, "num_micro_batches", 0);
  const int64_t m = json_int(config, "window_size", 0);
  if (n < 1 || m < 1) return fail("config needs integers num_micro_batches >= 1 and window_size >= 1");
  const zl::WindowPlan plan(n, m);
  const int64_t steps = plan.num_windows();
  // As in the stage config, a warmup_cosine total_steps of 0 (or none) means
  // "the number of windows"; fill it in before validation checks T >= W.
  nlohmann::json optimizer_json = config.value("optimizer", nlohmann::json::object());
  if (optimizer_json.is_object() && optimizer_json.contains("schedule") && optimizer_json["schedule"].is_object()) {
    nlohmann::json& schedule = optimizer_json["schedule"];
    const bool cosine = schedule.value("kind", "") == "warmup_cosine";
    if (cosine && json_int(schedule, "total_steps", 0) == 0) schedule["total_steps"] = steps;
  }
  zl::AdamWConfig adamw;
  status = zl::parse_optimizer_config(optimizer_json, &adamw);
  if (!status.ok()) return fail(status.message());

  zl::SafetensorsFile params_file, grads_file;
  status = zl::read_safetensors(args["params"], &params_file);
  if (!status.ok()) return fail(status.message());
  status = zl::read_safetensors(args["grads"], &grads_file);
  if (!status.ok()) return fail(status.message());

  // Parameters live in these buffers (stand-ins for the program's tensors).
  std::vector<std::string> names;
  std::vector<std::vector<float>> buffers;
  std::vector<zl::TrainableParam> params;
  for (const auto& entry : params_file.tensors) {
    if (entry.second.dtype != zl::SafetensorsDtype::kF32) return fail("parameter '" + entry.first + "' is not F32");
    names.push_back(entry.first);
    buffers.emplace_back(entry.second.f32(), entry.second.f32() + entry.second.numel());
  }
  for (size_t i = 0; i < names.size(); ++i) {
    params.push_back({names[i], params_file.tensors.at(names[i]).shape, buffers[i].data()});
  }
  std::unique_ptr<zl::AdamW> optimizer;
  status = zl::AdamW::create(adamw, params, &optimizer);
  if (!status.ok()) return fail(status.message());

  std::unique_ptr<zl::CheckpointStore> store;
  if (args.count("checkpoint-dir") != 0) {
    const int64_t keep = args.count("keep-last") != 0 ? std::atoll(args["keep-last"].c_str()) : 2;
    store.reset(new zl::CheckpointStore({args["checkpoint-dir"], 1, keep}));
    status = store->validate();
    if (!status.ok()) return fail(status.message());
  }

  std::vector<std::vector<float>> trajectory(names.size());
  std::vector<double> lrs;
  for (int64_t k = 0; k < n; ++k) {
    std::vector<const float*> grads;
    for (size_t i = 0; i < names.size(); ++i) {
      const std::string key = names[i] + "@" + std::to_string(k);
      auto it = grads_file.tensors.find(key);
      if (it == grads_file.tensors.end()) return fail("grads file lacks '" + key + "'");
      if (it->second.dtype != zl::SafetensorsDtype::kF32 || it->second.shape != params[i].shape) {
        return fail("gradient '" + key + "' must be F32 with the parameter's shape");
      }
      grads.push_back(it->second.f32());
    }
    status = optimizer->accumulate(grads);
    if (!status.ok()) return fail(status.message());
    if (!plan.is_last_of_window(k)) continue;
    double lr = 0;
    status = optimizer->step(&lr);
    if (!status.ok()) return fail(status.message());
    lrs.push_back(lr);
    for (size_t i = 0; i < names.size(); ++i) {
      trajectory[i].insert(trajectory[i].end(), buffers[i].begin(), buffers[i].end());
    }
    if (store) {
      zl::CheckpointProgress progress;
      progress.run_id = "zl_adamw_check";
      progress.window = plan.window_of(k);
      progress.last_micro_batch = k;
      progress.micro_batches_done = k + 1;
      progress.optimizer_step = optimizer->step_count();
      progress.lr = lr;
      status = store->save(*optimizer, progress);
      if (!status.ok()) return fail(status.message());
    }
  }

  std::vector<zl::SafetensorsTensorRef> out;
  for (size_t i = 0; i < names.size(); ++i) {
    std::vector<int64_t> shape = {steps};
    shape.insert(shape.end(), params[i].shape.begin(), params[i].shape.end());
    out.push_back({names[i], zl::SafetensorsDtype::kF32, shape, trajectory[i].data()});
  }
  out.push_back({"__lr__", zl::SafetensorsDtype::kF64, {steps}, lrs.data()});
  status = zl::write_safetensors(args["out"], out, {{"format", "pt"}});
  if (!status.ok()) return fail(status.message());
  return 0;
}
