package com.zerolock.zl

/**
 * A failed native run. Thrown by libzl_jni.so (it builds this class through
 * its `(String, String)` constructor; proguard-rules.pro keeps it).
 *
 * @property code the runner's status code in lower case: `invalid_argument`,
 *   `not_found`, `io_error`, `corrupt`, `timeout`, `closed` or `internal`.
 */
class NativeRunnerException(message: String, val code: String) : RuntimeException(message)
