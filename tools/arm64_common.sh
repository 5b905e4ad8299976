# Sourced by tools/check_arm64.sh and tools/build_phone_runner.sh: what both need around an aarch64 build.
# Expects ROOT, OUT, JOBS, VENV_PY and the caller's say/die; x86_reference sets EXPORT.
#
#   debian_packages PKG...   install the Debian packages not installed yet (adding the arm64 architecture for
#                   multiarch ones; sudo unless root); with ZL_SKIP_APT=1 a missing one is an error instead
#   executorch_src FILE HINT   $ZL_EXECUTORCH_SRC, absolute, into ET_SRC (and the venv checked: ExecuTorch's kernel
#                   codegen runs with it); dies unless it is set (HINT says how to get one) and holds FILE
#   x86_reference   build zl_step_check (and the kernel library the export loads) against the venv's x86
#                   wheel in $OUT/x86, then export tiny-random into 3 stages (first, middle, last; seq 16) in
#                   $OUT/export unless it is there: the same .pte files run on both sides.

debian_packages() {
  local p missing=() SUDO=""
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "${ZL_SKIP_APT:-0}" = 1 ] && die "missing Debian packages: ${missing[*]} (ZL_SKIP_APT=1)"
  [ "$(id -u)" = 0 ] || SUDO=sudo
  say "installing ${missing[*]}"
  dpkg --print-foreign-architectures | grep -qx arm64 || $SUDO dpkg --add-architecture arm64
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >"$OUT/apt.log" 2>&1 ||
    { tail -20 "$OUT/apt.log"; die "apt-get install (log: $OUT/apt.log)"; }
}

executorch_src() {
  [ -x "$VENV_PY" ] || die "no $VENV_PY; run setup.sh first (ExecuTorch's kernel codegen runs with it)"
  ET_SRC=${ZL_EXECUTORCH_SRC:-}
  [ -n "$ET_SRC" ] || die "ZL_EXECUTORCH_SRC is not set; point it at $2"
  ET_SRC=$(cd "$ET_SRC" && pwd)
  [ -f "$ET_SRC/$1" ] || die "ZL_EXECUTORCH_SRC=$ET_SRC has no $1; is it an ExecuTorch checkout?"
}

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
