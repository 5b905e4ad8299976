// The `zerolock::widen.out` and `zerolock::widen_int4.out` ExecuTorch kernels (AOT side: widen.py).
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

/// One row's groups: a 16-entry table per group (each nibble's value), then
/// two lookups a byte. `Params` gives group g's table entry for nibble k.
template <typename Params>
void widen_int4_rows(const uint8_t* packed, const Params& params, float* out, size_t rows, size_t groups,
                     size_t group) {
  float table[16];
  for (size_t r = 0; r < rows; ++r) {
    for (size_t g = 0; g < groups; ++g) {
      params.fill(r * groups + g, table);
      for (size_t j = 0; j < group / 2; ++j) {
        const uint8_t byte = *packed++;
        out[0] = table[byte & 0xF];
        out[1] = table[byte >> 4];
        out += 2;
      }
    }
  }
}

/// llama.cpp's Q4_1 grid (what the exporter writes): float16 (scale, minimum)
/// pairs, nibble k is k * scale + minimum.
struct AffineParams {
  const executorch::aten::Half* pairs;
  void fill(size_t group, float* table) const {
    const float scale = static_cast<float>(pairs[2 * group]), minimum = static_cast<float>(pairs[2 * group + 1]);
    for (int k = 0; k < 16; ++k) table[k] = static_cast<float>(k) * scale + minimum;
  }
};

/// The symmetric grid of programs exported before the affine one: a float32
/// scale per group, nibble k is (k - 8) * scale.
struct SymmetricParams {
  const float* scales;
  void fill(size_t group, float* table) const {
    for (int k = 0; k < 16; ++k) table[k] = static_cast<float>(k - 8) * scales[group];
  }
};

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

Tensor& widen_int4_out(KernelRuntimeContext& ctx, const Tensor& packed, const Tensor& params, Tensor& out) {
  ET_KERNEL_CHECK_MSG(ctx, out.scalar_type() == ScalarType::Float, InvalidArgument, out,
                      "widen_int4: out must be float32, got %s", executorch::runtime::toString(out.scalar_type()));
  const bool affine = params.scalar_type() == ScalarType::Half;
  const bool symmetric = params.scalar_type() == ScalarType::Float;
  ET_KERNEL_CHECK_MSG(ctx, packed.scalar_type() == ScalarType::Byte && (affine || symmetric), InvalidArgument, out,
                      "widen_int4: packed must be uint8 and params float16 (or float32 scales), got %s and %s",
                      executorch::runtime::toString(packed.scalar_type()),
                      executorch::runtime::toString(params.scalar_type()));
  const ssize_t dims = packed.dim();
  bool same_rows = dims >= 1 && params.dim() == dims;
  for (ssize_t d = 0; same_rows && d + 1 < dims; ++d) same_rows = packed.size(d) == params.size(d);
  const size_t bytes = same_rows ? static_cast<size_t>(packed.size(dims - 1)) : 0;
  const size_t per_row = same_rows ? static_cast<size_t>(params.size(dims - 1)) : 0;
  const size_t groups = affine ? per_row / 2 : per_row;  // affine: a (scale, minimum) pair per group
  ET_KERNEL_CHECK_MSG(ctx,
                      same_rows && groups > 0 && (!affine || per_row % 2 == 0) && (2 * bytes) % groups == 0 &&
                          (2 * bytes / groups) % 2 == 0,
                      InvalidArgument, out,
                      "widen_int4: packed (%zd dims, %zu bytes a row) and params (%zd dims, %zu a row) do not match",
                      dims, bytes, static_cast<ssize_t>(params.dim()), per_row);
  executorch::aten::SizesType sizes[executorch::runtime::kTensorDimensionLimit];
  for (ssize_t d = 0; d < dims; ++d) sizes[d] = packed.size(d);
  sizes[dims - 1] = static_cast<executorch::aten::SizesType>(2 * bytes);
  ET_KERNEL_CHECK_MSG(ctx,
                      executorch::runtime::resize_tensor(out, {sizes, static_cast<size_t>(dims)}) == Error::Ok,
                      InvalidArgument, out, "widen_int4: cannot resize out (numel %zd) to %zu columns a row",
                      static_cast<ssize_t>(out.numel()), 2 * bytes);
  ET_KERNEL_CHECK_MSG(ctx,
                      executorch::runtime::tensor_is_default_dim_order(packed) &&
                          executorch::runtime::tensor_is_default_dim_order(params) &&
                          executorch::runtime::tensor_is_default_dim_order(out),
                      InvalidArgument, out, "widen_int4: packed, params and out must be contiguous");
  const size_t rows = bytes == 0 ? 0 : static_cast<size_t>(packed.numel()) / bytes;
  const uint8_t* in = packed.const_data_ptr<uint8_t>();
  float* dst = out.mutable_data_ptr<float>();
  if (affine) {
    widen_int4_rows(in, AffineParams{params.const_data_ptr<executorch::aten::Half>()}, dst, rows, groups,
                    2 * bytes / groups);
  } else {
    widen_int4_rows(in, SymmetricParams{params.const_data_ptr<float>()}, dst, rows, groups, 2 * bytes / groups);
  }
  return out;
}

}  // namespace zl

EXECUTORCH_LIBRARY(zerolock, "widen.out", zl::widen_out);
EXECUTORCH_LIBRARY(zerolock, "widen_int4.out", zl::widen_int4_out);
