#!/usr/bin/env bash
# The phone binary (issue 41): zl_runner, zl_step_check and the C++ test
# suites as statically linked aarch64 Linux executables. They need nothing
# from a phone but its kernel: `zl train --devices SERIAL --mode binary`
# pushes build-phone/zl/runner/zl_runner to /data/local/tmp, and
# the very same file runs here under `qemu-aarch64` with no sysroot.
#
#   ZL_EXECUTORCH_SRC=~/src/executorch tools/build_phone_runner.sh          # build
#   ZL_EXECUTORCH_SRC=~/src/executorch tools/build_phone_runner.sh --test   # build, then the proofs below
#
# ZL_EXECUTORCH_SRC: an ExecuTorch checkout (v1.5.1 tag, with its
# third-party/flatbuffers submodule; for the thread pool also
# backends/xnnpack/third-party/{pthreadpool,cpuinfo,FXdiv}, with a cpuinfo
# from before its commit 7607ca5 or one that fixes it: from there on it
# dereferences a null L2 table on a CPU it does not know, e.g. under qemu on
# an x86 host). This script downloads nothing and never writes into that
# checkout.
#
# What it builds, into build-phone/ (ignored; delete it to start over):
#   et-src/executorch/  a symlink mirror of the checkout whose kernels/portable/cpu
#                holds only the kernels of the operators in tools/phone_ops.txt
#                (ZL_PHONE_OPS=<file> for another list; make one with
#                `python tools/phone_kernels.py ops <export>/stage_*.pte`)
#   et/, et-install/  ExecuTorch's runtime, Module extension and the selected
#                portable kernels (EXECUTORCH_SELECT_OPS_LIST), static, aarch64
#   zl/          zl's runner, tools, kernels and suites against it, with
#                Debian's aarch64 GCC, its static glibc, the multiarch arm64
#                libsodium.a and libgtest.a, and Eigen's GEMM (header only)
# --test then checks: `file` says statically linked; `env -i qemu-aarch64
# zl_runner --version` runs and names the kernel path each `-cpu` gets
# (cortex-a53, cortex-a76: baseline; max: bf16); ctest runs every suite under
# qemu-aarch64 (no -L) on -cpu max and on -cpu cortex-a53; one 3-stage step
# equals x86's, and is bit-identical on both CPUs and (with the thread pool)
# on 4 threads; ZL_THREADS_PROGRAM=<stage .pte> also times it on 1 and 2.
#
# Debian packages: gcc-aarch64-linux-gnu g++-aarch64-linux-gnu
# libc6-dev-arm64-cross qemu-user libsodium-dev:arm64 libgtest-dev:arm64
# nlohmann-json3-dev libeigen3-dev (installed when missing and run as root;
# ZL_SKIP_APT=1 only checks). The host Python (.venv, setup.sh) runs
# ExecuTorch's kernel-registration codegen. Optional: ZL_JOBS (default 2).
#
# Static glibc and the network: the runner's sockets use numeric addresses
# only (no getaddrinfo on names, no NSS), which a static glibc serves without
# reading /etc.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=$ROOT/build-phone
JOBS=${ZL_JOBS:-2}
VENV_PY=$ROOT/.venv/bin/python
OPS=${ZL_PHONE_OPS:-$ROOT/tools/phone_ops.txt}
TEST=0
for arg in "$@"; do
  case "$arg" in
    --test) TEST=1 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "build_phone_runner.sh: unknown argument '$arg' (expected --test or --help)" >&2; exit 2 ;;
  esac
done
say() { printf '\033[1m[phone]\033[0m %s\n' "$*"; }
die() { printf '\033[1m[phone]\033[0m FAILED: %s\n' "$*" >&2; exit 1; }
# shellcheck source=tools/arm64_common.sh
. "$ROOT/tools/arm64_common.sh"
executorch_src runtime/executor/program.cpp "an ExecuTorch v1.5.1 checkout (git clone -b v1.5.1 https://github.com/pytorch/executorch && git -C executorch submodule update --init third-party/flatbuffers)"
[ -f "$ET_SRC/third-party/flatbuffers/CMakeLists.txt" ] ||
  die "ZL_EXECUTORCH_SRC=$ET_SRC has no third-party/flatbuffers; run: git -C $ET_SRC submodule update --init third-party/flatbuffers"
[ -f "$OPS" ] || die "ZL_PHONE_OPS=$OPS does not exist"
mkdir -p "$OUT"
T0=$(date +%s)

# 1. Debian packages: the cross compiler with its static glibc, qemu, and the
#    arm64 static archives of libsodium and GoogleTest (multiarch).
APT_PKGS=(gcc-aarch64-linux-gnu g++-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user
          libsodium-dev:arm64 libgtest-dev:arm64 nlohmann-json3-dev libeigen3-dev file)
debian_packages "${APT_PKGS[@]}"

# 2. The ExecuTorch mirror with only the portable kernels the programs call.
say "selecting the portable kernels of $(grep -cv '^#' "$OPS") operators ($OPS)"
# (ExecuTorch's CMake insists on a source folder named executorch.)
ET_MIRROR=$OUT/et-src/executorch
rm -rf "$OUT/et-src"
SELECTED=$("$VENV_PY" "$ROOT/tools/phone_kernels.py" tree "$ET_SRC" "$ET_MIRROR" "$OPS") ||
  die "tools/phone_kernels.py tree"

# 3. ExecuTorch for aarch64, static: the core runtime, the Module extension
#    and what it requires, and the selected portable kernels; no backends,
#    no dlopen. MAX_KERNEL_NUM: the registry's size, which a selective build
#    otherwise cuts to the selected kernels alone, leaving no room for zl's
#    own (the marker, widen, the fast kernels). FLATCC_EXECUTABLE: flatcc only serves devtools' etdump
#    (off), so ExecuTorch need not build it for the host.
ET_INSTALL=$OUT/et-install
# ExecuTorch's thread pool (zl's GEMM splits its panels over it,
# docs/design#kernels) needs the pthreadpool and cpuinfo submodules; without them the
# kernels run on one thread (zl/thread_pool.h's weak references stay null).
THREADPOOL=OFF
if [ -f "$ET_SRC/backends/xnnpack/third-party/pthreadpool/CMakeLists.txt" ] &&
   [ -f "$ET_SRC/backends/xnnpack/third-party/cpuinfo/CMakeLists.txt" ]; then
  THREADPOOL=ON
else
  say "no pthreadpool/cpuinfo submodules in $ET_SRC: zl's kernels will run on one thread"
fi
say "building ExecuTorch for aarch64 in $OUT/et (log: $OUT/et.log)"
{ nice -n 10 cmake -S "$ET_MIRROR" -B "$OUT/et" --toolchain "$ROOT/tools/aarch64-linux-static.cmake" \
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$ET_INSTALL" -DPYTHON_EXECUTABLE="$VENV_PY" \
    -DBUILD_SHARED_LIBS=OFF -DEXECUTORCH_BUILD_SHARED=OFF -DEXECUTORCH_USE_DL=OFF \
    -DEXECUTORCH_BUILD_EXTENSION_MODULE=ON -DEXECUTORCH_BUILD_EXTENSION_DATA_LOADER=ON \
    -DEXECUTORCH_BUILD_EXTENSION_FLAT_TENSOR=ON -DEXECUTORCH_BUILD_EXTENSION_NAMED_DATA_MAP=ON \
    -DEXECUTORCH_BUILD_EXTENSION_TENSOR=ON -DEXECUTORCH_BUILD_KERNELS_OPTIMIZED=OFF \
    -DEXECUTORCH_BUILD_XNNPACK=OFF -DEXECUTORCH_BUILD_PTHREADPOOL=$THREADPOOL -DEXECUTORCH_BUILD_CPUINFO=$THREADPOOL \
    -DEXECUTORCH_BUILD_DEVTOOLS=OFF -DEXECUTORCH_BUILD_EXECUTOR_RUNNER=OFF -DEXECUTORCH_BUILD_TESTS=OFF \
    -DEXECUTORCH_ENABLE_LOGGING=ON -DEXECUTORCH_SELECT_OPS_LIST="$SELECTED" -DFLATCC_EXECUTABLE=/bin/false \
    -DMAX_KERNEL_NUM=256 &&
  nice -n 10 cmake --build "$OUT/et" -j"$JOBS" --target install; } >"$OUT/et.log" 2>&1 ||
  { tail -30 "$OUT/et.log"; die "ExecuTorch build (log: $OUT/et.log)"; }

# 4. zl for aarch64, static, against that ExecuTorch: the runner, its tools,
#    zl's kernels (a static library: one operator registry per binary) and
#    the suites. Eigen's GEMM (headers only); no JNI library (the app keeps
#    its NDK build).
# pkg-config would name libsodium.so, which a static link cannot take: a
# prefix holding the multiarch arm64 headers and static archive instead.
SODIUM=$OUT/sodium
mkdir -p "$SODIUM/include" "$SODIUM/lib"
ln -sfn /usr/include/sodium.h "$SODIUM/include/sodium.h"
ln -sfn /usr/include/sodium "$SODIUM/include/sodium"
ln -sfn /usr/lib/aarch64-linux-gnu/libsodium.a "$SODIUM/lib/libsodium.a"
say "building zl for aarch64 in $OUT/zl (log: $OUT/zl.log)"
{ nice -n 10 cmake -S "$ROOT" -B "$OUT/zl" --toolchain "$ROOT/tools/aarch64-linux-static.cmake" \
    -DCMAKE_BUILD_TYPE=Release -Dexecutorch_DIR="$ET_INSTALL/lib/cmake/ExecuTorch" \
    -DZL_SODIUM_PREFIX="$SODIUM" -DZL_GEMM=eigen -DCMAKE_DISABLE_FIND_PACKAGE_Java=ON &&
  nice -n 10 cmake --build "$OUT/zl" -j"$JOBS"; } >"$OUT/zl.log" 2>&1 ||
  { tail -30 "$OUT/zl.log"; die "zl build (log: $OUT/zl.log)"; }
RUNNER=$OUT/zl/runner/zl_runner
STEP=$OUT/zl/runner/zl_step_check
for bin in "$RUNNER" "$STEP"; do
  file -b "$bin" | grep -q 'ARM aarch64.*statically linked' ||
    die "$bin is not a statically linked aarch64 executable: $(file -b "$bin")"
done
say "built in $(( $(date +%s) - T0 )) s: $RUNNER ($(stat -c %s "$RUNNER") bytes, $(file -b "$RUNNER" | grep -oE 'ARM aarch64|statically linked' | paste -sd' '))"
[ "$TEST" = 1 ] || exit 0

# 5. The proofs. With an empty environment and no -L, qemu-aarch64 has no
#    host userland to hand the binary; its -strace shows every file the
#    binary opens, none of which may be under /etc or /usr (a phone has
#    neither to offer).
say "zl_runner under qemu-aarch64, empty environment, no sysroot"
version=$(env -i "$(command -v qemu-aarch64)" "$RUNNER" --version) || die "qemu-aarch64 $RUNNER --version"
echo "  $version"
case "$version" in *"aarch64 static"*) ;; *) die "--version does not say 'aarch64 static': $version" ;; esac

# The kernel path each class of phone CPU gets (docs/design#runner-process): qemu's
# -cpu sets the hwcaps the binary reads. cortex-a53: armv8.0; cortex-a76:
# armv8.2 with dotprod and fp16, no bf16; max: everything (bf16, i8mm).
say "the kernel path per CPU (qemu-aarch64 -cpu)"
for want in "cortex-a53 kernels=baseline cpu=none" "cortex-a76 kernels=baseline cpu=fp16,dotprod" \
            "max kernels=bf16 cpu=fp16,dotprod,bf16,i8mm"; do
  cpu=${want%% *}
  got=$(env -i "$(command -v qemu-aarch64)" -cpu "$cpu" "$RUNNER" --version) || die "qemu-aarch64 -cpu $cpu $RUNNER --version"
  case "$got" in *" static ${want#* } threads="*) ;; *) die "-cpu $cpu: --version says '$got', expected '... static ${want#* } threads=N'" ;; esac
  echo "  -cpu $cpu: ${got#* static }"
done

# The x86 reference (zl_step_check and the kernel library the export loads)
# against the venv's wheel, and a tiny-random 3-stage export, as
# tools/check_arm64.sh makes them (tools/arm64_common.sh x86_reference).
x86_reference

# Without a thread pool the one test of the thread split has nothing to test
# (it skips itself); leaving it out keeps "none skipped" meaningful.
EXCLUDE=()
[ "$THREADPOOL" = ON ] || EXCLUDE=(-E 'ThreadSplitIsBitIdenticalToOneThread')
# Twice: on the bf16 path (-cpu max, where Bf16Test also compares BFCVTN
# with the baseline bit for bit) and on the baseline of an armv8.0 phone
# (-cpu cortex-a53: any instruction past armv8.0 would be SIGILL there).
# QEMU_CPU is qemu's -cpu; ZL_EXPECT_KERNEL_PATH tells Bf16Test which path it must see.
for run in "max bf16" "cortex-a53 baseline"; do
  cpu=${run% *} path=${run#* }
  log=$OUT/ctest-$cpu.log
  say "every C++ suite under qemu-aarch64 -cpu $cpu, $path path (log: $log)"
  QEMU_CPU=$cpu ZL_EXPECT_KERNEL_PATH=$path ZL_TEST_EXPORT_DIR=$EXPORT ZL_MARKER_TEST_PTE=$EXPORT/stage_1.pte \
    nice -n 10 ctest --test-dir "$OUT/zl" "${EXCLUDE[@]}" --output-on-failure -j"$JOBS" --timeout 600 >"$log" 2>&1 ||
    { grep -E 'Failed|\*\*\*' "$log" | tail -30; die "ctest under qemu -cpu $cpu (log: $log)"; }
  grep -q 'tests did not run' "$log" &&
    { sed -n '/tests did not run/,$p' "$log"; die "tests skipped under qemu -cpu $cpu (log: $log)"; }
  echo "  $(grep -E 'tests passed' "$log"), none skipped"
done

say "one step through the 3 stages: x86, and the static aarch64 binary under qemu (logs: $OUT/step_*.log)"
nice -n 10 "$OUT/x86/runner/zl_step_check" --export-dir "$EXPORT" \
  --out "$OUT/step_x86.safetensors" >"$OUT/step_x86.log" 2>&1 || { cat "$OUT/step_x86.log"; die "x86 step"; }
nice -n 10 env -i "$(command -v qemu-aarch64)" -strace "$STEP" --export-dir "$EXPORT" \
  --out "$OUT/step_arm64.safetensors" >"$OUT/step_arm64.log" 2>"$OUT/step_arm64.strace" ||
  { cat "$OUT/step_arm64.log"; tail "$OUT/step_arm64.strace"; die "aarch64 step"; }
# Every path the binary opened (openat/open/stat family) outside the export and the output.
host_files=$(grep -oE '(openat|open|newfstatat|faccessat|readlinkat|statx)\([^"]*"[^"]*"' "$OUT/step_arm64.strace" |
  grep -oE '"/(etc|usr|lib|system)[^"]*"' | sort -u || true)
[ -z "$host_files" ] || die "the static binary looked for host files: $host_files"
echo "  files opened: $(grep -oE '(openat|open)\([^"]*"[^"]*"' "$OUT/step_arm64.strace" | grep -oE '"[^"]*"' | sort -u | tr '\n' ' ')"
compare=$("$VENV_PY" "$ROOT/tools/compare_step.py" "$OUT/step_x86.safetensors" "$OUT/step_arm64.safetensors" \
  "${ZL_LOSS_RTOL:-1e-5}" "${ZL_GRAD_ATOL:-1e-6}") || { echo "$compare"; die "x86 and static aarch64 numbers differ beyond the limits"; }
echo "$compare" | sed 's/^/  /'
# The same step on an armv8.0 CPU: it runs (nothing past armv8.0 outside the
# dispatched kernels) and gives the very bytes of the default (-cpu max) run.
say "the same step on the baseline path (qemu-aarch64 -cpu cortex-a53; log: $OUT/step_arm64_a53.log)"
nice -n 10 env -i "$(command -v qemu-aarch64)" -cpu cortex-a53 "$STEP" --export-dir "$EXPORT" \
  --out "$OUT/step_arm64_a53.safetensors" >"$OUT/step_arm64_a53.log" 2>&1 ||
  { cat "$OUT/step_arm64_a53.log"; die "aarch64 step on -cpu cortex-a53"; }
cmp -s "$OUT/step_arm64.safetensors" "$OUT/step_arm64_a53.safetensors" ||
  die "the step's outputs differ between -cpu max and -cpu cortex-a53 ($OUT/step_arm64*.safetensors)"
echo "  bit-identical to -cpu max"

# The thread pool (docs/design#one-device-and-threads): the same step split over 4 threads
# gives the numbers of 1 (qemu runs guest threads on host threads).
if [ "$THREADPOOL" = ON ]; then
  say "the same step on 4 threads (log: $OUT/step_arm64_t4.log)"
  nice -n 10 env -i "$(command -v qemu-aarch64)" "$STEP" --export-dir "$EXPORT" --threads 4 \
    --out "$OUT/step_arm64_t4.safetensors" >"$OUT/step_arm64_t4.log" 2>&1 ||
    { cat "$OUT/step_arm64_t4.log"; die "aarch64 step on 4 threads"; }
  compare=$("$VENV_PY" "$ROOT/tools/compare_step.py" "$OUT/step_arm64.safetensors" "$OUT/step_arm64_t4.safetensors" \
    "${ZL_LOSS_RTOL:-1e-5}" "${ZL_GRAD_ATOL:-1e-6}") || { echo "$compare"; die "4 threads differ from 1 beyond the limits"; }
  echo "$compare" | sed 's/^/  /'
  # ZL_THREADS_PROGRAM=<a real stage .pte>: its step time on 1 and 2 threads
  # (tiny-random's kernels take microseconds: too small to split).
  if [ -n "${ZL_THREADS_PROGRAM:-}" ]; then
    BENCH=$OUT/zl/runner/zl_stage_bench
    for t in 1 2; do
      say "zl_stage_bench on $t thread(s): $ZL_THREADS_PROGRAM (log: $OUT/bench_t$t.log)"
      env -i "$(command -v qemu-aarch64)" "$BENCH" --program "$ZL_THREADS_PROGRAM" --steps 4 --threads $t \
        >"$OUT/bench_t$t.log" 2>&1 || { tail "$OUT/bench_t$t.log"; die "zl_stage_bench --threads $t"; }
    done
    "$VENV_PY" - "$OUT/bench_t1.log" "$OUT/bench_t2.log" <<'PY'
import json, statistics, sys
steps = [[json.loads(l) for l in open(p) if l.startswith('{"event": "step"')] for p in sys.argv[1:]]
ms = [statistics.median(s["ms"] for s in run[1:]) for run in steps]  # step 0 faults the program's pages in
print(f"  step: 1 thread {ms[0]:.0f} ms, 2 threads {ms[1]:.0f} ms ({ms[1] / ms[0]:.2f}x)")
PY
  fi
fi
say "OK"
