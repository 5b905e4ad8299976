// zl's float32 linear/mm/bmm kernels on OpenBLAS's GEMM (or Eigen's, in a
// build without OpenBLAS), and the registration of all of zl's fast kernels
// (docs/design#kernels).
#include <zl/fast_kernels.h>
#include <zl/thread_pool.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <mutex>

#include <Eigen/Core>
#if ZL_GEMM_OPENBLAS
#include <cblas.h>
#endif

#include <executorch/runtime/core/event_tracer_hooks.h>
#include <executorch/runtime/kernel/thread_parallel_interface.h>

#include "kernel_support.h"

namespace zl {
namespace {

using executorch::runtime::Kernel;
using executorch::runtime::KernelKey;
using namespace zl::kernels;

using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstMatrix = Eigen::Map<const RowMajor>;
using Matrix = Eigen::Map<RowMajor>;

std::atomic<uint64_t> call_count{0};
std::atomic<bool> registered{false};

// Products are cut into panels of this many output columns (or rows) by
// their shape alone, whatever the thread count: every panel is one GEMM call,
// so each element is computed by the same call on one thread as on eight.
// (A GEMM library picks kernels and blocking by the shape of the call, e.g.
// OpenBLAS's small-matrix kernels below ~100^3 multiply-adds, which sum in
// another order than its blocked ones.) 64 is a whole number of micro-panels
// of both libraries' kernels (at most 16 wide with AVX-512).
constexpr int64_t kPanel = 64;
// Below this many multiply-adds a product is one call, on the calling thread.
constexpr int64_t kMinParallelWork = int64_t{1} << 18;

// One GEMM on one thread: out[m, n] = a[m, k] @ (b or b^T), m and n >= 2.
// Both libraries pack both operands, so the result does not depend on where
// they sit in memory (Eigen's matrix-vector path, which it takes for a
// one-row or one-column result, peels to an alignment and does: such
// products never come here).
void gemm_serial(const float* a, const float* b, float* out, int64_t m, int64_t k, int64_t n,
                 int64_t ldb, int64_t ldout, bool b_transposed) {
#if ZL_GEMM_OPENBLAS
  cblas_sgemm(CblasRowMajor, CblasNoTrans, b_transposed ? CblasTrans : CblasNoTrans, static_cast<blasint>(m),
              static_cast<blasint>(n), static_cast<blasint>(k), 1.0f, a, static_cast<blasint>(k), b,
              static_cast<blasint>(ldb), 0.0f, out, static_cast<blasint>(ldout));
#else
  using Stride = Eigen::OuterStride<>;
  ConstMatrix lhs(a, m, k);
  Eigen::Map<RowMajor, Eigen::Unaligned, Stride> res(out, m, n, Stride(ldout));
  if (b_transposed) {
    Eigen::Map<const RowMajor, Eigen::Unaligned, Stride> rhs(b, n, k, Stride(ldb));
    res.noalias() = lhs * rhs.transpose();
  } else {
    Eigen::Map<const RowMajor, Eigen::Unaligned, Stride> rhs(b, k, n, Stride(ldb));
    res.noalias() = lhs * rhs;
  }
#endif
}

// x . y over k elements, summed in a fixed order (16 lanes, then the lanes
// in turn, then the tail) whatever the pointers' alignment.
float dot(const float* x, const float* y, int64_t k) {
  constexpr int kLanes = 16;
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += x[i + l] * y[i + l];
  }
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  for (; i < k; ++i) sum += x[i] * y[i];
  return sum;
}

// A product with a one-row or one-column result, as dot products and
// row updates whose order of summation is fixed (see gemm_serial).
void vector_product(const float* a, const float* b, float* out, int64_t m, int64_t k, int64_t n,
                    bool b_transposed) {
  if (b_transposed) {  // b is [n, k]: every output is a row of a against a row of b
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) out[i * n + j] = dot(a + i * k, b + j * k, k);
    }
  } else if (n == 1) {  // b is [k, 1]: contiguous
    for (int64_t i = 0; i < m; ++i) out[i] = dot(a + i * k, b, k);
  } else {  // m == 1, b is [k, n]: out += a[p] * b[p, :] for p in order
    std::fill(out, out + n, 0.0f);
    for (int64_t p = 0; p < k; ++p) {
      const float w = a[p];
      const float* row = b + p * n;
      for (int64_t j = 0; j < n; ++j) out[j] += w * row[j];
    }
  }
}

}  // namespace

void gemm_f32(const float* a, const float* b, float* out, int64_t m, int64_t k, int64_t n,
              bool b_transposed) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    std::fill(out, out + m * n, 0.0f);
    return;
  }
  if (m == 1 || n == 1) return vector_product(a, b, out, m, k, n, b_transposed);
  // The panels depend on the shape only (see kPanel). A cut leaving a
  // one-wide last panel would run it as a matrix-vector product: such a
  // product stays whole.
  const int64_t split = n >= m ? n : m;
  if (m * k * n < kMinParallelWork || split <= kPanel || split % kPanel == 1) {
    gemm_serial(a, b, out, m, k, n, b_transposed ? k : n, n, b_transposed);
    return;
  }
  const int64_t panels = (split + kPanel - 1) / kPanel;
  // parallel_for hands each thread a range of whole panels (inline with one
  // thread); each panel is its own call, so the ranges do not matter.
  const int64_t ldb = b_transposed ? k : n;
  executorch::extension::parallel_for(0, panels, 1, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      const int64_t lo = p * kPanel;
      const int64_t width = std::min(lo + kPanel, split) - lo;
      if (n >= m) {  // a column panel: all of `a` times columns lo.. of the product
        const float* b0 = b_transposed ? b + lo * k : b + lo;
        gemm_serial(a, b0, out + lo, m, k, width, ldb, n, b_transposed);
      } else {  // a row panel: rows lo.. of `a` times all of b
        gemm_serial(a + lo * k, b, out + lo * n, width, k, n, ldb, n, b_transposed);
      }
    }
  });
}

namespace {

// The operators' own kernels, for calls these decline (set at registration).
OpFunction linear_fallback = nullptr;
OpFunction mm_fallback = nullptr;
OpFunction bmm_fallback = nullptr;

// aten::linear.out(Tensor input, Tensor weight, Tensor? bias=None, *, Tensor(a!) out)
void linear_out(KernelRuntimeContext& ctx, Span<EValue*> stack) {
  constexpr const char* kOp = "zl::linear.out";
  executorch::runtime::internal::EventTracerProfileOpScope scope(ctx.internal_event_tracer(),
                                                                 kOp);
  const Tensor& input = stack[0]->toTensor();
  const Tensor& weight = stack[1]->toTensor();
  const bool has_bias = !stack[2]->isNone();
  Tensor& out = stack[3]->toTensor();
  const int64_t k = input.dim() >= 1 ? input.size(input.dim() - 1) : 0;
  const bool plain = input.dim() >= 1 && weight.dim() == 2 && weight.size(1) == k &&
                     is_contiguous_f32(input) && is_contiguous_f32(weight) &&
                     is_contiguous_f32(out) &&
                     (!has_bias || (stack[2]->toTensor().dim() == 1 &&
                                    stack[2]->toTensor().size(0) == weight.size(0) &&
                                    is_contiguous_f32(stack[2]->toTensor())));
  if (!plain) return run_fallback(linear_fallback, kOp, ctx, stack);
  count_call();

  const int64_t n = weight.size(0);
  std::array<SizesType, executorch::runtime::kTensorDimensionLimit> sizes{};
  for (ssize_t d = 0; d + 1 < input.dim(); ++d) sizes[d] = input.size(d);
  sizes[input.dim() - 1] = static_cast<SizesType>(n);
  if (!resize(ctx, out, sizes.data(), static_cast<size_t>(input.dim()), kOp)) return;
  const int64_t m = k == 0 ? 0 : input.numel() / k;
  float* result = out.mutable_data_ptr<float>();
  gemm_f32(input.const_data_ptr<float>(), weight.const_data_ptr<float>(), result, m, k, n,
           /*b_transposed=*/true);
  if (has_bias) {
    Eigen::Map<const Eigen::RowVectorXf> bias(stack[2]->toTensor().const_data_ptr<float>(), n);
    Matrix(result, m, n).rowwise() += bias;
  }
}

// aten::mm.out(Tensor self, Tensor mat2, *, Tensor(a!) out)
void mm_out(KernelRuntimeContext& ctx, Span<EValue*> stack) {
  constexpr const char* kOp = "zl::mm.out";
  executorch::runtime::internal::EventTracerProfileOpScope scope(ctx.internal_event_tracer(),
                                                                 kOp);
  const Tensor& a = stack[0]->toTensor();
  const Tensor& b = stack[1]->toTensor();
  Tensor& out = stack[2]->toTensor();
  const bool plain = a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0) &&
                     is_contiguous_f32(a) && is_contiguous_f32(b) && is_contiguous_f32(out);
  if (!plain) return run_fallback(mm_fallback, kOp, ctx, stack);
  count_call();
  const std::array<SizesType, 2> sizes{static_cast<SizesType>(a.size(0)),
                                       static_cast<SizesType>(b.size(1))};
  if (!resize(ctx, out, sizes.data(), 2, kOp)) return;
  gemm_f32(a.const_data_ptr<float>(), b.const_data_ptr<float>(), out.mutable_data_ptr<float>(),
           a.size(0), a.size(1), b.size(1), /*b_transposed=*/false);
}

// aten::bmm.out(Tensor self, Tensor mat2, *, Tensor(a!) out)
void bmm_out(KernelRuntimeContext& ctx, Span<EValue*> stack) {
  constexpr const char* kOp = "zl::bmm.out";
  executorch::runtime::internal::EventTracerProfileOpScope scope(ctx.internal_event_tracer(),
                                                                 kOp);
  const Tensor& a = stack[0]->toTensor();
  const Tensor& b = stack[1]->toTensor();
  Tensor& out = stack[2]->toTensor();
  const bool plain = a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) &&
                     a.size(2) == b.size(1) && is_contiguous_f32(a) && is_contiguous_f32(b) &&
                     is_contiguous_f32(out);
  if (!plain) return run_fallback(bmm_fallback, kOp, ctx, stack);
  count_call();
  const int64_t batch = a.size(0), m = a.size(1), k = a.size(2), n = b.size(2);
  const std::array<SizesType, 3> sizes{static_cast<SizesType>(batch), static_cast<SizesType>(m),
                                       static_cast<SizesType>(n)};
  if (!resize(ctx, out, sizes.data(), 3, kOp)) return;
  const float* pa = a.const_data_ptr<float>();
  const float* pb = b.const_data_ptr<float>();
  float* po = out.mutable_data_ptr<float>();
  if (m == 0 || n == 0 || batch == 0) return;
  const int64_t threads = zl::parallel_thread_count();
  if (threads > 1 && batch >= threads) {
    // Attention's many small products: one whole product per task.
    executorch::extension::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        if (k == 0) {
          std::fill(po + i * m * n, po + (i + 1) * m * n, 0.0f);
        } else {
          if (m == 1 || n == 1) {
            vector_product(pa + i * m * k, pb + i * k * n, po + i * m * n, m, k, n, false);
          } else {
            gemm_serial(pa + i * m * k, pb + i * k * n, po + i * m * n, m, k, n, n, n, false);
          }
        }
      }
    });
    return;
  }
  for (int64_t i = 0; i < batch; ++i) {
    gemm_f32(pa + i * m * k, pb + i * k * n, po + i * m * n, m, k, n, /*b_transposed=*/false);
  }
}

OpFunction find_fallback(const char* name) {
  auto found = executorch::runtime::get_op_function_from_registry(name, {});
  return found.ok() ? found.get() : nullptr;
}

}  // namespace

namespace kernels {

std::string float_key(std::initializer_list<int> ranks) {
  std::string key = "v1/";
  for (int rank : ranks) {
    if (key.size() > 3) key += '|';
    key += "6;";
    for (int d = 0; d < rank; ++d) key += (d ? "," : "") + std::to_string(d);
  }
  return key;
}

void count_call() { call_count.fetch_add(1, std::memory_order_relaxed); }

std::vector<KernelSpec> matrix_kernel_specs() {
  std::vector<std::string> linear_keys;
  for (int rank = 2; rank <= 4; ++rank) {
    linear_keys.push_back(float_key({rank, 2, rank, rank}));     // no bias
    linear_keys.push_back(float_key({rank, 2, 1, rank, rank}));  // with bias
  }
  return {
      {"aten::linear.out", linear_keys, linear_out, &linear_fallback},
      {"aten::mm.out", {float_key({2, 2, 2, 2})}, mm_out, &mm_fallback},
      {"aten::bmm.out", {float_key({3, 3, 3, 3})}, bmm_out, &bmm_fallback},
  };
}

}  // namespace kernels

FastKernelsRegistration register_fast_kernels() {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  if (registered.load()) return {true, 0, ""};
  // Eigen's lazily initialised cache-size statics, before any pool thread.
  Eigen::initParallel();
#if ZL_GEMM_OPENBLAS
  // One OpenBLAS thread per call: the panels already run on ExecuTorch's pool.
  openblas_set_num_threads(1);
#endif

  // The registry keeps the Kernel entries' name and key pointers: both live
  // as long as the process (the specs are never freed; held by a static, so
  // LeakSanitizer sees them reachable).
  static std::vector<KernelSpec>* specs = nullptr;
  specs = new std::vector<KernelSpec>(matrix_kernel_specs());
  for (auto& spec : layout_kernel_specs()) specs->push_back(std::move(spec));
  for (auto& spec : elementwise_kernel_specs()) specs->push_back(std::move(spec));
  std::vector<Kernel> list;
  for (const KernelSpec& spec : *specs) {
    *spec.fallback = find_fallback(spec.op);
    for (const std::string& key : spec.keys) {
      list.emplace_back(spec.op, KernelKey(key.c_str()), spec.fn);
    }
  }
  const Error error = executorch::runtime::register_kernels({list.data(), list.size()});
  if (error != Error::Ok) {
    return {false, 0,
            "ExecuTorch refused zl's kernels (error " + std::to_string(static_cast<int>(error)) +
                "): a kernel library in this process already registered float32 kernels "
                "under the same keys"};
  }
  registered.store(true);
  return {true, static_cast<int>(list.size()), ""};
}

bool fast_kernels_registered() { return registered.load(); }

std::string gemm_backend() {
#if ZL_GEMM_OPENBLAS
  return std::string("OpenBLAS (") + openblas_get_config() + ")";
#else
  return "Eigen " + std::to_string(EIGEN_WORLD_VERSION) + "." + std::to_string(EIGEN_MAJOR_VERSION) + "." +
         std::to_string(EIGEN_MINOR_VERSION);
#endif
}

uint64_t fast_kernel_call_count() { return call_count.load(std::memory_order_relaxed); }

}  // namespace zl

extern "C" int zl_register_fast_kernels() {
  const auto result = zl::register_fast_kernels();
  if (!result.ok) {
    ET_LOG(Error, "%s", result.error.c_str());
    return -1;
  }
  return result.kernels;
}

extern "C" uint64_t zl_fast_kernel_call_count() { return zl::fast_kernel_call_count(); }

extern "C" const char* zl_gemm_backend() {
  static const std::string name = zl::gemm_backend();
  return name.c_str();
}
