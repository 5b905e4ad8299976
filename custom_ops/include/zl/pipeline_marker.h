// The ExecuTorch kernel of `zerolock::pipeline_marker.out` and its hook.
//
// In a stage's training program the marker copies the detached chunk output
// (B, S, D) float32 into its `out` tensor before any readout, loss or
// backward instruction runs. Right after the copy it calls the hook installed
// on the executing thread, so the stage runner can send the hidden state
// downstream while the method goes on ("early forwarding", docs/design.md §3-4).
#pragma once

#include <cstdint>

#include <executorch/runtime/core/exec_aten/exec_aten.h>
#include <executorch/runtime/kernel/kernel_runtime_context.h>

namespace zl {

/// Called on the executing thread right after the marker kernel copied the
/// hidden state into `hidden`.
///
/// `hidden` is the kernel's `out` tensor (B, S, D) float32: it stays valid
/// and unchanged until the method that owns it runs again, but the hook must
/// not keep a reference past the current `execute` call. The hook runs inside
/// the kernel, so it should hand the data off quickly (copy, enqueue) rather
/// than block.
using PipelineMarkerHook =
    void (*)(const executorch::aten::Tensor& hidden, void* user_data);

/// Installs `hook` (with `user_data`, passed back on every call) for the
/// calling thread only; `nullptr` removes it.
///
/// Thread-local so that several stage runners can share one process (tests)
/// and each sees only the markers of the methods it executes itself.
///
/// @returns the hook that was installed on this thread before, or nullptr.
PipelineMarkerHook set_pipeline_marker_hook(
    PipelineMarkerHook hook,
    void* user_data);

/// The kernel of `zerolock::pipeline_marker.out(Tensor hidden, *,
/// Tensor(a!) out) -> Tensor(a!)`, registered with the ExecuTorch runtime
/// when this library is loaded.
///
/// Copies `hidden` into `out` (resized to `hidden`'s shape if its dynamism
/// allows), then calls the calling thread's hook, if any. Bad inputs (not
/// float32, dtype or shape of `out` that cannot match, unallocated `out`)
/// set `ctx`'s failure state to InvalidArgument and leave `out` untouched;
/// the hook is not called then.
///
/// @returns `out`.
executorch::aten::Tensor& pipeline_marker_out(
    executorch::runtime::KernelRuntimeContext& ctx,
    const executorch::aten::Tensor& hidden,
    executorch::aten::Tensor& out);

} // namespace zl

extern "C" {
/// Number of successful marker kernel calls in this process, on any thread.
/// For tests (the Python ones read it through ctypes) to prove that this
/// kernel, not some other, ran.
uint64_t zl_pipeline_marker_call_count(void);
}
