"""How the coordinator recovers a failed stage (docs/design#coordinator, #recovery-in-detail), and its hot standbys
(docs/design#hot-standbys).

Recovery:
- `local` (ZeroLock's stage-local recovery): only the failed stage is
  restarted with --resume, on its device or on the next spare; it restores
  its latest checkpoint and replays the micro-batches after it from its own
  input log (stage 0: its shard). Its neighbours keep running; the links
  reconnect and re-send what was not acknowledged.
- `global` (the baseline): every stage is stopped, rolled back to the last
  window all stages committed (newer checkpoints are deleted) and restarted
  with --resume, so every stage replays from that window.

Hot standbys (`standby`, `zl train --standby`; docs/design#hot-standbys): next to
each stage's runner a second `zl_runner --standby` has its program mapped,
its method loaded and its optimizer built, and waits. A restart (either
mode) tells it to take over instead of starting a process that loads its
program after the failure; a new standby is started once the failure is
recovered (not before: it would compete with the replay for the CPU).

`--resume` (`Recovery.resume_all`) starts every stage from its checkpoints the same way. `Recovery` works on the
stage table (stage_table.py) and on the stages' files through `DeviceFiles` (device_files.py); it is fed by the
coordinator's loop (a failure the health checks found, a paused stage to start again) and calls no other part.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from zl_base.errors import ZLError
from zl_device.devices.backend import Device
from zl_device.executorch.device_files import IN_FLIGHT_GRACE_S, DeviceFiles, stderr_tail
from zl_device.executorch.stage_table import StageTable, unix_ms

log = logging.getLogger(__name__)

#: --recovery: `local` restarts only the failed stage (ZeroLock's stage-local recovery), `global` rolls every stage
#: back to the last window all committed and restarts them all (the baseline; --runtime torch's only one).
RECOVERY_MODES = ("local", "global")
#: Restarts of a failing stage (--runtime torch: of every rank) before a run gives up.
MAX_RESTARTS = 3


@dataclass
class Failure:
    """A stage's failure, from its detection until the stage after it commits the window it was in."""

    stage: int
    window: int  # the window in flight at the failure
    restart_t: float | None = None
    failure_t: float | None = None  # the injected kill, else when the failure was detected (time.monotonic())


class Recovery:
    """Restarts of failed stages, local or global, `--resume`, and the hot standbys (module docstring), over the
    stage table; a restart reports the stages it restarted and from which window, for the pauses (pauses.py) that
    the coordinator's loop tells."""

    def __init__(self, table: StageTable, files: DeviceFiles, mode: str = "local", spares: Sequence[Device] = (),
                 redeploy: Callable[[Device, int], None] | None = None, standby: bool = False,
                 max_restarts: int = MAX_RESTARTS):
        if mode not in RECOVERY_MODES:
            raise ZLError(f"--recovery {mode!r}: expected one of {', '.join(RECOVERY_MODES)}.")
        self.table, self.files = table, files
        self.mode = mode
        self.spares = list(spares)
        self.redeploy = redeploy  # puts stage k's program and config on a spare before it takes over
        self.standby = standby  # keep a hot standby per stage (see the module docstring)
        self.max_restarts = max_restarts  # restarts of one stage before the run gives up
        if standby:
            lacking = [p.device.name for p in table.plans if not p.device.supports_standby]
            if lacking:
                raise ZLError(f"--standby: {', '.join(lacking)} cannot keep a hot standby (local devices and phones "
                              f"in --mode binary can; the app runs one runner); run without --standby, or with "
                              f"--mode binary.")
        self.failures: list[Failure] = []  # failed stages not recovered yet
        self.standby_wanted: set[int] = set()  # stages whose standby took over (or died): start one when calm

    def failed(self, k: int, now: float, why: str, stalled_s: float | None = None,
               failure_t: float | None = None) -> dict[int, int]:
        """Stage k failed at `now` (time.monotonic()) for `why`: record it and restart it (`local`) or every stage
        (`global`). `failure_t`: when it really failed, where that is known earlier (an injected kill).

        Returns:
            each stage restarted -> the last window it had committed, where it continues.

        Raises:
            ZLError: the stage failed more than `max_restarts` times.
        """
        s = self.table.status[k]
        # before the lines read now, which are not news of life; a stalled stage was alive, but not progressing
        last_sign_of_life = s.last_sign_of_life if stalled_s is None else now - stalled_s
        self.table.read_telemetry(k, remote=True)
        in_flight = self.table.windows.window_of(s.micro_batches_done)
        log.warning("stage %d on %s failed (%s) in window %d", k, s.device, why, in_flight)
        s.state = "failed"
        self.table.events.append({"type": "failure", "stage": k, "t_unix_ms": unix_ms(),
                                  "detected_after_ms": round((now - last_sign_of_life) * 1e3, 1),
                                  "window": in_flight, "micro_batch": s.micro_batches_done, "reason": why})
        if s.restarts >= self.max_restarts:
            raise ZLError(f"stage {k} failed {s.restarts + 1} times ({why}); giving up. "
                          f"Last error output: {stderr_tail(self.table.plans[k].device)}")
        failure_t = now if failure_t is None else failure_t
        if self.mode == "local":
            restarted = {k: s.last_committed_window}
            self._restart(k, in_flight, failure_t)
        else:
            restarted = self._restart_all(k, in_flight, failure_t)
        # The others now wait for the recovering stage: none of them is stalled until a full stall timeout since.
        self.table.waiting_from(time.monotonic())
        return restarted

    def _restart(self, k: int, in_flight: int, failure_t: float) -> None:
        plan, s = self.table.plans[k], self.table.status[k]
        if self.spares and not plan.device.has_standby():
            spare = self.spares.pop(0)
            log.warning("moving stage %d from %s to spare %s", k, plan.device.name, spare.name)
            if self.redeploy is None:
                raise ZLError("a spare needs a redeploy function to receive the stage's program.")
            self.redeploy(spare, k)  # its config carries no hold_at_micro_batch (see launch.py)
            self.table.move(k, spare)
        self.files.clear_hold(plan)
        self.files.drop_snapshot_of_lost_sends(plan, self.table.downstream(k), grace_s=IN_FLIGHT_GRACE_S)
        committed = self.files.resume_point_mb(plan)
        replayed = max(0, s.micro_batches_done - committed)
        s.micro_batches_done = committed
        s.state, s.restarts = "restarting", s.restarts + 1
        s.last_progress = time.monotonic()  # the restart's own clock: loading and replay take time
        # The clock starts when the restart is issued: a start that waits for the runner's pid (adb, the app)
        # returns when the stage may have replayed whole windows already.
        t, t_unix_ms = time.monotonic(), unix_ms()
        took_over = self.replace(k)
        self.table.events.append({"type": "restart", "stage": k, "t_unix_ms": t_unix_ms,
                                  "replayed_micro_batches": replayed, "replay_bytes": replayed * plan.input_bytes,
                                  "device": plan.device.name, "standby": took_over})
        self.failures.append(Failure(k, in_flight, t, failure_t))

    def _restart_all(self, failed: int, in_flight: int, failure_t: float) -> dict[int, int]:
        """Global recovery: stop everyone, roll back to the last window all stages committed, restart all but the
        paused ones (rolled back with the others; each starts when its device is back in range)."""
        plans, status = self.table.plans, self.table.status
        for plan in plans:
            plan.device.kill_runner()
        self.table.read_all_telemetry(remote=True)
        common, replayed_total, bytes_total = self.roll_back()
        status[failed].restarts += 1
        t, t_unix_ms = time.monotonic(), unix_ms()  # when the restart is issued (see _restart)
        took_over, restarted = [], {}
        for plan in reversed(plans):
            if status[plan.index].state == "paused":
                continue
            restarted[plan.index] = common
            status[plan.index].state = "restarting"
            took_over.append(self.replace(plan.index))
        self.table.events.append({"type": "restart", "stage": failed, "t_unix_ms": t_unix_ms,
                                  "replayed_micro_batches": replayed_total, "replay_bytes": bytes_total,
                                  "device": plans[failed].device.name, "rolled_back_to_window": common,
                                  "scope": "global", "standby": all(took_over) if self.standby else False})
        self.failures.append(Failure(failed, in_flight, t, failure_t))
        return restarted

    def roll_back(self) -> tuple[int, int, int]:
        """Every stage back to the last window all of them committed: newer checkpoints and the input-log entries
        past it removed (docs/design#recovery-in-detail). Returns (that window, micro-batches to replay, their
        bytes)."""
        windows = self.table.windows
        common = min(self.files.latest_checkpoint_window(p) for p in self.table.plans)
        replayed_total, bytes_total = 0, 0
        for plan, s in zip(self.table.plans, self.table.status):
            self.files.clear_hold(plan)
            self.files.remove_checkpoints_after(plan, common)
            self.files.remove_input_log_after(plan, common)
            # The baseline replays from the common checkpoint: no stage continues a window from its snapshot.
            self.files.remove_accumulator(plan)
            replay_from = windows.done_after(common)
            replayed = max(0, s.micro_batches_done - replay_from)
            replayed_total += replayed
            bytes_total += replayed * plan.input_bytes
            s.micro_batches_done = replay_from
            s.last_committed_window = common
            s.commit_times = {w: t for w, t in s.commit_times.items() if w <= common}
            s.last_progress = time.monotonic()
            if s.state not in ("done", "paused"):
                s.state = "restarting"
        return common, replayed_total, bytes_total

    def resume_all(self) -> None:
        """`zl train --resume`: stop the runners a previous `zl train` left running, then start every stage from
        its checkpoints: each from its own latest with --recovery local (the inputs it needs are in its input log
        or come again from upstream, as after a local restart), from the last window all committed with global."""
        plans, status = self.table.plans, self.table.status
        for plan in plans:
            plan.device.stop_standby()  # a standby the previous zl train left
            if plan.device.is_running():
                log.warning("stage %d on %s: a runner of the previous zl train is still running; stopping it",
                            plan.index, plan.device.name)
                plan.device.stop_runner(timeout_s=10)
        self.table.read_all_telemetry(remote=True)
        if self.mode == "global":
            common, replayed, replay_bytes = self.roll_back()
        else:
            common = None
            for k, plan in enumerate(plans):
                self.files.drop_snapshot_of_lost_sends(plan, self.table.downstream(k))
            points = [self.files.resume_point_mb(p) for p in plans]
            replayed = sum(max(0, s.micro_batches_done - at) for s, at in zip(status, points))
            replay_bytes = sum(max(0, s.micro_batches_done - at) * p.input_bytes
                               for p, s, at in zip(plans, status, points))
            for s, at in zip(status, points):
                s.micro_batches_done = at
        self.table.events.append({"type": "resume", "t_unix_ms": unix_ms(), "scope": self.mode,
                                  "rolled_back_to_window": common, "replayed_micro_batches": replayed,
                                  "replay_bytes": replay_bytes})
        for plan in reversed(plans):
            status[plan.index].state = "restarting"
            plan.device.start_runner(plan.config, resume=True)

    def check_recovered(self) -> None:
        """A failure is recovered once the stage after the failed one (the last stage: itself) commits the window
        that was in flight, after the restart: a `recovered` event; then standbys are started again."""
        status, windows = self.table.status, self.table.windows
        for f in list(self.failures):
            downstream = min(f.stage + 1, len(status) - 1)
            t = status[downstream].commit_times.get(f.window)
            if t is not None and t >= f.restart_t:
                self.table.events.append({"type": "recovered", "stage": f.stage, "t_unix_ms": unix_ms(),
                                          "recovery_ms": round((t - f.restart_t) * 1e3, 1),
                                          "since_failure_ms": round((t - f.failure_t) * 1e3, 1),
                                          "downstream_stage": downstream, "window": f.window})
                self.failures.remove(f)
            elif status[downstream].state == "done" and not windows.exists(f.window):
                self.failures.remove(f)  # the failure hit after the last window: nothing left to recover
        if self.standby_wanted and not self.failures:
            self.start_standbys()

    # --- hot standbys --------------------------------------------------------------------------------

    def want_standbys(self) -> None:
        """At the start of a run with --standby: every stage wants one."""
        if self.standby:
            self.standby_wanted = set(range(len(self.table.plans)))
            self.start_standbys()

    def start_standbys(self) -> None:
        """A standby for every stage that wants one, while no recovery is in progress (a standby loading its
        program competes with the replay for the CPU)."""
        if not self.standby or self.failures:
            return
        for k in sorted(self.standby_wanted):
            plan = self.table.plans[k]
            if self.table.status[k].state not in ("done", "error") and not plan.device.has_standby():
                plan.device.start_standby(plan.config)
        self.standby_wanted.clear()

    def stop_standbys(self) -> None:
        if self.standby:
            for plan in self.table.plans:
                plan.device.stop_standby()

    def replace(self, k: int) -> bool:
        """Start stage k's runner with --resume: its standby takes over where there is one (True), else a new
        process starts (False)."""
        plan = self.table.plans[k]
        if self.standby:
            self.standby_wanted.add(k)
            if plan.device.take_over():
                return True
            log.warning("stage %d on %s: no standby to take over; starting a runner", k, plan.device.name)
        plan.device.start_runner(plan.config, resume=True)
        return False
