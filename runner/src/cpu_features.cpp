// CPU feature probe and the kernel path (zl/cpu_features.h).
#include "zl/cpu_features.h"

#if defined(__aarch64__) && defined(__linux__)  // Android included
#include <sys/auxv.h>
#endif

namespace zl {
namespace {

// The hwcap bits (Linux arch/arm64/include/uapi/asm/hwcap.h); spelled out
// because older NDK and glibc headers lack the HWCAP2 ones.
constexpr unsigned long kHwcapAsimdHp = 1ul << 10;
constexpr unsigned long kHwcapAsimdDp = 1ul << 20;
constexpr unsigned long kHwcap2I8mm = 1ul << 13;
constexpr unsigned long kHwcap2Bf16 = 1ul << 14;

CpuFeatures probe() {
  CpuFeatures f;
#if defined(__aarch64__) && defined(__linux__)
  const unsigned long hwcap = getauxval(AT_HWCAP);
  const unsigned long hwcap2 = getauxval(AT_HWCAP2);
  f.fp16 = (hwcap & kHwcapAsimdHp) != 0;
  f.dotprod = (hwcap & kHwcapAsimdDp) != 0;
  f.bf16 = (hwcap2 & kHwcap2Bf16) != 0;
  f.i8mm = (hwcap2 & kHwcap2I8mm) != 0;
#endif
  return f;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = probe();
  return features;
}

std::string cpu_features_str(const CpuFeatures& features) {
  std::string out;
  const auto add = [&out](bool present, const char* name) {
    if (!present) return;
    if (!out.empty()) out += ',';
    out += name;
  };
  add(features.fp16, "fp16");
  add(features.dotprod, "dotprod");
  add(features.bf16, "bf16");
  add(features.i8mm, "i8mm");
  return out.empty() ? "none" : out;
}

bool has_bf16_kernels() {
#if ZL_HAVE_BF16_KERNELS
  return true;
#else
  return false;
#endif
}

KernelPath kernel_path() {
  static const KernelPath path =
      has_bf16_kernels() && cpu_features().bf16 ? KernelPath::kBf16 : KernelPath::kBaseline;
  return path;
}

const char* kernel_path_name(KernelPath path) { return path == KernelPath::kBf16 ? "bf16" : "baseline"; }

}  // namespace zl
