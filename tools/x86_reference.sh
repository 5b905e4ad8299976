# Sourced by tools/check_arm64.sh and tools/build_phone_runner.sh: the x86 side both compare an aarch64 build with.
# Expects ROOT, OUT, JOBS, VENV_PY and the caller's say/die; sets EXPORT.
#
#   x86_reference   build zl_step_check (and the kernel library the export loads) against the venv's x86
#                   wheel in $OUT/x86, then export tiny-random into 3 stages (first, middle, last; seq 16) in
#                   $OUT/export unless it is there: the same .pte files run on both sides.

x86_reference() {
  local et_x86
  et_x86=$("$VENV_PY" -c 'import executorch, os; print(os.path.join(executorch.__path__[0], "share", "cmake"))')
  say "building the x86 zl_step_check in $OUT/x86 (log: $OUT/x86.log)"
  { nice -n 10 cmake -S "$ROOT" -B "$OUT/x86" -DCMAKE_BUILD_TYPE=Release -DZL_BUILD_TESTS=OFF \
      -DCMAKE_PREFIX_PATH="$et_x86" &&
    nice -n 10 cmake --build "$OUT/x86" -j"$JOBS" --target zl_step_check zl_custom_ops; } >"$OUT/x86.log" 2>&1 ||
    { tail -30 "$OUT/x86.log"; die "x86 build (log: $OUT/x86.log)"; }
  EXPORT=$OUT/export
  if [ ! -f "$EXPORT/manifest.json" ]; then
    say "exporting tiny-random, 3 stages, seq 16, into $EXPORT"
    ZL_CUSTOM_OPS_LIB=$OUT/x86/custom_ops/libzl_custom_ops.so nice -n 10 "$VENV_PY" -m zl.cli export \
      --model tiny-random --num-stages 3 --seq-len 16 --out "$EXPORT" --no-check >"$OUT/export.log" 2>&1 ||
      { tail -20 "$OUT/export.log"; die "export (log: $OUT/export.log)"; }
  fi
}
