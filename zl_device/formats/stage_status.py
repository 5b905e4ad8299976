"""What the flow knows about each stage while a run goes (`StageStatus`), folded from its telemetry lines the same
way in both runtimes (`fold_telemetry`): the live display's rows, and what the coordinator's recovery works from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class StageStatus:
    """What the flow knows about one stage, for the live display (and the coordinator's recovery)."""

    index: int
    device: str
    state: str = "starting"  # starting | running | pausing | paused | failed | restarting | done | error
    micro_batches_done: int = 0  # by this stage's telemetry / heartbeats
    last_committed_window: int = -1
    last_loss: float | None = None
    forward_only: bool = False  # held still by lr 0: phase 1 only, no loss to show (docs/design#windows-and-adamw)
    pss_mib: float | None = None  # latest reading (peaks and temperatures are the report's, from telemetry)
    restarts: int = 0
    last_sign_of_life: float = field(default_factory=time.monotonic)
    last_progress: float = field(default_factory=time.monotonic)  # a micro-batch done, a window committed, a start
    heartbeat_seen: bool = False
    control_seen: bool = False  # its runner's control frames come (REGISTER, then a HEARTBEAT every second)
    commit_times: dict[int, float] = field(default_factory=dict)  # window -> time.monotonic() of its commit
    pause_reason: str | None = None  # the policy limit holding it: pausing, then paused (docs/design#device-policies)
    paused_since: float | None = None  # time.monotonic() its runner stopped for the pause

    def progressed(self, micro_batches_done: int, t: float) -> None:
        """The stage reports `micro_batches_done` at `t` (time.monotonic()); counts only go up."""
        if micro_batches_done > self.micro_batches_done:
            self.micro_batches_done = micro_batches_done
            self.last_progress = max(self.last_progress, t)

    def committed(self, window: int, loss: float | None, t: float) -> None:
        """The stage committed `window` (mean loss `loss`) at `t`."""
        if window > self.last_committed_window:
            self.last_progress = max(self.last_progress, t)
        self.last_committed_window = max(self.last_committed_window, window)
        self.commit_times.setdefault(window, t)
        if loss is not None:
            self.last_loss = float(loss)
        if self.state in ("starting", "restarting"):
            self.state = "running"


def fold_telemetry(status: StageStatus, record: dict, now: float, lifecycle: bool = False) -> None:
    """One telemetry line of the stage into its status, seen at `now` (time.monotonic()).

    `micro_batch` and `window` lines are progress, for every runtime. With `lifecycle`, `start` and `done` lines
    also move the state (a later `start`: the stage restarted, from its `first_micro_batch`): for a runtime whose
    launcher tells the display nothing else (torch). The coordinator knows those from the runners' processes and
    its own restarts, and leaves `lifecycle` off. Other kinds are not progress.
    """
    kind = record.get("type")
    if kind in ("start", "micro_batch", "window") and "forward_only" in record:
        status.forward_only = record["forward_only"] is True  # its losses are null: not a missing reading
    if kind == "micro_batch":
        status.last_sign_of_life = now
        status.progressed(int(record["micro_batch"]) + 1, now)
        status.last_loss = record.get("loss")
        status.pss_mib = record.get("pss_mib") or status.pss_mib
        if status.state in ("starting", "restarting"):
            status.state = "running"
    elif kind == "window":
        status.committed(int(record["window"]), record.get("mean_loss"), now)
        status.pss_mib = record.get("pss_mib") or status.pss_mib  # a missing reading keeps the last one
    elif lifecycle and kind == "start":
        status.restarts += status.state != "starting"
        status.state = "running"
        status.last_progress = now
        if record.get("first_micro_batch") is not None:  # a restart rolled back to there
            status.micro_batches_done = int(record["first_micro_batch"])
        if "resumed_from_window" in record:
            resumed = record["resumed_from_window"]
            status.last_committed_window = -1 if resumed is None else int(resumed)
    elif lifecycle and kind == "done":
        status.state = "done"
