package com.zerolock.zl;

import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;

/**
 * Runs one stage through libzl_jni.so the way the app's RunnerService does
 * (read the config file, add its folder as base_dir, startNative, poll
 * statusNative until the run ends), as a process with zl_runner's command
 * line and exit statuses, so a pipeline test can put the app's native path
 * in place of zl_runner for one stage (tests/test_runner.py).
 *
 * <p>Usage: java -Dzl.jni.library=libzl_jni.so -cp classes
 * com.zerolock.zl.AppStageDriver --config FILE [--resume] [--run-key-file
 * PRIVATE_KEY] (the key a START intent carried, deleted at the end). SIGTERM asks the
 * run to stop (stopNative, as the app's STOP intent does); the exit status is
 * the run's: 0 done, 1 failed, 2 bad config, 3 stopped.
 */
public final class AppStageDriver {
  private AppStageDriver() {}

  private static volatile boolean ended = false;

  public static void main(String[] args) throws Exception {
    String configPath = null;
    String runKeyFile = null;  // the START intent's run key, as RunnerService writes it to private storage
    boolean resume = false;
    for (int i = 0; i < args.length; i++) {
      if ("--config".equals(args[i]) && i + 1 < args.length) {
        configPath = args[++i];
      } else if ("--resume".equals(args[i])) {
        resume = true;
      } else if ("--run-key-file".equals(args[i]) && i + 1 < args.length) {
        runKeyFile = args[++i];
      } else {
        System.err.println("AppStageDriver: unknown argument " + args[i]);
        System.exit(2);
      }
    }
    if (configPath == null) {
      System.err.println("AppStageDriver: --config FILE is required");
      System.exit(2);
    }
    final Path config = Paths.get(configPath).toAbsolutePath();
    String text = new String(Files.readAllBytes(config), StandardCharsets.UTF_8).trim();
    // What RunnerService adds (with org.json there): the folder and the resume flag.
    if (!text.startsWith("{") || text.contains("\"base_dir\"") || (resume && text.contains("\"resume\""))) {
      System.err.println("AppStageDriver: " + config + ": expected a JSON object without base_dir"
          + (resume ? " and resume" : ""));
      System.exit(2);
    }
    final String extra = "\"base_dir\": \"" + config.getParent() + "\", " + (resume ? "\"resume\": true, " : "");
    text = "{" + extra + text.substring(1);
    if (runKeyFile != null) {
      // RunnerService: JSONObject.put("run_key_file", <private copy>).
      text = text.replaceFirst("\"run_key_file\"\\s*:\\s*\"[^\"]*\"",
          java.util.regex.Matcher.quoteReplacement("\"run_key_file\": \"" + runKeyFile + "\""));
      final Path key = Paths.get(runKeyFile);
      // RunnerService deletes its private copy when the run ends.
      Runtime.getRuntime().addShutdownHook(new Thread(() -> key.toFile().delete()));
    }

    try {
      NativeRunner.startNative(text);
    } catch (NativeRunnerException e) {
      System.err.println("AppStageDriver: " + e.getMessage());
      System.exit("invalid_argument".equals(e.code) ? 2 : 1);
    }
    Runtime.getRuntime().addShutdownHook(new Thread(() -> {
      if (!ended) {
        NativeRunner.stopNative();
        // As zl_runner on SIGTERM: the run's own status (3: stopped), not the signal's.
        Runtime.getRuntime().halt(waitForEnd());
      }
    }));
    final int code = waitForEnd();
    ended = true;
    System.exit(code);
  }

  /** The run's exit code once it ended (JniHostCheck.waitForEnd without a limit); 1 if interrupted. */
  static int waitForEnd() {
    try {
      return Integer.parseInt(JniHostCheck.field(JniHostCheck.waitForEnd(0), "exit_code"));
    } catch (InterruptedException e) {
      Thread.currentThread().interrupt();
      return 1;
    }
  }
}
