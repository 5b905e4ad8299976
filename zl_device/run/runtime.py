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
stage's telemetry lines the same way in both (`fold_telemetry`,
zl_device/formats/stage_status.py); `--inject-failure` is an `Injection`
(zl_device/formats/injection.py) in both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from zl_device.formats.injection import Injection
from zl_device.formats.run_layout import RunLayout
from zl_device.formats.windows import WindowPlan
from zl_device.run.resolved_run import ResolvedRun
from zl_device.run.train_settings import TrainSettings
from zl_export.manifest import Manifest

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
    """One `zl train` run as the flow hands it to its runtime: the settings as given and the run resolved from
    them and the data (resolved_run.py), which is where the stages' roles, learning rates and windows come from."""

    settings: TrainSettings
    resolved: ResolvedRun
    layout: RunLayout
    devices: object  # the parsed --devices (zl_device.devices.registry.DevicesSpec)
    model: RunModel
    say: Say
    export_progress: object | None = None  # a zl_export.pipeline.ExportProgress, for an export that runs

    @property
    def windows(self) -> WindowPlan:
        return self.resolved.windows


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
    def prepare(self, run: Run, shard: Path) -> Manifest:
        """What the stages run, for the training shard `shard` (the export's options: the resolved run's): the
        stage programs (ExecuTorch) or the stages' modules and job (torch); RUN_DIR/manifest.json. Returns the
        manifest."""

    @abstractmethod
    def run(self, run: Run, injection: Injection | None, on_update) -> bool:
        """Start the stages and watch them to the end (`on_update(list[StageStatus])` about once a second); on a
        failure, stop them and keep what `--resume` needs. False: the stages were only prepared (torch's
        `--launcher torchrun`: the user starts them)."""

    @abstractmethod
    def collect(self, run: Run) -> RunRecord:
        """After `run`: every stage's telemetry in RUN_DIR/stages/stage_<k>/metrics.jsonl and the run's checkpoints
        in RUN_DIR/checkpoints/; the events and span of the run."""


def run_event(run: Run, record: RunRecord) -> dict:
    """The `run` line of metrics.jsonl (schema in zl_device/formats/metrics_log.py), both runtimes'."""
    s, windows = run.settings, run.windows
    return {"type": "run", "start_unix_ms": record.start_unix_ms, "end_unix_ms": record.end_unix_ms,
            "samples": windows.num_micro_batches * s.export.micro_batch, "run_id": record.run_id,
            "num_stages": run.resolved.num_stages, "window_size": windows.window_size,
            "num_micro_batches": windows.num_micro_batches, "recovery": s.recovery, "devices": record.devices,
            **record.extra}
