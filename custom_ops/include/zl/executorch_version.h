// The ExecuTorch version zl is compiled against, where the install says it:
// a source build installs runtime/core/version.h (ET_VERSION "1.5.0"); the
// pip wheel (1.5.1, what zl targets) does not.
//
// ZL_EXECUTORCH_BEFORE_1_5_1 is 1 for a source tree from before 1.5.1
// (tools/build_phone_runner.sh on a 1.5.0 checkout), whose API differs from
// 1.5.1 in a few places: no get_thread_count() without the thread pool, and
// make_tensor_ptr takes the device last.
#pragma once

#if __has_include(<executorch/runtime/core/version.h>)
#include <executorch/runtime/core/version.h>
#endif

#if defined(ET_VERSION_MAJOR) && \
    ET_VERSION_MAJOR * 10000 + ET_VERSION_MINOR * 100 + ET_VERSION_PATCH < 10501
#define ZL_EXECUTORCH_BEFORE_1_5_1 1
#else
#define ZL_EXECUTORCH_BEFORE_1_5_1 0
#endif
