package com.zerolock.zl

import android.os.Handler
import android.os.Looper
import java.util.concurrent.CopyOnWriteArrayList

/** Where a stage run is. */
enum class RunState { IDLE, RUNNING, STOPPING, FINISHED, STOPPED, FAILED }

/**
 * What the UI shows: the state of the current or last run, its stage and
 * config, and the last error (kept until the next error, so a failed run
 * stays explained after the service has gone).
 */
data class RunnerStatus(
    val state: RunState = RunState.IDLE,
    val stage: String? = null,
    val configPath: String? = null,
    val lastError: String? = null,
)

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
