package com.zerolock.zl

import java.io.File
import java.nio.file.Files
import org.junit.After
import org.junit.Assert.assertEquals
import org.junit.Assert.assertTrue
import org.junit.Assert.fail
import org.junit.Assume.assumeTrue
import org.junit.Test

/**
 * The app's own Kotlin ([StageConfig], [NativeRunner], [NativeStatus]) against libzl_jni.so built for the
 * host: what RunnerService does with a config, end to end through JNI. Runs only where that library is on
 * java.library.path and -Dzl.test.hostJni=1 says so (tests/test_app_kotlin.py); a Gradle unit-test run on a
 * developer machine skips it (its libzl_jni.so is built for arm64 phones).
 */
class NativeRunnerHostTest {
    private val dir: File = Files.createTempDirectory("zl_native_runner").toFile()

    @After
    fun cleanUp() {
        dir.deleteRecursively()
    }

    private fun awaitEnd(): NativeStatus {
        val deadline = System.currentTimeMillis() + 30_000
        while (true) {
            val s = NativeRunner.status()
            if (s.ended) return s
            if (System.currentTimeMillis() > deadline) fail("still ${s.state}")
            Thread.sleep(20)
        }
    }

    @Test
    fun badFieldIsRefusedAtStartAndRecordedForTheHost() {
        assumeTrue(System.getProperty("zl.test.hostJni") == "1")
        val file = File(dir, "stage_0.json")
        file.writeText(
            "{\"stage_index\": 0, \"num_stages\": 2, \"program\": \"s.pte\", \"data_shard\": \"train.safetensors\"," +
                " \"downstream\": \"127.0.0.1:9\", \"run_key_file\": \"run.key\"," +
                " \"run_id\": \"00112233445566778899aabbccddeeff\", \"window_size\": \"two\", \"num_micro_batches\": 4," +
                " \"checkpoint_dir\": \"ckpt\"}",
        )
        val config = StageConfig.load(file.path)
        try {
            NativeRunner.startNative(config.toNativeJson(resume = false))
            fail("startNative accepted window_size \"two\"")
        } catch (e: NativeRunnerException) {
            assertEquals("invalid_argument", e.code)
            assertTrue(e.message!!, e.message!!.startsWith("startNative (run folder ${dir.absolutePath}): invalid_argument"))
            assertTrue(e.message!!, e.message!!.contains("window_size"))
        }
        val s = NativeRunner.status()
        assertEquals("failed", s.state)
        assertEquals(2, s.exitCode)
        assertEquals("2\n", File(dir, "runner.exit").readText())
    }

    @Test
    fun runThatFailsOnItsThreadEndsAsFailedWithTheStageNamed() {
        assumeTrue(System.getProperty("zl.test.hostJni") == "1")
        File(dir, "run.key").writeText("5a".repeat(32) + "\n")
        val file = File(dir, "stage_1.json")
        file.writeText(
            "{\"stage_index\": 1, \"num_stages\": 3, \"program\": \"missing.pte\", \"listen\": \"127.0.0.1:0\"," +
                " \"downstream\": \"127.0.0.1:9\", \"run_key_file\": \"run.key\"," +
                " \"run_id\": \"00112233445566778899aabbccddeeff\", \"window_size\": 2, \"num_micro_batches\": 4," +
                " \"checkpoint_dir\": \"ckpt\"}",
        )
        NativeRunner.startNative(StageConfig.load(file.path).toNativeJson(resume = true))
        val s = awaitEnd()
        assertEquals("failed", s.state)
        assertEquals(1, s.exitCode)
        assertEquals(1, s.stage)
        val e = s.failure()!!
        assertTrue(e.message!!, e.message!!.startsWith("stage 1 (run folder ${dir.absolutePath}): "))
        assertTrue(e.message!!, e.message!!.contains(File(dir, "manifest.json").path))
        assertEquals("1\n", File(dir, "runner.exit").readText())
        assertTrue(File(dir, "runner.err").readText().contains("stage 1 failed"))
        NativeRunner.reportBatteryTemperatureNative(30.0)
    }
}
