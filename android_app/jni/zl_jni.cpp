// JNI bridge of the Kotlin app: the whole native surface is four static
// methods of `com.zerolock.zl.NativeRunner` (android_app/app/.../NativeRunner.kt):
//
//   startNative(configJson: String)          starts one stage run on a native
//                                            thread of its own and returns;
//                                            a config or run-folder problem
//                                            throws NativeRunnerException
//   stopNative(): Boolean                    asks the run to stop; true if one
//                                            was running
//   statusNative(): String                   the run's state and progress as
//                                            JSON (StageSession::to_json);
//                                            a failed run's error is in it
//   reportBatteryTemperatureNative(c: Double) BatteryManager's reading, for
//                                            telemetry where the app may not
//                                            read /sys (zl/telemetry.h)
//
// Kotlin owns the lifecycle (foreground service), the status polling and the
// UI; zl::StageSession owns the run (thread, files for the host, status);
// this file only translates Java types and errors. The methods are bound
// with RegisterNatives in JNI_OnLoad, so a mismatch with the Kotlin class
// fails System.loadLibrary at once instead of the first call.
#include <jni.h>

#include <string>

#include "zl/log.h"
#include "zl/stage_session.h"
#include "zl/status.h"
#include "zl/telemetry.h"

#if defined(__ANDROID__)
#include <android/log.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <thread>
#endif

namespace {

constexpr const char* kRunnerClass = "com/zerolock/zl/NativeRunner";
constexpr const char* kExceptionClass = "com/zerolock/zl/NativeRunnerException";

/// One stage per process (DESIGN §4), so one session per process. Never
/// destroyed: the process ends with it.
zl::StageSession& session() {
  static zl::StageSession* instance = new zl::StageSession();
  return *instance;
}

/// Throws `class_name(message)`; RuntimeException if that class is missing
/// (the exception from FindClass is cleared first, so ours is the one seen).
void throw_simple(JNIEnv* env, const char* class_name, const std::string& message) {
  jclass cls = env->FindClass(class_name);
  if (cls == nullptr) {
    env->ExceptionClear();
    cls = env->FindClass("java/lang/RuntimeException");
  }
  env->ThrowNew(cls, message.c_str());
  env->DeleteLocalRef(cls);
}

/// Throws NativeRunnerException("<what>: <code>: <message>", code) for a failed zl::Status.
void throw_status(JNIEnv* env, const std::string& what, const zl::Status& status) {
  const char* code = zl::status_code_name(status.code());
  const std::string message = what + ": " + code + ": " + status.message();
  jclass cls = env->FindClass(kExceptionClass);
  jmethodID ctor = cls != nullptr
      ? env->GetMethodID(cls, "<init>", "(Ljava/lang/String;Ljava/lang/String;)V")
      : nullptr;
  jstring jmessage = ctor != nullptr ? env->NewStringUTF(message.c_str()) : nullptr;
  jstring jcode = jmessage != nullptr ? env->NewStringUTF(code) : nullptr;
  jobject exception = jcode != nullptr ? env->NewObject(cls, ctor, jmessage, jcode) : nullptr;
  if (exception == nullptr) {
    // The app's exception class is missing or could not be built: still
    // report the failure, as a RuntimeException with the same text.
    env->ExceptionClear();
    throw_simple(env, "java/lang/RuntimeException", message);
  } else {
    env->Throw(static_cast<jthrowable>(exception));
  }
  if (cls != nullptr) env->DeleteLocalRef(cls);
}

void start_native(JNIEnv* env, jclass, jstring config_json) {
  if (config_json == nullptr) {
    throw_simple(env, "java/lang/IllegalArgumentException", "startNative: configJson is null");
    return;
  }
  const char* chars = env->GetStringUTFChars(config_json, nullptr);
  if (chars == nullptr) return;  // OutOfMemoryError is pending
  const std::string text(chars);
  env->ReleaseStringUTFChars(config_json, chars);

  if (session().running()) {
    throw_simple(env, "java/lang/IllegalStateException",
                 "startNative: a stage is already running in this process (" + session().status().run_dir +
                     "); stopNative() it first");
    return;
  }
  const zl::Status status = session().start(text);
  if (!status.ok()) {
    const std::string run_dir = session().status().run_dir;
    throw_status(env, "startNative" + (run_dir.empty() ? std::string() : " (run folder " + run_dir + ")"), status);
  }
}

jboolean stop_native(JNIEnv*, jclass) { return session().stop() ? JNI_TRUE : JNI_FALSE; }

jstring status_native(JNIEnv* env, jclass) {
  return env->NewStringUTF(session().status().to_json().dump().c_str());
}

void report_battery_temperature_native(JNIEnv*, jclass, jdouble celsius) {
  zl::report_temperature_c(static_cast<double>(celsius));
}

#if defined(__ANDROID__)
// An app process's stdout and stderr go nowhere on Android. The runner logs
// to stderr (zl/log.h) and ExecuTorch to logcat already, so route both
// streams into logcat under the tag "zl", one line per record.
void pump_stdio_to_logcat() {
  int fds[2];
  if (pipe(fds) != 0) return;
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::setvbuf(stderr, nullptr, _IOLBF, 0);
  dup2(fds[1], STDOUT_FILENO);
  dup2(fds[1], STDERR_FILENO);
  close(fds[1]);
  std::thread([fd = fds[0]] {
    std::string pending;
    char buffer[512];
    ssize_t n;
    while ((n = read(fd, buffer, sizeof(buffer))) > 0) {
      pending.append(buffer, static_cast<size_t>(n));
      size_t end;
      while ((end = pending.find('\n')) != std::string::npos) {
        const std::string line = pending.substr(0, end);
        pending.erase(0, end + 1);
        // zl/log.h lines read "HH:MM:SS.mmm L zl: ...", L in D/I/W/E.
        int priority = ANDROID_LOG_INFO;
        if (line.size() > 18 && line[12] == ' ' && line.compare(14, 5, " zl: ") == 0) {
          switch (line[13]) {
            case 'D': priority = ANDROID_LOG_DEBUG; break;
            case 'W': priority = ANDROID_LOG_WARN; break;
            case 'E': priority = ANDROID_LOG_ERROR; break;
            default: break;
          }
        }
        __android_log_write(priority, "zl", line.c_str());
      }
    }
  }).detach();
}
#endif

}  // namespace

extern "C" JNIEXPORT jint JNI_OnLoad(JavaVM* vm, void*) {
  JNIEnv* env = nullptr;
  if (vm->GetEnv(reinterpret_cast<void**>(&env), JNI_VERSION_1_6) != JNI_OK) return JNI_ERR;
  jclass cls = env->FindClass(kRunnerClass);
  if (cls == nullptr) return JNI_ERR;  // NoClassDefFoundError names the class
  const JNINativeMethod methods[] = {
      {const_cast<char*>("startNative"), const_cast<char*>("(Ljava/lang/String;)V"),
       reinterpret_cast<void*>(start_native)},
      {const_cast<char*>("stopNative"), const_cast<char*>("()Z"), reinterpret_cast<void*>(stop_native)},
      {const_cast<char*>("statusNative"), const_cast<char*>("()Ljava/lang/String;"),
       reinterpret_cast<void*>(status_native)},
      {const_cast<char*>("reportBatteryTemperatureNative"), const_cast<char*>("(D)V"),
       reinterpret_cast<void*>(report_battery_temperature_native)},
  };
  const jint rc = env->RegisterNatives(cls, methods, sizeof(methods) / sizeof(methods[0]));
  env->DeleteLocalRef(cls);
  if (rc != JNI_OK) return JNI_ERR;  // NoSuchMethodError names the method
#if defined(__ANDROID__)
  static std::atomic<bool> pumping{false};
  if (!pumping.exchange(true)) pump_stdio_to_logcat();
#endif
  return JNI_VERSION_1_6;
}
