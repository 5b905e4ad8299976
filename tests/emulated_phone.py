"""Emulated Android phones with the app com.zerolock.zl, for end-to-end tests of `--mode app`.

An `EmulatedPhone` quacks like an adbutils device (`serial`, `shell`, `sync.push/pull_file/stat/
iter_directory/read_text`, `forward/reverse/..._remove_all`) and is backed by a real folder on this host,
its root: device paths under /sdcard, /storage and /data map to ROOT/sdcard/..., ROOT/data/... Shell
commands run in a real `sh` with those paths rewritten and a PATH that puts the phone's Android commands
first (`am`, `pidof`, `dumpsys`, `pm`, `getprop`, `ip`, `settings`, `input`: one busybox-style script,
PHONE_COMMANDS); the rest
(`cat`, `rm`, `mv`, `mkdir`, `stat`, `df`, `sha256sum`, `kill`) are this host's. Output has the root cut out
again, so the host sees device paths, as from a phone.

The app is the real native side run as the app runs it: `am start-foreground-service ... -a START --es
config P --ez resume B` starts `com.zerolock.zl.AppStageDriver` (a JVM on libzl_jni.so, the app's
RunnerService without Android) on the config's mapped path, in its own session (`setsid`), so once `am`
exits init adopts it; the native session writes runner.pid (the JVM's pid), runner.out/.err/.exit into the
app's files folder. STOP sends it SIGTERM (the run stops, exit status 3); `am force-stop com.zerolock.zl`
SIGKILLs it and waits until it is gone. `pidof com.zerolock.zl` lists the JVM while it lives (a zombie, or a
pid reused by another program, does not count). `pm install` checks the zip header and keeps the APK's bytes
as the installed base.apk, so deploy's sha256 skip works. Every process the app started is listed in
ROOT/.emulator/starts ("pid resume config" lines), outside the files folder.

The phone runs what it is given: by default the host build of zl_runner stands in for the arm64 one;
with `qemu=` (the path of qemu-aarch64) it is an arm64 phone, and `./zl_runner` in its shell commands runs
under that qemu, as binfmt_misc would run an AArch64 file on a host that registers it, so `--mode binary` can
push and start the static phone build (tools/build_phone_runner.sh) itself.

Network: each phone reports a distinct loopback address, 127.0.0.2, 127.0.0.3, ..., as its Wi-Fi
(wlan0) address, so `zl train` plans the `wifi` network: stage k listens on 0.0.0.0:P+k and stage k-1
sends to phone k's address, over real TCP, as phones on one Wi-Fi do (a listener takes its port on every
address of this host: the stage ports keep the phones apart, the addresses make each config name its
downstream phone). adb forward/reverse tunnels are not
emulated (they raise): all phones share this host's loopback, so a reverse tunnel to phone A's
127.0.0.1:P would take the port that phone B's stage listens on.

    phones = [EmulatedPhone(f"zlemu-{i}", tmp_path / f"zlemu-{i}", f"127.0.0.{2 + i}", app) for i in range(3)]
    monkeypatch.setattr(zl_device.devices.adb, "connect", lambda start=True: emulated_client(phones))
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

from adbutils._proto import FileInfo
from adbutils.errors import AdbTimeout

from test_devices_adb import FakeClient

PACKAGE = "com.zerolock.zl"
#: Where `pm install` puts the app (a device path, as `pm path` prints it).
BASE_APK = f"/data/app/~~emulated==/{PACKAGE}-emulated==/base.apk"
#: `./zl_runner` as a command word of a shell line (an arm64 phone with `qemu=` runs it under qemu-aarch64).
_RUNNER_WORD = re.compile(r"(?<![\w./-])\./zl_runner\b")
#: Device path prefixes that live under the phone's root folder.
_DEVICE_PATH = re.compile(r"(?<![\w.\-/~])(?=/(?:sdcard|storage|data)(?:/|\b))")

# The Android commands of one phone, called by their names (symlinks to this script). ZLEMU_* come from
# EmulatedPhone.shell's environment.
PHONE_COMMANDS = r"""#!/bin/sh
PKG=com.zerolock.zl
FILES="$ZLEMU_ROOT/sdcard/Android/data/$PKG/files"
PIDFILE="$ZLEMU_STATE/app.pid"
BASE_APK="$ZLEMU_BASE_APK"

app_pid() {  # the app process's pid while it lives: not a zombie, and still the JVM (pids get reused)
  pid=$(cat "$PIDFILE" 2>/dev/null) && [ -n "$pid" ] || return 1
  st=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
  case "${st##*) }" in Z*|X*) return 1 ;; esac
  grep -qa AppStageDriver "/proc/$pid/cmdline" 2>/dev/null || return 1
  echo "$pid"
}

kill_app() {  # SIGKILL, then wait until it is gone (as force-stop returns once the process died)
  pid=$(app_pid) || return 0
  kill -KILL "$pid"
  for _ in $(seq 200); do app_pid >/dev/null || return 0; sleep 0.05; done
  echo "emulated phone: pid $pid did not die" >&2
}

start_app() {  # the service's START: the app's native run on the config ($1, resume $2, run key $3), own session
  resume_flag=
  [ "$2" = true ] && resume_flag=--resume
  key_flag=
  if [ -n "$3" ]; then  # as RunnerService: the key goes to the app's private storage, not the files folder
    mkdir -p "$ZLEMU_STATE/private" && (umask 077 && printf '%s\n' "$3" >"$ZLEMU_STATE/private/run.key")
    key_flag="--run-key-file $ZLEMU_STATE/private/run.key"
  fi
  setsid "$ZLEMU_JAVA" -XX:+UseSerialGC -XX:TieredStopAtLevel=1 -Dzl.jni.library="$ZLEMU_JNI_LIBRARY" \
    -cp "$ZLEMU_JNI_CLASSES" com.zerolock.zl.AppStageDriver --config "$1" $resume_flag $key_flag \
    >>"$ZLEMU_STATE/logcat" 2>&1 </dev/null &
  echo $! >"$PIDFILE"
  echo "$! $2 $1" >>"$ZLEMU_STATE/starts"
}

am_service() {
  component= action= config= resume=false run_key=
  while [ $# -gt 0 ]; do
    case "$1" in
      -n) component=$2; shift ;;
      -a) action=$2; shift ;;
      --es) [ "$2" = config ] && config=$3; [ "$2" = run_key ] && run_key=$3; shift 2 ;;
      --ez) [ "$2" = resume ] && resume=$3; shift 2 ;;
    esac
    shift
  done
  echo "Starting service: Intent { act=$action cmp=$component }"
  if [ "$component" != "$PKG/.RunnerService" ] || [ ! -f "$ZLEMU_ROOT$BASE_APK" ]; then
    echo "Error: Not found; no service started."
    return 0
  fi
  case "$action" in
    "$PKG.action.PREPARE")
      mkdir -p "$FILES" && printf '{"package": "%s", "version_name": "0.1.0", "version_code": 1, "files_dir": "%s"}\n' \
        "$PKG" "/storage/emulated/0/Android/data/$PKG/files" >"$FILES/.app.json" && mv "$FILES/.app.json" "$FILES/app.json" ;;
    "$PKG.action.START") start_app "$config" "$resume" "$run_key" ;;
    "$PKG.action.STOP") pid=$(app_pid) && kill -TERM "$pid" ;;
    *) echo "Error: unknown action $action" ;;
  esac
}

case "$(basename "$0")" in
  am)
    case "$1" in
      start-foreground-service) shift; am_service "$@" ;;
      force-stop) [ "$2" = "$PKG" ] && kill_app ;;
      *) echo "emulated am: unsupported: $*" >&2; exit 1 ;;
    esac ;;
  pidof) [ "$1" = "$PKG" ] && app_pid ;;
  dumpsys)
    case "$1" in
      meminfo)
        pid=$(app_pid) || { echo "No process found for: $2"; exit 0; }
        pss=$(awk '/^Pss:/ { kib += $2 } END { print kib }' "/proc/$pid/smaps_rollup")
        printf '** MEMINFO in pid %s [%s] **\n\n App Summary\n           TOTAL PSS:  %s            TOTAL RSS:  0\n' \
          "$pid" "$PKG" "$pss" ;;
      battery) printf 'Current Battery Service state:\n  AC powered: false\n  USB powered: true\n  level: 88\n  temperature: 312\n' ;;
      package) [ -f "$ZLEMU_ROOT$BASE_APK" ] && echo "    versionName=0.1.0" ;;
      *) echo "emulated dumpsys: unsupported: $*" >&2; exit 1 ;;
    esac ;;
  pm)
    case "$1" in
      path) [ -f "$ZLEMU_ROOT$BASE_APK" ] && echo "package:$BASE_APK" ;;
      install)
        for apk; do :; done
        if [ "$(head -c 2 "$apk")" != PK ]; then
          echo "Failure [INSTALL_PARSE_FAILED_NOT_APK: Failed to parse $apk]"; exit 1
        fi
        kill_app  # installing stops the app
        mkdir -p "$(dirname "$ZLEMU_ROOT$BASE_APK")" && cp "$apk" "$ZLEMU_ROOT$BASE_APK" && echo Success ;;
      *) echo "emulated pm: unsupported: $*" >&2; exit 1 ;;
    esac ;;
  getprop)
    case "$1" in
      ro.product.model) echo "zl emulated phone" ;;
      ro.product.cpu.abi) echo arm64-v8a ;;
      ro.product.cpu.abilist) echo arm64-v8a,armeabi-v7a,armeabi ;;
      ro.build.version.release) echo 14 ;;
    esac ;;
  settings)  # Android's settings provider: one file per setting under the phone's state ("null": none)
    file="$ZLEMU_STATE/settings/$2/$3"
    case "$1" in
      get) cat "$file" 2>/dev/null || echo null ;;
      put) mkdir -p "$(dirname "$file")" && printf '%s\n' "$4" > "$file" ;;
      delete) rm -f "$file" ;;
      *) echo "emulated settings: unsupported: $*" >&2; exit 1 ;;
    esac ;;
  input)
    [ "$1" = keyevent ] || { echo "emulated input: unsupported: $*" >&2; exit 1; }
    echo "$2" >> "$ZLEMU_STATE/keyevents" ;;
  ip)
    [ "$*" = "-f inet addr show wlan0" ] || { echo "emulated ip: unsupported: $*" >&2; exit 1; }
    printf '47: wlan0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc mq state UP group default qlen 3000\n'
    printf '    inet %s/8 brd 127.255.255.255 scope global wlan0\n' "$ZLEMU_WIFI_IP" ;;
esac
"""
_COMMANDS = ("am", "pidof", "dumpsys", "pm", "getprop", "ip", "settings", "input")


@dataclass(frozen=True)
class AppRuntime:
    """What plays the app on every emulated phone: a JVM and the host build of the app's native side."""

    java: str
    jni_library: Path  # libzl_jni.so
    jni_classes: Path  # the folder with com/zerolock/zl/AppStageDriver.class


@dataclass(frozen=True)
class AppStart:
    """One process the app's service started (a START intent)."""

    pid: int
    resume: bool
    config: str  # the config's path on the phone


class EmulatedSync:
    """adbutils' `Sync` on the phone's folder: what adb's sync service does (STAT, LIST, SEND, RECV)."""

    def __init__(self, phone: EmulatedPhone):
        self._phone = phone

    def stat(self, path: str) -> FileInfo:
        try:
            st = os.lstat(self._phone.local(path))
        except OSError:
            return FileInfo(0, 0, None, path)  # adb answers mode 0 for a missing path
        return FileInfo(st.st_mode, st.st_size, None, path)

    def iter_directory(self, path: str):
        local = self._phone.local(path)
        if not local.is_dir():
            return
        for name in [".", ".."] + sorted(os.listdir(local)):
            st = os.lstat(local / name)
            yield FileInfo(st.st_mode, st.st_size, None, name)

    def push(self, src, dst: str, mode: int = 0o755, check: bool = False) -> int:
        if isinstance(src, (bytes, bytearray)):
            data = bytes(src)
        elif isinstance(src, (str, Path)):
            data = Path(src).read_bytes()
        else:
            data = b"".join(iter(lambda: src.read(1 << 16), b""))
        local = self._phone.local(dst)
        local.parent.mkdir(parents=True, exist_ok=True)  # adbd creates the parents
        local.write_bytes(data)
        local.chmod(stat.S_IMODE(mode))
        self._phone.pushed.append(dst)
        return len(data)

    def pull_file(self, src: str, dst) -> int:
        data = self._phone.local(src).read_bytes()
        Path(dst).write_bytes(data)
        return len(data)

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return self._phone.local(path).read_text(encoding=encoding)


class EmulatedPhone:
    """One phone (see the module docstring): a root folder, Android's commands and the app."""

    def __init__(self, serial: str, root: Path, wifi_ip: str, app: AppRuntime, qemu: str | None = None):
        self.serial = serial
        self.qemu = qemu  # qemu-aarch64: an arm64 phone (see the module docstring)
        self.root = Path(root).resolve()
        self.wifi_ip = wifi_ip
        self.app = app
        self.sync = EmulatedSync(self)
        self.commands: list[str] = []  # shell commands as the host sent them (device paths)
        self.pushed: list[str] = []  # device paths pushed with sync
        self.state = self.root / ".emulator"  # the phone's private state: app pid, starts, logcat
        for folder in ("sdcard", "data/local/tmp"):  # what every phone has
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        bin_dir = self.state / "bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        script = bin_dir / "android-commands"
        script.write_text(PHONE_COMMANDS)
        script.chmod(0o755)
        for name in _COMMANDS:
            (bin_dir / name).symlink_to(script.name)
        self._env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(self.state), "LC_ALL": "C",
                     "ZLEMU_ROOT": str(self.root), "ZLEMU_STATE": str(self.state), "ZLEMU_WIFI_IP": wifi_ip,
                     "ZLEMU_BASE_APK": BASE_APK, "ZLEMU_JAVA": app.java,
                     "ZLEMU_JNI_LIBRARY": str(Path(app.jni_library).resolve()),
                     "ZLEMU_JNI_CLASSES": str(Path(app.jni_classes).resolve())}
        # The host's OpenBLAS settings (e.g. OPENBLAS_CORETYPE=Haswell on an AVX-512 host) pick its GEMM kernels,
        # whose float order the tests compare bit for bit with local devices: a phone's runner must use the same
        # ones as the local runners, which inherit the host's environment.
        self._env.update({k: v for k, v in os.environ.items() if k.startswith("OPENBLAS_")})

    def setting(self, namespace: str, key: str) -> str | None:
        """A value of Android's settings on this phone (`settings get`); None: not set."""
        path = self.state / "settings" / namespace / key
        return path.read_text().strip() if path.is_file() else None

    def put_setting(self, namespace: str, key: str, value: str) -> None:
        """What the phone's owner set (`settings put`)."""
        path = self.state / "settings" / namespace / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(value + "\n")

    def local(self, device_path: str) -> Path:
        """The host path of a device path (/sdcard/x -> ROOT/sdcard/x)."""
        if not _DEVICE_PATH.match(device_path):
            raise AssertionError(f"{self.serial}: {device_path!r} is not a path this emulated phone has")
        return Path(str(self.root) + device_path)

    @property
    def files_dir(self) -> Path:
        """The app's external files folder on this host."""
        return self.local(f"/sdcard/Android/data/{PACKAGE}/files")

    def shell(self, cmdargs, timeout: float | None = 600) -> str:
        """`adb shell CMD`: stdout and stderr merged, right-stripped (adbutils' defaults)."""
        command = cmdargs if isinstance(cmdargs, str) else shlex.join(cmdargs)
        self.commands.append(command)
        local = _DEVICE_PATH.sub(lambda m: str(self.root), command)
        if self.qemu:
            local = _RUNNER_WORD.sub(lambda m: f"{self.qemu} ./zl_runner", local)
        try:
            # cwd: the root, as `adb shell` starts in /.
            done = subprocess.run(["sh", "-c", local], env=self._env,
                                  cwd=self.root, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise AdbTimeout(f"{self.serial}: `{command}` took more than {timeout} s") from e
        return done.stdout.decode(errors="replace").replace(str(self.root), "").rstrip()

    # --- adb tunnels: not emulated (see the module docstring) ------------------------------------------------

    def forward(self, local: str, remote: str) -> None:
        raise AssertionError(f"{self.serial}: adb forward {local} {remote}: emulated phones talk over Wi-Fi only")

    def reverse(self, remote: str, local: str) -> None:
        raise AssertionError(f"{self.serial}: adb reverse {remote} {local}: emulated phones talk over Wi-Fi only")

    def forward_remove_all(self) -> None:
        pass

    def reverse_remove_all(self) -> None:
        pass

    # --- for assertions and cleanup ------------------------------------------------------------------------

    def app_starts(self) -> list[AppStart]:
        """Every process the app's service started, in order."""
        path = self.state / "starts"
        lines = path.read_text().splitlines() if path.is_file() else []
        return [AppStart(int(pid), resume == "true", config.replace(str(self.root), ""))
                for pid, resume, config in (line.split(" ", 2) for line in lines)]

    def close(self) -> None:
        """SIGKILL every app process still alive (a test that failed half-way)."""
        for start in self.app_starts():
            try:
                cmdline = Path(f"/proc/{start.pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue  # gone
            if "AppStageDriver" in cmdline and str(self.root) in cmdline:  # still ours, not a reused pid
                os.kill(start.pid, signal.SIGKILL)


def emulated_client(phones: list[EmulatedPhone]) -> FakeClient:
    """An adb client that lists `phones` as attached and authorized ("device")."""
    return FakeClient({p.serial: p for p in phones})
