// The `zerolock::widen.out` ExecuTorch kernel (AOT side: widen.py).
#include <zl/widen.h>

#include <cstdint>
#include <cstring>

#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/core/exec_aten/util/scalar_type_util.h>
#include <executorch/runtime/core/exec_aten/util/tensor_util.h>

namespace zl {
namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

/// bf16 is the top half of a float32: shift the bits back.
void widen_bf16(const uint16_t* in, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(in[i]) << 16;
    std::memcpy(&out[i], &bits, sizeof(float));
  }
}

void widen_int8(const int8_t* in, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(in[i]);
}

void widen_half(const executorch::aten::Half* in, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(in[i]);
}

}  // namespace

bool widen_kernel_linked() { return true; }

Tensor& widen_out(KernelRuntimeContext& ctx, const Tensor& weight, Tensor& out) {
  ET_KERNEL_CHECK_MSG(ctx, out.scalar_type() == ScalarType::Float, InvalidArgument, out,
                      "widen: out must be float32, got %s", executorch::runtime::toString(out.scalar_type()));
  ET_KERNEL_CHECK_MSG(ctx, executorch::runtime::resize_tensor(out, weight.sizes()) == Error::Ok, InvalidArgument,
                      out, "widen: cannot resize out (numel %zd) to the weight's shape (numel %zd)",
                      static_cast<ssize_t>(out.numel()), static_cast<ssize_t>(weight.numel()));
  ET_KERNEL_CHECK_MSG(ctx,
                      executorch::runtime::tensor_is_default_dim_order(weight) &&
                          executorch::runtime::tensor_is_default_dim_order(out),
                      InvalidArgument, out, "widen: weight and out must be contiguous");
  const size_t n = static_cast<size_t>(weight.numel());
  float* dst = out.mutable_data_ptr<float>();
  switch (weight.scalar_type()) {
    case ScalarType::BFloat16:
      widen_bf16(static_cast<const uint16_t*>(weight.const_data_ptr()), dst, n);
      break;
    case ScalarType::Char:
      widen_int8(weight.const_data_ptr<int8_t>(), dst, n);
      break;
    case ScalarType::Half:
      widen_half(weight.const_data_ptr<executorch::aten::Half>(), dst, n);
      break;
    case ScalarType::Float:
      if (n > 0 && dst != weight.const_data_ptr<float>()) std::memcpy(dst, weight.const_data_ptr<float>(), n * 4);
      break;
    default:
      ET_KERNEL_CHECK_MSG(ctx, false, InvalidArgument, out, "widen: weight dtype %s is not bf16, fp16, int8 or float32",
                          executorch::runtime::toString(weight.scalar_type()));
  }
  return out;
}

}  // namespace zl

EXECUTORCH_LIBRARY(zerolock, "widen.out", zl::widen_out);
