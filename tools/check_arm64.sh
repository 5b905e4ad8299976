#!/usr/bin/env bash
# Checks the native code on aarch64 Linux instead of assuming it (issue 10):
# cross-compiles the runner, its tools, the pipeline_marker kernel and both
# GoogleTest suites with Debian's aarch64 GCC against the aarch64
# executorch==1.5.1 wheel, runs the suites under qemu-aarch64 (including the
# StageProgram tests on a real 3-stage export), then runs one training step
# through every stage with zl_step_check built for x86 and for aarch64 and
# compares losses, hidden states and LoRA gradients.
#
#   tools/check_arm64.sh          # everything: ~10 min the first time on 2 busy cores, ~1 min again
#   ZL_SKIP_APT=1 tools/check_arm64.sh   # do not apt-get; fail if packages are missing
#
# Not Android (glibc, not bionic; GCC, not the NDK's clang) and emulated
# speed means nothing: see docs/design#arm64-check, "arm64 check".
#
# Everything goes to build-arm64/ (ignored): wheels/, et/ (the unpacked
# aarch64 wheel), cmake/ (the aarch64 build), x86/ (the x86 zl_step_check),
# export/ (the programs), step_{x86,arm64}.safetensors. Each step is skipped
# when its result is there; delete build-arm64/ to start over. Needs root or
# sudo for the apt packages (an arm64 foreign architecture is added); the
# export runs with .venv (setup.sh). Optional: ZL_JOBS (default 2),
# ZL_LOSS_RTOL (default 1e-5), ZL_GRAD_ATOL (default 1e-6). Exit status 0 only
# when every step passed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=$ROOT/build-arm64
JOBS=${ZL_JOBS:-2}
ET_VERSION=1.5.1
VENV_PY=$ROOT/.venv/bin/python
# As CMAKE_CROSSCOMPILING_EMULATOR in tools/aarch64-linux.cmake (why the order matters: there).
QEMU=(qemu-aarch64 -L /usr/aarch64-linux-gnu -E LD_LIBRARY_PATH=/usr/aarch64-linux-gnu/lib:/usr/lib/aarch64-linux-gnu)

say() { printf '\033[1m[arm64]\033[0m %s\n' "$*"; }
die() { printf '\033[1m[arm64]\033[0m FAILED: %s\n' "$*" >&2; exit 1; }
# shellcheck source=tools/arm64_common.sh
. "$ROOT/tools/arm64_common.sh"
mkdir -p "$OUT"
[ -x "$VENV_PY" ] || die "no $VENV_PY; run setup.sh first (the export and the comparison use it)"

# 1. Debian packages: the cross compiler, qemu, and the arm64 builds of what
#    the runner links (libsodium, GoogleTest, OpenBLAS) through multiarch.
APT_PKGS=(gcc-aarch64-linux-gnu g++-aarch64-linux-gnu qemu-user libsodium-dev:arm64 libgtest-dev:arm64 libopenblas-dev:arm64 nlohmann-json3-dev)
debian_packages "${APT_PKGS[@]}"

# 2. The aarch64 ExecuTorch wheel: headers, lib/*.so and the CMake package.
#    Downloaded, never installed (the venv keeps its x86 wheel).
WHEEL=$OUT/wheels/executorch-$ET_VERSION-cp311-cp311-manylinux_2_28_aarch64.whl
if [ ! -f "$WHEEL" ]; then
  say "downloading the aarch64 executorch==$ET_VERSION wheel"
  "$VENV_PY" -m pip download -q "executorch==$ET_VERSION" --no-deps --only-binary=:all: \
    --platform manylinux_2_28_aarch64 --python-version 3.11 -d "$OUT/wheels"
fi
ET_PKG=$OUT/et/executorch
if [ ! -f "$ET_PKG/share/cmake/executorch-config.cmake" ]; then
  say "unpacking $(basename "$WHEEL")"
  rm -rf "$OUT/et" && mkdir -p "$OUT/et"
  "$VENV_PY" -m zipfile -e "$WHEEL" "$OUT/et"
fi

# 3. The aarch64 build: everything the host build has (runner, tools,
#    kernel, both test suites; the JNI library without its JVM check).
say "building for aarch64 in $OUT/cmake (log: $OUT/cmake.log)"
{ nice -n 10 cmake -S "$ROOT" -B "$OUT/cmake" --toolchain "$ROOT/tools/aarch64-linux.cmake" \
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$ET_PKG/share/cmake" -DZL_GEMM=openblas &&
  nice -n 10 cmake --build "$OUT/cmake" -j"$JOBS"; } >"$OUT/cmake.log" 2>&1 ||
  { tail -30 "$OUT/cmake.log"; die "aarch64 build (log: $OUT/cmake.log)"; }
for bin in runner/zl_runner runner/zl_step_check runner/zl_runner_tests \
           custom_ops/libzl_custom_ops.so custom_ops/zl_custom_ops_tests; do
  machine=$(aarch64-linux-gnu-readelf -h "$OUT/cmake/$bin" | awk -F: '/Machine/ {gsub(/^ +/, "", $2); print $2}')
  [ "$machine" = AArch64 ] || die "$OUT/cmake/$bin is built for '$machine', not AArch64"
done

# 4. The x86 reference: zl_step_check (and the kernel library the export
#    loads) against the venv's x86 wheel, in its own build folder; 5. a
#    tiny-random export of 3 stages (first, middle, last), made on x86 as
#    always; the same .pte files run on both sides (tools/arm64_common.sh x86_reference).
x86_reference

# 6. Both GoogleTest suites under qemu (ctest runs each test through the
#    toolchain's emulator); ZL_TEST_EXPORT_DIR turns the StageProgram tests on,
#    ZL_MARKER_TEST_PTE the marker kernel's test inside Module::execute.
say "running the C++ suites under qemu-aarch64 (log: $OUT/ctest.log)"
ZL_TEST_EXPORT_DIR=$EXPORT ZL_MARKER_TEST_PTE=$EXPORT/stage_1.pte nice -n 10 ctest --test-dir "$OUT/cmake" --output-on-failure -j"$JOBS" \
  --timeout 600 >"$OUT/ctest.log" 2>&1 || { grep -E 'Failed|\*\*\*' "$OUT/ctest.log" | tail -30; die "ctest under qemu (log: $OUT/ctest.log)"; }
ctest_summary=$(grep -E 'tests passed' "$OUT/ctest.log")
# A skipped test would be a pass that checked nothing (the StageProgram tests
# skip without an export): every test must run here.
if grep -q 'tests did not run' "$OUT/ctest.log"; then
  sed -n '/tests did not run/,$p' "$OUT/ctest.log"; die "tests skipped under qemu (log: $OUT/ctest.log)"
fi

# 7. One step through the 3 stages, x86 natively and aarch64 under qemu.
say "one step, x86 and aarch64 (logs: $OUT/step_{x86,arm64}.log)"
nice -n 10 "$OUT/x86/runner/zl_step_check" --export-dir "$EXPORT" \
  --out "$OUT/step_x86.safetensors" >"$OUT/step_x86.log" 2>&1 || { cat "$OUT/step_x86.log"; die "x86 step"; }
nice -n 10 "${QEMU[@]}" "$OUT/cmake/runner/zl_step_check" --export-dir "$EXPORT" \
  --out "$OUT/step_arm64.safetensors" >"$OUT/step_arm64.log" 2>&1 || { cat "$OUT/step_arm64.log"; die "aarch64 step"; }

# 8. The comparison (tools/compare_step.py): each stage's loss and CE within
#    ZL_LOSS_RTOL (relative); its KL term within ZL_LOSS_RTOL of the stage's
#    loss; every gradient and hidden state within ZL_GRAD_ATOL (absolute).
compare=$("$VENV_PY" "$ROOT/tools/compare_step.py" "$OUT/step_x86.safetensors" "$OUT/step_arm64.safetensors" \
  "${ZL_LOSS_RTOL:-1e-5}" "${ZL_GRAD_ATOL:-1e-6}") || { echo "$compare"; die "x86 and aarch64 numbers differ beyond the limits"; }

say "summary"
echo "  aarch64 build: zl_runner, zl_step_check, libzl_custom_ops.so and the test suites are AArch64 ELF"
echo "  $(grep -o "zl fast kernels: GEMM on [A-Za-z]*" "$OUT/cmake.log" | head -1) (the Eigen path: custom_ops.eigen.* tests)"
echo "  C++ suites under qemu-aarch64: $ctest_summary, none skipped"
echo "$compare" | sed 's/^/  /'
say "OK"
