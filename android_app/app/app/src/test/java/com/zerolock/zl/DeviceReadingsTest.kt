package com.zerolock.zl

import java.io.File
import java.nio.file.Files
import org.json.JSONObject
import org.junit.Assert.assertEquals
import org.junit.Assert.assertFalse
import org.junit.Assert.assertNull
import org.junit.Assert.assertTrue
import org.junit.Test

/** What RunnerService writes for the host's device policies (zl_device/devices/readings.py reads it). */
class DeviceReadingsTest {
    @Test
    fun batteryExtrasBecomePercentPowerAndDegrees() {
        val r = DeviceReadings.fromBattery(
            level = 170, scale = 200, plugged = 2, temperatureTenths = 412, thermalStatus = 3,
            elapsedRealtimeMs = 998_000L, tUnixMs = 1_700_000_000_000L,
        )
        assertEquals(85.0, r.batteryPct!!, 0.0)
        assertTrue(r.charging!!) // BATTERY_PLUGGED_USB
        assertEquals(41.2, r.temperatureC!!, 1e-9)
        assertEquals(3, r.thermalStatus)
        val json = JSONObject(r.toJson())
        assertEquals(85.0, json.getDouble("battery_pct"), 0.0)
        assertEquals(998_000L, json.getLong("elapsed_realtime_ms"))
        assertTrue(json.getBoolean("charging"))
    }

    @Test
    fun whatThePhoneDidNotGiveIsNullNotMadeUp() {
        val r = DeviceReadings.fromBattery(
            level = -1, scale = -1, plugged = -1, temperatureTenths = Int.MIN_VALUE, thermalStatus = null,
            elapsedRealtimeMs = 1L, tUnixMs = 2L,
        )
        assertNull(r.batteryPct)
        assertNull(r.charging)
        assertNull(r.temperatureC)
        assertNull(r.thermalStatus)
        val json = JSONObject(r.toJson())
        for (key in listOf("battery_pct", "charging", "temperature_c", "thermal_status")) {
            assertTrue(key, json.isNull(key))
        }
        // A broken sensor's junk and an unknown status are not readings either; 0 on battery is "not charging".
        val junk = DeviceReadings.fromBattery(
            level = 5, scale = 100, plugged = 0, temperatureTenths = -2730, thermalStatus = 9,
            elapsedRealtimeMs = 1L, tUnixMs = 2L,
        )
        assertNull(junk.temperatureC)
        assertNull(junk.thermalStatus)
        assertFalse(junk.charging!!)
    }

    @Test
    fun theFileIsWrittenWhole() {
        val folder = Files.createTempDirectory("zl-readings").toFile()
        try {
            val r = DeviceReadings(30.5, 60.0, false, 0, 5L, 6L)
            r.writeTo(folder)
            r.copy(temperatureC = 31.0).writeTo(folder)
            assertEquals(listOf(DeviceReadings.FILE), folder.list()!!.toList())
            val json = JSONObject(File(folder, DeviceReadings.FILE).readText())
            assertEquals(31.0, json.getDouble("temperature_c"), 0.0)
        } finally {
            folder.deleteRecursively()
        }
    }
}
