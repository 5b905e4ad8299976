// ExecuTorch kernel of `zerolock::pipeline_marker.out`; see
// include/zl/pipeline_marker.h for the contract and pipeline_marker.py for
// the AOT schema it implements.
#include <zl/pipeline_marker.h>

#include <atomic>
#include <cstring>

#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/core/exec_aten/util/scalar_type_util.h>
#include <executorch/runtime/core/exec_aten/util/tensor_util.h>
#include <executorch/runtime/platform/log.h>

namespace zl {
namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

struct InstalledHook {
  PipelineMarkerHook hook = nullptr;
  void* user_data = nullptr;
};

// One per thread: the hook fires on the thread that runs Method::execute.
thread_local InstalledHook installed_hook;

// Process-wide, any thread; relaxed because it is only a statistic.
std::atomic<uint64_t> call_count{0};

} // namespace

PipelineMarkerHook set_pipeline_marker_hook(
    PipelineMarkerHook hook,
    void* user_data) {
  PipelineMarkerHook previous = installed_hook.hook;
  installed_hook.hook = hook;
  installed_hook.user_data = hook != nullptr ? user_data : nullptr;
  return previous;
}

Tensor& pipeline_marker_out(
    KernelRuntimeContext& ctx,
    const Tensor& hidden,
    Tensor& out) {
  // The stage contract sends float32 hidden states only; any other dtype
  // means the program was exported wrongly, so fail the method loudly.
  ET_KERNEL_CHECK_MSG(
      ctx,
      hidden.scalar_type() == ScalarType::Float,
      InvalidArgument,
      out,
      "pipeline_marker: hidden must be float32, got %s",
      executorch::runtime::toString(hidden.scalar_type()));
  ET_KERNEL_CHECK_MSG(
      ctx,
      out.scalar_type() == hidden.scalar_type(),
      InvalidArgument,
      out,
      "pipeline_marker: out dtype %s differs from hidden dtype %s",
      executorch::runtime::toString(out.scalar_type()),
      executorch::runtime::toString(hidden.scalar_type()));
  // Memory-planned outputs are usually STATIC: resizing to the same shape is
  // a no-op and to another shape fails, which is the shape check.
  ET_KERNEL_CHECK_MSG(
      ctx,
      executorch::runtime::resize_tensor(out, hidden.sizes()) == Error::Ok,
      InvalidArgument,
      out,
      "pipeline_marker: cannot resize out (dim %zd, numel %zd) to hidden's "
      "shape (dim %zd, numel %zd)",
      static_cast<ssize_t>(out.dim()),
      static_cast<ssize_t>(out.numel()),
      static_cast<ssize_t>(hidden.dim()),
      static_cast<ssize_t>(hidden.numel()));
  ET_KERNEL_CHECK(
      ctx,
      executorch::runtime::tensors_have_same_dim_order(hidden, out),
      InvalidArgument,
      out);

  const size_t nbytes = hidden.nbytes();
  if (nbytes > 0) {
    ET_KERNEL_CHECK_MSG(
        ctx,
        out.mutable_data_ptr() != nullptr &&
            hidden.const_data_ptr() != nullptr,
        InvalidArgument,
        out,
        "pipeline_marker: hidden or out has no data (%zu bytes expected)",
        nbytes);
    if (out.mutable_data_ptr() != hidden.const_data_ptr()) {
      std::memcpy(out.mutable_data_ptr(), hidden.const_data_ptr(), nbytes);
    }
  }

  call_count.fetch_add(1, std::memory_order_relaxed);
  // Copied before the call so a hook that reinstalls itself (or another
  // hook) does not change what this call passes.
  const InstalledHook current = installed_hook;
  if (current.hook != nullptr) {
    current.hook(out, current.user_data);
  }
  return out;
}

} // namespace zl

extern "C" uint64_t zl_pipeline_marker_call_count(void) {
  return zl::call_count.load(std::memory_order_relaxed);
}

// Registers at library load time (static initializer). The name must match
// the `.out` schema in pipeline_marker.py, which is what to_executorch writes
// into the program's operator table.
EXECUTORCH_LIBRARY(zerolock, "pipeline_marker.out", zl::pipeline_marker_out);
