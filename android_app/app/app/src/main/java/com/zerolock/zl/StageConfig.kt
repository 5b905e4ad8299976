package com.zerolock.zl

import java.io.File
import org.json.JSONException
import org.json.JSONObject

/**
 * What the app checks of a stage config before handing it to the native
 * runner: that the file is there and readable by this app, and which stage
 * it describes (for the status UI). The runner validates every field again
 * with messages that name them; this only catches what would otherwise
 * surface late or unclearly (a path the app cannot read, a file that is not
 * a stage config at all).
 */
data class StageConfig(
    val path: String,
    val stageIndex: Int,
    val numStages: Int,
    /** Micro-batches per update window (for "window 3/16" in the UI); 0 if the file has none. */
    val windowSize: Long,
    private val text: String,
) {
    /** "stage 1 of 3", as the UI shows it (1-based). */
    val label: String get() = "stage ${stageIndex + 1} of $numStages"

    /** The folder of the config file: relative paths resolve here, and the run's host files go here. */
    val folder: File get() = File(path).absoluteFile.parentFile ?: File("/")

    /**
     * What [NativeRunner.startNative] takes: the file's JSON with `base_dir`
     * made absolute (the file's folder, or its own `base_dir` resolved
     * against it) and, with [resume], `"resume": true` (as `zl_runner --resume`).
     * With [runKeyFile] (the key the START intent carried, written to the
     * app's private storage), `run_key_file` names that file instead.
     */
    fun toNativeJson(resume: Boolean, runKeyFile: File? = null): String {
        val json = JSONObject(text)
        if (runKeyFile != null) json.put("run_key_file", runKeyFile.absolutePath)
        val own = json.optString("base_dir", "")
        val base = when {
            own.isEmpty() -> folder
            File(own).isAbsolute -> File(own)
            else -> File(folder, own)
        }
        json.put("base_dir", base.path)
        if (resume) json.put("resume", true)
        return json.toString()
    }

    companion object {
        /** A stage config is a few hundred bytes; anything this big is the wrong file. */
        private const val MAX_BYTES = 1L shl 20

        /**
         * Writes the run key of a START intent to [file] (in the app's private
         * storage, never in the shared files folder other apps may read) and
         * returns it.
         *
         * @throws IllegalArgumentException when [hex] is not 64 hex characters;
         *   the message never contains the key.
         */
        fun writeRunKey(hex: String, file: File): File {
            val key = hex.trim()
            require(key.length == 64 && key.all { it in '0'..'9' || it in 'a'..'f' || it in 'A'..'F' }) {
                "the START intent's run_key is ${key.length} characters, not 64 hex characters; " +
                    "send the run's key file content (zl train does)"
            }
            file.parentFile?.mkdirs()
            file.delete()
            file.writeText(key + "\n")
            // Private storage is the app's alone already; owner-only in case the folder is not.
            file.setReadable(false, false)
            file.setReadable(true, true)
            file.setWritable(false, false)
            file.setWritable(true, true)
            return file
        }

        /**
         * Reads and checks the config at [path].
         *
         * @throws IllegalArgumentException with a message that names the path,
         *   what was wrong and what is expected.
         */
        fun load(path: String): StageConfig {
            val trimmed = path.trim()
            require(trimmed.isNotEmpty()) { "no stage config path given" }
            val file = File(trimmed)
            require(file.isAbsolute) { "stage config path '$trimmed' is relative; give an absolute path" }
            require(file.isFile) {
                "stage config '$trimmed' does not exist or is not a file " +
                    "(the app reads its own storage, e.g. /sdcard/Android/data/com.zerolock.zl/files/; " +
                    "it cannot read /data/local/tmp)"
            }
            require(file.canRead()) { "stage config '$trimmed' is not readable by the app" }
            require(file.length() <= MAX_BYTES) {
                "stage config '$trimmed' is ${file.length()} bytes; expected a small JSON file (<= $MAX_BYTES)"
            }
            val text = file.readText()
            val json = try {
                JSONObject(text)
            } catch (e: JSONException) {
                throw IllegalArgumentException("stage config '$trimmed' is not a JSON object: ${e.message}")
            }
            val stageIndex = intField(json, "stage_index", trimmed)
            val numStages = intField(json, "num_stages", trimmed)
            require(numStages >= 1 && stageIndex in 0 until numStages) {
                "stage config '$trimmed': stage_index $stageIndex, num_stages $numStages; " +
                    "expected 0 <= stage_index < num_stages"
            }
            return StageConfig(trimmed, stageIndex, numStages, json.optLong("window_size", 0), text)
        }

        private fun intField(json: JSONObject, name: String, path: String): Int {
            require(json.has(name)) { "stage config '$path' has no field '$name'" }
            val value = json.get(name)
            require(value is Int || (value is Long && value in Int.MIN_VALUE..Int.MAX_VALUE)) {
                "stage config '$path': field '$name' is $value; expected an integer"
            }
            return (value as Number).toInt()
        }
    }
}
