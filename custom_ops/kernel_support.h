// What zl's fast kernels share (fast_kernels.cpp, layout_kernels.cpp):
// their registration entries, kernel keys, and the checks and fallbacks
// every kernel makes. Private to the kernel library.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include <executorch/runtime/core/evalue.h>
#include <executorch/runtime/core/exec_aten/util/tensor_util.h>
#include <executorch/runtime/kernel/kernel_runtime_context.h>
#include <executorch/runtime/kernel/operator_registry.h>
#include <executorch/runtime/platform/log.h>

namespace zl::kernels {

using executorch::aten::ScalarType;
using executorch::aten::SizesType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::EValue;
using executorch::runtime::KernelRuntimeContext;
using executorch::runtime::OpFunction;
using executorch::runtime::Span;

/// One operator's kernel: the ExecuTorch operator it serves, the kernel keys
/// it registers under, and where registration stores the operator's
/// fallback kernel (the one already registered) for calls it declines.
struct KernelSpec {
  const char* op;
  std::vector<std::string> keys;
  OpFunction fn;
  OpFunction* fallback;
};

/// The kernel key of a call whose tensor arguments (inputs, `out`, and `out`
/// again as the returned value; an absent optional tensor has no entry) are
/// float32 tensors of these ranks in the default dim order:
/// "v1/6;0,1|6;0,1|..." (6 is float32's ScalarType).
std::string float_key(std::initializer_list<int> ranks);

/// Counts one call of a zl kernel (the statistic behind
/// zl::fast_kernel_call_count).
void count_call();

/// Elements per thread-pool task of an elementwise kernel.
constexpr int64_t kGrain = 1 << 14;

/// Sum in a fixed order (16 lanes, the lanes in turn, the tail), whatever
/// the pointer's alignment.
inline float fixed_order_sum(const float* x, int64_t n) {
  constexpr int kLanes = 16;
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += x[i + l];
  }
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  for (; i < n; ++i) sum += x[i];
  return sum;
}

inline bool is_contiguous_f32(const Tensor& t) {
  return t.scalar_type() == ScalarType::Float &&
         executorch::runtime::tensor_is_default_dim_order(t) &&
         executorch::runtime::tensor_is_contiguous(t);
}

/// Resizes out to `sizes` (a no-op for a memory-planned output of that
/// shape); on failure marks the call failed.
inline bool resize(KernelRuntimeContext& ctx, Tensor& out, const SizesType* sizes, size_t dim,
                   const char* op) {
  if (executorch::runtime::resize_tensor(out, {sizes, dim}) == Error::Ok) return true;
  ET_LOG(Error, "%s: cannot resize out to the result's shape", op);
  ctx.fail(Error::InvalidArgument);
  return false;
}

/// Hands a call this kernel does not take to the operator's own kernel.
inline void run_fallback(OpFunction fn, const char* op, KernelRuntimeContext& ctx,
                         Span<EValue*> stack) {
  if (fn == nullptr) {
    ET_LOG(Error, "%s: unsupported arguments and no fallback kernel registered", op);
    ctx.fail(Error::NotSupported);
    return;
  }
  fn(ctx, stack);
}

std::vector<KernelSpec> matrix_kernel_specs();
std::vector<KernelSpec> layout_kernel_specs();
std::vector<KernelSpec> elementwise_kernel_specs();

}  // namespace zl::kernels
