// FEAT_BF16's float32 -> bfloat16 narrowing (zl/bf16.h), the one kernel of
// the bf16 path. CMake compiles this file alone for armv8.2-a+bf16 in an
// arm64 build; kernel_path() calls it only on a CPU with HWCAP2_BF16.
//
// Nothing here but the one function: every inline function a header would
// instantiate in this file would carry bf16 instructions, and the linker may
// keep that copy for callers on any CPU. (Hence only C headers of types and
// the intrinsics.)
//
// BFCVTN and BFCVT round by FPCR.RMode (Linux and Android start every thread
// at round to nearest, ties to even, no flush-to-zero, no default NaN): the
// baseline's bits exactly, NaNs quieted with their sign and top payload bits
// (tests/bf16_test.cpp checks every bf16 neighbourhood).
#if defined(__aarch64__) && defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
#include <arm_neon.h>
#include <stddef.h>
#include <stdint.h>

namespace zl {

void narrow_to_bf16_bfcvtn(const float* in, uint16_t* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {  // 8 floats: BFCVTN + BFCVTN2, one 16-byte store
    bfloat16x8_t v = vcvtq_low_bf16_f32(vld1q_f32(in + i));
    v = vcvtq_high_bf16_f32(v, vld1q_f32(in + i + 4));
    vst1q_u16(out + i, vreinterpretq_u16_bf16(v));
  }
  for (; i < n; ++i) {  // the tail: scalar BFCVT
    const bfloat16_t h = vcvth_bf16_f32(in[i]);
    __builtin_memcpy(out + i, &h, sizeof(h));
  }
}

}  // namespace zl
#endif
