// ExecuTorch kernel of `zerolock::pipeline_marker.out`; see
// include/zl/pipeline_marker.h for the contract and pipeline_marker.py for
// the AOT schema it implements.
#include <zl/pipeline_marker.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string_view>

#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/core/exec_aten/util/scalar_type_util.h>
#include <executorch/runtime/core/exec_aten/util/tensor_util.h>
#include <executorch/runtime/platform/log.h>
#include <executorch/runtime/platform/platform.h>

namespace zl {
namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

struct InstalledHook {
  PipelineMarkerHook hook = nullptr;
  void* user_data = nullptr;
};

// One per thread: the hook fires on the thread that runs Method::execute.
thread_local InstalledHook installed_hook;

// Process-wide, any thread; relaxed because it is only a statistic.
std::atomic<uint64_t> call_count{0};

// --- Keeping a requested stop out of the runtime's log ---------------------
//
// Method::execute_instruction logs every kernel that fails: "KernelCall failed
// at instruction C:I in operator zerolock::pipeline_marker.out: 0x3", then
// "arg N with type id T" per argument (ExecuTorch 1.5.1, method.cpp). For a
// stop the hook asked for that is four error lines per micro-batch of a
// forward-only stage, none of them news. So the first stop installs a log
// function in front of the PAL's (executorch::runtime::register_pal) that
// drops exactly those lines on the thread that stopped, right after the stop,
// and passes everything else on to the function it replaced.

enum class StopLog { kNone, kExpectKernelCall, kArgs };
struct StopLogState {
  StopLog expect = StopLog::kNone;
  unsigned next_arg = 0;
};
thread_local StopLogState stop_log;

// The PAL's log function before ours; written once, before ours is installed.
pal_emit_log_message_method forward_log = nullptr;
std::once_flag filter_installed;

bool starts_with(std::string_view text, std::string_view prefix) {
  return text.substr(0, prefix.size()) == prefix;
}

// True for the runtime's lines about this thread's requested stop.
bool is_stop_line(std::string_view message) {
  while (!message.empty() && (message.back() == '\n' || message.back() == '\r')) {
    message.remove_suffix(1);
  }
  if (stop_log.expect == StopLog::kExpectKernelCall) {
    char code[16];
    std::snprintf(code, sizeof(code), ": 0x%x",
                  static_cast<unsigned>(kPipelineMarkerStopped));
    const std::string_view suffix(code);
    if (starts_with(message, "KernelCall failed at instruction ") &&
        message.find("zerolock::pipeline_marker") != std::string_view::npos &&
        message.size() >= suffix.size() &&
        message.substr(message.size() - suffix.size()) == suffix) {
      stop_log = {StopLog::kArgs, 0};
      return true;
    }
  } else if (stop_log.expect == StopLog::kArgs) {
    char prefix[48];
    std::snprintf(prefix, sizeof(prefix), "arg %u with type id ", stop_log.next_arg);
    if (starts_with(message, prefix)) {
      ++stop_log.next_arg;
      return true;
    }
  }
  stop_log = {};  // any other line ends what belongs to the stop
  return false;
}

void filtered_log(
    et_timestamp_t timestamp,
    et_pal_log_level_t level,
    const char* filename,
    const char* function,
    size_t line,
    const char* message,
    size_t length) {
  if (stop_log.expect != StopLog::kNone && level == ::kError &&
      message != nullptr && is_stop_line(std::string_view(message, length))) {
    return;
  }
  if (forward_log != nullptr) {
    forward_log(timestamp, level, filename, function, line, message, length);
  }
}

void install_stop_log_filter() {
  std::call_once(filter_installed, [] {
    const executorch::runtime::PalImpl* pal = executorch::runtime::get_pal_impl();
    forward_log = pal != nullptr ? pal->emit_log_message : nullptr;
    if (forward_log == nullptr) return;  // no log to filter
    executorch::runtime::register_pal(
        executorch::runtime::PalImpl::create(filtered_log, __FILE__));
  });
}

} // namespace

PipelineMarkerHook set_pipeline_marker_hook(
    PipelineMarkerHook hook,
    void* user_data) {
  PipelineMarkerHook previous = installed_hook.hook;
  installed_hook.hook = hook;
  installed_hook.user_data = hook != nullptr ? user_data : nullptr;
  return previous;
}

Tensor& pipeline_marker_out(
    KernelRuntimeContext& ctx,
    const Tensor& hidden,
    Tensor& out) {
  // The stage contract sends float32 hidden states only; any other dtype
  // means the program was exported wrongly, so fail the method loudly.
  ET_KERNEL_CHECK_MSG(
      ctx,
      hidden.scalar_type() == ScalarType::Float,
      InvalidArgument,
      out,
      "pipeline_marker: hidden must be float32, got %s",
      executorch::runtime::toString(hidden.scalar_type()));
  ET_KERNEL_CHECK_MSG(
      ctx,
      out.scalar_type() == hidden.scalar_type(),
      InvalidArgument,
      out,
      "pipeline_marker: out dtype %s differs from hidden dtype %s",
      executorch::runtime::toString(out.scalar_type()),
      executorch::runtime::toString(hidden.scalar_type()));
  // Memory-planned outputs are usually STATIC: resizing to the same shape is
  // a no-op and to another shape fails, which is the shape check.
  ET_KERNEL_CHECK_MSG(
      ctx,
      executorch::runtime::resize_tensor(out, hidden.sizes()) == Error::Ok,
      InvalidArgument,
      out,
      "pipeline_marker: cannot resize out (dim %zd, numel %zd) to hidden's "
      "shape (dim %zd, numel %zd)",
      static_cast<ssize_t>(out.dim()),
      static_cast<ssize_t>(out.numel()),
      static_cast<ssize_t>(hidden.dim()),
      static_cast<ssize_t>(hidden.numel()));
  ET_KERNEL_CHECK(
      ctx,
      executorch::runtime::tensors_have_same_dim_order(hidden, out),
      InvalidArgument,
      out);

  const size_t nbytes = hidden.nbytes();
  if (nbytes > 0) {
    ET_KERNEL_CHECK_MSG(
        ctx,
        out.mutable_data_ptr() != nullptr &&
            hidden.const_data_ptr() != nullptr,
        InvalidArgument,
        out,
        "pipeline_marker: hidden or out has no data (%zu bytes expected)",
        nbytes);
    if (out.mutable_data_ptr() != hidden.const_data_ptr()) {
      std::memcpy(out.mutable_data_ptr(), hidden.const_data_ptr(), nbytes);
    }
  }

  call_count.fetch_add(1, std::memory_order_relaxed);
  // Copied before the call so a hook that reinstalls itself (or another
  // hook) does not change what this call passes.
  const InstalledHook current = installed_hook;
  if (current.hook != nullptr &&
      current.hook(out, current.user_data) == PipelineMarkerAction::kStop) {
    install_stop_log_filter();
    stop_log = {StopLog::kExpectKernelCall, 0};
    ctx.fail(kPipelineMarkerStopped);
  }
  return out;
}

} // namespace zl

extern "C" uint64_t zl_pipeline_marker_call_count(void) {
  return zl::call_count.load(std::memory_order_relaxed);
}

// Registers at library load time (static initializer). The name must match
// the `.out` schema in pipeline_marker.py, which is what to_executorch writes
// into the program's operator table.
EXECUTORCH_LIBRARY(zerolock, "pipeline_marker.out", zl::pipeline_marker_out);
