package com.zerolock.zl

import android.app.Notification
import android.app.NotificationChannel
import android.app.NotificationManager
import android.app.PendingIntent
import android.app.Service
import android.content.Context
import android.content.Intent
import android.content.IntentFilter
import android.content.pm.ServiceInfo
import android.os.BatteryManager
import android.os.Build
import android.os.Handler
import android.os.IBinder
import android.os.Looper
import android.os.PowerManager
import android.os.Process
import android.os.SystemClock
import android.util.Log
import androidx.core.app.NotificationCompat
import androidx.core.app.ServiceCompat
import androidx.core.content.ContextCompat
import java.io.File
import java.io.IOException
import org.json.JSONObject

/**
 * Runs one pipeline stage in the foreground: validates the config, starts
 * the native run ([NativeRunner.startNative], which runs on a native thread
 * of its own), holds a partial wake lock, polls the run once a second for
 * the notification and [StatusBoard] (stage, window, loss, PSS, battery
 * temperature), and goes away when the run ends. Stops the stage on
 * ACTION_STOP (the notification's button, the activity, or adb).
 *
 * Each poll also writes the phone's [DeviceReadings] (battery level, power,
 * temperature, PowerManager's thermal status) to device_state.json in the
 * files folder, for `zl train`'s device policies: the host decides when a
 * too hot, too flat or unplugged phone pauses (it stops the stage with
 * ACTION_STOP after a window and starts it again with `resume`); while the
 * service is gone the host reads `dumpsys battery` instead.
 *
 * Driven by intents, so the host runs it without touching the screen (the
 * service is guarded by the DUMP permission, which the adb shell holds):
 *
 *     D=/sdcard/Android/data/com.zerolock.zl/files
 *     adb shell am start-foreground-service -n com.zerolock.zl/.RunnerService \
 *       -a com.zerolock.zl.action.START --es config $D/stage_1.json [--ez resume true] [--es run_key HEX]
 *     adb shell am start-foreground-service -n com.zerolock.zl/.RunnerService -a com.zerolock.zl.action.STOP
 *     adb shell am start-foreground-service -n com.zerolock.zl/.RunnerService -a com.zerolock.zl.action.PREPARE
 *
 * PREPARE creates the app's external files folder and writes app.json there
 * (package, version, folder), so the host knows the app starts and where to
 * push. A run leaves runner.pid, runner.out, runner.err and, at its end,
 * runner.exit in the config's folder (zl_device/devices/app.py reads them); a start
 * refused before the native run began leaves the same files, with exit
 * status 2 (bad config) or 1.
 *
 * START_NOT_STICKY: if the process dies, the coordinator decides whether and
 * where the stage restarts (it resumes from its last checkpoint).
 */
class RunnerService : Service() {
    companion object {
        const val ACTION_START = "com.zerolock.zl.action.START"
        const val ACTION_STOP = "com.zerolock.zl.action.STOP"
        const val ACTION_PREPARE = "com.zerolock.zl.action.PREPARE"
        const val EXTRA_CONFIG = "config"
        const val EXTRA_RESUME = "resume"
        /** The run key (64 hex characters); kept in private storage, never in the shared files folder. */
        const val EXTRA_RUN_KEY = "run_key"
        /** Where a START's run key lives while its stage runs (under filesDir, private to the app). */
        const val PRIVATE_RUN_KEY = "run.key"
        const val APP_INFO_FILE = "app.json"

        private const val TAG = "zl.RunnerService"
        private const val CHANNEL_ID = "zl_stage"
        private const val NOTIFICATION_ID = 1
        private const val POLL_MS = 1000L

        fun start(context: Context, configPath: String, resume: Boolean = false) {
            val intent = Intent(context, RunnerService::class.java)
                .setAction(ACTION_START)
                .putExtra(EXTRA_CONFIG, configPath)
                .putExtra(EXTRA_RESUME, resume)
            ContextCompat.startForegroundService(context, intent)
        }

        fun stop(context: Context) {
            context.startService(Intent(context, RunnerService::class.java).setAction(ACTION_STOP))
        }
    }

    private val mainHandler = Handler(Looper.getMainLooper())

    // Main thread only.
    private var config: StageConfig? = null
    private var wakeLock: PowerManager.WakeLock? = null
    private var polling = false
    private var readingsFailureLogged = false

    private val poll = object : Runnable {
        override fun run() {
            if (!polling) return
            pollRun()
            if (polling) mainHandler.postDelayed(this, POLL_MS)
        }
    }

    override fun onBind(intent: Intent?): IBinder? = null

    override fun onStartCommand(intent: Intent?, flags: Int, startId: Int): Int {
        when (intent?.action) {
            ACTION_START -> {
                // Started with startForegroundService: enter the foreground
                // promptly whatever happens next, so this comes first.
                enterForeground(StatusBoard.current)
                startStage(intent.getStringExtra(EXTRA_CONFIG), intent.getBooleanExtra(EXTRA_RESUME, false),
                    intent.getStringExtra(EXTRA_RUN_KEY))
            }
            ACTION_STOP -> requestStop()
            ACTION_PREPARE -> {
                enterForegroundIfAllowed()
                if (!polling) forgetRunKey()
                writeAppInfo()
                finishIfIdle()
            }
            else -> {
                Log.w(TAG, "ignoring intent with action ${intent?.action}")
                enterForegroundIfAllowed()
                finishIfIdle()
            }
        }
        return START_NOT_STICKY
    }

    override fun onDestroy() {
        // The system is taking the service down (or the app is being
        // stopped): ask the stage to stop; its last checkpoint stands.
        if (polling) NativeRunner.stopNative()
        polling = false
        mainHandler.removeCallbacks(poll)
        releaseWakeLock()
        super.onDestroy()
    }

    private fun privateRunKey(): File = File(filesDir, PRIVATE_RUN_KEY)

    /** The run key leaves the phone with the run (ended, refused, or a PREPARE of the next one). */
    private fun forgetRunKey() {
        val key = privateRunKey()
        if (key.exists() && !key.delete()) Log.w(TAG, "cannot delete ${key.path}")
    }

    private fun startStage(configPath: String?, resume: Boolean, runKey: String?) {
        if (polling) {
            val running = StatusBoard.current.configPath
            Log.w(TAG, "a stage is already running ($running); ignoring start of $configPath")
            StatusBoard.update { it.copy(lastError = "already running $running; stop it before starting $configPath") }
            return
        }
        val loaded = try {
            StageConfig.load(configPath ?: "")
        } catch (e: IllegalArgumentException) {
            refuse(configPath, e.message ?: "invalid stage config", exitCode = 2)
            return
        }
        val keyFile = try {
            runKey?.let { StageConfig.writeRunKey(it, privateRunKey()) }
        } catch (e: IllegalArgumentException) {
            refuse(configPath, e.message ?: "invalid run key", exitCode = 2)
            return
        } catch (e: IOException) {
            refuse(configPath, "cannot write the run key to ${privateRunKey().path}: ${e.message}", exitCode = 1)
            return
        }
        try {
            NativeRunner.startNative(loaded.toNativeJson(resume, keyFile))
        } catch (e: NativeRunnerException) {
            // Native code has written runner.exit where it could (a bad field: 2).
            Log.e(TAG, "start refused (${e.code}): ${e.message}")
            forgetRunKey()
            StatusBoard.update { RunnerStatus(RunState.FAILED, loaded.label, loaded.path, e.message) }
            finishIfIdle()
            return
        } catch (e: IllegalStateException) {
            refuse(configPath, e.message ?: "a stage is already running", exitCode = null)
            return
        } catch (e: LinkageError) {
            // UnsatisfiedLinkError, or its wrappers from NativeRunner's initializer.
            refuse(configPath, "cannot load libzl_jni.so: ${e.message}", exitCode = 1)
            return
        }
        Log.i(TAG, "running ${loaded.label} from ${loaded.path}${if (resume) " (resume)" else ""}")
        config = loaded
        StatusBoard.update { RunnerStatus(RunState.RUNNING, loaded.label, loaded.path, it.lastError) }
        acquireWakeLock()
        notifyStatus(StatusBoard.current)
        polling = true
        mainHandler.post(poll)
    }

    /**
     * A start that never reached the native run: shown, logged and, when the
     * config's folder exists, recorded for the host as zl_runner would
     * (runner.pid, the message in runner.err, runner.exit [exitCode]).
     */
    private fun refuse(configPath: String?, message: String, exitCode: Int?) {
        Log.e(TAG, message)
        if (!polling) forgetRunKey()
        StatusBoard.update { RunnerStatus(RunState.FAILED, null, configPath, message) }
        val folder = configPath?.let { File(it.trim()).absoluteFile.parentFile }
        if (exitCode != null && folder != null && folder.isDirectory) {
            try {
                File(folder, "runner.exit").delete()
                File(folder, "runner.pid").writeText("${Process.myPid()}\n")
                File(folder, "runner.err").appendText("zl.RunnerService: $message\n")
                File(folder, "runner.exit").writeText("$exitCode\n")
            } catch (e: IOException) {
                Log.w(TAG, "cannot record the refusal in $folder: ${e.message}")
            }
        }
        finishIfIdle()
    }

    private fun requestStop() {
        if (!polling) {
            // Nothing to stop. If this start came through
            // startForegroundService (adb), the system still expects the
            // foreground call.
            enterForegroundIfAllowed()
            finishIfIdle()
            return
        }
        NativeRunner.stopNative()
        StatusBoard.update { it.copy(state = RunState.STOPPING) }
        notifyStatus(StatusBoard.current)
    }

    /** Main thread, once a second while a run is going: battery in, progress and device readings out. */
    private fun pollRun() {
        val readings = readDevice()
        val battery = readings.temperatureC
        if (battery != null) NativeRunner.reportBatteryTemperatureNative(battery)
        writeReadings(readings)
        val native = NativeRunner.status()
        val windowSize = config?.windowSize
        StatusBoard.update { it.withProgress(native, windowSize).copy(batteryC = battery ?: it.batteryC) }
        if (native.ended) {
            onStageEnded(native)
        } else {
            notifyStatus(StatusBoard.current)
        }
    }

    private fun onStageEnded(native: NativeStatus) {
        polling = false
        mainHandler.removeCallbacks(poll)
        forgetRunKey()
        forgetReadings()
        val failure = native.failure()
        val state = when (native.state) {
            "finished" -> RunState.FINISHED
            "stopped" -> RunState.STOPPED
            else -> RunState.FAILED
        }
        if (failure != null) {
            Log.e(TAG, "run failed (${failure.code}): ${failure.message}")
        } else {
            Log.i(TAG, "run ${native.state}, exit status ${native.exitCode}")
        }
        StatusBoard.update { it.copy(state = state, lastError = failure?.message ?: it.lastError) }
        config = null
        releaseWakeLock()
        // Leave the final notification up (not ongoing) so the outcome stays
        // visible after the service is gone.
        ServiceCompat.stopForeground(this, ServiceCompat.STOP_FOREGROUND_DETACH)
        notifyStatus(StatusBoard.current)
        stopSelf()
    }

    /**
     * The phone's state now: BatteryManager's sticky ACTION_BATTERY_CHANGED
     * (level, scale, plugged, temperature) and, from Android 10,
     * PowerManager's thermal status; null fields for what it does not give.
     */
    private fun readDevice(): DeviceReadings {
        val battery = registerReceiver(null, IntentFilter(Intent.ACTION_BATTERY_CHANGED))
        val thermal = if (Build.VERSION.SDK_INT >= Build.VERSION_CODES.Q) {
            getSystemService(PowerManager::class.java)?.currentThermalStatus
        } else {
            null
        }
        return DeviceReadings.fromBattery(
            level = battery?.getIntExtra(BatteryManager.EXTRA_LEVEL, -1) ?: -1,
            scale = battery?.getIntExtra(BatteryManager.EXTRA_SCALE, -1) ?: -1,
            plugged = battery?.getIntExtra(BatteryManager.EXTRA_PLUGGED, -1) ?: -1,
            temperatureTenths = battery?.getIntExtra(BatteryManager.EXTRA_TEMPERATURE, Int.MIN_VALUE)
                ?: Int.MIN_VALUE,
            thermalStatus = thermal,
            elapsedRealtimeMs = SystemClock.elapsedRealtime(),
            tUnixMs = System.currentTimeMillis(),
        )
    }

    /** device_state.json for the host's device policies; a failure is logged once (until a write works). */
    private fun writeReadings(readings: DeviceReadings) {
        val folder = getExternalFilesDir(null) ?: return
        try {
            readings.writeTo(folder)
            readingsFailureLogged = false
        } catch (e: IOException) {
            if (!readingsFailureLogged) Log.w(TAG, "cannot write ${DeviceReadings.FILE} in $folder: ${e.message}")
            readingsFailureLogged = true
        }
    }

    /** The stage ended: its readings would only grow stale (the host falls back to dumpsys either way). */
    private fun forgetReadings() {
        getExternalFilesDir(null)?.let { File(it, DeviceReadings.FILE).delete() }
    }

    /** app.json in the external files folder: the host's proof that the app starts, and where to push. */
    private fun writeAppInfo() {
        val folder = getExternalFilesDir(null)
        if (folder == null) {
            Log.e(TAG, "no external files folder (shared storage not mounted?)")
            return
        }
        val info = packageManager.getPackageInfo(packageName, 0)
        val versionCode = if (Build.VERSION.SDK_INT >= Build.VERSION_CODES.P) {
            info.longVersionCode
        } else {
            @Suppress("DEPRECATION")
            info.versionCode.toLong()
        }
        val json = JSONObject()
            .put("package", packageName)
            .put("version_name", info.versionName ?: "")
            .put("version_code", versionCode)
            .put("files_dir", folder.absolutePath)
        try {
            File(folder, APP_INFO_FILE).writeText(json.toString() + "\n")
            Log.i(TAG, "prepared $folder")
        } catch (e: IOException) {
            Log.e(TAG, "cannot write $APP_INFO_FILE in $folder: ${e.message}")
        }
    }

    private fun finishIfIdle() {
        if (polling) return
        ServiceCompat.stopForeground(this, ServiceCompat.STOP_FOREGROUND_REMOVE)
        stopSelf()
    }

    private fun acquireWakeLock() {
        if (wakeLock?.isHeld == true) return
        // getSystemService(Class) is documented to return null for a service
        // the device lacks: then the run goes on without a wake lock.
        val power = getSystemService(PowerManager::class.java) ?: run {
            Log.w(TAG, "no PowerManager: running without a wake lock")
            return
        }
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

    /** For intents that may come through startForegroundService (adb) but start no run. */
    private fun enterForegroundIfAllowed() {
        try {
            enterForeground(StatusBoard.current)
        } catch (e: IllegalStateException) {
            Log.i(TAG, "not entering the foreground: ${e.message}")
        }
    }

    private fun notifyStatus(status: RunnerStatus) {
        getSystemService(NotificationManager::class.java)?.notify(NOTIFICATION_ID, buildNotification(status))
    }

    private fun buildNotification(status: RunnerStatus): Notification {
        val manager = getSystemService(NotificationManager::class.java)
        if (manager != null && manager.getNotificationChannel(CHANNEL_ID) == null) {
            manager.createNotificationChannel(
                NotificationChannel(CHANNEL_ID, getString(R.string.channel_name), NotificationManager.IMPORTANCE_LOW),
            )
        }
        val active = status.state == RunState.RUNNING || status.state == RunState.STOPPING
        val openApp = PendingIntent.getActivity(
            this, 0, Intent(this, MainActivity::class.java), PendingIntent.FLAG_IMMUTABLE,
        )
        val summary = listOfNotNull(status.state.name.lowercase(), status.progressLine).joinToString(" · ")
        val details = buildString {
            append(summary)
            if (status.metricsLine.isNotEmpty()) append('\n').append(status.metricsLine)
            if (status.state == RunState.FAILED && status.lastError != null) append('\n').append(status.lastError)
        }
        val builder = NotificationCompat.Builder(this, CHANNEL_ID)
            .setSmallIcon(android.R.drawable.stat_notify_sync)
            .setContentTitle("ZeroLock ${status.stage ?: "stage"}")
            .setContentText(summary)
            .setStyle(NotificationCompat.BigTextStyle().bigText(details))
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
