// float32 <-> bfloat16 arrays: the GRAD frame's wire dtype (frame.h). The
// narrowing has two variants, chosen by kernel_path() (cpu_features.h):
// portable code the compiler vectorises for baseline NEON, and FEAT_BF16's
// BFCVTN; both round to nearest, ties to even, and give the same bits.
#pragma once

#include <cstddef>
#include <cstdint>

#include "zl/cpu_features.h"

namespace zl {

/// float32 -> bfloat16 bits, round to nearest, ties to even (NaN stays a quiet NaN).
uint16_t bf16_from_f32(float value);
/// bfloat16 bits -> float32 (exact: bf16 is the top half of a float32).
float f32_from_bf16(uint16_t bits);

/// out[i] = bf16_from_f32(in[i]) for i < n, on kernel_path()'s variant.
void narrow_to_bf16(const float* in, uint16_t* out, size_t n);
/// The same on a given variant (tests compare them). kBf16 needs
/// has_bf16_kernels() and a CPU with FEAT_BF16 (else SIGILL); the caller checks.
void narrow_to_bf16(KernelPath path, const float* in, uint16_t* out, size_t n);

/// out[i] = f32_from_bf16(in[i]) for i < n. One variant: a 16-bit shift is
/// already the whole conversion on baseline NEON (SHLL); FEAT_BF16 adds no
/// widening instruction.
void widen_from_bf16(const uint16_t* in, float* out, size_t n);

/// The FEAT_BF16 narrowing (src/bf16_bfcvtn.cpp, compiled for
/// armv8.2-a+bf16); defined only where has_bf16_kernels().
void narrow_to_bf16_bfcvtn(const float* in, uint16_t* out, size_t n);

}  // namespace zl
