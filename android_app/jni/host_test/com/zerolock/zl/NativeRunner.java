package com.zerolock.zl;

/**
 * Host stand-in for the app's Kotlin {@code object NativeRunner}
 * (android_app/app/app/src/main/java/com/zerolock/zl/NativeRunner.kt): the
 * same class name and the same static native methods, so libzl_jni.so's
 * JNI_OnLoad binds to it exactly as it does in the app. It loads the library
 * from the path in the system property {@code zl.jni.library} instead of
 * System.loadLibrary("zl_jni").
 */
public final class NativeRunner {
  static {
    System.load(System.getProperty("zl.jni.library"));
  }

  private NativeRunner() {}

  public static native void startNative(String configJson);

  public static native boolean stopNative();

  public static native String statusNative();

  public static native void reportBatteryTemperatureNative(double celsius);
}
