"""The coordinator: runs a deployed pipeline to the end (docs/design.md §5).

It starts every stage, then loops: the control channel's frames and the stages' telemetry into their status
(`StageStatus`), the injected failure, the health checks (health.py), the device policies' pauses (pauses.py),
the recovery of failed stages (recovery.py), the display. What it reads and prunes of the stages' files on their
devices is device_files.py's. Each concern is a mixin of `Coordinator`, over its state (`plans`, `status`,
`windows`, `events`); this module keeps the flow.

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
from zl_device.executorch.device_files import DeviceFiles, StagePlan
from zl_device.executorch.device_policy import DevicePolicy
from zl_device.executorch.health import HealthChecks
from zl_device.executorch.pauses import Pause, Pauses
from zl_device.executorch.recovery import MAX_RESTARTS, RECOVERY_MODES, Failure, Recovery
from zl_device.formats import frames
from zl_device.formats.checkpoints import DEFAULT_LAYOUT
from zl_device.formats.frames import FrameType
from zl_device.formats.injection import Injection
from zl_device.formats.metrics_log import LineTail
from zl_device.formats.stage_status import StageStatus, fold_telemetry
from zl_device.formats.windows import WindowPlan

log = logging.getLogger(__name__)

POLL_S = 0.05

__all__ = ["Coordinator", "StagePlan"]


class Coordinator(HealthChecks, Recovery, Pauses, DeviceFiles):
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
        self.backprop = backprop  # a backprop schedule: a stage's progress waits on its downstream's gradients
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
        self._failures: list[Failure] = []
        self._kill_t: float | None = None  # when the injected failure's SIGKILL was sent
        self._standby_wanted: set[int] = set()  # stages whose standby took over (or died): start one when calm
        self._pauses: dict[int, Pause] = {}  # stage -> its pause, from the limit crossed until it runs again
        self._next_read = [0.0] * len(self.plans)  # when each stage's device is read next (time.monotonic())
        self._unreadable: set[int] = set()  # stages whose device's last reading failed (logged once)
        self.held_s = 0.0  # time some stage was paused: not counted against timeout_s

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
            self._held = any(_telemetry_type(line) == "hold" for line in text.splitlines() if "hold" in line)
        if self._held:
            self._injected = True
            log.info("injecting a failure: SIGKILL stage %d parked at micro-batch %d (window %d)", inj.stage,
                     inj.hold_micro_batch(self.windows), inj.window)
            self._kill_t = time.monotonic()
            plan.device.kill_runner()


def _telemetry_type(line: str) -> str | None:
    """The "type" of one telemetry JSON line; None for a line that is not a JSON object (e.g. half written)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record.get("type") if isinstance(record, dict) else None
