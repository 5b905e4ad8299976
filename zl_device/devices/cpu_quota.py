"""A CPU quota per local device (`--cpu-quota 1.0,0.5,0.75`): unequal phones emulated on one host.

A local device is a `zl_runner` process on this host. With a quota of `q` CPUs its runner may use at most `q` CPUs
of time per wall-clock second, whatever the host has spare, as a slower phone could not borrow its neighbour's
cores. Two mechanisms, the first that works:

- `cgroup`: the runner (all its threads) in a control group of its own under the cpu controller, capped by CFS
  bandwidth (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`/`cpu.cfs_period_us`) at `q` CPUs per `PERIOD_US`. Exact,
  for any `q` (also above 1 with several threads). Needs write access to the controller: root, or a cgroup
  delegated to this user.
- `throttle`: a thread of this process stops the runner (SIGSTOP) and lets it go on (SIGCONT) in a duty cycle of
  `THROTTLE_PERIOD_S`, running for the fraction `q` of each period. Works anywhere the runner may be signalled,
  but it caps the runner's *wall* time: a runner with several busy threads gets up to `q` x threads CPUs, and a
  quota of 1 or more is no cap at all. Coarser (a Python thread's timer on a busy host slips by a millisecond or
  two per switch) -- figures measured under it are indicative.

`ZL_CPU_QUOTA=cgroup|throttle` forces one (`auto`, the default, tries the cgroup first and says once on the log
when it falls back). Groups live under <cpu controller>/zl-devices/<device>-<pid>; one whose runner is gone (a zl
that was killed never released it) is removed the next time a group is made there.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
from collections.abc import Sequence
from pathlib import Path

from zl_base.errors import ZLError

log = logging.getLogger(__name__)

#: CFS bandwidth period: short, so a capped runner runs in slices of a few ms, as a slower CPU would, not in
#: 100 ms bursts (the kernel's default period).
PERIOD_US = 10_000
#: Duty cycle of the throttle fallback: long against the ~0.1 ms a signal takes, short against a micro-batch.
THROTTLE_PERIOD_S = 0.05
#: Where the groups go, below the cpu controller's root.
GROUP_BASE = "zl-devices"
#: Environment override of the mechanism.
MECHANISM_ENV = "ZL_CPU_QUOTA"
MECHANISMS = ("auto", "cgroup", "throttle")
#: The smallest quota, in CPUs: the kernel refuses CFS quotas below 1 ms per period (so a cgroup could not cap
#: lower than 1 ms per PERIOD_US), and below it a device works too slowly to plan or train on (0.0001 CPU took a
#: tiny-random `zl plan` 85 s).
MIN_CPUS = 1000 / PERIOD_US


def cgroup_cpu_root() -> Path:
    """Where this host's cpu controller is mounted: cgroup v1's /sys/fs/cgroup/cpu or the v2 unified tree."""
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.cfs_quota_us").is_file():
        return v1
    return Path("/sys/fs/cgroup")


def is_v2(root: Path) -> bool:
    """cgroup v2 (`cpu.max` per group) unless the root carries v1's `cpu.cfs_quota_us`."""
    return not (root / "cpu.cfs_quota_us").is_file()


def has_cpu_controller(root: Path) -> bool:
    """The tree at `root` can cap CPU: v1's cpu hierarchy, or a v2 tree that lists `cpu` in cgroup.controllers."""
    return not is_v2(root) or "cpu" in read_text(root / "cgroup.controllers").split()


def write_cpu_limit(group: Path, cpus: float, v2: bool) -> None:
    """Cap `group` at `cpus` CPUs per PERIOD_US (CFS bandwidth)."""
    quota = max(round(MIN_CPUS * PERIOD_US), round(cpus * PERIOD_US))  # the kernel refuses quotas below 1 ms
    if v2:
        (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
    else:
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(quota))


def enable_cpu_controller(root: Path, base: Path) -> None:
    """cgroup v2: children may only use the controllers their parent hands down (`+cpu` at each level)."""
    (root / "cgroup.subtree_control").write_text("+cpu")
    (base / "cgroup.subtree_control").write_text("+cpu")


def check_cpu_quota(quotas: Sequence[float] | None, flag: str = "--cpu-quota") -> None:
    """`--cpu-quota`'s check (zl_base/settings.py): every value a number of CPUs in [MIN_CPUS, this host's CPU
    count].

    Raises:
        ZLError: an empty list, a value out of range (zero, negative, not finite, more than the host has), or a
            positive one below MIN_CPUS.
    """
    if quotas is None:
        return
    host = os.cpu_count() or 1
    shown = ",".join(f"{q:g}" for q in quotas)
    if not quotas:
        raise ZLError(f"{flag} is empty; give the CPUs of each local device, e.g. {flag} 1.0,0.5,0.75.")
    bad = [q for q in quotas if not (math.isfinite(q) and 0 < q <= host)]
    if bad:
        raise ZLError(f"{flag} {shown}: {bad[0]:g} is out of range; each value is the CPUs one local device may use, "
                      f"more than 0 and at most this host's {host} (e.g. 0.5 = half a core), as in "
                      f"{flag} 1.0,0.5,0.75.")
    low = [q for q in quotas if q < MIN_CPUS]
    if low:
        raise ZLError(f"{flag} {shown}: {low[0]:g} CPU is below the floor of {MIN_CPUS:g} CPU a device can work at "
                      f"(a cgroup cannot cap lower); give {MIN_CPUS:g} or more, e.g. {flag} {MIN_CPUS:g}.")


def quotas_per_device(quotas: Sequence[float] | None, count: int, flag: str = "--cpu-quota") -> list[float | None]:
    """One quota per device of `count`: one value for all, or exactly one each (None: uncapped).

    Raises:
        ZLError: another number of values.
    """
    if quotas is None:
        return [None] * count
    check_cpu_quota(quotas, flag)
    if len(quotas) == 1:
        return [float(quotas[0])] * count
    if len(quotas) != count:
        shown = ",".join(f"{q:g}" for q in quotas)
        raise ZLError(f"{flag} {shown}: {len(quotas)} values for {count} local devices; give one value for every "
                      f"device or exactly {count}.")
    return [float(q) for q in quotas]


class CpuCap:
    """One runner process held to its quota until `release` (or until it exits)."""

    mechanism = ""

    def __init__(self, pid: int, cpus: float):
        self.pid, self.cpus = pid, cpus

    def release(self) -> None:
        """Lift the cap (a process still alive runs uncapped from here) and free what it used."""


class CgroupCap(CpuCap):
    """The process in <root>/zl-devices/<label>-<pid>, capped by CFS bandwidth."""

    mechanism = "cgroup"

    def __init__(self, pid: int, cpus: float, label: str, root: Path):
        super().__init__(pid, cpus)
        self.root, self.v2 = root, is_v2(root)
        base = root / GROUP_BASE
        self.group = base / f"{label}-{pid}"
        if not base.is_dir():
            base.mkdir()
            if self.v2:
                enable_cpu_controller(root, base)
        remove_stale_groups(base)
        self.group.mkdir()
        try:
            write_cpu_limit(self.group, cpus, self.v2)
            (self.group / "cgroup.procs").write_text(str(pid))  # every thread of it, and those it starts later
        except OSError:
            self.group.rmdir()
            raise

    def release(self) -> None:
        if Path(f"/proc/{self.pid}").exists():
            try:
                (self.root / "cgroup.procs").write_text(str(self.pid))
            except OSError:
                pass  # exited meanwhile
        try:
            self.group.rmdir()
        except OSError:
            pass  # a straggler still in it; the next group made under the base removes it


def remove_stale_groups(base: Path) -> None:
    """Remove the groups under `base` whose runner (the pid their name ends in) is gone: a zl that was killed
    never released them. A group whose runner lives is left alone, even while it is still being filled."""
    for group in base.iterdir():
        pid = group.name.rpartition("-")[2]
        if group.is_dir() and pid.isdigit() and not _alive(int(pid)):
            try:
                group.rmdir()
            except OSError:
                pass  # not empty after all, or a fake tree in a test


class ThrottleCap(CpuCap):
    """The process stopped and continued in a duty cycle: running `cpus` of every THROTTLE_PERIOD_S (cpus < 1)."""

    mechanism = "throttle"

    def __init__(self, pid: int, cpus: float, period_s: float = THROTTLE_PERIOD_S):
        super().__init__(pid, cpus)
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._cycle, name=f"cpu-throttle-{pid}", daemon=True)
        if cpus < 1:  # a duty cycle cannot give more than all of the wall time
            self._thread.start()

    def _cycle(self) -> None:
        run_s, stop_s = self.cpus * self.period_s, (1 - self.cpus) * self.period_s
        try:
            while not self._stop.wait(run_s) and _alive(self.pid):
                os.kill(self.pid, signal.SIGSTOP)
                stopped = self._stop.wait(stop_s)
                os.kill(self.pid, signal.SIGCONT)
                if stopped:
                    break
        except ProcessLookupError:
            pass  # exited

    def release(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        try:
            os.kill(self.pid, signal.SIGCONT)  # never leave it stopped
        except ProcessLookupError:
            pass


def cap_process(pid: int, cpus: float, label: str, root: Path | None = None, mechanism: str | None = None) -> CpuCap:
    """Hold process `pid` (a local device's runner, named `label`) to `cpus` CPUs until the cap is released.

    Args:
        mechanism: "cgroup", "throttle" or "auto" (default: $ZL_CPU_QUOTA, else auto: the cgroup when this host
            lets us make one, else the throttle).

    Raises:
        ZLError: an unknown mechanism, or `cgroup` asked for where it cannot be made.
    """
    mechanism = mechanism or os.environ.get(MECHANISM_ENV, "auto")
    if mechanism not in MECHANISMS:
        raise ZLError(f"{MECHANISM_ENV}={mechanism}: expected one of {', '.join(MECHANISMS)}.")
    if mechanism != "throttle":
        root = root or cgroup_cpu_root()
        why = None if has_cpu_controller(root) else f"no cpu controller at {root}"
        if why is None:
            try:
                return CgroupCap(pid, cpus, label, root)
            except OSError as e:
                why = f"cannot make a control group under {root}: {e}"
        if mechanism == "cgroup":
            raise ZLError(f"--cpu-quota: {why}; it needs root or a delegated cgroup. Unset {MECHANISM_ENV} to use "
                          "the SIGSTOP/SIGCONT throttle instead.")
        _say_fallback_once(why)
    return ThrottleCap(pid, cpus)


_fallback_said = False


def _say_fallback_once(why: str) -> None:
    global _fallback_said
    if not _fallback_said:
        log.warning("--cpu-quota: %s; capping local devices with a SIGSTOP/SIGCONT duty cycle instead (wall time, "
                    "coarser: docs/design#planning)", why)
        _fallback_said = True


def _alive(pid: int) -> bool:
    """Running or stopped, not a zombie (a zombie takes signals and ignores them)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def read_text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""
