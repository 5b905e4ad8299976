// `zerolock::widen.out`: a compact frozen weight (bf16, fp16, int8 or
// float32) converted to float32, one tight loop per dtype (see
// custom_ops/widen.py for why not `_to_dim_order_copy`).
#pragma once

namespace zl {

/// Always true. Referencing it keeps widen.cpp, and with it the kernel's
/// static registration, in binaries that link zl_custom_ops statically
/// (the Android build drops unreferenced object files).
bool widen_kernel_linked();

}  // namespace zl
