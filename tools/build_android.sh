#!/usr/bin/env bash
# Builds the stage runner for Android arm64-v8a: the `zl_runner` executable
# (for adb, /data/local/tmp/zerolock/) and `libzl_jni.so` (for the Kotlin app),
# into build-android/ at the repository root.
#
#   export ANDROID_NDK=$HOME/Android/Sdk/ndk/28.2.13676358      # NDK r27 or newer; r28c tested by ExecuTorch CI
#   export EXECUTORCH_ANDROID_PREFIX=$HOME/et-android-arm64      # ExecuTorch 1.5.1 installed for arm64-v8a
#   export ZL_SODIUM_ANDROID_PREFIX=$HOME/libsodium-android-armv8-a+crypto
#   android_app/build_android.sh            # or: --check (prerequisites only), --clean
#
# android_app/README.md says how to produce the two prefixes. Nothing here
# downloads anything. Outputs:
#   build-android/zl_runner
#   build-android/libzl_jni.so
#   build-android/jniLibs/arm64-v8a/libzl_jni.so   (what the Gradle project packages)
#
# Optional: NLOHMANN_JSON_INCLUDE_DIR (folder with nlohmann/json.hpp, default
# /usr/include), ZL_ANDROID_PLATFORM (default android-26), ZL_BUILD_TYPE
# (default Release), ZL_JOBS (default 2), ZL_ANDROID_BUILD_DIR (default
# <repo>/build-android), ZL_ALLOW_EXECUTORCH_VERSION_MISMATCH=1.
set -euo pipefail

readonly EXPECTED_ET_VERSION="1.5.1"
readonly MIN_NDK_MAJOR=27
readonly ABI="arm64-v8a"

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${ZL_ANDROID_BUILD_DIR:-${REPO_ROOT}/build-android}"
CHECK_ONLY=0
CLEAN=0

usage() { sed -n '2,22p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

for arg in "$@"; do
  case "$arg" in
    --check) CHECK_ONLY=1 ;;
    --clean) CLEAN=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "build_android.sh: unknown argument '$arg' (expected --check, --clean or --help)" >&2; exit 2 ;;
  esac
done

die() {
  echo "build_android.sh: error: $1" >&2
  shift
  for line in "$@"; do echo "  $line" >&2; done
  exit 1
}
note() { echo "build_android.sh: $*" >&2; }

# --- the NDK -----------------------------------------------------------------
NDK="${ANDROID_NDK:-${ANDROID_NDK_HOME:-${ANDROID_NDK_ROOT:-}}}"
[[ -n "$NDK" ]] || die "ANDROID_NDK is not set" \
  "Install NDK r${MIN_NDK_MAJOR}+ (r28c recommended), e.g. with Android Studio's SDK Manager or" \
  "  sdkmanager 'ndk;28.2.13676358'" \
  "then: export ANDROID_NDK=\$ANDROID_HOME/ndk/28.2.13676358"
[[ -d "$NDK" ]] || die "ANDROID_NDK=$NDK is not a directory"
TOOLCHAIN_FILE="$NDK/build/cmake/android.toolchain.cmake"
[[ -f "$TOOLCHAIN_FILE" ]] || die "ANDROID_NDK=$NDK has no build/cmake/android.toolchain.cmake; is it an NDK root?"
[[ -f "$NDK/source.properties" ]] || die "ANDROID_NDK=$NDK has no source.properties; cannot tell its version"
NDK_REVISION="$(sed -n 's/^Pkg\.Revision *= *//p' "$NDK/source.properties" | tr -d '\r')"
NDK_MAJOR="${NDK_REVISION%%.*}"
[[ "$NDK_MAJOR" =~ ^[0-9]+$ ]] || die "cannot read Pkg.Revision from $NDK/source.properties (got '$NDK_REVISION')"
(( NDK_MAJOR >= MIN_NDK_MAJOR )) || die "NDK $NDK_REVISION is too old; need r${MIN_NDK_MAJOR} or newer" \
  "r27 is the first NDK with ANDROID_SUPPORT_FLEXIBLE_PAGE_SIZES (16 KB pages, Android 15+);" \
  "ExecuTorch's own CI builds with r28c."
READELF=""
for candidate in "$NDK"/toolchains/llvm/prebuilt/*/bin/llvm-readelf; do
  if [[ -x "$candidate" ]]; then READELF="$candidate"; break; fi
done
[[ -n "$READELF" ]] || die "no llvm-readelf under $NDK/toolchains/llvm/prebuilt/*/bin; incomplete NDK?"

# Prints the ELF machine of a static archive or shared object ("AArch64", ...).
elf_machine() {
  "$READELF" -h "$1" 2>/dev/null | sed -n 's/^ *Machine: *//p' | head -n1
}
require_aarch64() {  # $1 = file, $2 = what it is
  local machine
  machine="$(elf_machine "$1")"
  [[ "$machine" == "AArch64" ]] || die "$2 ($1) is built for '${machine:-unknown}', not AArch64 (arm64-v8a)" \
    "Rebuild it with the NDK toolchain and ANDROID_ABI=$ABI."
}

# --- host tools --------------------------------------------------------------
command -v cmake >/dev/null || die "cmake not found; need CMake 3.24+ (ExecuTorch's package config needs it)"
CMAKE_VERSION="$(cmake --version | sed -n 's/^cmake version \([0-9.]*\).*/\1/p')"
IFS=. read -r CMAKE_MAJOR CMAKE_MINOR _ <<<"$CMAKE_VERSION"
(( CMAKE_MAJOR > 3 || (CMAKE_MAJOR == 3 && CMAKE_MINOR >= 24) )) \
  || die "cmake $CMAKE_VERSION is too old; need 3.24+ (ExecuTorch's installed package config requires it)"
GENERATOR=()
if command -v ninja >/dev/null; then GENERATOR=(-G Ninja); fi

# --- ExecuTorch built for Android ----------------------------------------------
ET_PREFIX="${EXECUTORCH_ANDROID_PREFIX:-}"
[[ -n "$ET_PREFIX" ]] || die "EXECUTORCH_ANDROID_PREFIX is not set" \
  "Build ExecuTorch $EXPECTED_ET_VERSION for $ABI and install it to a prefix (android_app/README.md," \
  "\"ExecuTorch for Android\"), then: export EXECUTORCH_ANDROID_PREFIX=/that/prefix"
[[ -d "$ET_PREFIX" ]] || die "EXECUTORCH_ANDROID_PREFIX=$ET_PREFIX is not a directory"
ET_CONFIG_DIR=""
for candidate in "$ET_PREFIX/lib/cmake/ExecuTorch" "$ET_PREFIX/lib64/cmake/ExecuTorch" "$ET_PREFIX/share/cmake"; do
  if [[ -f "$candidate/executorch-config.cmake" ]]; then ET_CONFIG_DIR="$candidate"; break; fi
done
[[ -n "$ET_CONFIG_DIR" ]] || die "EXECUTORCH_ANDROID_PREFIX=$ET_PREFIX has no lib/cmake/ExecuTorch/executorch-config.cmake" \
  "Point it at the CMAKE_INSTALL_PREFIX of an ExecuTorch build ('cmake --build ... --target install')."
[[ -f "$ET_CONFIG_DIR/ExecuTorchTargets.cmake" ]] || die "$ET_CONFIG_DIR has executorch-config.cmake but no ExecuTorchTargets.cmake" \
  "That is the pip wheel's package (host only, shared libraries), not an Android install."
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
require_aarch64 "$SODIUM_PREFIX/lib/libsodium.a" "libsodium"

# --- nlohmann_json (header-only) -------------------------------------------------
JSON_INCLUDE="${NLOHMANN_JSON_INCLUDE_DIR:-/usr/include}"
[[ -f "$JSON_INCLUDE/nlohmann/json.hpp" ]] || die "no nlohmann/json.hpp under $JSON_INCLUDE" \
  "Install it (Debian/Ubuntu: apt-get install nlohmann-json3-dev) or set NLOHMANN_JSON_INCLUDE_DIR" \
  "to a folder holding nlohmann/json.hpp (3.x; single-include or the full tree)."
JSON_MAJOR="$(sed -n 's/^#define NLOHMANN_JSON_VERSION_MAJOR \([0-9]*\).*/\1/p' "$JSON_INCLUDE/nlohmann/json.hpp" | head -n1)"
if [[ -z "$JSON_MAJOR" && -f "$JSON_INCLUDE/nlohmann/detail/abi_macros.hpp" ]]; then
  JSON_MAJOR="$(sed -n 's/^ *#define NLOHMANN_JSON_VERSION_MAJOR \([0-9]*\).*/\1/p' "$JSON_INCLUDE/nlohmann/detail/abi_macros.hpp" | head -n1)"
fi
[[ "$JSON_MAJOR" == 3 ]] || die "nlohmann/json.hpp under $JSON_INCLUDE is version '${JSON_MAJOR:-unknown}'.x; need 3.x"

# --- platform ------------------------------------------------------------------
PLATFORM="${ZL_ANDROID_PLATFORM:-android-26}"
[[ "$PLATFORM" =~ ^android-([0-9]+)$ ]] || die "ZL_ANDROID_PLATFORM=$PLATFORM; expected android-<API level>, e.g. android-26"
(( BASH_REMATCH[1] >= 26 )) || die "ZL_ANDROID_PLATFORM=$PLATFORM is below android-26, the floor ExecuTorch's Android build uses"

note "NDK $NDK_REVISION at $NDK"
note "ExecuTorch ${ET_VERSION:-?} at $ET_PREFIX (kernels: $ET_KERNELS)"
note "libsodium at $SODIUM_PREFIX; nlohmann_json $JSON_MAJOR.x from $JSON_INCLUDE"
note "target $ABI, $PLATFORM; build folder $BUILD_DIR"
if (( CHECK_ONLY )); then
  note "prerequisites OK (--check: nothing built)"
  exit 0
fi

# --- configure and build ---------------------------------------------------------
if (( CLEAN )); then rm -rf "$BUILD_DIR"; fi
mkdir -p "$BUILD_DIR/deps/nlohmann_json/include"
# Only the nlohmann headers go on the Android include path: the host's
# /usr/include would put glibc headers in front of the NDK's.
rm -rf "$BUILD_DIR/deps/nlohmann_json/include/nlohmann"
cp -R "$JSON_INCLUDE/nlohmann" "$BUILD_DIR/deps/nlohmann_json/include/"

cmake -S "$REPO_ROOT/android_app/native/android" -B "$BUILD_DIR" "${GENERATOR[@]}" \
  -DCMAKE_TOOLCHAIN_FILE="$TOOLCHAIN_FILE" \
  -DANDROID_ABI="$ABI" \
  -DANDROID_PLATFORM="$PLATFORM" \
  -DANDROID_STL=c++_static \
  -DANDROID_SUPPORT_FLEXIBLE_PAGE_SIZES=ON \
  -DCMAKE_BUILD_TYPE="${ZL_BUILD_TYPE:-Release}" \
  -Dexecutorch_DIR="$ET_CONFIG_DIR" \
  -DCMAKE_FIND_ROOT_PATH="$ET_PREFIX" \
  -DZL_SODIUM_PREFIX="$SODIUM_PREFIX" \
  -DZL_NLOHMANN_JSON_INCLUDE_DIR="$BUILD_DIR/deps/nlohmann_json/include"

# Both targets are defined only once their sources exist (the stage loop in
# android_app/native/app and include/zl/runner.h); say so instead of make's
# "No rule to make target".
for target in zl_runner zl_jni; do
  grep -qx "$target" "$BUILD_DIR/zl_targets.txt" \
    || die "the configured project has no '$target' target" \
      "zl_runner needs android_app/native/app/zl_runner_main.cpp; zl_jni needs android_app/native/include/zl/runner.h."
done
cmake --build "$BUILD_DIR" --target zl_runner zl_jni -j "${ZL_JOBS:-2}"

require_aarch64 "$BUILD_DIR/zl_runner" "zl_runner"
require_aarch64 "$BUILD_DIR/libzl_jni.so" "libzl_jni.so"
mkdir -p "$BUILD_DIR/jniLibs/$ABI"
cp "$BUILD_DIR/libzl_jni.so" "$BUILD_DIR/jniLibs/$ABI/libzl_jni.so"
note "built:"
ls -l "$BUILD_DIR/zl_runner" "$BUILD_DIR/libzl_jni.so" "$BUILD_DIR/jniLibs/$ABI/libzl_jni.so" >&2
note "next: adb push (android_app/README.md) or build the app (cd android_app/app && ./gradlew assembleDebug)"
