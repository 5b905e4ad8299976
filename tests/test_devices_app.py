"""Device backends, part 3: `--mode app`, phones that run their stage in the app com.zerolock.zl.

A fake phone (`FakeAppPhone`, built on tests/test_devices_adb.py's fakes of adbutils) plays the app's side of
the contract in zl_device/devices/app.py: START writes runner.pid, STOP writes runner.exit 3, force-stop kills the
process without one, PREPARE writes app.json, `pm` installs. The status line `pidof` decides on runs under
this host's sh / mksh with a stand-in `pidof`.

    .venv/bin/python -m pytest tests/test_devices_app.py
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from test_devices import cli_app, make_configs, make_export
from test_devices_adb import DF_TOYBOX, DUMPSYS_BATTERY, FakeClient, FakePhone, FakeSync
from zl_base.errors import ZLError
from zl_device.devices import adb as zadb
from zl_device.devices import app as zapp
from zl_device.devices import deploy as zdeploy
from zl_device.devices.registry import open_devices, open_phone

WD = zapp.APP_WORKDIR
BASE_APK = "/data/app/~~Xa1bC2==/com.zerolock.zl-Qd3eF4==/base.apk"
AM_OK = "Starting service: Intent { act={action} cmp=com.zerolock.zl/.RunnerService }"

# `dumpsys meminfo com.zerolock.zl`, Android 14 (the App Summary ends with "TOTAL PSS:").
MEMINFO_NEW = """Applications Memory Usage (in Kilobytes):
Uptime: 98313264 Realtime: 251839218

** MEMINFO in pid 5000 [com.zerolock.zl] **
                   Pss  Private  Private  SwapPss      Rss     Heap     Heap     Heap
                 Total    Dirty    Clean    Dirty    Total     Size    Alloc     Free
                ------   ------   ------   ------   ------   ------   ------   ------
  Native Heap  3101184  3101120        0        0  3102220  3170304  3120112    50191
  Dalvik Heap     2210     2164        0        0     7388     5461     2731     2730
     .so mmap    20873      300    18836        0    32172
   Other mmap   119900        8   119876        0   120160
      Unknown      541      536        0        0     1100
        TOTAL  3252800  3109180   139640        0  3294832  3175765  3122843    52921

 App Summary
                       Pss(KB)                        Rss(KB)
                        ------                         ------
           Java Heap:     6068                          24444
         Native Heap:  3101120                        3102220
                Code:    19940                          43864
               Stack:     1088                           1096
            Graphics:        0                              0
       Private Other:   120652
              System:     3932
             Unknown:                                  123208

           TOTAL PSS:  3252800            TOTAL RSS:  3294832       TOTAL SWAP PSS:        0
"""
# Android 9: no "TOTAL PSS:"; the table's TOTAL row and the summary's "TOTAL:" start with the PSS.
MEMINFO_OLD = """Applications Memory Usage (in Kilobytes):
Uptime: 5285433 Realtime: 6628897

** MEMINFO in pid 5049 [com.zerolock.zl] **
                   Pss  Private  Private  SwapPss     Heap     Heap     Heap
                 Total    Dirty    Clean    Dirty     Size    Alloc     Free
                ------   ------   ------   ------   ------   ------   ------
  Native Heap  2990000  2989000        0        0  3000000  2995000     5000
  Dalvik Heap     4859     4820        0        0     7057     5309     1748
        TOTAL  3145728  2999000    28124        0  3007057  3000309     6748

 App Summary
                       Pss(KB)
                        ------
           Java Heap:     7700
         Native Heap:  2989000
               TOTAL:  3145728       TOTAL SWAP PSS:        0
"""


class NormalizingSync(FakeSync):
    """FakeSync that resolves "dir/." as adb's sync service does (`zl pull` lists the workdir as ".")."""

    def stat(self, path):
        return super().stat(posixpath.normpath(path))

    def iter_directory(self, path):
        return super().iter_directory(posixpath.normpath(path))


class FakeAppPhone(FakePhone):
    """A FakePhone with the app com.zerolock.zl on it (or not), answering every shell command AppDevice sends.

    `answers=False`: the app is installed but its service never does anything (a phone that blocks it).
    An unexpected command fails the test: AppDevice must not depend on commands this fake does not model.
    """

    def __init__(self, serial: str = "P1", installed: bool = True, answers: bool = True):
        super().__init__(serial)
        self.sync = NormalizingSync(self)
        self.answers = answers
        self.pid: int | None = None  # the app process, when alive
        self.next_pid = 5000
        self.version = "0.1.0"
        self.am_error: str | None = None  # an "Error: ..." line am prints (with exit status 0)
        self.install_output = "Success"
        self.intents: list[tuple[str, list[str]]] = []
        if installed:
            self.files[BASE_APK] = (b"PK\x03\x04 the installed app", 0o644)

    @property
    def installed(self) -> bool:
        return BASE_APK in self.files

    def text(self, name: str) -> str:
        return self.files.get(f"{WD}/{name}", (b"", 0))[0].decode()

    def write(self, name: str, text: str) -> None:
        self.files[f"{WD}/{name}"] = (text.encode(), 0o660)

    def finish(self, status: int) -> None:
        """The run ends by itself with `status` (the process stays, as Android keeps it cached)."""
        self.write("runner.out", self.text("runner.out") + '{"event": "done"}\n')
        self.write("runner.exit", f"{status}\n")

    def _process(self) -> int:
        if self.pid is None:
            self.pid, self.next_pid = self.next_pid, self.next_pid + 1
        return self.pid

    def _am(self, args: list[str]) -> str:
        action = args[args.index("-a") + 1]
        assert args[:4] == ["am", "start-foreground-service", "-n", "com.zerolock.zl/.RunnerService"], args
        self.intents.append((action, args[args.index("-a") + 2:]))
        if not self.installed:
            return AM_OK.replace("{action}", action) + "\nError: Not found; no service started."
        if self.am_error:
            return AM_OK.replace("{action}", action) + "\n" + self.am_error
        if not self.answers:
            return AM_OK.replace("{action}", action)
        if action == zapp.ACTION_PREPARE:
            self._process()
            self.write("app.json", json.dumps({"package": "com.zerolock.zl", "version_name": self.version,
                                               "version_code": 1, "files_dir": "/storage/emulated/0/Android/data/"
                                               "com.zerolock.zl/files"}))
        elif action == zapp.ACTION_START:
            extras = args[args.index("-a") + 2:]
            assert extras[0:2] == ["--es", "config"] and extras[3:5] == ["--ez", "resume"], extras
            self.files.pop(f"{WD}/runner.exit", None)
            self.write("runner.pid", f"{self._process()}\n")
            self.write("runner.out", self.text("runner.out") + json.dumps(
                {"event": "listening", "port": 7101, "config": extras[2], "resume": extras[5] == "true"}) + "\n")
        elif action == zapp.ACTION_STOP:
            if self.pid is not None and not self.text("runner.exit"):
                self.write("runner.exit", "3\n")
        return AM_OK.replace("{action}", action)

    def _status(self) -> str:
        if not any(p.startswith(WD + "/") for p in self.files):
            return ""  # `cd` failed: no workdir
        alive = str(self.pid) if self.pid is not None else ""
        return (f"exit={self.text('runner.exit').strip()}\npid={self.text('runner.pid').strip()}\n"
                f"alive={alive}")

    def shell(self, command, timeout=None):
        self.calls.append(("shell", command))
        if command.startswith("getprop"):
            return "\n".join(self.props)
        if command.startswith(f"cd {WD} 2>/dev/null || exit 0; echo \"exit="):
            return self._status()
        if command.endswith("./zl_runner --version 2>/dev/null"):  # `zl devices` asks binary mode's runner
            return ""  # this phone runs the app; /data/local/tmp/zerolock holds no zl_runner
        args = shlex.split(command.replace(" 2>/dev/null", "").replace(" 2>&1", "").replace(" | ", " | "))
        match args:
            case ["am", "start-foreground-service", *_]:
                return self._am(args)
            case ["am", "force-stop", "com.zerolock.zl"]:
                self.pid = None
                return ""
            case ["pm", "path", "com.zerolock.zl"]:
                return f"package:{BASE_APK}" if self.installed else ""
            case ["pm", "install", "-r", "-t", "-g", path]:
                if self.install_output == "Success":
                    self.files[BASE_APK] = self.files[path]
                    self.pid = None  # installing stops the app
                return self.install_output
            case ["dumpsys", "meminfo", "com.zerolock.zl"]:
                return MEMINFO_NEW if self.pid is not None else "No process found for: com.zerolock.zl"
            case ["dumpsys", "package", "com.zerolock.zl", "|", "grep", "versionName"]:
                return f"    versionName={self.version}" if self.installed else ""
            case ["dumpsys", "battery"]:
                return DUMPSYS_BATTERY
            case ["df", "-k", *_]:
                return DF_TOYBOX
            case ["cat", path]:
                return self.files.get(path, (b"", 0))[0].decode()
            case ["stat", "-c", "%s", path]:
                return str(len(self.files[path][0])) if path in self.files else ""
            case ["sha256sum", path]:
                return f"{hashlib.sha256(self.files[path][0]).hexdigest()}  {path}" if path in self.files else ""
            case ["mkdir", "-p", _]:
                return ""
            case ["mv", "-f", src, dst]:
                self.files[dst] = self.files.pop(src)
                return ""
            case ["rm", "-f" | "-rf", *paths]:
                for path in paths:
                    for p in [p for p in self.files if p == path or p.startswith(path.rstrip("/") + "/")]:
                        del self.files[p]
                return ""
        raise AssertionError(f"FakeAppPhone: unexpected shell command {command!r}")

    def shell_commands(self, prefix: str) -> list[str]:
        return [c[1] for c in self.calls if c[0] == "shell" and c[1].startswith(prefix)]


def app_device(phone: FakeAppPhone) -> zapp.AppDevice:
    return zapp.AppDevice(phone.serial, FakeClient({phone.serial: phone}))


@pytest.fixture()
def fast(monkeypatch):
    """Short waits for the app (the real ones are 15 s)."""
    monkeypatch.setattr(zapp, "_START_TIMEOUT_S", 0.3)
    monkeypatch.setattr(zapp, "_PREPARE_TIMEOUT_S", 0.3)
    monkeypatch.setattr(zapp, "_POLL_S", 0.02)


def fake_apk(path: Path, body: bytes = b"the app") -> Path:
    path.write_bytes(b"PK\x03\x04" + body)
    return path


# --- parsing --------------------------------------------------------------------------------------------


def test_parse_meminfo_both_formats_and_other_outputs():
    assert zapp.parse_meminfo_total_pss_kib(MEMINFO_NEW) == 3252800
    assert zapp.parse_meminfo_total_pss_kib(MEMINFO_OLD) == 3145728
    table_only = MEMINFO_OLD.split(" App Summary")[0]  # some vendors print no summary
    assert zapp.parse_meminfo_total_pss_kib(table_only) == 3145728
    summary_only = "           TOTAL PSS:    11620            TOTAL RSS:    39072       TOTAL SWAP PSS:       75\n"
    assert zapp.parse_meminfo_total_pss_kib(summary_only) == 11620
    assert zapp.parse_meminfo_total_pss_kib("No process found for: com.zerolock.zl\n") is None
    assert zapp.parse_meminfo_total_pss_kib("   TOTAL SWAP PSS:   75\n") is None  # not the PSS total
    assert zapp.parse_version_name("    versionName=0.2.1-debug\n    versionName=0.1\n") == "0.2.1-debug"
    assert zapp.parse_version_name("") is None
    splits = f"package:{BASE_APK.replace('base', 'split_config.arm64_v8a')}\npackage:{BASE_APK}\n"
    assert zapp.parse_base_apk(splits) == BASE_APK and zapp.parse_base_apk("") is None


# --- the run ----------------------------------------------------------------------------------------------


def test_app_run_lifecycle_and_exit_codes(fast):
    phone = FakeAppPhone()
    dev = app_device(phone)
    assert dev.workdir == WD and dev.kind == "adb" and not dev.runs_runner_binary
    assert not dev.is_running() and dev.exit_code() is None and dev.pss_mib() is None  # never started
    assert dev.signal_runner(signal.SIGTERM) is False
    phone.write("stage_1.json", "{}")  # the config only: the app needs no zl_runner on the phone

    dev.start_runner("stage_1.json", resume=True)
    assert phone.intents[-1] == (zapp.ACTION_START, ["--es", "config", f"{WD}/stage_1.json", "--ez", "resume", "true"])
    assert phone.shell_commands("am start-foreground-service")[-1] == (
        "am start-foreground-service -n com.zerolock.zl/.RunnerService -a com.zerolock.zl.action.START "
        f"--es config {WD}/stage_1.json --ez resume true 2>&1")
    assert dev.is_running() and dev.exit_code() is None
    assert json.loads(dev.runner_output()) == {"event": "listening", "port": 7101, "config": f"{WD}/stage_1.json",
                                               "resume": True}
    assert dev.pss_mib() == 3252800 / 1024 and dev.temperature_c() == 31.2
    assert dev.free_bytes() == 54730432 * 1024
    with pytest.raises(ZLError, match=r"phone P1: the app is already running a stage \(pid 5000\); stop it first"):
        dev.start_runner("stage_1.json")

    phone.finish(0)  # done: runner.exit 0, the process stays
    assert not dev.is_running() and dev.exit_code() == 0 and dev.pss_mib() is None

    dev.start_runner("stage_1.json")  # the last run's runner.exit is cleared before START
    assert phone.shell_commands("rm -f")[-1] == f"rm -f {WD}/runner.pid {WD}/runner.exit"
    assert dev.is_running() and dev.exit_code() is None
    assert json.loads(dev.runner_output())["resume"] is False  # only this start's output
    assert dev.stop_runner(timeout_s=5) == 3  # STOP: the runner's "stopped" status
    assert phone.intents[-1] == (zapp.ACTION_STOP, []) and phone.pid == 5000

    dev.start_runner("stage_1.json")
    assert dev.kill_runner(timeout_s=5) == -9  # force-stop: the process is gone without a runner.exit
    assert phone.shell_commands("am force-stop") == ["am force-stop com.zerolock.zl"]
    assert not dev.is_running() and not phone.text("runner.exit")

    dev.start_runner("stage_1.json", resume=True)  # a new process after the kill
    assert dev.is_running() and phone.text("runner.pid").strip() == "5001"
    phone.pid = 6000  # the app died and was started again by someone else: not our run
    assert not dev.is_running() and dev.exit_code() == -9
    with pytest.raises(ZLError, match="cannot send signal 10 to the app; .*SIGTERM/SIGINT .* SIGKILL"):
        dev.signal_runner(signal.SIGUSR1)
    assert not any("zl_runner" in c[1] for c in phone.calls)


def test_stop_that_does_not_stop_ends_in_force_stop(fast):
    phone = FakeAppPhone()
    dev = app_device(phone)
    phone.write("stage_0.json", "{}")
    dev.start_runner("stage_0.json")
    phone.answers = False  # STOP arrives but the stage never checks it
    assert dev.stop_runner(timeout_s=0.3) == -9
    assert phone.shell_commands("am force-stop") == ["am force-stop com.zerolock.zl"]


def test_start_errors_name_the_phone_and_the_fix(fast):
    phone = FakeAppPhone()
    dev = app_device(phone)
    with pytest.raises(ZLError, match=rf"phone P1: {WD}/stage_0.json does not exist; run `zl deploy --mode app`"):
        dev.start_runner("stage_0.json")

    phone.write("stage_0.json", "{}")
    phone.write("runner.err", "stage config /sdcard/x.json: not_found: config: cannot open\n")
    phone.answers = False  # the service never writes runner.pid
    with pytest.raises(ZLError, match=r"phone P1: the app did not start the stage within 0 s \(no runner.pid\); "
                                      r"runner.err: .*not_found.*open the app once and see "
                                      r"`adb -s P1 logcat -s zl zl.RunnerService`"):
        dev.start_runner("stage_0.json")

    phone.answers = True
    phone.files.pop(BASE_APK)  # am: "Error: Not found; no service started." with exit status 0
    with pytest.raises(ZLError, match=r"phone P1: `am start-foreground-service -n com.zerolock.zl/.RunnerService "
                                      r"-a com.zerolock.zl.action.START .*` failed: Error: Not found; no service "
                                      r"started.; the app com.zerolock.zl is not installed; `zl deploy --mode app` "
                                      r"installs it"):
        dev.start_runner("stage_0.json")

    phone.files[BASE_APK] = (b"PK", 0o644)
    phone.am_error = ("Error: java.lang.SecurityException: Permission Denial: Accessing service "
                      "com.zerolock.zl/.RunnerService requires android.permission.DUMP")
    with pytest.raises(ZLError, match=r"action.START .*` failed: Error: java.lang.SecurityException: Permission "
                                      r"Denial.*; reinstall the app with `zl deploy --mode app --force`"):
        dev.start_runner("stage_0.json")
    assert not dev.is_running()


@pytest.mark.parametrize("shell", ["sh", "mksh"])  # mksh is Android's /system/bin/sh
def test_status_line_under_a_posix_shell(tmp_path, shell):
    """The exact status line, run by this host's shell with a stand-in `pidof`: exit, pid and liveness."""
    if shutil.which(shell) is None:
        pytest.skip(f"{shell} not installed (apt install {shell})")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "pidof").write_text('#!/bin/sh\n[ "$1" = com.zerolock.zl ] && echo "4242 77" && exit 0\nexit 1\n')
    (bin_dir / "pidof").chmod(0o755)

    class HostShell(FakePhone):
        def shell(self, command, timeout=None):
            env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
            return subprocess.run([shell, "-c", command], env=env, capture_output=True, text=True, timeout=10).stdout

    work = tmp_path / "files dir"  # a space: the workdir is quoted
    dev = zapp.AppDevice("P1", FakeClient({"P1": HostShell("P1")}), workdir=str(work))
    assert not dev.is_running() and dev.exit_code() is None  # no workdir yet
    work.mkdir()
    assert not dev.is_running() and dev.exit_code() is None  # never started
    (work / "runner.pid").write_text("4242\n")
    assert dev.is_running() and dev.exit_code() is None
    (work / "runner.pid").write_text("424\n")  # a prefix of a live pid is not that pid
    assert not dev.is_running() and dev.exit_code() == -9
    (work / "runner.exit").write_text("3\n")
    assert not dev.is_running() and dev.exit_code() == 3
    (work / "runner.pid").write_text("77\n")
    assert not dev.is_running() and dev.exit_code() == 3  # runner.exit wins over a live process


# --- deploy ---------------------------------------------------------------------------------------------


def test_deploy_installs_the_app_once_and_pushes_no_runner(tmp_path, monkeypatch, fast):
    export, configs = make_export(tmp_path, stages=1), make_configs(tmp_path, stages=1)
    apk = fake_apk(tmp_path / "app-debug.apk")
    monkeypatch.setenv("ZL_ANDROID_APK", str(apk))
    monkeypatch.setenv("ZL_ANDROID_RUNNER", str(tmp_path / "not-built" / "zl_runner"))  # app mode needs none
    phone, spare = FakeAppPhone("P1", installed=False), FakeAppPhone("P2")
    devs = open_devices("P1,P2", client=FakeClient({"P1": phone, "P2": spare}), mode="app")
    assert [type(d) for d in devs] == [zapp.AppDevice, zapp.AppDevice] and devs[0].workdir == WD
    files = []
    results = zdeploy.deploy(devs, export, configs, on_file=lambda *a: files.append(a))

    assert results[0].runtime == zdeploy.RuntimeInstall("app com.zerolock.zl 0.1.0", True, apk.stat().st_size)
    # The run key stays off the shared files folder: START carries it into the app's private storage.
    assert sorted(results[0].pushed) == ["manifest.json", "stage_0.json", "stage_0.pte", "train.safetensors"]
    assert not any(p.endswith("run.key") for p in phone.files) and devs[0]._run_key == "5a" * 32
    assert json.loads(phone.text("stage_0.json"))["run_key_file"] == "run.key"
    assert phone.files[BASE_APK][0] == apk.read_bytes()  # installed, and the staged copy removed
    assert phone.shell_commands("pm install") == ["pm install -r -t -g /data/local/tmp/com.zerolock.zl.apk 2>&1"]
    assert not any("com.zerolock.zl.apk" in p for p in phone.files)
    assert phone.intents[0] == (zapp.ACTION_PREPARE, [])  # before any push: the app makes its folder
    first_push = next(i for i, c in enumerate(phone.calls) if c[0] == "push" and c[1].startswith(WD))
    assert phone.calls.index(("shell", phone.shell_commands("am start-foreground-service")[0])) < first_push
    assert json.loads(phone.text("stage_0.json"))["program"] == "stage_0.pte"
    assert not any("zl_runner" in p for p in phone.files)
    assert ("P1", "app-debug.apk", apk.stat().st_size, False) in files
    # The spare had some other build of the app: it gets this one and the manifest.
    assert results[1].stage is None and results[1].pushed == ["manifest.json"] and results[1].runtime.installed
    assert spare.files[BASE_APK][0] == apk.read_bytes()

    again = zdeploy.deploy(devs, export, configs)
    assert [r.runtime.installed for r in again] == [False, False]  # same sha256: no second install
    assert again[0].unchanged == ["stage_0.pte"] and again[0].runtime.bytes_pushed == 0
    assert len(phone.shell_commands("pm install")) == 1 and len(phone.intents) == 2  # PREPARE again, to check
    assert zdeploy.deploy_stage(devs[0], export, 0, force=True).runtime.installed
    fake_apk(apk, b"a new build")
    assert zdeploy.deploy_stage(devs[0], export, 0).runtime.installed
    assert phone.files[BASE_APK][0] == apk.read_bytes() and len(phone.shell_commands("pm install")) == 3
    with pytest.raises(ZLError, match=r"--runner .*P1 runs its stage in the app \(--mode app\).*drop --runner"):
        zdeploy.deploy_stage(devs[0], export, 0, runner=apk)


def test_deploy_apk_and_install_errors(tmp_path, monkeypatch, fast):
    export = make_export(tmp_path, stages=1)
    phone = FakeAppPhone("P1", installed=False)
    dev = app_device(phone)
    monkeypatch.delenv("ZL_ANDROID_APK", raising=False)
    monkeypatch.setattr(zapp, "DEFAULT_APK", tmp_path / "outputs" / "apk" / "debug" / "app-debug.apk")
    with pytest.raises(ZLError, match=r"outputs/apk/debug/app-debug.apk: the app's APK is not built; build it with "
                                      r"`tools/build_android.sh --apk-only` \(see android_app/README.md\), or set ZL_ANDROID_APK"):
        zdeploy.deploy_stage(dev, export, 0)
    elf = tmp_path / "not.apk"
    elf.write_bytes(b"\x7fELF")
    monkeypatch.setenv("ZL_ANDROID_APK", str(elf))
    with pytest.raises(ZLError, match=r"not.apk is not an APK \(no zip header, starts with b'\\x7fE'\)"):
        zdeploy.deploy_stage(dev, export, 0)
    assert not phone.shell_commands("pm")  # nothing reached the phone

    monkeypatch.setenv("ZL_ANDROID_APK", str(fake_apk(tmp_path / "app.apk")))
    phone.install_output = ("Failure [INSTALL_FAILED_UPDATE_INCOMPATIBLE: Package com.zerolock.zl signatures do "
                            "not match previously installed version; ignoring!]")
    with pytest.raises(ZLError, match=r"phone P1: installing .*app.apk failed: Failure \[INSTALL_FAILED_UPDATE_"
                                      r"INCOMPATIBLE.*; an app com.zerolock.zl signed with another key is installed; "
                                      r"uninstall it with `adb -s P1 uninstall com.zerolock.zl`"):
        zdeploy.deploy_stage(dev, export, 0)
    assert not any("com.zerolock.zl.apk" in p for p in phone.files)  # the staged APK is removed anyway

    phone.install_output, phone.answers = "Success", False  # installed, but the service never answers PREPARE
    with pytest.raises(ZLError, match=r"phone P1: the app com.zerolock.zl did not write .*/files/app.json within 0 s "
                                      r"of com.zerolock.zl.action.PREPARE; open the app once .*"
                                      r"`adb -s P1 logcat -s zl zl.RunnerService`"):
        zdeploy.deploy_stage(dev, export, 0)


# --- --mode -----------------------------------------------------------------------------------------------


def test_mode_option_values_and_local_devices(tmp_path):
    client = FakeClient({"P1": FakeAppPhone("P1")})
    assert type(open_devices("P1", client=client)[0]) is zadb.AdbDevice  # binary stays the default
    assert open_devices("P1", client=client, mode="binary")[0].workdir == "/data/local/tmp/zerolock"
    with pytest.raises(ZLError, match=r"--mode app needs phones; local devices run the host binary"):
        open_devices("local:2", tmp_path, mode="app")
    with pytest.raises(ZLError, match=r"--mode 'apk': expected one of binary, app"):
        open_devices("P1", client=client, mode="apk")


def test_train_refuses_app_mode_on_local_devices_before_exporting(tmp_path):
    from zl_device.run.train_job import run_training
    from zl_device.run.train_settings import TrainSettings
    from zl_export.options import ModelSplit

    settings = TrainSettings(split=ModelSplit("no-such-model"), devices="local:3", mode="app", out=tmp_path / "run")
    with pytest.raises(ZLError, match="--mode app needs phones"):
        run_training(settings, say=lambda line: None)
    assert not (tmp_path / "run").exists()


def test_cli_mode_option(tmp_path, monkeypatch, fast):
    from zl.commands import train as train_cli

    app = cli_app()
    for command in ("deploy", "pull"):
        result = CliRunner().invoke(app, [command, "--help"], terminal_width=200)
        assert result.exit_code == 0 and "--mode" in result.stdout, result.stdout
    assert "com.zerolock.zl" in CliRunner().invoke(app, ["deploy", "--help"], terminal_width=200).stdout
    train_app = typer.Typer()
    train_app.command("train")(train_cli.train_command)
    train_app.command("other")(lambda: None)  # two commands: `train --help` is the train command's help
    result = CliRunner().invoke(train_app, ["train", "--help"], terminal_width=200)
    assert result.exit_code == 0 and "--mode" in result.stdout and "--mode app" in result.stdout

    export, configs = make_export(tmp_path, stages=1), make_configs(tmp_path, stages=1)
    result = CliRunner().invoke(app, ["deploy", "--devices", "local:1", "--mode", "app", "--export", str(export),
                                      "--run-dir", str(tmp_path / "run")])
    assert isinstance(result.exception, ZLError) and "--mode app needs phones" in str(result.exception)
    result = CliRunner().invoke(app, ["pull", "--devices", "local:1", "--mode", "app", "--out", str(tmp_path)])
    assert isinstance(result.exception, ZLError) and "--mode app needs phones" in str(result.exception)

    phone = FakeAppPhone("P1", installed=False)
    monkeypatch.setattr(zadb, "connect", lambda start=True: FakeClient({"P1": phone}))
    monkeypatch.setenv("ZL_ANDROID_APK", str(fake_apk(tmp_path / "app-debug.apk")))
    result = CliRunner().invoke(app, ["deploy", "--devices", "P1", "--mode", "app", "--export", str(export),
                                      "--configs", str(configs)])
    assert result.exit_code == 0, result.output
    assert "P1: stage 0: pushed 4 files" in result.stdout and "app com.zerolock.zl 0.1.0 installed" in result.stdout
    phone.write("ckpt/window_1/adapter.safetensors", "w1")
    phone.write("metrics.jsonl", '{"stage": 0}\n')
    result = CliRunner().invoke(app, ["pull", "--devices", "P1", "--mode", "app", "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "logs" / "P1" / "metrics.jsonl").read_text() == '{"stage": 0}\n'
    assert (tmp_path / "out" / "checkpoints" / "stage_0" / "window_1" / "adapter.safetensors").read_text() == "w1"


def test_cli_devices_shows_the_app_version(monkeypatch):
    with_app, without = FakeAppPhone("P1"), FakeAppPhone("P2", installed=False)
    with_app.version = "0.3.0"
    monkeypatch.setattr(zadb, "connect", lambda start=True: FakeClient({"P1": with_app, "P2": without}))
    result = CliRunner().invoke(cli_app(), ["devices", "--json"])
    assert result.exit_code == 0, result.output
    assert {r["name"]: r["app"] for r in map(json.loads, result.stdout.splitlines())} == {
        "local": "", "P1": "0.3.0", "P2": ""}
    result = CliRunner().invoke(cli_app(), ["devices"], terminal_width=200)
    assert result.exit_code == 0 and "0.3.0" in result.stdout and " app " in result.stdout


# --- with a phone -----------------------------------------------------------------------------------------


@pytest.fixture()
def app_phone():
    """The attached phone in app mode, with the app installed from the built APK and prepared.

    Its workdir is a subfolder of the app's files folder: a test must not clobber a deployment there.
    """
    serial = os.environ.get("ZL_TEST_SERIAL")
    if not serial:
        pytest.skip("set ZL_TEST_SERIAL to an attached phone's serial (and build the APK: tools/build_android.sh)")
    dev = open_phone(serial, mode="app")
    dev.install_runtime()  # fails with the build command when the APK is not built
    dev.workdir = f"{zapp.APP_WORKDIR}/zl-test"
    yield dev
    if dev.is_running():
        dev.kill_runner()
    dev.shell(f"rm -rf {dev.workdir}")


@pytest.mark.device
def test_real_phone_app_refuses_a_bad_config_with_exit_2(app_phone):
    """START reaches the app, the native session parses the config and leaves runner.pid/.err/.exit 2."""
    app_phone.write_text("bad.json", "{}")
    app_phone.start_runner("bad.json")
    assert app_phone.wait(30) and app_phone.exit_code() == 2
    assert "required" in (app_phone.read_text("runner.err") or "")


@pytest.mark.device
def test_real_phone_app_runs_stops_and_is_force_stopped(app_phone, tmp_path):
    """The last stage of a real export loads in the app and waits for input: running, PSS, listening event;
    STOP ends it with exit 3, a force-stop with -9, and a restart resumes."""
    from test_runner import RUN_KEY, export_programs

    export = export_programs(tmp_path / "export", 3)
    for name in ("manifest.json", "stage_2.pte"):
        app_phone.push(export / name, name)
    app_phone.write_text("run.key", RUN_KEY + "\n")
    app_phone.write_text("stage_2.json", json.dumps({
        "program": "stage_2.pte", "stage_index": 2, "num_stages": 3, "listen": "127.0.0.1:0",
        "input_timeout_s": 0, "run_key_file": "run.key", "run_id": "00112233445566778899aabbccddeeff",
        "window_size": 1, "num_micro_batches": 2, "checkpoint_dir": "ckpt", "log_path": "metrics.jsonl"}))
    app_phone.start_runner("stage_2.json")
    deadline = time.monotonic() + 60
    while '"listening"' not in app_phone.runner_output():
        assert app_phone.is_running() and time.monotonic() < deadline, app_phone.read_text("runner.err")
        time.sleep(0.5)
    assert app_phone.pss_mib() is not None
    assert app_phone.stop_runner(timeout_s=30) == 3
    app_phone.start_runner("stage_2.json", resume=True)
    assert app_phone.kill_runner() == -9
