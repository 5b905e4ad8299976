package com.zerolock.zl

import java.io.File
import java.nio.file.Files
import org.json.JSONObject
import org.junit.After
import org.junit.Assert.assertEquals
import org.junit.Assert.assertFalse
import org.junit.Assert.assertTrue
import org.junit.Assert.fail
import org.junit.Test

/** What the app checks of a stage config and what it hands to startNative (no Android classes involved). */
class StageConfigTest {
    private val dir: File = Files.createTempDirectory("zl_stage_config").toFile()

    @After
    fun cleanUp() {
        dir.deleteRecursively()
    }

    private fun write(name: String, text: String): File = File(dir, name).apply { writeText(text) }

    private fun refusal(path: String): String {
        try {
            StageConfig.load(path)
        } catch (e: IllegalArgumentException) {
            return e.message ?: ""
        }
        fail("StageConfig.load($path) accepted it")
        return ""
    }

    @Test
    fun refusesWhatTheRunnerWouldRefuseLateOrUnclearly() {
        assertEquals("no stage config path given", refusal(" "))
        assertTrue(refusal("files/stage_1.json").contains("is relative"))
        assertTrue(refusal(File(dir, "missing.json").path).contains("does not exist"))
        assertTrue(refusal(write("list.json", "[1, 2]").path).contains("is not a JSON object"))
        assertTrue(refusal(write("nostage.json", "{\"num_stages\": 3}").path).contains("no field 'stage_index'"))
        val outOfRange = refusal(write("range.json", "{\"stage_index\": 3, \"num_stages\": 3}").path)
        assertTrue(outOfRange, outOfRange.contains("stage_index 3, num_stages 3"))
        val notInt = refusal(write("type.json", "{\"stage_index\": \"one\", \"num_stages\": 3}").path)
        assertTrue(notInt, notInt.contains("field 'stage_index' is one; expected an integer"))
    }

    @Test
    fun nativeJsonGetsTheFoldersAbsolutePathAndResumeOnlyWhenAsked() {
        val file = write("stage_1.json", "{\"stage_index\": 1, \"num_stages\": 3, \"window_size\": 4, \"program\": \"stage_1.pte\"}")
        val config = StageConfig.load(file.path)
        assertEquals("stage 2 of 3", config.label)
        assertEquals(4L, config.windowSize)

        val plain = JSONObject(config.toNativeJson(resume = false))
        assertEquals(dir.absolutePath, plain.getString("base_dir"))
        assertEquals("stage_1.pte", plain.getString("program"))  // resolved by the runner, not here
        assertFalse(plain.has("resume"))

        val resumed = JSONObject(config.toNativeJson(resume = true))
        assertTrue(resumed.getBoolean("resume"))
    }

    @Test
    fun ownBaseDirIsResolvedAgainstTheConfigsFolder() {
        val relative = StageConfig.load(write("a.json", "{\"stage_index\": 0, \"num_stages\": 2, \"base_dir\": \"run\"}").path)
        assertEquals(File(dir, "run").path, JSONObject(relative.toNativeJson(false)).getString("base_dir"))
        val absolute = StageConfig.load(write("b.json", "{\"stage_index\": 0, \"num_stages\": 2, \"base_dir\": \"/data/x\"}").path)
        assertEquals("/data/x", JSONObject(absolute.toNativeJson(false)).getString("base_dir"))
    }

    @Test
    fun runKeyOfTheIntentGoesToPrivateStorageOwnerOnlyAndTheConfigNamesIt() {
        val config = StageConfig.load(write("c.json", "{\"stage_index\": 0, \"num_stages\": 2, \"run_key_file\": \"run.key\"}").path)
        val private = File(dir, "private/run.key")
        val key = "ab".repeat(32)
        val written = StageConfig.writeRunKey(key, private)
        assertEquals(key + "\n", written.readText())
        val mode = Files.getPosixFilePermissions(written.toPath()).map { it.toString() }.sorted()
        assertEquals(listOf("OWNER_READ", "OWNER_WRITE"), mode)
        assertEquals(private.absolutePath, JSONObject(config.toNativeJson(false, written)).getString("run_key_file"))
        assertEquals("run.key", JSONObject(config.toNativeJson(false)).getString("run_key_file"))
        try {
            StageConfig.writeRunKey("zz" + key.substring(2), private)
            fail("a key with non-hex characters was accepted")
        } catch (e: IllegalArgumentException) {
            assertTrue(e.message, e.message!!.contains("not 64 hex characters") && !e.message!!.contains(key.substring(2)))
        }
    }
}
