"""How the coordinator recovers a failed stage (docs/design.md §5, §7), and its hot standbys (§5.5).

Recovery:
- `local` (ZeroLock's stage-local recovery): only the failed stage is
  restarted with --resume, on its device or on the next spare; it restores
  its latest checkpoint and replays the micro-batches after it from its own
  input log (stage 0: its shard). Its neighbours keep running; the links
  reconnect and re-send what was not acknowledged.
- `global` (the baseline): every stage is stopped, rolled back to the last
  window all stages committed (newer checkpoints are deleted) and restarted
  with --resume, so every stage replays from that window.

Hot standbys (`standby`, `zl train --standby`; docs/design.md §5.5): next to
each stage's runner a second `zl_runner --standby` has its program mapped,
its method loaded and its optimizer built, and waits. A restart (either
mode) tells it to take over instead of starting a process that loads its
program after the failure; a new standby is started once the failure is
recovered (not before: it would compete with the replay for the CPU).

`--resume` (`_resume_all`) starts every stage from its checkpoints the same way. `Recovery` is mixed into the
`Coordinator` (coordinator.py): it works on its `plans`, `status`, `windows` and `events`, and on the stages'
files through `DeviceFiles` (device_files.py).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace

from zl_base.errors import ZLError
from zl_base.json_reader import loads
from zl_device.executorch.device_files import IN_FLIGHT_GRACE_S, StagePlan, stderr_tail
from zl_device.formats.metrics_log import LineTail
from zl_device.formats.runner_config import RunnerConfig

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
    """Restarts of failed stages, local or global, `--resume`, and the hot standbys (module docstring)."""

    def _failed(self, k: int, now: float, why: str, stalled_s: float | None = None) -> None:
        s = self.status[k]
        # before the lines read now, which are not news of life; a stalled stage was alive, but not progressing
        last_sign_of_life = s.last_sign_of_life if stalled_s is None else now - stalled_s
        self._read_telemetry(k, remote=True)
        in_flight = self.windows.window_of(s.micro_batches_done)
        log.warning("stage %d on %s failed (%s) in window %d", k, s.device, why, in_flight)
        s.state = "failed"
        self._rearm_pause(k, s.last_committed_window)
        self.events.append({"type": "failure", "stage": k, "t_unix_ms": unix_ms(),
                            "detected_after_ms": round((now - last_sign_of_life) * 1e3, 1),
                            "window": in_flight, "micro_batch": s.micro_batches_done, "reason": why})
        if s.restarts >= self.max_restarts:
            self.stop_all()
            raise ZLError(f"stage {k} failed {s.restarts + 1} times ({why}); giving up. "
                          f"Last error output: {stderr_tail(self.plans[k].device)}")
        injected = self.injection is not None and k == self.injection.stage and self._kill_t is not None
        failure_t = self._kill_t if injected else now
        self._kill_t = None if injected else self._kill_t
        if self.recovery == "local":
            self._restart(k, in_flight, failure_t)
        else:
            self._restart_all(k, in_flight, failure_t)
        # The others now wait for the recovering stage (and may still show progress counts from before it
        # rolled back): none of them is stalled until it has had a full stall timeout since.
        restarted = time.monotonic()
        for st in self.status:
            st.last_progress = max(st.last_progress, restarted)

    def _restart(self, k: int, in_flight: int, failure_t: float) -> None:
        plan, s = self.plans[k], self.status[k]
        if self.spares and not plan.device.has_standby():
            spare = self.spares.pop(0)
            log.warning("moving stage %d from %s to spare %s", k, plan.device.name, spare.name)
            if self.redeploy is None:
                raise ZLError("a spare needs a redeploy function to receive the stage's program.")
            self.redeploy(spare, k)  # its config carries no hold_at_micro_batch (see launch.py)
            plan.device = spare
            s.device = spare.name
            self._tails[k] = LineTail()
        self._clear_hold(plan)
        self._drop_snapshot_of_lost_sends(k, grace_s=IN_FLIGHT_GRACE_S)  # the next stage runs on: let it log
        committed = self._resume_point_mb(plan)
        replayed = max(0, s.micro_batches_done - committed)
        s.micro_batches_done = committed
        s.state, s.restarts = "restarting", s.restarts + 1
        s.last_progress = time.monotonic()  # the restart's own clock: loading and replay take time
        # The clock starts when the restart is issued: a start that waits for the runner's pid (adb, the app)
        # returns when the stage may have replayed whole windows already.
        t, t_unix_ms = time.monotonic(), unix_ms()
        took_over = self._replace(plan)
        self.events.append({"type": "restart", "stage": k, "t_unix_ms": t_unix_ms, "replayed_micro_batches": replayed,
                            "replay_bytes": replayed * plan.input_bytes, "device": plan.device.name,
                            "standby": took_over})
        self._failures.append(Failure(k, in_flight, t, failure_t))

    def _restart_all(self, failed: int, in_flight: int, failure_t: float) -> None:
        """Global recovery: stop everyone, roll back to the last window all stages committed, restart all."""
        for plan in self.plans:
            plan.device.kill_runner()
        for k in range(len(self.plans)):
            self._read_telemetry(k, remote=True)
        common, replayed_total, bytes_total = self._roll_back()
        for plan in self.plans:
            self.status[plan.index].restarts += plan.index == failed
        t, t_unix_ms = time.monotonic(), unix_ms()  # when the restart is issued (see _restart)
        took_over = []
        for plan in reversed(self.plans):
            if self.status[plan.index].state == "paused":
                continue  # rolled back with the others; it starts when its device is back in range
            self._rearm_pause(plan.index, common)
            self.status[plan.index].state = "restarting"
            took_over.append(self._replace(plan))
        self.events.append({"type": "restart", "stage": failed, "t_unix_ms": t_unix_ms,
                            "replayed_micro_batches": replayed_total, "replay_bytes": bytes_total,
                            "device": self.plans[failed].device.name, "rolled_back_to_window": common,
                            "scope": "global", "standby": all(took_over) if self.standby else False})
        self._failures.append(Failure(failed, in_flight, t, failure_t))

    def _roll_back(self) -> tuple[int, int, int]:
        """Every stage back to the last window all of them committed: newer checkpoints and the input-log entries
        past it removed (docs/design.md §7). Returns (that window, micro-batches to replay, their bytes)."""
        common = min(self._latest_checkpoint_window(p) for p in self.plans)
        replayed_total, bytes_total = 0, 0
        for plan, s in zip(self.plans, self.status):
            self._clear_hold(plan)
            self._remove_checkpoints_after(plan, common)
            self._remove_input_log_after(plan, common)
            # The baseline replays from the common checkpoint: no stage continues a window from its snapshot.
            plan.device.remove(self.layout.device_accumulator(plan.checkpoint_dir))
            replay_from = self.windows.done_after(common)
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

    def _resume_all(self) -> None:
        """`zl train --resume`: stop the runners a previous `zl train` left running, then start every stage from
        its checkpoints: each from its own latest with --recovery local (the inputs it needs are in its input log
        or come again from upstream, as after a local restart), from the last window all committed with global."""
        for plan in self.plans:
            plan.device.stop_standby()  # a standby the previous zl train left
            if plan.device.is_running():
                log.warning("stage %d on %s: a runner of the previous zl train is still running; stopping it",
                            plan.index, plan.device.name)
                plan.device.stop_runner(timeout_s=10)
        for k in range(len(self.plans)):
            self._read_telemetry(k, remote=True)
        if self.recovery == "global":
            common, replayed, replay_bytes = self._roll_back()
        else:
            common = None
            for k in range(len(self.plans)):
                self._drop_snapshot_of_lost_sends(k)
            points = [self._resume_point_mb(p) for p in self.plans]
            replayed = sum(max(0, s.micro_batches_done - at) for s, at in zip(self.status, points))
            replay_bytes = sum(max(0, s.micro_batches_done - at) * p.input_bytes
                               for p, s, at in zip(self.plans, self.status, points))
            for s, at in zip(self.status, points):
                s.micro_batches_done = at
        self.events.append({"type": "resume", "t_unix_ms": unix_ms(), "scope": self.recovery,
                            "rolled_back_to_window": common, "replayed_micro_batches": replayed,
                            "replay_bytes": replay_bytes})
        for plan in reversed(self.plans):
            self.status[plan.index].state = "restarting"
            plan.device.start_runner(plan.config, resume=True)

    def _check_recovered(self) -> None:
        for f in list(self._failures):
            downstream = min(f.stage + 1, len(self.plans) - 1)
            t = self.status[downstream].commit_times.get(f.window)
            if t is not None and t >= f.restart_t:
                self.events.append({"type": "recovered", "stage": f.stage, "t_unix_ms": unix_ms(),
                                    "recovery_ms": round((t - f.restart_t) * 1e3, 1),
                                    "since_failure_ms": round((t - f.failure_t) * 1e3, 1),
                                    "downstream_stage": downstream, "window": f.window})
                self._failures.remove(f)
            elif self.status[downstream].state == "done" and not self.windows.exists(f.window):
                self._failures.remove(f)  # the failure hit after the last window: nothing left to recover
        if self._standby_wanted and not self._failures:
            self._start_standbys()

    def _clear_hold(self, plan: StagePlan) -> None:
        """Drop hold_at_micro_batch from the stage's config on its device, so the restart runs through."""
        text = plan.device.read_text(plan.config)
        if not text:
            return
        label, fix = f"{plan.device.name}:{plan.config}", "redeploy the stage"
        cfg = RunnerConfig.from_json(loads(text, label, fix), label, fix)
        if cfg.hold_at_micro_batch != -1:
            plan.device.write_text(plan.config, json.dumps(replace(cfg, hold_at_micro_batch=-1).to_json(), indent=2)
                                   + "\n")

    # --- hot standbys --------------------------------------------------------------------------------

    def _start_standbys(self) -> None:
        """A standby for every stage that wants one, while no recovery is in progress (a standby loading its
        program competes with the replay for the CPU)."""
        if not self.standby or self._failures:
            return
        for k in sorted(self._standby_wanted):
            plan = self.plans[k]
            if self.status[k].state not in ("done", "error") and not plan.device.has_standby():
                plan.device.start_standby(plan.config)
        self._standby_wanted.clear()

    def _stop_standbys(self) -> None:
        if self.standby:
            for plan in self.plans:
                plan.device.stop_standby()

    def _replace(self, plan: StagePlan) -> bool:
        """Start the stage's runner with --resume: its standby takes over where there is one (True), else a new
        process starts (False)."""
        if self.standby:
            self._standby_wanted.add(plan.index)
            if plan.device.take_over():
                return True
            log.warning("stage %d on %s: no standby to take over; starting a runner", plan.index, plan.device.name)
        plan.device.start_runner(plan.config, resume=True)
        return False


def unix_ms() -> int:
    """Now, in Unix milliseconds (the events' clock)."""
    return int(time.time() * 1000)
