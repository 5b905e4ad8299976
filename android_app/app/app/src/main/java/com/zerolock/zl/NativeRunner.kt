package com.zerolock.zl

/**
 * The whole native surface of the stage runner (android_app/native/jni/zl_jni.cpp).
 *
 * C++ owns the compute: one call runs a stage to its end. Everything around
 * it (which thread, when to start and stop, what the user sees) belongs to
 * [RunnerService]. One stage per process: the native side refuses a second
 * concurrent run.
 */
object NativeRunner {
    init {
        // libzl_jni.so binds the two methods below in its JNI_OnLoad
        // (RegisterNatives), so a mismatch fails here, by name.
        System.loadLibrary("zl_jni")
    }

    /**
     * Runs the stage described by the JSON config at [configPath] (the same
     * file `zl_runner --config` takes) on the calling thread, until it has
     * trained every micro-batch or [nativeStop] is called. Blocks for as
     * long as the run lasts; never call it on the main thread.
     *
     * @throws NativeRunnerException the config is unreadable or invalid, or
     *   the run failed; the message names the config path, [NativeRunnerException.code]
     *   the kind of failure.
     * @throws IllegalStateException a stage is already running in this process.
     */
    @JvmStatic
    external fun nativeRun(configPath: String)

    /**
     * Asks the running stage to stop at its next check (between
     * micro-batches); returns at once. `nativeRun` then returns, or throws
     * if the stage reports the interruption as an error.
     *
     * @return true if a stage was running.
     */
    @JvmStatic
    external fun nativeStop(): Boolean
}
