#!/usr/bin/env bash
# ExecuTorch's own LLM runner, llama_main (issue 55): the runner of ExecuTorch's
# demo apps, which runs the tuned model `zl export-model` writes (XNNPACK, the
# LLM kernels llama::update_cache / custom_sdpa, the quantized kernels, the
# tokenizer library for tokenizer.json). Built twice from one checkout:
#   build-llm/x86_64/llama_main   for this host
#   build-llm/aarch64/llama_main  static aarch64: needs nothing of a phone but
#                                 its kernel; `zl deploy --program` pushes it
#
#   ZL_EXECUTORCH_SRC=~/src/executorch tools/build_llm_runner.sh                 # both
#   ZL_EXECUTORCH_SRC=~/src/executorch tools/build_llm_runner.sh --arch aarch64  # the phone's only
#   ZL_EXECUTORCH_SRC=~/src/executorch tools/build_llm_runner.sh --test          # build, then the checks below
#
# ZL_EXECUTORCH_SRC: an ExecuTorch checkout (the one zl's pip wheel came from,
# or a later one: programs keep their format) with the submodules the runner
# needs, recursively:
#   git -C executorch submodule update --init --recursive third-party/flatbuffers third-party/flatcc \
#     third-party/gflags third-party/json third-party/pocketfft third-party/ao \
#     kernels/optimized/third-party/eigen backends/xnnpack/third-party extension/llm/tokenizers
# ZL_KLEIDIAI_SRC (aarch64, optional): a KleidiAI checkout at the commit
# XNNPACK's cmake/DownloadKleidiAI.cmake names; XNNPACK then uses Arm's
# KleidiAI GEMMs. Without it they are off (XNNPACK would download KleidiAI at
# configure time; this script downloads nothing). Debian 12's aarch64 GCC 12
# stops on KleidiAI with an internal compiler error, so it is refused there.
# ZL_CMAKE: the cmake to use (default: cmake on PATH). ExecuTorch needs 3.24,
# and 3.26 for aarch64 (its optimized kernels' BUILD_LOCAL_INTERFACE); with an
# older one: pip install --target ~/cmake 'cmake>=3.26,<4' and
# ZL_CMAKE=~/cmake/cmake/data/bin/cmake.
# ZL_JOBS: parallel compile jobs (default: the number of cores). The first
# build compiles ~2,100 files per architecture (XNNPACK's micro-kernels, the
# portable and optimized kernels twice, abseil): about 40 minutes per
# architecture on two cores; ccache is used when installed.
#
# How: ExecuTorch's documented flow for llama_main, once per architecture into
# build-llm/<arch>/et (ignored; delete it to start over): `cmake` with
# ExecuTorch's `llm` preset (XNNPACK, optimized, quantized and LLM kernels,
# the LLM runner and its tokenizers), logging on, then
# examples/models/llama against that install. aarch64: Debian's aarch64 GCC
# and static glibc (tools/aarch64-linux-static.cmake, as the phone zl_runner);
# XNNPACK's SME/SME2 kernels are off with a GCC older than 14 (it cannot
# assemble them). ExecuTorch's CMake writes flatcc's runtime library into the
# checkout's third-party/flatcc/lib; nothing else is written there.
#
# --test then, for each architecture built (`file` has said the aarch64 one is
# statically linked): on tiny-random programs of `zl export-model` (float and
# int8) tools/check_llm_runner.py compares llama_main's greedy continuations
# with the Python runtime's (`zl generate --program`'s), the aarch64 binary
# under `env -i qemu-aarch64` with no sysroot, whose -strace must show no file
# opened under /etc, /usr or /lib.
#
# Debian packages: gcc-aarch64-linux-gnu g++-aarch64-linux-gnu
# libc6-dev-arm64-cross qemu-user file (installed when missing and run as
# root; ZL_SKIP_APT=1 only checks), and ninja-build and ccache when present.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=$ROOT/build-llm
JOBS=${ZL_JOBS:-$(nproc)}
VENV_PY=$ROOT/.venv/bin/python
ARCHES="x86_64 aarch64"
TEST=0
while [ $# -gt 0 ]; do
  case "$1" in
    --test) TEST=1 ;;
    --arch) shift; case "${1:-}" in x86_64|host) ARCHES=x86_64 ;; aarch64) ARCHES=aarch64 ;;
              *) echo "build_llm_runner.sh: --arch '${1:-}': expected x86_64 (this host) or aarch64 (phones)" >&2; exit 2 ;; esac ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "build_llm_runner.sh: unknown argument '$1' (expected --arch x86_64|aarch64, --test or --help)" >&2; exit 2 ;;
  esac
  shift
done
say() { printf '\033[1m[llama_main]\033[0m %s\n' "$*"; }
die() { printf '\033[1m[llama_main]\033[0m FAILED: %s\n' "$*" >&2; exit 1; }
# shellcheck source=tools/arm64_common.sh
. "$ROOT/tools/arm64_common.sh"
executorch_src examples/models/llama/main.cpp "an ExecuTorch checkout with its submodules (see --help)"
missing=()  # submodule:a file it holds
for spec in third-party/{flatbuffers,flatcc,gflags,json}:CMakeLists.txt third-party/pocketfft:pocketfft_hdronly.h \
            third-party/ao:torchao/csrc/cpu/shared_kernels/internal/packed_weights_header.h \
            kernels/optimized/third-party/eigen:blas/single.cpp \
            backends/xnnpack/third-party/{XNNPACK,pthreadpool,cpuinfo,FXdiv,FP16}:CMakeLists.txt \
            extension/llm/tokenizers:CMakeLists.txt \
            extension/llm/tokenizers/third-party/{abseil-cpp,re2,sentencepiece,pcre2,json}:CMakeLists.txt; do
  [ -e "$ET_SRC/${spec%%:*}/${spec#*:}" ] || missing+=("${spec%%:*}")
done
[ ${#missing[@]} -eq 0 ] || die "ZL_EXECUTORCH_SRC=$ET_SRC lacks the submodules ${missing[*]}; check them out with the
  git command in --help (tools/build_llm_runner.sh --help)"
CMAKE=${ZL_CMAKE:-cmake}
cmake_version=$("$CMAKE" --version 2>/dev/null | awk 'NR == 1 { print $3 }') ||
  die "ZL_CMAKE=$CMAKE does not run; install CMake 3.26 or later (see --help)"
for arch in $ARCHES; do
  need=3.24; [ "$arch" = aarch64 ] && need=3.26
  [ "$(printf '%s\n%s\n' "$need" "$cmake_version" | sort -V | head -1)" = "$need" ] ||
    die "$arch needs CMake $need or later, $CMAKE is $cmake_version; set ZL_CMAKE to a newer one (see --help)"
done
mkdir -p "$OUT"
GENERATOR=()
command -v ninja >/dev/null && GENERATOR=(-G Ninja)
LAUNCHER=()
command -v ccache >/dev/null && LAUNCHER=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)

case " $ARCHES " in *" aarch64 "*)
  debian_packages gcc-aarch64-linux-gnu g++-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user file ;;
esac

build_arch() {  # build_arch ARCH: ExecuTorch, then llama_main, into $OUT/ARCH
  local arch=$1 dir=$OUT/$1 t0 cross=() et
  et=$dir/et
  t0=$(date +%s)
  mkdir -p "$dir"
  if [ "$arch" = aarch64 ]; then
    cross=(--toolchain "$ROOT/tools/aarch64-linux-static.cmake")
    if [ "$(aarch64-linux-gnu-gcc -dumpversion | cut -d. -f1)" -lt 14 ]; then
      cross+=(-DXNNPACK_ENABLE_ARM_SME=OFF -DXNNPACK_ENABLE_ARM_SME2=OFF)
    fi
    if [ -n "${ZL_KLEIDIAI_SRC:-}" ]; then
      [ "$(aarch64-linux-gnu-gcc -dumpversion | cut -d. -f1)" -ge 13 ] ||
        die "ZL_KLEIDIAI_SRC: aarch64-linux-gnu-gcc $(aarch64-linux-gnu-gcc -dumpversion) fails on KleidiAI (an internal compiler error in kai_lhs_quant_pack_qai8dxp_bf16_neon.c with Debian 12's GCC 12); unset ZL_KLEIDIAI_SRC, or use GCC 13 or later"
      cross+=(-DEXECUTORCH_XNNPACK_ENABLE_KLEIDI=ON -DXNNPACK_ENABLE_KLEIDIAI=ON
              -DKLEIDIAI_SOURCE_DIR="$(cd "$ZL_KLEIDIAI_SRC" && pwd)")
    else
      cross+=(-DEXECUTORCH_XNNPACK_ENABLE_KLEIDI=OFF -DXNNPACK_ENABLE_KLEIDIAI=OFF)
    fi
  fi
  say "$arch: ExecuTorch (llm preset) in $et (log: $dir/et.log)"
  { nice -n 10 "$CMAKE" -S "$ET_SRC" -B "$et" "${GENERATOR[@]}" "${LAUNCHER[@]}" "${cross[@]}" \
      -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$et" -DPYTHON_EXECUTABLE="$VENV_PY" \
      -DEXECUTORCH_BUILD_PRESET_FILE="$ET_SRC/tools/cmake/preset/llm.cmake" \
      -DEXECUTORCH_BUILD_EXTENSION_ASR_RUNNER=OFF -DEXECUTORCH_BUILD_EXECUTOR_RUNNER=OFF \
      -DEXECUTORCH_BUILD_TESTS=OFF -DEXECUTORCH_BUILD_DEVTOOLS=OFF -DEXECUTORCH_ENABLE_LOGGING=ON &&
    nice -n 10 "$CMAKE" --build "$et" -j"$JOBS" --target install; } >"$dir/et.log" 2>&1 ||
    { tail -30 "$dir/et.log"; die "$arch: ExecuTorch build (log: $dir/et.log)"; }
  # examples/models/llama finds gflags at <build>/third-party/gflags, three levels above its own build folder.
  # Its runner library is SHARED on Linux (STATIC only on Android and Apple), which a static executable cannot
  # link: for aarch64, CMake is told the platform has no shared libraries, so it builds that library static.
  local llama=("${cross[@]}")
  if [ "$arch" = aarch64 ]; then
    echo 'set_property(GLOBAL PROPERTY TARGET_SUPPORTS_SHARED_LIBS FALSE)' >"$dir/static-only.cmake"
    llama+=(-DCMAKE_PROJECT_INCLUDE="$dir/static-only.cmake")
  fi
  say "$arch: llama_main in $et/examples/models/llama (log: $dir/llama.log)"
  { nice -n 10 "$CMAKE" -S "$ET_SRC/examples/models/llama" -B "$et/examples/models/llama" "${GENERATOR[@]}" \
      "${LAUNCHER[@]}" "${llama[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$et" \
      -DPYTHON_EXECUTABLE="$VENV_PY" -Dexecutorch_DIR="$et/lib/cmake/ExecuTorch" -DBUILD_TESTING=OFF \
      -DEXECUTORCH_ENABLE_LOGGING=ON &&
    nice -n 10 "$CMAKE" --build "$et/examples/models/llama" -j"$JOBS" --target llama_main; } >"$dir/llama.log" 2>&1 ||
    { tail -30 "$dir/llama.log"; die "$arch: llama_main build (log: $dir/llama.log)"; }
  cp "$et/examples/models/llama/llama_main" "$dir/llama_main"
  if [ "$arch" = aarch64 ]; then
    file -b "$dir/llama_main" | grep -q 'ARM aarch64.*statically linked' ||
      die "$dir/llama_main is not a statically linked aarch64 executable: $(file -b "$dir/llama_main")"
  fi
  say "$arch: built in $(( $(date +%s) - t0 )) s: $dir/llama_main ($(( $(stat -c %s "$dir/llama_main") >> 20 )) MiB)"
}

for arch in $ARCHES; do build_arch "$arch"; done
[ "$TEST" = 1 ] || exit 0

# The checks: a tiny-random run's programs (float and int8), each architecture's llama_main against the Python
# runtime on the same prompts; the aarch64 binary under qemu with an empty environment and no -L.
CHECK=$OUT/check
for arch in $ARCHES; do
  emulator=()
  [ "$arch" = aarch64 ] && emulator=(--emulator "env -i qemu-aarch64")
  say "$arch: llama_main against the Python runtime (tools/check_llm_runner.py; programs in $CHECK)"
  nice -n 10 "$VENV_PY" "$ROOT/tools/check_llm_runner.py" --work "$CHECK" --runner "$OUT/$arch/llama_main" \
    "${emulator[@]}" || die "$arch: llama_main's continuations differ from the Python runtime's"
  if [ "$arch" = aarch64 ]; then
    # With an empty environment and no -L, qemu hands the binary nothing of this host; -strace lists every file it
    # opens, none of which may be under /etc, /usr or /lib (a phone has none of them to offer).
    opened=$(cd "$CHECK" && env -i qemu-aarch64 -strace "$OUT/aarch64/llama_main" --model_path=model-none.pte \
      --tokenizer_path=tokenizer.json --prompt=Hi --temperature=0 --max_new_tokens=2 2>&1 |
      grep -oE 'open(at)?\([^"]*"[^"]*"' | grep -oE '"[^"]*"' | tr -d '"' | sort -u)
    ! grep -qE '^/(etc|usr|lib)' <<<"$opened" ||
      die "aarch64 llama_main opened host files under qemu: $(grep -E '^/(etc|usr|lib)' <<<"$opened" | paste -sd' ')"
    say "aarch64: under env -i qemu-aarch64 it opens only $(paste -sd' ' <<<"$opened")"
  fi
done
say "all checks passed"
