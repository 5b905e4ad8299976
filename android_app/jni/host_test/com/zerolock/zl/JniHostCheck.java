package com.zerolock.zl;

import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.util.ArrayList;
import java.util.List;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

/**
 * Drives libzl_jni.so from a plain JVM the way the app's RunnerService does
 * (NativeRunner.startNative / statusNative / stopNative /
 * reportBatteryTemperatureNative) and checks what Kotlin relies on: refusals
 * arrive as NativeRunnerException with a stable code and a message that names
 * the method and the run folder; bad arguments as the standard Java
 * exceptions; a run's outcome in statusNative's JSON and in the files the
 * host reads (runner.pid, runner.exit); a failed run leaves the process free
 * for the next one.
 *
 * <p>Usage: java -Dzl.jni.library=/path/libzl_jni.so -cp classes
 * com.zerolock.zl.JniHostCheck WORK_DIR. Prints one line per check and
 * "N passed, M failed"; exits 1 on any failure.
 */
public final class JniHostCheck {
  private interface Check {
    void run() throws Exception;
  }

  private static final List<String> failures = new ArrayList<>();
  private static int passed = 0;
  private static final String RUN_ID = "00112233445566778899aabbccddeeff";

  private static void check(String name, Check body) {
    try {
      body.run();
      passed++;
      System.out.println("PASS " + name);
    } catch (Throwable t) {
      failures.add(name);
      System.out.println("FAIL " + name + ": " + t);
    }
  }

  private static void expect(boolean condition, String what) {
    if (!condition) throw new AssertionError(what);
  }

  /**
   * A top-level field of statusNative's flat JSON object as text: a string's
   * contents, a number, "null" or a boolean; null when absent. (The JDK has
   * no JSON parser; the app uses org.json.)
   */
  static String field(String json, String name) {
    Matcher m = Pattern.compile("\"" + Pattern.quote(name) + "\":(\"((?:[^\"\\\\]|\\\\.)*)\"|[^,}]*)").matcher(json);
    if (!m.find()) return null;
    return m.group(2) != null ? m.group(2) : m.group(1);
  }

  /** Runs startNative(json) and returns the NativeRunnerException it must throw. */
  private static NativeRunnerException startExpectingFailure(String json) {
    try {
      NativeRunner.startNative(json);
    } catch (NativeRunnerException e) {
      return e;
    }
    throw new AssertionError("startNative(" + json + ") returned normally");
  }

  /**
   * Polls statusNative until the run is no longer running or stopping (as RunnerService does, more often);
   * the last status. {@code timeoutMs} 0: no limit.
   */
  static String waitForEnd(long timeoutMs) throws InterruptedException {
    final long deadline = System.currentTimeMillis() + timeoutMs;
    while (true) {
      final String status = NativeRunner.statusNative();
      final String state = field(status, "state");
      if (!"running".equals(state) && !"stopping".equals(state)) return status;
      if (timeoutMs > 0 && System.currentTimeMillis() > deadline) {
        throw new AssertionError("still " + state + ": " + status);
      }
      Thread.sleep(20);
    }
  }

  private static Path write(Path path, String text) throws IOException {
    Files.createDirectories(path.getParent());
    Files.write(path, text.getBytes(StandardCharsets.UTF_8));
    return path;
  }

  private static String read(Path path) throws IOException {
    return Files.isRegularFile(path) ? new String(Files.readAllBytes(path), StandardCharsets.UTF_8) : "";
  }

  private static String pid() {
    return Long.toString(ProcessHandle.current().pid());
  }

  /**
   * Runs the last stage of a real export with no upstream, so it loads its
   * program and then waits for input forever (input_timeout_s 0); then
   * stops it as the app's STOP intent does.
   */
  private static void checkStopWhileRunning(Path exportDir, Path dir) throws Exception {
    int numStages = 0;
    while (Files.isRegularFile(exportDir.resolve("stage_" + numStages + ".pte"))) numStages++;
    expect(numStages >= 2, "need an export with 2+ stages in " + exportDir + " (stage 0 never waits)");
    final int last = numStages - 1;
    write(dir.resolve("run.key"), "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f\n");
    final String json = "{\"base_dir\": \"" + dir + "\", \"program\": \"" + exportDir.resolve("stage_" + last + ".pte")
        + "\", \"manifest\": \"" + exportDir.resolve("manifest.json") + "\","
        + " \"stage_index\": " + last + ", \"num_stages\": " + numStages + ","
        + " \"listen\": \"127.0.0.1:0\", \"input_timeout_s\": 0,"
        + " \"run_key_file\": \"run.key\", \"run_id\": \"" + RUN_ID + "\","
        + " \"window_size\": 1, \"num_micro_batches\": 2, \"checkpoint_dir\": \"ckpt\","
        + " \"log_path\": \"metrics.jsonl\"}";
    NativeRunner.startNative(json);
    expect(read(dir.resolve("runner.pid")).equals(pid() + "\n"), "runner.pid: " + read(dir.resolve("runner.pid")));
    // Loading a test-sized program takes well under a second; then it waits for upstream input.
    final long deadline = System.currentTimeMillis() + 10000;
    String status = NativeRunner.statusNative();
    while (!"running".equals(field(status, "phase")) && System.currentTimeMillis() < deadline) {
      Thread.sleep(20);
      status = NativeRunner.statusNative();
    }
    expect("running".equals(field(status, "state")), "not running: " + status);
    expect("running".equals(field(status, "phase")), "never reached its loop: " + status);
    expect(Integer.toString(last).equals(field(status, "stage")), "stage: " + status);
    expect("0".equals(field(status, "micro_batches_done")), "progress: " + status);
    expect(read(dir.resolve("runner.out")).contains("\"event\": \"listening\""),
        "runner.out lacks the listening event: " + read(dir.resolve("runner.out")));
    expect(!Files.exists(dir.resolve("runner.exit")), "runner.exit exists while running");

    try {
      NativeRunner.startNative(json);
      throw new AssertionError("a second concurrent startNative returned");
    } catch (IllegalStateException e) {
      expect(e.getMessage().contains("already running") && e.getMessage().contains(dir.toString()),
          "message: " + e.getMessage());
    }

    expect(NativeRunner.stopNative(), "stopNative() returned false while a stage was running");
    status = waitForEnd(30000);
    expect("stopped".equals(field(status, "state")), "state: " + status);
    expect("3".equals(field(status, "exit_code")), "exit_code: " + status);
    expect("closed".equals(field(status, "error_code")), "error_code: " + status);
    expect(read(dir.resolve("runner.exit")).equals("3\n"), "runner.exit: " + read(dir.resolve("runner.exit")));
    expect(read(dir.resolve("runner.err")).contains("stopped"), "runner.err: " + read(dir.resolve("runner.err")));
    expect(!NativeRunner.stopNative(), "stopNative() returned true after the stage ended");
  }

  public static void main(String[] args) throws Exception {
    final Path work = Paths.get(args.length > 0 ? args[0] : "jni_host_check").toAbsolutePath();
    Files.createDirectories(work);

    check("idle: stopNative returns false, statusNative says idle", () -> {
      expect(!NativeRunner.stopNative(), "stopNative() returned true while idle");
      final String status = NativeRunner.statusNative();
      expect("idle".equals(field(status, "state")), "status: " + status);
      expect("null".equals(field(status, "exit_code")), "status: " + status);
    });

    check("startNative(null) throws IllegalArgumentException", () -> {
      try {
        NativeRunner.startNative(null);
        throw new AssertionError("no exception");
      } catch (IllegalArgumentException e) {
        expect(e.getMessage().contains("configJson"), "message: " + e.getMessage());
      }
    });

    check("not JSON: invalid_argument, message names the method", () -> {
      NativeRunnerException e = startExpectingFailure("stage.json");
      expect("invalid_argument".equals(e.code), "code " + e.code);
      expect(e.getMessage().startsWith("startNative: invalid_argument: config: not a JSON object"),
          "message: " + e.getMessage());
    });

    check("no absolute base_dir: invalid_argument naming the field", () -> {
      NativeRunnerException e = startExpectingFailure("{\"base_dir\": \"files\", \"program\": \"s.pte\"}");
      expect("invalid_argument".equals(e.code), "code " + e.code);
      expect(e.getMessage().contains("'base_dir'") && e.getMessage().contains("\"files\""),
          "message: " + e.getMessage());
    });

    check("invalid config: invalid_argument naming folder and field; runner.exit 2", () -> {
      final Path dir = work.resolve("bad");
      NativeRunnerException e = startExpectingFailure(
          "{\"base_dir\": \"" + dir + "\", \"program\": \"s.pte\", \"stage_index\": \"zero\"}");
      expect("invalid_argument".equals(e.code), "code " + e.code);
      expect(e.getMessage().startsWith("startNative (run folder " + dir + "): invalid_argument: "),
          "message: " + e.getMessage());
      expect(e.getMessage().contains("stage_index"), "message lacks the field: " + e.getMessage());
      expect(read(dir.resolve("runner.exit")).equals("2\n"), "runner.exit: " + read(dir.resolve("runner.exit")));
      expect(read(dir.resolve("runner.pid")).equals(pid() + "\n"), "runner.pid: " + read(dir.resolve("runner.pid")));
      final String status = NativeRunner.statusNative();
      expect("failed".equals(field(status, "state")) && "2".equals(field(status, "exit_code")), "status: " + status);
    });

    check("a run that fails on its thread: statusNative failed, exit 1, error names the file; twice", () -> {
      final Path dir = work.resolve("fails");
      // Parses, but neither program nor manifest exists: run_stage fails after start returned.
      final String json = "{\"base_dir\": \"" + dir + "\", \"program\": \"missing.pte\", \"stage_index\": 0,"
          + " \"num_stages\": 1, \"data_shard\": \"missing_shard.bin\", \"run_key_file\": \"run.key\","
          + " \"run_id\": \"" + RUN_ID + "\", \"window_size\": 1,"
          + " \"num_micro_batches\": 1, \"checkpoint_dir\": \"ckpt\", \"log_path\": \"metrics.jsonl\"}";
      write(dir.resolve("run.key"), "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f\n");
      for (int attempt = 0; attempt < 2; attempt++) {
        NativeRunner.startNative(json);
        final String status = waitForEnd(30000);
        expect("failed".equals(field(status, "state")), "attempt " + attempt + ": " + status);
        expect("1".equals(field(status, "exit_code")), "attempt " + attempt + ": " + status);
        expect("0".equals(field(status, "stage")), "attempt " + attempt + ": " + status);
        expect(field(status, "error").contains(dir.resolve("manifest.json").toString()), "error: " + status);
        expect(read(dir.resolve("runner.exit")).equals("1\n"), "runner.exit: " + read(dir.resolve("runner.exit")));
        expect(read(dir.resolve("runner.err")).contains("stage 0 failed"), "runner.err: " + read(dir.resolve("runner.err")));
      }
    });

    check("reportBatteryTemperatureNative accepts a reading", () ->
        NativeRunner.reportBatteryTemperatureNative(31.5));

    final String exportDir = System.getenv("ZL_TEST_EXPORT_DIR");
    if (exportDir == null || exportDir.isEmpty()) {
      System.out.println("SKIP stopNative ends a running stage (set ZL_TEST_EXPORT_DIR to a `zl export` directory)");
    } else {
      check("stopNative ends a running stage: stopped, exit 3, and a second start is refused meanwhile",
          () -> checkStopWhileRunning(Paths.get(exportDir).toAbsolutePath(), work.resolve("stop")));
    }

    System.out.println(passed + " passed, " + failures.size() + " failed");
    System.exit(failures.isEmpty() ? 0 : 1);
  }
}
