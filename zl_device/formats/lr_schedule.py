"""AdamW and the runner's learning-rate schedule (runner/include/zl/adamw.h, zl/lr_schedule.h), in Python.

`OptimizerSettings` is the one place the optimizer's defaults live: `zl train`'s settings tree nests it (--lr), the
stage configs carry it (`config`, `from_config`), and the PyTorch references that must apply exactly the runner's
updates (tests, baselines, the torch runtime) train with it:
`torch.optim.lr_scheduler.LambdaLR(opt, lambda t: lr_factor(t, settings.schedule, windows))`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Annotated

from zl_base.json_reader import Bounds, typed
from zl_base.settings import check_fields, setting
from zl_device.formats.runner_config import LrScheduleConfig, OptimizerConfig

_AT_LEAST_0 = Bounds(0)  # the ranges a file read back is checked against (zl_base/json_reader.py)
_Beta = Annotated[float, Bounds(0, below=1)]

SCHEDULE_KINDS = ("constant", "warmup_cosine")


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW (decoupled weight decay) stepped once per window, with a warm-up + cosine learning-rate schedule.

    The defaults are `zl train`'s; a stage config that leaves a field out gets the runner's own default instead
    (`from_config`).
    """

    lr: Annotated[float, _AT_LEAST_0] = setting(2e-3, "AdamW learning rate (warm-up, then cosine to 10%).")
    weight_decay: Annotated[float, _AT_LEAST_0] = setting(0.0, "AdamW's decoupled weight decay.", cli=False)
    betas: tuple[_Beta, _Beta] = setting((0.9, 0.999), "AdamW's moment decays (beta1, beta2).", cli=False)
    eps: Annotated[float, Bounds(above=0)] = setting(1e-8, "Added to the square root of AdamW's second moment.",
                                                     cli=False)
    schedule_kind: str = setting("warmup_cosine", "constant, or warmup_cosine: linear warm-up over the first "
                                                  "windows, then a cosine down to min_lr_ratio x lr.",
                                 choices=SCHEDULE_KINDS, cli=False)
    warmup_windows: Annotated[int, _AT_LEAST_0] = setting(2, "Windows of linear LR warm-up (capped at the run's "
                                                             "windows - 1).", cli=False)
    min_lr_ratio: Annotated[float, Bounds(0, 1)] = setting(0.1, "Where the cosine ends, as a fraction of the lr.",
                                                           cli=False)
    total_steps: Annotated[int, _AT_LEAST_0] = setting(0, "Optimizer steps the cosine spans; 0: the run's windows.",
                                                       cli=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))

    def validate(self) -> None:
        check_fields(self)

    @property
    def schedule(self) -> dict:
        """The schedule as a stage config's "optimizer"."schedule" holds it (what `lr_factor` reads)."""
        if self.schedule_kind == "constant":
            return {"kind": "constant"}
        out = {"kind": self.schedule_kind, "warmup_steps": self.warmup_windows, "min_lr_ratio": self.min_lr_ratio}
        return {**out, "total_steps": self.total_steps} if self.total_steps else out

    def for_windows(self, num_windows: int) -> OptimizerSettings:
        """These settings for a run of `num_windows` windows: the warm-up leaves at least the last window to the
        cosine (a run of 2 windows warms up over 1)."""
        return replace(self, warmup_windows=min(self.warmup_windows, max(0, num_windows - 1)))

    def config(self, lr: float | None = None) -> OptimizerConfig:
        """A stage config's "optimizer" (runner_config.h), with the stage's `lr` (default: `self.lr`)."""
        return OptimizerConfig(lr=self.lr if lr is None else lr, betas=self.betas, eps=self.eps,
                               weight_decay=self.weight_decay, schedule=LrScheduleConfig(**self.schedule))

    @classmethod
    def from_config(cls, optimizer: OptimizerConfig | dict) -> OptimizerSettings:
        """The settings a stage config's "optimizer" (typed, or its JSON object) holds; what the file left out is
        the runner's default (zl/adamw.h: lr 1e-4, weight decay 0.01; a constant schedule)."""
        if not isinstance(optimizer, OptimizerConfig):
            optimizer = typed(OptimizerConfig, optimizer, "optimizer", "fix the stage config's \"optimizer\"")
        schedule = optimizer.schedule
        return cls(lr=optimizer.lr, weight_decay=optimizer.weight_decay, betas=optimizer.betas, eps=optimizer.eps,
                   schedule_kind=schedule.kind, warmup_windows=schedule.warmup_steps,
                   min_lr_ratio=schedule.min_lr_ratio, total_steps=schedule.total_steps)


def lr_factor(t: int, schedule: dict, total_steps: int) -> float:
    """Multiplier of the base lr at optimizer step t (0-based).

    constant: 1. warmup_cosine: (t+1)/W for t < W, then a cosine from 1 down to
    min_lr_ratio at step T (`total_steps`, 0 = `total_steps` argument: the number of windows).
    """
    if schedule.get("kind", "constant") == "constant":
        return 1.0
    w, r = schedule.get("warmup_steps", 0), schedule.get("min_lr_ratio", 0.0)
    total = schedule.get("total_steps", 0) or total_steps
    if t < w:
        return (t + 1) / w
    p = min(max((t - w) / max(1, total - w), 0.0), 1.0)
    return r + (1 - r) * 0.5 * (1 + math.cos(math.pi * p))
