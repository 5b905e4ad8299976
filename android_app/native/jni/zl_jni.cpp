// JNI bridge of the Kotlin app: the whole native surface is two static
// methods of `com.zerolock.zl.NativeRunner` (android_app/app/.../NativeRunner.kt):
//
//   nativeRun(configPath: String)   runs one stage to the end on the calling
//                                   thread; a failure throws
//                                   NativeRunnerException(message, code) whose
//                                   message names the config path
//   nativeStop(): Boolean           asks a running nativeRun to stop; true if
//                                   one was running
//
// Kotlin owns the thread, the lifecycle (foreground service) and the UI; this
// file only translates: Java strings in, zl::Status out as a Java exception.
// The methods are bound with RegisterNatives in JNI_OnLoad, so a mismatch with
// the Kotlin class fails System.loadLibrary at once instead of the first call.
#include <jni.h>

#include <atomic>
#include <string>

#include "zl/log.h"
#include "zl/runner_config.h"
#include "zl/status.h"

#if __has_include("zl/runner.h")
#include "zl/runner.h"
#else
// The stage main loop (another part of the runner, android_app/native/src);
// declared here exactly as zl/runner.h states it until that header lands.
namespace zl {
Status run_stage(const RunnerConfig& config, const std::atomic<bool>* stop_requested);
}  // namespace zl
#endif

#if defined(__ANDROID__)
#include <android/log.h>
#include <unistd.h>

#include <cstdio>
#include <thread>
#endif

namespace {

constexpr const char* kRunnerClass = "com/zerolock/zl/NativeRunner";
constexpr const char* kExceptionClass = "com/zerolock/zl/NativeRunnerException";

// One stage per process (DESIGN §4), so one flag pair per process. Set by
// nativeStop from any thread, polled by run_stage between micro-batches.
std::atomic<bool> g_stop_requested{false};
std::atomic<bool> g_running{false};

/// Stable lower-case names for NativeRunnerException.code (the Kotlin UI
/// shows them, tests match them).
const char* status_code_name(zl::StatusCode code) {
  switch (code) {
    case zl::StatusCode::kOk: return "ok";
    case zl::StatusCode::kInvalidArgument: return "invalid_argument";
    case zl::StatusCode::kNotFound: return "not_found";
    case zl::StatusCode::kIoError: return "io_error";
    case zl::StatusCode::kCorrupt: return "corrupt";
    case zl::StatusCode::kTimeout: return "timeout";
    case zl::StatusCode::kClosed: return "closed";
    case zl::StatusCode::kInternal: return "internal";
  }
  return "unknown";
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

/// Throws NativeRunnerException(message, code) for a failed zl::Status.
void throw_status(JNIEnv* env, const std::string& what, const zl::Status& status) {
  const char* code = status_code_name(status.code());
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

/// Marks the process as running a stage for the lifetime of the guard.
class RunningGuard {
 public:
  RunningGuard() : acquired_(!g_running.exchange(true)) {}
  ~RunningGuard() {
    if (acquired_) g_running.store(false);
  }
  bool acquired() const { return acquired_; }

 private:
  bool acquired_;
};

void native_run(JNIEnv* env, jclass, jstring config_path) {
  if (config_path == nullptr) {
    throw_simple(env, "java/lang/IllegalArgumentException", "nativeRun: configPath is null");
    return;
  }
  const char* chars = env->GetStringUTFChars(config_path, nullptr);
  if (chars == nullptr) return;  // OutOfMemoryError is pending
  const std::string path(chars);
  env->ReleaseStringUTFChars(config_path, chars);

  RunningGuard guard;
  if (!guard.acquired()) {
    throw_simple(env, "java/lang/IllegalStateException",
                 "nativeRun(" + path + "): a stage is already running in this process");
    return;
  }
  // A stop request belongs to the run it was made for; a new run starts
  // clean. (The Kotlin service never starts a run after asking to stop.)
  g_stop_requested.store(false);

  zl::RunnerConfig config;
  zl::Status status = zl::load_runner_config(path, &config);
  if (!status.ok()) {
    throw_status(env, "stage config " + path, status);
    return;
  }
  zl::log(zl::LogLevel::kInfo, "jni: stage %lld of %lld from %s", static_cast<long long>(config.stage_index),
          static_cast<long long>(config.num_stages), path.c_str());
  status = zl::run_stage(config, &g_stop_requested);
  if (!status.ok()) {
    throw_status(env, "stage " + std::to_string(config.stage_index) + " (config " + path + ")", status);
  }
}

jboolean native_stop(JNIEnv*, jclass) {
  g_stop_requested.store(true);
  return g_running.load() ? JNI_TRUE : JNI_FALSE;
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
      {const_cast<char*>("nativeRun"), const_cast<char*>("(Ljava/lang/String;)V"),
       reinterpret_cast<void*>(native_run)},
      {const_cast<char*>("nativeStop"), const_cast<char*>("()Z"), reinterpret_cast<void*>(native_stop)},
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
