"""GPipe and 1F1B (torch.distributed.pipelining) over ZeroLock's split: two backprop baselines.

The comparison ZeroLock is measured against (tools/bench_pipelines.py): the
same stages, LoRA, data order, micro-batches, windows and optimizer as a
`--runtime torch` run, trained end to end (backprop.py), so each rank holds
activations until their backward comes back:

- GPipe (`ScheduleGPipe`): all m forwards of a window, then all m backwards;
- 1F1B (`Schedule1F1B`): after a warm-up, one forward then one backward, so a
  stage keeps at most K-k micro-batches' activations instead of m (a window of
  fewer than K micro-batches runs as GPipe: 1F1B's warm-up would hold them all).

One window = one `schedule.step` over its m micro-batches of B rows;
`scale_grads` makes the gradient the mean over them (the runner's mean
gradient), then one AdamW step with the runner's schedule (no `.grad /= m`:
the schedule has scaled it). The translator a ZeroLock loss may add gets no
gradient here and is committed as initialised.
"""

from __future__ import annotations

import torch
from torch import nn

from zl_device.formats.lr_schedule import OptimizerSettings
from zl_device.torch.backprop import PipeStage, target_loss, window_rows
from zl_device.torch.eager_training import runner_optimizer
from zl_device.torch.schedules.base import CrossRankBackprop
from zl_device.torch.stage_io import Rank

KINDS = ("gpipe", "1f1b")  # torch.distributed.pipelining's, one flush per window


class PipelinedStage:
    """One rank of a GPipe or 1F1B pipeline over stage `module`'s layers, trained window by window."""

    def __init__(self, module: nn.Module, rank: int, world: int, device: torch.device, schedule: str, lr: float,
                 opt: OptimizerSettings, num_windows: int):
        from torch.distributed.pipelining import PipelineStage

        if schedule not in KINDS:
            raise ValueError(f"schedule {schedule!r}: expected one of {KINDS}")
        module.train()  # LoRA dropout is 0; train mode only so nothing skips autograd
        self.module, self.rank, self.world, self.kind = module, rank, world, schedule
        # LoRA only: a readout translator is ZeroLock's and gets no gradient here.
        self.params = [p for n, p in module.named_parameters() if p.requires_grad and "lora_" in n]
        self.stage = PipelineStage(PipeStage(module), rank, world, device)
        # Every rank passes the loss: a schedule without one runs forward only (only the last stage calls it).
        self.loss_fn = target_loss(module)
        self.optimizer, self.scheduler = runner_optimizer([{"params": self.params, "lr": lr}], opt, num_windows)
        self._schedules: dict[int, object] = {}

    def _schedule(self, count: int):
        """The schedule for windows of `count` micro-batches (a short last window gets its own)."""
        if count not in self._schedules:
            from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

            # 1F1B needs at least K micro-batches; with fewer its warm-up holds them all, which is GPipe's order.
            cls = Schedule1F1B if self.kind == "1f1b" and count >= self.world else ScheduleGPipe
            self._schedules[count] = cls(self.stage, n_microbatches=count, loss_fn=self.loss_fn, scale_grads=True)
        return self._schedules[count]

    def backward_window(self, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor, count: int) -> float | None:
        """Forward and backward of one window's `count` micro-batches ((count*B, S) each); the mean gradient is in
        `.grad` afterwards. Returns the mean micro-batch loss on the last stage, None elsewhere."""
        for p in self.params:
            p.grad = None
        schedule = self._schedule(count)
        if self.rank == 0:
            schedule.step(ids, mask)
        elif self.module.is_last:
            losses: list[torch.Tensor] = []
            schedule.step(target=labels, losses=losses, return_outputs=False)
            return float(torch.stack([loss.detach() for loss in losses]).mean())
        else:
            schedule.step()
        return None

    def step(self) -> float:
        """The window's AdamW step on the mean gradient; returns the lr used."""
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        return lr


class GPipe(CrossRankBackprop):
    """GPipe on the ranks: per window all forwards, then all backwards, then every stage's AdamW step."""

    name = "gpipe"

    def __init__(self, rank: Rank):
        super().__init__(rank, PipelinedStage(rank.module, rank.index, rank.world, rank.device, self.name, rank.lr,
                                              rank.optimizer_settings, rank.plan.num_windows))

    def train(self, first_window: int) -> dict:
        rank, plan = self.rank, self.rank.plan
        for w in range(first_window, plan.num_windows):
            window = plan.micro_batches(w)
            if self.shard is not None:
                ids, mask, labels = (t.to(rank.device) for t in window_rows(self.shard, window, rank.batch))
            else:
                ids = mask = labels = None
            loss = self.pipe.backward_window(ids, mask, labels, len(window))
            lr = self.pipe.step()
            rank.commit(w, self.optimizer, self.scheduler.last_epoch, lr, mean_loss=loss)
        return {}


class OneFOneB(GPipe):
    """1F1B on the ranks: GPipe's windows, with one forward then one backward after a warm-up."""

    name = "1f1b"
