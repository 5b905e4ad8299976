"""When a stage has failed, as the coordinator sees it (docs/design#control-channel, #failure-detection).

Membership: every stage's runner registers and sends heartbeats on the
control channel (zl_device/executorch/control.py); on local devices the coordinator
also reads each runner's telemetry file as it grows, so progress shows even
without a control connection; on phones it reads that file over adb when a
stage fails, to know the window in flight (heartbeats come once a second). A stage has failed when its process exits
with a non-zero status or, once it has sent a heartbeat, when no heartbeat
arrived for `heartbeat_timeout_s`.

A stage alive but without progress while its input is there has stalled (`stall_timeout_s`); the stall is traced
to the stage it comes from (`stalled_stage`). Time the host itself did not run is no stage's silence
(`HOST_GAP_S`).

`Health` reads the stage table (stage_table.py) and returns what it found about a stage (`Verdict`: finished,
fatal, failed and why); the coordinator's loop hands a failed stage to the recovery (recovery.py), a stage that
stopped for a pause to the pauses (pauses.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from zl_device.executorch.device_files import stderr_tail
from zl_device.executorch.stage_table import StageTable

log = logging.getLogger(__name__)

# A stage whose heartbeats (every second, from the runner's timer thread) stopped this long while the pipeline
# stalls is the stage that stopped -- SIGSTOP, a frozen phone, a hung process -- whatever the micro-batch counts
# say (`silent_stage`): under a flushed schedule the counts of every stage can be level at a window's edge, and
# the count rule then blamed a starved neighbour (issue 56). Well under `heartbeat_timeout_s`, which fails such a
# stage by itself when no stall is seen first.
SILENT_S = 3.0  # three heartbeats missed

# A pass of the coordinator's loop that began this much later than it should have means the host itself did not run
# (a laptop starved by other work, suspended or swapping): heartbeats sent meanwhile are queued, not missing, so
# that time is no stage's silence (`Health.forgive_host_gap`).
HOST_GAP_S = 5.0


@dataclass(frozen=True)
class Verdict:
    """What the health checks found about one stage; the coordinator's loop acts on it (coordinator.py)."""

    stage: int
    kind: str  # finished (exit 0) | fatal (exit 2: not retried) | failed (any other exit, silence, a stall)
    why: str = ""  # failed: "exited with status -9", "heartbeat timeout", "stalled: ..."; fatal: the whole message
    code: int | None = None  # the runner's exit status, where it exited
    kill: bool = False  # its runner is still there (silent or stalled): the loop kills it before the recovery
    stalled_s: float | None = None  # a stall: how long the stage made no progress


class Health:
    """Exit statuses, heartbeats and stalls of the stages in a `StageTable` (module docstring): each check returns
    what it found (`Verdict`) and changes nothing but the clocks it forgives (`forgive_host_gap`)."""

    def __init__(self, table: StageTable, heartbeat_timeout_s: float, stall_timeout_s: float, backprop: bool):
        self.table = table
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.stall_timeout_s = stall_timeout_s  # 0: no stall detection
        self.backprop = backprop  # a backprop schedule: a stage's progress waits on its downstream's gradients

    def forgive_host_gap(self, gap_s: float) -> None:
        """Move every stage's heartbeat and progress clocks on by the `gap_s` seconds the coordinator did not run,
        when that is more than HOST_GAP_S: under load (all three stages of a run on a 2-core host with other jobs
        were once blamed together after a 37 s gap) a stage is judged only on the time the host watched it. A
        stage that really died is found `gap_s` later."""
        if gap_s <= HOST_GAP_S:
            return
        log.warning("the coordinator did not run for %.1f s (host overloaded?); no stage is blamed for it", gap_s)
        for s in self.table.status:
            s.last_sign_of_life += gap_s
            s.last_progress += gap_s

    def check_stage(self, k: int, now: float) -> Verdict | None:
        """Stage k's runner: exited (0, 2 or another status) or silent past the heartbeat timeout; None while it
        runs and beats, and for a stage done, given up on or paused (no process to watch)."""
        plan, s = self.table.plans[k], self.table.status[k]
        if s.state in ("done", "error", "paused"):
            return None
        code = plan.device.exit_code()
        if code == 0:
            return Verdict(k, "finished", code=0)
        if code == 2:
            return Verdict(k, "fatal", f"stage {k} on {plan.device.name} stopped with exit status 2 (a bad "
                                       f"configuration, or a failure a restart cannot fix, so it is not retried): "
                                       f"{stderr_tail(plan.device)}", code=2)
        if code is not None:
            return Verdict(k, "failed", f"exited with status {code}", code=code)
        if s.heartbeat_seen and now - s.last_sign_of_life > self.heartbeat_timeout_s:
            return Verdict(k, "failed", "heartbeat timeout", kill=True)
        return None

    def check_stalls(self, now: float) -> Verdict | None:
        """A stage alive (heartbeats come from a timer thread) but without progress for `stall_timeout_s`.

        Its neighbours stop progressing too: the ones downstream starve, the ones upstream are held back by the
        in-flight limit. So the stage blamed is not the first one found without progress but the one its stall
        leads to (`stalled_stage`), and only when that one itself has made no progress for as long: a slow
        stage that still moves is left alone (docs/design#failure-detection).
        """
        if not self.stall_timeout_s:
            return None
        status, total = self.table.status, self.table.windows.num_micro_batches
        live = [s.state not in ("done", "error", "failed") for s in status]
        for k, s in enumerate(status):
            if not live[k] or now - s.last_progress < self.stall_timeout_s:
                continue
            done = [st.micro_batches_done if live[i] else total for i, st in enumerate(status)]
            silent = silent_stage(status, live, now)
            if silent is not None:
                blamed = silent
            else:
                blamed = stalled_backprop_stage(done, live) if self.backprop else stalled_stage(done, live, k)
            b = status[blamed]
            if not live[blamed] or now - b.last_progress < self.stall_timeout_s:
                continue
            if b.state == "paused":
                continue  # the stall leads to a stage a device policy holds: waiting for it is no failure
            still = now - b.last_progress
            why = (f"silent for {now - b.last_sign_of_life:.0f} s: stopped or frozen" if silent is not None else
                   "alive; input available")
            log.warning("stage %d made no progress for %.0f s at micro-batch %d (%s): restarting it", blamed, still,
                        b.micro_batches_done, why)
            return Verdict(blamed, "failed", f"stalled: no progress for {still:.0f} s at micro-batch "
                                             f"{b.micro_batches_done} ({why})", kill=True, stalled_s=still)
        return None


def silent_stage(status: Sequence, live: Sequence[bool], now: float, silent_s: float = SILENT_S) -> int | None:
    """The live stage whose control frames stopped longest ago, more than `silent_s` seconds ago (`SILENT_S`); None
    while every live stage whose runner has connected (`control_seen`) still beats. A stage restarting is not
    counted (its new runner sends nothing until it has loaded), nor one without a control connection, whose only
    signs of life are its telemetry lines. `status`: each stage's `StageStatus`."""
    quiet = [(now - s.last_sign_of_life, k) for k, s in enumerate(status)
             if live[k] and s.state != "restarting" and s.control_seen and now - s.last_sign_of_life > silent_s]
    return max(quiet)[1] if quiet else None


def stalled_backprop_stage(done: Sequence[int], live: Sequence[bool]) -> int:
    """The stage a stall under a backprop schedule comes from, by each stage's micro-batches done (backwards).

    There a stage's backward of a micro-batch waits for its downstream's (the gradient), so done[k] <= done[k+1],
    and its forward for its upstream's: every count is bounded both ways, and `stalled_stage`'s walk would blame
    stage 0. When stage s stops, its downstream stages still finish the micro-batches s had forwarded, so they end
    ahead of it (done[s+1] > done[s]), while its upstream stages use up the gradients s had sent and end level with
    it. So the stalled stage is the last live one its downstream has done more than; none: the last stage (it
    stopped, and the others used up its gradients).

    Example: stage 1 parked in a forward after its first backward: done = [1, 1, 3]: stage 1.
    """
    ahead = [k for k in range(len(done) - 1) if live[k] and done[k + 1] > done[k]]
    return ahead[-1] if ahead else max(k for k in range(len(done)) if live[k])


def stalled_stage(done: Sequence[int], live: Sequence[bool], k: int) -> int:
    """The stage a stall seen at stage `k` comes from, by each stage's micro-batches done.

    A stage is starved when its upstream has done no more than it has (nothing new to consume): the stall is
    upstream. It is held back when it has done more than its live downstream (its output waits there): the
    stall is downstream. The walk ends at a stage that is neither -- input there, output taken -- which is
    the one that stopped. It never turns back (starved means done[k-1] <= done[k], held back the opposite),
    so it ends within len(done) steps.

    Example: stage 1 parked after sending micro-batch 9: done = [14, 9, 10]; stage 2 is starved (9 <= 10),
    stage 0 held back (14 > 9), stage 1 neither: it is the one.
    """
    while True:
        if k > 0 and live[k - 1] and done[k - 1] <= done[k]:
            k -= 1
        elif k < len(done) - 1 and live[k + 1] and done[k] > done[k + 1]:
            k += 1
        else:
            return k
