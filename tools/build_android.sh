#!/usr/bin/env bash
# Builds zl for Android arm64-v8a: the `zl_runner` executable (adb mode,
# /data/local/tmp/zerolock/) into build-android/ at the repository root, and
# the app's APK with Gradle, which builds libzl_jni.so itself
# (android_app/app/app/build.gradle.kts, externalNativeBuild).
#
#   export ANDROID_HOME=$HOME/Android/Sdk    # platform 35, build-tools 35.0.0, ndk 28.2.13676358, cmake 3.31.6
#   export ANDROID_NDK=$ANDROID_HOME/ndk/28.2.13676358   # for zl_runner: r27 or newer; default: that folder
#   export EXECUTORCH_ANDROID_PREFIX=$HOME/et-android-arm64-v8a   # ExecuTorch 1.5.1 installed for arm64-v8a
#   export ZL_SODIUM_ANDROID_PREFIX=$HOME/libsodium-android-armv8-a+crypto
#   tools/build_android.sh [--check] [--clean] [--native-only | --apk-only] [--release]
#
#   --check        check the prerequisites, build nothing
#   --clean        delete what this run builds first (build-android/; the app's build/ and .cxx/)
#   --native-only  zl_runner and libzl_jni.so into build-android/; no APK (no SDK, JDK or Gradle needed)
#   --apk-only     the APK only, no zl_runner
#   --release      assembleRelease instead of assembleDebug: an unsigned APK, to sign with your key
#
# android_app/README.md says how to produce the two prefixes. This script
# downloads nothing (Gradle fetches its plugins and libraries). Outputs:
#   build-android/zl_runner
#   build-android/libzl_jni.so                                  (--native-only)
#   android_app/app/app/build/outputs/apk/debug/app-debug.apk
#   android_app/app/app/build/outputs/apk/release/app-release-unsigned.apk  (--release)
#
# The APK needs a JDK 17 (JAVA_HOME, else java on PATH) and Gradle:
# android_app/app/gradlew if it exists, else gradle (8.11.1) on PATH.
# Optional: ZL_OPENBLAS_ANDROID_PREFIX (OpenBLAS built for arm64-v8a, the GEMM
# of zl's kernels; without it Eigen's), NLOHMANN_JSON_INCLUDE_DIR (folder with nlohmann/json.hpp, default
# /usr/include), ZL_ANDROID_PLATFORM (zl_runner's API level, default
# android-26), ZL_BUILD_TYPE (default Release), ZL_JOBS (default 2),
# ZL_ANDROID_BUILD_DIR (default <repo>/build-android),
# ZL_ALLOW_EXECUTORCH_VERSION_MISMATCH=1.
set -euo pipefail

readonly EXPECTED_ET_VERSION="1.5.1"
readonly MIN_NDK_MAJOR=27
readonly ABI="arm64-v8a"
# What android_app/app pins (app/build.gradle.kts, gradle-wrapper.properties).
readonly APP_COMPILE_SDK=35
readonly APP_BUILD_TOOLS="35.0.0"
readonly APP_NDK_VERSION="28.2.13676358"
readonly APP_CMAKE_VERSION="3.31.6"
readonly GRADLE_VERSION="8.11.1"
readonly MIN_JDK=17
readonly MAX_JDK=23   # the newest JDK Gradle 8.11 runs on

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
APP_DIR="$REPO_ROOT/android_app/app"
BUILD_DIR="${ZL_ANDROID_BUILD_DIR:-${REPO_ROOT}/build-android}"
[[ "$BUILD_DIR" == /* ]] || BUILD_DIR="$PWD/$BUILD_DIR"
CHECK_ONLY=0
CLEAN=0
NATIVE=1
APK=1
VARIANT=debug

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; }

bad_usage() {
  echo "build_android.sh: $1" >&2
  echo "  usage: tools/build_android.sh [--check] [--clean] [--native-only | --apk-only] [--release] (--help for more)" >&2
  exit 2
}
for arg in "$@"; do
  case "$arg" in
    --check) CHECK_ONLY=1 ;;
    --clean) CLEAN=1 ;;
    --native-only) APK=0 ;;
    --apk-only) NATIVE=0 ;;
    --release) VARIANT=release ;;
    -h|--help) usage; exit 0 ;;
    *) bad_usage "unknown argument '$arg'" ;;
  esac
done
(( NATIVE || APK )) || bad_usage "--native-only and --apk-only exclude each other"
[[ "$VARIANT" == debug || "$APK" == 1 ]] || bad_usage "--release builds the APK; it does not go with --native-only"

die() {
  echo "build_android.sh: error: $1" >&2
  shift
  for line in "$@"; do echo "  $line" >&2; done
  exit 1
}
note() { echo "build_android.sh: $*" >&2; }

# True if version $1 < version $2 (dotted numbers).
version_lt() {
  local IFS=.
  local -a a b
  read -ra a <<<"$1"
  read -ra b <<<"$2"
  local i
  for (( i = 0; i < ${#a[@]} || i < ${#b[@]}; i++ )); do
    (( 10#${a[i]:-0} < 10#${b[i]:-0} )) && return 0
    (( 10#${a[i]:-0} > 10#${b[i]:-0} )) && return 1
  done
  return 1
}

# Value of key $2 in the Java properties file $1 (empty if absent).
property_of() {
  [[ -f "$1" ]] || return 0
  sed -n "s/^[[:space:]]*$2[[:space:]]*[=:][[:space:]]*//p" "$1" | tr -d '\r' | sed 's/\\:/:/g; s/\\\\/\\/g' | tail -n1
}

# --- the Android SDK (found the way the Android Gradle plugin finds it) ---------
# local.properties' sdk.dir first, then ANDROID_HOME, then ANDROID_SDK_ROOT.
SDK="$(property_of "$APP_DIR/local.properties" sdk.dir)"
SDK_FROM="sdk.dir in android_app/app/local.properties"
if [[ -z "$SDK" ]]; then
  SDK="${ANDROID_HOME:-${ANDROID_SDK_ROOT:-}}"
  SDK_FROM="$([[ -n "${ANDROID_HOME:-}" ]] && echo ANDROID_HOME || echo ANDROID_SDK_ROOT)"
fi

# --- the NDK -----------------------------------------------------------------
NDK="${ANDROID_NDK:-${ANDROID_NDK_HOME:-${ANDROID_NDK_ROOT:-}}}"
if [[ -z "$NDK" && -n "$SDK" && -f "$SDK/ndk/$APP_NDK_VERSION/source.properties" ]]; then
  NDK="$SDK/ndk/$APP_NDK_VERSION"
  note "ANDROID_NDK is not set; using the SDK's NDK $APP_NDK_VERSION ($NDK)"
fi
[[ -n "$NDK" ]] || die "ANDROID_NDK is not set" \
  "Install NDK r28c (r${MIN_NDK_MAJOR}+ works for zl_runner; the app pins $APP_NDK_VERSION), e.g. with" \
  "Android Studio's SDK Manager or: sdkmanager 'ndk;$APP_NDK_VERSION'" \
  "then: export ANDROID_NDK=\$ANDROID_HOME/ndk/$APP_NDK_VERSION (with ANDROID_HOME set, that folder is the default)"
[[ -d "$NDK" ]] || die "ANDROID_NDK=$NDK is not a directory"
TOOLCHAIN_FILE="$NDK/build/cmake/android.toolchain.cmake"
[[ -f "$TOOLCHAIN_FILE" ]] || die "ANDROID_NDK=$NDK has no build/cmake/android.toolchain.cmake; is it an NDK root?"
[[ -f "$NDK/source.properties" ]] || die "ANDROID_NDK=$NDK has no source.properties; cannot tell its version"
NDK_REVISION="$(property_of "$NDK/source.properties" 'Pkg\.Revision')"
NDK_MAJOR="${NDK_REVISION%%.*}"
[[ "$NDK_MAJOR" =~ ^[0-9]+$ ]] || die "cannot read Pkg.Revision from $NDK/source.properties (got '$NDK_REVISION')"
(( NDK_MAJOR >= MIN_NDK_MAJOR )) || die "NDK $NDK_REVISION is too old; need r${MIN_NDK_MAJOR} or newer" \
  "r27 is the first NDK with ANDROID_SUPPORT_FLEXIBLE_PAGE_SIZES (16 KB pages, Android 15+);" \
  "ExecuTorch's own CI builds with r28c: sdkmanager 'ndk;$APP_NDK_VERSION'"
READELF=""
for candidate in "$NDK"/toolchains/llvm/prebuilt/*/bin/llvm-readelf; do
  if [[ -x "$candidate" ]]; then READELF="$candidate"; break; fi
done
[[ -n "$READELF" ]] || die "no llvm-readelf under $NDK/toolchains/llvm/prebuilt/*/bin; incomplete NDK?"

# Prints the ELF machine of a static archive or shared object ("AArch64", ...).
elf_machine() {
  { "$READELF" -h "$1" 2>/dev/null || true; } | sed -n 's/^ *Machine: *//p' | sed -n 1p
}
require_aarch64() {  # $1 = file, $2 = what it is
  local machine
  machine="$(elf_machine "$1")"
  [[ "$machine" == "AArch64" ]] || die "$2 ($1) is built for '${machine:-unknown}', not AArch64 (arm64-v8a)" \
    "Rebuild it with the NDK toolchain and ANDROID_ABI=$ABI."
}

# --- host tools (zl_runner; the APK uses the SDK's CMake, checked below) -------
GENERATOR=()
if (( NATIVE )); then
  command -v cmake >/dev/null || die "cmake not found; need CMake 3.24+ (ExecuTorch's package config needs it)"
  CMAKE_VERSION="$(cmake --version | sed -n 's/^cmake version \([0-9.]*\).*/\1/p')"
  ! version_lt "$CMAKE_VERSION" 3.24 \
    || die "cmake $CMAKE_VERSION is too old; need 3.24+ (ExecuTorch's installed package config requires it)"
  if command -v ninja >/dev/null; then GENERATOR=(-G Ninja); fi
fi

# --- ExecuTorch built for Android ----------------------------------------------
ET_PREFIX="${EXECUTORCH_ANDROID_PREFIX:-}"
[[ -n "$ET_PREFIX" ]] || die "EXECUTORCH_ANDROID_PREFIX is not set" \
  "Build ExecuTorch $EXPECTED_ET_VERSION for $ABI and install it to a prefix (android_app/README.md," \
  "\"ExecuTorch for Android\"), then: export EXECUTORCH_ANDROID_PREFIX=/that/prefix"
[[ -d "$ET_PREFIX" ]] || die "EXECUTORCH_ANDROID_PREFIX=$ET_PREFIX is not a directory"
ET_PREFIX="$(cd "$ET_PREFIX" && pwd)"
ET_CONFIG_DIR=""
for candidate in "$ET_PREFIX/lib/cmake/ExecuTorch" "$ET_PREFIX/lib64/cmake/ExecuTorch" "$ET_PREFIX/share/cmake"; do
  if [[ -f "$candidate/executorch-config.cmake" ]]; then ET_CONFIG_DIR="$candidate"; break; fi
done
[[ -n "$ET_CONFIG_DIR" ]] || die "EXECUTORCH_ANDROID_PREFIX=$ET_PREFIX has no lib/cmake/ExecuTorch/executorch-config.cmake" \
  "Point it at the CMAKE_INSTALL_PREFIX of an ExecuTorch build ('cmake --build ... --target install')."
[[ -f "$ET_CONFIG_DIR/ExecuTorchTargets.cmake" ]] || die "$ET_CONFIG_DIR has executorch-config.cmake but no ExecuTorchTargets.cmake" \
  "That is the pip wheel's package (host only, shared libraries), not an Android install."
if (( APK )) && [[ "$ET_CONFIG_DIR" != "$ET_PREFIX/lib/cmake/ExecuTorch" ]]; then
  die "the ExecuTorch package config is in $ET_CONFIG_DIR; the app's Gradle build looks in $ET_PREFIX/lib/cmake/ExecuTorch" \
    "Install ExecuTorch with the default CMAKE_INSTALL_LIBDIR (lib), or build with --native-only."
fi
ET_LIBDIR="$(dirname "$(dirname "$ET_CONFIG_DIR")")"
[[ "$ET_CONFIG_DIR" == */share/cmake ]] && ET_LIBDIR="$ET_PREFIX/lib"
for lib in executorch executorch_core extension_module_static extension_data_loader extension_flat_tensor extension_tensor; do
  [[ -f "$ET_LIBDIR/lib$lib.a" ]] || die "$ET_LIBDIR/lib$lib.a is missing" \
    "Rebuild ExecuTorch with the options listed in android_app/README.md" \
    "(EXECUTORCH_BUILD_EXTENSION_MODULE/_DATA_LOADER/_FLAT_TENSOR/_NAMED_DATA_MAP/_TENSOR/_TRAINING=ON)."
done
if [[ -f "$ET_LIBDIR/liboptimized_native_cpu_ops_lib.a" ]]; then
  ET_KERNELS="optimized_native_cpu_ops_lib"
elif [[ -f "$ET_LIBDIR/libportable_ops_lib.a" ]]; then
  ET_KERNELS="portable_ops_lib"
  note "warning: $ET_LIBDIR has no liboptimized_native_cpu_ops_lib.a; using the (slow) portable kernels." \
    "Rebuild ExecuTorch with -DEXECUTORCH_BUILD_KERNELS_OPTIMIZED=ON for phone-speed training."
else
  die "$ET_LIBDIR has neither liboptimized_native_cpu_ops_lib.a nor libportable_ops_lib.a: no operator kernels"
fi
require_aarch64 "$ET_LIBDIR/libexecutorch_core.a" "ExecuTorch"
ET_VERSION_H="$ET_PREFIX/include/executorch/runtime/core/version.h"
if [[ -f "$ET_VERSION_H" ]]; then
  ET_VERSION="$(sed -n 's/^#define ET_VERSION "\(.*\)"/\1/p' "$ET_VERSION_H")"
  if [[ "$ET_VERSION" != "$EXPECTED_ET_VERSION" ]]; then
    if [[ "${ZL_ALLOW_EXECUTORCH_VERSION_MISMATCH:-0}" == 1 ]]; then
      note "warning: ExecuTorch at $ET_PREFIX is $ET_VERSION, not $EXPECTED_ET_VERSION (allowed by ZL_ALLOW_EXECUTORCH_VERSION_MISMATCH=1)"
    else
      die "ExecuTorch at $ET_PREFIX is version ${ET_VERSION:-unknown}; the .pte files come from the executorch $EXPECTED_ET_VERSION pip package" \
        "Build the v$EXPECTED_ET_VERSION tag, or set ZL_ALLOW_EXECUTORCH_VERSION_MISMATCH=1 to try anyway."
    fi
  fi
else
  note "warning: $ET_VERSION_H is missing; cannot check that ExecuTorch is $EXPECTED_ET_VERSION"
fi

# --- libsodium built for Android -----------------------------------------------
SODIUM_PREFIX="${ZL_SODIUM_ANDROID_PREFIX:-}"
[[ -n "$SODIUM_PREFIX" ]] || die "ZL_SODIUM_ANDROID_PREFIX is not set" \
  "Build libsodium 1.0.18+ for arm64-v8a with its own script (android_app/README.md, \"libsodium for Android\")," \
  "e.g. in a libsodium release tree: ANDROID_NDK_HOME=\$ANDROID_NDK ./dist-build/android-armv8-a.sh" \
  "then: export ZL_SODIUM_ANDROID_PREFIX=\$PWD/libsodium-android-armv8-a+crypto"
[[ -f "$SODIUM_PREFIX/include/sodium.h" ]] || die "ZL_SODIUM_ANDROID_PREFIX=$SODIUM_PREFIX has no include/sodium.h"
[[ -f "$SODIUM_PREFIX/lib/libsodium.a" ]] || die "ZL_SODIUM_ANDROID_PREFIX=$SODIUM_PREFIX has no lib/libsodium.a"
SODIUM_PREFIX="$(cd "$SODIUM_PREFIX" && pwd)"
require_aarch64 "$SODIUM_PREFIX/lib/libsodium.a" "libsodium"

# --- nlohmann_json (header-only) -------------------------------------------------
JSON_INCLUDE="${NLOHMANN_JSON_INCLUDE_DIR:-/usr/include}"
[[ -f "$JSON_INCLUDE/nlohmann/json.hpp" ]] || die "no nlohmann/json.hpp under $JSON_INCLUDE" \
  "Install it (Debian/Ubuntu: apt-get install nlohmann-json3-dev) or set NLOHMANN_JSON_INCLUDE_DIR" \
  "to a folder holding nlohmann/json.hpp (3.x; single-include or the full tree)."
JSON_MAJOR="$(sed -n 's/^#define NLOHMANN_JSON_VERSION_MAJOR \([0-9]*\).*/\1/p' "$JSON_INCLUDE/nlohmann/json.hpp" | sed -n 1p)"
if [[ -z "$JSON_MAJOR" && -f "$JSON_INCLUDE/nlohmann/detail/abi_macros.hpp" ]]; then
  JSON_MAJOR="$(sed -n 's/^ *#define NLOHMANN_JSON_VERSION_MAJOR \([0-9]*\).*/\1/p' "$JSON_INCLUDE/nlohmann/detail/abi_macros.hpp" | sed -n 1p)"
fi
[[ "$JSON_MAJOR" == 3 ]] || die "nlohmann/json.hpp under $JSON_INCLUDE is version '${JSON_MAJOR:-unknown}'.x; need 3.x"

# --- Eigen (header-only; the GEMM of zl's fast kernels) -------------------------
EIGEN_INCLUDE="${ZL_EIGEN_INCLUDE_DIR:-/usr/include/eigen3}"
[[ -f "$EIGEN_INCLUDE/Eigen/Core" ]] || die "no Eigen/Core under $EIGEN_INCLUDE" \
  "Install it (Debian/Ubuntu: apt-get install libeigen3-dev) or set ZL_EIGEN_INCLUDE_DIR" \
  "to a folder holding Eigen/Core (Eigen 3.3 or 3.4)."

# --- OpenBLAS built for Android (optional; the GEMM of zl's kernels) -------------
OPENBLAS_ARGS=()
OPENBLAS_GRADLE=()
if [[ -n "${ZL_OPENBLAS_ANDROID_PREFIX:-}" ]]; then
  OPENBLAS_PREFIX="$ZL_OPENBLAS_ANDROID_PREFIX"
  [[ -f "$OPENBLAS_PREFIX/lib/libopenblas.a" ]] || die "ZL_OPENBLAS_ANDROID_PREFIX=$OPENBLAS_PREFIX has no lib/libopenblas.a" \
    "Build OpenBLAS for arm64-v8a as android_app/README.md (\"OpenBLAS for Android\") says, or unset it to use Eigen's GEMM."
  [[ -f "$OPENBLAS_PREFIX/include/cblas.h" || -f "$OPENBLAS_PREFIX/include/openblas/cblas.h" ]] \
    || die "ZL_OPENBLAS_ANDROID_PREFIX=$OPENBLAS_PREFIX has no include/cblas.h"
  OPENBLAS_PREFIX="$(cd "$OPENBLAS_PREFIX" && pwd)"
  require_aarch64 "$OPENBLAS_PREFIX/lib/libopenblas.a" "OpenBLAS"
  OPENBLAS_ARGS=(-DZL_OPENBLAS_PREFIX="$OPENBLAS_PREFIX")
  OPENBLAS_GRADLE=(-Pzl.openblasPrefix="$OPENBLAS_PREFIX")
  note "OpenBLAS at $OPENBLAS_PREFIX (the GEMM of zl's kernels)"
else
  note "ZL_OPENBLAS_ANDROID_PREFIX is not set: zl's kernels use Eigen's GEMM (slower; android_app/README.md, \"OpenBLAS for Android\")"
fi

# --- platform ------------------------------------------------------------------
PLATFORM="${ZL_ANDROID_PLATFORM:-android-26}"
[[ "$PLATFORM" =~ ^android-([0-9]+)$ ]] || die "ZL_ANDROID_PLATFORM=$PLATFORM; expected android-<API level>, e.g. android-26"
(( BASH_REMATCH[1] >= 26 )) || die "ZL_ANDROID_PLATFORM=$PLATFORM is below android-26, the floor ExecuTorch's Android build uses"
BUILD_TYPE="${ZL_BUILD_TYPE:-Release}"

# --- the APK: SDK packages, JDK, Gradle ------------------------------------------
GRADLE=()
if (( APK )); then
  if [[ -n "${ANDROID_HOME:-}" && -n "${ANDROID_SDK_ROOT:-}" && "$SDK_FROM" != sdk.dir* ]] \
    && [[ "$(cd "$ANDROID_HOME" 2>/dev/null && pwd -P)" != "$(cd "$ANDROID_SDK_ROOT" 2>/dev/null && pwd -P)" ]]; then
    die "ANDROID_HOME=$ANDROID_HOME and ANDROID_SDK_ROOT=$ANDROID_SDK_ROOT name different SDKs; the Android Gradle plugin refuses that" \
      "Unset one of them (ANDROID_SDK_ROOT is the deprecated one)."
  fi
  [[ -n "$SDK" ]] || die "ANDROID_HOME is not set: the APK needs the Android SDK" \
    "Install it (Android Studio, or the command-line tools: https://developer.android.com/tools/sdkmanager)," \
    "then: export ANDROID_HOME=\$HOME/Android/Sdk  (or build zl_runner only: --native-only)"
  [[ -d "$SDK" ]] || die "$SDK_FROM=$SDK is not a directory"
  missing=()
  [[ -f "$SDK/platforms/android-$APP_COMPILE_SDK/android.jar" ]] || missing+=("platforms;android-$APP_COMPILE_SDK")
  [[ -f "$SDK/build-tools/$APP_BUILD_TOOLS/source.properties" ]] || missing+=("build-tools;$APP_BUILD_TOOLS")
  [[ -f "$SDK/ndk/$APP_NDK_VERSION/source.properties" ]] || missing+=("ndk;$APP_NDK_VERSION")
  # The plugin takes CMake from cmake.dir in local.properties, the SDK, or PATH, in that order.
  APP_CMAKE=""
  if [[ -n "$(property_of "$APP_DIR/local.properties" cmake.dir)" ]]; then
    APP_CMAKE="cmake.dir in android_app/app/local.properties"
  elif [[ -x "$SDK/cmake/$APP_CMAKE_VERSION/bin/cmake" ]]; then
    APP_CMAKE="$SDK/cmake/$APP_CMAKE_VERSION"
  elif command -v cmake >/dev/null \
    && [[ "$(cmake --version | sed -n 's/^cmake version \([0-9.]*\).*/\1/p')" == "$APP_CMAKE_VERSION" ]]; then
    APP_CMAKE="$(command -v cmake)"
  else
    missing+=("cmake;$APP_CMAKE_VERSION")
  fi
  if (( ${#missing[@]} )); then
    die "the Android SDK at $SDK ($SDK_FROM) lacks what the app's Gradle build pins: ${missing[*]}" \
      "Install them with Android Studio's SDK Manager or:" \
      "  $SDK/cmdline-tools/latest/bin/sdkmanager$(printf " '%s'" "${missing[@]}")"
  fi
  if (( NATIVE )) && [[ "$NDK_REVISION" != "$APP_NDK_VERSION" ]]; then
    note "zl_runner is built with NDK $NDK_REVISION ($NDK); the app with NDK $APP_NDK_VERSION from the SDK"
  fi

  # JDK: Gradle runs on JAVA_HOME if set, else on the java found on PATH.
  if [[ -n "${JAVA_HOME:-}" ]]; then
    JAVA="$JAVA_HOME/bin/java"
    [[ -x "$JAVA" ]] || die "JAVA_HOME=$JAVA_HOME has no bin/java" \
      "Set JAVA_HOME to a JDK $MIN_JDK (e.g. /usr/lib/jvm/java-17-openjdk-amd64, or Android Studio's jbr/)."
    JAVA_FROM="JAVA_HOME=$JAVA_HOME"
  else
    JAVA="$(command -v java || true)"
    [[ -n "$JAVA" ]] || die "no JDK: JAVA_HOME is not set and java is not on PATH; Gradle needs JDK $MIN_JDK" \
      "Install one (Debian/Ubuntu: apt-get install openjdk-17-jdk-headless; or use Android Studio's jbr/)" \
      "and set JAVA_HOME to it."
    JAVA_FROM="java on PATH ($JAVA)"
  fi
  JDK_HOME="$("$JAVA" -XshowSettings:properties -version 2>&1 | sed -n 's/^ *java\.home = //p' | sed -n 1p)"
  [[ -n "$JDK_HOME" ]] || JDK_HOME="$(cd "$(dirname "$JAVA")/.." && pwd)"
  JDK_VERSION="$("$JAVA" -version 2>&1 | sed -n 's/.* version "\([^"]*\)".*/\1/p' | sed -n 1p)"
  JDK_MAJOR="${JDK_VERSION%%[.+-]*}"
  [[ "$JDK_VERSION" == 1.* ]] && JDK_MAJOR="$(echo "$JDK_VERSION" | cut -d. -f2)"
  [[ "$JDK_MAJOR" =~ ^[0-9]+$ ]] || die "cannot tell the Java version of $JAVA_FROM (got '$JDK_VERSION')"
  (( JDK_MAJOR >= MIN_JDK )) || die "$JAVA_FROM is Java $JDK_VERSION; the Android Gradle plugin 8.9 needs JDK $MIN_JDK" \
    "Install JDK 17 (Debian/Ubuntu: apt-get install openjdk-17-jdk-headless) and set JAVA_HOME to it."
  if (( JDK_MAJOR > MAX_JDK )); then
    note "warning: $JAVA_FROM is Java $JDK_VERSION; Gradle $GRADLE_VERSION runs on JDK $MIN_JDK-$MAX_JDK." \
      "If Gradle fails with 'Unsupported class file major version', set JAVA_HOME to a JDK 17."
  fi
  [[ -x "$JDK_HOME/bin/javac" && -x "$JDK_HOME/bin/jlink" ]] || die "$JAVA_FROM is a JRE ($JDK_HOME has no bin/javac or bin/jlink); Gradle needs a JDK" \
    "Install JDK 17 (Debian/Ubuntu: apt-get install openjdk-17-jdk-headless) and set JAVA_HOME to it."
  export JAVA_HOME="$JDK_HOME"

  # Gradle: the wrapper if it has been made, else gradle on PATH.
  if [[ -f "$APP_DIR/gradlew" ]]; then
    [[ -f "$APP_DIR/gradle/wrapper/gradle-wrapper.jar" ]] || die "android_app/app/gradlew exists but gradle/wrapper/gradle-wrapper.jar does not" \
      "Make the wrapper again: cd android_app/app && gradle wrapper --gradle-version $GRADLE_VERSION"
    GRADLE=("$APP_DIR/gradlew")
    [[ -x "$APP_DIR/gradlew" ]] || GRADLE=(sh "$APP_DIR/gradlew")
    WRAPPER_URL="$(property_of "$APP_DIR/gradle/wrapper/gradle-wrapper.properties" distributionUrl)"
    GRADLE_FOUND="$(echo "$WRAPPER_URL" | sed -n 's/.*gradle-\([0-9][0-9.]*\)-.*/\1/p')"
    GRADLE_FROM="android_app/app/gradlew (Gradle ${GRADLE_FOUND:-?})"
  elif command -v gradle >/dev/null; then
    GRADLE=(gradle)
    GRADLE_FOUND="$(gradle --version 2>/dev/null | sed -n 's/^Gradle \([0-9][0-9.]*\).*/\1/p' | sed -n 1p || true)"
    GRADLE_FROM="gradle on PATH ($(command -v gradle), Gradle ${GRADLE_FOUND:-?})"
  else
    die "no Gradle: android_app/app/gradlew does not exist and gradle is not on PATH" \
      "The wrapper is not committed. Make it once with any Gradle (https://gradle.org/install):" \
      "  cd android_app/app && gradle wrapper --gradle-version $GRADLE_VERSION" \
      "or open android_app/app in Android Studio, or install Gradle $GRADLE_VERSION on PATH."
  fi
  [[ -n "$GRADLE_FOUND" ]] || die "cannot tell the version of $GRADLE_FROM"
  if version_lt "$GRADLE_FOUND" "$GRADLE_VERSION"; then
    die "$GRADLE_FROM is too old: the Android Gradle plugin 8.9.0 needs Gradle $GRADLE_VERSION or newer" \
      "Make the wrapper: cd android_app/app && gradle wrapper --gradle-version $GRADLE_VERSION"
  elif [[ "$GRADLE_FOUND" != "$GRADLE_VERSION" ]]; then
    note "warning: $GRADLE_FROM is not $GRADLE_VERSION, the version android_app/app is set up for;" \
      "if the build fails, use the wrapper: cd android_app/app && gradle wrapper --gradle-version $GRADLE_VERSION"
  fi
fi

note "NDK $NDK_REVISION at $NDK"
note "ExecuTorch ${ET_VERSION:-?} at $ET_PREFIX (kernels: $ET_KERNELS)"
note "libsodium at $SODIUM_PREFIX; nlohmann_json $JSON_MAJOR.x from $JSON_INCLUDE"
if (( NATIVE )); then note "zl_runner: $ABI, $PLATFORM, $BUILD_TYPE, cmake $CMAKE_VERSION; build folder $BUILD_DIR"; fi
if (( APK )); then
  note "APK ($VARIANT): SDK $SDK ($SDK_FROM), CMake $APP_CMAKE_VERSION ($APP_CMAKE), JDK $JDK_VERSION ($JDK_HOME), $GRADLE_FROM"
fi
if (( CHECK_ONLY )); then
  note "prerequisites OK (--check: nothing built)"
  exit 0
fi

# --- build -----------------------------------------------------------------------
if (( CLEAN )); then
  if (( NATIVE )); then rm -rf "$BUILD_DIR"; fi
  if (( APK )); then rm -rf "$APP_DIR/app/build" "$APP_DIR/app/.cxx" "$APP_DIR/build"; fi
fi
# Only the nlohmann headers go on the Android include path: the host's
# /usr/include would put glibc headers in front of the NDK's. Copied again
# only when they changed, so that nothing recompiles for nothing.
JSON_COPY="$BUILD_DIR/deps/nlohmann_json/include"
if ! diff -rq "$JSON_INCLUDE/nlohmann" "$JSON_COPY/nlohmann" >/dev/null 2>&1; then
  rm -rf "$JSON_COPY/nlohmann"
  mkdir -p "$JSON_COPY"
  cp -R "$JSON_INCLUDE/nlohmann" "$JSON_COPY/"
fi

if (( NATIVE )); then
  NATIVE_TARGETS=(zl_runner)
  if (( ! APK )); then NATIVE_TARGETS+=(zl_jni); fi
  cmake -S "$REPO_ROOT/android_app" -B "$BUILD_DIR" ${GENERATOR[@]+"${GENERATOR[@]}"} \
    -DCMAKE_TOOLCHAIN_FILE="$TOOLCHAIN_FILE" \
    -DANDROID_ABI="$ABI" \
    -DANDROID_PLATFORM="$PLATFORM" \
    -DANDROID_STL=c++_static \
    -DANDROID_SUPPORT_FLEXIBLE_PAGE_SIZES=ON \
    -DCMAKE_BUILD_TYPE="$BUILD_TYPE" \
    -Dexecutorch_DIR="$ET_CONFIG_DIR" \
    -DCMAKE_FIND_ROOT_PATH="$ET_PREFIX" \
    -DZL_SODIUM_PREFIX="$SODIUM_PREFIX" \
    -DZL_NLOHMANN_JSON_INCLUDE_DIR="$JSON_COPY" \
    -DZL_EIGEN_INCLUDE_DIR="$EIGEN_INCLUDE" \
    ${OPENBLAS_ARGS[@]+"${OPENBLAS_ARGS[@]}"}

  # Both targets are defined only once their sources exist (the stage loop in
  # runner/app and include/zl/runner.h); say so instead of make's
  # "No rule to make target".
  for target in "${NATIVE_TARGETS[@]}"; do
    grep -qx "$target" "$BUILD_DIR/zl_targets.txt" \
      || die "the configured project has no '$target' target" \
        "zl_runner needs runner/app/zl_runner_main.cpp; zl_jni needs runner/include/zl/runner.h."
  done
  cmake --build "$BUILD_DIR" --target "${NATIVE_TARGETS[@]}" -j "${ZL_JOBS:-2}"

  require_aarch64 "$BUILD_DIR/zl_runner" "zl_runner"
  if (( ! APK )); then require_aarch64 "$BUILD_DIR/libzl_jni.so" "libzl_jni.so"; fi
fi

if (( APK )); then
  TASK=assembleDebug
  [[ "$VARIANT" == release ]] && TASK=assembleRelease
  note "building the APK: ${GRADLE[*]} $TASK (in android_app/app)"
  (
    cd "$APP_DIR"
    "${GRADLE[@]}" "$TASK" \
      -Pzl.executorchPrefix="$ET_PREFIX" \
      -Pzl.sodiumPrefix="$SODIUM_PREFIX" \
      -Pzl.nlohmannJsonInclude="$JSON_COPY" \
      ${OPENBLAS_GRADLE[@]+"${OPENBLAS_GRADLE[@]}"} \
      -Pzl.nativeBuildType="$BUILD_TYPE"
  )
  APK_DIR="$APP_DIR/app/build/outputs/apk/$VARIANT"
  APK_FILE="$APK_DIR/app-$VARIANT.apk"
  # Without a signing config of yours, assembleRelease writes app-release-unsigned.apk
  # (app-release.apk may then be an older one you signed).
  if [[ "$VARIANT" == release && "$APK_DIR/app-release-unsigned.apk" -nt "$APK_FILE" ]]; then
    APK_FILE="$APK_DIR/app-release-unsigned.apk"
  fi
  [[ -f "$APK_FILE" ]] || die "Gradle finished but wrote no $APK_FILE" "Look in $APK_DIR; android_app/app/app/build.gradle.kts builds it."
  # The library must be in the APK, or the app fails only on the phone (UnsatisfiedLinkError).
  if [[ -x "$JDK_HOME/bin/jar" ]]; then
    "$JDK_HOME/bin/jar" tf "$APK_FILE" | grep -qx "lib/$ABI/libzl_jni.so" \
      || die "$APK_FILE has no lib/$ABI/libzl_jni.so" \
        "The CMake build of android_app/CMakeLists.txt did not hand libzl_jni.so to Gradle; see the Gradle output above."
  fi
fi

note "built:"
if (( NATIVE )); then
  ls -l "$BUILD_DIR/zl_runner" >&2
  if (( ! APK )); then ls -l "$BUILD_DIR/libzl_jni.so" >&2; fi
fi
if (( APK )); then
  ls -l "$APK_FILE" >&2
  echo "APK: ${APK_FILE#"$REPO_ROOT"/}"
  if [[ "$APK_FILE" == *-unsigned.apk ]]; then
    note "the release APK is unsigned; sign it with your key before installing (android_app/README.md, \"Build\"):" \
      "$SDK/build-tools/$APP_BUILD_TOOLS/apksigner sign --ks your.jks --out $APK_DIR/app-release.apk $APK_FILE"
  elif [[ "$VARIANT" == debug ]]; then
    note "next: adb install -r ${APK_FILE#"$REPO_ROOT"/}, or zl deploy --mode app (installs this APK; ZL_ANDROID_APK names another)"
  fi
fi
if (( NATIVE )); then note "zl_runner: adb push it (android_app/README.md), or zl deploy"; fi
