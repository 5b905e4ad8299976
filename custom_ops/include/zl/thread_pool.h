// ExecuTorch's CPU thread pool, which parallel_for (and zl's fast kernels,
// docs/design#kernels) run on. The wheel ships libexecutorch_threadpool.so
// without its header, and an Android build may leave the pool out, so these
// declarations (matching the library's exported symbols, non-virtual
// members) are weak: without the library get_threadpool's address is null.
#pragma once

#include <cstddef>
#include <cstdint>

#include <executorch/runtime/kernel/thread_parallel_interface.h>

#include "zl/executorch_version.h"

namespace executorch::extension::threadpool {
class ThreadPool {
 public:
  __attribute__((weak)) bool _unsafe_reset_threadpool(uint32_t num_threads);
  __attribute__((weak)) size_t get_thread_count() const;
};
__attribute__((weak)) ThreadPool* get_threadpool();
}  // namespace executorch::extension::threadpool

namespace zl {

/// ExecuTorch's thread pool, or null in a build without one (the weak
/// get_threadpool is unresolved) or where it could not start.
inline executorch::extension::threadpool::ThreadPool* thread_pool() {
  namespace tp = executorch::extension::threadpool;
  return &tp::get_threadpool != nullptr ? tp::get_threadpool() : nullptr;
}

/// Resizes ExecuTorch's thread pool to `threads`; false when this build has
/// no pool or the pool refused.
inline bool reset_thread_pool(uint32_t threads) {
  auto* pool = thread_pool();
  return pool != nullptr && pool->_unsafe_reset_threadpool(threads);
}

/// The threads parallel_for spreads work over. Before ExecuTorch 1.5.1 there
/// is no get_thread_count(): the pool says it where the build has one
/// (ET_USE_THREADPOOL), and parallel_for runs inline (one thread) where not.
inline int64_t parallel_thread_count() {
#if !ZL_EXECUTORCH_BEFORE_1_5_1
  return executorch::extension::get_thread_count();
#elif defined(ET_USE_THREADPOOL)
  namespace tp = executorch::extension::threadpool;
  auto* pool = thread_pool();
  return pool != nullptr && &tp::ThreadPool::get_thread_count != nullptr
             ? static_cast<int64_t>(pool->get_thread_count())
             : 1;
#else
  return 1;
#endif
}

/// True when this build has ExecuTorch's thread pool.
inline bool has_thread_pool() { return thread_pool() != nullptr; }

}  // namespace zl
