// zl's float32 layout and elementwise kernels (docs/design#kernels):
// `permute_copy` and `expand_copy` as one strided copy that moves whole
// rows (memcpy), fills broadcast rows, or transposes in cache-sized tiles,
// where the portable kernels compute every element's coordinates;
// `pow.Tensor_Scalar` with the exponents RMSNorm and its backward use
// computed exactly as multiplications and square roots, not with std::pow;
// and `_softmax` / `_log_softmax` (last dimension), `sigmoid` and `exp` on
// Eigen's vectorized exp, split over the thread pool.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include <Eigen/Core>

#include <executorch/runtime/core/event_tracer_hooks.h>
#include <executorch/runtime/kernel/thread_parallel_interface.h>

#include "kernel_support.h"

namespace zl::kernels {
namespace {

using executorch::runtime::kTensorDimensionLimit;

OpFunction permute_fallback = nullptr;
OpFunction expand_fallback = nullptr;
OpFunction pow_fallback = nullptr;
OpFunction softmax_fallback = nullptr;
OpFunction sigmoid_fallback = nullptr;
OpFunction log_softmax_fallback = nullptr;
OpFunction exp_fallback = nullptr;

// Side of the square tiles a transposing copy moves at a time (floats): two
// 32x32 tiles stay within a 32 KiB L1 cache.
constexpr int64_t kTile = 32;

/// out (contiguous, `sizes`) = in read with element strides `strides`
/// (0 for a broadcast dimension).
class StridedCopy {
 public:
  StridedCopy(const float* in, float* out, const int64_t* sizes, const int64_t* strides, int dim)
      : in_(in), out_(out) {
    // Size-1 dimensions move nothing; neighbours laid out back to back in
    // the input read as one dimension.
    for (int d = 0; d < dim; ++d) {
      if (sizes[d] == 1) continue;
      if (n_ > 0 && strides_[n_ - 1] == strides[d] * sizes[d]) {
        sizes_[n_ - 1] *= sizes[d];
        strides_[n_ - 1] = strides[d];
      } else {
        sizes_[n_] = sizes[d];
        strides_[n_] = strides[d];
        ++n_;
      }
    }
    int64_t stride = 1;
    for (int d = n_ - 1; d >= 0; --d) {
      out_strides_[d] = stride;
      stride *= sizes_[d];
    }
  }

  void run() {
    if (n_ == 0) {
      out_[0] = in_[0];
      return;
    }
    inner_ = n_ - 1;
    // A transposing copy: some dimension j other than the last is the
    // input's unit-stride one; tiles over (j, last) read and write both
    // along cache lines.
    tile_dim_ = -1;
    if (strides_[inner_] > 1) {
      for (int d = inner_ - 1; d >= 0; --d) {
        if (strides_[d] == 1) {
          tile_dim_ = d;
          break;
        }
      }
    }
    walk(0, 0, 0);
  }

 private:
  void walk(int d, int64_t in_off, int64_t out_off) {
    if (d == inner_) return row(in_off, out_off);
    if (d == tile_dim_) return walk(d + 1, in_off, out_off);  // done inside the tiles
    for (int64_t i = 0; i < sizes_[d]; ++i) {
      walk(d + 1, in_off + i * strides_[d], out_off + i * out_strides_[d]);
    }
  }

  void row(int64_t in_off, int64_t out_off) {
    const int64_t len = sizes_[inner_];
    const int64_t step = strides_[inner_];
    const float* src = in_ + in_off;
    float* dst = out_ + out_off;
    if (tile_dim_ >= 0) return tiles(src, dst);
    if (step == 1) {
      std::memcpy(dst, src, len * sizeof(float));
    } else if (step == 0) {
      std::fill(dst, dst + len, *src);
    } else {
      for (int64_t i = 0; i < len; ++i) dst[i] = src[i * step];
    }
  }

  // dst[a * out_stride + b] = src[a + b * step] over a < rows, b < cols.
  void tiles(const float* src, float* dst) {
    const int64_t rows = sizes_[tile_dim_], out_stride = out_strides_[tile_dim_];
    const int64_t cols = sizes_[inner_], step = strides_[inner_];
    for (int64_t a0 = 0; a0 < rows; a0 += kTile) {
      const int64_t a1 = std::min(a0 + kTile, rows);
      for (int64_t b0 = 0; b0 < cols; b0 += kTile) {
        const int64_t b1 = std::min(b0 + kTile, cols);
        for (int64_t a = a0; a < a1; ++a) {
          float* d = dst + a * out_stride;
          const float* s = src + a;
          for (int64_t b = b0; b < b1; ++b) d[b] = s[b * step];
        }
      }
    }
  }

  const float* in_;
  float* out_;
  int n_ = 0;
  int inner_ = 0;
  int tile_dim_ = -1;
  std::array<int64_t, kTensorDimensionLimit> sizes_{};
  std::array<int64_t, kTensorDimensionLimit> strides_{};
  std::array<int64_t, kTensorDimensionLimit> out_strides_{};
};

std::array<int64_t, kTensorDimensionLimit> contiguous_strides(const Tensor& t) {
  std::array<int64_t, kTensorDimensionLimit> strides{};
  int64_t stride = 1;
  for (ssize_t d = t.dim() - 1; d >= 0; --d) {
    strides[d] = stride;
    stride *= t.size(d);
  }
  return strides;
}

// aten::permute_copy.out(Tensor self, int[] dims, *, Tensor(a!) out)
void permute_copy_out(KernelRuntimeContext& ctx, Span<EValue*> stack) {
  constexpr const char* kOp = "zl::permute_copy.out";
  executorch::runtime::internal::EventTracerProfileOpScope scope(ctx.internal_event_tracer(), kOp);
  const Tensor& in = stack[0]->toTensor();
  const auto dims = stack[1]->toIntList();
  Tensor& out = stack[2]->toTensor();
  const int64_t rank = in.dim();
  bool plain = is_contiguous_f32(in) && is_contiguous_f32(out) &&
               static_cast<int64_t>(dims.size()) == rank;
  std::array<bool, kTensorDimensionLimit> seen{};
  std::array<int64_t, kTensorDimensionLimit> axis{};
  for (int64_t i = 0; plain && i < rank; ++i) {
    const int64_t d = dims[i] < 0 ? dims[i] + rank : dims[i];
    plain = d >= 0 && d < rank && !seen[d];
    if (plain) seen[d] = true, axis[i] = d;
  }
  if (!plain) return run_fallback(permute_fallback, kOp, ctx, stack);
  count_call();
  const auto in_strides = contiguous_strides(in);
  std::array<SizesType, kTensorDimensionLimit> out_sizes{};
  std::array<int64_t, kTensorDimensionLimit> sizes{}, strides{};
  for (int64_t i = 0; i < rank; ++i) {
    out_sizes[i] = in.size(axis[i]);
    sizes[i] = in.size(axis[i]);
    strides[i] = in_strides[axis[i]];
  }
  if (!resize(ctx, out, out_sizes.data(), rank, kOp)) return;
  if (out.numel() == 0) return;
  StridedCopy(in.const_data_ptr<float>(), out.mutable_data_ptr<float>(), sizes.data(),
              strides.data(), static_cast<int>(rank))
      .run();
}

// aten::expand_copy.out(Tensor self, SymInt[] size, *, bool implicit=False, Tensor(a!) out)
void expand_copy_out(KernelRuntimeContext& ctx, Span<EValue*> stack) {
  constexpr const char* kOp = "zl::expand_copy.out";
  executorch::runtime::internal::EventTracerProfileOpScope scope(ctx.internal_event_tracer(), kOp);
  const Tensor& in = stack[0]->toTensor();
  const auto size = stack[1]->toIntList();
  Tensor& out = stack[3]->toTensor();
  const int64_t rank = static_cast<int64_t>(size.size());
  const int64_t lead = rank - in.dim();  // new leading dimensions
  bool plain = is_contiguous_f32(in) && is_contiguous_f32(out) && lead >= 0 &&
               rank <= static_cast<int64_t>(kTensorDimensionLimit);
  const auto in_strides = contiguous_strides(in);
  std::array<SizesType, kTensorDimensionLimit> out_sizes{};
  std::array<int64_t, kTensorDimensionLimit> sizes{}, strides{};
  for (int64_t i = 0; plain && i < rank; ++i) {
    if (i < lead) {
      plain = size[i] >= 0;
      sizes[i] = size[i], strides[i] = 0;
      continue;
    }
    const int64_t have = in.size(i - lead);
    const int64_t want = size[i] == -1 ? have : size[i];
    plain = want == have || (have == 1 && want >= 0);
    sizes[i] = want;
    strides[i] = want == have ? in_strides[i - lead] : 0;
  }
  if (!plain) return run_fallback(expand_fallback, kOp, ctx, stack);
  count_call();
  for (int64_t i = 0; i < rank; ++i) out_sizes[i] = static_cast<SizesType>(sizes[i]);
  if (!resize(ctx, out, out_sizes.data(), rank, kOp)) return;
  if (out.numel() == 0) return;
  StridedCopy(in.const_data_ptr<float>(), out.mutable_data_ptr<float>(), sizes.data(),
              strides.data(), static_cast<int>(rank))
      .run();
}

// aten::pow.Tensor_Scalar_out(Tensor self, Scalar exponent, *, Tensor(a!) out)
void pow_tensor_scalar_out(KernelRuntimeContext& ctx, Span<EValue*> stack) {
  constexpr const char* kOp = "zl::pow.Tensor_Scalar_out";
  executorch::runtime::internal::EventTracerProfileOpScope scope(ctx.internal_event_tracer(), kOp);
  const Tensor& in = stack[0]->toTensor();
  const auto exponent = stack[1]->toScalar();
  Tensor& out = stack[2]->toTensor();
  double e = 0.0;
  if (exponent.isFloatingPoint()) {
    e = exponent.to<double>();
  } else if (exponent.isIntegral(/*includeBool=*/false)) {
    e = static_cast<double>(exponent.to<int64_t>());
  }
  const bool known = e == 2.0 || e == 1.0 || e == 3.0 || e == 0.5 || e == -0.5 || e == -1.0;
  if (!known || !is_contiguous_f32(in) || !is_contiguous_f32(out)) {
    return run_fallback(pow_fallback, kOp, ctx, stack);
  }
  count_call();
  std::array<SizesType, kTensorDimensionLimit> sizes{};
  for (ssize_t d = 0; d < in.dim(); ++d) sizes[d] = in.size(d);
  if (!resize(ctx, out, sizes.data(), in.dim(), kOp)) return;
  const float* x = in.const_data_ptr<float>();
  float* y = out.mutable_data_ptr<float>();
  const int64_t n = in.numel();
  // The values std::pow gives for these exponents, to the last bit for 1, 2
  // and 0.5 (correctly rounded sqrt); 3, -0.5 and -1 round once more.
  if (e == 2.0) {
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * x[i];
  } else if (e == 1.0) {
    if (y != x) std::memcpy(y, x, n * sizeof(float));
  } else if (e == 3.0) {
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * x[i] * x[i];
  } else if (e == 0.5) {
    for (int64_t i = 0; i < n; ++i) y[i] = std::sqrt(x[i]);
  } else if (e == -0.5) {
    for (int64_t i = 0; i < n; ++i) y[i] = 1.0f / std::sqrt(x[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) y[i] = 1.0f / x[i];
  }
}

bool resize_like(KernelRuntimeContext& ctx, Tensor& out, const Tensor& in, const char* op) {
  std::array<SizesType, kTensorDimensionLimit> sizes{};
  for (ssize_t d = 0; d < in.dim(); ++d) sizes[d] = in.size(d);
  return resize(ctx, out, sizes.data(), in.dim(), op);
}

// y[i] = f(x[i]) on Eigen's packets only: each chunk goes through a 64-byte
// aligned buffer padded to whole packets, so every element takes the same
// path (Eigen's vectorized exp) wherever x and y sit. On an unaligned map
// Eigen would compute the first elements with the scalar std::exp, which
// differs in the last bit: results would depend on addresses.
template <typename F>
void map_packets(const float* x, float* y, int64_t n, F f) {
  constexpr int64_t kChunk = 256, kPacketFloats = 16;  // AVX-512; a multiple of AVX's 8 and NEON's 4
  alignas(64) float buf[kChunk];
  for (int64_t i = 0; i < n; i += kChunk) {
    const int64_t len = std::min(kChunk, n - i);
    const int64_t padded = (len + kPacketFloats - 1) / kPacketFloats * kPacketFloats;
    std::memcpy(buf, x + i, len * sizeof(float));
    std::fill(buf + len, buf + padded, 0.0f);
    Eigen::Map<Eigen::ArrayXf, Eigen::Aligned64> a(buf, padded);
    a = f(a);
    std::memcpy(y + i, buf, len * sizeof(float));
  }
}

// `_softmax.out` / `_log_softmax.out`(Tensor self, int dim, bool half_to_float, *, Tensor(a!) out) over the
// last dimension: `row_fn(row, res, cols, shift)` fills each output row, `shift` being the row's maximum.
// Log-softmax reads the row again after writing res, so an out that is the input goes to the fallback.
template <typename RowFn>
void last_dim_rows(KernelRuntimeContext& ctx, Span<EValue*> stack, const char* op, OpFunction fallback,
                   RowFn row_fn) {
  executorch::runtime::internal::EventTracerProfileOpScope scope(ctx.internal_event_tracer(), op);
  const Tensor& in = stack[0]->toTensor();
  const int64_t dim = stack[1]->toInt();
  const bool half_to_float = stack[2]->toBool();
  Tensor& out = stack[3]->toTensor();
  const bool last = in.dim() >= 1 && (dim == in.dim() - 1 || dim == -1);
  if (!last || half_to_float || !is_contiguous_f32(in) || !is_contiguous_f32(out) ||
      in.const_data_ptr() == out.const_data_ptr()) {
    return run_fallback(fallback, op, ctx, stack);
  }
  count_call();
  if (!resize_like(ctx, out, in, op)) return;
  const int64_t cols = in.size(in.dim() - 1);
  if (cols == 0 || in.numel() == 0) return;
  const int64_t rows = in.numel() / cols;
  const float* x = in.const_data_ptr<float>();
  float* y = out.mutable_data_ptr<float>();
  executorch::extension::parallel_for(0, rows, std::max<int64_t>(1, kGrain / cols), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = x + r * cols;
      row_fn(row, y + r * cols, cols, *std::max_element(row, row + cols));
    }
  });
}

// softmax: exp(x - max) / sum.
void softmax_out(KernelRuntimeContext& ctx, Span<EValue*> stack) {
  last_dim_rows(ctx, stack, "zl::_softmax.out", softmax_fallback,
                [](const float* row, float* res, int64_t cols, float shift) {
                  map_packets(row, res, cols, [shift](auto& a) { return (a - shift).exp(); });
                  const float total = fixed_order_sum(res, cols);
                  for (int64_t c = 0; c < cols; ++c) res[c] /= total;
                });
}

// log-softmax: x - max - log(sum(exp(x - max))).
void log_softmax_out(KernelRuntimeContext& ctx, Span<EValue*> stack) {
  last_dim_rows(ctx, stack, "zl::_log_softmax.out", log_softmax_fallback,
                [](const float* row, float* res, int64_t cols, float shift) {
                  map_packets(row, res, cols, [shift](auto& a) { return (a - shift).exp(); });  // res as scratch
                  const float lse = shift + std::log(fixed_order_sum(res, cols));
                  for (int64_t c = 0; c < cols; ++c) res[c] = row[c] - lse;
                });
}

// aten::sigmoid.out(Tensor self, *, Tensor(a!) out)
void sigmoid_out(KernelRuntimeContext& ctx, Span<EValue*> stack) {
  constexpr const char* kOp = "zl::sigmoid.out";
  executorch::runtime::internal::EventTracerProfileOpScope scope(ctx.internal_event_tracer(), kOp);
  const Tensor& in = stack[0]->toTensor();
  Tensor& out = stack[1]->toTensor();
  if (!is_contiguous_f32(in) || !is_contiguous_f32(out)) {
    return run_fallback(sigmoid_fallback, kOp, ctx, stack);
  }
  count_call();
  if (!resize_like(ctx, out, in, kOp)) return;
  const float* x = in.const_data_ptr<float>();
  float* y = out.mutable_data_ptr<float>();
  executorch::extension::parallel_for(0, in.numel(), kGrain, [&](int64_t i0, int64_t i1) {
    map_packets(x + i0, y + i0, i1 - i0, [](auto& a) { return (1.0f + (-a).exp()).inverse(); });
  });
}

// aten::exp.out(Tensor self, *, Tensor(a!) out)
void exp_out(KernelRuntimeContext& ctx, Span<EValue*> stack) {
  constexpr const char* kOp = "zl::exp.out";
  executorch::runtime::internal::EventTracerProfileOpScope scope(ctx.internal_event_tracer(), kOp);
  const Tensor& in = stack[0]->toTensor();
  Tensor& out = stack[1]->toTensor();
  if (!is_contiguous_f32(in) || !is_contiguous_f32(out)) return run_fallback(exp_fallback, kOp, ctx, stack);
  count_call();
  if (!resize_like(ctx, out, in, kOp)) return;
  const float* x = in.const_data_ptr<float>();
  float* y = out.mutable_data_ptr<float>();
  executorch::extension::parallel_for(0, in.numel(), kGrain, [&](int64_t i0, int64_t i1) {
    map_packets(x + i0, y + i0, i1 - i0, [](auto& a) { return a.exp(); });
  });
}

}  // namespace

std::vector<KernelSpec> layout_kernel_specs() {
  std::vector<std::string> expand_keys, same_rank_keys;
  for (int rank = 1; rank <= 6; ++rank) {
    same_rank_keys.push_back(float_key({rank, rank, rank}));  // input, out, result
    for (int in_rank = 0; in_rank <= rank; ++in_rank) {
      expand_keys.push_back(float_key({in_rank, rank, rank}));
    }
  }
  return {
      {"aten::permute_copy.out", same_rank_keys, permute_copy_out, &permute_fallback},
      {"aten::expand_copy.out", expand_keys, expand_copy_out, &expand_fallback},
      {"aten::pow.Tensor_Scalar_out", same_rank_keys, pow_tensor_scalar_out, &pow_fallback},
      {"aten::_softmax.out", same_rank_keys, softmax_out, &softmax_fallback},
      {"aten::sigmoid.out", same_rank_keys, sigmoid_out, &sigmoid_fallback},
      {"aten::_log_softmax.out", same_rank_keys, log_softmax_out, &log_softmax_fallback},
      {"aten::exp.out", same_rank_keys, exp_out, &exp_fallback},
  };
}

}  // namespace zl::kernels
