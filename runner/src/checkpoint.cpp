#include "zl/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <set>

#include "zl/durable_file.h"

namespace zl {
namespace {

// Swaps two paths atomically (renameat2 with RENAME_EXCHANGE); false, with
// errno set, where the kernel or the filesystem cannot.
bool exchange_paths(const std::string& a, const std::string& b) {
#if defined(__linux__) && defined(SYS_renameat2)
  constexpr unsigned kRenameExchange = 2;  // RENAME_EXCHANGE of <linux/fs.h>
  return ::syscall(SYS_renameat2, AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), kRenameExchange) == 0;
#else
  errno = ENOSYS;
  return false;
#endif
}

using nlohmann::json;

constexpr int kFormatVersion = 1;

std::string shape_text(const std::vector<int64_t>& shape) { return json(shape).dump(); }

Status check_tensor(const std::string& file, const SafetensorsFile& contents, const std::string& name,
                    const std::vector<int64_t>& shape) {
  auto it = contents.tensors.find(name);
  if (it == contents.tensors.end()) {
    return Status(StatusCode::kCorrupt, "checkpoint file '" + file + "' lacks tensor '" + name + "'");
  }
  if (it->second.dtype != SafetensorsDtype::kF32) {
    return Status(StatusCode::kCorrupt, "checkpoint file '" + file + "': tensor '" + name + "' has dtype " +
                                            safetensors_dtype_name(it->second.dtype) + ", expected F32");
  }
  if (it->second.shape != shape) {
    return Status(StatusCode::kCorrupt, "checkpoint file '" + file + "': tensor '" + name + "' has shape " +
                                            shape_text(it->second.shape) + ", expected " + shape_text(shape));
  }
  // A weight or moment that is nan or inf: the run was damaged (it diverged, or the file was); resuming from it
  // would train on NaNs, so it is as unusable as a torn file (StageRunner::fall_back takes an older one).
  const int64_t bad = first_non_finite(it->second.f32(), it->second.numel());
  if (bad >= 0) {
    return Status(StatusCode::kCorrupt, "checkpoint file '" + file + "': tensor '" + name + "' holds " +
                                            std::to_string(it->second.f32()[bad]) + " at element " +
                                            std::to_string(bad) + " (a damaged run: not finite)");
  }
  return Status();
}

Status check_no_extra(const std::string& file, const SafetensorsFile& contents, const std::set<std::string>& names) {
  for (const auto& entry : contents.tensors) {
    if (names.count(entry.first) == 0) {
      return Status(StatusCode::kCorrupt, "checkpoint file '" + file + "' has tensor '" + entry.first +
                                              "' that is not a parameter of this stage program");
    }
  }
  return Status();
}

json progress_to_json(const CheckpointProgress& p, const AdamW& optimizer) {
  json params = json::array();
  for (size_t i = 0; i < optimizer.num_params(); ++i) {
    params.push_back({{"name", optimizer.param(i).name}, {"shape", optimizer.param(i).shape}});
  }
  return {{"format", "zl-checkpoint"},
          {"version", kFormatVersion},
          {"run_id", p.run_id},
          {"stage", p.stage},
          {"window", p.window},
          {"last_micro_batch", p.last_micro_batch},
          {"micro_batches_done", p.micro_batches_done},
          {"optimizer_step", p.optimizer_step},
          {"lr", p.lr},
          {"created_unix_ms", p.created_unix_ms},
          {"params", params},
          {"extra", p.extra.is_object() ? p.extra : json::object()}};
}

Result<CheckpointProgress> progress_from_json(const std::string& file, const std::string& text) {
  CheckpointProgress out;
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return Status(StatusCode::kCorrupt, "checkpoint file '" + file + "' is not a valid JSON object");
  }
  auto missing = [&](const char* key, const char* type) {
    return Status(StatusCode::kCorrupt, "checkpoint file '" + file + "': field '" + key + "' is missing or not " + type);
  };
  auto get_int = [&](const char* key, int64_t* value) {
    auto it = j.find(key);
    if (it == j.end() || !it->is_number_integer()) return missing(key, "an integer");
    *value = it->get<int64_t>();
    return Status();
  };
  auto format = j.find("format");
  if (format == j.end() || !format->is_string() || format->get<std::string>() != "zl-checkpoint") {
    return missing("format", "\"zl-checkpoint\"");
  }
  int64_t version = 0;
  ZL_RETURN_IF_ERROR(get_int("version", &version));
  if (version != kFormatVersion) {
    return Status(StatusCode::kCorrupt, "checkpoint file '" + file + "' has version " + std::to_string(version) +
                                            ", this runner reads version " + std::to_string(kFormatVersion));
  }
  for (auto field : {std::make_pair("stage", &out.stage), std::make_pair("window", &out.window),
                     std::make_pair("last_micro_batch", &out.last_micro_batch),
                     std::make_pair("micro_batches_done", &out.micro_batches_done),
                     std::make_pair("optimizer_step", &out.optimizer_step),
                     std::make_pair("created_unix_ms", &out.created_unix_ms)}) {
    ZL_RETURN_IF_ERROR(get_int(field.first, field.second));
  }
  auto run_id = j.find("run_id");
  if (run_id == j.end() || !run_id->is_string()) return missing("run_id", "a string");
  out.run_id = run_id->get<std::string>();
  auto lr = j.find("lr");
  if (lr == j.end() || !lr->is_number()) return missing("lr", "a number");
  out.lr = lr->get<double>();
  auto extra = j.find("extra");
  out.extra = (extra != j.end() && extra->is_object()) ? *extra : json::object();
  if (out.optimizer_step < 0 || out.window < 0) {
    return Status(StatusCode::kCorrupt, "checkpoint file '" + file + "' has a negative window or optimizer_step");
  }
  return out;
}

int64_t now_unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

int64_t first_non_finite(const float* data, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    if (!std::isfinite(data[i])) return i;
  }
  return -1;
}

Result<CheckpointData> read_checkpoint(const std::string& window_dir, const std::vector<TrainableParam>& expected) {
  if (!is_directory(window_dir)) {
    return Status(StatusCode::kNotFound, "checkpoint directory '" + window_dir + "' does not exist");
  }
  const std::string progress_path = window_dir + "/" + kProgressFile;
  const std::string adapter_path = window_dir + "/" + kAdapterFile;
  const std::string optimizer_path = window_dir + "/" + kOptimizerFile;
  const Result<std::string> text = read_file(progress_path);
  ZL_RETURN_IF_ERROR_WITH_PREFIX(text, "checkpoint is incomplete: ");
  CheckpointData out;
  ZL_ASSIGN_OR_RETURN(out.progress, progress_from_json(progress_path, *text));
  Result<SafetensorsFile> adapter = read_safetensors(adapter_path);
  ZL_RETURN_IF_ERROR_WITH_PREFIX(adapter, "checkpoint is unreadable: ");
  out.adapter = std::move(adapter).value();
  Result<SafetensorsFile> optimizer = read_safetensors(optimizer_path);
  ZL_RETURN_IF_ERROR_WITH_PREFIX(optimizer, "checkpoint is unreadable: ");
  out.optimizer = std::move(optimizer).value();
  const auto zero = out.optimizer.metadata.find(kZeroMomentsKey);
  out.zero_moments = zero != out.optimizer.metadata.end() && zero->second == kZeroMomentsValue;

  std::set<std::string> param_names, moment_names;  // moment_names stays empty with zero moments: no tensor
  for (const auto& p : expected) {
    param_names.insert(p.name);
    ZL_RETURN_IF_ERROR(check_tensor(adapter_path, out.adapter, p.name, p.shape));
    if (out.zero_moments) continue;
    moment_names.insert(p.name + ".exp_avg");
    moment_names.insert(p.name + ".exp_avg_sq");
    ZL_RETURN_IF_ERROR(check_tensor(optimizer_path, out.optimizer, p.name + ".exp_avg", p.shape));
    ZL_RETURN_IF_ERROR(check_tensor(optimizer_path, out.optimizer, p.name + ".exp_avg_sq", p.shape));
  }
  ZL_RETURN_IF_ERROR(check_no_extra(adapter_path, out.adapter, param_names));
  ZL_RETURN_IF_ERROR(check_no_extra(optimizer_path, out.optimizer, moment_names));
  return out;
}

Status CheckpointStore::validate() const {
  if (options_.dir.empty()) return Status(StatusCode::kInvalidArgument, "checkpoint dir is empty");
  if (options_.interval < 1) {
    return Status(StatusCode::kInvalidArgument,
                  "checkpoint interval must be >= 1, got " + std::to_string(options_.interval));
  }
  if (options_.keep_last < 1) {
    return Status(StatusCode::kInvalidArgument,
                  "checkpoint keep_last must be >= 1, got " + std::to_string(options_.keep_last));
  }
  return Status();
}

bool CheckpointStore::due(int64_t window, bool is_last_window) const {
  return is_last_window || (window + 1) % std::max<int64_t>(1, options_.interval) == 0;
}

Result<std::vector<int64_t>> CheckpointStore::list_windows() const {
  std::vector<int64_t> windows;
  const Result<std::vector<std::string>> names = list_directory(options_.dir);
  if (names.status().code() == StatusCode::kNotFound) return windows;
  ZL_RETURN_IF_ERROR(names);
  const CheckpointLayout layout(options_.dir);
  for (const auto& name : *names) {
    int64_t window = 0;
    if (parse_checkpoint_dir_name(name, &window) && is_directory(layout.entry(name))) windows.push_back(window);
  }
  std::sort(windows.begin(), windows.end());
  return windows;
}

namespace {

// save()'s checks before anything is written.
Status check_save(const AdamW& optimizer, const CheckpointProgress& progress) {
  if (progress.window < 0) {
    return Status(StatusCode::kInvalidArgument, "checkpoint save: window must be >= 0, got " +
                                                    std::to_string(progress.window));
  }
  if (progress.optimizer_step != optimizer.step_count()) {
    return Status(StatusCode::kInvalidArgument, "checkpoint save: progress.optimizer_step " +
                                                    std::to_string(progress.optimizer_step) +
                                                    " != optimizer step count " +
                                                    std::to_string(optimizer.step_count()));
  }
  return Status();
}

// Creates staging directory `tmp` and writes the three files into it, each
// fsynced, then the directory itself.
Status write_staging(const std::string& tmp, const AdamW& optimizer, const CheckpointProgress& progress,
                     const std::vector<SafetensorsTensorRef>& extra) {
  if (::mkdir(tmp.c_str(), 0755) != 0) {
    return Status(StatusCode::kIoError, "cannot create '" + tmp + "': " + std::strerror(errno));
  }
  std::vector<SafetensorsTensorRef> adapter, moments;
  for (size_t i = 0; i < optimizer.num_params(); ++i) {
    const TrainableParam& p = optimizer.param(i);
    adapter.push_back({p.name, SafetensorsDtype::kF32, p.shape, p.data});
    if (!optimizer.has_moments()) continue;  // all zero: not written (a held stage's: 2/3 of its checkpoint)
    moments.push_back({p.name + ".exp_avg", SafetensorsDtype::kF32, p.shape, optimizer.exp_avg(i)});
    moments.push_back({p.name + ".exp_avg_sq", SafetensorsDtype::kF32, p.shape, optimizer.exp_avg_sq(i)});
  }
  // "format": "pt" is what safetensors.torch.save_file writes; PEFT expects it.
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"}, {"run_id", progress.run_id}, {"window", std::to_string(progress.window)}};
  std::map<std::string, std::string> optimizer_metadata = metadata;
  if (!optimizer.has_moments()) optimizer_metadata[kZeroMomentsKey] = kZeroMomentsValue;
  ZL_RETURN_IF_ERROR(write_safetensors(tmp + "/" + kAdapterFile, adapter, metadata));
  ZL_RETURN_IF_ERROR(write_safetensors(tmp + "/" + kOptimizerFile, moments, optimizer_metadata));
  if (!extra.empty()) ZL_RETURN_IF_ERROR(write_safetensors(tmp + "/" + kWeightVersionsFile, extra, metadata));
  CheckpointProgress stamped = progress;
  stamped.created_unix_ms = now_unix_ms();
  const std::string progress_text = progress_to_json(stamped, optimizer).dump(2) + "\n";
  ZL_RETURN_IF_ERROR(write_file_synced(tmp + "/" + kProgressFile, progress_text.data(), progress_text.size()));
  return fsync_directory(tmp);
}

}  // namespace

Status CheckpointStore::save(const AdamW& optimizer, const CheckpointProgress& progress,
                             const std::vector<SafetensorsTensorRef>& extra) {
  ZL_RETURN_IF_ERROR(validate());
  ZL_RETURN_IF_ERROR(check_save(optimizer, progress));
  const CheckpointLayout layout(options_.dir);
  const std::string& root = layout.root();
  ZL_RETURN_IF_ERROR(make_directories(root));

  // One writer per checkpoint root: any .tmp-* left here is from a killed save.
  ZL_ASSIGN_OR_RETURN(const std::vector<std::string> names, list_directory(root));
  for (const auto& name : names) {
    if (is_checkpoint_staging_name(name)) ZL_RETURN_IF_ERROR(remove_tree(layout.entry(name)));
  }

  const long pid = static_cast<long>(::getpid());
  const std::string tmp = layout.staging_dir(progress.window, pid);
  ZL_RETURN_IF_ERROR(write_staging(tmp, optimizer, progress, extra));
  ZL_RETURN_IF_ERROR(publish(layout, tmp, progress.window, pid));
  return prune(layout);
}

Status CheckpointStore::publish(const CheckpointLayout& layout, const std::string& tmp, int64_t window,
                                long pid) const {
  const std::string& root = layout.root();
  const std::string final_path = layout.window_dir(window);
  const std::string old_path = layout.replaced_dir(window, pid);
  const bool replacing = is_directory(final_path);
  if (replacing && exchange_paths(tmp, final_path)) {
    // One atomic step: window_N is the old checkpoint, then the new one, never
    // missing; the old one is left under the staging name (.tmp-, ignored).
    ZL_RETURN_IF_ERROR(fsync_directory(root));
    if (options_.on_replace) options_.on_replace(final_path);
    return remove_tree(tmp);
  }
  // Without RENAME_EXCHANGE (not Linux, or a filesystem without it):
  // rename() cannot replace a non-empty directory, so an existing one is
  // moved aside first (under .tmp-, so a crash here leaves it ignored).
  if (replacing && ::rename(final_path.c_str(), old_path.c_str()) != 0) {
    return Status(StatusCode::kIoError, "cannot move aside '" + final_path + "': " + std::strerror(errno));
  }
  if (::rename(tmp.c_str(), final_path.c_str()) != 0) {
    return Status(StatusCode::kIoError,
                  "cannot rename '" + tmp + "' to '" + final_path + "': " + std::strerror(errno));
  }
  ZL_RETURN_IF_ERROR(fsync_directory(root));
  if (replacing && options_.on_replace) options_.on_replace(final_path);
  if (replacing) ZL_RETURN_IF_ERROR(remove_tree(old_path));
  return Status();
}

Status CheckpointStore::prune(const CheckpointLayout& layout) const {
  ZL_ASSIGN_OR_RETURN(const std::vector<int64_t> windows, list_windows());
  const int64_t excess = static_cast<int64_t>(windows.size()) - options_.keep_last;
  for (int64_t i = 0; i < excess; ++i) {
    ZL_RETURN_IF_ERROR(remove_tree(layout.window_dir(windows[static_cast<size_t>(i)])));
  }
  return excess > 0 ? fsync_directory(layout.root()) : Status();
}

Result<CheckpointProgress> CheckpointStore::load(int64_t window, AdamW* optimizer) const {
  std::vector<TrainableParam> expected;
  for (size_t i = 0; i < optimizer->num_params(); ++i) expected.push_back(optimizer->param(i));
  const std::string dir = CheckpointLayout(options_.dir).window_dir(window);
  ZL_ASSIGN_OR_RETURN(const CheckpointData data, read_checkpoint(dir, expected));
  if (data.progress.window != window) {
    return Status(StatusCode::kCorrupt, "checkpoint '" + dir + "' says window " +
                                            std::to_string(data.progress.window) + " in " + kProgressFile);
  }
  std::vector<const float*> params, exp_avg, exp_avg_sq;  // the moments stay empty when they are zero
  for (const auto& p : expected) {
    params.push_back(data.adapter.tensors.at(p.name).f32());
    if (data.zero_moments) continue;
    exp_avg.push_back(data.optimizer.tensors.at(p.name + ".exp_avg").f32());
    exp_avg_sq.push_back(data.optimizer.tensors.at(p.name + ".exp_avg_sq").f32());
  }
  ZL_RETURN_IF_ERROR(optimizer->restore(data.progress.optimizer_step, params, exp_avg, exp_avg_sq));
  return data.progress;
}

Result<std::optional<CheckpointProgress>> CheckpointStore::load_latest(AdamW* optimizer) const {
  ZL_ASSIGN_OR_RETURN(const std::vector<int64_t> windows, list_windows());
  if (windows.empty()) return std::optional<CheckpointProgress>();
  Result<CheckpointProgress> progress = load(windows.back(), optimizer);
  if (!progress.ok()) return progress.status().with_context("", " (newest checkpoint)");
  return std::optional<CheckpointProgress>(std::move(progress).value());
}

}  // namespace zl
