package com.zerolock.zl

import android.Manifest
import android.app.Activity
import android.content.pm.PackageManager
import android.os.Build
import android.os.Bundle
import android.widget.Button
import android.widget.EditText
import android.widget.TextView
import java.io.File

/**
 * Status UI of this device's stage (stage, state, window and micro-batch,
 * loss, PSS, battery temperature, last error) with start/stop for manual
 * runs. The run itself lives in [RunnerService]; this
 * activity only reads [StatusBoard] and sends intents, so closing it does
 * not touch the run.
 */
class MainActivity : Activity() {
    private companion object {
        const val PREFS = "zerolock"
        const val PREF_CONFIG_PATH = "config_path"
        const val REQUEST_NOTIFICATIONS = 1
        val STAGE_CONFIG = Regex("""stage_\d+\.json""")
    }

    private lateinit var stageView: TextView
    private lateinit var stateView: TextView
    private lateinit var progressView: TextView
    private lateinit var metricsView: TextView
    private lateinit var errorView: TextView
    private lateinit var configPathView: EditText
    private lateinit var startButton: Button
    private lateinit var stopButton: Button

    private val render: (RunnerStatus) -> Unit = { status ->
        stageView.text = status.stage ?: "-"
        stateView.text = status.state.name.lowercase()
        progressView.text = status.progressLine ?: "-"
        metricsView.text = status.metricsLine.ifEmpty { "-" }
        errorView.text = status.lastError ?: "-"
        val active = status.state == RunState.RUNNING || status.state == RunState.STOPPING
        startButton.isEnabled = !active
        stopButton.isEnabled = status.state == RunState.RUNNING
        if (status.configPath != null && active) configPathView.setText(status.configPath)
    }

    override fun onCreate(savedInstanceState: Bundle?) {
        super.onCreate(savedInstanceState)
        setContentView(R.layout.activity_main)
        stageView = findViewById(R.id.stage)
        stateView = findViewById(R.id.state)
        progressView = findViewById(R.id.progress)
        metricsView = findViewById(R.id.metrics)
        errorView = findViewById(R.id.last_error)
        configPathView = findViewById(R.id.config_path)
        startButton = findViewById(R.id.start)
        stopButton = findViewById(R.id.stop)

        // Default: a stage config in the app's own external files folder,
        // where `zl deploy --mode app` (or `adb push`) puts configs and
        // programs (see android_app/README.md).
        val files = getExternalFilesDir(null)
        val deployed = files?.listFiles()?.filter { STAGE_CONFIG.matches(it.name) }?.minByOrNull { it.name }
        val default = (deployed ?: File(files, "stage_0.json")).path
        configPathView.setText(getSharedPreferences(PREFS, MODE_PRIVATE).getString(PREF_CONFIG_PATH, default))

        startButton.setOnClickListener { startStage() }
        stopButton.setOnClickListener { RunnerService.stop(this) }

        if (Build.VERSION.SDK_INT >= Build.VERSION_CODES.TIRAMISU &&
            checkSelfPermission(Manifest.permission.POST_NOTIFICATIONS) != PackageManager.PERMISSION_GRANTED
        ) {
            // Without it the run still works; only the notification is hidden.
            requestPermissions(arrayOf(Manifest.permission.POST_NOTIFICATIONS), REQUEST_NOTIFICATIONS)
        }
    }

    override fun onStart() {
        super.onStart()
        StatusBoard.observe(render)
    }

    override fun onStop() {
        StatusBoard.remove(render)
        super.onStop()
    }

    private fun startStage() {
        val path = configPathView.text.toString().trim()
        // Checked here too, so a wrong path is explained at once, without a
        // service start and a notification.
        try {
            StageConfig.load(path)
        } catch (e: IllegalArgumentException) {
            StatusBoard.update { it.copy(state = RunState.FAILED, lastError = e.message) }
            return
        }
        getSharedPreferences(PREFS, MODE_PRIVATE).edit().putString(PREF_CONFIG_PATH, path).apply()
        RunnerService.start(this, path)
    }
}
