package com.zerolock.zl

import android.os.Handler
import android.os.Looper
import java.util.Locale
import java.util.concurrent.CopyOnWriteArrayList

/** Where a stage run is, as the app shows it. */
enum class RunState { IDLE, RUNNING, STOPPING, FINISHED, STOPPED, FAILED }

/**
 * What the UI and the notification show: the state of the current or last
 * run, its stage and config, its progress (window, loss, PSS) from the
 * native status, the battery temperature from BatteryManager, and the last
 * error (kept until the next error, so a failed run stays explained after
 * the service has gone).
 */
data class RunnerStatus(
    val state: RunState = RunState.IDLE,
    val stage: String? = null,
    val configPath: String? = null,
    val lastError: String? = null,
    val window: Long? = null,
    val numWindows: Long? = null,
    val microBatchesDone: Long = 0,
    val numMicroBatches: Long = 0,
    val loss: Double? = null,
    val pssMib: Double? = null,
    val batteryC: Double? = null,
) {
    /** "window 3/16 · mb 13/64", or null before the first micro-batch. */
    val progressLine: String?
        get() = window?.let {
            val windows = numWindows?.let { n -> "/$n" } ?: ""
            "window ${it + 1}$windows · micro-batch $microBatchesDone/$numMicroBatches"
        }

    /** "loss 2.314 · PSS 1903 MiB · battery 36.1 °C"; unknown values are left out. */
    val metricsLine: String
        get() = listOfNotNull(
            loss?.let { String.format(Locale.US, "loss %.3f", it) },
            pssMib?.let { String.format(Locale.US, "PSS %.0f MiB", it) },
            batteryC?.let { String.format(Locale.US, "battery %.1f °C", it) },
        ).joinToString(" · ")

    /** This status with a native snapshot's progress. */
    fun withProgress(native: NativeStatus, windowSize: Long?): RunnerStatus = copy(
        window = native.window,
        numWindows = windowSize?.takeIf { it > 0 }?.let { (native.numMicroBatches + it - 1) / it },
        microBatchesDone = native.microBatchesDone,
        numMicroBatches = native.numMicroBatches,
        loss = native.loss,
        pssMib = native.pssMib,
    )
}

/**
 * The one place the service writes status to and the activity reads it
 * from (same process). Writers may be on any thread; listeners are called
 * on the main thread.
 */
object StatusBoard {
    private val mainHandler = Handler(Looper.getMainLooper())
    private val listeners = CopyOnWriteArrayList<(RunnerStatus) -> Unit>()

    @Volatile
    var current: RunnerStatus = RunnerStatus()
        private set

    fun update(transform: (RunnerStatus) -> RunnerStatus) {
        val next = synchronized(this) { transform(current).also { current = it } }
        mainHandler.post { listeners.forEach { it(next) } }
    }

    /** Adds [listener] and calls it with the current status. Main thread. */
    fun observe(listener: (RunnerStatus) -> Unit) {
        listeners.add(listener)
        listener(current)
    }

    fun remove(listener: (RunnerStatus) -> Unit) {
        listeners.remove(listener)
    }
}
