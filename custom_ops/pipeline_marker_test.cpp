// Tests of the `zerolock::pipeline_marker.out` kernel and its thread-local
// hook: one test per behaviour or failure mode. The kernel is called directly
// with TensorImpl-backed tensors (extension/tensor), through the operator
// registry, and (when ZL_MARKER_TEST_PTE names a program) inside a real
// Module::execute.
#include <zl/executorch_version.h>
#include <zl/fast_kernels.h>
#include <zl/pipeline_marker.h>

#include <cstdlib>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>
#include <executorch/runtime/core/evalue.h>
#include <executorch/runtime/kernel/operator_registry.h>
#include <executorch/runtime/platform/log.h>

namespace {

using executorch::aten::ScalarType;
using executorch::aten::SizesType;
using executorch::aten::Tensor;
using executorch::aten::TensorShapeDynamism;
using executorch::extension::make_tensor_ptr;
using executorch::extension::TensorPtr;
using executorch::runtime::Error;
using executorch::runtime::EValue;
using executorch::runtime::KernelRuntimeContext;

constexpr const char* kOpName = "zerolock::pipeline_marker.out";

/// What a hook saw on one call.
struct HookRecord {
  int calls = 0;
  std::thread::id thread;
  std::vector<float> data;
  std::vector<SizesType> sizes;
  const void* data_ptr = nullptr;
};

void record_call(const Tensor& hidden, HookRecord* record) {
  record->calls += 1;
  record->thread = std::this_thread::get_id();
  const float* begin = hidden.const_data_ptr<float>();
  record->data.assign(begin, begin + hidden.numel());
  record->sizes.assign(hidden.sizes().begin(), hidden.sizes().end());
  record->data_ptr = hidden.const_data_ptr();
}

zl::PipelineMarkerAction recording_hook(const Tensor& hidden, void* user_data) {
  record_call(hidden, static_cast<HookRecord*>(user_data));
  return zl::PipelineMarkerAction::kContinue;
}

/// Records like recording_hook, then asks the method to stop at the marker.
zl::PipelineMarkerAction stopping_hook(const Tensor& hidden, void* user_data) {
  record_call(hidden, static_cast<HookRecord*>(user_data));
  return zl::PipelineMarkerAction::kStop;
}

zl::PipelineMarkerAction other_hook(const Tensor&, void* user_data) {
  static_cast<HookRecord*>(user_data)->calls += 100;
  return zl::PipelineMarkerAction::kContinue;
}

/// (2, 3, 4) float32 with values 0.5 * i, so a missed or partial copy shows.
TensorPtr make_hidden() {
  std::vector<float> values(2 * 3 * 4);
  for (size_t i = 0; i < values.size(); ++i) {
    values[i] = 0.5f * static_cast<float>(i) - 3.0f;
  }
  return make_tensor_ptr({2, 3, 4}, std::move(values));
}

/// Zero-filled float32 `out` of the given shape and dynamism; -1 sentinel
/// values would work as well, zeros differ from every hidden value but one.
TensorPtr make_out(
    std::vector<SizesType> sizes,
    TensorShapeDynamism dynamism = TensorShapeDynamism::STATIC) {
  const size_t numel = std::accumulate(
      sizes.begin(), sizes.end(), size_t{1}, std::multiplies<size_t>());
  return make_tensor_ptr(
      std::move(sizes),
      std::vector<float>(numel, -7.0f),
      {},
      {},
      ScalarType::Float,
      dynamism);
}

std::vector<float> values_of(const Tensor& t) {
  const float* begin = t.const_data_ptr<float>();
  return std::vector<float>(begin, begin + t.numel());
}

std::vector<SizesType> sizes_of(const Tensor& t) {
  return std::vector<SizesType>(t.sizes().begin(), t.sizes().end());
}

class PipelineMarkerTest : public ::testing::Test {
 protected:
  // The hook is thread-local and the tests share the main thread.
  void SetUp() override {
    zl::set_pipeline_marker_hook(nullptr, nullptr);
  }
  void TearDown() override {
    zl::set_pipeline_marker_hook(nullptr, nullptr);
  }
};

TEST_F(PipelineMarkerTest, RegisteredUnderTheProgramsOperatorName) {
  EXPECT_TRUE(executorch::runtime::registry_has_op_function(kOpName));
}

TEST_F(PipelineMarkerTest, CopiesHiddenIntoOut) {
  TensorPtr hidden = make_hidden();
  TensorPtr out = make_out({2, 3, 4});
  KernelRuntimeContext ctx;

  Tensor& result = zl::pipeline_marker_out(ctx, *hidden, *out);

  EXPECT_EQ(ctx.failure_state(), Error::Ok);
  EXPECT_EQ(&result, out.get());
  EXPECT_EQ(values_of(*out), values_of(*hidden));
  // A copy, not an alias: the runner may keep the marker output while the
  // method overwrites the chunk output's buffer.
  EXPECT_NE(out->const_data_ptr(), hidden->const_data_ptr());
}

TEST_F(PipelineMarkerTest, ResizesDynamicOutToHiddenShape) {
  TensorPtr hidden = make_hidden();
  TensorPtr out = make_out({2, 3, 8}, TensorShapeDynamism::DYNAMIC_BOUND);
  KernelRuntimeContext ctx;

  zl::pipeline_marker_out(ctx, *hidden, *out);

  EXPECT_EQ(ctx.failure_state(), Error::Ok);
  EXPECT_EQ(sizes_of(*out), (std::vector<SizesType>{2, 3, 4}));
  EXPECT_EQ(values_of(*out), values_of(*hidden));
}

TEST_F(PipelineMarkerTest, HookFiresOnExecutingThreadWithCopiedData) {
  TensorPtr hidden = make_hidden();
  TensorPtr out = make_out({2, 3, 4});
  HookRecord record;
  zl::set_pipeline_marker_hook(recording_hook, &record);
  KernelRuntimeContext ctx;

  zl::pipeline_marker_out(ctx, *hidden, *out);

  ASSERT_EQ(ctx.failure_state(), Error::Ok);
  EXPECT_EQ(record.calls, 1);
  EXPECT_EQ(record.thread, std::this_thread::get_id());
  EXPECT_EQ(record.data, values_of(*hidden));
  EXPECT_EQ(record.sizes, (std::vector<SizesType>{2, 3, 4}));
  // The hook sees the marker's output, which outlives the chunk's buffers.
  EXPECT_EQ(record.data_ptr, out->const_data_ptr());
}

TEST_F(PipelineMarkerTest, WithoutHookOnlyCopies) {
  TensorPtr hidden = make_hidden();
  TensorPtr out = make_out({2, 3, 4});
  HookRecord record;
  zl::set_pipeline_marker_hook(recording_hook, &record);
  zl::set_pipeline_marker_hook(nullptr, nullptr);
  const uint64_t calls_before = zl_pipeline_marker_call_count();
  KernelRuntimeContext ctx;

  zl::pipeline_marker_out(ctx, *hidden, *out);

  EXPECT_EQ(ctx.failure_state(), Error::Ok);
  EXPECT_EQ(record.calls, 0);
  EXPECT_EQ(values_of(*out), values_of(*hidden));
  EXPECT_EQ(zl_pipeline_marker_call_count(), calls_before + 1);
}

TEST_F(PipelineMarkerTest, SetHookReturnsThePreviousHook) {
  HookRecord record;
  EXPECT_EQ(zl::set_pipeline_marker_hook(recording_hook, &record), nullptr);
  EXPECT_EQ(zl::set_pipeline_marker_hook(other_hook, &record), recording_hook);
  EXPECT_EQ(zl::set_pipeline_marker_hook(nullptr, nullptr), other_hook);
  EXPECT_EQ(zl::set_pipeline_marker_hook(nullptr, nullptr), nullptr);
}

TEST_F(PipelineMarkerTest, HookIsThreadLocal) {
  TensorPtr hidden = make_hidden();
  HookRecord main_record;
  HookRecord worker_record;
  zl::set_pipeline_marker_hook(recording_hook, &main_record);

  std::thread::id worker_id;
  Error worker_without_hook = Error::Internal;
  Error worker_with_hook = Error::Internal;
  std::thread worker([&] {
    worker_id = std::this_thread::get_id();
    TensorPtr out = make_out({2, 3, 4});
    KernelRuntimeContext ctx_a;
    // The main thread's hook must not fire here.
    zl::pipeline_marker_out(ctx_a, *hidden, *out);
    worker_without_hook = ctx_a.failure_state();
    EXPECT_EQ(zl::set_pipeline_marker_hook(recording_hook, &worker_record),
              nullptr);
    KernelRuntimeContext ctx_b;
    zl::pipeline_marker_out(ctx_b, *hidden, *out);
    worker_with_hook = ctx_b.failure_state();
  });
  worker.join();

  EXPECT_EQ(worker_without_hook, Error::Ok);
  EXPECT_EQ(worker_with_hook, Error::Ok);
  EXPECT_EQ(main_record.calls, 0);
  EXPECT_EQ(worker_record.calls, 1);
  EXPECT_EQ(worker_record.thread, worker_id);

  // The worker's install did not replace the main thread's hook.
  TensorPtr out = make_out({2, 3, 4});
  KernelRuntimeContext ctx;
  zl::pipeline_marker_out(ctx, *hidden, *out);
  EXPECT_EQ(main_record.calls, 1);
  EXPECT_EQ(main_record.thread, std::this_thread::get_id());
  EXPECT_EQ(worker_record.calls, 1);
}

TEST_F(PipelineMarkerTest, OutDtypeMismatchFailsThroughContext) {
  TensorPtr hidden = make_hidden();
  TensorPtr out = make_tensor_ptr(
      {2, 3, 4}, std::vector<double>(24, -7.0), {}, {}, ScalarType::Double,
      TensorShapeDynamism::STATIC);
  HookRecord record;
  zl::set_pipeline_marker_hook(recording_hook, &record);
  KernelRuntimeContext ctx;

  zl::pipeline_marker_out(ctx, *hidden, *out);

  EXPECT_EQ(ctx.failure_state(), Error::InvalidArgument);
  EXPECT_EQ(record.calls, 0);
  EXPECT_EQ(out->const_data_ptr<double>()[0], -7.0);
}

TEST_F(PipelineMarkerTest, NonFloatHiddenFailsThroughContext) {
  // Same dtype on both sides, but the stage contract is float32 only.
  TensorPtr hidden = make_tensor_ptr({2, 2}, std::vector<double>{1, 2, 3, 4});
  TensorPtr out = make_tensor_ptr(
      {2, 2}, std::vector<double>(4, -7.0), {}, {}, ScalarType::Double,
      TensorShapeDynamism::STATIC);
  KernelRuntimeContext ctx;

  zl::pipeline_marker_out(ctx, *hidden, *out);

  EXPECT_EQ(ctx.failure_state(), Error::InvalidArgument);
  EXPECT_EQ(out->const_data_ptr<double>()[0], -7.0);
}

TEST_F(PipelineMarkerTest, StaticOutShapeMismatchFailsThroughContext) {
  TensorPtr hidden = make_hidden();
  TensorPtr out = make_out({2, 3, 5}, TensorShapeDynamism::STATIC);
  HookRecord record;
  zl::set_pipeline_marker_hook(recording_hook, &record);
  KernelRuntimeContext ctx;

  zl::pipeline_marker_out(ctx, *hidden, *out);

  EXPECT_EQ(ctx.failure_state(), Error::InvalidArgument);
  EXPECT_EQ(record.calls, 0);
  EXPECT_EQ(sizes_of(*out), (std::vector<SizesType>{2, 3, 5}));
  EXPECT_EQ(values_of(*out), std::vector<float>(30, -7.0f));
}

TEST_F(PipelineMarkerTest, OutTooSmallForHiddenFailsThroughContext) {
  // DYNAMIC_BOUND may shrink but never grow past its allocation.
  TensorPtr hidden = make_hidden();
  TensorPtr out = make_out({2, 3, 2}, TensorShapeDynamism::DYNAMIC_BOUND);
  KernelRuntimeContext ctx;

  zl::pipeline_marker_out(ctx, *hidden, *out);

  EXPECT_EQ(ctx.failure_state(), Error::InvalidArgument);
  EXPECT_EQ(sizes_of(*out), (std::vector<SizesType>{2, 3, 2}));
}

TEST_F(PipelineMarkerTest, UnallocatedOutFailsThroughContext) {
  TensorPtr hidden = make_hidden();
#if ZL_EXECUTORCH_BEFORE_1_5_1
  // Before 1.5.1 (tools/build_phone_runner.sh on a 1.5.0 tree) the device came last.
  TensorPtr out = make_tensor_ptr({2, 3, 4}, nullptr, ScalarType::Float, TensorShapeDynamism::STATIC);
#else
  TensorPtr out = make_tensor_ptr(
      {2, 3, 4}, nullptr, ScalarType::Float,
      executorch::aten::Device(executorch::aten::DeviceType::CPU),
      TensorShapeDynamism::STATIC);
#endif
  KernelRuntimeContext ctx;

  zl::pipeline_marker_out(ctx, *hidden, *out);

  EXPECT_EQ(ctx.failure_state(), Error::InvalidArgument);
}

TEST_F(PipelineMarkerTest, StoppingHookFailsTheCallWithTheStopError) {
  TensorPtr hidden = make_hidden();
  TensorPtr out = make_out({2, 3, 4});
  HookRecord record;
  zl::set_pipeline_marker_hook(stopping_hook, &record);
  const uint64_t calls_before = zl_pipeline_marker_call_count();
  KernelRuntimeContext ctx;

  Tensor& result = zl::pipeline_marker_out(ctx, *hidden, *out);

  // The stop is a failure of the call (it ends Method::execute there), with
  // its own code; the copy was made and the hook saw it first.
  EXPECT_EQ(ctx.failure_state(), zl::kPipelineMarkerStopped);
  EXPECT_EQ(&result, out.get());
  EXPECT_EQ(record.calls, 1);
  EXPECT_EQ(record.data, values_of(*hidden));
  EXPECT_EQ(values_of(*out), values_of(*hidden));
  EXPECT_EQ(zl_pipeline_marker_call_count(), calls_before + 1);
}

// The runtime logs a failed kernel call as "KernelCall failed at instruction
// C:I in operator <name>.<overload>: 0x<code>" and one "arg N with type id T"
// line per argument. After a stop, exactly those lines of the stop are left
// out; a genuine failure's lines and every other line still reach the log.
TEST_F(PipelineMarkerTest, StopKeepsOnlyItsOwnFailureLinesOutOfTheLog) {
  TensorPtr hidden = make_hidden();
  TensorPtr out = make_out({2, 3, 4});
  HookRecord record;
  zl::set_pipeline_marker_hook(stopping_hook, &record);
  const unsigned stop_code = static_cast<unsigned>(zl::kPipelineMarkerStopped);

  testing::internal::CaptureStderr();
  KernelRuntimeContext ctx;
  zl::pipeline_marker_out(ctx, *hidden, *out);
  ET_LOG(Error, "KernelCall failed at instruction 0:7 in operator zerolock::pipeline_marker.out: 0x%x", stop_code);
  ET_LOG(Error, "arg %u with type id %u", 0u, 1u);
  ET_LOG(Error, "arg %u with type id %u", 1u, 1u);
  ET_LOG(Error, "arg %u with type id %u", 2u, 1u);
  ET_LOG(Error, "after the stop %d", 1);
  ET_LOG(Error, "arg %u with type id %u", 3u, 1u);  // no longer part of the stop's lines
  KernelRuntimeContext ctx_bad;
  zl::pipeline_marker_out(ctx_bad, *hidden, *out);  // stops again: the filter is armed again
  ET_LOG(Error, "KernelCall failed at instruction 0:7 in operator zerolock::pipeline_marker.out: 0x%x", 0x12u);
  const std::string log = testing::internal::GetCapturedStderr();

  ASSERT_EQ(ctx.failure_state(), zl::kPipelineMarkerStopped);
  EXPECT_EQ(log.find("0x" + std::to_string(stop_code) + "\n"), std::string::npos) << log;
  EXPECT_EQ(log.find("arg 0 with type id"), std::string::npos) << log;
  EXPECT_EQ(log.find("arg 2 with type id"), std::string::npos) << log;
  EXPECT_NE(log.find("after the stop 1"), std::string::npos) << log;
  EXPECT_NE(log.find("arg 3 with type id"), std::string::npos) << log;
  EXPECT_NE(log.find("pipeline_marker.out: 0x12"), std::string::npos) << log;
}

TEST_F(PipelineMarkerTest, BoxedCallThroughRegistryCopiesAndFiresHook) {
  // The path Method::execute takes: look up by name, call with EValues
  // (hidden, out, return value aliasing out).
  auto op = executorch::runtime::get_op_function_from_registry(kOpName);
  ASSERT_TRUE(op.ok());
  TensorPtr hidden = make_hidden();
  TensorPtr out = make_out({2, 3, 4});
  HookRecord record;
  zl::set_pipeline_marker_hook(recording_hook, &record);
  EValue values[] = {EValue(*hidden), EValue(*out), EValue(*out)};
  EValue* stack[] = {&values[0], &values[1], &values[2]};
  KernelRuntimeContext ctx;

  (*op.get())(ctx, executorch::runtime::Span<EValue*>(stack, 3));

  EXPECT_EQ(ctx.failure_state(), Error::Ok);
  EXPECT_EQ(values_of(*out), values_of(*hidden));
  EXPECT_EQ(record.calls, 1);
}

/// Inputs for every input of `meta`'s method: floats 0.25, integers 1 (a
/// valid token id, attention-mask value and label for the stage programs).
/// `storage` keeps the tensors alive.
std::vector<EValue> inputs_of(
    const executorch::runtime::MethodMeta& meta,
    std::vector<TensorPtr>* storage) {
  std::vector<EValue> values;
  for (size_t i = 0; i < meta.num_inputs(); ++i) {
    auto info = meta.input_tensor_meta(i);
    EXPECT_TRUE(info.ok()) << "input " << i << " is not a tensor";
    if (!info.ok()) return {};
    std::vector<SizesType> sizes(info->sizes().begin(), info->sizes().end());
    const size_t numel = std::accumulate(
        sizes.begin(), sizes.end(), size_t{1}, std::multiplies<size_t>());
    if (info->scalar_type() == ScalarType::Float) {
      storage->push_back(make_tensor_ptr(sizes, std::vector<float>(numel, 0.25f)));
    } else if (info->scalar_type() == ScalarType::Long) {
      storage->push_back(make_tensor_ptr(sizes, std::vector<int64_t>(numel, 1)));
    } else {
      ADD_FAILURE() << "input " << i << " has unsupported dtype "
                    << executorch::runtime::toString(info->scalar_type());
      return {};
    }
    values.emplace_back(*storage->back());
  }
  return values;
}

/// The float values of every tensor output, in order (copies: the outputs
/// live in the method's memory, which the next execution overwrites).
std::vector<std::vector<float>> float_outputs(const std::vector<EValue>& outputs) {
  std::vector<std::vector<float>> values;
  for (const EValue& v : outputs) {
    if (v.isTensor() && v.toTensor().scalar_type() == ScalarType::Float) {
      values.push_back(values_of(v.toTensor()));
    }
  }
  return values;
}

const char* marker_test_pte() {
  const char* pte = std::getenv("ZL_MARKER_TEST_PTE");
  return pte != nullptr && *pte != '\0' ? pte : nullptr;
}

// The .pte of ZL_MARKER_TEST_PTE loaded, with inputs for its "forward".
struct MarkerProgram {
  explicit MarkerProgram(const char* pte) : path(pte), module(pte) {}

  void prepare_inputs() {
    auto meta = module.method_meta("forward");
    ASSERT_TRUE(meta.ok()) << "cannot load " << path;
    values = inputs_of(*meta, &inputs);
    ASSERT_EQ(values.size(), meta->num_inputs());
  }

  const char* path;
  executorch::extension::Module module;
  std::vector<TensorPtr> inputs;
  std::vector<EValue> values;
};

// The tests on a real program: skipped without ZL_MARKER_TEST_PTE.
class PipelineMarkerProgramTest : public PipelineMarkerTest {
 protected:
  void SetUp() override {
    PipelineMarkerTest::SetUp();
    const char* pte = marker_test_pte();
    if (pte == nullptr) {
      GTEST_SKIP() << "set ZL_MARKER_TEST_PTE to a .pte whose first output is "
                      "the pipeline marker's";
    }
    // A selective ExecuTorch build (the phone binary, tools/build_phone_runner.sh)
    // has no aten::linear.out of its own: zl's fast kernels supply it, as they
    // do in the runner.
    if (!executorch::runtime::registry_has_op_function("aten::linear.out")) {
      const zl::FastKernelsRegistration registered = zl::register_fast_kernels();
      ASSERT_TRUE(registered.ok) << registered.error;
    }
    program_ = std::make_unique<MarkerProgram>(pte);
    ASSERT_NO_FATAL_FAILURE(program_->prepare_inputs());
  }

  // One execution of the program's "forward" with `hook` installed.
  auto execute(zl::PipelineMarkerHook hook, HookRecord* record) {
    zl::set_pipeline_marker_hook(hook, record);
    return program_->module.execute("forward", program_->values);
  }

  std::unique_ptr<MarkerProgram> program_;
};

// The early-forwarding contract inside a real program: the hook fires during
// Module::execute, on this thread, once, with what becomes user output 0.
// Needs a .pte whose first output is the marker's; tests/test_custom_ops.py
// writes one and runs this test with ZL_MARKER_TEST_PTE set.
TEST_F(PipelineMarkerProgramTest, ModuleExecuteFiresHookWithFirstOutput) {
  HookRecord record;
  auto outputs = execute(recording_hook, &record);

  ASSERT_TRUE(outputs.ok()) << "execute failed: "
                            << static_cast<int>(outputs.error());
  EXPECT_EQ(record.calls, 1);
  EXPECT_EQ(record.thread, std::this_thread::get_id());
  ASSERT_TRUE((*outputs)[0].isTensor());
  const Tensor& first = (*outputs)[0].toTensor();
  EXPECT_EQ(record.sizes, sizes_of(first));
  EXPECT_EQ(record.data, values_of(first));
}

// A stop ends Module::execute at the marker with kPipelineMarkerStopped, and
// leaves the method fit to run again: after many stopped executions a whole
// one gives bit for bit what the first (on the freshly loaded program) gave.
// The runtime's lines about the stopped kernel stay out of the log.
TEST_F(PipelineMarkerProgramTest, ModuleExecuteStoppedAtTheMarkerRunsAgainUnchanged) {
  HookRecord whole;
  auto fresh = execute(recording_hook, &whole);
  ASSERT_TRUE(fresh.ok()) << static_cast<int>(fresh.error());
  const std::vector<std::vector<float>> expected = float_outputs(*fresh);
  ASSERT_GE(expected.size(), 2u) << "expected the marker's output and a loss";

  HookRecord stopped;
  constexpr int kStops = 20;
  testing::internal::CaptureStderr();
  for (int i = 0; i < kStops; ++i) {
    auto result = execute(stopping_hook, &stopped);
    ASSERT_FALSE(result.ok()) << "a stopped method returned outputs";
    ASSERT_EQ(result.error(), zl::kPipelineMarkerStopped) << "execution " << i;
    ASSERT_EQ(stopped.data, whole.data) << "execution " << i;
  }
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(stopped.calls, kStops);
  EXPECT_EQ(log.find("KernelCall failed"), std::string::npos) << log;
  EXPECT_EQ(log.find("with type id"), std::string::npos) << log;

  HookRecord again;
  auto after = execute(recording_hook, &again);
  ASSERT_TRUE(after.ok()) << "execute after stops failed: "
                          << static_cast<int>(after.error());
  EXPECT_EQ(again.calls, 1);
  EXPECT_EQ(float_outputs(*after), expected);
}

} // namespace
