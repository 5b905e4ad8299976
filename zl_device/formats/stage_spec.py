"""A stage as a run plans it: its place, its role, its learning rate and schedule (docs/design#windows-and-adamw,
#backprop-schedules).

`zl train` resolves its run once (zl_device/run/resolved_run.py) into one `StageSpec` per stage; the ExecuTorch
launch turns each into a runner config (zl_device/executorch/launch.py `stage_configs`) and the torch runtime into
its job (zl_device/torch/job.py `TorchJob`). Both read the role from the spec: nothing downstream infers it from a
learning rate. `stage_role` is the one rule that assigns it, the rule the runner applies to a config without a
role (RunnerConfig::forward_only, runner/include/zl/runner_config.h).

One name per concept, from the flag to the runner's config, but for the few keys of that wire format that spell a
concept otherwise: `runner_config.SETTING_NAMES` lists them, and the typed `RunnerConfig` is the only place that
writes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from zl_base.json_reader import Bounds
from zl_device.formats.schedules import SCHEDULES, is_backprop

#: A stage's role. train: it steps its LoRA weights (its learning rate may still be 0 in a backprop schedule,
#: where it must pass the gradient upstream); forward: held still, it runs phase 1 only and hands its hidden
#: state on (ZeroLock's stages at lr 0 but the last).
TRAIN, FORWARD = "train", "forward"
ROLES = (TRAIN, FORWARD)

def stage_role(lr: float, stage: int, num_stages: int, schedule: str) -> str:
    """The role of stage `stage` with learning rate `lr`: held still (FORWARD) when ZeroLock gives it lr 0 and it
    is not the last (its phase 2 could not move its weights; the last always computes the loss), else TRAIN.
    A backprop schedule's stages all run their backward: a stage upstream still needs their gradient."""
    return FORWARD if lr == 0 and stage < num_stages - 1 and not is_backprop(schedule) else TRAIN


@dataclass(frozen=True)
class StageSpec:
    """One stage of a resolved run: what both runtimes' stage configs are made from."""

    index: Annotated[int, Bounds(0)]
    num_stages: Annotated[int, Bounds(1)]
    lr: Annotated[float, Bounds(0)]  # peak learning rate: --lr x its --stage-lr multiplier
    role: str  # TRAIN | FORWARD
    schedule: str  # zerolock | gpipe | 1f1b | async (the schedule's own name, an alias resolved)

    def __post_init__(self) -> None:
        if self.role not in ROLES or self.schedule not in SCHEDULES or not 0 <= self.index < self.num_stages:
            raise ValueError(f"StageSpec {self}: role in {ROLES}, schedule in {SCHEDULES}, 0 <= index < num_stages")
        if self.role == FORWARD and (self.lr != 0 or self.index == self.num_stages - 1 or is_backprop(self.schedule)):
            raise ValueError(f"StageSpec {self}: only a ZeroLock stage at lr 0 before the last is held still")

    @property
    def forward_only(self) -> bool:
        """Held still: phase 1 only (docs/design#windows-and-adamw)."""
        return self.role == FORWARD

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


def stage_specs(lrs: tuple[float, ...] | list[float], schedule: str) -> tuple[StageSpec, ...]:
    """The stages of a run whose stage k trains at `lrs[k]`, on `schedule` (its own name, not an alias)."""
    n = len(lrs)
    return tuple(StageSpec(k, n, float(lr), stage_role(lr, k, n, schedule), schedule) for k, lr in enumerate(lrs))
