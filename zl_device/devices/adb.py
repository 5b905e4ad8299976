"""The `adb` backend: a phone, reached through the adb server with adbutils.

Files live under /data/local/tmp/zerolock (writable by adb's shell user, no
root needed). The runner runs there as a background process of `adb shell`:
`nohup` keeps it alive when the shell session ends, a wrapper shell writes
its pid to runner.pid and its exit status to runner.exit, and its output
goes to runner.out / runner.err. A hot standby (`zl train --standby`,
docs/design#hot-standbys) runs the same way with its pid in standby.pid; taking
over moves that pid into runner.pid (see `AdbDevice._wrapped`).

Every adb failure becomes a `ZLError` that names the phone and the fix.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import adbutils
from adbutils.errors import AdbError

from zl_base.errors import ZLError
from zl_device.devices.backend import (
    RUNNER_EXIT,
    RUNNER_NAME,
    RUNNER_PID,
    RUNNER_STDERR,
    RUNNER_STDOUT,
    STANDBY_EXIT,
    STANDBY_PID,
    ByteCallback,
    Device,
    DeviceInfo,
    excluded,
    signal_exit_code,
    sum_pss_kib,
)

log = logging.getLogger(__name__)

REMOTE_ROOT = "/data/local/tmp/zerolock"
# What `keep_awake` sets for a run in --mode binary, where nothing else keeps a phone awake: a process started over
# `adb shell` holds no wake lock, so a phone whose screen goes off suspends its stage. Stay on while powered (USB,
# AC or wireless: 7, what `svc power stayon true` writes), and no screen timeout for an unplugged one.
AWAKE_SETTINGS = (("global", "stay_on_while_plugged_in", "7"), ("system", "screen_off_timeout", "2147483647"))
# In the workdir while a run holds the phone awake: its own values of AWAKE_SETTINGS, to put back. A zl that could
# not (killed) leaves it, and the next run restores from it, not from the values that zl had set.
AWAKE_FILE = "awake_settings.json"
REQUIRED_ABI = "arm64-v8a"
DEFAULT_PORT = 5037
_SHELL_TIMEOUT_S = 30.0
_START_TIMEOUT_S = 10.0  # until the wrapper wrote runner.pid (standby.pid)
_TAKE_OVER_POLL_S = 0.02  # between readiness checks of a standby still loading (one shell round trip each)

_STATE_FIXES = {
    "unauthorized": "unlock the phone and accept the 'Allow USB debugging?' prompt (tick 'Always allow'), "
    "then run `zl devices` again",
    "offline": "unplug and replug the cable (or `adb reconnect offline`); if it stays offline, "
    "revoke USB debugging authorizations in Developer options and accept the prompt again",
    "no permissions": "the host user may not open the USB device: add a udev rule for the phone's vendor "
    "(or run `adb kill-server; sudo adb start-server`)",
    "authorizing": "wait a few seconds and accept the prompt on the phone",
    "connecting": "wait a few seconds and run `zl devices` again",
    "bootloader": "reboot the phone into Android",
    "recovery": "reboot the phone into Android",
    "sideload": "reboot the phone into Android",
}


# --- the adb server ---------------------------------------------------------------------------------


def server_address() -> tuple[str, int]:
    """Where adbutils and the adb binary look for the server ($ANDROID_ADB_SERVER_HOST / _PORT)."""
    return os.environ.get("ANDROID_ADB_SERVER_HOST", "127.0.0.1"), int(
        os.environ.get("ANDROID_ADB_SERVER_PORT", DEFAULT_PORT))


def find_adb() -> str | None:
    """The adb binary: $ADBUTILS_ADB_PATH (when set it is the only candidate), PATH, adbutils' bundled copy."""
    explicit = os.environ.get("ADBUTILS_ADB_PATH")
    if explicit:
        return explicit if os.path.isfile(explicit) and os.access(explicit, os.X_OK) else None
    found = shutil.which("adb")
    if found:
        return found
    bundled = Path(adbutils.__file__).parent / "binaries" / "adb"
    return str(bundled) if bundled.is_file() and os.access(bundled, os.X_OK) else None


def _server_up(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def connect(start: bool = True) -> adbutils.AdbClient:
    """An adbutils client for the adb server, started first when it is not running.

    Raises:
        ZLError: no server and no adb binary to start one, or the server does not start.
    """
    host, port = server_address()
    if not _server_up(host, port):
        where = f"{host}:{port}"
        if not start or host not in ("127.0.0.1", "localhost"):
            raise ZLError(f"no adb server at {where}; start it with `adb start-server` "
                          "(or unset ANDROID_ADB_SERVER_HOST/PORT).")
        adb = find_adb()
        if adb is None:
            hint = (f"ADBUTILS_ADB_PATH={os.environ['ADBUTILS_ADB_PATH']} is not an executable; fix or unset it"
                    if os.environ.get("ADBUTILS_ADB_PATH") else "put adb on PATH")
            raise ZLError(f"no adb server at {where} and no adb binary to start one: install Android platform-tools "
                          f"(`apt install adb`, or the SDK's platform-tools) and {hint}.")
        try:
            done = subprocess.run([adb, "-P", str(port), "start-server"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ZLError(f"`{adb} start-server` failed: {e}; run it by hand to see why.") from e
        if done.returncode != 0 or not _server_up(host, port):
            raise ZLError(f"`{adb} -P {port} start-server` failed (exit {done.returncode}): "
                          f"{(done.stderr or done.stdout).strip()[-300:]}; is another adb version holding the port?")
    return adbutils.AdbClient(host=host, port=port, socket_timeout=_SHELL_TIMEOUT_S)


def kill_server() -> None:
    """`adb kill-server` for the server at server_address() (no-op when none runs)."""
    host, port = server_address()
    if _server_up(host, port):
        adbutils.AdbClient(host=host, port=port).server_kill()


@contextmanager
def _adb_errors(serial: str, action: str) -> Iterator[None]:
    """adbutils errors (and lost sockets) as one-line ZLErrors naming the phone."""
    try:
        yield
    except AdbError as e:
        text = str(e)
        if "not found" in text:
            raise ZLError(f"phone {serial}: not found by the adb server while trying to {action}; "
                          "check the cable and `zl devices`.") from e
        if "No space left" in text or "ENOSPC" in text:
            raise ZLError(f"phone {serial}: storage full while trying to {action}; free space on the phone "
                          "(`adb shell df -h /data`, delete old runs under /data/local/tmp/zerolock).") from e
        if "unauthorized" in text or "offline" in text:
            state = "unauthorized" if "unauthorized" in text else "offline"
            raise ZLError(f"phone {serial} is {state}: {_STATE_FIXES[state]}.") from e
        raise ZLError(f"phone {serial}: adb failed to {action}: {text}.") from e
    except OSError as e:
        raise ZLError(f"phone {serial}: lost the adb connection while trying to {action} ({e}); "
                      "check the cable and that the adb server runs (`adb devices`).") from e


# --- listing and opening phones ---------------------------------------------------------------------


def _props(dev, serial: str) -> tuple[str, str, str, str]:
    """model, primary ABI, ABI list, Android version in one shell round trip."""
    with _adb_errors(serial, "read its properties"):
        out = dev.shell("getprop ro.product.model; getprop ro.product.cpu.abi; getprop ro.product.cpu.abilist; "
                        "getprop ro.build.version.release", timeout=_SHELL_TIMEOUT_S)
    lines = (out.splitlines() + ["", "", "", ""])[:4]
    return tuple(line.strip() for line in lines)  # type: ignore[return-value]


def abi_problem(abi: str, abilist: str) -> str:
    """Why zl_runner (arm64-v8a) cannot run with these ABIs; "" when it can."""
    if abi == REQUIRED_ABI or REQUIRED_ABI in abilist.split(","):
        return ""
    return f"ABI {abi or 'unknown'} (supports {abilist or abi or 'unknown'}); zl_runner is built for {REQUIRED_ABI}"


def list_phones(client: adbutils.AdbClient) -> list[DeviceInfo]:
    """Every phone the adb server sees, with model, ABI and Android version where it is usable."""
    try:
        entries = client.list()
    except (AdbError, OSError) as e:
        raise ZLError(f"cannot list phones from the adb server ({e}); run `adb devices` to see why.") from e
    rows = []
    for entry in entries:
        if entry.state != "device":
            fix = _STATE_FIXES.get(entry.state, "run `adb devices -l` to see why")
            rows.append(DeviceInfo(entry.serial, "adb", entry.state, note=fix))
            continue
        model, abi, abilist, version = _props(client.device(entry.serial), entry.serial)
        problem = abi_problem(abi, abilist)
        rows.append(DeviceInfo(entry.serial, "adb", "unsupported" if problem else "ready", model=model, abi=abi,
                               android=version, note=problem))
    return rows


def attached(serial: str, client: adbutils.AdbClient | None = None) -> adbutils.AdbClient:
    """The adb client, once the phone with this serial is checked to be attached, online and authorized.

    Raises:
        ZLError: the serial is not attached, unauthorized or offline.
    """
    client = client or connect()
    try:
        entries = {e.serial: e.state for e in client.list()}
    except (AdbError, OSError) as e:
        raise ZLError(f"phone {serial}: cannot ask the adb server for phones ({e}); run `adb devices`.") from e
    if serial not in entries:
        seen = ", ".join(f"{s} ({st})" for s, st in entries.items()) or "no phones"
        raise ZLError(f"phone {serial} not found: the adb server sees {seen}. Check the cable (or "
                      f"`adb connect IP:5555` for Wi-Fi debugging) and the serial in `zl devices`.")
    state = entries[serial]
    if state != "device":
        raise ZLError(f"phone {serial} is {state}: {_STATE_FIXES.get(state, 'run `adb devices -l` to see why')}.")
    return client


def runner_version(dev, serial: str, workdir: str = REMOTE_ROOT) -> str | None:
    """`zl_runner --version` of the runner `--mode binary` deployed in `workdir` on an adbutils device (which zl
    and ExecuTorch it holds); None when there is none or it does not answer."""
    with _adb_errors(serial, "ask zl_runner for its version"):
        out = dev.shell(f"cd {shlex.quote(workdir)} 2>/dev/null && [ -x {RUNNER_NAME} ] && "
                        f"./{RUNNER_NAME} --version 2>/dev/null", timeout=_SHELL_TIMEOUT_S)
    line = out.strip().splitlines()[-1] if out.strip() else ""
    return line if line.startswith(f"{RUNNER_NAME} ") else None


def check_abi(phone: AdbDevice) -> None:
    """Raises ZLError when the phone is not arm64-v8a (the runner is built for that ABI only)."""
    info = phone.info()
    if info.note:
        raise ZLError(f"phone {phone.serial} ({info.model or 'unknown model'}) has {info.note}; use a 64-bit ARM "
                      "phone, or leave this one out of --devices.")


# --- one phone -------------------------------------------------------------------------------------


class _ProgressReader:
    """A file wrapper that reports each chunk adbutils reads (sync push has no callback of its own)."""

    def __init__(self, f, on_bytes: ByteCallback):
        self._f, self._on_bytes = f, on_bytes

    def read(self, n: int) -> bytes:
        chunk = self._f.read(n)
        if chunk:
            self._on_bytes(len(chunk))
        return chunk

    def close(self) -> None:
        self._f.close()


def parse_battery_temperature(dumpsys: str) -> float | None:
    """°C from `dumpsys battery` ("  temperature: 312" is tenths of a degree); None when absent or implausible."""
    m = re.search(r"^[ \t]*temperature:[ \t]*(-?\d+)[ \t\r]*$", dumpsys, re.MULTILINE)
    if not m:
        return None
    celsius = int(m.group(1)) / 10.0
    return celsius if -40.0 < celsius < 150.0 else None


def parse_df_available(df: str) -> int | None:
    """Available bytes from `df -k PATH` (toybox or busybox; a long device name may wrap the row)."""
    tokens = " ".join(df.splitlines()[1:]).split()
    for i in range(len(tokens) - 3):
        a, b, c, pct = tokens[i:i + 4]
        if a.isdigit() and b.isdigit() and c.isdigit() and pct.endswith("%"):
            return int(c) * 1024
    return None


def parse_wifi_ip(ip_addr: str) -> str | None:
    """The IPv4 address in `ip -f inet addr show wlan0` output."""
    m = re.search(r"\binet (\d+\.\d+\.\d+\.\d+)/", ip_addr)
    return m.group(1) if m else None


class AdbDevice(Device):
    """A phone: a workdir under /data/local/tmp/zerolock and a runner started over `adb shell`.

    Use `zl_device.devices.registry.open_phone` to get one with its state and ABI checked.
    """

    kind = "adb"

    def __init__(self, serial: str, client: adbutils.AdbClient, workdir: str = REMOTE_ROOT,
                 link_profile: str = "local"):
        super().__init__(serial, workdir, link_profile)
        self.serial = serial
        self.client = client
        self._dev = client.device(serial)
        self._info: DeviceInfo | None = None
        self._out_offset = 0
        self._standby_out_offset = 0  # runner.out's size when this object started the standby

    def shell(self, command: str, action: str = "run a shell command", timeout: float = _SHELL_TIMEOUT_S,
              shown: str | None = None) -> str:
        """Run `command` with /system/bin/sh on the phone; its output, right-stripped. `shown` is what the debug
        log says instead of `command` (a command that carries the run key)."""
        log.debug("%s$ %s", self.serial, command if shown is None else shown)
        with _adb_errors(self.serial, action):
            return self._dev.shell(command, timeout=timeout)

    def _q(self, remote: str) -> str:
        return shlex.quote(self.path(remote))

    # --- description ---------------------------------------------------------------------------------

    def info(self) -> DeviceInfo:
        if self._info is None:
            model, abi, abilist, version = _props(self._dev, self.serial)
            problem = abi_problem(abi, abilist)
            self._info = DeviceInfo(self.serial, self.kind, "unsupported" if problem else "ready", model=model,
                                    abi=abi, android=version, note=problem)
        return self._info

    def address(self) -> str | None:
        return parse_wifi_ip(self.shell("ip -f inet addr show wlan0 2>/dev/null", "read its Wi-Fi address"))

    def keep_awake(self) -> str | None:
        saved = self.read_text(AWAKE_FILE)
        if not saved:
            said = self.shell("; ".join(f"settings get {ns} {key}" for ns, key, _ in AWAKE_SETTINGS),
                              "read its sleep settings").split()
            if len(said) != len(AWAKE_SETTINGS):
                raise ZLError(f"{self.name}: `settings get` answered {said!r}; is the phone unlocked and adb "
                              "authorized? Run `adb shell settings get system screen_off_timeout` to see.")
            self.write_text(AWAKE_FILE, json.dumps({f"{ns} {key}": v for (ns, key, _), v in zip(AWAKE_SETTINGS, said)}))
        self.shell("; ".join([f"settings put {ns} {key} {v}" for ns, key, v in AWAKE_SETTINGS]
                             + ["input keyevent KEYCODE_WAKEUP"]), "keep it awake")
        return "kept awake (stays on while powered, no screen timeout)"

    def restore_sleep(self) -> None:
        saved = self.read_text(AWAKE_FILE)
        if not saved:
            return
        try:
            values = json.loads(saved)
        except ValueError:
            values = {}
        commands = []
        for ns, key, _ in AWAKE_SETTINGS:
            value = str(values.get(f"{ns} {key}", "null"))
            ok = value.isdigit()  # both settings are numbers; "null": the phone had none, so none again
            commands.append(f"settings put {ns} {key} {value}" if ok else f"settings delete {ns} {key}")
        self.shell("; ".join(commands), "restore its sleep settings")
        self.remove(AWAKE_FILE)

    def runner_version(self) -> str | None:
        if not self.runs_runner_binary:  # the app carries its runtime; no zl_runner in its folder
            return None
        return runner_version(self._dev, self.serial, self.workdir)

    # --- files ---------------------------------------------------------------------------------------

    def push(self, local: Path, remote: str, mode: int | None = None, on_bytes: ByteCallback | None = None) -> int:
        src = Path(local)
        if not src.is_file():
            raise ZLError(f"{src}: no such file to push to phone {self.serial}.")
        dst = self.path(remote)
        tmp = f"{os.path.dirname(dst)}/.{os.path.basename(dst)}.tmp"
        mode = mode if mode is not None else (src.stat().st_mode & 0o777)
        self.shell(f"mkdir -p {shlex.quote(os.path.dirname(dst))}", "create the folder " + os.path.dirname(dst))
        # Push under a temp name and rename: a runner never sees half a program.
        with open(src, "rb") as f, _adb_errors(self.serial, f"push {src.name}"):
            size = self._dev.sync.push(_ProgressReader(f, on_bytes) if on_bytes else f, tmp, mode=mode, check=True)
        self.shell(f"mv -f {shlex.quote(tmp)} {shlex.quote(dst)}", "rename " + tmp)
        return size

    def _stat(self, path: str):
        with _adb_errors(self.serial, "stat " + path):
            return self._dev.sync.stat(path)

    def pull(self, remote: str, local: Path, exclude: tuple[str, ...] = ()) -> int:
        src, dst = self.path(remote), Path(local)
        info = self._stat(src)
        if info.mode == 0:
            raise ZLError(f"phone {self.serial}: {src} does not exist; nothing to pull.")
        if stat.S_ISREG(info.mode):
            dst.parent.mkdir(parents=True, exist_ok=True)
            with _adb_errors(self.serial, "pull " + src):
                return self._dev.sync.pull_file(src, dst)
        total = 0
        dst.mkdir(parents=True, exist_ok=True)
        with _adb_errors(self.serial, "list " + src):
            entries = [e for e in self._dev.sync.iter_directory(src) if e.path not in (".", "..")]
        for entry in entries:
            if excluded(entry.path, exclude):
                continue
            child = f"{remote.rstrip('/')}/{entry.path}"
            if stat.S_ISDIR(entry.mode):
                total += self.pull(child, dst / entry.path, exclude)
            elif stat.S_ISREG(entry.mode):
                with _adb_errors(self.serial, "pull " + self.path(child)):
                    total += self._dev.sync.pull_file(self.path(child), dst / entry.path)
        return total

    def exists(self, remote: str) -> bool:
        return self._stat(self.path(remote)).mode != 0

    def listdir(self, remote: str = ".") -> list[str]:
        path = self.path(remote)
        if not stat.S_ISDIR(self._stat(path).mode):
            return []
        with _adb_errors(self.serial, "list " + path):
            return sorted(e.path for e in self._dev.sync.iter_directory(path) if e.path not in (".", ".."))

    def read_text(self, remote: str) -> str | None:
        if not self.exists(remote):
            return None
        with _adb_errors(self.serial, "read " + self.path(remote)):
            return self._dev.sync.read_text(self.path(remote))

    def write_text(self, remote: str, text: str) -> None:
        dst = self.path(remote)
        self.shell(f"mkdir -p {shlex.quote(os.path.dirname(dst))}", "create the folder " + os.path.dirname(dst))
        with _adb_errors(self.serial, "write " + dst):
            self._dev.sync.push(text.encode(), dst, mode=0o644)

    def remove(self, remote: str) -> None:
        self.shell(f"rm -rf {self._q(remote)}", "remove " + self.path(remote))

    def file_sha256(self, remote: str) -> str | None:
        out = self.shell(f"sha256sum {self._q(remote)} 2>/dev/null", "hash " + self.path(remote), timeout=300)
        digest = out.split()[0] if out.split() else ""
        return digest if re.fullmatch(r"[0-9a-f]{64}", digest) else None

    def free_bytes(self) -> int:
        # The workdir may not exist yet; its parent /data/local/tmp is on the same filesystem.
        where = os.path.dirname(self.workdir.rstrip("/"))
        out = self.shell(f"df -k {shlex.quote(where)}", "check free space")
        free = parse_df_available(out)
        if free is None:
            raise ZLError(f"phone {self.serial}: cannot read free space from `df -k {where}`: {out[:200]!r}.")
        return free

    # --- the runner ----------------------------------------------------------------------------------

    @staticmethod
    def _wrapped(args: list[str], pid_file: str) -> str:
        """The wrapper shell that runs `args` in the background, writes its pid to `pid_file` and waits for it.

        When the process ends, the wrapper writes its status ($?, 128+N after signal N) to runner.exit if
        runner.pid still names the process, to standby.exit if standby.pid does, else nowhere. So a status
        lands only where the process still is the one its pid file names: a standby that takes over (its pid
        moved from standby.pid to runner.pid, `take_over`) reports to runner.exit as a runner started so would;
        a standby killed before taking over (`stop_standby` removes standby.pid) writes nothing, and never makes
        the running runner look ended; nor does an old runner whose wrapper outlives a new `start_runner`.
        """
        line = " ".join(shlex.quote(a) for a in args)
        # `read` is a builtin: no fork between the process's end and its status (is_running, which sees the
        # process gone before the status is there, says "not running" with no exit code in that gap).
        report = " ".join(f'read q <{pid} && [ "$q" = "$p" ] && echo $s >{status};'
                          for pid, status in ((RUNNER_PID, RUNNER_EXIT), (STANDBY_PID, STANDBY_EXIT)))
        return (f"{line} >>{RUNNER_STDOUT} 2>>{RUNNER_STDERR} </dev/null & p=$!; echo $p >{pid_file}; "
                f"wait $p; s=$?; {report}")

    def _detached(self, inner: str, stale: tuple[str, ...]) -> str:
        # `a && b && c &` would background the rm as well; the subshell backgrounds only the wrapper (and
        # detaches it from the adb shell session).
        return (f"cd {shlex.quote(self.workdir)} && rm -f {' '.join(stale)} && "
                f"(nohup sh -c {shlex.quote(inner)} >/dev/null 2>&1 </dev/null &)")

    def start_command(self, config: str, resume: bool = False) -> str:
        """The `adb shell` line that starts the runner in the background (shown by --verbose, tested)."""
        args = [f"./{RUNNER_NAME}", "--config", config] + (["--resume"] if resume else [])
        return self._detached(self._wrapped(args, RUNNER_PID), (RUNNER_PID, RUNNER_EXIT))

    def standby_command(self, config: str) -> str:
        """The `adb shell` line that starts a hot standby (`zl_runner --standby`) in the background."""
        args = [f"./{RUNNER_NAME}", "--config", config, "--standby"]
        return self._detached(self._wrapped(args, STANDBY_PID), (STANDBY_PID, STANDBY_EXIT))

    def _out_size(self) -> int:
        size = self.shell(f"stat -c %s {self._q(RUNNER_STDOUT)} 2>/dev/null", "stat runner.out").strip()
        return int(size) if size.isdigit() else 0

    def _check_deployed(self, config: str) -> None:
        for needed in (RUNNER_NAME, config):
            if not self.exists(needed):
                raise ZLError(f"phone {self.serial}: {self.path(needed)} does not exist; run `zl deploy` first.")

    def _wait_for_pid(self, pid_file: str, what: str) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self.shell(f"cat {self._q(pid_file)} 2>/dev/null", f"read {pid_file}").strip().isdigit():
            if time.monotonic() > deadline:
                err = self.read_text(RUNNER_STDERR) or ""
                raise ZLError(f"phone {self.serial}: {what} did not start within {_START_TIMEOUT_S:.0f} s; "
                              f"{RUNNER_STDERR}: {err.strip()[-300:]!r}.")
            time.sleep(0.1)

    def start_runner(self, config: str, resume: bool = False) -> None:
        if self.is_running():
            raise ZLError(f"phone {self.serial}: a runner is already running (pid {self._pid()}); stop it first.")
        self._check_deployed(config)
        self._out_offset = self._out_size()
        self.shell(self.start_command(config, resume), "start zl_runner")
        self._wait_for_pid(RUNNER_PID, "zl_runner")

    def _pid(self) -> int | None:
        text = self.shell(f"cat {self._q(RUNNER_PID)} 2>/dev/null", "read runner.pid").strip()
        return int(text) if text.isdigit() else None

    def is_running(self) -> bool:
        # runner.exit appears when the runner ended; the pid check covers a wrapper that was killed itself.
        out = self.shell(
            f"cd {shlex.quote(self.workdir)} 2>/dev/null || exit 0; [ -e {RUNNER_EXIT} ] && exit 0; "
            f"[ -e {RUNNER_PID} ] && kill -0 $(cat {RUNNER_PID}) 2>/dev/null && echo running",
            "check the runner")
        return out.strip() == "running"

    def exit_code(self) -> int | None:
        text = self.shell(f"cat {self._q(RUNNER_EXIT)} 2>/dev/null", "read runner.exit").strip()
        return signal_exit_code(int(text)) if text.isdigit() else None

    def signal_runner(self, sig: int) -> bool:
        pid = self._pid()
        if pid is None or not self.is_running():
            return False
        self.shell(f"kill -{int(sig)} {pid}", f"send signal {int(sig)} to zl_runner")
        return True

    def wait(self, timeout_s: float, poll_s: float = 0.2) -> bool:
        return super().wait(timeout_s, poll_s)

    # --- hot standby (docs/design#hot-standbys) --------------------------------------------------------

    supports_standby = True

    def start_standby(self, config: str) -> None:
        alive, _, pid = self._standby_state()
        if alive:
            raise ZLError(f"phone {self.serial}: a standby is already waiting (pid {pid}); stop it first.")
        self._check_deployed(config)
        self._standby_out_offset = self._out_size()
        self.shell(self.standby_command(config), "start the zl_runner standby")
        self._wait_for_pid(STANDBY_PID, "the zl_runner standby")

    def standby_state_command(self) -> str:
        """The `adb shell` line behind `_standby_state`: prints "alive PID" and then "ready" when it is."""
        return (f"cd {shlex.quote(self.workdir)} 2>/dev/null || exit 0; [ -e {STANDBY_EXIT} ] && exit 0; "
                f"p=$(cat {STANDBY_PID} 2>/dev/null) || exit 0; kill -0 \"$p\" 2>/dev/null || exit 0; "
                f"echo \"alive $p\"; tail -c +{self._standby_out_offset + 1} {RUNNER_STDOUT} 2>/dev/null "
                f"| grep -F '\"event\": \"standby\"' | grep -qE '\"pid\": '\"$p\"'[,}}]' && echo ready")

    def _standby_state(self) -> tuple[bool, bool, int | None]:
        """(alive, ready, pid) of the standby in one shell round trip. Alive: standby.pid names a live process
        that has not ended on its own (no standby.exit). Ready: it printed its {"event": "standby"} line (loaded,
        SIGUSR1 blocked, waiting) in runner.out since this object started it."""
        words = self.shell(self.standby_state_command(), "check the standby").split()
        if len(words) < 2 or words[0] != "alive" or not words[1].isdigit():
            return False, False, None
        return True, "ready" in words[2:], int(words[1])

    def has_standby(self) -> bool:
        return self._standby_state()[0]

    def _standby_ready(self) -> bool:
        """The standby printed its {"event": "standby"} line: loaded, SIGUSR1 blocked, waiting."""
        return self._standby_state()[1]

    def take_over_command(self) -> str:
        """The one `adb shell` line that hands the stage to the standby: the old status goes, the standby's pid
        becomes runner.pid (so its wrapper reports to runner.exit, see `_wrapped`), then SIGUSR1. Prints
        runner.out's size before the signal (where the new runner's lines start) and whether the signal got there."""
        return (f"cd {shlex.quote(self.workdir)} || exit 1; p=$(cat {STANDBY_PID} 2>/dev/null) || exit 1; "
                f"rm -f {RUNNER_EXIT} && mv -f {STANDBY_PID} {RUNNER_PID} || exit 1; "
                f"echo \"out $(stat -c %s {RUNNER_STDOUT} 2>/dev/null || echo 0)\"; "
                f"kill -USR1 \"$p\" && echo \"took over $p\"")

    def take_over(self, timeout_s: float = 60.0) -> bool:
        if self.is_running():
            raise ZLError(f"phone {self.serial}: the runner (pid {self._pid()}) is still running; stop it before "
                          f"its standby takes over.")
        deadline = time.monotonic() + timeout_s
        # Until its "standby" line the process may not have blocked SIGUSR1 yet (the signal would kill it).
        alive, ready, _ = self._standby_state()
        while alive and not ready:
            if time.monotonic() >= deadline:
                self.stop_standby()
                return False
            time.sleep(_TAKE_OVER_POLL_S)
            alive, ready, _ = self._standby_state()
        if not alive:
            self.stop_standby()  # its pid file, if any
            return False
        out = self.shell(self.take_over_command(), "hand the stage to the standby")
        size = re.search(r"^out (\d+)$", out, re.MULTILINE)
        self._out_offset = int(size.group(1)) if size else 0
        # No "took over": the standby died since the check; runner.pid names a dead process (not running, no
        # status), and the caller starts a runner.
        return re.search(r"^took over \d+$", out, re.MULTILINE) is not None

    def stop_standby(self) -> None:
        # It holds nothing yet (no checkpoint, port or input log): SIGKILL. standby.pid goes first, so its
        # wrapper writes no status (no pid file names the process any more, see `_wrapped`). No kill once
        # standby.exit says it ended: its pid may be another process's by now.
        self.shell(f"cd {shlex.quote(self.workdir)} 2>/dev/null || exit 0; p=$(cat {STANDBY_PID} 2>/dev/null); "
                   f"rm -f {STANDBY_PID}; [ -n \"$p\" ] && [ ! -e {STANDBY_EXIT} ] && kill -9 \"$p\" 2>/dev/null; "
                   "exit 0", "stop the standby")

    def runner_output(self) -> str:
        """What the runner printed on stdout since the last start by this object (JSON event lines)."""
        text = self.read_text(RUNNER_STDOUT) or ""
        return text.encode()[self._out_offset:].decode(errors="replace")

    # --- tunnels ------------------------------------------------------------------------------------

    def forward(self, host_port: int, device_port: int) -> None:
        """Host 127.0.0.1:host_port -> phone's 127.0.0.1:device_port (`adb forward`)."""
        with _adb_errors(self.serial, f"forward tcp:{host_port}"):
            self._dev.forward(f"tcp:{host_port}", f"tcp:{device_port}")

    def reverse(self, device_port: int, host_port: int) -> None:
        """Phone's 127.0.0.1:device_port -> host 127.0.0.1:host_port (`adb reverse`)."""
        with _adb_errors(self.serial, f"reverse tcp:{device_port}"):
            self._dev.reverse(f"tcp:{device_port}", f"tcp:{host_port}")

    def remove_tunnels(self) -> None:
        """Drop this phone's forwards and reverses (end of a run)."""
        with _adb_errors(self.serial, "remove port forwards"):
            self._dev.forward_remove_all()
            self._dev.reverse_remove_all()

    # --- probes --------------------------------------------------------------------------------------

    def temperature_c(self) -> float | None:
        return parse_battery_temperature(self.shell("dumpsys battery", "read the battery temperature"))

    def pss_mib(self) -> float | None:
        pid = self._pid()
        if pid is None or not self.is_running():
            return None
        kib = sum_pss_kib(self.shell(f"cat /proc/{pid}/smaps_rollup 2>/dev/null", "read the runner's PSS"))
        return kib / 1024.0 if kib is not None else None
