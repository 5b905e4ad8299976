"""The `local` backend: a device is a folder on this host and a `zl_runner` child process.

`--devices local:3` makes RUN_DIR/devices/local-0 .. local-2. They stand in
for phones in tests and benchmarks: optional CPU pinning (so three stages do
not share cores the way they would not share a phone's), a CPU quota per
device (`--cpu-quota 1.0,0.5,0.75`: unequal phones, cpu_quota.py), and a link
profile the stage configs pass to the runner's link shaping (of DATA down and GRAD up).

A local device may run another build than this host's: `--runner PATH` is the binary deploy
puts in its folder, `--runner-prefix CMD` the command it is started under. With the static
phone build of tools/build_phone_runner.sh and `qemu-aarch64`, the three "phones" of
`--devices local:3` run the very file `--mode binary` pushes to a phone (issue 41).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from zl_base.errors import ZLError
from zl_device.devices.backend import (
    RUNNER_EXIT,
    RUNNER_NAME,
    RUNNER_PID,
    RUNNER_STDERR,
    RUNNER_STDOUT,
    STANDBY_PID,
    ByteCallback,
    Device,
    DeviceInfo,
    elf_machine,
    excluded,
    sum_pss_kib,
)
from zl_device.devices.cpu_quota import CpuCap, cap_process

REPO = Path(__file__).resolve().parents[2]
#: Environment override for the host runner binary (same variable as tests/test_runner.py).
RUNNER_ENV = "ZL_RUNNER_BIN"
_CHUNK = 1 << 20  # copy granularity for progress callbacks, bytes


def host_runner_binary() -> Path:
    """The host build of zl_runner: $ZL_RUNNER_BIN, else build/runner/zl_runner.

    Raises:
        ZLError: it is not built.
    """
    path = Path(os.environ.get(RUNNER_ENV, REPO / "build" / "runner" / RUNNER_NAME))
    if not path.is_file():
        raise ZLError(
            f"{path}: the host zl_runner is not built; run `bash setup.sh` or "
            f"`cmake --build build -j2 --target zl_runner` (or set {RUNNER_ENV} to a built binary)."
        )
    return path


def local_runner_command(binary: Path | None, prefix: str | None) -> tuple[Path | None, tuple[str, ...]]:
    """`--runner` and `--runner-prefix` of local devices, checked: the binary (absolute; None: this host's
    build) and the prefix's words.

    Raises:
        ZLError: a binary that is missing or not executable, a prefix whose command is not on PATH, or a binary
            built for another architecture than this host's with no prefix to run it.
    """
    words = tuple(shlex.split(prefix)) if prefix else ()
    if prefix is not None and not words:
        raise ZLError(f"--runner-prefix {prefix!r}: empty; give the command that runs the runner, e.g. "
                      "--runner-prefix qemu-aarch64, or drop the option.")
    if words and shutil.which(words[0]) is None:
        raise ZLError(f"--runner-prefix {prefix!r}: {words[0]} is not on PATH; install it (qemu-aarch64: "
                      "`sudo apt-get install qemu-user`) or give its full path.")
    if binary is None:
        return None, words
    binary = Path(binary).expanduser().resolve()
    if not binary.is_file() or not os.access(binary, os.X_OK):
        raise ZLError(f"--runner {binary}: no executable file there; build it (this host's: `bash setup.sh`; the "
                      "phone's: `tools/build_phone_runner.sh`, into build-phone/zl/runner/zl_runner) "
                      "or fix the path.")
    arch, host = elf_machine(binary), platform.machine()
    if not words and arch is not None and arch != host:
        raise ZLError(f"--runner {binary}: built for {arch}, this host is {host}; run it under an emulator, e.g. "
                      f"--runner-prefix qemu-{arch}, or pass a {host} build.")
    return binary, words


class LocalDevice(Device):
    """A working directory plus one runner process on this host.

    Args:
        name: "local-0", ...
        workdir: the device's folder (created).
        runner: the command to start instead of the deployed or built zl_runner (tests inject a dummy
            process here); `--config FILE [--resume]` is appended.
        cpus: pin the runner to these CPU ids (taskset, or sched_setaffinity where taskset is missing).
        link_profile: the link profile of stages placed here (local, wifi, mobile, constrained).
        cpu_quota: cap every runner (and standby) started here at this many CPUs (cpu_quota.py); None: uncapped.
        runner_binary: the zl_runner build deploy puts here (checked by `local_runner_command`); None: this host's
            (`host_runner_binary`).
        runner_prefix: the command the runner is started under, e.g. ("qemu-aarch64",) for the phone build.
    """

    kind = "local"
    files_on_host = True

    def __init__(
        self,
        name: str,
        workdir: Path,
        runner: Sequence[str] | None = None,
        cpus: Sequence[int] | None = None,
        link_profile: str = "local",
        cpu_quota: float | None = None,
        runner_binary: Path | None = None,
        runner_prefix: Sequence[str] = (),
    ):
        workdir = Path(workdir).resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        super().__init__(name, str(workdir), link_profile)
        self.runner = list(runner) if runner else None
        self.cpus = tuple(cpus) if cpus else None
        self.cpu_quota = cpu_quota
        self.runner_binary = Path(runner_binary) if runner_binary else None
        self.runner_prefix = tuple(runner_prefix)
        self._caps: dict[int, CpuCap] = {}  # runner or standby pid -> its cap, until it is seen to end
        self._proc: subprocess.Popen | None = None
        self._out_offset = 0
        self._standby: subprocess.Popen | None = None
        self._standby_out_offset = 0  # runner.out's size when the standby started (its "standby" line follows)

    def _local(self, remote: str) -> Path:
        return Path(self.path(remote))

    # --- description ---------------------------------------------------------------------------------

    def info(self) -> DeviceInfo:
        cpus = f"CPUs {','.join(map(str, self.cpus))}" if self.cpus else f"{os.cpu_count()} CPUs"
        if self.cpu_quota is not None:
            cpus += f", quota {self.cpu_quota:g} CPU"
        return DeviceInfo(self.name, self.kind, "ready", model=platform.node() or "this host",
                          abi=platform.machine(), note=f"{cpus}, {self.workdir}")

    def address(self) -> str | None:
        return "127.0.0.1"

    # --- files ---------------------------------------------------------------------------------------

    def push(self, local: Path, remote: str, mode: int | None = None, on_bytes: ByteCallback | None = None) -> int:
        src, dst = Path(local), self._local(remote)
        if not src.is_file():
            raise ZLError(f"{src}: no such file to push to {self.name}.")
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.exists() and os.path.samefile(src, dst):
            return 0
        # Copy to a temp name and rename: a runner never sees half a program.
        tmp = dst.with_name(f".{dst.name}.tmp")
        copied = 0
        mode = mode if mode is not None else (src.stat().st_mode & 0o777)
        tmp.unlink(missing_ok=True)  # a leftover could carry wider permissions than `mode`
        # Created with `mode` (a key: 0600), not chmod-ed after: never readable by others on the way.
        with open(src, "rb") as fin, os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as fout:
            while chunk := fin.read(_CHUNK):
                fout.write(chunk)
                copied += len(chunk)
                if on_bytes:
                    on_bytes(len(chunk))
        os.chmod(tmp, mode)  # the umask may have narrowed it (0755 for the runner must stay executable)
        tmp.replace(dst)
        return copied

    def pull(self, remote: str, local: Path, exclude: tuple[str, ...] = ()) -> int:
        src, dst = self._local(remote), Path(local)
        if not src.exists():
            raise ZLError(f"{self.name}: {src} does not exist; nothing to pull.")
        if src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
            return dst.stat().st_size
        total = 0
        for root, dirs, files in os.walk(src):
            dirs[:] = [d for d in dirs if not excluded(d, exclude)]
            out = dst / Path(root).relative_to(src)
            out.mkdir(parents=True, exist_ok=True)
            for f in files:
                if not excluded(f, exclude):
                    shutil.copy2(Path(root) / f, out / f)
                    total += (out / f).stat().st_size
        return total

    def exists(self, remote: str) -> bool:
        return self._local(remote).exists()

    def listdir(self, remote: str = ".") -> list[str]:
        p = self._local(remote)
        return sorted(os.listdir(p)) if p.is_dir() else []

    def read_from(self, remote: str, offset: int) -> bytes:
        try:
            with self._local(remote).open("rb") as f:
                f.seek(offset)
                return f.read()
        except FileNotFoundError:
            return b""

    def read_text(self, remote: str) -> str | None:
        p = self._local(remote)
        return p.read_text(errors="replace") if p.is_file() else None

    def write_text(self, remote: str, text: str) -> None:
        p = self._local(remote)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.tmp")
        tmp.write_text(text)
        tmp.replace(p)

    def remove(self, remote: str) -> None:
        p = self._local(remote)
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()

    def file_sha256(self, remote: str) -> str | None:
        p = self._local(remote)
        if not p.is_file():
            return None
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        return h.hexdigest()

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.workdir).free

    # --- the runner ----------------------------------------------------------------------------------

    def _command(self) -> list[str]:
        if self.runner:
            return list(self.runner)
        deployed = self._local(RUNNER_NAME)
        binary = deployed if deployed.is_file() else self.runner_binary or host_runner_binary()
        return [*self.runner_prefix, str(binary)]

    def runner_version(self) -> str | None:
        if self.runner or not self.exists(RUNNER_NAME):
            return None
        try:
            done = subprocess.run(self._command() + ["--version"], cwd=self.workdir, stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return (done.stdout.strip() or None) if done.returncode == 0 else None

    def start_runner(self, config: str, resume: bool = False) -> None:
        if self.is_running():
            raise ZLError(f"{self.name}: a runner is already running (pid {self._pid()}); stop it first.")
        out_path = self._local(RUNNER_STDOUT)
        self._out_offset = out_path.stat().st_size if out_path.exists() else 0
        self._local(RUNNER_EXIT).unlink(missing_ok=True)
        self._proc = self._spawn(config, ["--resume"] if resume else [])
        self._local(RUNNER_PID).write_text(f"{self._proc.pid}\n")

    def _spawn(self, config: str, flags: list[str]) -> subprocess.Popen:
        """`zl_runner --config CONFIG FLAGS` in the workdir, output appended to runner.out / runner.err."""
        if not self._local(config).is_file():
            raise ZLError(f"{self.name}: config {self._local(config)} does not exist; deploy it first.")
        cmd = self._command() + ["--config", config] + flags
        taskset = shutil.which("taskset") if self.cpus else None
        if taskset:
            cmd = [taskset, "-c", ",".join(map(str, self.cpus))] + cmd
        with open(self._local(RUNNER_STDOUT), "ab") as out, open(self._local(RUNNER_STDERR), "ab") as err:
            try:
                # A session of its own: Ctrl-C in the orchestrator's terminal must not reach the stages.
                proc = subprocess.Popen(cmd, cwd=self.workdir, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=err, start_new_session=True)
            except OSError as e:
                raise ZLError(f"{self.name}: cannot start {cmd[0]}: {e}.") from e
        if self.cpus and not taskset:
            # Threads the runner creates later inherit this mask; only a thread started in the first
            # microseconds could escape it.
            try:
                os.sched_setaffinity(proc.pid, self.cpus)
            except OSError as e:
                proc.kill()
                raise ZLError(f"{self.name}: cannot pin to CPUs {self.cpus}: {e}; available: "
                              f"{sorted(os.sched_getaffinity(0))}.") from e
        if self.cpu_quota is not None:
            self._release_ended_caps()
            try:  # microseconds after the start: the runner is still mapping its program
                self._caps[proc.pid] = cap_process(proc.pid, self.cpu_quota, self.name)
            except ZLError:
                proc.kill()
                proc.wait()
                raise
        return proc

    def _release_ended_caps(self) -> None:
        """Free the caps of runners and standbys that have ended (their cgroup, their throttle thread)."""
        live = {p.pid for p in (self._proc, self._standby) if p is not None and p.poll() is None}
        for pid in [pid for pid in self._caps if pid not in live]:
            self._caps.pop(pid).release()

    @property
    def cap_mechanism(self) -> str | None:
        """How the quota holds the current runner ("cgroup" or "throttle"); None when uncapped or not running."""
        cap = self._caps.get(self._proc.pid) if self._proc is not None else None
        return cap.mechanism if cap else None

    # --- hot standby (docs/design#hot-standbys) --------------------------------------------------------

    supports_standby = True

    def start_standby(self, config: str) -> None:
        if self.has_standby():
            raise ZLError(f"{self.name}: a standby is already waiting (pid {self._standby.pid}); stop it first.")
        out_path = self._local(RUNNER_STDOUT)
        self._standby_out_offset = out_path.stat().st_size if out_path.exists() else 0
        self._standby = self._spawn(config, ["--standby"])
        self._local(STANDBY_PID).write_text(f"{self._standby.pid}\n")

    def has_standby(self) -> bool:
        return self._standby is not None and self._standby.poll() is None

    def _standby_ready(self) -> bool:
        """The standby printed its {"event": "standby"} line: loaded, SIGUSR1 blocked, waiting."""
        text = self.read_from(RUNNER_STDOUT, self._standby_out_offset).decode(errors="replace")
        return any(f'"pid": {self._standby.pid}' in line for line in text.splitlines()
                   if '"event": "standby"' in line)

    def take_over(self, timeout_s: float = 60.0) -> bool:
        if self.is_running():
            raise ZLError(f"{self.name}: the runner (pid {self._pid()}) is still running; stop it before its "
                          f"standby takes over.")
        deadline = time.monotonic() + timeout_s
        # Until its "standby" line the process may not have blocked SIGUSR1 yet (the signal would kill it).
        while self.has_standby() and not self._standby_ready():
            if time.monotonic() >= deadline:
                self.stop_standby()
                return False
            time.sleep(0.005)
        if not self.has_standby():
            self._standby = None
            self._local(STANDBY_PID).unlink(missing_ok=True)
            return False
        proc, self._standby = self._standby, None
        out_path = self._local(RUNNER_STDOUT)
        self._out_offset = out_path.stat().st_size if out_path.exists() else 0
        self._local(RUNNER_EXIT).unlink(missing_ok=True)
        os.kill(proc.pid, signal.SIGUSR1)
        self._proc = proc
        self._local(RUNNER_PID).write_text(f"{proc.pid}\n")
        self._local(STANDBY_PID).unlink(missing_ok=True)
        return True

    def stop_standby(self) -> None:
        proc, self._standby = self._standby, None
        if proc is not None:
            proc.kill()  # it holds nothing yet: no checkpoint, port or input log
            proc.wait()
            if self._caps:
                self._release_ended_caps()
        else:
            text = self.read_text(STANDBY_PID)
            pid = int(text) if text and text.strip().isdigit() else None
            if pid is not None and self._alive_elsewhere(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self._local(STANDBY_PID).unlink(missing_ok=True)

    def _pid(self) -> int | None:
        if self._proc is not None:
            return self._proc.pid
        text = self.read_text(RUNNER_PID)
        return int(text) if text and text.strip().isdigit() else None

    def _alive_elsewhere(self, pid: int) -> bool:
        """A runner started by another zl process: alive, not a zombie, and still in this workdir."""
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            return stat.rsplit(")", 1)[1].split()[0] != "Z" and os.readlink(f"/proc/{pid}/cwd") == self.workdir
        except OSError:
            return False

    def is_running(self) -> bool:
        if self._proc is not None:
            if self._proc.poll() is None:
                return True
            self._record_exit()
            return False
        pid = self._pid()
        return pid is not None and self._alive_elsewhere(pid)

    def _record_exit(self) -> None:
        exit_path = self._local(RUNNER_EXIT)
        if not exit_path.exists():
            exit_path.write_text(f"{self._proc.returncode}\n")
        if self._caps:
            self._release_ended_caps()

    def exit_code(self) -> int | None:
        if self._proc is not None:
            code = self._proc.poll()
            if code is not None:
                self._record_exit()
            return code
        text = self.read_text(RUNNER_EXIT)
        return int(text) if text and text.strip().lstrip("-").isdigit() and not self.is_running() else None

    def signal_runner(self, sig: int) -> bool:
        if not self.is_running():
            return False
        try:
            os.kill(self._pid(), sig)
        except ProcessLookupError:
            return False
        return True

    def wait(self, timeout_s: float, poll_s: float = 0.05) -> bool:
        if self._proc is None:
            return super().wait(timeout_s, poll_s)
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        self._record_exit()
        return True

    def runner_output(self) -> str:
        """What the runner printed on stdout since the last start by this object (JSON event lines)."""
        text = self._local(RUNNER_STDOUT).read_bytes() if self.exists(RUNNER_STDOUT) else b""
        return text[self._out_offset:].decode(errors="replace")

    # --- probes --------------------------------------------------------------------------------------

    def temperature_c(self) -> float | None:
        return thermal_zone_celsius()

    def pss_mib(self) -> float | None:
        pid = self._pid()
        if pid is None or not self.is_running():
            return None
        for name in ("smaps_rollup", "smaps"):
            try:
                kib = sum_pss_kib(Path(f"/proc/{pid}/{name}").read_text())
            except OSError:
                continue
            if kib is not None:
                return kib / 1024.0
        return None


# Thermal zones that measure the CPU package, as the runner's telemetry picks them
# (runner/src/telemetry.cpp): battery, wifi and ACPI "virtual" zones say nothing about load.
_ZONE_KEYS = ("cpu", "soc", "pkg", "package", "coretemp", "acpitz", "tsens")


def thermal_zone_celsius(root: Path = Path("/sys/class/thermal")) -> float | None:
    """The first plausible CPU thermal zone in °C (millidegrees in sysfs); None when there is none."""
    if not root.is_dir():
        return None
    zones = sorted((int(p.name[len("thermal_zone"):]), p) for p in root.glob("thermal_zone*")
                   if p.name[len("thermal_zone"):].isdigit())
    for _, zone in zones:
        try:
            kind = (zone / "type").read_text().strip().lower()
            if not any(key in kind for key in _ZONE_KEYS):
                continue
            celsius = int((zone / "temp").read_text().strip()) / 1000.0
        except (OSError, ValueError):
            continue
        if -40.0 < celsius < 150.0:
            return celsius
    return None
