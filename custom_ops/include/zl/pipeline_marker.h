// The ExecuTorch kernel of `zerolock::pipeline_marker.out` and its hook.
//
// In a stage's training program the marker copies the detached chunk output
// (B, S, D) float32 into its `out` tensor before any readout, loss or
// backward instruction runs. Right after the copy it calls the hook installed
// on the executing thread, so the stage runner can send the hidden state
// downstream while the method goes on ("early forwarding", docs/design#stage-program, #runner).
// The hook may also end the method there (a stage held still by lr 0 needs
// only phase 1, docs/design#windows-and-adamw): the kernel then fails the method with
// kPipelineMarkerStopped, which the caller of `execute` takes as "stopped at
// the marker", not as an error.
#pragma once

#include <cstdint>

#include <executorch/runtime/core/error.h>
#include <executorch/runtime/core/exec_aten/exec_aten.h>
#include <executorch/runtime/kernel/kernel_runtime_context.h>

namespace zl {

/// What the method does after the hook returns.
enum class PipelineMarkerAction {
  kContinue,  ///< go on with the instructions after the marker (phase 2)
  kStop,      ///< end the method here: fail it with kPipelineMarkerStopped
};

/// The error a method fails with when its marker hook returned kStop.
///
/// `Method::execute` never returns EndOfMethod itself (only `step()` does),
/// and no kernel fails with it, so within `execute` it can only mean this.
/// A method that failed this way has run its instructions up to the marker
/// and no further: it can be executed again at once (execute() starts from
/// the first instruction; nothing after the marker ran, and the outputs of a
/// stopped run other than the marker's are stale), but its outputs other
/// than `hidden` must not be read. ExecuTorch logs every failed kernel call
/// ("KernelCall failed at instruction ..." and one line per argument); the
/// kernel keeps those lines of a requested stop out of the log, see
/// pipeline_marker_out.
constexpr executorch::runtime::Error kPipelineMarkerStopped =
    executorch::runtime::Error::EndOfMethod;

/// Called on the executing thread right after the marker kernel copied the
/// hidden state into `hidden`; its return value says whether the method goes
/// on.
///
/// `hidden` is the kernel's `out` tensor (B, S, D) float32: it stays valid
/// and unchanged until the method that owns it runs again, but the hook must
/// not keep a reference past the current `execute` call. The hook runs inside
/// the kernel: the method waits for it (the stage runner parks it there until
/// phase 2 is due, docs/design#per-micro-batch).
using PipelineMarkerHook = PipelineMarkerAction (*)(
    const executorch::aten::Tensor& hidden,
    void* user_data);

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
/// the hook is not called then. A hook that returns kStop makes the kernel
/// set `ctx`'s failure state to kPipelineMarkerStopped (`out` holds the
/// copy); the runtime's log lines about that failure are dropped.
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
