"""The `Device` interface every backend implements (docs/design#coordinator).

A device is a working directory plus at most one runner in it: a folder and
a `zl_runner` child process on this host (`local`), a folder under
/data/local/tmp/zerolock on a phone reached over adb with `zl_runner` started
by `adb shell` (`adb`, `--mode binary`), or the app com.zerolock.zl's files
folder and its foreground service (`adb`, `--mode app`). The orchestrator,
`zl deploy` and `zl pull` only use the operations below, so a new backend (an
SSH board, say) is one more subclass.

Paths on the device are POSIX strings; a relative one is relative to the
device's `workdir`. Exit codes follow Python's `subprocess` convention:
0..255 is the runner's status (docs/design#runner-process: 0 done, 1 failed, 2 bad config,
3 stopped), -N means killed by signal N.
"""

from __future__ import annotations

import fnmatch
import posixpath
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

#: Name of the runner binary inside a device's workdir.
RUNNER_NAME = "zl_runner"
#: The runner's stdout (JSON event lines: listening, done) and stderr (diagnostics), appended per start.
RUNNER_STDOUT = "runner.out"
RUNNER_STDERR = "runner.err"
#: Process id of the running runner, written at start.
RUNNER_PID = "runner.pid"
#: The runner's exit status once it ended (adb backend; written by the wrapper shell).
RUNNER_EXIT = "runner.exit"
#: Process id of the hot standby waiting to take over this device's stage (docs/design#hot-standbys).
STANDBY_PID = "standby.pid"
#: The standby's exit status when it ended before taking over (adb backend; written by the wrapper shell).
STANDBY_EXIT = "standby.exit"

#: ELF e_machine values (byte 18, little endian) of the builds zl makes, by `platform.machine()`'s name.
ELF_MACHINES = {62: "x86_64", 183: "aarch64"}

#: Called with the number of bytes just copied, for progress bars.
ByteCallback = Callable[[int], None]
#: Called before each push with (device name, remote name, bytes to push, skipped because unchanged).
FileCallback = Callable[[str, str, int, bool], None]


def elf_machine(path: Path) -> str | None:
    """The architecture an ELF executable is built for ("x86_64", "aarch64", else "e_machine N"); None: not ELF."""
    with open(path, "rb") as f:
        header = f.read(20)
    if len(header) < 20 or header[:4] != b"\x7fELF":
        return None
    machine = int.from_bytes(header[18:20], "little")
    return ELF_MACHINES.get(machine, f"e_machine {machine}")


@dataclass(frozen=True)
class DeviceInfo:
    """One row of `zl devices`."""

    name: str  # "local-0" or the adb serial
    kind: str  # "local" | "adb"
    state: str  # "ready" when usable; adb states otherwise ("unauthorized", "offline", ...)
    model: str = ""
    abi: str = ""  # ro.product.cpu.abi on a phone, the machine on the host (x86_64, aarch64)
    android: str = ""  # Android version (ro.build.version.release); "" for local
    note: str = ""  # what to do when state is not "ready", or extra detail
    app: str = ""  # versionName of the installed com.zerolock.zl app (phones); "" when not installed
    # `zl_runner --version` of the runner it holds, e.g. "zl_runner 0.1.0 executorch 1.5.0 aarch64 static
    # kernels=bf16 cpu=fp16,dotprod,bf16,i8mm threads=4" (the kernel path this device's CPU gets,
    # docs/design#runner-process, and the threads a stage's pool gets there, docs/design#one-device-and-threads)
    runner: str = ""


@dataclass(frozen=True)
class RuntimeInstall:
    """What `Device.install_runtime` did."""

    name: str  # what runs the stages, e.g. "app com.zerolock.zl 0.1.0"
    installed: bool  # False: the same build was already there
    bytes_pushed: int = 0


class Device(ABC):
    """A place to run one pipeline stage: a working directory and a runner process."""

    kind: str = ""
    #: Whether stages run as the `zl_runner` binary in the workdir, which deploy pushes there. False: the
    #: runtime lives outside the workdir and `install_runtime` puts it on the device (the app).
    runs_runner_binary: bool = True
    #: Whether the workdir's files are on this host, cheap enough to poll: the coordinator tails such a
    #: device's telemetry as it grows, and reads a phone's (over adb) only when it must.
    files_on_host: bool = False
    #: Whether a file pushed with mode 0600 is readable by this device's owner only. False for the app's
    #: files folder on shared storage (other apps may read it on Android 8-10): deploy hands the run key to
    #: `hold_run_key` instead, and the device passes it on at each start.
    workdir_is_private: bool = True
    #: The zl_runner build deploy puts in the workdir (`zl train --runner`); None: the default of the backend
    #: (deploy.runner_binary_for).
    runner_binary: Path | None = None

    def __init__(self, name: str, workdir: str, link_profile: str):
        self.name = name
        self.workdir = workdir
        self.link_profile = link_profile  # the runner config's `link_profile` for stages on this device

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, workdir={self.workdir!r})"

    def path(self, remote: str) -> str:
        """`remote` resolved against the workdir."""
        return posixpath.join(self.workdir, remote)

    # --- description ---------------------------------------------------------------------------------

    @abstractmethod
    def info(self) -> DeviceInfo:
        """Model, ABI, OS version and state."""

    @abstractmethod
    def address(self) -> str | None:
        """The IP other pipeline devices reach this one at directly (None: only through host tunnels)."""

    # --- files ---------------------------------------------------------------------------------------

    @abstractmethod
    def push(self, local: Path, remote: str, mode: int | None = None, on_bytes: ByteCallback | None = None) -> int:
        """Copy one host file to `remote` (parents created); `mode` sets permission bits. Returns bytes copied."""

    @abstractmethod
    def pull(self, remote: str, local: Path, exclude: tuple[str, ...] = ()) -> int:
        """Copy a device file or folder to `local` (folders merge into an existing one).

        `exclude`: glob patterns of entry names to skip at any depth, e.g. ("input_log", ".tmp-*").
        Returns bytes copied.
        """

    @abstractmethod
    def exists(self, remote: str) -> bool: ...

    @abstractmethod
    def listdir(self, remote: str = ".") -> list[str]:
        """Entry names of a device folder ([] when it does not exist)."""

    def read_from(self, remote: str, offset: int) -> bytes:
        """The bytes of `remote` from byte `offset` on; b"" when it is missing."""
        return (self.read_text(remote) or "").encode()[offset:]

    @abstractmethod
    def read_text(self, remote: str) -> str | None:
        """A small device file's text, or None when it does not exist."""

    @abstractmethod
    def write_text(self, remote: str, text: str) -> None:
        """Write a small text file (parents created)."""

    def hold_run_key(self, key_file: Path) -> None:
        """Keep the run key for the next starts, off the workdir (only devices whose workdir is not private)."""
        raise NotImplementedError(f"{self.name}: its workdir is private; deploy pushes the run key there")

    @abstractmethod
    def remove(self, remote: str) -> None:
        """Delete a device file or folder (nothing when it does not exist); global recovery drops newer checkpoints."""

    @abstractmethod
    def file_sha256(self, remote: str) -> str | None:
        """Hex sha256 of a device file, None when it does not exist (used to skip unchanged pushes)."""

    @abstractmethod
    def free_bytes(self) -> int:
        """Free space on the filesystem that holds the workdir."""

    # --- the runner ----------------------------------------------------------------------------------

    def install_runtime(self, force: bool = False, on_file: FileCallback | None = None,
                        on_bytes: ByteCallback | None = None) -> RuntimeInstall | None:
        """Install what runs stages here beyond the workdir's files; deploy calls it before pushing any.

        The default has nothing to install: the runner is `zl_runner` in the workdir, pushed with the stage
        files (`runs_runner_binary`). Returns None then.

        Args:
            force: install even when the same build is already there.
        """
        return None

    def keep_awake(self) -> str | None:
        """Keep the device from sleeping while a run's stages are on it (`restore_sleep` undoes it). Returns what
        was done, as a phrase for the live view; None when there is nothing to do (a local device)."""
        return None

    def restore_sleep(self) -> None:
        """Put back what `keep_awake` changed; nothing when it changed nothing."""

    def runner_version(self) -> str | None:
        """`zl_runner --version` of the runner in the workdir, run there as stages are (one line: zl's version,
        ExecuTorch's, the architecture, static or dynamic); None when none is there or it does not answer."""
        return None

    @abstractmethod
    def start_runner(self, config: str, resume: bool = False) -> None:
        """Start `zl_runner --config CONFIG [--resume]` in the workdir, in the background.

        Output is appended to runner.out / runner.err in the workdir.

        Raises:
            ZLError: a runner is already running here, or the binary is missing.
        """

    @abstractmethod
    def is_running(self) -> bool: ...

    @abstractmethod
    def exit_code(self) -> int | None:
        """The last runner's exit status (-N: killed by signal N); None while running or never started."""

    @abstractmethod
    def signal_runner(self, sig: int) -> bool:
        """Send `sig` to the runner; False when none is running."""

    @abstractmethod
    def runner_output(self) -> str:
        """What the runner printed on stdout since this object last started it (JSON event lines such as
        {"event": "listening", "port": 7101}); the whole runner.out when this object started none."""

    def stop_runner(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM (the runner stops and exits 3; resume later with --resume), then SIGKILL after `timeout_s`.

        Returns the exit code, or None when no runner had been started.
        """
        import signal

        if self.signal_runner(signal.SIGTERM) and not self.wait(timeout_s):
            self.signal_runner(signal.SIGKILL)
            self.wait(timeout_s)
        return self.exit_code()

    def kill_runner(self, timeout_s: float = 10.0) -> int | None:
        """SIGKILL at once, as a crash would (failure injection). Returns the exit code (-9)."""
        import signal

        if self.signal_runner(signal.SIGKILL):
            self.wait(timeout_s)
        return self.exit_code()

    # --- hot standby (docs/design#hot-standbys) --------------------------------------------------------

    #: Whether this backend can keep a hot standby runner (`zl_runner --standby`) beside the running one.
    supports_standby = False

    def start_standby(self, config: str) -> None:
        """Start `zl_runner --config CONFIG --standby` beside the running runner: it maps its program, loads
        the method and optimizer, then waits for `take_over`. At most one standby per device.

        Raises:
            ZLError: the backend has no standby, one is there already, or the binary or config is missing.
        """
        from zl_base.errors import ZLError

        raise ZLError(f"{self.name}: {self.kind} devices keep no hot standby; run without --standby.")

    def has_standby(self) -> bool:
        """A standby is alive here (loading or waiting)."""
        return False

    def take_over(self, timeout_s: float = 60.0) -> bool:
        """Tell the standby to take over: it restores the latest checkpoint, replays and connects, and is from
        now on this device's runner (exit_code, signal_runner, stop_runner act on it). Waits at most `timeout_s`
        for a standby still loading. False when there is none (or it died): start a runner instead.

        Raises:
            ZLError: the runner it would replace is still running.
        """
        return False

    def stop_standby(self) -> None:
        """End the standby, if any (also one a previous `zl train` left, by its pid file)."""

    def remove_tunnels(self) -> None:
        """Drop the port tunnels a run set up to this device (phones on USB only); nothing to do elsewhere."""

    def wait(self, timeout_s: float, poll_s: float = 0.05) -> bool:
        """Wait until the runner ended; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self.is_running():
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
        return True

    # --- probes --------------------------------------------------------------------------------------

    @abstractmethod
    def temperature_c(self) -> float | None:
        """Battery (phone) or CPU thermal zone (host) temperature in °C; None where there is no sensor."""

    @abstractmethod
    def pss_mib(self) -> float | None:
        """Proportional set size of the running runner in MiB; None when not running or unreadable."""


def sum_pss_kib(smaps: str) -> int | None:
    """Sum of the "Pss:" lines of /proc/PID/smaps_rollup (or smaps) in kB; None when there are none.

    "Pss_Anon:" and friends do not count: the key must end at the colon.
    """
    return sum_field_kib(smaps, "Pss")


def sum_field_kib(text: str, field: str) -> int | None:
    """Sum of the values (kB) of the `field:` lines of a /proc file (smaps, status); None when there are none."""
    total, found = 0, False
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key.strip() == field and rest.split():
            total += int(rest.split()[0])
            found = True
    return total if found else None


def excluded(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether an entry name matches one of the glob patterns."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def signal_exit_code(shell_status: int) -> int:
    """A shell's `$?` (128+N for a process killed by signal N) in subprocess's convention (-N)."""
    return -(shell_status - 128) if shell_status > 128 else shell_status
