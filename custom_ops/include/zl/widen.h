// `zerolock::widen.out`: a compact frozen weight (bf16, fp16, int8 or
// float32) converted to float32, one tight loop per dtype (see
// custom_ops/widen.py for why not `_to_dim_order_copy`);
// `zerolock::widen_int4.out`: int4 rows packed two to a byte, on their
// groups' grids (a scale and a minimum each), to float32.
#pragma once

#include <executorch/runtime/core/exec_aten/exec_aten.h>
#include <executorch/runtime/kernel/kernel_runtime_context.h>

namespace zl {

/// `out` (float32, resized to `weight`'s shape) = `weight` as float32.
/// Fails the context (InvalidArgument) for a non-float32 `out`, a
/// non-contiguous tensor or a weight dtype other than bf16/fp16/int8/fp32.
executorch::aten::Tensor& widen_out(executorch::runtime::KernelRuntimeContext& ctx,
                                    const executorch::aten::Tensor& weight, executorch::aten::Tensor& out);

/// `out` (float32, resized to `packed`'s shape with twice the last size) =
/// the int4 values of `packed` (uint8, byte j of a row: column 2j in the low
/// nibble, 2j + 1 in the high one, each q in [0, 15]) on their group's grid:
/// `params` float16 (the same leading sizes, a (scale, minimum) pair per
/// group of columns) gives q * scale + minimum (llama.cpp's Q4_1, what the
/// exporter writes); float32 `params` (one scale per group, programs exported
/// before) give (q - 8) * scale. The group size is the columns over the
/// groups, and even. Fails the context (InvalidArgument) for other dtypes,
/// shapes that do not match, a non-contiguous tensor or an `out` that cannot
/// take the result.
executorch::aten::Tensor& widen_int4_out(executorch::runtime::KernelRuntimeContext& ctx,
                                         const executorch::aten::Tensor& packed,
                                         const executorch::aten::Tensor& params, executorch::aten::Tensor& out);

/// Always true. Referencing it keeps widen.cpp, and with it the kernel's
/// static registration, in binaries that link zl_custom_ops statically
/// (the Android build drops unreferenced object files).
bool widen_kernel_linked();

}  // namespace zl
