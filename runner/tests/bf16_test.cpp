// The bf16 kernel paths (zl/bf16.h, zl/cpu_features.h): every variant this
// CPU can run gives the scalar reference's bits on every bf16 neighbourhood,
// and the process picks the path its hwcaps call for.
//
// ZL_EXPECT_KERNEL_PATH (tools/build_phone_runner.sh --test sets it per
// `qemu-aarch64 -cpu`): the path this CPU must get, "baseline" or "bf16".
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "zl/bf16.h"
#include "zl/cpu_features.h"

namespace zl {
namespace {

// Every upper half (each bf16 value, NaNs, infinities and denormals among
// them) with the lower halves where rounding decides: exact, just above,
// just below, at and just past the tie, the largest, and a scrambled one;
// 5 more at the end so the vector loop leaves a scalar tail.
std::vector<float> neighbourhoods() {
  const uint32_t lows[] = {0x0000, 0x0001, 0x4000, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0};
  std::vector<float> values;
  for (uint32_t high = 0; high < 0x10000; ++high) {
    for (uint32_t low : lows) {
      const uint32_t bits = (high << 16) | (low ? low : (high * 2654435761u) >> 16);
      float f = 0;
      std::memcpy(&f, &bits, sizeof(f));
      values.push_back(f);
    }
  }
  values.resize(values.size() + 5, 1.00390625f);  // a tie: rounds to the even 0x3F80
  return values;
}

std::vector<uint16_t> reference(const std::vector<float>& in) {
  std::vector<uint16_t> out(in.size());
  for (size_t i = 0; i < in.size(); ++i) out[i] = bf16_from_f32(in[i]);
  return out;
}

// The first index where two narrowings differ, as text ("" when none).
std::string first_difference(const std::vector<float>& in, const std::vector<uint16_t>& want,
                             const std::vector<uint16_t>& got) {
  for (size_t i = 0; i < in.size(); ++i) {
    if (want[i] != got[i]) {
      uint32_t bits = 0;
      std::memcpy(&bits, &in[i], sizeof(bits));
      char buf[96];
      std::snprintf(buf, sizeof(buf), "f32 0x%08X: want 0x%04X, got 0x%04X", bits, want[i], got[i]);
      return buf;
    }
  }
  return "";
}

TEST(Bf16Test, EveryVariantThisCpuRunsGivesTheReferenceBits) {
  const std::vector<float> in = neighbourhoods();
  const std::vector<uint16_t> want = reference(in);
  std::vector<uint16_t> got(in.size());
  narrow_to_bf16(KernelPath::kBaseline, in.data(), got.data(), in.size());
  EXPECT_EQ(first_difference(in, want, got), "") << "baseline";
  if (has_bf16_kernels() && cpu_features().bf16) {
    std::fill(got.begin(), got.end(), 0);
    narrow_to_bf16(KernelPath::kBf16, in.data(), got.data(), in.size());
    EXPECT_EQ(first_difference(in, want, got), "") << "bf16 (BFCVTN)";
  }
  std::fill(got.begin(), got.end(), 0);
  narrow_to_bf16(in.data(), got.data(), in.size());  // the dispatched one
  EXPECT_EQ(first_difference(in, want, got), "") << kernel_path_name(kernel_path());
}

TEST(Bf16Test, WideningIsExactForEveryBf16) {
  std::vector<uint16_t> in(0x10000);
  for (uint32_t h = 0; h < 0x10000; ++h) in[h] = static_cast<uint16_t>(h);
  std::vector<float> out(in.size());
  widen_from_bf16(in.data(), out.data(), in.size());
  for (uint32_t h = 0; h < 0x10000; ++h) {
    uint32_t bits = 0;
    std::memcpy(&bits, &out[h], sizeof(bits));
    ASSERT_EQ(bits, h << 16) << "bf16 0x" << std::hex << h;
  }
}

TEST(Bf16Test, KernelPathFollowsTheCpu) {
  const KernelPath path = kernel_path();
  EXPECT_EQ(path == KernelPath::kBf16, has_bf16_kernels() && cpu_features().bf16);
  if (const char* want = std::getenv("ZL_EXPECT_KERNEL_PATH")) {
    EXPECT_STREQ(kernel_path_name(path), want) << "cpu features: " << cpu_features_str(cpu_features());
  }
#if !defined(__aarch64__)
  EXPECT_EQ(cpu_features_str(cpu_features()), "none");  // only arm64 hwcaps are read
#endif
}

TEST(Bf16Test, CpuFeaturesNameThosePresentInOrder) {
  EXPECT_EQ(cpu_features_str(CpuFeatures{}), "none");
  EXPECT_EQ(cpu_features_str(CpuFeatures{true, true, true, true}), "fp16,dotprod,bf16,i8mm");
  CpuFeatures a76;
  a76.fp16 = a76.dotprod = true;
  EXPECT_EQ(cpu_features_str(a76), "fp16,dotprod");
}

}  // namespace
}  // namespace zl
