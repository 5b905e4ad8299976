"""The interface every pipeline schedule of the torch runtime implements (the table is schedules/__init__.py).

A schedule is what differs between ZeroLock and the backprop baselines on one
rank: how micro-batches and gradients flow between the ranks and when the
stage steps. Everything else is the harness's (harness.py: process group,
stage, barrier, resume point, `start`/`done` lines) and the `Rank`'s
(stage_io.py: telemetry lines, window checkpoints), the same for every
schedule.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from zl_device.torch.stage_io import Rank


class Schedule(ABC):
    """One rank's training under a pipeline schedule.

    `__init__(rank)` is the set-up, before the ranks' barrier (it is not run time): optimizer, links, data. It
    sets `optimizer` and `scheduler` (torch AdamW and the runner's lr schedule), which the harness resumes and
    whose step count the `done` line reports. `train(first_window)` trains windows `first_window`.. to the
    run's end and commits each one through `rank.commit` (checkpoint + `window` line) right after its optimizer
    step; it returns the `done` line's own fields.
    """

    #: The name in the table: a torch job's `pipeline`, tools/bench_pipelines.py --pipelines.
    name: ClassVar[str]
    #: Resumes from the latest window every stage checkpointed after a restart (`Rank.resume`); a schedule that
    #: does not starts its run over (its replay is the same computation, so the result is the same).
    resumable: ClassVar[bool] = False
    #: This rank runs its stage's forward only (ZeroLock's stage held still by lr 0); the `start` line says so.
    forward_only: bool = False

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler

    def __init__(self, rank: Rank):
        self.rank = rank

    @abstractmethod
    def train(self, first_window: int) -> dict:
        """Train windows `first_window`.. of the plan, committing each; returns the `done` line's extra fields."""


class CrossRankBackprop(Schedule, ABC):
    """A backprop baseline: the gradient crosses ranks, so the first rank (input ids) and the last (labels) read
    the shard, and `pipe`, the rank's part of the cross-rank stage, owns the optimizer and its schedule."""

    def __init__(self, rank: Rank, pipe):
        super().__init__(rank)
        self.shard = rank.shard() if rank.first or rank.last else None
        self.pipe = pipe
        self.optimizer, self.scheduler = pipe.optimizer, pipe.scheduler
