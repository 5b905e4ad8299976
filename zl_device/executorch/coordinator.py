"""The coordinator: runs a deployed pipeline to the end (docs/design#coordinator).

It starts every stage, then loops over what happened since its last pass: the control channel's frames and the
stages' telemetry into the stage table (stage_table.py), the injected failure, the health checks (health.py:
each returns a `Verdict`, "stage k failed because ..."), the device policies' pauses (pauses.py: a state machine
per stage), the recovery of failed stages (recovery.py), the display. The parts share the table and nothing
else: none calls another; this loop hands a verdict to the part that acts on it, a paused stage back in range to
the recovery's restart, a restart's windows to the pauses. What they read and prune of the stages' files on
their devices is device_files.py's.

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
import time
from collections.abc import Callable, Sequence

from zl_base.errors import ZLError
from zl_device.devices.backend import Device
from zl_device.executorch.control import ControlServer
from zl_device.executorch.device_files import DeviceFiles
from zl_device.executorch.device_policy import DevicePolicy
from zl_device.executorch.health import Health, Verdict
from zl_device.executorch.pauses import EXIT_STOPPED, Pauses
from zl_device.executorch.recovery import MAX_RESTARTS, Recovery
from zl_device.executorch.stage_table import StagePlan, StageTable
from zl_device.formats import frames
from zl_device.formats.frames import FrameType
from zl_device.formats.injection import Injection
from zl_device.formats.stage_status import StageStatus
from zl_device.formats.windows import WindowPlan

log = logging.getLogger(__name__)

POLL_S = 0.05

__all__ = ["Coordinator", "StagePlan"]


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
        backprop: bool = False,
    ):
        self.table = StageTable(plans, windows)
        files = DeviceFiles(windows)
        self.health = Health(self.table, heartbeat_timeout_s, stall_timeout_s, backprop)
        self.recovery = Recovery(self.table, files, recovery, spares, redeploy, standby, max_restarts)
        self.pauses = Pauses(self.table, files, policy)
        self.control = control
        self.injection = injection
        self.timeout_s = timeout_s
        self.resume = resume  # `zl train --resume`: the stages continue from their checkpoints
        self._injected = False
        self._last_remote_poll = 0.0
        self._kill_t: float | None = None  # when the injected failure's SIGKILL was sent
        self.held_s = 0.0  # time some stage was paused: not counted against timeout_s

    @property
    def plans(self) -> list[StagePlan]:
        return self.table.plans

    @property
    def status(self) -> list[StageStatus]:
        return self.table.status

    @property
    def events(self) -> list[dict]:
        return self.table.events

    def run(self, on_update: Callable[[list[StageStatus]], None] | None = None) -> list[dict]:
        """Start every stage (last first, so listeners are up early) and supervise until all are done.

        Returns:
            the coordinator events of the run.

        Raises:
            ZLError: a runner that fails for a reason a restart cannot fix (bad config, exit status 2), one
                that keeps failing, or the run timing out; every runner is stopped first.
        """
        try:
            return self._run(on_update)
        except ZLError:
            self.stop_all()
            raise

    def _run(self, on_update: Callable[[list[StageStatus]], None] | None) -> list[dict]:
        start = time.monotonic()
        if self.resume:
            self.recovery.resume_all()
        else:
            for plan in reversed(self.plans):
                plan.device.start_runner(plan.config, resume=False)
        self.recovery.want_standbys()
        for s in self.status:
            s.last_progress = time.monotonic()
        tick = time.monotonic()
        while True:
            self.health.forgive_host_gap(time.monotonic() - tick - POLL_S)
            self._drain_control()
            self.table.read_all_telemetry()
            self._maybe_inject()
            self._check_health()
            for resume in self.pauses.step(time.monotonic()):
                self.pauses.resumed(resume, took_over=self.recovery.replace(resume.stage))
            self.recovery.check_recovered()
            if on_update:
                on_update(self.status)
            if all(s.state == "done" for s in self.status):
                # Frames sent just before the runners exited (last commits, a final heartbeat) may be queued
                # still: a phone's exit is seen over adb, not on the control channel.
                self._drain_control()
                self.recovery.check_recovered()
                self.recovery.stop_standbys()
                return self.events
            now = time.monotonic()
            if any(s.state == "paused" for s in self.status):
                self.held_s += now - tick
            tick = now
            if self.timeout_s and now - start - self.held_s > self.timeout_s:
                held = f" (and {self.held_s:.0f} s paused)" if self.held_s else ""
                raise ZLError(f"the run did not finish within {self.timeout_s:.0f} s{held}; stages: "
                              + ", ".join(f"{s.index}: {s.state} at micro-batch {s.micro_batches_done}"
                                          for s in self.status)
                              + ". Look at RUN_DIR/logs/*/runner.err.")
            time.sleep(POLL_S)

    def stop_all(self) -> None:
        self.recovery.stop_standbys()
        self.table.stop_runners()

    # --- health: what the checks found, handed to the part that acts on it ---------------------------

    def _check_health(self) -> None:
        """Each stage's exit or silence, then the stalls, each acted on as soon as it is found: a restart changes
        what the next stage's check sees (a global one restarts every runner)."""
        now = time.monotonic()
        for k in range(len(self.plans)):
            verdict = self.health.check_stage(k, now)
            if verdict is not None:
                self._act_on(verdict, now)
        verdict = self.health.check_stalls(now)
        if verdict is not None:
            self._act_on(verdict, now)

    def _act_on(self, v: Verdict, now: float) -> None:
        k = v.stage
        if v.kind == "finished":
            self.table.read_telemetry(k)
            self.table.finished(k)
            self.pauses.finished(k)
        elif v.kind == "fatal":
            self.status[k].state = "error"
            raise ZLError(v.why)
        elif v.code == EXIT_STOPPED and self.pauses.stopping(k):
            self.pauses.stopped(k)
        else:
            if v.kill:
                self.plans[k].device.kill_runner()
            self._failed(k, now, v.why, v.stalled_s)

    def _failed(self, k: int, now: float, why: str, stalled_s: float | None = None) -> None:
        """Stage k failed: its recovery (the injected kill's time as the failure's, where it is the injected one),
        then the pauses of the stages restarted are rearmed."""
        injected = self.injection is not None and k == self.injection.stage and self._kill_t is not None
        failure_t, self._kill_t = (self._kill_t, None) if injected else (None, self._kill_t)
        for stage, committed in self.recovery.failed(k, now, why, stalled_s, failure_t).items():
            self.pauses.rearm(stage, committed)

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
        total = self.table.windows.num_micro_batches
        done = e.payload.get("micro_batches_done") if isinstance(e.payload, dict) else None
        if isinstance(done, int) and not isinstance(done, bool) and done > total:
            return f"micro_batches_done {done} is above the run's {total} micro-batches"
        if e.type == FrameType.WINDOW_COMMITTED and not self.table.windows.exists(e.window):
            return f"window {e.window} is not one of the run's windows 0-{self.table.windows.num_windows - 1}"
        return None

    def _control_event(self, e) -> None:
        payload = e.payload if isinstance(e.payload, dict) else {}
        s = self.status[e.stage]
        s.last_sign_of_life = e.t
        s.control_seen = True
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

    # --- failure injection ---------------------------------------------------------------------------

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
            self.table.hold_seen = any(_telemetry_type(line) == "hold" for line in text.splitlines() if "hold" in line)
        if self.table.hold_seen:
            self._injected = True
            log.info("injecting a failure: SIGKILL stage %d parked at micro-batch %d (window %d)", inj.stage,
                     inj.hold_micro_batch(self.table.windows), inj.window)
            self._kill_t = time.monotonic()
            plan.device.kill_runner()


def _telemetry_type(line: str) -> str | None:
    """The "type" of one telemetry JSON line; None for a line that is not a JSON object (e.g. half written)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record.get("type") if isinstance(record, dict) else None
