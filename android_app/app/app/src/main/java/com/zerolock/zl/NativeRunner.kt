package com.zerolock.zl

import org.json.JSONObject

/**
 * The whole native surface of the stage runner (android_app/jni/zl_jni.cpp),
 * over `zl::StageSession` (runner/include/zl/stage_session.h).
 *
 * C++ owns the run: [startNative] starts it on a native thread of its own
 * (16 MiB stack) and returns; the run writes runner.pid, runner.out,
 * runner.err and, when it ends, runner.exit into the config's `base_dir`,
 * where the host reads them over adb. Kotlin ([RunnerService]) owns the
 * lifecycle, polls [status] for the notification and the UI, and passes in
 * the battery temperature. One stage per process: a second [startNative]
 * while one runs throws [IllegalStateException].
 */
object NativeRunner {
    init {
        // libzl_jni.so binds the methods below in its JNI_OnLoad
        // (RegisterNatives), so a mismatch fails here, by name.
        System.loadLibrary("zl_jni")
    }

    /**
     * Starts the stage described by [configJson]: the same JSON as a
     * `zl_runner --config` file, plus an absolute `base_dir` (where its
     * relative paths resolve and the host files go) and, to force a resume,
     * `"resume": true`. Returns once the run's thread is started.
     *
     * @throws NativeRunnerException the JSON is not an object, has no
     *   absolute `base_dir`, the folder is not writable (`io_error`) or a
     *   field is invalid (`invalid_argument`; the message names the field,
     *   and the folder then holds runner.exit 2, as zl_runner would leave it).
     * @throws IllegalStateException a stage is already running in this process.
     */
    @JvmStatic
    external fun startNative(configJson: String)

    /**
     * Asks the running stage to stop at its next check (between
     * micro-batches or while waiting); returns at once. The run then ends as
     * `stopped` (exit status 3); its last checkpoint stands.
     *
     * @return true if a stage was running.
     */
    @JvmStatic
    external fun stopNative(): Boolean

    /** The run's state and progress as JSON; see [NativeStatus]. Cheap: poll it. */
    @JvmStatic
    external fun statusNative(): String

    /**
     * The battery temperature from BatteryManager, in °C. The runner's
     * telemetry records it where the app may not read
     * /sys/class/power_supply/battery/temp (SELinux usually denies apps).
     */
    @JvmStatic
    external fun reportBatteryTemperatureNative(celsius: Double)

    /** [statusNative], parsed. */
    fun status(): NativeStatus = NativeStatus.parse(statusNative())
}

/**
 * What `statusNative` reports (`zl::SessionStatus::to_json`). Unknown values
 * are null, never made up: no loss before the first micro-batch, no PSS
 * where /proc cannot be read.
 */
data class NativeStatus(
    /** idle, running, stopping, finished, stopped or failed. */
    val state: String,
    /** starting, loading (the program), running (micro-batches) or done. */
    val phase: String,
    val runDir: String,
    /** 0-based stage index; null before the config was read. */
    val stage: Int?,
    val numStages: Int,
    val microBatchesDone: Long,
    val numMicroBatches: Long,
    val window: Long?,
    val committedWindow: Long?,
    val loss: Double?,
    val pssMib: Double?,
    val temperatureC: Double?,
    /** 0 done, 1 failed, 2 bad config, 3 stopped; null while running. */
    val exitCode: Int?,
    val error: String?,
    val errorCode: String?,
) {
    val ended: Boolean get() = state == "finished" || state == "stopped" || state == "failed"

    /** A failed run as the exception Kotlin code handles, naming the stage and folder; null otherwise. */
    fun failure(): NativeRunnerException? {
        if (state != "failed" || error == null) return null
        val where = if (stage != null) "stage $stage (run folder $runDir)" else "run folder $runDir"
        return NativeRunnerException("$where: ${errorCode ?: "internal"}: $error", errorCode ?: "internal")
    }

    companion object {
        fun parse(json: String): NativeStatus {
            val o = JSONObject(json)
            fun optLong(name: String): Long? = if (o.isNull(name)) null else o.getLong(name)
            fun optDouble(name: String): Double? = if (o.isNull(name)) null else o.getDouble(name)
            fun optString(name: String): String? = if (o.isNull(name)) null else o.getString(name)
            return NativeStatus(
                state = o.getString("state"),
                phase = o.optString("phase", ""),
                runDir = o.optString("run_dir", ""),
                stage = optLong("stage")?.toInt(),
                numStages = o.optInt("num_stages", 0),
                microBatchesDone = o.optLong("micro_batches_done", 0),
                numMicroBatches = o.optLong("num_micro_batches", 0),
                window = optLong("window"),
                committedWindow = optLong("committed_window"),
                loss = optDouble("loss"),
                pssMib = optDouble("pss_mib"),
                temperatureC = optDouble("temperature_c"),
                exitCode = optLong("exit_code")?.toInt(),
                error = optString("error"),
                errorCode = optString("error_code"),
            )
        }
    }
}
