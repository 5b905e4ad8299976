"""Separate devices emulated on one host, for the benchmarks: a CPU quota per rank and one shaped link.

Ranks on one host share its cores: a rank that waits for a neighbour (a backprop pipeline's bubble) hands its core
to the others, which a phone in a pipeline cannot do, and neighbours talk over loopback at tens of Gbit/s where
phones share a Wi-Fi link. Two context managers put that back, for the length of a benchmark run:

- `CpuQuota(cpus)`: every rank process (a torch rank spawned by `launch_ranks`, or a `zl_runner`) that appears
  below this process goes into a control group of its own capped at `cpus` CPUs (CFS quota; cgroup v1's cpu
  controller or cgroup v2's cpu.max). What a rank leaves idle is lost, as on its own device.
- `ShapedLoopback(mbit)`: one token-bucket filter (`tc qdisc ... tbf`) on the loopback interface, so all traffic
  between the ranks shares `mbit` Mbit/s, like phones on one access point. Bandwidth only: this kernel may lack
  netem, so no added delay. It changes the host's loopback for everything on it until the block ends (and, if the
  process is killed hard, until `tc qdisc del dev lo root`).

Both need root (or the matching capabilities) and say so, naming what to do, when they cannot set up. The cgroup
mechanics (where the cpu controller is, how a group is capped) are zl_device/devices/cpu_quota.py's, which also
gives `zl train`'s local devices a quota each (`--cpu-quota 1.0,0.5,0.75`, with a SIGSTOP/SIGCONT fallback): use
that for unequal devices; `CpuQuota` caps every rank alike, for the torch ranks of bench_pipelines.py, which are
no devices.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
from pathlib import Path

from zl_base.errors import ZLError
from zl_device.devices.cpu_quota import (  # noqa: F401  (PERIOD_US, cgroup_cpu_root: this tool's API too)
    PERIOD_US,
    cgroup_cpu_root,
    enable_cpu_controller,
    has_cpu_controller,
    is_v2,
    write_cpu_limit,
)
from zl_device.devices.cpu_quota import read_text as _read

# torch.multiprocessing's spawned ranks (not its resource tracker) and the ExecuTorch runner.
RANK_COMMAND = re.compile(r"spawn_main|zl_runner")


def descendants(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """The pids below `pid` (children, their children, ...), from each process's parent in /proc/PID/stat."""
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])  # after "pid (comm) state"; comm may hold spaces
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return sorted(found)


def command_line(pid: int, proc: Path = Path("/proc")) -> str:
    """A process's command line with spaces between its arguments ('' once it is gone)."""
    try:
        return (proc / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class CpuQuota:
    """Each rank process below this one in a cgroup of its own capped at `cpus` CPUs, while the block runs.

    A thread looks for new rank processes every `poll_s` (ranks spend their first seconds importing torch or
    mapping their program, so none has trained yet when it is placed); `placed` counts them. On exit the
    processes still alive go back to the root group and the groups are removed.
    """

    def __init__(self, cpus: float, root: Path | None = None, proc: Path = Path("/proc"), poll_s: float = 0.05):
        if not cpus > 0:
            raise ZLError(f"--cpus-per-rank {cpus}: give a positive number of CPUs per rank, e.g. 0.66.")
        self.cpus, self.proc, self.poll_s = cpus, proc, poll_s
        self.root = root or cgroup_cpu_root()
        self.v2 = is_v2(self.root)
        self.base = self.root / f"zl-bench-{os.getpid()}"
        self.groups: dict[int, Path] = {}  # pid -> its group
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def placed(self) -> int:
        return len(self.groups)

    def __enter__(self) -> CpuQuota:
        if not has_cpu_controller(self.root):
            raise ZLError(f"--cpus-per-rank: no cpu controller at {self.root} (cgroup v1 mounts it at "
                          "/sys/fs/cgroup/cpu, v2 lists it in cgroup.controllers); run without --cpus-per-rank.")
        try:
            self.base.mkdir()
            if self.v2:  # children of the root may only use the controllers it hands down
                enable_cpu_controller(self.root, self.base)
        except OSError as e:
            raise ZLError(f"--cpus-per-rank: cannot create the control group {self.base}: {e}; it needs root "
                          "(or a cgroup delegated to you), or run without --cpus-per-rank.") from e
        self._thread = threading.Thread(target=self._watch, name="cpu-quota", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for pid, group in self.groups.items():
            if (self.proc / str(pid)).exists():
                try:
                    (self.root / "cgroup.procs").write_text(str(pid))
                except OSError:
                    pass  # exited meanwhile
            try:
                group.rmdir()
            except OSError:
                pass  # still populated by a straggler; the kernel frees it with the last process
        try:
            self.base.rmdir()
        except OSError:
            pass

    def place_new(self) -> None:
        """Put every rank process below this one that has no group yet into one of its own."""
        for pid in descendants(os.getpid(), self.proc):
            if pid in self.groups or not RANK_COMMAND.search(command_line(pid, self.proc)):
                continue
            group = self.base / f"rank-{len(self.groups)}-{pid}"
            group.mkdir()
            write_cpu_limit(group, self.cpus, self.v2)
            try:
                (group / "cgroup.procs").write_text(str(pid))  # all its threads
            except OSError:  # exited before it could be placed
                group.rmdir()
                continue
            self.groups[pid] = group

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.place_new()


class ShapedLoopback:
    """One tbf qdisc on `device` (loopback) at `mbit` Mbit/s while the block runs; removed on exit."""

    def __init__(self, mbit: float, device: str = "lo", run=subprocess.run):
        if not mbit > 0:
            raise ZLError(f"--link-mbit {mbit}: give the shared link's bandwidth in Mbit/s, e.g. 50.")
        self.mbit, self.device, self._run = mbit, device, run
        self.added = False

    def tc(self, *args: str) -> subprocess.CompletedProcess:
        return self._run(["tc", *args], capture_output=True, text=True)

    def burst_bytes(self) -> int:
        """The bucket: two of the device's largest packets (tbf passes nothing bigger than its bucket), or 2 ms at
        the rate if that is more."""
        mtu = int(_read(Path(f"/sys/class/net/{self.device}/mtu")) or 65536)
        return max(2 * mtu, round(self.mbit * 1e6 / 8 * 0.002))

    def __enter__(self) -> ShapedLoopback:
        if shutil.which("tc") is None and self._run is subprocess.run:
            raise ZLError("--link-mbit needs `tc` (Debian: apt-get install iproute2); or run without --link-mbit.")
        shown = self.tc("qdisc", "show", "dev", self.device)
        root = next((line for line in shown.stdout.splitlines() if " root " in f" {line} "), "")
        if root and not root.startswith("qdisc noqueue"):
            raise ZLError(f"--link-mbit: {self.device} already has a root qdisc ({root.strip()}); the benchmark "
                          f"will not replace it. Remove it (tc qdisc del dev {self.device} root) or run without "
                          "--link-mbit.")
        added = self.tc("qdisc", "add", "dev", self.device, "root", "tbf", "rate", f"{self.mbit:g}mbit",
                        "burst", str(self.burst_bytes()), "latency", "50ms")
        if added.returncode != 0:
            raise ZLError(f"--link-mbit: `tc qdisc add dev {self.device} root tbf ...` failed: "
                          f"{added.stderr.strip()}; it needs root (CAP_NET_ADMIN). Or run without --link-mbit.")
        self.added = True
        return self

    def __exit__(self, *exc) -> None:
        if self.added:
            self.tc("qdisc", "del", "dev", self.device, "root")
            self.added = False

    def sent_bytes(self) -> int | None:
        """Bytes the qdisc has passed so far (`tc -s`), or None when it is not there."""
        m = re.search(r"Sent (\d+) bytes", self.tc("-s", "qdisc", "show", "dev", self.device).stdout)
        return int(m.group(1)) if m and self.added else None
