"""Device backends, part 2: adb through a fake adbutils client and a real offline adb server, the address
plan for Wi-Fi and USB-only phones, and (marked `device`) a real phone.

    .venv/bin/python -m pytest tests/test_devices_adb.py
    ZL_TEST_SERIAL=R58M123 .venv/bin/python -m pytest tests/test_devices_adb.py -m device   # with a phone

Tests that start an adb server use a free port of their own (ANDROID_ADB_SERVER_PORT), never the user's
5037, and kill that server when done.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from test_devices import WAIT_S, cli_app, dummy, free_port, make_configs, make_export  # noqa: F401 (dummy: fixture)
from zl_base.errors import ZLError
from zl_device.devices import adb as zadb
from zl_device.devices import deploy as zdeploy
from zl_device.devices.backend import signal_exit_code
from zl_device.devices.registry import open_devices, open_phone
from zl_device.devices.network import apply_tunnels, plan_addresses


# --- address plan ---------------------------------------------------------------------------------------


@dataclass
class FakeEndpoint:
    name: str
    kind: str = "adb"
    ip: str | None = None

    def address(self):
        return self.ip

    def __post_init__(self):
        self.calls = []

    def forward(self, host_port, device_port):
        self.calls.append(("forward", host_port, device_port))

    def reverse(self, device_port, host_port):
        self.calls.append(("reverse", device_port, host_port))


def test_usb_plan_tunnels_each_link_through_the_host():
    phones = [FakeEndpoint("A"), FakeEndpoint("B"), FakeEndpoint("C")]
    plan = plan_addresses(phones, mode="usb", stage_port=7100, host_port=7200, coordinator_port=7099)
    assert plan.mode == "usb"
    assert [s.config_fields() for s in plan.stages] == [
        {"downstream": "127.0.0.1:7101", "coordinator": "127.0.0.1:7099"},
        {"listen": "127.0.0.1:7101", "downstream": "127.0.0.1:7102", "coordinator": "127.0.0.1:7099"},
        {"listen": "127.0.0.1:7102", "coordinator": "127.0.0.1:7099"},
    ]
    assert [t.command() for t in plan.tunnels] == [
        "adb -s B forward tcp:7201 tcp:7101",  # host 7201 -> B's listening stage 1
        "adb -s A reverse tcp:7101 tcp:7201",  # A's 127.0.0.1:7101 -> host 7201
        "adb -s C forward tcp:7202 tcp:7102",
        "adb -s B reverse tcp:7102 tcp:7202",
        "adb -s A reverse tcp:7099 tcp:7099",  # the coordinator on the host, seen from every phone
        "adb -s B reverse tcp:7099 tcp:7099",
        "adb -s C reverse tcp:7099 tcp:7099",
    ]
    apply_tunnels(plan, phones)
    assert phones[0].calls == [("reverse", 7101, 7201), ("reverse", 7099, 7099)]
    assert phones[1].calls == [("forward", 7201, 7101), ("reverse", 7102, 7202), ("reverse", 7099, 7099)]


def test_usb_plan_two_stages_on_one_phone_talk_directly():
    phones = [FakeEndpoint("A"), FakeEndpoint("A"), FakeEndpoint("B")]
    plan = plan_addresses(phones, mode="usb", coordinator_port=None)
    assert plan.stages[0].downstream == "127.0.0.1:7101" and plan.stages[0].coordinator == ""
    assert [t.command() for t in plan.tunnels] == ["adb -s B forward tcp:7202 tcp:7102",
                                                   "adb -s A reverse tcp:7102 tcp:7202"]


def test_wifi_plan_and_auto_fallback():
    phones = [FakeEndpoint("A", ip="192.168.1.10"), FakeEndpoint("B", ip="192.168.1.11")]
    plan = plan_addresses(phones, mode="auto", host_ip="192.168.1.2")
    assert plan.mode == "wifi" and plan.tunnels == ()
    assert plan.stages[0].config_fields() == {"downstream": "192.168.1.11:7101", "coordinator": "192.168.1.2:7099"}
    assert plan.stages[1].listen == "0.0.0.0:7101"
    phones[1].ip = None
    assert plan_addresses(phones, mode="auto").mode == "usb"
    with pytest.raises(ZLError, match="B have no Wi-Fi address"):
        plan_addresses(phones, mode="wifi", host_ip="192.168.1.2")


def test_local_plan_and_plan_errors():
    local = [FakeEndpoint(f"local-{i}", kind="local") for i in range(2)]
    plan = plan_addresses(local, stage_port=9000, coordinator_port=8999)
    assert plan.mode == "local"
    assert plan.stages[1].config_fields() == {"listen": "127.0.0.1:9001", "coordinator": "127.0.0.1:8999"}
    with pytest.raises(ZLError, match="mix kinds"):
        plan_addresses([local[0], FakeEndpoint("A")])
    with pytest.raises(ZLError, match="collides"):
        plan_addresses(local, stage_port=9000, coordinator_port=9001)
    with pytest.raises(ZLError, match="applies to phones"):
        plan_addresses(local, mode="usb")
    with pytest.raises(ZLError, match="expected one of"):
        plan_addresses(local, mode="bluetooth")


# --- adb with a fake adbutils client --------------------------------------------------------------------

# `adb shell dumpsys battery` on a Pixel 6 (Android 14), charging over USB.
DUMPSYS_BATTERY = """Current Battery Service state:
  AC powered: false
  USB powered: true
  Wireless powered: false
  Dock powered: false
  Max charging current: 500000
  Max charging voltage: 5000000
  Charge counter: 3474000
  status: 2
  health: 2
  present: true
  level: 78
  scale: 100
  voltage: 4123
  temperature: 312
  technology: Li-ion
  Capacity level: 3
"""

# toybox `df -k /data/local/tmp` (Android 13); the second sample wraps a long device name like busybox.
DF_TOYBOX = """Filesystem      1K-blocks     Used Available Use% Mounted on
/dev/block/dm-48 115249236 60387732  54730432  53% /data
"""
DF_WRAPPED = """Filesystem           1K-blocks      Used Available Use% Mounted on
/dev/block/bootdevice/by-name/userdata
                      25671908  24999908    672000  97% /data
"""

IP_ADDR = """30: wlan0: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc mq state UP group default qlen 3000
    inet 192.168.1.23/24 brd 192.168.1.255 scope global wlan0
       valid_lft forever preferred_lft forever
"""


def test_parse_real_device_outputs():
    assert zadb.parse_battery_temperature(DUMPSYS_BATTERY) == 31.2
    assert zadb.parse_battery_temperature("  level: 50\n") is None
    assert zadb.parse_battery_temperature("  temperature: 9999\n") is None  # 999.9 °C: a broken sensor
    assert zadb.parse_df_available(DF_TOYBOX) == 54730432 * 1024
    assert zadb.parse_df_available(DF_WRAPPED) == 672000 * 1024
    assert zadb.parse_df_available("df: /nope: No such file or directory") is None
    assert zadb.parse_wifi_ip(IP_ADDR) == "192.168.1.23" and zadb.parse_wifi_ip("") is None


@dataclass
class Entry:
    serial: str
    state: str


@dataclass
class FileInfo:
    mode: int
    size: int
    mtime: object
    path: str


class FakeSync:
    def __init__(self, phone):
        self.phone = phone

    def push(self, src, dst, mode=0o755, check=False):
        data = src if isinstance(src, bytes) else b"".join(iter(lambda: src.read(4096), b""))
        self.phone.files[dst] = (data, mode)
        self.phone.calls.append(("push", dst, oct(mode)))
        return len(data)

    def stat(self, path):
        if path in self.phone.files:
            return FileInfo(stat.S_IFREG | 0o644, len(self.phone.files[path][0]), None, path)
        if any(p.startswith(path.rstrip("/") + "/") for p in self.phone.files):
            return FileInfo(stat.S_IFDIR | 0o755, 0, None, path)
        return FileInfo(0, 0, None, path)

    def iter_directory(self, path):
        prefix = path.rstrip("/") + "/"
        names = {p[len(prefix):].split("/")[0] for p in self.phone.files if p.startswith(prefix)}
        for name in sorted(names):
            yield FileInfo(self.stat(prefix + name).mode, 0, None, name)

    def pull_file(self, src, dst):
        Path(dst).write_bytes(self.phone.files[src][0])
        return len(self.phone.files[src][0])

    def read_text(self, path):
        return self.phone.files[path][0].decode()


class FakePhone:
    """An adbutils AdbDevice stand-in: records shell commands, answers from `responses` (regex -> text)."""

    def __init__(self, serial, props=("Pixel 6", "arm64-v8a", "arm64-v8a,armeabi-v7a,armeabi", "14")):
        self.serial, self.props = serial, props
        self.calls, self.files, self.responses = [], {}, {}
        self.sync = FakeSync(self)

    def shell(self, command, timeout=None):
        self.calls.append(("shell", command))
        if command.startswith("getprop"):
            return "\n".join(self.props)
        for pattern, answer in self.responses.items():
            if re.search(pattern, command):
                return answer(command) if callable(answer) else answer
        return ""

    def forward(self, local, remote):
        self.calls.append(("forward", local, remote))

    def reverse(self, remote, local):
        self.calls.append(("reverse", remote, local))


class FakeClient:
    def __init__(self, phones: dict[str, FakePhone], states: dict[str, str] | None = None):
        self.phones = phones
        self.states = states or {s: "device" for s in phones}

    def list(self):
        return [Entry(s, st) for s, st in self.states.items()]

    def device(self, serial):
        return self.phones[serial]


def test_list_and_open_phones_with_clear_errors():
    client = FakeClient({"P1": FakePhone("P1"), "P2": FakePhone("P2", ("Galaxy J2", "armeabi-v7a", "armeabi-v7a", "7"))},
                        {"P1": "device", "P2": "device", "P3": "unauthorized", "P4": "offline"})
    rows = {r.name: r for r in zadb.list_phones(client)}
    assert (rows["P1"].state, rows["P1"].model, rows["P1"].abi, rows["P1"].android) == ("ready", "Pixel 6",
                                                                                         "arm64-v8a", "14")
    assert rows["P2"].state == "unsupported" and "armeabi-v7a" in rows["P2"].note
    assert rows["P3"].state == "unauthorized" and "Allow USB debugging" in rows["P3"].note
    assert rows["P4"].state == "offline"

    assert open_phone("P1", client).info().model == "Pixel 6"
    with pytest.raises(ZLError, match=r"phone XYZ not found: the adb server sees P1 \(device\), P2 \(device\)"):
        open_phone("XYZ", client)
    with pytest.raises(ZLError, match="phone P3 is unauthorized: unlock the phone and accept"):
        open_phone("P3", client)
    with pytest.raises(ZLError, match="phone P4 is offline: unplug and replug"):
        open_phone("P4", client)
    with pytest.raises(ZLError, match=r"phone P2 \(Galaxy J2\) has ABI armeabi-v7a .* built for arm64-v8a"):
        open_phone("P2", client)
    assert open_phone("P2", client, check_abi=False).serial == "P2"
    devs = open_devices("P1", client=client, link_profile="mobile")
    assert devs[0].kind == "adb" and devs[0].link_profile == "mobile" and devs[0].workdir == "/data/local/tmp/zerolock"


def wait_for_file(path: Path, timeout_s: float = WAIT_S) -> str:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    return path.read_text().strip()


@pytest.mark.parametrize("shell", ["sh", "dash", "bash", "mksh", "busybox"])  # mksh: Android's /system/bin/sh
def test_adb_start_command_runs_under_a_posix_shell(tmp_path, shell):
    """The exact line sent over `adb shell`, run by this host's shell in a stand-in workdir (quoting, pid, status)."""
    host = ShellPhone("P1", shell, tmp_path / "bin")  # skips when the shell is not installed
    dev = zadb.AdbDevice("P1", FakeClient({"P1": FakePhone("P1")}), workdir=str(tmp_path))
    runner = tmp_path / "zl_runner"
    runner.write_text('#!/bin/sh\necho "args: $*"\necho oops >&2\n[ "$2" = sleep.json ] && exec sleep 60\nexit 3\n')
    runner.chmod(0o755)
    line = dev.start_command("stage 1.json", resume=True)
    assert line.startswith(f"cd {tmp_path} && rm -f runner.pid runner.exit && (nohup sh -c ")
    assert host.shell(line) == ""  # no error from the shell
    assert wait_for_file(tmp_path / "runner.exit") == "3"
    assert (tmp_path / "runner.out").read_text() == "args: --config stage 1.json --resume\n"
    assert (tmp_path / "runner.err").read_text() == "oops\n"
    assert "--resume" not in dev.start_command("stage_1.json")

    assert host.shell(dev.start_command("sleep.json")) == ""
    pid = int(wait_for_file(tmp_path / "runner.pid"))
    try:
        assert not (tmp_path / "runner.exit").exists()  # the previous status was cleared before the start
    finally:
        os.kill(pid, 9)
    assert signal_exit_code(int(wait_for_file(tmp_path / "runner.exit"))) == -9


def test_adb_runner_lifecycle_commands():
    phone = FakePhone("P1")
    dev = zadb.AdbDevice("P1", FakeClient({"P1": phone}))
    # The runner exists, starts and writes its pid; then runs; then was SIGKILLed (status 137).
    phone.files["/data/local/tmp/zerolock/zl_runner"] = (b"\x7fELF", 0o755)
    phone.files["/data/local/tmp/zerolock/stage_1.json"] = (b"{}", 0o644)
    state = {"started": False, "exit": ""}
    phone.responses = {
        r"nohup sh -c": lambda c: state.update(started=True) or "",
        r"^cat /data/local/tmp/zerolock/runner\.pid": lambda c: "4242" if state["started"] else "",
        r"\[ -e runner\.exit \]": lambda c: "running" if state["started"] and not state["exit"] else "",
        r"^cat /data/local/tmp/zerolock/runner\.exit": lambda c: state["exit"],
        r"^kill -9 4242$": lambda c: state.update(exit="137") or "",
        r"^cat /proc/4242/smaps_rollup": "Rss: 4000000 kB\nPss: 3145728 kB\n",
        r"^dumpsys battery$": DUMPSYS_BATTERY,
        r"^df -k /data/local/tmp$": DF_TOYBOX,
    }
    dev.start_runner("stage_1.json", resume=True)
    assert dev.is_running() and dev.exit_code() is None
    assert dev.pss_mib() == 3072.0 and dev.temperature_c() == 31.2 and dev.free_bytes() == 54730432 * 1024
    with pytest.raises(ZLError, match="already running"):
        dev.start_runner("stage_1.json")
    assert dev.kill_runner(timeout_s=5) == -9
    assert ("shell", "kill -9 4242") in phone.calls and not dev.is_running()

    missing = zadb.AdbDevice("P2", FakeClient({"P2": FakePhone("P2")}))
    with pytest.raises(ZLError, match=r"zerolock/zl_runner does not exist; run `zl deploy` first"):
        missing.start_runner("stage_0.json")


# --- hot standby in binary mode (docs/design#hot-standbys) -------------------------------------------------


class HostSync:
    """adbutils' `Sync` on this host's files: a phone whose device paths are host paths."""

    def stat(self, path):
        try:
            st = os.lstat(path)
        except OSError:
            return FileInfo(0, 0, None, path)
        return FileInfo(st.st_mode, st.st_size, None, path)

    def push(self, src, dst, mode=0o755, check=False):
        data = bytes(src) if isinstance(src, (bytes, bytearray)) else b"".join(iter(lambda: src.read(1 << 16), b""))
        Path(dst).parent.mkdir(parents=True, exist_ok=True)
        Path(dst).write_bytes(data)
        os.chmod(dst, mode)
        return len(data)

    def read_text(self, path):
        return Path(path).read_text()


# POSIX shells to run the adb shell lines under: Android's /system/bin/sh is mksh; busybox also stands in for
# toybox's cat, stat, tail, grep, kill (GNU's are used otherwise; Debian's busybox has no nohup).
SHELLS = ("dash", "bash", "mksh", "busybox")
_BUSYBOX_APPLETS = ("sh", "cat", "stat", "tail", "grep", "mv", "rm", "mkdir", "kill", "sleep")


class ShellPhone(FakePhone):
    """A phone whose `adb shell` runs each command in a real POSIX shell on this host, `sh` on its PATH being that
    shell too (the runner's wrapper is `nohup sh -c ...`), and whose files are this host's."""

    def __init__(self, serial, shell: str, bin_dir: Path):
        super().__init__(serial)
        self.sync = HostSync()
        found = shutil.which(shell)
        if found is None:
            pytest.skip(f"{shell} not installed (apt install {shell})")
        bin_dir.mkdir(parents=True, exist_ok=True)
        for name in _BUSYBOX_APPLETS if shell == "busybox" else ("sh",):
            (bin_dir / name).symlink_to(found)
        self.env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
        self.sh = str(bin_dir / "sh")

    def shell(self, command, timeout=None):
        self.calls.append(("shell", command))
        done = subprocess.run([self.sh, "-c", command], env=self.env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout or WAIT_S)
        return done.stdout.decode(errors="replace").rstrip()


def gone(pid: int) -> bool:
    """The process ended (a zombie its wrapper has not reaped yet counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def wait_until(check, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.fixture(params=SHELLS)
def standby_phone(request, tmp_path, dummy):
    """An AdbDevice on a ShellPhone (one per shell) with the dummy runner (tests/test_devices.py) deployed as
    zl_runner and a stage config; every runner and standby it started is killed at the end."""
    phone = ShellPhone("P1", request.param, tmp_path / "bin")
    dev = zadb.AdbDevice("P1", FakeClient({"P1": phone}), workdir=str(tmp_path / "zerolock"))
    runner = tmp_path / "zl_runner"
    # With slow.json it loads for 0.5 s before it blocks SIGUSR1 (a signal then would kill it).
    runner.write_text(f"#!/bin/sh\ncase \"$*\" in *slow.json*) sleep 0.5 ;; esac\nexec {shlex.join(dummy)} \"$@\"\n")
    dev.push(runner, "zl_runner", mode=0o755)
    for name in ("stage_0.json", "slow.json"):
        dev.write_text(name, json.dumps({"stage_index": 0}))
    yield dev, tmp_path / "zerolock"
    pids = tmp_path / "zerolock" / "pids"  # every runner and standby the test started (see `remember`)
    for pid in map(int, pids.read_text().split() if pids.exists() else []):
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)


def listening(dev) -> bool:
    return '"listening"' in dev.runner_output()


def started_runner(dev, wd: Path) -> int:
    dev.start_runner("stage_0.json")
    wait_until(lambda: listening(dev), "the runner never printed its listening event")
    return remember(wd, "runner.pid")


def remember(wd: Path, pid_file: str) -> int:
    """The pid in the pid file, noted for the fixture's cleanup."""
    pid = int(wait_for_file(wd / pid_file))
    with open(wd / "pids", "a") as f:
        f.write(f"{pid}\n")
    return pid


def test_adb_standby_takes_over_only_once_the_runner_is_gone(standby_phone):
    """As test_local_standby_takes_over_only_once_the_runner_is_gone, on a phone in binary mode: real processes
    started by the exact adb shell lines, under each POSIX shell."""
    dev, wd = standby_phone
    assert dev.supports_standby
    assert not dev.has_standby() and not dev.take_over()  # none: the caller starts a runner instead
    started_runner(dev, wd)
    dev.start_standby("stage_0.json")
    standby_pid = remember(wd, "standby.pid")
    assert dev.has_standby()
    with pytest.raises(ZLError, match=rf"phone P1: a standby is already waiting \(pid {standby_pid}\); stop it"):
        dev.start_standby("stage_0.json")
    with pytest.raises(ZLError, match="still running; stop it before its standby takes over"):
        dev.take_over()
    assert dev.kill_runner(timeout_s=WAIT_S) == -9
    assert dev.take_over(timeout_s=WAIT_S)  # waits for its "standby" line if it is still loading
    assert int((wd / "runner.pid").read_text()) == standby_pid and not (wd / "standby.pid").exists()
    assert dev.is_running() and dev.exit_code() is None and not dev.has_standby()
    wait_until(lambda: listening(dev), "the standby never took over")
    # runner_output() shows the new runner's lines only: it got SIGUSR1 and went on as --resume would.
    assert [json.loads(line)["event"] for line in dev.runner_output().splitlines()] == ["took_over", "listening"]
    assert dev.stop_runner(timeout_s=WAIT_S) == 3  # it is the phone's runner now: its status, not the stale -9
    assert (wd / "runner.exit").read_text() == "3\n" and not (wd / "standby.exit").exists()

    dev.start_standby("stage_0.json")  # one that died is no standby
    dead = remember(wd, "standby.pid")
    wait_until(dev._standby_ready, "the standby never got ready")
    os.kill(dead, signal.SIGKILL)
    assert signal_exit_code(int(wait_for_file(wd / "standby.exit"))) == -9  # its own status file, not runner.exit
    assert (wd / "runner.exit").read_text() == "3\n" and not dev.has_standby()
    assert not dev.take_over(timeout_s=WAIT_S) and not (wd / "standby.pid").exists()
    assert dev.exit_code() == 3

    dev.start_standby("stage_0.json")  # one a previous zl train left: found by its pid file
    left = remember(wd, "standby.pid")
    zadb.AdbDevice("P1", dev.client, workdir=dev.workdir).stop_standby()
    wait_until(lambda: gone(left), "stop_standby did not kill the standby a previous AdbDevice started")
    assert not (wd / "standby.pid").exists() and not dev.has_standby()
    time.sleep(0.2)  # its wrapper is gone too: no status, no pid file names it any more
    assert not (wd / "standby.exit").exists() and (wd / "runner.exit").read_text() == "3\n"

    dev.start_standby("slow.json")  # still loading: take_over waits for it, up to its timeout
    slow = remember(wd, "standby.pid")
    assert dev.has_standby() and not dev._standby_ready()
    assert not dev.take_over(timeout_s=0.1)
    wait_until(lambda: gone(slow), "a standby that was not ready in time was not stopped")
    assert not (wd / "standby.pid").exists() and dev.exit_code() == 3
    dev.start_standby("slow.json")
    remember(wd, "standby.pid")
    assert not dev._standby_ready() and dev.take_over(timeout_s=WAIT_S)
    wait_until(lambda: listening(dev), "the standby that was still loading never took over")
    assert dev.stop_runner(timeout_s=WAIT_S) == 3


def test_adb_standby_killed_before_taking_over_leaves_the_runner_running(standby_phone):
    dev, wd = standby_phone
    runner = started_runner(dev, wd)
    for end in ("crash", "stop_standby"):
        dev.start_standby("stage_0.json")
        pid = remember(wd, "standby.pid")
        wait_until(dev._standby_ready, "the standby never got ready")
        if end == "crash":
            os.kill(pid, signal.SIGKILL)
            assert wait_for_file(wd / "standby.exit") == "137"
        else:
            dev.stop_standby()
            wait_until(lambda: gone(pid), "stop_standby did not kill the standby")
            time.sleep(0.2)  # time for its wrapper to write a status, were it to
            assert not (wd / "standby.pid").exists()
        assert not (wd / "runner.exit").exists() and int((wd / "runner.pid").read_text()) == runner
        assert dev.is_running() and dev.exit_code() is None and not dev.has_standby()
    with pytest.raises(ZLError, match="still running"):
        dev.take_over()
    assert dev.stop_runner(timeout_s=WAIT_S) == 3


def test_adb_take_over_is_three_round_trips_and_app_mode_has_no_standby():
    """On the recovery's critical path: is the runner gone, is the standby alive and ready, hand over."""
    phone = FakePhone("P1")
    dev = zadb.AdbDevice("P1", FakeClient({"P1": phone}))
    phone.responses = {
        r"\[ -e runner\.exit \]": "",  # the runner is gone
        r"kill -0 \"\$p\"": "alive 4343\nready",
        r"kill -USR1": "out 1234\ntook over 4343",
    }
    assert dev.take_over(timeout_s=1)
    shells = [c[1] for c in phone.calls if c[0] == "shell"]
    assert len(shells) == 3 and shells[-1] == dev.take_over_command() and dev._out_offset == 1234
    assert "rm -f runner.exit && mv -f standby.pid runner.pid" in shells[-1]
    phone.responses[r"kill -USR1"] = "out 1234"  # the standby died since the check: the caller starts a runner
    assert not dev.take_over(timeout_s=1)

    from zl_device.devices.app import AppDevice

    app_phone = FakePhone("P2")
    app = AppDevice("P2", FakeClient({"P2": app_phone}))
    assert not app.supports_standby and not app.has_standby() and not app.take_over()
    app.stop_standby()
    assert app_phone.calls == []  # the app's service runs one runner: nothing to ask the phone
    with pytest.raises(ZLError, match="phone P2: --mode app keeps no hot standby .* run without --standby, or with "
                                      "--mode binary"):
        app.start_standby("stage_0.json")

    from zl_device.executorch.coordinator import Coordinator, StagePlan

    def coordinator(device):
        return Coordinator([StagePlan(0, device, "stage_0.json", "metrics.jsonl", "ckpt", 1)], None, standby=True)

    assert coordinator(dev).recovery.standby  # binary mode: accepted
    with pytest.raises(ZLError, match=r"--standby: P2 cannot keep a hot standby \(local devices and phones in "
                                      r"--mode binary can; the app runs one runner\); run without --standby, or "
                                      r"with --mode binary"):
        coordinator(app)


def test_adb_push_pull_and_tunnels(tmp_path):
    phone = FakePhone("P1")
    dev = zadb.AdbDevice("P1", FakeClient({"P1": phone}))
    binary = tmp_path / "zl_runner"
    binary.write_bytes(b"\x7fELF" + bytes(5000))
    seen = []
    assert dev.push(binary, "zl_runner", mode=0o755, on_bytes=seen.append) == 5004 and sum(seen) == 5004
    # Pushed under a temp name with the mode bits, then renamed into place.
    assert ("push", "/data/local/tmp/zerolock/.zl_runner.tmp", "0o755") in phone.calls
    assert ("shell", "mv -f /data/local/tmp/zerolock/.zl_runner.tmp /data/local/tmp/zerolock/zl_runner") in phone.calls
    for name in ("ckpt/window_1/adapter.safetensors", "ckpt/.tmp-window_2/adapter.safetensors",
                 "ckpt/input_log/e1.bin", "metrics.jsonl"):
        phone.files[f"/data/local/tmp/zerolock/{name}"] = (name.encode(), 0o644)
    dev.pull("ckpt", tmp_path / "ck", exclude=(".tmp-*", "input_log"))
    assert [str(p.relative_to(tmp_path / "ck")) for p in (tmp_path / "ck").rglob("*") if p.is_file()] == [
        "window_1/adapter.safetensors"]
    with pytest.raises(ZLError, match="does not exist; nothing to pull"):
        dev.pull("nothing", tmp_path / "n")

    dev.forward(7201, 7101)
    dev.reverse(7101, 7201)
    assert phone.calls[-2:] == [("forward", "tcp:7201", "tcp:7101"), ("reverse", "tcp:7101", "tcp:7201")]
    phone.responses = {r"ip -f inet addr show wlan0": IP_ADDR}
    assert dev.address() == "192.168.1.23"


def test_adb_errors_name_the_phone(tmp_path):
    from adbutils.errors import AdbError

    class Broken(FakePhone):
        def shell(self, command, timeout=None):
            raise AdbError("device unauthorized.\nThis adb server's $ADB_VENDOR_KEYS is not set")

    dev = zadb.AdbDevice("P9", FakeClient({"P9": Broken("P9")}))
    with pytest.raises(ZLError, match="phone P9 is unauthorized: unlock the phone"):
        dev.temperature_c()

    class Full(FakeSync):
        def push(self, src, dst, mode=0o755, check=False):
            raise AdbError("FAIL", "write failed: No space left on device")

    full = FakePhone("P8")
    full.sync = Full(full)
    blob = tmp_path / "blob"
    blob.write_bytes(b"x")
    with pytest.raises(ZLError, match=r"phone P8: storage full while trying to push blob; free space"):
        zadb.AdbDevice("P8", FakeClient({"P8": full})).push(blob, "blob")


def test_deploy_to_phone_through_fake_client(tmp_path, monkeypatch):
    """A phone gets the arm64 runner, the program and the config; a full disk stops the deploy with a fix."""
    export, configs = make_export(tmp_path, stages=1), make_configs(tmp_path, stages=1)
    arm = tmp_path / "zl_runner"
    arm.write_bytes(b"\x7fELF" + bytes(14) + (183).to_bytes(2, "little") + bytes(40))
    monkeypatch.setenv("ZL_ANDROID_RUNNER", str(arm))
    phone = FakePhone("P1")
    phone.responses = {r"^df -k": DF_TOYBOX}
    dev = zadb.AdbDevice("P1", FakeClient({"P1": phone}))
    result = zdeploy.deploy([dev], export, configs)[0]
    assert sorted(result.pushed) == ["manifest.json", "run.key", "stage_0.json", "stage_0.pte", "train.safetensors",
                                     "zl_runner"]
    assert phone.files["/data/local/tmp/zerolock/.zl_runner.tmp"][1] == 0o755
    assert json.loads(phone.files["/data/local/tmp/zerolock/stage_0.json"][0])["program"] == "stage_0.pte"
    phone.responses = {r"^df -k": DF_WRAPPED.replace("672000", "1000")}
    with pytest.raises(ZLError, match=r"P1: 0 MiB free under /data/local/tmp, deploy needs"):
        zdeploy.deploy([dev], export, configs)


# --- the real adb binary and server, no phone attached ----------------------------------------------------


@pytest.fixture()
def adb_server(monkeypatch):
    """A private adb server on a free port, killed at the end (it would outlive the tests otherwise)."""
    adb = zadb.find_adb()
    if adb is None:
        pytest.skip("no adb binary (apt install adb)")
    port = free_port()
    monkeypatch.setenv("ANDROID_ADB_SERVER_PORT", str(port))
    monkeypatch.delenv("ANDROID_ADB_SERVER_HOST", raising=False)
    yield port
    subprocess.run([adb, "-P", str(port), "kill-server"], capture_output=True, timeout=30)


def test_real_adb_server_serial_not_found(adb_server):
    client = zadb.connect()  # starts the server on the private port
    assert zadb._server_up("127.0.0.1", adb_server)
    phones = zadb.list_phones(client)
    with pytest.raises(ZLError, match=r"phone XYZ not found: the adb server sees .*zl devices"):
        open_phone("XYZ", client)
    with pytest.raises(ZLError, match="phone XYZ not found"):
        open_devices("XYZ,ABC", client=client)
    result = CliRunner().invoke(cli_app(), ["devices"])
    assert result.exit_code == 0 and "local" in result.stdout
    assert all(p.name in result.stdout for p in phones)
    result = CliRunner().invoke(cli_app(), ["devices", "--json"])
    assert [json.loads(line)["name"] for line in result.stdout.splitlines()] == ["local"] + [p.name for p in phones]
    zadb.kill_server()
    assert not zadb._server_up("127.0.0.1", adb_server)


def test_no_server_and_no_adb_binary(monkeypatch):
    monkeypatch.setenv("ANDROID_ADB_SERVER_PORT", str(free_port()))
    monkeypatch.setenv("ADBUTILS_ADB_PATH", "/nonexistent/platform-tools/adb")
    with pytest.raises(ZLError, match=r"no adb server at 127.0.0.1:\d+ and no adb binary .*apt install adb"):
        zadb.connect()
    with pytest.raises(ZLError, match="no adb binary"):
        open_devices("R58M123")
    with pytest.raises(ZLError, match=r"no adb server at .*adb start-server"):
        zadb.connect(start=False)
    result = CliRunner().invoke(cli_app(), ["devices"])  # lists local anyway, says why phones are missing
    assert result.exit_code == 0 and "local" in result.stdout and "no adb binary" in result.stderr


# --- with a phone -----------------------------------------------------------------------------------------


@pytest.fixture()
def phone():
    serial = os.environ.get("ZL_TEST_SERIAL")
    if not serial:
        pytest.skip("set ZL_TEST_SERIAL to an attached phone's serial")
    dev = open_phone(serial)
    dev.workdir = "/data/local/tmp/zerolock-test"  # not the real workdir: a test must not clobber a deployment
    yield dev
    dev.shell(f"rm -rf {dev.workdir}")


@pytest.mark.device
def test_real_phone_files_and_probes(phone, tmp_path):
    src = tmp_path / "blob"
    src.write_bytes(os.urandom(2 << 20))
    assert phone.push(src, "dir/blob", mode=0o600) == 2 << 20
    assert phone.file_sha256("dir/blob") == zdeploy.file_sha256(src)
    assert phone.listdir("dir") == ["blob"]
    phone.pull("dir", tmp_path / "back")
    assert (tmp_path / "back" / "blob").read_bytes() == src.read_bytes()
    assert phone.free_bytes() > 0
    celsius = phone.temperature_c()
    assert celsius is not None and 0 < celsius < 80


@pytest.mark.device
def test_real_phone_runner_lifecycle(phone, tmp_path):
    """nohup, runner.pid and runner.exit under Android's sh, with a shell script standing in for zl_runner."""
    script = tmp_path / "zl_runner"
    script.write_text('#!/system/bin/sh\necho "args: $*"\n[ "$2" = exit.json ] && exit 3\nexec sleep 60\n')
    phone.push(script, "zl_runner", mode=0o755)
    for name in ("sleep.json", "exit.json"):
        phone.write_text(name, "{}")
    phone.start_runner("sleep.json", resume=True)
    assert phone.is_running() and phone.exit_code() is None
    assert phone.pss_mib() is not None
    assert phone.stop_runner(timeout_s=10) == -15  # sleep has no SIGTERM handler
    phone.start_runner("sleep.json")
    assert phone.kill_runner() == -9
    phone.start_runner("exit.json")
    assert phone.wait(10) and phone.exit_code() == 3
    assert phone.runner_output() == "args: --config exit.json\n"


@pytest.mark.device
def test_real_phone_zl_runner_bad_config(phone):
    """The arm64 zl_runner runs on the phone and rejects an empty config with exit status 2."""
    phone.push(zdeploy.android_runner_binary(), "zl_runner", mode=0o755)  # fails with the build command if unbuilt
    phone.write_text("bad.json", "{}")
    phone.start_runner("bad.json")
    assert phone.wait(30) and phone.exit_code() == 2
    assert "required" in (phone.read_text("runner.err") or "")
