// Which arm64 extensions the CPU has, and which of zl's kernel paths the
// process runs (chosen once, at first use). docs/design#runner-process "Kernel
// paths" lists what each extension would change and why only FEAT_BF16
// gets a path.
#pragma once

#include <string>

namespace zl {

/// arm64 extensions read from the kernel's hwcaps (getauxval AT_HWCAP /
/// AT_HWCAP2); all false on other architectures.
struct CpuFeatures {
  bool fp16 = false;     ///< FEAT_FP16, HWCAP_ASIMDHP (armv8.2: Cortex-A55/A75 and later)
  bool dotprod = false;  ///< FEAT_DotProd, HWCAP_ASIMDDP (armv8.2 optional: Cortex-A55/A75/A76 and later)
  bool bf16 = false;     ///< FEAT_BF16, HWCAP2_BF16 (armv8.6: Cortex-A510/A710/X2 and later)
  bool i8mm = false;     ///< FEAT_I8MM, HWCAP2_I8MM (armv8.6: as bf16)
};

/// The kernel variants a process can run.
enum class KernelPath {
  kBaseline,  ///< armv8.0 NEON (every arm64 phone) or the host's own ISA
  kBf16,      ///< kBaseline plus FEAT_BF16's BFCVTN for float32 -> bfloat16
};

/// This CPU's features, read once.
const CpuFeatures& cpu_features();

/// "fp16,dotprod,bf16,i8mm" (those present, in that order), or "none".
std::string cpu_features_str(const CpuFeatures& features);

/// True when this build holds the FEAT_BF16 kernels (an arm64 build whose
/// compiler takes -march=armv8.2-a+bf16).
bool has_bf16_kernels();

/// The path this process runs: kBf16 when the build has it and the CPU has
/// FEAT_BF16, else kBaseline. Read once; the kernels dispatch on it.
KernelPath kernel_path();

/// "baseline" or "bf16".
const char* kernel_path_name(KernelPath path);

}  // namespace zl
