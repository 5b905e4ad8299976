"""Every path of a run directory, built in one place (docs/design#run-outputs).

    RUN_DIR/manifest.json                  the export's manifest (--runtime torch: built without an export)
    RUN_DIR/train_settings.json            the run's settings as given; `zl train --resume` continues with them
    RUN_DIR/resolved_run.json              what the run worked out from them and the data (run/resolved_run.py)
    RUN_DIR/started_run.json               both as the run started: --resume refuses a run whose files differ
    RUN_DIR/UNFINISHED.txt                 until the run finishes: how to continue it (older runs: .zl-incomplete)
    RUN_DIR/run.key, stage_<k>.json        the run key (deleted when the run finishes) and the runner configs
    RUN_DIR/torch_job.json                 --runtime torch: what every rank needs
    RUN_DIR/data/train.safetensors         the shard stage 0 trains on (+ dev.safetensors when there is one)
    RUN_DIR/devices/<device>/              local devices' working folders
    RUN_DIR/logs/<device>/                 runner output, configs, telemetry as pulled
    RUN_DIR/stages/stage_<k>/metrics.jsonl one stage's telemetry
    RUN_DIR/metrics.jsonl                  every stage's lines merged, then the run's events
    RUN_DIR/checkpoints/stage_<k>/window_NNNNNN/   a stage's checkpoints (`CheckpointLayout`)
    RUN_DIR/adapter/                       the PEFT adapter of the whole model
    RUN_DIR/eval.json, report.json, report.md, plots/

Writers and readers both build their paths here, so a name changes in one place. `zl pull --out DIR` writes
the `logs/` and `checkpoints/` of this layout into DIR, and a torch job names its own telemetry and checkpoint
roots (`stage_metrics`, `CheckpointLayout.stage_root` take any root).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from zl_device.formats.checkpoints import DEFAULT_LAYOUT, CheckpointLayout

MANIFEST = "manifest.json"  # zl_export.manifest.MANIFEST: the name an export writes
METRICS = "metrics.jsonl"
STAGES_DIR = "stages"
CHECKPOINTS_DIR = "checkpoints"
RUN_KEY = "run.key"
SETTINGS_FILE = "train_settings.json"
RESOLVED_FILE = "resolved_run.json"
STARTED_FILE = "started_run.json"
INCOMPLETE_MARKER = "UNFINISHED.txt"
LEGACY_INCOMPLETE_MARKER = ".zl-incomplete"
TORCH_JOB = "torch_job.json"
EVAL_JSON = "eval.json"
REPORT_JSON = "report.json"
REPORT_MD = "report.md"
PLOTS_DIR = "plots"


def stage_config_name(stage: int) -> str:
    """A runner config's file name, in RUN_DIR and on the device: stage_<k>.json."""
    return f"stage_{stage}.json"


def stage_config_index(name: str) -> int | None:
    """k of a runner config's file name stage_<k>.json; None for any other name."""
    match = re.fullmatch(r"stage_(\d+)\.json", name)
    return int(match.group(1)) if match else None


def stage_dir_name(stage: int) -> str:
    """stage_<k>: a stage's folder under stages/ (its checkpoints' under checkpoints/ is CheckpointLayout's)."""
    return f"stage_{stage}"


def stage_metrics(stages_dir: Path, stage: int) -> Path:
    """stage `stage`'s telemetry file under a stages folder (RUN_DIR/stages, or a torch job's `metrics_dir`)."""
    return Path(stages_dir) / stage_dir_name(stage) / METRICS


@dataclass(frozen=True)
class RunLayout:
    """The paths of the run directory `root` (see the module docstring)."""

    root: Path
    checkpoint_layout: CheckpointLayout = DEFAULT_LAYOUT

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def manifest(self) -> Path:
        return self.root / MANIFEST

    @property
    def settings(self) -> Path:
        return self.root / SETTINGS_FILE

    @property
    def resolved(self) -> Path:
        return self.root / RESOLVED_FILE

    @property
    def started(self) -> Path:
        """The run's settings and resolved run as it started, which its checkpoints were trained with."""
        return self.root / STARTED_FILE

    @property
    def markers(self) -> tuple[Path, Path]:
        """The unfinished-run marker and its name in older versions."""
        return self.root / INCOMPLETE_MARKER, self.root / LEGACY_INCOMPLETE_MARKER

    @property
    def run_key(self) -> Path:
        return self.root / RUN_KEY

    def stage_config(self, stage: int) -> Path:
        return self.root / stage_config_name(stage)

    @property
    def torch_job(self) -> Path:
        return self.root / TORCH_JOB

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def dev_shard(self) -> Path:
        """Where the data step writes the dev shard (a dev .safetensors given as --eval-data stays where it is)."""
        return self.data / "dev.safetensors"

    @property
    def train_shard(self) -> Path:
        """Where the data step writes the training shard (a .safetensors given as --data stays where it is)."""
        return self.data / "train.safetensors"

    def device_dir(self, device: str) -> Path:
        """A local device's working folder."""
        return self.root / "devices" / device

    def device_logs(self, device: str) -> Path:
        """What `pull` brings back from a device: runner output, configs, telemetry."""
        return self.root / "logs" / device

    @property
    def stages(self) -> Path:
        return self.root / STAGES_DIR

    def stage_metrics(self, stage: int) -> Path:
        return stage_metrics(self.stages, stage)

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS_DIR

    def stage_checkpoints(self, stage: int) -> Path:
        return self.checkpoint_layout.stage_root(self.checkpoints, stage)

    @property
    def adapter(self) -> Path:
        return self.root / "adapter"

    @property
    def eval(self) -> Path:
        return self.root / EVAL_JSON

    @property
    def report_json(self) -> Path:
        return self.root / REPORT_JSON

    @property
    def report_md(self) -> Path:
        return self.root / REPORT_MD

    @property
    def plots(self) -> Path:
        return self.root / PLOTS_DIR
