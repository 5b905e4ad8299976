#include "zl/stage_program.h"

#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <fstream>
#include <optional>
#include <utility>

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>
#include <executorch/runtime/core/evalue.h>
#include <zl/fast_kernels.h>
#include <zl/pipeline_marker.h>
#include <zl/thread_pool.h>
#include <zl/widen.h>

#include "zl/cpu_cores.h"
#include "zl/durable_file.h"
#include "zl/log.h"
#include "zl/stage_manifest.h"


namespace zl {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::extension::Module;
using executorch::extension::TensorPtr;
using executorch::runtime::Error;
using executorch::runtime::EValue;
using executorch::runtime::MethodMeta;

namespace {

constexpr const char* kMethod = "forward";
constexpr const char* kGradientsIndexMethod = "__et_training_gradients_index_forward";
constexpr const char* kParametersIndexMethod = "__et_training_parameters_index_forward";
constexpr const char* kFqnMethod = "__et_training_fqn_forward";

std::string error_name(Error error) {
  return "ExecuTorch error " + std::to_string(static_cast<int>(error));
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

// Sizes the pool to `threads` (0: the device's performance cores) and returns
// the threads the kernels then split their work over.
int64_t apply_thread_count(int64_t threads) {
  const int64_t wanted = threads == 0 ? device_default_threads() : threads;
  if (!has_thread_pool()) {
    if (wanted > 1) {
      log(LogLevel::kWarn, "ExecuTorch thread pool unavailable in this build; %lld threads asked, 1 used",
          static_cast<long long>(wanted));
    }
    return 1;
  }
  if (!reset_thread_pool(static_cast<uint32_t>(wanted))) {
    log(LogLevel::kWarn, "could not resize the ExecuTorch thread pool to %lld threads",
        static_cast<long long>(wanted));
  }
  return parallel_thread_count();
}

// Registers zl's float32 kernels (docs/design#kernels) unless
// ZL_KERNELS=executorch asks for ExecuTorch's own. Before the program
// loads: the runtime binds each instruction to a kernel at method load.
Status use_fast_kernels() {
  const char* env = std::getenv("ZL_KERNELS");
  const std::string choice = env != nullptr && *env != '\0' ? env : "zl";
  if (choice == "executorch") {
    log(LogLevel::kInfo, "kernels: ExecuTorch's own (ZL_KERNELS=executorch)");
    if (fast_kernels_registered()) {
      log(LogLevel::kWarn, "ZL_KERNELS=executorch, but zl's kernels were registered "
                           "earlier in this process and stay in use");
    }
    return Status();
  }
  if (choice != "zl") {
    return Status(StatusCode::kInvalidArgument,
                  "ZL_KERNELS=" + choice + " is not one of zl, executorch; unset it to use zl's kernels");
  }
  const FastKernelsRegistration result = register_fast_kernels();
  if (!result.ok) {
    return Status(StatusCode::kInternal,
                  result.error + "; set ZL_KERNELS=executorch to run on ExecuTorch's own kernels");
  }
  if (result.kernels > 0) {
    log(LogLevel::kInfo, "kernels: zl's fast kernels (%d registered, GEMM on %s; docs/design#kernels)",
        result.kernels, gemm_backend().c_str());
  }
  return Status();
}

/// Checks that the file is as long as its `.pte` extended header says (an
/// interrupted copy or `adb push` leaves a prefix). The container: a
/// flatbuffer with identifier "ET12" at bytes 4..8, then at byte 8 "eh00",
/// u32 header length, u64 program size, u64 segment base, u64 segment size
/// (little-endian; zl_export/training_program.py checks the same on the host).
Status check_program_size(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return Status(StatusCode::kNotFound, "program " + path + ": cannot open it; run `zl export` first");
  const uint64_t size = static_cast<uint64_t>(in.tellg());
  unsigned char head[40] = {};
  in.seekg(0);
  in.read(reinterpret_cast<char*>(head), sizeof(head));
  if (in.gcount() < static_cast<std::streamsize>(sizeof(head)) || std::memcmp(head + 8, "eh00", 4) != 0) {
    return Status();  // too short or no extended header: ExecuTorch's own checks name the problem
  }
  auto u64 = [&](size_t at) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | head[at + i];
    return v;
  };
  const uint64_t program_size = u64(16), segment_base = u64(24), segment_size = u64(32);
  const uint64_t need = std::max(program_size, segment_size != 0 ? segment_base + segment_size : 0);
  if (size < need) {
    return Status(StatusCode::kInvalidArgument, "program " + path + " is truncated: " + std::to_string(size) +
                                                    " bytes, its header says " + std::to_string(need) +
                                                    "; export or copy it again");
  }
  return Status();
}

}  // namespace

// Method::mutable_input is deprecated, and it is ExecuTorch's only access to a planned input mid-execution.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
/// A Module that lets a suspended method's planned input be written: Method::set_input refuses mid-execution, and
/// the method copied the input into its own planned buffer when execute() began.
class StageModule : public Module {
 public:
  using Module::Module;
  /// The data of input `index` of the loaded `method` as the method reads it, or nullptr.
  float* planned_input(const std::string& method, size_t index) {
    const auto it = methods_.find(method);
    if (it == methods_.end() || !it->second.method) return nullptr;
    EValue& value = it->second.method->mutable_input(index);  // ExecuTorch's only access to it mid-execution
    return value.isTensor() ? value.toTensor().mutable_data_ptr<float>() : nullptr;
  }
};
#pragma GCC diagnostic pop

/// ExecuTorch state, out of the public header.
struct StageProgram::Impl {
  std::unique_ptr<StageModule> module;
  std::vector<int64_t> ids;     // (B, S)
  std::vector<float> hidden;    // (B, S, D)
  std::vector<int64_t> mask;    // (B, S)
  std::vector<int64_t> labels;  // (B, S)
  std::vector<float> grad_hidden;  // (B, S, D): a backprop program's 4th input, stages before the last
  std::vector<TensorPtr> tensors;
  std::vector<EValue> inputs;
  // Result of the worker's last execute.
  Error exec_error = Error::Ok;
  std::vector<EValue> outputs;
};

/// Lets the C hook reach the private handler.
struct StageProgramHook {
  static PipelineMarkerAction call(const Tensor& hidden, void* self) {
    return static_cast<StageProgram*>(self)->on_marker(&hidden) ? PipelineMarkerAction::kContinue
                                                                 : PipelineMarkerAction::kStop;
  }
};

StageProgram::StageProgram() : impl_(new Impl) {}

/// StageProgram::load's steps, in order. Each fills part of the program and
/// checks it against the stage contract and the manifest; errors name the
/// program (and the manifest) and the mismatch. A friend of StageProgram, so
/// the steps and their ExecuTorch types stay out of the header.
struct StageProgramLoader {
  StageProgram& program;
  StageProgram::Impl& impl;
  const std::string& path;
  const std::string& manifest_path;
  const ManifestStage& stage;
  const StageProgramOptions& options;
  std::vector<EValue> fqns;  // program names of the parameters, gradient order

  Status load_module();
  Status read_training_indices();
  Status check_inputs(const MethodMeta& meta);
  Status check_outputs(const MethodMeta& meta);
  Status bind_parameters(const MethodMeta& meta);
  void allocate_input_buffers();
};

Status StageProgramLoader::load_module() {
  // The LoRA weights have gradients, so the exporter plans them into the
  // method's memory (initialised from the program's mutable segment at load;
  // `weight_has_gradient` in exir/memory_planning.py): AdamW writes there, and
  // the frozen constants can stay a read-only map of the file.
  ZL_RETURN_IF_ERROR(check_program_size(path));
  impl.module.reset(new StageModule(path, options.map_file ? Module::LoadMode::Mmap : Module::LoadMode::File));
  const Error error = impl.module->load();
  if (error != Error::Ok) {
    return Status(StatusCode::kInvalidArgument,
                  "program " + path + ": ExecuTorch cannot load it (" + error_name(error) + "); is it a `zl export` output?");
  }
  return Status();
}

Status StageProgramLoader::read_training_indices() {
  auto grad_index = impl.module->execute(kGradientsIndexMethod);
  auto param_index = impl.module->execute(kParametersIndexMethod);
  auto names = impl.module->execute(kFqnMethod);
  if (!grad_index.ok() || !param_index.ok() || !names.ok() || grad_index->empty() || param_index->empty() ||
      !(*grad_index)[0].isInt() || !(*param_index)[0].isInt()) {
    return Status(StatusCode::kInvalidArgument,
                  "program " + path + " is not an ExecuTorch training program (no " + kGradientsIndexMethod + " / " +
                      kParametersIndexMethod + " / " + kFqnMethod + " methods)");
  }
  program.grad_start_ = static_cast<size_t>((*grad_index)[0].toInt());
  program.param_start_ = static_cast<size_t>((*param_index)[0].toInt());
  fqns = std::move(*names);
  return Status();
}

Status StageProgramLoader::check_inputs(const MethodMeta& meta) {
  program.backprop_ = stage.program_kind == "backprop";
  program.is_last_ = !stage.has_hidden_output;
  program.local_loss_ = program.backprop_ && !program.is_last_ && stage.local_weight > 0;
  // A backprop program takes grad_hidden after (x, attention_mask, labels), but on the last stage
  // (docs/design#backprop-program).
  const size_t expected = program.backprop_ && !program.is_last_ ? 4 : 3;
  if (meta.num_inputs() != expected) {
    return Status(StatusCode::kInvalidArgument,
                  "program " + path + ": 'forward' takes " + std::to_string(meta.num_inputs()) + " inputs, a " +
                      stage.program_kind + " stage program " + (expected == 4 ? "before the last " : "") +
                      "takes " + std::to_string(expected) + " (x, attention_mask, labels" +
                      (expected == 4 ? ", grad_hidden)" : ")") + "; does manifest " + manifest_path +
                      " belong to this export?");
  }
  std::vector<std::vector<int64_t>> in_shapes;
  std::vector<ScalarType> in_types;
  for (size_t i = 0; i < expected; ++i) {
    auto info = meta.input_tensor_meta(i);
    if (!info.ok()) return Status(StatusCode::kInvalidArgument, "program " + path + ": input " + std::to_string(i) + " is not a tensor");
    in_shapes.emplace_back(info->sizes().begin(), info->sizes().end());
    in_types.push_back(info->scalar_type());
  }
  const bool first = in_types[0] == ScalarType::Long && in_shapes[0].size() == 2;
  const bool hidden_in = in_types[0] == ScalarType::Float && in_shapes[0].size() == 3;
  if ((!first && !hidden_in) || in_shapes[1].size() != 2 || in_shapes[1] != in_shapes[2] ||
      in_shapes[0][0] != in_shapes[1][0] || in_shapes[0][1] != in_shapes[1][1] || in_types[1] != ScalarType::Long ||
      in_types[2] != ScalarType::Long) {
    return Status(StatusCode::kInvalidArgument,
                  "program " + path + ": inputs " + shape_text(in_shapes[0]) + ", " + shape_text(in_shapes[1]) + ", " +
                      shape_text(in_shapes[2]) +
                      " are not (input_ids int64 [B,S] | hidden float32 [B,S,D], attention_mask int64 [B,S], labels int64 [B,S])");
  }
  if (expected == 4 && (in_types[3] != ScalarType::Float || in_shapes[3].size() != 3 ||
                        in_shapes[3][0] != in_shapes[1][0] || in_shapes[3][1] != in_shapes[1][1] ||
                        (hidden_in && in_shapes[3] != in_shapes[0]))) {
    return Status(StatusCode::kInvalidArgument, "program " + path + ": input 3 " + shape_text(in_shapes[3]) +
                                                    " is not grad_hidden float32 [B,S,D]");
  }
  program.is_first_ = first;
  program.batch_ = in_shapes[1][0];
  program.seq_len_ = in_shapes[1][1];
  program.hidden_size_ = hidden_in ? in_shapes[0][2] : 0;
  program.stage_index_ = stage.index;
  program.first_layer_ = stage.first_layer;
  program.last_layer_ = stage.last_layer;
  if (first != (stage.index == 0)) {
    return Status(StatusCode::kInvalidArgument, "program " + path + ": manifest says stage " +
                                                    std::to_string(stage.index) + " but its first input is " +
                                                    (first ? "input_ids" : "hidden"));
  }
  return Status();
}

Status StageProgramLoader::check_outputs(const MethodMeta& meta) {
  const size_t user_outputs = program.user_outputs();
  const size_t num_params = program.param_start_ - program.grad_start_;
  if (program.grad_start_ != user_outputs || program.param_start_ < program.grad_start_ ||
      meta.num_outputs() != program.param_start_ + num_params || fqns.size() != num_params) {
    return Status(StatusCode::kInvalidArgument,
                  "program " + path + ": outputs do not follow the stage contract (user outputs " +
                      std::to_string(program.grad_start_) + ", expected " + std::to_string(user_outputs) +
                      "; gradients " + std::to_string(num_params) + ", names " + std::to_string(fqns.size()) +
                      ", outputs " + std::to_string(meta.num_outputs()) + ")");
  }
  if (num_params != stage.params.size()) {
    return Status(StatusCode::kInvalidArgument, "program " + path + " has " + std::to_string(num_params) +
                                                    " trainable parameters, manifest " + manifest_path + " lists " +
                                                    std::to_string(stage.params.size()) +
                                                    "; the manifest belongs to another export");
  }
  // hidden output shape: (B, S, D); take D from it on stage 0.
  if (!program.is_last_) {
    auto info = meta.output_tensor_meta(0);
    if (!info.ok() || info->sizes().size() != 3 || info->scalar_type() != ScalarType::Float) {
      return Status(StatusCode::kInvalidArgument, "program " + path + ": output 0 is not hidden float32 [B,S,D]");
    }
    program.hidden_size_ = info->sizes()[2];
  }
  return Status();
}

Status StageProgramLoader::bind_parameters(const MethodMeta& meta) {
  // The parameters are outputs of the loaded method: their tensors point at
  // the program's own memory, which AdamW then updates in place.
  auto outputs = impl.module->get_outputs(kMethod);
  if (!outputs.ok() || outputs->size() != meta.num_outputs()) {
    return Status(StatusCode::kInternal, "program " + path + ": cannot read the outputs of 'forward' after loading");
  }
  for (size_t i = 0; i < fqns.size(); ++i) {
    const std::string fqn(fqns[i].toString());
    const ManifestStage::Param& expected = stage.params[i];
    if (fqn != expected.program_name) {
      return Status(StatusCode::kInvalidArgument, "program " + path + ": parameter " + std::to_string(i) + " is '" +
                                                      fqn + "', manifest " + manifest_path + " says '" +
                                                      expected.program_name + "'");
    }
    const EValue& value = (*outputs)[program.param_start_ + i];
    if (!value.isTensor() || value.toTensor().scalar_type() != ScalarType::Float) {
      return Status(StatusCode::kInvalidArgument, "program " + path + ": parameter '" + fqn + "' is not float32");
    }
    const Tensor& tensor = value.toTensor();
    std::vector<int64_t> shape(tensor.sizes().begin(), tensor.sizes().end());
    if (shape != expected.shape) {
      return Status(StatusCode::kInvalidArgument, "program " + path + ": parameter '" + fqn + "' has shape " +
                                                      shape_text(shape) + ", manifest says " +
                                                      shape_text(expected.shape));
    }
    program.params_.push_back({expected.name, shape, tensor.mutable_data_ptr<float>()});
  }
  return Status();
}

void StageProgramLoader::allocate_input_buffers() {
  // Input buffers and the tensors over them (shapes fixed by the program).
  const int64_t bs = program.batch_ * program.seq_len_;
  using executorch::extension::from_blob;
  using Sizes = std::vector<executorch::aten::SizesType>;
  const auto b = static_cast<executorch::aten::SizesType>(program.batch_);
  const auto s = static_cast<executorch::aten::SizesType>(program.seq_len_);
  if (program.is_first_) {
    impl.ids.assign(bs, 0);
    impl.tensors.push_back(from_blob(impl.ids.data(), Sizes{b, s}, ScalarType::Long));
  } else {
    impl.hidden.assign(bs * program.hidden_size_, 0.0f);
    impl.tensors.push_back(from_blob(impl.hidden.data(),
                                     Sizes{b, s, static_cast<executorch::aten::SizesType>(program.hidden_size_)},
                                     ScalarType::Float));
  }
  impl.mask.assign(bs, 1);
  impl.labels.assign(bs, -100);
  impl.tensors.push_back(from_blob(impl.mask.data(), Sizes{b, s}, ScalarType::Long));
  impl.tensors.push_back(from_blob(impl.labels.data(), Sizes{b, s}, ScalarType::Long));
  if (program.takes_gradient()) {
    impl.grad_hidden.assign(bs * program.hidden_size_, 0.0f);
    impl.tensors.push_back(from_blob(impl.grad_hidden.data(),
                                     Sizes{b, s, static_cast<executorch::aten::SizesType>(program.hidden_size_)},
                                     ScalarType::Float));
  }
  for (const TensorPtr& t : impl.tensors) impl.inputs.emplace_back(*t);
}

Result<std::unique_ptr<StageProgram>> StageProgram::load(const StageProgramOptions& options) {
  const std::string& path = options.program_path;
  if (options.threads < 0) {
    return Status(StatusCode::kInvalidArgument, "threads must be >= 0, got " + std::to_string(options.threads));
  }
  // Programs with compact frozen weights (--frozen-dtype bf16/int8) call
  // zerolock::widen; this reference keeps its kernel in static builds.
  if (!widen_kernel_linked()) return Status(StatusCode::kInternal, "the zerolock::widen kernel is not linked");
  std::unique_ptr<StageProgram> program(new StageProgram);
  program->path_ = path;
  const std::string manifest_path =
      options.manifest_path.empty() ? dir_of(path) + "/manifest.json" : options.manifest_path;
  ZL_ASSIGN_OR_RETURN(const ManifestStage stage, read_manifest_stage(manifest_path, base_of(path)));

  ZL_RETURN_IF_ERROR(use_fast_kernels());
  StageProgramLoader loader{*program, *program->impl_, path, manifest_path, stage, options, {}};
  ZL_RETURN_IF_ERROR(loader.load_module());
  ZL_RETURN_IF_ERROR(loader.read_training_indices());
  auto meta = program->impl_->module->method_meta(kMethod);
  if (!meta.ok()) return Status(StatusCode::kInvalidArgument, "program " + path + ": no method 'forward'");
  ZL_RETURN_IF_ERROR(loader.check_inputs(*meta));
  ZL_RETURN_IF_ERROR(loader.check_outputs(*meta));
  ZL_RETURN_IF_ERROR(loader.bind_parameters(*meta));
  loader.allocate_input_buffers();

  program->threads_ = apply_thread_count(options.threads);
  program->worker_ = std::thread(&StageProgram::worker_main, program.get());
  log(LogLevel::kInfo, "stage program %s (%s): stage %lld, layers %lld-%lld, B=%lld S=%lld D=%lld, %zu LoRA tensors, %lld thread(s)%s",
      path.c_str(), options.map_file ? "mapped" : "read into heap", static_cast<long long>(program->stage_index_), static_cast<long long>(program->first_layer_),
      static_cast<long long>(program->last_layer_), static_cast<long long>(program->batch_),
      static_cast<long long>(program->seq_len_), static_cast<long long>(program->hidden_size_),
      program->params_.size(), static_cast<long long>(program->threads_),
      program->is_last_ ? " (last stage: no marker)" : "");
  return program;
}

StageProgram::~StageProgram() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // A method suspended at the marker stops there (its phase 2 is not wanted).
    if (state_ == State::kSuspended) state_ = State::kStopping;
    shutdown_ = true;
  }
  changed_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void StageProgram::worker_main() {
  set_pipeline_marker_hook(&StageProgramHook::call, this);
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    changed_.wait(lock, [&] { return state_ == State::kPhase1 || shutdown_; });
    if (state_ != State::kPhase1) break;  // shutdown with nothing to run
    lock.unlock();
    auto result = impl_->module->execute(kMethod, impl_->inputs);
    lock.lock();
    impl_->exec_error = result.ok() ? Error::Ok : result.error();
    if (result.ok()) impl_->outputs = std::move(*result);
    state_ = State::kDone;
    changed_.notify_all();
  }
  lock.unlock();
  set_pipeline_marker_hook(nullptr, nullptr);
}

bool StageProgram::on_marker(const void* hidden_tensor) {
  const Tensor& hidden = *static_cast<const Tensor*>(hidden_tensor);
  std::unique_lock<std::mutex> lock(mutex_);
  ++marker_calls_;
  if (state_ != State::kPhase1 || hidden_out_ == nullptr) {
    // A second marker in one method, or a marker on a stage whose manifest
    // says it has none: do not suspend, report at the end.
    if (marker_error_.empty()) marker_error_ = "the marker fired more than once or on a stage without hidden output";
    return true;
  }
  const int64_t expected = batch_ * seq_len_ * hidden_size_;
  if (hidden.scalar_type() != ScalarType::Float || hidden.numel() != expected) {
    marker_error_ = "marker tensor has " + std::to_string(hidden.numel()) + " elements, expected B*S*D = " +
                    std::to_string(expected);
  } else {
    // The tensor lives in planned memory that later instructions may reuse:
    // copy now, while the method is stopped here.
    const float* data = hidden.const_data_ptr<float>();
    hidden_out_->assign(data, data + expected);
  }
  state_ = State::kSuspended;
  changed_.notify_all();
  changed_.wait(lock, [&] { return state_ == State::kPhase2 || state_ == State::kStopping; });
  return state_ == State::kPhase2;
}

void StageProgram::wait_done(std::unique_lock<std::mutex>& lock) {
  changed_.notify_all();
  changed_.wait(lock, [&] { return state_ == State::kDone; });
  state_ = State::kIdle;
  hidden_out_ = nullptr;
}

int64_t StageProgram::last_marker_calls() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return marker_calls_;
}

bool StageProgram::suspended() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return state_ == State::kSuspended;
}

Status StageProgram::stage_inputs(const StageInputs& inputs) {
  const size_t bs = static_cast<size_t>(batch_ * seq_len_);
  if (inputs.attention_mask == nullptr || inputs.labels == nullptr ||
      (is_first_ ? inputs.input_ids == nullptr : inputs.hidden == nullptr)) {
    return Status(StatusCode::kInvalidArgument,
                  std::string("stage inputs need ") + (is_first_ ? "input_ids" : "hidden") + ", attention_mask and labels");
  }
  if (is_first_) {
    std::memcpy(impl_->ids.data(), inputs.input_ids, bs * sizeof(int64_t));
  } else {
    std::memcpy(impl_->hidden.data(), inputs.hidden, impl_->hidden.size() * sizeof(float));
  }
  std::memcpy(impl_->mask.data(), inputs.attention_mask, bs * sizeof(int64_t));
  std::memcpy(impl_->labels.data(), inputs.labels, bs * sizeof(int64_t));
  if (takes_gradient()) {
    if (inputs.grad_hidden != nullptr) {
      std::memcpy(impl_->grad_hidden.data(), inputs.grad_hidden, impl_->grad_hidden.size() * sizeof(float));
    } else {
      std::fill(impl_->grad_hidden.begin(), impl_->grad_hidden.end(), 0.0f);
    }
  }
  return Status();
}

Status StageProgram::begin(const StageInputs& inputs, std::vector<float>* hidden) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (state_ != State::kIdle) {
    return Status(StatusCode::kInvalidArgument, "begin() while a step is in progress; call finish() first");
  }
  ZL_RETURN_IF_ERROR(stage_inputs(inputs));
  marker_calls_ = 0;
  marker_error_.clear();
  if (hidden != nullptr) hidden->clear();
  if (is_last_) {
    hidden_out_ = nullptr;
    state_ = State::kDeferred;
    return Status();
  }
  if (hidden == nullptr) return Status(StatusCode::kInvalidArgument, "begin() needs a hidden buffer on this stage");
  hidden_out_ = hidden;
  state_ = State::kPhase1;
  changed_.notify_all();
  changed_.wait(lock, [&] { return state_ == State::kSuspended || state_ == State::kDone; });
  if (state_ == State::kDone) {
    // Ended (or failed) without ever reaching the marker.
    state_ = State::kIdle;
    hidden_out_ = nullptr;
    if (impl_->exec_error != Error::Ok) {
      return Status(StatusCode::kInternal, "program " + path_ + ": 'forward' failed before the marker (" +
                                               error_name(impl_->exec_error) + ")");
    }
    return Status(StatusCode::kInternal,
                  "program " + path_ + ": 'forward' ran to its end without the pipeline marker firing; is the "
                  "zerolock::pipeline_marker kernel of libzl_custom_ops the one registered?");
  }
  if (!marker_error_.empty()) {
    return Status(StatusCode::kInternal, "program " + path_ + ": " + marker_error_);
  }
  return Status();
}

Result<StageStepResult> StageProgram::finish() {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (state_ == State::kDeferred) {
      state_ = State::kPhase1;
    } else if (state_ == State::kSuspended) {
      state_ = State::kPhase2;
    } else {
      return Status(StatusCode::kInvalidArgument, "finish() without a successful begin()");
    }
    wait_done(lock);
    if (impl_->exec_error != Error::Ok) {
      return Status(StatusCode::kInternal, "program " + path_ + ": 'forward' failed after the marker (" +
                                               error_name(impl_->exec_error) + ")");
    }
    if (!marker_error_.empty()) return Status(StatusCode::kInternal, "program " + path_ + ": " + marker_error_);
  }
  return collect(nullptr);
}

Result<StageStepResult> StageProgram::finish(const float* grad_hidden) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!takes_gradient()) {
      return Status(StatusCode::kInvalidArgument, "finish(grad_hidden) on a program that takes no gradient");
    }
    if (grad_hidden == nullptr) return Status(StatusCode::kInvalidArgument, "finish(grad_hidden) without a gradient");
    if (state_ != State::kSuspended) {
      return Status(StatusCode::kInvalidArgument, "finish(grad_hidden) without a begin() suspended at the marker");
    }
    // The worker is parked in the marker kernel: the method's memory is not being touched.
    float* planned = impl_->module->planned_input(kMethod, 3);
    if (planned == nullptr) {
      return Status(StatusCode::kInternal, "program " + path_ + ": no grad_hidden input to write");
    }
    std::memcpy(planned, grad_hidden, impl_->grad_hidden.size() * sizeof(float));
  }
  return finish();
}

Status StageProgram::abandon() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (state_ == State::kDeferred) {  // the last stage: nothing ran yet
    state_ = State::kIdle;
    return Status();
  }
  if (state_ != State::kSuspended) {
    return Status(StatusCode::kInvalidArgument, "abandon() without a successful begin()");
  }
  state_ = State::kStopping;
  wait_done(lock);
  if (impl_->exec_error != kPipelineMarkerStopped) {
    return Status(StatusCode::kInternal,
                  "program " + path_ + ": 'forward' was to stop at the pipeline marker but " +
                      (impl_->exec_error == Error::Ok ? std::string("ran to its end")
                                                      : "failed (" + error_name(impl_->exec_error) + ")"));
  }
  return Status();
}

Result<StageStepResult> StageProgram::run(const StageInputs& inputs, std::vector<float>* hidden) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (state_ != State::kIdle) {
      return Status(StatusCode::kInvalidArgument, "run() while a step is in progress; call finish() first");
    }
    ZL_RETURN_IF_ERROR(stage_inputs(inputs));
  }
  // The caller's thread has no marker hook of ours; the worker is idle, so the
  // Module is not shared.
  auto out = impl_->module->execute(kMethod, impl_->inputs);
  if (!out.ok()) {
    return Status(StatusCode::kInternal, "program " + path_ + ": 'forward' failed (" + error_name(out.error()) + ")");
  }
  impl_->outputs = std::move(*out);
  return collect(hidden);
}

Result<StageStepResult> StageProgram::collect(std::vector<float>* hidden_from_output) {
  const std::vector<EValue>& outputs = impl_->outputs;
  if (outputs.size() != param_start_ + params_.size()) {
    return Status(StatusCode::kInternal, "program " + path_ + ": 'forward' returned " +
                                             std::to_string(outputs.size()) + " outputs");
  }
  // User outputs (docs/design#program-inputs-outputs): [hidden,] loss, task_loss, consistency_loss; a
  // backprop program's (docs/design#backprop-program): [hidden,] loss, [local_loss,] [grad_input].
  const size_t loss_at = is_last_ ? 0 : 1;
  const size_t num_losses = backprop_ ? (local_loss_ ? 2 : 1) : 3;
  double losses[3] = {0, 0, 0};
  for (size_t k = 0; k < num_losses; ++k) {
    const EValue& v = outputs[loss_at + k];
    if (!v.isTensor() || v.toTensor().scalar_type() != ScalarType::Float || v.toTensor().numel() != 1) {
      return Status(StatusCode::kInternal, "program " + path_ + ": loss output " + std::to_string(loss_at + k) +
                                               " is not a float32 scalar");
    }
    losses[k] = v.toTensor().const_data_ptr<float>()[0];
  }
  if (hidden_from_output != nullptr) {
    hidden_from_output->clear();
    if (!is_last_) {
      const Tensor& h = outputs[0].toTensor();
      hidden_from_output->assign(h.const_data_ptr<float>(), h.const_data_ptr<float>() + h.numel());
    }
  }
  StageStepResult result;
  result.loss = losses[0];
  result.task_loss = backprop_ ? (is_last_ ? losses[0] : losses[1]) : losses[1];
  result.consistency_loss = losses[2];
  if (gives_gradient()) {
    const EValue& g = outputs[grad_start_ - 1];  // the last user output
    if (!g.isTensor() || g.toTensor().scalar_type() != ScalarType::Float ||
        g.toTensor().numel() != batch_ * seq_len_ * hidden_size_) {
      return Status(StatusCode::kInternal, "program " + path_ + ": grad_input is not float32 [B,S,D]");
    }
    result.grad_input = g.toTensor().const_data_ptr<float>();
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    const EValue& g = outputs[grad_start_ + i];
    const EValue& p = outputs[param_start_ + i];
    if (!g.isTensor() || g.toTensor().numel() != static_cast<ssize_t>(params_[i].numel()) ||
        g.toTensor().scalar_type() != ScalarType::Float) {
      return Status(StatusCode::kInternal, "program " + path_ + ": gradient of '" + params_[i].name +
                                               "' has the wrong size or dtype");
    }
    // AdamW writes through params_[i].data; it must still be the tensor the
    // method reads, or updates would silently be lost.
    if (!p.isTensor() || p.toTensor().const_data_ptr<float>() != params_[i].data) {
      return Status(StatusCode::kInternal, "program " + path_ + ": parameter '" + params_[i].name +
                                               "' moved in memory; in-place updates would be lost");
    }
    result.gradients.push_back(g.toTensor().const_data_ptr<float>());
  }
  return result;
}

}  // namespace zl
