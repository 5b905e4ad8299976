// zl's float32 binary and reduction kernels (docs/design#kernels):
// `mul`, `add` and `sub` of two tensors (alpha 1) for the broadcasts a stage
// program makes (same shape; one operand repeating over the other's leading
// dimensions, e.g. RMSNorm's weight or RoPE's cos/sin; one value per row,
// e.g. RMSNorm's 1/rms), and `sum` / `mean` over one dimension, all split over
// the thread pool. ExecuTorch's kernels compute the broadcast ones per element
// through index arithmetic and run on one thread.
//
// Results are ExecuTorch's, bit for bit, for the binary ops (one IEEE
// operation per element either way); the reductions add in a fixed order
// that depends on neither the thread count nor addresses.
#include <algorithm>
#include <array>
#include <cstring>

#include <executorch/runtime/core/event_tracer_hooks.h>
#include <executorch/runtime/kernel/thread_parallel_interface.h>

#include "kernel_support.h"

namespace zl::kernels {
namespace {

using executorch::runtime::kTensorDimensionLimit;

OpFunction mul_fallback = nullptr;
OpFunction add_fallback = nullptr;
OpFunction sub_fallback = nullptr;
OpFunction sum_fallback = nullptr;
OpFunction mean_fallback = nullptr;

enum class BinaryOp { kMul, kAdd, kSub };

// How an operand is read against the output (both contiguous).
enum class Reads {
  kSame,     // element i of the output reads element i
  kPeriodic, // element i reads element i % n (the operand is the output's trailing dimensions)
  kPerRow,   // element i reads element i / cols (the output's shape with its last dimension 1)
  kNone,     // another broadcast: not taken
};

// The operand's shape, right-aligned against the output's `out` sizes.
Reads classify(const Tensor& t, const std::array<int64_t, kTensorDimensionLimit>& out, int rank) {
  const int lead = rank - static_cast<int>(t.dim());
  if (lead < 0) return Reads::kNone;
  bool same = true;
  for (int d = 0; d < rank; ++d) {
    const int64_t have = d < lead ? 1 : t.size(d - lead);
    if (have != out[d]) same = false;
  }
  if (same) return Reads::kSame;
  // Periodic: the sizes match the output's from some dimension k on, and
  // are 1 (or missing) before it.
  int k = rank;
  while (k > 0 && (k - 1 < lead ? 1 : t.size(k - 1 - lead)) == out[k - 1]) --k;
  bool periodic = true;
  for (int d = 0; d < k; ++d) periodic = periodic && (d < lead ? 1 : t.size(d - lead)) == 1;
  if (periodic) return Reads::kPeriodic;
  // Per row: every dimension but the last matches, and the last is 1.
  if (rank >= 1 && t.dim() == rank && t.size(rank - 1) == 1 && out[rank - 1] != 1) {
    bool rows = true;
    for (int d = 0; d + 1 < rank; ++d) rows = rows && t.size(d) == out[d];
    if (rows) return Reads::kPerRow;
  }
  return Reads::kNone;
}

inline float apply(BinaryOp op, float x, float y) {
  switch (op) {
    case BinaryOp::kMul: return x * y;
    case BinaryOp::kAdd: return x + y;
    case BinaryOp::kSub: return x - y;
  }
  return 0.0f;
}

// out[i] = a(i) op b(i) for i in [i0, i1), each operand read as `ra` / `rb`
// says (period or row length `pa` / `pb`).
template <BinaryOp kOp>
void binary_range(const float* a, Reads ra, int64_t pa, const float* b, Reads rb, int64_t pb, float* y,
                  int64_t i0, int64_t i1) {
  if (ra == Reads::kSame && rb == Reads::kSame) {
    for (int64_t i = i0; i < i1; ++i) y[i] = apply(kOp, a[i], b[i]);
    return;
  }
  // Walk the range in runs over which the broadcast operand is either one
  // value (per row) or a contiguous slice (periodic), so the inner loops vectorize.
  const Reads rbc = ra == Reads::kSame ? rb : ra;
  const int64_t run = ra == Reads::kSame ? pb : pa;
  if (rbc == Reads::kPeriodic && run == 1) {  // a single value (a 0-dim tensor): one run
    const float v = ra == Reads::kSame ? b[0] : a[0];
    if (ra == Reads::kSame) {
      for (int64_t i = i0; i < i1; ++i) y[i] = apply(kOp, a[i], v);
    } else {
      for (int64_t i = i0; i < i1; ++i) y[i] = apply(kOp, v, b[i]);
    }
    return;
  }
  for (int64_t i = i0; i < i1;) {
    const int64_t end = std::min(i1, (i / run + 1) * run);
    if (rbc == Reads::kPerRow) {
      if (ra == Reads::kSame) {
        const float v = b[i / pb];
        for (int64_t j = i; j < end; ++j) y[j] = apply(kOp, a[j], v);
      } else {
        const float v = a[i / pa];
        for (int64_t j = i; j < end; ++j) y[j] = apply(kOp, v, b[j]);
      }
    } else {
      const int64_t len = end - i;
      const float* slice = (ra == Reads::kSame ? b : a) + i % run;
      const float* whole = (ra == Reads::kSame ? a : b) + i;
      float* res = y + i;
      if (ra == Reads::kSame) {
        for (int64_t j = 0; j < len; ++j) res[j] = apply(kOp, whole[j], slice[j]);
      } else {
        for (int64_t j = 0; j < len; ++j) res[j] = apply(kOp, slice[j], whole[j]);
      }
    }
    i = end;
  }
}

// aten::mul.out(Tensor self, Tensor other, *, Tensor(a!) out)
// aten::add.out / aten::sub.out(Tensor self, Tensor other, *, Scalar alpha=1, Tensor(a!) out)
template <BinaryOp kOp>
void binary_out(KernelRuntimeContext& ctx, Span<EValue*> stack, const char* name, OpFunction fallback) {
  executorch::runtime::internal::EventTracerProfileOpScope scope(ctx.internal_event_tracer(), name);
  const Tensor& a = stack[0]->toTensor();
  const Tensor& b = stack[1]->toTensor();
  const bool has_alpha = kOp != BinaryOp::kMul;
  Tensor& out = stack[has_alpha ? 3 : 2]->toTensor();
  if (has_alpha) {
    const auto alpha = stack[2]->toScalar();
    const bool one = alpha.isIntegral(false) ? alpha.to<int64_t>() == 1
                                             : alpha.isFloatingPoint() && alpha.to<double>() == 1.0;
    if (!one) return run_fallback(fallback, name, ctx, stack);
  }
  if (!is_contiguous_f32(a) || !is_contiguous_f32(b) || !is_contiguous_f32(out)) {
    return run_fallback(fallback, name, ctx, stack);
  }
  // The broadcast shape.
  const int rank = static_cast<int>(std::max(a.dim(), b.dim()));
  std::array<int64_t, kTensorDimensionLimit> sizes{};
  for (int d = 0; d < rank; ++d) {
    const int la = d - (rank - static_cast<int>(a.dim())), lb = d - (rank - static_cast<int>(b.dim()));
    const int64_t sa = la >= 0 ? a.size(la) : 1, sb = lb >= 0 ? b.size(lb) : 1;
    if (sa != sb && sa != 1 && sb != 1) return run_fallback(fallback, name, ctx, stack);
    sizes[d] = std::max(sa, sb);
    if (sa == 0 || sb == 0) sizes[d] = 0;
  }
  const Reads ra = classify(a, sizes, rank), rb = classify(b, sizes, rank);
  // At most one operand broadcast, in one of the two ways.
  if (ra == Reads::kNone || rb == Reads::kNone || (ra != Reads::kSame && rb != Reads::kSame)) {
    return run_fallback(fallback, name, ctx, stack);
  }
  count_call();
  std::array<SizesType, kTensorDimensionLimit> out_sizes{};
  for (int d = 0; d < rank; ++d) out_sizes[d] = static_cast<SizesType>(sizes[d]);
  if (!resize(ctx, out, out_sizes.data(), rank, name)) return;
  const int64_t n = out.numel();
  if (n == 0) return;
  const int64_t cols = rank >= 1 ? sizes[rank - 1] : 1;
  const int64_t pa = ra == Reads::kPerRow ? cols : std::max<int64_t>(a.numel(), 1);
  const int64_t pb = rb == Reads::kPerRow ? cols : std::max<int64_t>(b.numel(), 1);
  const float* pa_data = a.const_data_ptr<float>();
  const float* pb_data = b.const_data_ptr<float>();
  float* y = out.mutable_data_ptr<float>();
  executorch::extension::parallel_for(0, n, kGrain, [&](int64_t i0, int64_t i1) {
    binary_range<kOp>(pa_data, ra, pa, pb_data, rb, pb, y, i0, i1);
  });
}

void mul_out(KernelRuntimeContext& ctx, Span<EValue*> stack) {
  binary_out<BinaryOp::kMul>(ctx, stack, "zl::mul.out", mul_fallback);
}
void add_out(KernelRuntimeContext& ctx, Span<EValue*> stack) {
  binary_out<BinaryOp::kAdd>(ctx, stack, "zl::add.out", add_fallback);
}
void sub_out(KernelRuntimeContext& ctx, Span<EValue*> stack) {
  binary_out<BinaryOp::kSub>(ctx, stack, "zl::sub.out", sub_fallback);
}

// aten::sum.IntList_out(Tensor self, int[1]? dim, bool keepdim=False, *, ScalarType? dtype=None, Tensor(a!) out)
// aten::mean.out(same arguments)
// over exactly one dimension: out[o, i] = sum over j of in[o, j, i] (divided by
// the dimension's size for mean), j in order.
template <bool kMean>
void reduce_out(KernelRuntimeContext& ctx, Span<EValue*> stack, const char* name, OpFunction fallback) {
  executorch::runtime::internal::EventTracerProfileOpScope scope(ctx.internal_event_tracer(), name);
  const Tensor& in = stack[0]->toTensor();
  Tensor& out = stack[4]->toTensor();
  const auto dims = stack[1]->toOptional<executorch::aten::ArrayRef<int64_t>>();
  const bool keepdim = stack[2]->toBool();
  const auto dtype = stack[3]->toOptional<ScalarType>();
  const int64_t rank = in.dim();
  if (!dims.has_value() || dims.value().size() != 1 || rank == 0 || !is_contiguous_f32(in) ||
      !is_contiguous_f32(out) || (dtype.has_value() && dtype.value() != ScalarType::Float)) {
    return run_fallback(fallback, name, ctx, stack);
  }
  int64_t dim = dims.value()[0];
  if (dim < 0) dim += rank;
  if (dim < 0 || dim >= rank) return run_fallback(fallback, name, ctx, stack);
  count_call();
  std::array<SizesType, kTensorDimensionLimit> out_sizes{};
  int64_t out_rank = 0, outer = 1, inner = 1;
  for (int64_t d = 0; d < rank; ++d) {
    if (d < dim) outer *= in.size(d);
    if (d > dim) inner *= in.size(d);
    if (d != dim) {
      out_sizes[out_rank++] = in.size(d);
    } else if (keepdim) {
      out_sizes[out_rank++] = 1;
    }
  }
  if (!resize(ctx, out, out_sizes.data(), out_rank, name)) return;
  const int64_t len = in.size(dim);
  const float* x = in.const_data_ptr<float>();
  float* y = out.mutable_data_ptr<float>();
  if (outer * inner == 0) return;
  if (inner == 1) {  // rows: one fixed-order sum each
    executorch::extension::parallel_for(0, outer, std::max<int64_t>(1, kGrain / std::max<int64_t>(len, 1)),
                                        [&](int64_t r0, int64_t r1) {
                                          for (int64_t r = r0; r < r1; ++r) {
                                            const float s = fixed_order_sum(x + r * len, len);
                                            y[r] = kMean ? s / static_cast<float>(len) : s;
                                          }
                                        });
    return;
  }
  // Slabs: out[o, :] accumulates in[o, j, :] for j in order (vectorized over i).
  executorch::extension::parallel_for(0, outer, std::max<int64_t>(1, kGrain / std::max<int64_t>(len * inner, 1)),
                                      [&](int64_t o0, int64_t o1) {
                                        for (int64_t o = o0; o < o1; ++o) {
                                          float* acc = y + o * inner;
                                          std::fill(acc, acc + inner, 0.0f);
                                          for (int64_t j = 0; j < len; ++j) {
                                            const float* row = x + (o * len + j) * inner;
                                            for (int64_t i = 0; i < inner; ++i) acc[i] += row[i];
                                          }
                                          if (kMean) {
                                            for (int64_t i = 0; i < inner; ++i) acc[i] /= static_cast<float>(len);
                                          }
                                        }
                                      });
}

void sum_out(KernelRuntimeContext& ctx, Span<EValue*> stack) {
  reduce_out<false>(ctx, stack, "zl::sum.IntList_out", sum_fallback);
}
void mean_out(KernelRuntimeContext& ctx, Span<EValue*> stack) {
  reduce_out<true>(ctx, stack, "zl::mean.out", mean_fallback);
}

}  // namespace

std::vector<KernelSpec> elementwise_kernel_specs() {
  // Binary: inputs of rank 0, 1 or the output's (RMSNorm's [D] weight, a
  // 0-dim scalar, or a same-rank broadcast), out, result.
  std::vector<std::string> binary_keys, reduce_keys;
  for (int rank = 1; rank <= 5; ++rank) {
    std::vector<int> in_ranks = {0, rank};
    if (rank > 1) in_ranks.insert(in_ranks.begin() + 1, 1);
    for (int ra : in_ranks) {
      for (int rb : in_ranks) {
        if (ra != rank && rb != rank) continue;
        binary_keys.push_back(float_key({ra, rb, rank, rank}));
      }
    }
    reduce_keys.push_back(float_key({rank, rank, rank}));          // keepdim
    if (rank > 1) reduce_keys.push_back(float_key({rank, rank - 1, rank - 1}));  // dimension dropped
  }
  return {
      {"aten::mul.out", binary_keys, mul_out, &mul_fallback},
      {"aten::add.out", binary_keys, add_out, &add_fallback},
      {"aten::sub.out", binary_keys, sub_out, &sub_fallback},
      {"aten::sum.IntList_out", reduce_keys, sum_out, &sum_fallback},
      {"aten::mean.out", reduce_keys, mean_out, &mean_fallback},
  };
}

}  // namespace zl::kernels
