package com.zerolock.zl;

/** Host stand-in for NativeRunnerException.kt: same class name and constructor. */
public final class NativeRunnerException extends RuntimeException {
  public final String code;

  public NativeRunnerException(String message, String code) {
    super(message);
    this.code = code;
  }
}
