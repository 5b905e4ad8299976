"""The coordinator's one table of stages (docs/design#coordinator): where each stage runs (`StagePlan`), how it is doing
(`StageStatus`), the run's window plan, and the events its parts record for metrics.jsonl.

Every part of the coordinator (health.py, recovery.py, pauses.py) reads and updates this table and nothing of the
others': the loop (coordinator.py) hands what one part found to the next.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from zl_device.devices.backend import Device
from zl_device.formats.metrics_log import LineTail
from zl_device.formats.stage_status import StageStatus, fold_telemetry
from zl_device.formats.windows import WindowPlan


@dataclass
class StagePlan:
    """Where and how stage k runs: its device, its config's name on the device, its telemetry file there."""

    index: int
    device: Device
    config: str  # remote config name, e.g. stage_1.json
    log_path: str  # remote telemetry file, e.g. metrics.jsonl
    checkpoint_dir: str  # remote checkpoint folder
    input_bytes: int  # bytes of one input entry (hidden + mask + labels, or a shard row)


class StageTable:
    """The stages of a run as the coordinator's parts share them (module docstring)."""

    def __init__(self, plans: Sequence[StagePlan], windows: WindowPlan):
        self.plans = list(plans)
        self.windows = windows
        self.status = [StageStatus(p.index, p.device.name) for p in self.plans]
        self.events: list[dict] = []  # coordinator events for metrics.jsonl (zl_device/formats/metrics_log.py)
        self.hold_seen = False  # a stage's telemetry said it parked at its injected failure's hold point
        self._tails = [LineTail() for _ in self.plans]  # each stage's telemetry file as read so far

    def __len__(self) -> int:
        return len(self.plans)

    def read_telemetry(self, k: int, remote: bool = False) -> None:
        """New lines of a stage's telemetry file: tailed where its files are on this host (local devices); on
        phones, which report through heartbeats, read over adb only when `remote` (at a failure: a heartbeat may
        be a window behind)."""
        plan = self.plans[k]
        if not (plan.device.files_on_host or remote):
            return
        s, now = self.status[k], time.monotonic()
        for record in self._tails[k].feed(plan.device.read_from(plan.log_path, self._tails[k].offset)):
            fold_telemetry(s, record, now)
            if record.get("type") == "hold":
                self.hold_seen = True

    def read_all_telemetry(self, remote: bool = False) -> None:
        """`read_telemetry` of every stage."""
        for k in range(len(self.plans)):
            self.read_telemetry(k, remote)

    def downstream(self, k: int) -> StagePlan | None:
        """The plan of the stage after stage k; None after the last."""
        return self.plans[k + 1] if k + 1 < len(self.plans) else None

    def move(self, k: int, device: Device) -> None:
        """Stage k runs on `device` from now on (a spare took it over): its telemetry is read there from the start."""
        self.plans[k].device = device
        self.status[k].device = device.name
        self._tails[k] = LineTail()

    def finished(self, k: int) -> None:
        """Stage k's runner exited 0: it has done every micro-batch of the run."""
        s = self.status[k]
        s.state = "done"
        s.micro_batches_done = max(s.micro_batches_done, self.windows.num_micro_batches)

    def waiting_from(self, t: float) -> None:
        """The stages now wait for one that is restarting (and may still show counts from before it rolled back):
        none of them is stalled until it has had a full stall timeout from `t` (time.monotonic())."""
        for s in self.status:
            s.last_progress = max(s.last_progress, t)

    def stop_runners(self) -> None:
        for plan in self.plans:
            plan.device.stop_runner(timeout_s=5)


def unix_ms() -> int:
    """Now, in Unix milliseconds (the events' clock)."""
    return int(time.time() * 1000)
