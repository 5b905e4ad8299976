"""Device policies' pauses (docs/design#device-policies): the state machine of a stage from a limit crossed to its
restart.

The policy (`policy`, `zl train --max-temperature/--min-battery/--require-charging`): every
`policy.read_every_s` the coordinator reads each stage's device (zl_device/devices/readings.py).
A device that crosses a limit finishes the window it is in; once that window is committed (and checkpointed:
`zl train` checkpoints every window) the coordinator stops its runner (SIGTERM, exit 3) and holds the stage
*paused*: no process, no health checks, never blamed by the stall detector, and its neighbours, which wait
for it, are not blamed either. When the device is back in range, with the policy's margins, the stage starts
again with --resume (its standby takes over if it has one), exactly as a restart after a failure, which is
why the adapter is the one of a run without pauses. Each pause becomes a `pause` event.

    running --limit crossed--> pausing --window committed, SIGTERM--> paused (runner exited 3)
    pausing --back in range before it stopped--> running
    paused --back in range--> restarting --> running

`Pauses` works on the stage table (stage_table.py) and is fed by the coordinator's loop: `step` each pass (it
returns the paused stages to start again, which the loop starts through the recovery's `replace`), `stopped`
when a stage asked to stop exits 3, `rearm` after a restart, `finished` when a stage ends.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass

from zl_base.errors import ZLError
from zl_device.devices.readings import DeviceReadings
from zl_device.executorch.device_files import IN_FLIGHT_GRACE_S, DeviceFiles
from zl_device.executorch.device_policy import DevicePolicy
from zl_device.executorch.stage_table import StageTable, unix_ms

log = logging.getLogger(__name__)

#: The runner's exit status when it stopped on request (docs/design#runner-process): a paused stage's.
EXIT_STOPPED = 3


@dataclass
class Pause:
    """A device policy's pause of one stage, from the limit crossed to the restart (times: time.monotonic())."""

    kind: str  # temperature | thermal_status | battery | charging
    reason: str
    after_window: int  # the stage stops once it has committed a later window than this one
    requested_t: float
    requested_unix_ms: int
    stop_t: float | None = None  # SIGTERM sent
    window: int | None = None  # the last window the stage committed before it stopped
    paused_t: float | None = None  # its runner exited (status 3)
    paused_unix_ms: int | None = None


@dataclass(frozen=True)
class Resume:
    """A paused stage whose device is back in range: the loop starts it again (recovery.py's `replace`), then
    records the pause (`Pauses.resumed`)."""

    stage: int
    pause: Pause
    readings: DeviceReadings
    t: float  # time.monotonic() it was found back in range


class Pauses:
    """Pausing stages whose device crossed a policy's limit, and restarting them (module docstring): a state machine
    per stage over the stage table, fed by the coordinator's loop."""

    def __init__(self, table: StageTable, files: DeviceFiles, policy: DevicePolicy | None):
        self.table, self.files = table, files
        self.policy = policy if policy is not None and policy.active else None  # None: devices are not watched
        self.pauses: dict[int, Pause] = {}  # stage -> its pause, from the limit crossed until it runs again
        self._next_read = [0.0] * len(table)  # when each stage's device is read next (time.monotonic())
        self._unreadable: set[int] = set()  # stages whose device's last reading failed (logged once)

    def step(self, now: float) -> list[Resume]:
        """Stop a pausing stage once it committed its window; read each device when due, then pause a stage whose
        device crossed a limit, let a pausing one go on when its device is back in range before it stopped, and
        return the paused ones whose device is, for the loop to start again."""
        if self.policy is None:
            return []
        resumes = []
        for k, s in enumerate(self.table.status):
            if s.state in ("done", "error"):
                continue
            pause = self.pauses.get(k)
            if pause is not None and pause.paused_t is None and s.state == "running":
                s.state = "pausing"  # requested while it was starting, or restarted since: it still is
            if pause is not None and pause.stop_t is None and s.last_committed_window > pause.after_window:
                self._stop_for_pause(k, pause)
            if now < self._next_read[k] or s.state == "failed":
                continue
            self._next_read[k] = now + self.policy.read_every_s
            readings = self._read_device(k)
            if readings is None:
                continue
            if pause is None:
                breach = self.policy.breach(readings)
                if breach is not None:
                    self._request_pause(k, *breach)
            elif self.policy.holds(readings) is None:
                if pause.paused_t is not None:
                    resumes.append(self._resuming(k, pause, readings))
                elif pause.stop_t is None:  # back in range before its window ended: it just goes on
                    log.warning("stage %d on %s: back in range (%s); not pausing", k, s.device, readings.summary())
                    del self.pauses[k]
                    s.pause_reason = None
                    s.state = "running" if s.state == "pausing" else s.state
        return resumes

    def stopping(self, k: int) -> bool:
        """Stage k was asked to stop for its pause (SIGTERM sent): an exit with EXIT_STOPPED is that stop."""
        pause = self.pauses.get(k)
        return pause is not None and pause.stop_t is not None

    def finished(self, k: int) -> None:
        """Stage k's runner exited 0: the window it was to pause after was its last."""
        if self.pauses.pop(k, None) is not None:
            self.table.status[k].pause_reason = None

    def rearm(self, k: int, committed: int) -> None:
        """A pausing stage that failed, or was restarted by a global recovery, before it stopped: it is to pause
        after the window it will be in once it runs again (`committed`: the last one it committed)."""
        pause = self.pauses.get(k)
        if pause is not None and pause.paused_t is None:
            pause.stop_t, pause.after_window = None, committed

    def _read_device(self, k: int) -> DeviceReadings | None:
        """Stage k's device's readings; None when they cannot be read now (logged once until they can again)."""
        plan = self.table.plans[k]
        try:
            readings = self.policy.read(plan.device)
        except ZLError as e:
            if k not in self._unreadable:
                log.warning("stage %d on %s: no readings (%s); its pause state stays as it is", k,
                            plan.device.name, e)
                self._unreadable.add(k)
            return None
        self._unreadable.discard(k)
        return readings

    def _request_pause(self, k: int, kind: str, reason: str) -> None:
        s = self.table.status[k]
        self.pauses[k] = Pause(kind, reason, s.last_committed_window, time.monotonic(), unix_ms())
        s.pause_reason = reason
        if s.state == "running":
            s.state = "pausing"
        log.warning("stage %d on %s: %s; pausing it after window %d", k, s.device, reason,
                    s.last_committed_window + 1)

    def _stop_for_pause(self, k: int, pause: Pause) -> None:
        """The stage committed the window it was in (zl train checkpoints every window): stop its runner. By the
        time the coordinator sees a commit (its loop, a phone's control frame: milliseconds) the stage has begun
        the next window, or on a tiny model finished it too; it stops at its next check, and what it did after its
        last commit is in its accumulator snapshot or is redone (docs/design#recovery-in-detail)."""
        pause.stop_t = time.monotonic()
        self.table.plans[k].device.signal_runner(signal.SIGTERM)

    def stopped(self, k: int) -> None:
        """Its runner stopped for the pause (exit 3): hold the stage. Its count goes back to where the restart will
        continue, so the stall walk never takes an output it sent but the next stage lost with the connection for
        input the next stage has (it would blame that stage)."""
        pause, plan, s = self.pauses[k], self.table.plans[k], self.table.status[k]
        self.table.read_telemetry(k, remote=True)
        # What it committed by the time the SIGTERM took effect: on a fast stage, more than the coordinator had seen.
        pause.window = self.files.latest_checkpoint_window(plan)
        self.files.drop_snapshot_of_lost_sends(plan, self.table.downstream(k), grace_s=IN_FLIGHT_GRACE_S)
        s.micro_batches_done = self.files.resume_point_mb(plan)
        s.state = "paused"
        pause.paused_t, pause.paused_unix_ms = time.monotonic(), unix_ms()
        s.paused_since = pause.paused_t
        log.warning("stage %d on %s paused after window %d (%s)", k, s.device, pause.window, pause.reason)

    def _resuming(self, k: int, pause: Pause, readings: DeviceReadings) -> Resume:
        """The device is back in range: the stage is to start again from its checkpoint (or snapshot), as a
        restart."""
        s, now = self.table.status[k], time.monotonic()
        s.state, s.pause_reason, s.paused_since = "restarting", None, None
        s.last_sign_of_life = now
        self.table.waiting_from(now)  # the others waited for it: none is stalled until a full stall timeout from now
        del self.pauses[k]
        return Resume(k, pause, readings, now)

    def resumed(self, r: Resume, took_over: bool) -> None:
        """The loop started the stage of `r` again (its standby took over: `took_over`): the pause's event."""
        pause, plan = r.pause, self.table.plans[r.stage]
        log.warning("stage %d on %s resumes (%s) after %.0f s paused", r.stage, plan.device.name,
                    r.readings.summary(), r.t - pause.paused_t)
        self.table.events.append({
            "type": "pause", "stage": r.stage, "device": plan.device.name, "kind": pause.kind,
            "reason": pause.reason, "window": pause.window, "requested_unix_ms": pause.requested_unix_ms,
            "paused_unix_ms": pause.paused_unix_ms, "resumed_unix_ms": unix_ms(),
            "to_pause_ms": round((pause.paused_t - pause.requested_t) * 1e3, 1),
            "paused_ms": round((r.t - pause.paused_t) * 1e3, 1), "resumed_at": r.readings.summary(),
            "standby": took_over})
