// Tests of the `zerolock::widen.out` and `zerolock::widen_int4.out` kernels: one per dtype, grid and failure mode.
#include <zl/widen.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include <executorch/extension/tensor/tensor.h>
#include <executorch/runtime/kernel/operator_registry.h>

namespace {

using executorch::aten::ScalarType;
using executorch::extension::make_tensor_ptr;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

TEST(Widen, Bf16IsTheTopHalfOfFloat32) {
  const std::vector<float> expected = {1.0f, -2.5f, 3.140625f, 0.0f, -0.0078125f, 65280.0f};
  std::vector<uint16_t> bits;
  for (float f : expected) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    bits.push_back(static_cast<uint16_t>(u >> 16));  // exact: each value has at most 8 significant bits
  }
  auto weight = make_tensor_ptr({2, 3}, bits.data(), ScalarType::BFloat16);
  auto out = make_tensor_ptr({2, 3}, std::vector<float>(6, 99.0f));
  KernelRuntimeContext ctx;
  zl::widen_out(ctx, *weight, *out);
  ASSERT_EQ(ctx.failure_state(), Error::Ok);
  const float* got = out->const_data_ptr<float>();
  for (size_t i = 0; i < expected.size(); ++i) EXPECT_EQ(got[i], expected[i]) << i;
}

TEST(Widen, Int8KeepsTheIntegerValues) {
  std::vector<int8_t> q = {-127, -1, 0, 1, 64, 127};
  auto weight = make_tensor_ptr({3, 2}, q.data(), ScalarType::Char);
  auto out = make_tensor_ptr({3, 2}, std::vector<float>(6, 99.0f));
  KernelRuntimeContext ctx;
  zl::widen_out(ctx, *weight, *out);
  ASSERT_EQ(ctx.failure_state(), Error::Ok);
  for (size_t i = 0; i < q.size(); ++i) EXPECT_EQ(out->const_data_ptr<float>()[i], static_cast<float>(q[i])) << i;
}

TEST(Widen, RefusesANonFloatOut) {
  std::vector<int8_t> q = {1, 2};
  auto weight = make_tensor_ptr({2}, q.data(), ScalarType::Char);
  std::vector<int8_t> bad(2);
  auto out = make_tensor_ptr({2}, bad.data(), ScalarType::Char);
  KernelRuntimeContext ctx;
  zl::widen_out(ctx, *weight, *out);
  EXPECT_EQ(ctx.failure_state(), Error::InvalidArgument);
}

TEST(Widen, RefusesAnUnsupportedWeightDtype) {
  std::vector<int64_t> w = {1, 2};
  auto weight = make_tensor_ptr({2}, w.data(), ScalarType::Long);
  auto out = make_tensor_ptr({2}, std::vector<float>(2));
  KernelRuntimeContext ctx;
  zl::widen_out(ctx, *weight, *out);
  EXPECT_EQ(ctx.failure_state(), Error::InvalidArgument);
}

TEST(Widen, RefusesAnOutOfAnotherSize) {
  std::vector<int8_t> q = {1, 2, 3};
  auto weight = make_tensor_ptr({3}, q.data(), ScalarType::Char);
  auto out = make_tensor_ptr({2}, std::vector<float>(2));  // static shape: cannot grow
  KernelRuntimeContext ctx;
  zl::widen_out(ctx, *weight, *out);
  EXPECT_EQ(ctx.failure_state(), Error::InvalidArgument);
}

/// The byte holding columns 2j (q_low) and 2j + 1 (q_high), each q in [0, 15].
uint8_t nibbles(int q_low, int q_high) { return static_cast<uint8_t>(q_low | (q_high << 4)); }

/// Float16 (scale, minimum) pairs, each value exact in float16.
std::vector<executorch::aten::Half> half_pairs(const std::vector<float>& values) {
  std::vector<executorch::aten::Half> out;
  for (float v : values) out.emplace_back(v);
  return out;
}

/// `zerolock::widen_int4.out` of `packed` (shape `sizes`) with `params` (shape `param_sizes`, float16 pairs or
/// float32 scales) into a float32 out of the widened shape: the context's state and the out's values.
template <typename Param>
std::pair<Error, std::vector<float>> widen_int4(std::vector<uint8_t> packed,
                                                std::vector<executorch::aten::SizesType> sizes,
                                                std::vector<Param> params,
                                                std::vector<executorch::aten::SizesType> param_sizes) {
  const ScalarType param_type = std::is_same_v<Param, float> ? ScalarType::Float : ScalarType::Half;
  auto p = make_tensor_ptr(sizes, packed.data(), ScalarType::Byte);
  auto s = make_tensor_ptr(param_sizes, params.data(), param_type);
  sizes.back() *= 2;
  auto out = make_tensor_ptr(sizes, std::vector<float>(2 * packed.size(), 99.0f));
  KernelRuntimeContext ctx;
  zl::widen_int4_out(ctx, *p, *s, *out);
  const float* values = out->const_data_ptr<float>();
  return {ctx.failure_state(), std::vector<float>(values, values + out->numel())};
}

TEST(WidenInt4, UnpacksLowNibbleFirstOntoEachGroupsGrid) {
  // 2 rows x 8 columns, groups of 4: (scale, minimum) (0.5, -4), (-2, 1) in row 0, (1, 0), (0.25, -1) in row 1.
  const auto [state, out] =
      widen_int4({nibbles(0, 15), nibbles(8, 9), nibbles(2, 3), nibbles(4, 0), nibbles(1, 2), nibbles(3, 4),
                  nibbles(0, 15), nibbles(4, 8)},
                 {2, 4}, half_pairs({0.5f, -4.0f, -2.0f, 1.0f, 1.0f, 0.0f, 0.25f, -1.0f}), {2, 4});
  ASSERT_EQ(state, Error::Ok);
  EXPECT_EQ(out, (std::vector<float>{-4, 3.5, 0, 0.5, -3, -5, -7, 1, 1, 2, 3, 4, -1, 2.75, 0, 1}));
}

TEST(WidenInt4, TakesLookedUpRowsOfAnyRank) {
  // An embedding's looked-up rows: (B=1, S=2, D/2=2) bytes, (1, 2, 2) pairs -> (1, 2, 4).
  const auto [state, out] = widen_int4({nibbles(1, 0), nibbles(2, 15), nibbles(7, 8), nibbles(0, 3)}, {1, 2, 2},
                                       half_pairs({2.0f, -1.0f, -1.0f, 0.5f}), {1, 2, 2});
  ASSERT_EQ(state, Error::Ok);
  EXPECT_EQ(out, (std::vector<float>{1, -1, 3, 29, -6.5, -7.5, 0.5, -2.5}));
}

TEST(WidenInt4, RefusesAnOddNumberOfHalfParams) {
  // A pair and a half a row.
  const auto [state, out] = widen_int4(std::vector<uint8_t>(8, nibbles(0, 0)), {2, 4},
                                       half_pairs({1.0f, 0.0f, 1.0f, 0.0f, 1.0f, 0.0f}), {2, 3});
  EXPECT_EQ(state, Error::InvalidArgument);
}

// Programs exported before the affine grid hold float32 scales, one per group, and nibbles q + 8, q in [-8, 7].

/// The byte holding columns 2j (q_low) and 2j + 1 (q_high), each q in [-8, 7].
uint8_t pack(int q_low, int q_high) { return static_cast<uint8_t>((q_low + 8) | ((q_high + 8) << 4)); }

TEST(WidenInt4Symmetric, UnpacksLowNibbleFirstAndScalesEachGroup) {
  // 2 rows x 8 columns, groups of 4: scales 0.5, -2 (row 0) and 1, 0.25 (row 1).
  const auto [state, out] = widen_int4({pack(-8, 7), pack(0, 1), pack(2, -3), pack(4, -5), pack(1, 2), pack(3, 4),
                                        pack(-1, -2), pack(-3, -4)},
                                       {2, 4}, std::vector<float>{0.5f, -2.0f, 1.0f, 0.25f}, {2, 2});
  ASSERT_EQ(state, Error::Ok);
  EXPECT_EQ(out, (std::vector<float>{-4, 3.5, 0, 0.5, -4, 6, -8, 10, 1, 2, 3, 4, -0.25, -0.5, -0.75, -1}));
}

TEST(WidenInt4Symmetric, TakesLookedUpRowsOfAnyRank) {
  // An embedding's looked-up rows: (B=1, S=2, D/2=2) bytes, (1, 2, 1) scales -> (1, 2, 4).
  const auto [state, out] = widen_int4({pack(1, -1), pack(2, -2), pack(7, -8), pack(0, 3)}, {1, 2, 2},
                                       std::vector<float>{2.0f, -1.0f}, {1, 2, 1});
  ASSERT_EQ(state, Error::Ok);
  EXPECT_EQ(out, (std::vector<float>{2, -2, 4, -4, -7, 8, 0, -3}));
}

TEST(WidenInt4, RefusesScalesThatDoNotMatch) {
  std::vector<uint8_t> packed(8, pack(0, 0));
  auto p = make_tensor_ptr({2, 4}, packed.data(), ScalarType::Byte);
  KernelRuntimeContext rows_ctx;  // 3 rows of scales for 2 rows of weights
  auto three_rows = make_tensor_ptr({3, 1}, std::vector<float>(3, 1.0f));
  auto out = make_tensor_ptr({2, 8}, std::vector<float>(16));
  zl::widen_int4_out(rows_ctx, *p, *three_rows, *out);
  EXPECT_EQ(rows_ctx.failure_state(), Error::InvalidArgument);
  KernelRuntimeContext odd_ctx;  // 8 columns in 8 groups: a group of 1 would split a byte
  auto eight = make_tensor_ptr({2, 8}, std::vector<float>(16, 1.0f));
  zl::widen_int4_out(odd_ctx, *p, *eight, *out);
  EXPECT_EQ(odd_ctx.failure_state(), Error::InvalidArgument);
  KernelRuntimeContext dtype_ctx;  // int8 where the packed bytes belong
  std::vector<int8_t> q(8);
  auto as_int8 = make_tensor_ptr({2, 4}, q.data(), ScalarType::Char);
  auto one = make_tensor_ptr({2, 1}, std::vector<float>(2, 1.0f));
  zl::widen_int4_out(dtype_ctx, *as_int8, *one, *out);
  EXPECT_EQ(dtype_ctx.failure_state(), Error::InvalidArgument);
}

TEST(WidenInt4, RefusesAnOutOfAnotherSize) {
  std::vector<uint8_t> packed(8, pack(1, 1));
  auto p = make_tensor_ptr({2, 4}, packed.data(), ScalarType::Byte);
  auto s = make_tensor_ptr({2, 1}, std::vector<float>(2, 1.0f));
  auto out = make_tensor_ptr({2, 4}, std::vector<float>(8));  // static shape: 8 values, not 16
  KernelRuntimeContext ctx;
  zl::widen_int4_out(ctx, *p, *s, *out);
  EXPECT_EQ(ctx.failure_state(), Error::InvalidArgument);
}

TEST(Widen, IsRegisteredWithTheRuntime) {
  EXPECT_TRUE(zl::widen_kernel_linked());
  EXPECT_TRUE(executorch::runtime::registry_has_op_function("zerolock::widen.out"));
  EXPECT_TRUE(executorch::runtime::registry_has_op_function("zerolock::widen_int4.out"));
}

}  // namespace
