package com.zerolock.zl

import org.junit.Assert.assertEquals
import org.junit.Assert.assertFalse
import org.junit.Assert.assertNull
import org.junit.Assert.assertTrue
import org.junit.Test

/** Parsing statusNative's JSON (zl::SessionStatus::to_json), as the service does once a second. */
class NativeStatusTest {
    @Test
    fun runningStatusWithUnknownValuesAsNull() {
        val s = NativeStatus.parse(
            "{\"state\":\"running\",\"run_dir\":\"/sdcard/x\",\"phase\":\"loading\",\"stage\":1,\"num_stages\":3," +
                "\"micro_batches_done\":0,\"num_micro_batches\":64,\"window\":null,\"committed_window\":null," +
                "\"loss\":null,\"pss_mib\":null,\"temperature_c\":null,\"exit_code\":null,\"error\":null," +
                "\"error_code\":null}",
        )
        assertEquals("running", s.state)
        assertEquals(1, s.stage)
        assertEquals(64L, s.numMicroBatches)
        assertNull(s.window)
        assertNull(s.loss)
        assertNull(s.exitCode)
        assertFalse(s.ended)
        assertNull(s.failure())
    }

    @Test
    fun failedStatusBecomesAnExceptionNamingStageAndFolder() {
        val s = NativeStatus.parse(
            "{\"state\":\"failed\",\"run_dir\":\"/sdcard/x\",\"phase\":\"running\",\"stage\":2,\"num_stages\":3," +
                "\"micro_batches_done\":5,\"num_micro_batches\":8,\"window\":1,\"committed_window\":0," +
                "\"loss\":2.5,\"pss_mib\":812.25,\"temperature_c\":31.5,\"exit_code\":1," +
                "\"error\":\"recv from 10.0.0.2: connection reset\",\"error_code\":\"io_error\"}",
        )
        assertTrue(s.ended)
        assertEquals(1, s.exitCode)
        assertEquals(2.5, s.loss!!, 0.0)
        val e = s.failure()!!
        assertEquals("io_error", e.code)
        assertEquals("stage 2 (run folder /sdcard/x): io_error: recv from 10.0.0.2: connection reset", e.message)
    }

    @Test
    fun stoppedAndFinishedAreEndedWithoutFailure() {
        for (state in listOf("stopped", "finished")) {
            val s = NativeStatus.parse("{\"state\":\"$state\",\"stage\":0,\"exit_code\":0,\"error\":null}")
            assertTrue(s.ended)
            assertNull(s.failure())
        }
    }
}
