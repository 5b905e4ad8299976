"""What the two runtimes of `zl train` share with its flow (train_job.py), and the interface each implements.

    train_job:   data -> runtime.prepare -> runtime.run -> runtime.collect -> merge -> eval -> report
    ExecuTorch:  export (cached)            deploy, coordinator  pull, telemetry
    torch:       manifest + torch job       ranks, their watch   the ranks' telemetry, recovery events

A runtime is one object per run (`Runtime`): `prepare` makes what the stages
run, `run` starts them and watches them to the end, `collect` brings their
telemetry into RUN_DIR/stages/ and returns the run's events (`RunRecord`).
The flow writes RUN_DIR/metrics.jsonl once from those (`run_event` builds its
`run` line), merges the checkpoints into the adapter, evaluates and reports,
the same for both. The live display gets `StageStatus` rows, folded from each
stage's telemetry lines the same way in both (`fold_telemetry`).
"""

from __future__ import annotations

import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from zl_base.errors import ZLError
from zl_device.formats.run_layout import RunLayout
from zl_device.formats.windows import WindowPlan
from zl_device.run.train_settings import TrainSettings

Say = Callable[[str], None]


class RunModel:
    """The run's model, loaded at most once: its tokenizer for the data, the model for the export and the eval."""

    def __init__(self, spec: str, seed: int):
        self.spec, self.seed = spec, seed
        self._tokenizer = None
        self._loaded = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from zl_export.model_source import load_tokenizer

            self._tokenizer = self._loaded.tokenizer if self._loaded is not None else load_tokenizer(self.spec)
        return self._tokenizer

    def loaded(self):
        """The `LoadedModel` (base weights; the export leaves no LoRA layers in it)."""
        if self._loaded is None:
            from zl_export.model_source import load_model

            self._loaded = load_model(self.spec, seed=self.seed)
        return self._loaded


@dataclass
class Run:
    """One `zl train` run as the flow hands it to its runtime."""

    settings: TrainSettings
    layout: RunLayout
    devices: object  # the parsed --devices (zl_device.devices.registry.DevicesSpec)
    model: RunModel
    say: Say
    export_progress: object | None = None  # a zl_export.pipeline.ExportProgress, for an export that runs

    @property
    def windows(self) -> WindowPlan:
        return self.settings.windows()


@dataclass(frozen=True)
class Injection:
    """--inject-failure STAGE@WINDOW: kill `stage` with SIGKILL in the middle of `window` (0-based)."""

    stage: int
    window: int

    @staticmethod
    def parse(text: str, num_stages: int, num_windows: int) -> Injection:
        m = re.fullmatch(r"\s*(\d+)\s*@\s*(\d+)\s*", text)
        if not m:
            raise ZLError(f"--inject-failure {text!r}: expected STAGE@WINDOW, e.g. 1@2 (stage 1 in window 2).")
        stage, window = int(m.group(1)), int(m.group(2))
        if stage >= num_stages:
            raise ZLError(f"--inject-failure {text}: stage {stage} does not exist; stages are 0-{num_stages - 1}.")
        if window >= num_windows:
            raise ZLError(f"--inject-failure {text}: window {window} does not exist; the run has windows "
                          f"0-{num_windows - 1}.")
        return Injection(stage, window)

    def hold_micro_batch(self, windows: WindowPlan) -> int:
        """The micro-batch the stage parks after (the runner) or dies at (torch): the middle of the window."""
        return windows.middle(self.window)


@dataclass
class RunRecord:
    """What a runtime's collect step hands the flow for RUN_DIR/metrics.jsonl."""

    events: list[dict]  # failure, restart, recovered, resume events, in order (schemas: formats/metrics_log.py)
    start_unix_ms: int  # the run's training span (the `run` event's)
    end_unix_ms: int
    run_id: str
    devices: list[str]  # where each stage ran, in stage order
    extra: dict = field(default_factory=dict)  # the runtime's own keys of the `run` event


class Runtime(ABC):
    """How a run's stages train: the steps of the flow that differ between runtimes (module docstring).

    One object per run; state from `prepare` to `collect` lives on it. The class attributes say what the flow
    needs to know before the object exists (`open_run`, `--resume`).
    """

    #: --runtime's value.
    name: ClassVar[str]
    #: The run's stages go to --devices (their count is checked before anything is written).
    uses_devices: ClassVar[bool]
    #: Files in RUN_DIR without which `--resume` cannot continue a run: a run that fails before they exist leaves
    #: nothing behind.
    resume_needs: ClassVar[tuple[str, ...]]
    #: How `--resume` continues (the end of its first line).
    resumes_from: ClassVar[str]

    def check(self, s: TrainSettings) -> None:
        """The settings this runtime cannot run, before anything else is checked or written."""

    @abstractmethod
    def prepare(self, run: Run, shard: Path, opts) -> dict:
        """What the stages run, for the training shard `shard` and the export options `opts`: the stage programs
        (ExecuTorch) or the stages' modules and job (torch); RUN_DIR/manifest.json. Returns the manifest."""

    @abstractmethod
    def run(self, run: Run, injection: Injection | None, on_update) -> bool:
        """Start the stages and watch them to the end (`on_update(list[StageStatus])` about once a second); on a
        failure, stop them and keep what `--resume` needs. False: the stages were only prepared (torch's
        `--launcher torchrun`: the user starts them)."""

    @abstractmethod
    def collect(self, run: Run) -> RunRecord:
        """After `run`: every stage's telemetry in RUN_DIR/stages/stage_<k>/metrics.jsonl and the run's checkpoints
        in RUN_DIR/checkpoints/; the events and span of the run."""


def run_event(s: TrainSettings, num_stages: int, record: RunRecord) -> dict:
    """The `run` line of metrics.jsonl (schema in zl_device/formats/metrics_log.py), both runtimes'."""
    windows = s.windows()
    return {"type": "run", "start_unix_ms": record.start_unix_ms, "end_unix_ms": record.end_unix_ms,
            "samples": windows.num_micro_batches * s.export.micro_batch, "run_id": record.run_id,
            "num_stages": num_stages, "window_size": windows.window_size,
            "num_micro_batches": windows.num_micro_batches, "recovery": s.recovery, "devices": record.devices,
            **record.extra}


# --- the live display ------------------------------------------------------------------------------------


@dataclass
class StageStatus:
    """What the flow knows about one stage, for the live display (and the coordinator's recovery)."""

    index: int
    device: str
    state: str = "starting"  # starting | running | pausing | paused | failed | restarting | done | error
    micro_batches_done: int = 0  # by this stage's telemetry / heartbeats
    last_committed_window: int = -1
    last_loss: float | None = None
    forward_only: bool = False  # held still by lr 0: runs phase 1 only, has no loss to show (docs/design.md §4.3)
    pss_mib: float | None = None  # latest reading (peaks and temperatures are the report's, from telemetry)
    restarts: int = 0
    last_sign_of_life: float = field(default_factory=time.monotonic)
    last_progress: float = field(default_factory=time.monotonic)  # a micro-batch done, a window committed, a start
    heartbeat_seen: bool = False
    commit_times: dict[int, float] = field(default_factory=dict)  # window -> time.monotonic() of its commit
    pause_reason: str | None = None  # the limit a device policy holds it for: pausing, then paused (§5.8)
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
