package com.zerolock.zl

/**
 * A native failure. Thrown by libzl_jni.so from [NativeRunner.startNative]
 * (it builds this class through its `(String, String)` constructor;
 * proguard-rules.pro keeps it), and made by [NativeStatus.failure] for a run
 * that failed on its thread. The message names the method or the stage and
 * the run folder, then the code, then the runner's own message (which names
 * the file, field or peer).
 *
 * @property code the runner's status code in lower case: `invalid_argument`,
 *   `not_found`, `io_error`, `corrupt`, `timeout`, `closed` or `internal`.
 */
class NativeRunnerException(message: String, val code: String) : RuntimeException(message)
