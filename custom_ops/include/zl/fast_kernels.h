// Fast float32 kernels for the stage programs (docs/design#kernels).
//
// A stage step spends most of its time in `aten::linear.out`, `aten::mm.out`
// and `aten::bmm.out`. ExecuTorch's optimized kernels run them on a GEMM
// built for the baseline ISA of the wheel (SSE2 on x86) on one core; these
// run them on OpenBLAS's GEMM (its kernels for the CPU it runs on), or
// Eigen's compiled for the build machine's vector unit (AVX2/AVX-512 on a
// host build, NEON on arm64) where OpenBLAS is not built in, split over
// ExecuTorch's thread pool, so the runner's `threads` setting applies.
//
// They register under ExecuTorch kernel keys for float32 tensors in the
// default dim order. The runtime prefers a kernel whose key matches the
// call's tensors over the fallback (key-less) kernel of the same operator,
// so they take precedence over the kernel libraries already registered, and
// any other call (another dtype or rank) still reaches those.
#pragma once

#include <cstdint>
#include <string>

namespace zl {

/// Outcome of register_fast_kernels.
struct FastKernelsRegistration {
  bool ok = false;
  int kernels = 0;          // specialized kernels registered (0 when already done)
  std::string error;        // set when !ok
};

/// Registers the kernels into ExecuTorch's operator registry. Idempotent:
/// later calls register nothing and report ok. Call before loading a program
/// (operators are resolved at method load).
FastKernelsRegistration register_fast_kernels();

/// True once register_fast_kernels succeeded in this process.
bool fast_kernels_registered();

/// The GEMM under linear/mm/bmm in this build: "OpenBLAS (<its config>)" or
/// "Eigen <version>" (CMake option ZL_GEMM).
std::string gemm_backend();

/// Calls of the registered kernels since process start (a statistic, to check
/// that a program actually ran on them).
uint64_t fast_kernel_call_count();

/// out[M, N] = a[M, K] @ b, where b is [K, N] (b_transposed false) or [N, K]
/// (b_transposed true), all row-major and contiguous, split over the thread
/// pool. The kernels' core, exposed for tests.
void gemm_f32(const float* a, const float* b, float* out, int64_t m, int64_t k, int64_t n,
              bool b_transposed);

}  // namespace zl

extern "C" {
/// For Python (ctypes): registers the kernels; returns the number registered
/// (0 if already registered) or -1 on error (logged through ExecuTorch).
int zl_register_fast_kernels();
/// For Python (ctypes): fast_kernel_call_count().
uint64_t zl_fast_kernel_call_count();
/// For Python (ctypes): gemm_backend(), valid for the life of the process.
const char* zl_gemm_backend();
}
