"""RUN_DIR/torch_job.json: what every rank of a `--runtime torch` run needs, written once by `zl train`.

The ranks read nothing else of the run's settings: `zl train --runtime torch` writes the job (run/torch_runtime.py),
`--launcher torchrun` leaves it for torchrun's ranks, tools/bench_pipelines.py rewrites its `pipeline` and
output folders to run one prepared job as every schedule.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from zl_device.formats.lr_schedule import OptimizerSettings
from zl_device.formats.run_layout import TORCH_JOB
from zl_device.formats.runner_config import LrScheduleConfig, OptimizerConfig
from zl_device.formats.stage_spec import FORWARD, stage_role


@dataclass
class TorchJob:
    """What every rank needs: the run's model, manifest, shard, plan, optimizer and where to write."""

    model: str  # the model spec (`--model`)
    manifest: str  # RUN_DIR/manifest.json: stages, LoRA, loss, shapes, seed
    shard: str  # stage 0's training shard (also the lens calibration rows)
    run_id: str
    window_size: int
    num_micro_batches: int
    micro_batch: int  # B, rows per micro-batch (the manifest's)
    lr: list[float]  # per stage: --lr x --stage-lr
    weight_decay: float
    schedule: LrScheduleConfig  # the runner's lr schedule (a runner config's "optimizer"."schedule")
    checkpoint_dir: str  # RUN_DIR/checkpoints; stage k writes stage_<k>/window_NNNNNN/
    metrics_dir: str  # RUN_DIR/stages; stage k appends to stage_<k>/metrics.jsonl
    keep_last: int = 2
    threads: int = 1  # torch intra-op threads per rank
    in_flight: int = 4  # un-received entries per link
    link_timeout_s: float = 600.0
    backend: str = "auto"  # auto: nccl when CUDA is there, else gloo
    pipeline: str = "zerolock"  # the schedule: a name in zl_device/torch/schedules SCHEDULES (zerolock, gpipe, ...)
    resume: bool = False  # start after the latest window every stage has checkpointed (docs/design#torch-runtime)
    fail_at: list[int] | None = None  # [stage, micro-batch]: that stage SIGKILLs itself there (--inject-failure)
    # ZeroLock's micro-batches cut to their longest row (eager takes any length); False: the full seq_len, the
    # work the runner's programs and the backprop baselines' fixed-shape stages do (tools/bench_pipelines.py).
    trim_padding: bool = True
    # ZeroLock's held stages (role forward) run phase 1 only (the runner config's forward_only_at_lr0); False:
    # they compute their local loss and backward too (the weights stay the same either way).
    forward_only_at_lr0: bool = True
    # per stage: its role (zl_device/formats/stage_spec.py ROLES); None in a job written before roles were: worked
    # out from `lr` and `pipeline` when loaded (stage_role, the rule the resolved run applies)
    roles: list[str] | None = None

    def __post_init__(self) -> None:
        if self.roles is None:
            self.roles = [stage_role(lr, k, len(self.lr), self.pipeline) for k, lr in enumerate(self.lr)]

    def forward_only(self, stage: int) -> bool:
        """Whether stage `stage` runs phase 1 only: held still (its role) and `forward_only_at_lr0`."""
        return self.forward_only_at_lr0 and self.roles[stage] == FORWARD

    @property
    def num_stages(self) -> int:
        """The run's stages: one rank and one learning rate each (the manifest's `stage_count`)."""
        return len(self.lr)

    def optimizer(self, stage: int) -> OptimizerSettings:
        """Stage `stage`'s AdamW and schedule, as a runner config's "optimizer" with the job's values."""
        return OptimizerSettings.from_config(OptimizerConfig(lr=self.lr[stage], weight_decay=self.weight_decay,
                                                             schedule=self.schedule))

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @staticmethod
    def load(path: Path | str) -> TorchJob:
        from zl_base.json_reader import read_typed

        path = Path(path)
        fix = "`zl train --runtime torch` writes one into its run directory; restore it, or start the run again"
        return read_typed(path, TorchJob, f"{path} ({TORCH_JOB})", fix)


def for_attempt(job: TorchJob, attempt: int) -> TorchJob:
    """The job as the ranks' attempt `attempt` runs it (0: the first; torchrun counts in TORCHELASTIC_RESTART_COUNT,
    zl's launcher passes it): every restart resumes from the latest window every stage checkpointed, and an
    injected failure (`fail_at`) happens in the first attempt only."""
    return job if attempt == 0 else replace(job, resume=True, fail_at=None)
