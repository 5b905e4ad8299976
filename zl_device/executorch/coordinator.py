"""The coordinator: runs a deployed pipeline to the end and recovers failed stages (docs/design.md §5).

Membership: every stage's runner registers and sends heartbeats on the
control channel (zl_device/executorch/control.py); on local devices the coordinator
also reads each runner's telemetry file as it grows, so progress shows even
without a control connection; on phones it reads that file over adb when a
stage fails, to know the window in flight (heartbeats come once a second). A stage has failed when its process exits
with a non-zero status or, once it has sent a heartbeat, when no heartbeat
arrived for `heartbeat_timeout_s`.

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

Device policies (`policy`, `zl train --max-temperature/--min-battery/--require-charging`; docs/design.md
§5.8): every `policy.read_every_s` the coordinator reads each stage's device (zl_device/devices/readings.py).
A device that crosses a limit finishes the window it is in; once that window is committed (and checkpointed:
`zl train` checkpoints every window) the coordinator stops its runner (SIGTERM, exit 3) and holds the stage
*paused*: no process, no health checks, never blamed by the stall detector, and its neighbours, which wait
for it, are not blamed either. When the device is back in range, with the policy's margins, the stage starts
again with --resume (its standby takes over if it has one), exactly as a restart after a failure, which is
why the adapter is the one of a run without pauses. Each pause becomes a `pause` event.

Failure injection (`Injection`, zl_device/formats/injection.py): SIGKILL a stage half-way through a given
window, as a crash would; for experiments and tests. To make the point
reproducible however fast the stages run, the stage's config asks it to
park right after sending micro-batch `Injection.hold_micro_batch` downstream
(config `hold_at_micro_batch`, before that micro-batch's phase 2: its hidden
state is downstream, its gradient is lost); the coordinator kills it once it
has parked and drops the field from the config before the restart.

The coordinator writes its events (`failure`, `restart`, `recovered`, `resume`, `pause`)
to a list that the run flow appends to RUN_DIR/metrics.jsonl with the `run`
event (train_job.py; schemas in zl_device/formats/metrics_log.py).
"""

from __future__ import annotations

import json
import logging
import queue
import re
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from zl_base.errors import ZLError
from zl_device.devices.backend import Device
from zl_device.executorch.control import ControlServer
from zl_device.executorch.device_policy import DevicePolicy
from zl_device.executorch.recovery import MAX_RESTARTS, RECOVERY_MODES
from zl_device.formats import frames
from zl_device.formats.checkpoints import DEFAULT_LAYOUT, snapshot_metadata
from zl_device.formats.frames import FrameType
from zl_device.formats.injection import Injection
from zl_device.formats.metrics_log import LineTail
from zl_device.formats.stage_status import StageStatus, fold_telemetry
from zl_device.formats.windows import WindowPlan

log = logging.getLogger(__name__)

# How long a local restart waits for outputs the failed stage sent just before it died to reach the next stage's
# input log (in its socket buffer, or being fsynced) before it gives up the failed stage's accumulator snapshot.
IN_FLIGHT_GRACE_S = 3.0

POLL_S = 0.05
# A pass of the coordinator's loop that began this much later than it should have means the host itself did not run
# (a laptop starved by other work, suspended or swapping): heartbeats sent meanwhile are queued, not missing, so
# that time is no stage's silence (`_forgive_host_gap`).
HOST_GAP_S = 5.0
#: The runner's exit status when it stopped on request (docs/design.md §4.1): a paused stage's.
EXIT_STOPPED = 3


@dataclass
class StagePlan:
    """Where and how stage k runs: its device, its config's name on the device, its telemetry file there."""

    index: int
    device: Device
    config: str  # remote config name, e.g. stage_1.json
    log_path: str  # remote telemetry file, e.g. metrics.jsonl
    checkpoint_dir: str  # remote checkpoint folder
    input_bytes: int  # bytes of one input entry (hidden + mask + labels, or a shard row)


@dataclass
class _Failure:
    stage: int
    window: int  # the window in flight at the failure
    restart_t: float | None = None
    failure_t: float | None = None  # the injected kill, else when the failure was detected (time.monotonic())


@dataclass
class _Pause:
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


class Coordinator:
    """Runs the stages in `plans` to completion; see the module docstring."""

    def __init__(
        self,
        plans: Sequence[StagePlan],
        windows: WindowPlan,
        control: ControlServer | None = None,
        recovery: str = "local",
        injection: Injection | None = None,
        spares: Sequence[Device] = (),
        heartbeat_timeout_s: float = 30.0,
        timeout_s: float | None = None,
        redeploy: Callable[[Device, int], None] | None = None,
        resume: bool = False,
        stall_timeout_s: float = 0.0,
        standby: bool = False,
        max_restarts: int = MAX_RESTARTS,
        policy: DevicePolicy | None = None,
    ):
        if recovery not in RECOVERY_MODES:
            raise ZLError(f"--recovery {recovery!r}: expected one of {', '.join(RECOVERY_MODES)}.")
        self.plans = list(plans)
        self.windows = windows
        self.layout = DEFAULT_LAYOUT
        self.control = control
        self.recovery = recovery
        self.injection = injection
        self.spares = list(spares)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.timeout_s = timeout_s
        self.stall_timeout_s = stall_timeout_s  # 0: no stall detection
        self.redeploy = redeploy  # puts stage k's program and config on a spare before it takes over
        self.resume = resume  # `zl train --resume`: the stages continue from their checkpoints
        self.standby = standby  # keep a hot standby per stage (see the module docstring)
        self.max_restarts = max_restarts  # restarts of one stage before the run gives up
        self.policy = policy if policy is not None and policy.active else None  # None: devices are not watched
        if standby:
            lacking = [p.device.name for p in self.plans if not p.device.supports_standby]
            if lacking:
                raise ZLError(f"--standby: {', '.join(lacking)} cannot keep a hot standby (local devices and phones "
                              f"in --mode binary can; the app runs one runner); run without --standby, or with "
                              f"--mode binary.")
        self.status = [StageStatus(p.index, p.device.name) for p in self.plans]
        self.events: list[dict] = []  # coordinator events for metrics.jsonl
        self._tails = [LineTail() for _ in self.plans]  # each stage's telemetry file as read so far
        self._injected = False
        self._held = False
        self._last_remote_poll = 0.0
        self._failures: list[_Failure] = []
        self._kill_t: float | None = None  # when the injected failure's SIGKILL was sent
        self._standby_wanted: set[int] = set()  # stages whose standby took over (or died): start one when calm
        self._pauses: dict[int, _Pause] = {}  # stage -> its pause, from the limit crossed until it runs again
        self._next_read = [0.0] * len(self.plans)  # when each stage's device is read next (time.monotonic())
        self._unreadable: set[int] = set()  # stages whose device's last reading failed (logged once)
        self.held_s = 0.0  # time some stage was paused: not counted against timeout_s

    # --- the loop ------------------------------------------------------------------------------------

    def run(self, on_update: Callable[[list[StageStatus]], None] | None = None) -> list[dict]:
        """Start every stage (last first, so listeners are up early) and supervise until all are done.

        Returns:
            the coordinator events of the run.

        Raises:
            ZLError: a runner that fails for a reason a restart cannot fix (bad config, exit status 2), one
                that keeps failing, or the run timing out.
        """
        start = time.monotonic()
        if self.resume:
            self._resume_all()
        else:
            for plan in reversed(self.plans):
                plan.device.start_runner(plan.config, resume=False)
        if self.standby:
            self._standby_wanted = set(range(len(self.plans)))
            self._start_standbys()
        for s in self.status:
            s.last_progress = time.monotonic()
        tick = time.monotonic()
        while True:
            self._forgive_host_gap(time.monotonic() - tick - POLL_S)
            self._drain_control()
            for k in range(len(self.plans)):
                self._read_telemetry(k)
            self._maybe_inject()
            self._check_health()
            self._apply_policy()
            self._check_recovered()
            if on_update:
                on_update(self.status)
            if all(s.state == "done" for s in self.status):
                # Frames sent just before the runners exited (last commits, a final heartbeat) may be queued
                # still: a phone's exit is seen over adb, not on the control channel.
                self._drain_control()
                self._check_recovered()
                self._stop_standbys()
                return self.events
            now = time.monotonic()
            if any(s.state == "paused" for s in self.status):
                self.held_s += now - tick
            tick = now
            if self.timeout_s and now - start - self.held_s > self.timeout_s:
                self.stop_all()
                held = f" (and {self.held_s:.0f} s paused)" if self.held_s else ""
                raise ZLError(f"the run did not finish within {self.timeout_s:.0f} s{held}; stages: "
                              + ", ".join(f"{s.index}: {s.state} at micro-batch {s.micro_batches_done}"
                                          for s in self.status)
                              + ". Look at RUN_DIR/logs/*/runner.err.")
            time.sleep(POLL_S)

    def stop_all(self) -> None:
        self._stop_standbys()
        for plan in self.plans:
            plan.device.stop_runner(timeout_s=5)

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

    # --- progress ------------------------------------------------------------------------------------

    def _drain_control(self) -> None:
        if self.control is None:
            return
        while True:
            try:
                e = self.control.events.get_nowait()
            except queue.Empty:
                return
            if not 0 <= e.stage < len(self.status):
                continue
            problem = self._event_problem(e)
            if problem is not None:
                log.warning("stage %d: %s dropped (%s)", e.stage, e.type.name, problem)
                continue
            try:
                self._control_event(e)
            except (TypeError, ValueError, AttributeError) as err:  # a payload the server let through
                log.warning("stage %d: unusable %s payload dropped (%s)", e.stage, e.type.name, err)

    def _event_problem(self, e) -> str | None:
        """Why an event's numbers do not fit this run (None when they do). The control server checked the types
        and the ranges that hold for any run (control.frame_problem); these come from the run's window plan."""
        total = self.windows.num_micro_batches
        done = e.payload.get("micro_batches_done") if isinstance(e.payload, dict) else None
        if isinstance(done, int) and not isinstance(done, bool) and done > total:
            return f"micro_batches_done {done} is above the run's {total} micro-batches"
        if e.type == FrameType.WINDOW_COMMITTED and not self.windows.exists(e.window):
            return f"window {e.window} is not one of the run's windows 0-{self.windows.num_windows - 1}"
        return None

    def _control_event(self, e) -> None:
        payload = e.payload if isinstance(e.payload, dict) else {}
        s = self.status[e.stage]
        s.last_sign_of_life = e.t
        if e.type == FrameType.HEARTBEAT:
            s.heartbeat_seen = True
            s.progressed(int(payload.get("micro_batches_done", 0)), e.t)
            s.pss_mib = payload.get("pss_mib") or s.pss_mib  # a missing reading keeps the last one
        elif e.type == FrameType.WINDOW_COMMITTED:
            s.committed(e.window, payload.get("mean_loss"), e.t)
        elif e.type == FrameType.ERROR:
            reason = str(payload.get("reason"))  # decoded JSON: control characters are real ones now
            log.warning("stage %d reports: %s", e.stage,
                        reason if reason.isprintable() else frames.escape_bytes(reason.encode("utf-8", "replace"), 2000))

    def _read_telemetry(self, k: int, remote: bool = False) -> None:
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
                self._held = True

    # --- failures ------------------------------------------------------------------------------------

    def _maybe_inject(self) -> None:
        inj = self.injection
        if inj is None or self._injected:
            return
        plan = self.plans[inj.stage]
        if not plan.device.files_on_host and time.monotonic() - self._last_remote_poll > 1.0:
            # Phones: look for the hold line in the device's telemetry file (local devices are tailed anyway).
            self._last_remote_poll = time.monotonic()
            text = plan.device.read_text(plan.log_path) or ""
            # Parsed, not matched as text: the runner writes compact JSON ({"type":"hold",...}).
            self._held = any(_telemetry_type(line) == "hold" for line in text.splitlines() if "hold" in line)
        if self._held:
            self._injected = True
            log.info("injecting a failure: SIGKILL stage %d parked at micro-batch %d (window %d)", inj.stage,
                     inj.hold_micro_batch(self.windows), inj.window)
            self._kill_t = time.monotonic()
            plan.device.kill_runner()

    def _clear_hold(self, plan: StagePlan) -> None:
        """Drop hold_at_micro_batch from the stage's config on its device, so the restart runs through."""
        text = plan.device.read_text(plan.config)
        cfg = json.loads(text) if text else {}
        if cfg.pop("hold_at_micro_batch", None) is not None:
            plan.device.write_text(plan.config, json.dumps(cfg, indent=2) + "\n")

    def _forgive_host_gap(self, gap_s: float) -> None:
        """Move every stage's heartbeat and progress clocks on by the `gap_s` seconds the coordinator did not run,
        when that is more than HOST_GAP_S: under load (all three stages of a run on a 2-core host with other jobs
        were once blamed together after a 37 s gap) a stage is judged only on the time the host watched it. A
        stage that really died is found `gap_s` later."""
        if gap_s <= HOST_GAP_S:
            return
        log.warning("the coordinator did not run for %.1f s (host overloaded?); no stage is blamed for it", gap_s)
        for s in self.status:
            s.last_sign_of_life += gap_s
            s.last_progress += gap_s

    def _check_health(self) -> None:
        now = time.monotonic()
        for k, plan in enumerate(self.plans):
            s = self.status[k]
            if s.state in ("done", "error", "paused"):  # paused: no process to watch
                continue
            code = plan.device.exit_code()
            if code == 0:
                self._read_telemetry(k)
                s.state = "done"
                s.micro_batches_done = max(s.micro_batches_done, self.windows.num_micro_batches)
                if self._pauses.pop(k, None) is not None:  # the window it was to finish was its last
                    s.pause_reason = None
                continue
            pause = self._pauses.get(k)
            if code == EXIT_STOPPED and pause is not None and pause.stop_t is not None:
                self._paused(k, pause)
                continue
            if code == 2:
                s.state = "error"
                self.stop_all()
                raise ZLError(f"stage {k} on {plan.device.name} stopped with exit status 2 (a bad configuration, or a "
                              f"failure a restart cannot fix, so it is not retried): "
                              f"{_stderr_tail(plan.device)}")
            timed_out = s.heartbeat_seen and now - s.last_sign_of_life > self.heartbeat_timeout_s
            if code is not None or timed_out:
                if timed_out and code is None:
                    plan.device.kill_runner()
                self._failed(k, now, "exited with status %s" % code if code is not None else "heartbeat timeout")
        self._check_stalls(now)

    def _check_stalls(self, now: float) -> None:
        """A stage alive (heartbeats come from a timer thread) but without progress for `stall_timeout_s`.

        Its neighbours stop progressing too: the ones downstream starve, the ones upstream are held back by the
        in-flight limit. So the stage blamed is not the first one found without progress but the one its stall
        leads to (`stalled_stage`), and only when that one itself has made no progress for as long: a slow
        stage that still moves is left alone (docs/design.md §5.2).
        """
        if not self.stall_timeout_s:
            return
        live = [s.state not in ("done", "error", "failed") for s in self.status]
        for k, s in enumerate(self.status):
            if not live[k] or now - s.last_progress < self.stall_timeout_s:
                continue
            done = [st.micro_batches_done if live[i] else self.windows.num_micro_batches
                    for i, st in enumerate(self.status)]
            blamed = stalled_stage(done, live, k)
            b = self.status[blamed]
            if not live[blamed] or now - b.last_progress < self.stall_timeout_s:
                continue
            if b.state == "paused":
                continue  # the stall leads to a stage a device policy holds: waiting for it is no failure
            still = now - b.last_progress
            log.warning("stage %d made no progress for %.0f s at micro-batch %d with its input there: restarting it",
                        blamed, still, b.micro_batches_done)
            self.plans[blamed].device.kill_runner()
            self._failed(blamed, now, f"stalled: no progress for {still:.0f} s at micro-batch "
                                      f"{b.micro_batches_done} (alive; input available)", stalled_s=still)
            return

    def _failed(self, k: int, now: float, why: str, stalled_s: float | None = None) -> None:
        s = self.status[k]
        # before the lines read now, which are not news of life; a stalled stage was alive, but not progressing
        last_sign_of_life = s.last_sign_of_life if stalled_s is None else now - stalled_s
        self._read_telemetry(k, remote=True)
        in_flight = self.windows.window_of(s.micro_batches_done)
        log.warning("stage %d on %s failed (%s) in window %d", k, s.device, why, in_flight)
        s.state = "failed"
        self._rearm_pause(k, s.last_committed_window)
        self.events.append({"type": "failure", "stage": k, "t_unix_ms": _unix_ms(),
                            "detected_after_ms": round((now - last_sign_of_life) * 1e3, 1),
                            "window": in_flight, "micro_batch": s.micro_batches_done, "reason": why})
        if s.restarts >= self.max_restarts:
            self.stop_all()
            raise ZLError(f"stage {k} failed {s.restarts + 1} times ({why}); giving up. "
                          f"Last error output: {_stderr_tail(self.plans[k].device)}")
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
        t, t_unix_ms = time.monotonic(), _unix_ms()
        took_over = self._replace(plan)
        self.events.append({"type": "restart", "stage": k, "t_unix_ms": t_unix_ms, "replayed_micro_batches": replayed,
                            "replay_bytes": replayed * plan.input_bytes, "device": plan.device.name,
                            "standby": took_over})
        self._failures.append(_Failure(k, in_flight, t, failure_t))

    def _restart_all(self, failed: int, in_flight: int, failure_t: float) -> None:
        """Global recovery: stop everyone, roll back to the last window all stages committed, restart all."""
        for plan in self.plans:
            plan.device.kill_runner()
        for k in range(len(self.plans)):
            self._read_telemetry(k, remote=True)
        common, replayed_total, bytes_total = self._roll_back()
        for plan in self.plans:
            self.status[plan.index].restarts += plan.index == failed
        t, t_unix_ms = time.monotonic(), _unix_ms()  # when the restart is issued (see _restart)
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
        self._failures.append(_Failure(failed, in_flight, t, failure_t))

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
        self.events.append({"type": "resume", "t_unix_ms": _unix_ms(), "scope": self.recovery,
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
                self.events.append({"type": "recovered", "stage": f.stage, "t_unix_ms": _unix_ms(),
                                    "recovery_ms": round((t - f.restart_t) * 1e3, 1),
                                    "since_failure_ms": round((t - f.failure_t) * 1e3, 1),
                                    "downstream_stage": downstream, "window": f.window})
                self._failures.remove(f)
            elif self.status[downstream].state == "done" and not self.windows.exists(f.window):
                self._failures.remove(f)  # the failure hit after the last window: nothing left to recover
        if self._standby_wanted and not self._failures:
            self._start_standbys()

    # --- device policies (docs/design.md §5.8) ---------------------------------------------------------

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
        self._pauses[k] = _Pause(kind, reason, s.last_committed_window, time.monotonic(), _unix_ms())
        s.pause_reason = reason
        if s.state == "running":
            s.state = "pausing"
        log.warning("stage %d on %s: %s; pausing it after window %d", k, s.device, reason,
                    s.last_committed_window + 1)

    def _stop_for_pause(self, k: int, pause: _Pause) -> None:
        """The stage committed the window it was in (zl train checkpoints every window): stop its runner. By the
        time the coordinator sees a commit (its loop, a phone's control frame: milliseconds) the stage has begun
        the next window, or on a tiny model finished it too; it stops at its next check, and what it did after its
        last commit is in its accumulator snapshot or is redone (§7)."""
        pause.stop_t = time.monotonic()
        self.plans[k].device.signal_runner(signal.SIGTERM)

    def _paused(self, k: int, pause: _Pause) -> None:
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
        pause.paused_t, pause.paused_unix_ms = time.monotonic(), _unix_ms()
        s.paused_since = pause.paused_t
        log.warning("stage %d on %s paused after window %d (%s)", k, s.device, pause.window, pause.reason)

    def _resume(self, k: int, pause: _Pause, readings) -> None:
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
                            "resumed_unix_ms": _unix_ms(),
                            "to_pause_ms": round((pause.paused_t - pause.requested_t) * 1e3, 1),
                            "paused_ms": round((now - pause.paused_t) * 1e3, 1),
                            "resumed_at": readings.summary(), "standby": took_over})

    def _rearm_pause(self, k: int, committed: int) -> None:
        """A pausing stage that failed, or was restarted by a global recovery, before it stopped: it is to pause
        after the window it will be in once it runs again."""
        pause = self._pauses.get(k)
        if pause is not None and pause.paused_t is None:
            pause.stop_t, pause.after_window = None, committed

    # --- checkpoints on the device -------------------------------------------------------------------

    def _checkpoint_windows(self, plan: StagePlan) -> list[int]:
        return self.layout.window_numbers(plan.device.listdir(plan.checkpoint_dir))

    def _latest_checkpoint_window(self, plan: StagePlan) -> int:
        windows = self._checkpoint_windows(plan)
        return windows[-1] if windows else -1

    def _latest_checkpoint_mb(self, plan: StagePlan) -> int:
        """micro_batches_done of the stage's latest checkpoint (0 without one)."""
        w = self._latest_checkpoint_window(plan)
        if w < 0:
            return 0
        text = plan.device.read_text(self.layout.device_progress(plan.checkpoint_dir, w))
        try:
            return int(json.loads(text or "{}").get("micro_batches_done", self.windows.done_after(w)))
        except ValueError:
            return self.windows.done_after(w)

    def _resume_point_mb(self, plan: StagePlan) -> int:
        """Where a restart of the stage continues: its accumulator snapshot's micro_batches_done when that continues
        the window after its latest checkpoint (the runner's check, accumulator_snapshot.h), else the
        checkpoint's."""
        window = self._latest_checkpoint_window(plan)
        committed = self._latest_checkpoint_mb(plan)
        path = self.layout.device_accumulator(plan.checkpoint_dir)
        meta = snapshot_metadata(_read_bytes(plan.device, path)) if plan.device.exists(path) else None
        try:
            done, accumulated = int(meta["micro_batches_done"]), int(meta["accumulated"])
            usable = (int(meta["window"]) == window + 1 and int(meta["stage"]) == plan.index
                      and 0 < accumulated and done == committed + accumulated
                      and done < min(self.windows.done_after(window + 1), self.windows.num_micro_batches))
        except (TypeError, KeyError, ValueError):
            usable = False
        return done if usable else committed

    def _drop_snapshot_of_lost_sends(self, k: int, grace_s: float = 0.0) -> None:
        """Remove stage k's accumulator snapshot when the next stage lacks an output of a micro-batch it covers, so
        that the restart replays the window from the checkpoint (exact, docs/design.md §7) and sends those again.

        A snapshot is written after a micro-batch's phase 2, not once downstream acknowledged its hidden state (that
        holds only at a commit, §4.4): sent entries still un-acknowledged live in the sender's memory and die with
        its process. A restart continuing from the snapshot never computes them again, and the next stage would
        wait for them forever (the run of `--max-restarts 0 --inject-failure 1@1`, then `--resume`: stage 0 went
        on to a snapshot of micro-batches 8-10, stage 1 had logged up to 7). Checked after the kill, against what
        the next stage holds durably: everything below its latest checkpoint, plus its input log. A next stage
        that commits meanwhile only makes that look smaller, so a race costs a replay, never a hang.

        `grace_s`: while the next stage still runs (a local restart), an output the killed stage sent just before
        it died may still sit in the next stage's socket buffer, on its way to the log; wait up to this long for
        the missing entries to land before giving up the snapshot (on a loaded host the receiver can lag).
        """
        if k + 1 >= len(self.plans):
            return  # the last stage sends nothing
        plan, down = self.plans[k], self.plans[k + 1]
        committed, resume_at = self._latest_checkpoint_mb(plan), self._resume_point_mb(plan)
        if resume_at <= committed:
            return  # no usable snapshot: the restart replays from the checkpoint anyway
        deadline = time.monotonic() + grace_s
        while True:
            held_below = self._latest_checkpoint_mb(down)
            logged = {mb for name in down.device.listdir(self.layout.device_input_log(down.checkpoint_dir))
                      if (mb := input_log_entry_micro_batch(name)) is not None}
            missing = [mb for mb in range(committed, resume_at) if mb >= held_below and mb not in logged]
            if not missing or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if missing:
            log.info("stage %d: accumulator snapshot (micro-batches %d-%d) not used: stage %d never received "
                     "micro-batch %d; replaying from the checkpoint (micro-batch %d)", k, committed, resume_at - 1,
                     k + 1, missing[0], committed)
            plan.device.remove(self.layout.device_accumulator(plan.checkpoint_dir))

    def _remove_checkpoints_after(self, plan: StagePlan, window: int) -> None:
        for w in self._checkpoint_windows(plan):
            if w > window:
                plan.device.remove(self.layout.device_window(plan.checkpoint_dir, w))

    def _remove_input_log_after(self, plan: StagePlan, window: int) -> None:
        """Input-log entries of windows after `window`: after a rollback upstream sends them again, and stale
        ones left in the log would count against the link's in-flight depth (the receiver stops reading)."""
        folder = self.layout.device_input_log(plan.checkpoint_dir)
        for name in plan.device.listdir(folder):
            entry_window = input_log_entry_window(name)
            if entry_window is not None and entry_window > window:
                plan.device.remove(f"{folder}/{name}")


_INPUT_LOG_ENTRY = re.compile(r"entry-(\d+)-w(\d+)\.zlf")


def input_log_entry_window(name: str) -> int | None:
    """The window of an input-log file `entry-<micro_batch>-w<window>.zlf` (android_app/native/include/zl/input_log.h);
    None for any other name."""
    match = _INPUT_LOG_ENTRY.fullmatch(name)
    return int(match.group(2)) if match else None


def input_log_entry_micro_batch(name: str) -> int | None:
    """The micro-batch of an input-log file `entry-<micro_batch>-w<window>.zlf`; None for any other name (a `.tmp`
    being written, a `.corrupt` one)."""
    match = _INPUT_LOG_ENTRY.fullmatch(name)
    return int(match.group(1)) if match else None


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


def _telemetry_type(line: str) -> str | None:
    """The "type" of one telemetry JSON line; None for a line that is not a JSON object (e.g. half written)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record.get("type") if isinstance(record, dict) else None


def _read_bytes(device: Device, path: str) -> bytes:
    """A binary file of a device: read in place where its files are on this host, else pulled (read_from is
    text-only over adb)."""
    if device.files_on_host:
        return device.read_from(path, 0)
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "file"
        device.pull(path, local)
        return local.read_bytes()


def _unix_ms() -> int:
    return int(time.time() * 1000)


def _stderr_tail(device: Device, lines: int = 5) -> str:
    text = device.read_text("runner.err") or ""
    tail = [ln for ln in text.strip().splitlines() if ln.strip()][-lines:]
    return " | ".join(tail) or "(no output)"
