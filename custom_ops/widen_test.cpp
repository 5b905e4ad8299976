// Tests of the `zerolock::widen.out` kernel: one per dtype and failure mode.
#include <zl/widen.h>

#include <cstdint>
#include <cstring>
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

TEST(Widen, IsRegisteredWithTheRuntime) {
  EXPECT_TRUE(zl::widen_kernel_linked());
  EXPECT_TRUE(executorch::runtime::registry_has_op_function("zerolock::widen.out"));
}

}  // namespace
