#include "zl/accumulator_snapshot.h"

#include <unistd.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <utility>

#include "zl/safetensors.h"

namespace zl {
namespace {

constexpr const char* kFormat = "zl-accumulator";
constexpr const char* kVersion = "1";

std::string exact(double value) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.17g", value);
  return text;
}

bool parse_int(const std::map<std::string, std::string>& m, const char* key, int64_t* out) {
  const auto it = m.find(key);
  if (it == m.end() || it->second.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(it->second.c_str(), &end, 10);
  if (errno != 0 || *end != '\0') return false;
  *out = v;
  return true;
}

bool parse_double(const std::map<std::string, std::string>& m, const char* key, double* out) {
  const auto it = m.find(key);
  if (it == m.end() || it->second.empty()) return false;
  char* end = nullptr;
  *out = std::strtod(it->second.c_str(), &end);
  return *end == '\0';
}

}  // namespace

AccumulatorSnapshot AccumulatorSnapshot::of(const AdamW& optimizer, bool with_sums) {
  AccumulatorSnapshot s;
  s.accumulated = optimizer.accumulated();
  if (!with_sums) return s;
  for (size_t i = 0; i < optimizer.num_params(); ++i) {
    const TrainableParam& p = optimizer.param(i);
    s.names.push_back(p.name);
    s.shapes.push_back(p.shape);
    s.sums.emplace_back(optimizer.grad_sum(i), optimizer.grad_sum(i) + p.numel());
  }
  return s;
}

std::string accumulator_snapshot_path(const std::string& checkpoint_dir) {
  return checkpoint_dir + "/accumulator.safetensors";
}

Status write_accumulator_snapshot(const std::string& path, const AccumulatorSnapshot& s) {
  std::vector<SafetensorsTensorRef> tensors;
  for (size_t i = 0; i < s.names.size(); ++i) {
    tensors.push_back({s.names[i], SafetensorsDtype::kF32, s.shapes[i], s.sums[i].data()});
  }
  const std::map<std::string, std::string> metadata = {
      {"format", kFormat},
      {"version", kVersion},
      {"run_id", s.run_id},
      {"stage", std::to_string(s.stage)},
      {"window", std::to_string(s.window)},
      {"micro_batches_done", std::to_string(s.micro_batches_done)},
      {"accumulated", std::to_string(s.accumulated)},
      {"loss_sum", exact(s.loss_sum)},
      {"task_loss_sum", exact(s.task_loss_sum)},
      {"consistency_loss_sum", exact(s.consistency_loss_sum)},
  };
  const std::string tmp = path + ".tmp";
  ZL_RETURN_IF_ERROR(write_safetensors(tmp, tensors, metadata));  // fsynced
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return Status(StatusCode::kIoError, "rename " + tmp + " -> " + path + ": " + std::strerror(errno));
  }
  return Status();
}

Result<AccumulatorSnapshot> read_accumulator_snapshot(const std::string& path) {
  if (::access(path.c_str(), F_OK) != 0) return Status(StatusCode::kNotFound, path + " does not exist");
  Result<SafetensorsFile> read = read_safetensors(path);
  if (!read.ok()) return Status(StatusCode::kCorrupt, read.status().message());
  SafetensorsFile& file = *read;
  const auto& m = file.metadata;
  AccumulatorSnapshot s;
  const auto format = m.find("format");
  const auto version = m.find("version");
  const auto run_id = m.find("run_id");
  if (format == m.end() || format->second != kFormat || version == m.end() || version->second != kVersion ||
      run_id == m.end() || !parse_int(m, "stage", &s.stage) || !parse_int(m, "window", &s.window) ||
      !parse_int(m, "micro_batches_done", &s.micro_batches_done) || !parse_int(m, "accumulated", &s.accumulated) ||
      !parse_double(m, "loss_sum", &s.loss_sum) || !parse_double(m, "task_loss_sum", &s.task_loss_sum) ||
      !parse_double(m, "consistency_loss_sum", &s.consistency_loss_sum)) {
    return Status(StatusCode::kCorrupt, path + ": not a zl-accumulator version 1 snapshot (metadata incomplete)");
  }
  s.run_id = run_id->second;
  for (auto& [name, tensor] : file.tensors) {
    if (tensor.dtype != SafetensorsDtype::kF32) {
      return Status(StatusCode::kCorrupt, path + ": tensor '" + name + "' is not F32");
    }
    s.names.push_back(name);
    s.shapes.push_back(tensor.shape);
    const float* data = tensor.f32();
    s.sums.emplace_back(data, data + tensor.numel());
  }
  return s;
}

Status check_accumulator_snapshot(const AccumulatorSnapshot& s, const std::string& run_id, int64_t stage,
                                  int64_t window, int64_t first_micro_batch, int64_t end_micro_batch,
                                  const AdamW& optimizer) {
  auto bad = [](const std::string& why) { return Status(StatusCode::kInvalidArgument, why); };
  if (s.run_id != run_id || s.stage != stage) {
    return bad("it is of run " + s.run_id + " stage " + std::to_string(s.stage));
  }
  if (s.window != window) return bad("it is of window " + std::to_string(s.window) + ", not " + std::to_string(window));
  if (s.accumulated <= 0 || first_micro_batch + s.accumulated >= end_micro_batch ||
      s.micro_batches_done != first_micro_batch + s.accumulated) {
    return bad("it holds " + std::to_string(s.accumulated) + " micro-batches with " +
               std::to_string(s.micro_batches_done) + " done; window " + std::to_string(window) + " is micro-batches " +
               std::to_string(first_micro_batch) + ".." + std::to_string(end_micro_batch - 1));
  }
  if (!s.names.empty() && s.names.size() != optimizer.num_params()) {  // none: a forward-only stage's
    return bad("it has " + std::to_string(s.names.size()) + " tensors for " + std::to_string(optimizer.num_params()) +
               " parameters");
  }
  for (size_t i = 0; i < s.names.size(); ++i) {
    const int k = optimizer.find(s.names[i]);
    if (k < 0 || optimizer.param(static_cast<size_t>(k)).shape != s.shapes[i]) {
      return bad("tensor '" + s.names[i] + "' is no parameter of this shape");
    }
  }
  return Status();
}

AccumulatorSnapshotWriter::AccumulatorSnapshotWriter(std::string path)
    : path_(std::move(path)), thread_([this] { run(); }) {}

AccumulatorSnapshotWriter::~AccumulatorSnapshotWriter() { stop(); }

void AccumulatorSnapshotWriter::submit(AccumulatorSnapshot snapshot) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return;
    pending_ = std::move(snapshot);
  }
  cv_.notify_all();
}

void AccumulatorSnapshotWriter::drain() {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [this] { return stopping_ || (!pending_ && !writing_); });
}

void AccumulatorSnapshotWriter::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    pending_.reset();
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

int64_t AccumulatorSnapshotWriter::failures() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failures_;
}

std::string AccumulatorSnapshotWriter::last_error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_error_;
}

void AccumulatorSnapshotWriter::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    cv_.wait(lock, [this] { return stopping_ || pending_.has_value(); });
    if (stopping_) return;
    AccumulatorSnapshot snapshot = std::move(*pending_);
    pending_.reset();
    writing_ = true;
    lock.unlock();
    const Status status = write_accumulator_snapshot(path_, snapshot);
    lock.lock();
    writing_ = false;
    if (!status.ok()) {
      ++failures_;
      last_error_ = status.message();
    }
    cv_.notify_all();
  }
}

}  // namespace zl
