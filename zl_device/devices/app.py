"""The `adb` backend in `--mode app`: a phone runs its stage in the app com.zerolock.zl instead of `zl_runner`.

The host talks to the app's foreground service with `am start-foreground-service` intents over adb
(android_app/README.md):

    com.zerolock.zl.action.PREPARE                    create the files folder, write app.json, stop
    com.zerolock.zl.action.START  --es config PATH --ez resume true|false
    com.zerolock.zl.action.STOP                       the run stops at its next check; exit status 3

The workdir is the app's external files folder, /sdcard/Android/data/com.zerolock.zl/files: the app
cannot read /data/local/tmp, and `adb push` / `pull` and the adb shell reach this one. The app writes the
files the binary's wrapper shell writes, with the same names: runner.pid (the app process's pid, at the
start of a run), runner.out / runner.err (appended), runner.exit (the status when the run ends; never
written when the process is killed). Everything else (files, tunnels, temperature) is `AdbDevice`'s.

The shell user cannot `kill -0` or read /proc/PID/smaps_rollup of the app's uid: liveness comes from
`pidof com.zerolock.zl`, memory from `dumpsys meminfo`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import signal
import time
from pathlib import Path

from zl_base.errors import ZLError
from zl_device.devices.adb import AdbDevice, _adb_errors, parse_df_available
from zl_device.devices.backend import (
    RUNNER_EXIT,
    RUNNER_PID,
    RUNNER_STDERR,
    RUNNER_STDOUT,
    ByteCallback,
    Device,
    FileCallback,
    RuntimeInstall,
    signal_exit_code,
)

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
APP_PACKAGE = "com.zerolock.zl"
APP_SERVICE = f"{APP_PACKAGE}/.RunnerService"
APP_WORKDIR = f"/sdcard/Android/data/{APP_PACKAGE}/files"
ACTION_PREPARE = f"{APP_PACKAGE}.action.PREPARE"
ACTION_START = f"{APP_PACKAGE}.action.START"
ACTION_STOP = f"{APP_PACKAGE}.action.STOP"
#: Written by PREPARE into the workdir: {"package", "version_name", "version_code", "files_dir"}.
APP_INFO = "app.json"
APK_ENV = "ZL_ANDROID_APK"
DEFAULT_APK = REPO / "android_app" / "app" / "app" / "build" / "outputs" / "apk" / "debug" / "app-debug.apk"
APK_BUILD_HINT = "build it with `tools/build_android.sh --apk-only` (see android_app/README.md)"
#: Where the APK is pushed before `pm install` (readable by the package manager, unlike /sdcard).
_APK_STAGING = f"/data/local/tmp/{APP_PACKAGE}.apk"
_PREPARE_TIMEOUT_S = 15.0  # until app.json appears
_START_TIMEOUT_S = 15.0  # until runner.pid appears
_POLL_S = 0.2
#: `pm install` failures with their fix (the rest: install by hand to see why).
_INSTALL_FIXES = {
    "INSTALL_FAILED_UPDATE_INCOMPATIBLE": "an app {pkg} signed with another key is installed; uninstall it with "
    "`adb -s {serial} uninstall {pkg}` (this deletes its files folder: `zl pull --mode app` results first)",
    "INSTALL_FAILED_VERSION_DOWNGRADE": "a newer {pkg} is installed; uninstall it with `adb -s {serial} uninstall "
    "{pkg}` or build a higher versionCode",
    "INSTALL_FAILED_INSUFFICIENT_STORAGE": "the phone's storage is full; free space and deploy again",
    "INSTALL_FAILED_NO_MATCHING_ABIS": "the APK has no arm64-v8a libzl_jni.so; rebuild it ({hint})",
    "INSTALL_FAILED_USER_RESTRICTED": "the phone refuses installs over USB: enable 'Install via USB' in "
    "Developer options (Xiaomi, Oppo, Vivo) or accept the install prompt on the phone",
    "INSTALL_PARSE_FAILED": "the APK is damaged or not an APK; rebuild it ({hint})",
}


def android_apk() -> Path:
    """The app to install: $ZL_ANDROID_APK, else the Gradle debug build's app-debug.apk.

    Raises:
        ZLError: missing (with how to build it) or not a zip file.
    """
    path = Path(os.environ.get(APK_ENV) or DEFAULT_APK)
    if not path.is_file():
        raise ZLError(f"{path}: the app's APK is not built; {APK_BUILD_HINT}, or set {APK_ENV} to a built APK.")
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic != b"PK":  # an APK is a zip archive
        raise ZLError(f"{path} is not an APK (no zip header, starts with {magic!r}); {APK_BUILD_HINT}, or set "
                      f"{APK_ENV} to a built APK.")
    return path


def parse_meminfo_total_pss_kib(meminfo: str) -> int | None:
    """Total PSS in kB from `dumpsys meminfo PACKAGE`; None when the process is not there.

    Newer Android prints "TOTAL PSS:   123456   TOTAL RSS: ..." in the App Summary; older versions only a
    row starting with "TOTAL" (the table's, or "TOTAL:" in the summary) whose first number is the PSS.
    """
    m = re.search(r"TOTAL PSS:\s*(\d+)", meminfo)
    if m is None:
        m = re.search(r"^[ \t]*TOTAL:?[ \t]+(\d+)", meminfo, re.MULTILINE)
    return int(m.group(1)) if m else None


def parse_version_name(dumpsys_package: str) -> str | None:
    """The first "versionName=..." of `dumpsys package PACKAGE`; None when not installed."""
    m = re.search(r"versionName=(\S+)", dumpsys_package)
    return m.group(1) if m else None


def parse_base_apk(pm_path: str) -> str | None:
    """The installed base.apk from `pm path PACKAGE` ("package:/data/app/.../base.apk", one line per split)."""
    for line in pm_path.splitlines():
        path = line.strip().removeprefix("package:")
        if line.strip().startswith("package:") and path.endswith("/base.apk"):
            return path
    return None


def app_version(dev, serial: str) -> str | None:
    """versionName of the installed app on an adbutils device; None when it is not installed."""
    with _adb_errors(serial, f"ask for the {APP_PACKAGE} version"):
        out = dev.shell(f"dumpsys package {APP_PACKAGE} | grep versionName", timeout=30)
    return parse_version_name(out)


class AppDevice(AdbDevice):
    """A phone that runs its stage in the app's foreground service (`--mode app`).

    Use `zl_device.devices.registry.open_phone(serial, mode="app")` to get one with its state and ABI checked.
    """

    runs_runner_binary = False  # the APK carries the runtime (libzl_jni.so); install_runtime installs it
    workdir_is_private = False  # shared storage: the run key goes with START into the app's private storage
    _run_key: str | None = None

    def __init__(self, serial: str, client, workdir: str = APP_WORKDIR, link_profile: str = "local"):
        super().__init__(serial, client, workdir=workdir, link_profile=link_profile)

    def keep_awake(self) -> str | None:
        return None  # the app's foreground service holds a wake lock for the run (RunnerService.kt)

    def restore_sleep(self) -> None:
        return None

    # --- no hot standby: the app's service runs one runner (docs/design#hot-standbys) -------------------

    supports_standby = False
    has_standby = Device.has_standby
    take_over = Device.take_over
    stop_standby = Device.stop_standby

    def start_standby(self, config: str) -> None:
        raise ZLError(f"phone {self.serial}: --mode app keeps no hot standby (the app's service runs one runner); "
                      "run without --standby, or with --mode binary.")

    def _logcat_hint(self) -> str:
        return f"see `adb -s {self.serial} logcat -s zl zl.RunnerService`"

    def hold_run_key(self, key_file: Path) -> None:
        """Keep the run key in memory: START carries it (`--es run_key`) and the app writes it to its private
        storage, so it never sits in the shared files folder.

        Raises:
            ZLError: the file is not a run key (64 hex characters).
        """
        from zl_device.formats.frames import parse_key

        try:
            text = Path(key_file).read_text()
            parse_key(text)
        except (OSError, ValueError) as e:
            raise ZLError(f"run key {key_file}: {e}; use the RUN_DIR/run.key zl train wrote.") from None
        self._run_key = text.strip()

    def am(self, action: str, extras: str = "", secret: str = "") -> str:
        """Send one intent to the app's service; `am`'s output. `secret` extras are sent, never shown in errors.

        Raises:
            ZLError: `am` reports an error (it exits 0 anyway), e.g. the app is not installed.
        """
        command = f"am start-foreground-service -n {APP_SERVICE} -a {action}" + (f" {extras}" if extras else "")
        out = self.shell(f"{command}{f' {secret}' if secret else ''} 2>&1", f"send {action} to the app",
                         shown=f"{command}{' <secret extras>' if secret else ''} 2>&1")
        bad = [line.strip() for line in out.splitlines()
               if line.strip().startswith("Error") or "Exception" in line]
        if bad:
            if "Not found" in bad[0]:
                fix = f"the app {APP_PACKAGE} is not installed; `zl deploy --mode app` installs it"
            else:
                fix = (f"reinstall the app with `zl deploy --mode app --force`, open it once on the phone, and "
                       f"{self._logcat_hint()}")
            raise ZLError(f"phone {self.serial}: `{command}` failed: {bad[0]}; {fix}.")
        return out

    # --- files ---------------------------------------------------------------------------------------

    def free_bytes(self) -> int:
        # /sdcard's filesystem; the workdir exists once the app ran PREPARE.
        out = self.shell(f"df -k {shlex.quote(self.workdir)} 2>/dev/null || df -k /sdcard", "check free space")
        free = parse_df_available(out)
        if free is None:
            raise ZLError(f"phone {self.serial}: cannot read free space from `df -k {self.workdir}`: {out[:200]!r}.")
        return free

    # --- the app -------------------------------------------------------------------------------------

    def installed_apk_sha256(self) -> str | None:
        """sha256 of the installed app's base.apk; None when the app is not installed."""
        base = parse_base_apk(self.shell(f"pm path {APP_PACKAGE} 2>/dev/null", f"look for {APP_PACKAGE}"))
        return self.file_sha256(base) if base else None

    def install_apk(self, apk: Path, on_bytes: ByteCallback | None = None) -> int:
        """`pm install -r` of a host APK (pushed to /data/local/tmp first). Returns the bytes pushed.

        Raises:
            ZLError: the package manager refuses it, with the fix for the usual reasons.
        """
        size = self.push(apk, _APK_STAGING, mode=0o644, on_bytes=on_bytes)
        try:
            # -r: keep the app's data (its files folder: checkpoints of a run); -t: debug builds may be test-only;
            # -g: grant the notification permission, so the foreground service shows its status.
            out = self.shell(f"pm install -r -t -g {_APK_STAGING} 2>&1", f"install {apk.name}", timeout=300)
        finally:
            self.shell(f"rm -f {_APK_STAGING}", "remove " + _APK_STAGING)
        if "Success" not in out:
            reason = next((ln.strip() for ln in out.splitlines() if "Failure" in ln or "Error" in ln),
                          out.strip()[-300:] or "no output")
            code = next((c for c in _INSTALL_FIXES if c in reason), None)
            fix = (_INSTALL_FIXES[code].format(pkg=APP_PACKAGE, serial=self.serial, hint=APK_BUILD_HINT) if code
                   else f"install it by hand with `adb -s {self.serial} install -r {apk}` to see why")
            raise ZLError(f"phone {self.serial}: installing {apk} failed: {reason}; {fix}.")
        return size

    def prepare(self, timeout_s: float | None = None) -> dict:
        """PREPARE: the app creates its files folder (the workdir) and describes itself in app.json.

        Returns:
            app.json: package, version_name, version_code, files_dir.

        Raises:
            ZLError: the app is not installed, or does not answer within `timeout_s` (default 15 s).
        """
        timeout_s = _PREPARE_TIMEOUT_S if timeout_s is None else timeout_s
        self.shell(f"rm -f {self._q(APP_INFO)}", "remove the old " + APP_INFO)
        self.am(ACTION_PREPARE)
        deadline = time.monotonic() + timeout_s
        while True:
            text = self.read_text(APP_INFO)
            if text and text.strip():
                try:
                    info = json.loads(text)
                except json.JSONDecodeError:
                    info = None  # half written; read it again
                if isinstance(info, dict):
                    log.info("%s: app %s", self.serial, info)
                    return info
            if time.monotonic() > deadline:
                raise ZLError(f"phone {self.serial}: the app {APP_PACKAGE} did not write {self.path(APP_INFO)} "
                              f"within {timeout_s:.0f} s of {ACTION_PREPARE}; open the app once on the phone "
                              f"(some vendors block background starts of an app that was never opened) and "
                              f"{self._logcat_hint()}.")
            time.sleep(_POLL_S)

    def install_runtime(self, force: bool = False, on_file: FileCallback | None = None,
                        on_bytes: ByteCallback | None = None) -> RuntimeInstall:
        """Install the APK unless the same build is installed (sha256 of base.apk), then PREPARE."""
        from zl_device.devices.deploy import file_sha256

        apk = android_apk()
        size = apk.stat().st_size
        unchanged = not force and self.installed_apk_sha256() == file_sha256(apk)
        if on_file:
            on_file(self.name, apk.name, size, unchanged)
        pushed = 0 if unchanged else self.install_apk(apk, on_bytes)
        info = self.prepare()
        return RuntimeInstall(f"app {APP_PACKAGE} {info.get('version_name', '?')}", not unchanged, pushed)

    # --- the runner ----------------------------------------------------------------------------------

    def status_command(self) -> str:
        """One shell line that prints exit=, pid= and alive= (pidof) for the run in the workdir (tested)."""
        return (f"cd {shlex.quote(self.workdir)} 2>/dev/null || exit 0; "
                f'echo "exit=$(cat {RUNNER_EXIT} 2>/dev/null)"; echo "pid=$(cat {RUNNER_PID} 2>/dev/null)"; '
                f'echo "alive=$(pidof {APP_PACKAGE} 2>/dev/null)"')

    def _status(self) -> tuple[int | None, int | None, bool]:
        """(runner.exit's status, runner.pid's pid, whether the app process with that pid is alive)."""
        fields = dict(line.partition("=")[::2] for line in self.shell(self.status_command(), "check the app's run")
                      .splitlines() if "=" in line)
        exit_text, pid_text = fields.get("exit", "").strip(), fields.get("pid", "").strip()
        pid = int(pid_text) if pid_text.isdigit() else None
        alive = pid is not None and str(pid) in fields.get("alive", "").split()
        return (int(exit_text) if exit_text.isdigit() else None), pid, alive

    def is_running(self) -> bool:
        status, pid, alive = self._status()
        return status is None and pid is not None and alive

    def exit_code(self) -> int | None:
        status, pid, alive = self._status()
        if status is None and pid is not None and not alive:
            # The process is gone without reporting; it may have written runner.exit just before it went.
            status, pid, alive = self._status()
        if status is not None:
            return signal_exit_code(status)
        return -signal.SIGKILL if pid is not None and not alive else None

    def start_runner(self, config: str, resume: bool = False) -> None:
        """START the app's service on `config` (the zl_runner binary is not needed on the phone).

        Raises:
            ZLError: a run is going, the config is missing, the app refuses the intent or does not start.
        """
        if self.is_running():
            raise ZLError(f"phone {self.serial}: the app is already running a stage (pid {self._pid()}); stop it "
                          "first.")
        if not self.exists(config):
            raise ZLError(f"phone {self.serial}: {self.path(config)} does not exist; run `zl deploy --mode app` "
                          "first.")
        self.shell(f"rm -f {self._q(RUNNER_PID)} {self._q(RUNNER_EXIT)}", "clear the last run's status")
        size = self.shell(f"stat -c %s {self._q(RUNNER_STDOUT)} 2>/dev/null", "stat runner.out").strip()
        self._out_offset = int(size) if size.isdigit() else 0
        self.am(ACTION_START, f"--es config {shlex.quote(self.path(config))} --ez resume "
                              f"{'true' if resume else 'false'}",
                secret=f"--es run_key {self._run_key}" if self._run_key else "")
        deadline = time.monotonic() + _START_TIMEOUT_S
        while self._pid() is None:
            if time.monotonic() > deadline:
                err = self.read_text(RUNNER_STDERR) or ""
                raise ZLError(f"phone {self.serial}: the app did not start the stage within {_START_TIMEOUT_S:.0f} "
                              f"s (no {RUNNER_PID}); {RUNNER_STDERR}: {err.strip()[-300:]!r}; open the app once "
                              f"and {self._logcat_hint()}.")
            time.sleep(_POLL_S)

    def signal_runner(self, sig: int) -> bool:
        """SIGTERM / SIGINT: the STOP intent (exit status 3); SIGKILL: `am force-stop` (a crash, exit -9).

        Raises:
            ZLError: another signal (the app has no way to receive it).
        """
        if sig not in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL):
            raise ZLError(f"phone {self.serial}: cannot send signal {int(sig)} to the app; in --mode app a stage "
                          f"takes SIGTERM/SIGINT (stop) and SIGKILL (force-stop) only.")
        if not self.is_running():
            return False
        if sig == signal.SIGKILL:
            self.shell(f"am force-stop {APP_PACKAGE}", "force-stop the app")
        else:
            self.am(ACTION_STOP)
        return True

    # --- probes --------------------------------------------------------------------------------------

    def pss_mib(self) -> float | None:
        if not self.is_running():
            return None
        kib = parse_meminfo_total_pss_kib(self.shell(f"dumpsys meminfo {APP_PACKAGE}", "read the app's PSS"))
        return kib / 1024.0 if kib is not None else None
