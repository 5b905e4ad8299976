package com.zerolock.zl

import android.app.Notification
import android.app.NotificationChannel
import android.app.NotificationManager
import android.app.PendingIntent
import android.app.Service
import android.content.Context
import android.content.Intent
import android.content.pm.ServiceInfo
import android.os.Build
import android.os.Handler
import android.os.IBinder
import android.os.Looper
import android.os.PowerManager
import android.util.Log
import androidx.core.app.NotificationCompat
import androidx.core.app.ServiceCompat
import androidx.core.content.ContextCompat

/**
 * Runs one pipeline stage in the foreground: validates the config, holds a
 * partial wake lock, calls [NativeRunner.nativeRun] on a thread of its own,
 * and keeps the notification and [StatusBoard] in step. Stops the stage on
 * ACTION_STOP (the notification's button, the activity, or adb) and goes
 * away when the run ends.
 *
 * Start over adb (the service is guarded by the DUMP permission, which the
 * shell holds):
 *
 *     adb shell am start-foreground-service -n com.zerolock.zl/.RunnerService \
 *       -a com.zerolock.zl.action.START --es config_path /sdcard/Android/data/com.zerolock.zl/files/stage1.json
 *
 * START_NOT_STICKY: if the process dies, the coordinator decides whether and
 * where the stage restarts (it resumes from its last checkpoint).
 */
class RunnerService : Service() {
    companion object {
        const val ACTION_START = "com.zerolock.zl.action.START"
        const val ACTION_STOP = "com.zerolock.zl.action.STOP"
        const val EXTRA_CONFIG_PATH = "config_path"

        private const val TAG = "zl.RunnerService"
        private const val CHANNEL_ID = "zl_stage"
        private const val NOTIFICATION_ID = 1

        // ExecuTorch runs the whole program on this thread; 16 MiB leaves
        // room for the kernels' stack use beyond the default ~1 MiB.
        private const val WORKER_STACK_BYTES = 16L shl 20

        fun start(context: Context, configPath: String) {
            val intent = Intent(context, RunnerService::class.java)
                .setAction(ACTION_START)
                .putExtra(EXTRA_CONFIG_PATH, configPath)
            ContextCompat.startForegroundService(context, intent)
        }

        fun stop(context: Context) {
            context.startService(Intent(context, RunnerService::class.java).setAction(ACTION_STOP))
        }
    }

    private val mainHandler = Handler(Looper.getMainLooper())

    // Main thread only.
    private var worker: Thread? = null
    private var wakeLock: PowerManager.WakeLock? = null

    // Set on the main thread, read by the worker when the run returns.
    @Volatile
    private var stopRequested = false

    override fun onBind(intent: Intent?): IBinder? = null

    override fun onStartCommand(intent: Intent?, flags: Int, startId: Int): Int {
        when (intent?.action) {
            ACTION_START -> {
                // Started with startForegroundService: enter the foreground
                // promptly whatever happens next, so this comes first.
                enterForeground(StatusBoard.current)
                startStage(intent.getStringExtra(EXTRA_CONFIG_PATH))
            }
            ACTION_STOP -> requestStop()
            else -> {
                Log.w(TAG, "ignoring intent with action ${intent?.action}")
                finishIfIdle()
            }
        }
        return START_NOT_STICKY
    }

    override fun onDestroy() {
        // The system is taking the service down (or the app is being
        // stopped): ask the stage to stop; its last checkpoint stands.
        if (worker?.isAlive == true) {
            stopRequested = true
            NativeRunner.nativeStop()
        }
        releaseWakeLock()
        super.onDestroy()
    }

    private fun startStage(configPath: String?) {
        if (worker?.isAlive == true) {
            val running = StatusBoard.current.configPath
            Log.w(TAG, "a stage is already running ($running); ignoring start of $configPath")
            StatusBoard.update { it.copy(lastError = "already running $running; stop it before starting $configPath") }
            return
        }
        val config = try {
            StageConfig.load(configPath ?: "")
        } catch (e: IllegalArgumentException) {
            Log.e(TAG, e.message ?: "invalid stage config")
            StatusBoard.update { RunnerStatus(RunState.FAILED, null, configPath, e.message) }
            finishIfIdle()
            return
        }
        stopRequested = false
        StatusBoard.update { RunnerStatus(RunState.RUNNING, config.label, config.path, it.lastError) }
        acquireWakeLock()
        notifyStatus(StatusBoard.current)
        worker = Thread(null, { runStage(config) }, "zl-stage", WORKER_STACK_BYTES).also { it.start() }
    }

    /** Worker thread: the whole run, then hands back to the main thread. */
    private fun runStage(config: StageConfig) {
        Log.i(TAG, "running ${config.label} from ${config.path}")
        val ended: RunnerStatus = try {
            NativeRunner.nativeRun(config.path)
            val state = if (stopRequested) RunState.STOPPED else RunState.FINISHED
            RunnerStatus(state, config.label, config.path, StatusBoard.current.lastError)
        } catch (e: NativeRunnerException) {
            if (stopRequested) {
                // The interruption we asked for, reported as an error by the runner.
                Log.i(TAG, "stopped: ${e.message}")
                RunnerStatus(RunState.STOPPED, config.label, config.path, StatusBoard.current.lastError)
            } else {
                Log.e(TAG, "run failed (${e.code}): ${e.message}")
                RunnerStatus(RunState.FAILED, config.label, config.path, e.message)
            }
        } catch (e: RuntimeException) {
            // IllegalStateException (a run already in the process) and the like.
            Log.e(TAG, "run failed", e)
            RunnerStatus(RunState.FAILED, config.label, config.path, e.toString())
        } catch (e: LinkageError) {
            // UnsatisfiedLinkError, or its wrappers from NativeRunner's initializer.
            Log.e(TAG, "cannot load libzl_jni.so", e)
            RunnerStatus(RunState.FAILED, config.label, config.path, "cannot load libzl_jni.so: ${e.message}")
        }
        StatusBoard.update { ended }
        mainHandler.post { onStageEnded(ended) }
    }

    private fun requestStop() {
        if (worker?.isAlive != true) {
            // Nothing to stop. If this start came through
            // startForegroundService (adb), the system still expects the
            // foreground call; where it is not allowed, there is nothing to do.
            try {
                enterForeground(StatusBoard.current)
            } catch (e: IllegalStateException) {
                Log.i(TAG, "stop with no stage running: ${e.message}")
            }
            finishIfIdle()
            return
        }
        stopRequested = true
        StatusBoard.update { it.copy(state = RunState.STOPPING) }
        notifyStatus(StatusBoard.current)
        NativeRunner.nativeStop()
    }

    private fun onStageEnded(ended: RunnerStatus) {
        worker = null
        releaseWakeLock()
        // Leave the final notification up (not ongoing) so the outcome stays
        // visible after the service is gone.
        ServiceCompat.stopForeground(this, ServiceCompat.STOP_FOREGROUND_DETACH)
        notifyStatus(ended)
        stopSelf()
    }

    private fun finishIfIdle() {
        if (worker?.isAlive == true) return
        ServiceCompat.stopForeground(this, ServiceCompat.STOP_FOREGROUND_REMOVE)
        stopSelf()
    }

    private fun acquireWakeLock() {
        if (wakeLock?.isHeld == true) return
        val power = getSystemService(PowerManager::class.java)
        // Released in onStageEnded / onDestroy: a run lasts as long as it
        // lasts, so there is no fixed timeout to give.
        wakeLock = power.newWakeLock(PowerManager.PARTIAL_WAKE_LOCK, "zerolock:stage").apply {
            setReferenceCounted(false)
            acquire()
        }
    }

    private fun releaseWakeLock() {
        wakeLock?.takeIf { it.isHeld }?.release()
        wakeLock = null
    }

    private fun enterForeground(status: RunnerStatus) {
        val type = if (Build.VERSION.SDK_INT >= Build.VERSION_CODES.UPSIDE_DOWN_CAKE) {
            ServiceInfo.FOREGROUND_SERVICE_TYPE_SPECIAL_USE
        } else {
            0
        }
        ServiceCompat.startForeground(this, NOTIFICATION_ID, buildNotification(status), type)
    }

    private fun notifyStatus(status: RunnerStatus) {
        getSystemService(NotificationManager::class.java).notify(NOTIFICATION_ID, buildNotification(status))
    }

    private fun buildNotification(status: RunnerStatus): Notification {
        val manager = getSystemService(NotificationManager::class.java)
        if (manager.getNotificationChannel(CHANNEL_ID) == null) {
            manager.createNotificationChannel(
                NotificationChannel(CHANNEL_ID, getString(R.string.channel_name), NotificationManager.IMPORTANCE_LOW),
            )
        }
        val active = status.state == RunState.RUNNING || status.state == RunState.STOPPING
        val openApp = PendingIntent.getActivity(
            this, 0, Intent(this, MainActivity::class.java), PendingIntent.FLAG_IMMUTABLE,
        )
        val text = buildString {
            append(status.state.name.lowercase())
            if (status.state == RunState.FAILED && status.lastError != null) append(": ").append(status.lastError)
        }
        val builder = NotificationCompat.Builder(this, CHANNEL_ID)
            .setSmallIcon(android.R.drawable.stat_notify_sync)
            .setContentTitle("ZeroLock ${status.stage ?: "stage"}")
            .setContentText(text)
            .setStyle(NotificationCompat.BigTextStyle().bigText(text))
            .setContentIntent(openApp)
            .setOngoing(active)
            .setOnlyAlertOnce(true)
        if (status.state == RunState.RUNNING) {
            val stop = PendingIntent.getService(
                this, 1, Intent(this, RunnerService::class.java).setAction(ACTION_STOP), PendingIntent.FLAG_IMMUTABLE,
            )
            builder.addAction(0, getString(R.string.stop), stop)
        }
        return builder.build()
    }
}
