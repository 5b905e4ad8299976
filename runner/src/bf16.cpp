// float32 <-> bfloat16 arrays (zl/bf16.h).
#include "zl/bf16.h"

#include <cstring>

namespace zl {
namespace {

// Branch-free so that the loops below vectorise (a compare and a select for
// the NaN case on NEON or SSE/AVX).
inline uint16_t narrow_bits(uint32_t bits) {
  // Round to nearest, ties to even: add 0x7FFF plus the lowest kept bit, then truncate.
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x0040u;  // the sign and the top of the payload, quieted
  return static_cast<uint16_t>((bits & 0x7FFFFFFFu) > 0x7F800000u ? quiet_nan : rounded);
}

void narrow_baseline(const float* in, uint16_t* out, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint32_t bits = 0;
    std::memcpy(&bits, in + i, sizeof(bits));
    out[i] = narrow_bits(bits);
  }
}

}  // namespace

uint16_t bf16_from_f32(float value) {
  uint32_t bits = 0;
  std::memcpy(&bits, &value, sizeof(bits));
  return narrow_bits(bits);
}

float f32_from_bf16(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out = 0;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

void narrow_to_bf16(KernelPath path, const float* in, uint16_t* out, size_t n) {
#if ZL_HAVE_BF16_KERNELS
  if (path == KernelPath::kBf16) return narrow_to_bf16_bfcvtn(in, out, n);
#else
  (void)path;
#endif
  narrow_baseline(in, out, n);
}

void narrow_to_bf16(const float* in, uint16_t* out, size_t n) { narrow_to_bf16(kernel_path(), in, out, n); }

void widen_from_bf16(const uint16_t* in, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const uint32_t wide = static_cast<uint32_t>(in[i]) << 16;
    std::memcpy(out + i, &wide, sizeof(wide));
  }
}

}  // namespace zl
