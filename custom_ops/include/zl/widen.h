// `zerolock::widen.out`: a compact frozen weight (bf16, fp16, int8 or
// float32) converted to float32, one tight loop per dtype (see
// custom_ops/widen.py for why not `_to_dim_order_copy`).
#pragma once

#include <executorch/runtime/core/exec_aten/exec_aten.h>
#include <executorch/runtime/kernel/kernel_runtime_context.h>

namespace zl {

/// `out` (float32, resized to `weight`'s shape) = `weight` as float32.
/// Fails the context (InvalidArgument) for a non-float32 `out`, a
/// non-contiguous tensor or a weight dtype other than bf16/fp16/int8/fp32.
executorch::aten::Tensor& widen_out(executorch::runtime::KernelRuntimeContext& ctx,
                                    const executorch::aten::Tensor& weight, executorch::aten::Tensor& out);

/// Always true. Referencing it keeps widen.cpp, and with it the kernel's
/// static registration, in binaries that link zl_custom_ops statically
/// (the Android build drops unreferenced object files).
bool widen_kernel_linked();

}  // namespace zl
