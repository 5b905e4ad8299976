package com.zerolock.zl

import java.io.File
import java.io.IOException
import org.json.JSONObject

/**
 * The phone's heat and power, as `zl train`'s device policies
 * (`--max-temperature`, `--min-battery`, `--require-charging`;
 * docs/design#device-policies) read them in `--mode app`. [RunnerService] takes them once a second
 * while a stage runs, from BatteryManager's sticky ACTION_BATTERY_CHANGED and
 * `PowerManager.getThermalStatus()`, and writes them to [FILE] in the app's
 * files folder; the host reads that file over adb together with the phone's
 * `/proc/uptime`, so it knows how old the reading is on the phone's own clock
 * (zl_device/devices/readings.py). The host decides about pauses; the app
 * only reports.
 *
 * No android.* here, so the rules are unit-tested on the host JVM. A value the
 * phone did not give is null, never made up.
 */
data class DeviceReadings(
    /** Battery temperature in °C. */
    val temperatureC: Double?,
    /** Battery level, 0-100. */
    val batteryPct: Double?,
    /** On external power: a charger, USB, a dock or a wireless pad (BatteryManager's `plugged` is not 0). */
    val charging: Boolean?,
    /** PowerManager's thermal status, 0 (NONE) to 6 (SHUTDOWN); null below Android 10. */
    val thermalStatus: Int?,
    /** SystemClock.elapsedRealtime() when read: time since boot, the clock /proc/uptime counts. */
    val elapsedRealtimeMs: Long,
    val tUnixMs: Long,
) {
    fun toJson(): String = JSONObject()
        .put("temperature_c", temperatureC ?: JSONObject.NULL)
        .put("battery_pct", batteryPct ?: JSONObject.NULL)
        .put("charging", charging ?: JSONObject.NULL)
        .put("thermal_status", thermalStatus ?: JSONObject.NULL)
        .put("elapsed_realtime_ms", elapsedRealtimeMs)
        .put("t_unix_ms", tUnixMs)
        .toString()

    /**
     * Writes [FILE] into [folder] whole: a temporary file renamed over the
     * old one, so the host never reads half a file.
     *
     * @throws IOException the folder is not writable.
     */
    fun writeTo(folder: File) {
        val tmp = File(folder, "$FILE.tmp")
        tmp.writeText(toJson() + "\n")
        if (!tmp.renameTo(File(folder, FILE))) {
            tmp.delete()
            throw IOException("cannot rename ${tmp.path} to $FILE")
        }
    }

    companion object {
        /** The file name the host reads (readings.py APP_READINGS_FILE). */
        const val FILE = "device_state.json"

        /** PowerManager.THERMAL_STATUS_SHUTDOWN, the highest status. */
        const val THERMAL_STATUS_MAX = 6

        /** Temperatures a working battery sensor can read; outside, the sensor is absent or broken. */
        private const val MIN_CELSIUS = -40.0
        private const val MAX_CELSIUS = 150.0

        /**
         * From ACTION_BATTERY_CHANGED's extras as `Intent.getIntExtra` returns
         * them with the defaults given there: [level] and [scale]
         * (EXTRA_LEVEL / EXTRA_SCALE, -1 when absent), [plugged]
         * (EXTRA_PLUGGED: 0 on battery, a BATTERY_PLUGGED_* bit otherwise, -1
         * when absent), [temperatureTenths] (EXTRA_TEMPERATURE, tenths of °C,
         * Int.MIN_VALUE when absent), and [thermalStatus]
         * (PowerManager.getCurrentThermalStatus(), null below API 29).
         */
        fun fromBattery(
            level: Int,
            scale: Int,
            plugged: Int,
            temperatureTenths: Int,
            thermalStatus: Int?,
            elapsedRealtimeMs: Long,
            tUnixMs: Long,
        ): DeviceReadings {
            val pct = if (level >= 0 && scale > 0 && level <= scale) 100.0 * level / scale else null
            val celsius = if (temperatureTenths == Int.MIN_VALUE) null else temperatureTenths / 10.0
            return DeviceReadings(
                temperatureC = celsius?.takeIf { it > MIN_CELSIUS && it < MAX_CELSIUS },
                batteryPct = pct,
                charging = if (plugged < 0) null else plugged != 0,
                thermalStatus = thermalStatus?.takeIf { it in 0..THERMAL_STATUS_MAX },
                elapsedRealtimeMs = elapsedRealtimeMs,
                tUnixMs = tUnixMs,
            )
        }
    }
}
