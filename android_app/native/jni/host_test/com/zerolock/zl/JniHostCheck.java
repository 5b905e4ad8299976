package com.zerolock.zl;

import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.util.ArrayList;
import java.util.List;

/**
 * Drives libzl_jni.so from a plain JVM the way the app's RunnerService does
 * (NativeRunner.nativeRun / nativeStop) and checks what Kotlin relies on:
 * failures arrive as NativeRunnerException with a stable code and a message
 * that names the config path; bad arguments as the standard Java exceptions;
 * a failed run leaves the process free for the next one.
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

  /** Runs nativeRun(path) and returns the NativeRunnerException it must throw. */
  private static NativeRunnerException runExpectingFailure(String path) {
    try {
      NativeRunner.nativeRun(path);
    } catch (NativeRunnerException e) {
      return e;
    }
    throw new AssertionError("nativeRun(" + path + ") returned normally");
  }

  private static Path write(Path path, String text) throws IOException {
    Files.createDirectories(path.getParent());
    Files.write(path, text.getBytes(StandardCharsets.UTF_8));
    return path;
  }

  /**
   * Runs the last stage of a real export with no upstream, so it loads its
   * program and then waits for input forever (input_timeout_s 0), on a
   * thread of its own as RunnerService does; then stops it.
   */
  private static void checkStopWhileRunning(Path exportDir, Path dir) throws Exception {
    int numStages = 0;
    while (Files.isRegularFile(exportDir.resolve("stage_" + numStages + ".pte"))) numStages++;
    expect(numStages >= 1, "no stage_0.pte in " + exportDir);
    final int last = numStages - 1;
    write(dir.resolve("run.key"), "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f\n");
    final String firstStage = last == 0 ? ", \"data_shard\": \"missing_shard.bin\"" : "";
    final Path config = write(dir.resolve("stage.json"),
        "{\"program\": \"" + exportDir.resolve("stage_" + last + ".pte") + "\","
            + " \"manifest\": \"" + exportDir.resolve("manifest.json") + "\","
            + " \"stage_index\": " + last + ", \"num_stages\": " + numStages + ","
            + " \"listen\": \"127.0.0.1:0\", \"input_timeout_s\": 0" + firstStage + ","
            + " \"run_key_file\": \"run.key\", \"run_id\": \"00112233445566778899aabbccddeeff\","
            + " \"window_size\": 1, \"num_micro_batches\": 2, \"checkpoint_dir\": \"ckpt\","
            + " \"log_path\": \"metrics.jsonl\"}");
    expect(last > 0, "the export has one stage: stage 0 reads its shard and never waits; need 2+ stages");

    final Throwable[] outcome = new Throwable[1];
    final boolean[] returned = new boolean[1];
    Thread worker = new Thread(() -> {
      try {
        NativeRunner.nativeRun(config.toString());
        returned[0] = true;
      } catch (Throwable t) {
        outcome[0] = t;
      }
    }, "zl-stage");
    worker.start();
    // Loading a test-sized program takes well under a second; give it 5 s,
    // then it must still be running (waiting for upstream input).
    worker.join(5000);
    expect(worker.isAlive(), "the stage ended before the stop: returned=" + returned[0] + ", " + outcome[0]);

    try {
      NativeRunner.nativeRun(config.toString());
      throw new AssertionError("a second concurrent nativeRun returned");
    } catch (IllegalStateException e) {
      expect(e.getMessage().contains("already running"), "message: " + e.getMessage());
    }

    expect(NativeRunner.nativeStop(), "nativeStop() returned false while a stage was running");
    worker.join(30000);
    expect(!worker.isAlive(), "the stage did not stop within 30 s of nativeStop");
    expect(outcome[0] instanceof NativeRunnerException, "run ended with " + outcome[0] + ", returned=" + returned[0]);
    NativeRunnerException e = (NativeRunnerException) outcome[0];
    expect("closed".equals(e.code), "code " + e.code + ": " + e.getMessage());
    expect(e.getMessage().startsWith("stage " + last + " (config " + config + "): closed: "), "message: " + e.getMessage());
    expect(!NativeRunner.nativeStop(), "nativeStop() returned true after the stage ended");
  }

  public static void main(String[] args) throws Exception {
    final Path work = Paths.get(args.length > 0 ? args[0] : "jni_host_check").toAbsolutePath();
    Files.createDirectories(work);

    check("nativeStop with no run in progress returns false", () ->
        expect(!NativeRunner.nativeStop(), "nativeStop() returned true while idle"));

    check("nativeRun(null) throws IllegalArgumentException", () -> {
      try {
        NativeRunner.nativeRun(null);
        throw new AssertionError("no exception");
      } catch (IllegalArgumentException e) {
        expect(e.getMessage().contains("configPath"), "message: " + e.getMessage());
      }
    });

    check("missing config: not_found, message names the path", () -> {
      final String path = work.resolve("no_such_dir/stage0.json").toString();
      NativeRunnerException e = runExpectingFailure(path);
      expect("not_found".equals(e.code), "code " + e.code);
      expect(e.getMessage().startsWith("stage config " + path + ": not_found: "), "message: " + e.getMessage());
    });

    check("invalid config: invalid_argument, message names the path and the field", () -> {
      final Path path = write(work.resolve("bad/stage0.json"), "{\"program\": \"s.pte\", \"stage_index\": \"zero\"}");
      NativeRunnerException e = runExpectingFailure(path.toString());
      expect("invalid_argument".equals(e.code), "code " + e.code);
      expect(e.getMessage().contains(path.toString()), "message lacks the path: " + e.getMessage());
      expect(e.getMessage().contains("stage_index"), "message lacks the field: " + e.getMessage());
    });

    check("a failed run releases the process: the next run fails the same way", () -> {
      final String path = work.resolve("no_such_dir/again.json").toString();
      for (int i = 0; i < 2; i++) {
        NativeRunnerException e = runExpectingFailure(path);
        expect("not_found".equals(e.code), "attempt " + i + ": code " + e.code + ", " + e.getMessage());
      }
    });

    check("valid config reaches run_stage; its failure names stage and path", () -> {
      // A one-stage run whose program and run key do not exist: the config
      // parses, so the error must come from run_stage, not the parser.
      final Path path = write(work.resolve("valid/stage0.json"),
          "{\"program\": \"missing.pte\", \"stage_index\": 0, \"num_stages\": 1,"
              + " \"data_shard\": \"missing_shard.bin\", \"run_key_file\": \"missing.key\","
              + " \"run_id\": \"00112233445566778899aabbccddeeff\", \"window_size\": 1,"
              + " \"num_micro_batches\": 1, \"checkpoint_dir\": \"ckpt\", \"log_path\": \"metrics.jsonl\"}");
      NativeRunnerException e = runExpectingFailure(path.toString());
      expect(e.getMessage().startsWith("stage 0 (config " + path + "): " + e.code + ": "),
          "message: " + e.getMessage());
      expect(!"ok".equals(e.code) && !e.code.isEmpty(), "code " + e.code);
    });

    check("nativeStop after the runs returns false again", () ->
        expect(!NativeRunner.nativeStop(), "nativeStop() returned true while idle"));

    final String exportDir = System.getenv("ZL_TEST_EXPORT_DIR");
    if (exportDir == null || exportDir.isEmpty()) {
      System.out.println("SKIP nativeStop ends a running stage (set ZL_TEST_EXPORT_DIR to a `zl export` directory)");
    } else {
      check("nativeStop ends a running stage: closed, and a second run is refused meanwhile",
          () -> checkStopWhileRunning(Paths.get(exportDir).toAbsolutePath(), work.resolve("stop")));
    }

    System.out.println(passed + " passed, " + failures.size() + " failed");
    System.exit(failures.isEmpty() ? 0 : 1);
  }
}
