"""Device policies' pauses (docs/design.md §5.8): the state machine of a stage from a limit crossed to its restart.

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

`Pauses` is mixed into the `Coordinator` (coordinator.py): it works on its `plans`, `status`, `policy` and
`events`; a paused stage restarts through `_replace` (recovery.py).
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass

from zl_base.errors import ZLError
from zl_device.executorch.device_files import IN_FLIGHT_GRACE_S
from zl_device.executorch.recovery import unix_ms

log = logging.getLogger(__name__)

#: The runner's exit status when it stopped on request (docs/design.md §4.1): a paused stage's.
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


class Pauses:
    """Pausing stages whose device crossed a policy's limit, and restarting them (module docstring)."""

    def _apply_policy(self) -> None:
        """Stop a pausing stage once it committed its window; read each device when due, then pause a stage whose
        device crossed a limit, let a pausing one go on when its device is back in range before it stopped, and
        restart a paused one whose device is."""
        if self.policy is None:
            return
        now = time.monotonic()
        for k, s in enumerate(self.status):
            if s.state in ("done", "error"):
                continue
            pause = self._pauses.get(k)
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
                    self._resume(k, pause, readings)
                elif pause.stop_t is None:  # back in range before its window ended: it just goes on
                    log.warning("stage %d on %s: back in range (%s); not pausing", k, s.device, readings.summary())
                    del self._pauses[k]
                    s.pause_reason = None
                    s.state = "running" if s.state == "pausing" else s.state

    def _read_device(self, k: int):
        """Stage k's device's readings; None when they cannot be read now (logged once until they can again)."""
        plan = self.plans[k]
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
        s = self.status[k]
        self._pauses[k] = Pause(kind, reason, s.last_committed_window, time.monotonic(), unix_ms())
        s.pause_reason = reason
        if s.state == "running":
            s.state = "pausing"
        log.warning("stage %d on %s: %s; pausing it after window %d", k, s.device, reason,
                    s.last_committed_window + 1)

    def _stop_for_pause(self, k: int, pause: Pause) -> None:
        """The stage committed the window it was in (zl train checkpoints every window): stop its runner. By the
        time the coordinator sees a commit (its loop, a phone's control frame: milliseconds) the stage has begun
        the next window, or on a tiny model finished it too; it stops at its next check, and what it did after its
        last commit is in its accumulator snapshot or is redone (§7)."""
        pause.stop_t = time.monotonic()
        self.plans[k].device.signal_runner(signal.SIGTERM)

    def _paused(self, k: int, pause: Pause) -> None:
        """Its runner stopped (exit 3): hold the stage. Its count goes back to where the restart will continue,
        so the stall walk never takes an output it sent but the next stage lost with the connection for input
        the next stage has (it would blame that stage)."""
        plan, s = self.plans[k], self.status[k]
        self._read_telemetry(k, remote=True)
        # What it committed by the time the SIGTERM took effect: on a fast stage, more than the coordinator had seen.
        pause.window = self._latest_checkpoint_window(plan)
        self._drop_snapshot_of_lost_sends(k, grace_s=IN_FLIGHT_GRACE_S)
        s.micro_batches_done = self._resume_point_mb(plan)
        s.state = "paused"
        pause.paused_t, pause.paused_unix_ms = time.monotonic(), unix_ms()
        s.paused_since = pause.paused_t
        log.warning("stage %d on %s paused after window %d (%s)", k, s.device, pause.window, pause.reason)

    def _resume(self, k: int, pause: Pause, readings) -> None:
        """The device is back in range: the stage starts again from its checkpoint (or snapshot), as a restart."""
        plan, s = self.plans[k], self.status[k]
        now = time.monotonic()
        s.state, s.pause_reason, s.paused_since = "restarting", None, None
        s.last_sign_of_life = now
        for st in self.status:  # the others waited for it: none is stalled until a full stall timeout from now
            st.last_progress = max(st.last_progress, now)
        took_over = self._replace(plan)
        del self._pauses[k]
        log.warning("stage %d on %s resumes (%s) after %.0f s paused", k, s.device, readings.summary(),
                    now - pause.paused_t)
        self.events.append({"type": "pause", "stage": k, "device": plan.device.name, "kind": pause.kind,
                            "reason": pause.reason, "window": pause.window,
                            "requested_unix_ms": pause.requested_unix_ms, "paused_unix_ms": pause.paused_unix_ms,
                            "resumed_unix_ms": unix_ms(),
                            "to_pause_ms": round((pause.paused_t - pause.requested_t) * 1e3, 1),
                            "paused_ms": round((now - pause.paused_t) * 1e3, 1),
                            "resumed_at": readings.summary(), "standby": took_over})

    def _rearm_pause(self, k: int, committed: int) -> None:
        """A pausing stage that failed, or was restarted by a global recovery, before it stopped: it is to pause
        after the window it will be in once it runs again."""
        pause = self._pauses.get(k)
        if pause is not None and pause.paused_t is None:
            pause.stop_t, pause.after_window = None, committed
