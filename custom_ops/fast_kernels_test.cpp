// Tests of zl's float32 kernels (fast_kernels.cpp): the GEMM
// against a double-precision reference, the thread split against the serial
// product, and the registration (keys resolve to these kernels for float32
// calls and to the fallback kernels otherwise).
#include <zl/fast_kernels.h>
#include <zl/thread_pool.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <executorch/extension/tensor/tensor.h>
#include <executorch/runtime/core/evalue.h>
#include <executorch/runtime/kernel/kernel_runtime_context.h>
#include <executorch/runtime/kernel/operator_registry.h>
#include <executorch/runtime/kernel/thread_parallel_interface.h>


namespace {

using executorch::aten::DimOrderType;
using executorch::aten::ScalarType;
using executorch::extension::from_blob;
using executorch::runtime::EValue;
using executorch::runtime::KernelRuntimeContext;
using executorch::runtime::OpFunction;
using executorch::runtime::Span;
using executorch::runtime::TensorMeta;

std::vector<float> random_values(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

// out = a @ b (b: [k, n]) or a @ b^T (b: [n, k]), in double.
std::vector<double> reference(const std::vector<float>& a, const std::vector<float>& b, int64_t m,
                              int64_t k, int64_t n, bool b_transposed) {
  std::vector<double> out(m * n, 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double sum = 0.0;
      for (int64_t p = 0; p < k; ++p)
        sum += double(a[i * k + p]) * double(b_transposed ? b[j * k + p] : b[p * n + j]);
      out[i * n + j] = sum;
    }
  return out;
}

bool set_threads(uint32_t threads) { return zl::reset_thread_pool(threads); }

struct Shape {
  int64_t m, k, n;
};

TEST(FastKernels, GemmMatchesReference) {
  // Small, odd, panel-crossing and split-sized products, both layouts of b.
  const Shape shapes[] = {{1, 1, 1},   {3, 5, 7},    {1, 576, 49},  {4, 576, 300},
                          {128, 64, 65}, {200, 300, 700}, {700, 96, 130}, {0, 4, 5}, {4, 0, 5}};
  for (bool transposed : {false, true}) {
    for (const Shape& s : shapes) {
      auto a = random_values(s.m * s.k, 1);
      auto b = random_values(s.k * s.n, 2);
      std::vector<float> out(s.m * s.n, 123.0f);
      zl::gemm_f32(a.data(), b.data(), out.data(), s.m, s.k, s.n, transposed);
      auto want = reference(a, b, s.m, s.k, s.n, transposed);
      for (int64_t i = 0; i < s.m * s.n; ++i) {
        ASSERT_NEAR(out[i], want[i], 1e-5 * std::sqrt(double(s.k)) + 1e-6)
            << "m=" << s.m << " k=" << s.k << " n=" << s.n << " transposed=" << transposed
            << " at " << i;
      }
    }
  }
}

TEST(FastKernels, GemmIsTheOneThisBuildChose) {
  const std::string backend = zl::gemm_backend();
  EXPECT_EQ(backend.rfind(ZL_EXPECT_GEMM, 0), 0u) << backend;
}

TEST(FastKernels, ThreadSplitIsBitIdenticalToOneThread) {
  if (!set_threads(1)) GTEST_SKIP() << "no ExecuTorch thread pool in this build";
  ASSERT_EQ(zl::parallel_thread_count(), 1);
  // Panels of 64; a product whose last panel would be one wide (129 = 2 x 64 + 1) stays whole.
  // Attention-sized products (128 x 64 x 128, ~1M multiply-adds) straddle OpenBLAS's
  // small-matrix limit: whole, they would take one kernel, cut in panels another.
  const Shape shapes[] = {{128, 576, 1536}, {576, 128, 300}, {130, 200, 70}, {70, 96, 129},
                          {129, 96, 70},    {128, 64, 128},  {128, 128, 64}, {96, 100, 160}};
  for (bool transposed : {false, true}) {
    for (const Shape& s : shapes) {
      auto a = random_values(s.m * s.k, 3);
      auto b = random_values(s.k * s.n, 4);
      std::vector<float> one(s.m * s.n), three(s.m * s.n);
      ASSERT_TRUE(set_threads(1));
      zl::gemm_f32(a.data(), b.data(), one.data(), s.m, s.k, s.n, transposed);
      ASSERT_TRUE(set_threads(3));
      ASSERT_EQ(zl::parallel_thread_count(), 3);
      zl::gemm_f32(a.data(), b.data(), three.data(), s.m, s.k, s.n, transposed);
      EXPECT_EQ(one, three) << "m=" << s.m << " k=" << s.k << " n=" << s.n
                            << " transposed=" << transposed;
    }
  }
  set_threads(1);
}

// The same product from copies of the inputs at every float offset within a
// 64-byte line: results must not depend on where data sits (a program's
// tensors sit elsewhere when it is mapped rather than read, or reloaded).
TEST(FastKernels, ResultsDoNotDependOnAlignment) {
  const Shape shapes[] = {{1, 300, 77}, {77, 300, 1}, {1, 5, 1}, {9, 300, 77}, {128, 64, 128}, {64, 576, 200}};
  for (bool transposed : {false, true}) {
    for (const Shape& s : shapes) {
      const auto a = random_values(s.m * s.k, 8), b = random_values(s.k * s.n, 9);
      std::vector<float> first;
      for (int offset = 0; offset < 16; ++offset) {
        std::vector<float> ab(offset + a.size()), bb(offset + b.size()), out(offset + s.m * s.n);
        std::copy(a.begin(), a.end(), ab.begin() + offset);
        std::copy(b.begin(), b.end(), bb.begin() + offset);
        zl::gemm_f32(ab.data() + offset, bb.data() + offset, out.data() + offset, s.m, s.k, s.n, transposed);
        std::vector<float> got(out.begin() + offset, out.end());
        if (offset == 0) {
          first = got;
        } else {
          ASSERT_EQ(got, first) << "m=" << s.m << " k=" << s.k << " n=" << s.n << " transposed=" << transposed
                                << " offset " << offset;
        }
      }
    }
  }
}

// Metadata of `count` float32 (or `dtype`) tensors of rank `dim`, default dim order.
struct Metas {
  std::vector<std::vector<DimOrderType>> orders;
  std::vector<TensorMeta> metas;
  Metas(std::initializer_list<int> dims, ScalarType dtype = ScalarType::Float) {
    for (int d : dims) {
      std::vector<DimOrderType> order(d);
      for (int i = 0; i < d; ++i) order[i] = static_cast<DimOrderType>(i);
      orders.push_back(order);
    }
    for (auto& order : orders) {
      TensorMeta meta;
      meta.dtype_ = dtype;
      meta.dim_order_ = Span<DimOrderType>(order.data(), order.size());
      metas.push_back(meta);
    }
  }
  Span<const TensorMeta> span() const { return {metas.data(), metas.size()}; }
};

OpFunction lookup(const char* op, const Metas& metas) {
  auto found = executorch::runtime::get_op_function_from_registry(op, metas.span());
  return found.ok() ? found.get() : nullptr;
}

TEST(FastKernels, RegistrationBindsFloatCallsOnly) {
  const OpFunction fallback_mm = lookup("aten::mm.out", Metas({}));
  const auto first = zl::register_fast_kernels();
  ASSERT_TRUE(first.ok) << first.error;
  EXPECT_TRUE(zl::fast_kernels_registered());
  const auto again = zl::register_fast_kernels();
  EXPECT_TRUE(again.ok);
  EXPECT_EQ(again.kernels, 0) << "a second registration must be a no-op";

  // A float32 mm call (self, mat2, out, and out as the result) resolves to
  // zl's kernel; an int64 one to the library's own.
  const OpFunction float_mm = lookup("aten::mm.out", Metas({2, 2, 2, 2}));
  ASSERT_NE(float_mm, nullptr);
  EXPECT_NE(float_mm, fallback_mm);
  EXPECT_EQ(lookup("aten::mm.out", Metas({2, 2, 2, 2}, ScalarType::Long)), fallback_mm);
  EXPECT_NE(lookup("aten::bmm.out", Metas({3, 3, 3, 3})), nullptr);
  EXPECT_NE(lookup("aten::linear.out", Metas({3, 2, 3, 3})), lookup("aten::linear.out", Metas({})));
  EXPECT_NE(lookup("aten::linear.out", Metas({2, 2, 1, 2, 2})), lookup("aten::linear.out", Metas({})));
}

TEST(FastKernels, RegisteredKernelsComputeThroughTheRegistry) {
  ASSERT_TRUE(zl::register_fast_kernels().ok);
  const int64_t m = 5, k = 7, n = 3;
  auto a = random_values(m * k, 5), w = random_values(n * k, 6), bias = random_values(n, 7);
  std::vector<float> out(m * n, 0.0f);
  auto ta = from_blob(a.data(), {int(m), int(k)});
  auto tw = from_blob(w.data(), {int(n), int(k)});
  auto tb = from_blob(bias.data(), {int(n)});
  auto to = from_blob(out.data(), {int(m), int(n)});
  EValue ea(*ta), ew(*tw), eb(*tb), eo(*to), ret(*to);
  EValue* stack[] = {&ea, &ew, &eb, &eo, &ret};
  const OpFunction linear = lookup("aten::linear.out", Metas({2, 2, 1, 2, 2}));
  ASSERT_NE(linear, nullptr);
  KernelRuntimeContext ctx;
  const uint64_t calls = zl::fast_kernel_call_count();
  linear(ctx, Span<EValue*>(stack, 5));
  EXPECT_EQ(ctx.failure_state(), executorch::runtime::Error::Ok);
  EXPECT_EQ(zl::fast_kernel_call_count(), calls + 1);
  auto want = reference(a, w, m, k, n, /*b_transposed=*/true);
  for (int64_t i = 0; i < m * n; ++i) EXPECT_NEAR(out[i], want[i] + bias[i % n], 1e-5) << i;
}

// softmax and sigmoid through the registry on rows at every float offset:
// bit-identical results (Eigen's exp on an unaligned map computes its first
// elements with the scalar std::exp).
TEST(FastKernels, SoftmaxAndSigmoidDoNotDependOnAlignment) {
  ASSERT_TRUE(zl::register_fast_kernels().ok);
  const int rows = 3, cols = 37;
  const auto x = random_values(rows * cols, 10);
  const OpFunction softmax = lookup("aten::_softmax.out", Metas({2, 2, 2}));
  const OpFunction sigmoid = lookup("aten::sigmoid.out", Metas({2, 2, 2}));
  ASSERT_NE(softmax, nullptr);
  ASSERT_NE(sigmoid, nullptr);
  std::vector<float> first_softmax, first_sigmoid;
  for (int offset = 0; offset < 16; ++offset) {
    std::vector<float> in(offset + x.size()), out(offset + x.size()), out2(offset + x.size());
    std::copy(x.begin(), x.end(), in.begin() + offset);
    auto tin = from_blob(in.data() + offset, {rows, cols});
    auto tout = from_blob(out.data() + offset, {rows, cols});
    auto tout2 = from_blob(out2.data() + offset, {rows, cols});
    EValue ein(*tin), dim(int64_t{1}), half(false), eout(*tout), ret(*tout);
    EValue* softmax_stack[] = {&ein, &dim, &half, &eout, &ret};
    KernelRuntimeContext ctx;
    softmax(ctx, Span<EValue*>(softmax_stack, 5));
    EValue eout2(*tout2), ret2(*tout2);
    EValue* sigmoid_stack[] = {&ein, &eout2, &ret2};
    sigmoid(ctx, Span<EValue*>(sigmoid_stack, 3));
    ASSERT_EQ(ctx.failure_state(), executorch::runtime::Error::Ok);
    std::vector<float> sm(out.begin() + offset, out.end()), sg(out2.begin() + offset, out2.end());
    if (offset == 0) {
      first_softmax = sm, first_sigmoid = sg;
      for (int r = 0; r < rows; ++r) {
        double sum = 0, max = -1e30;
        for (int c = 0; c < cols; ++c) sum += sm[r * cols + c], max = std::max<double>(max, x[r * cols + c]);
        EXPECT_NEAR(sum, 1.0, 1e-6);
        for (int c = 0; c < cols; ++c) {
          EXPECT_NEAR(sg[r * cols + c], 1.0 / (1.0 + std::exp(-double(x[r * cols + c]))), 1e-6);
        }
      }
    } else {
      ASSERT_EQ(sm, first_softmax) << "softmax, offset " << offset;
      ASSERT_EQ(sg, first_sigmoid) << "sigmoid, offset " << offset;
    }
  }
}

}  // namespace
