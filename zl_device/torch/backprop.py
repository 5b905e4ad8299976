"""What the backprop baselines share (schedules/backprop_ranks.py): the stage as a pipeline
stage, the end-to-end loss, and a window's rows at the full sequence length.

The baselines train the same stages, LoRA, data order, micro-batches, windows
and optimizer as ZeroLock, but end to end: the loss is the final output's
cross-entropy on the target positions (eager_training.causal_lm_loss's), the
backprop program's true loss (`StageModule.task_loss`, zl_export/backprop_stage.py,
docs/design#backprop-program), and its gradient flows back through every stage. Micro-batches keep the full
sequence length S (the links carry fixed shapes); right padding and
causal attention leave the loss as with the padding cut. Stage 0 and the last
stage both read the shard: ids and mask go in at stage 0, labels are the last
stage's loss target.
"""

from __future__ import annotations

import torch
from torch import nn

from zl_device.torch.eager_training import micro_batch_rows
from zl_export.shard import Shard


class PipeStage(nn.Module):
    """A StageModule's layers as a pipeline stage: (ids | hidden, mask) -> (hidden, mask); the last stage returns
    its output hidden state (B, S, D), which the loss reads out (`target_loss`)."""

    def __init__(self, stage_module: nn.Module):
        super().__init__()
        self.stage = stage_module

    def forward(self, x: torch.Tensor, mask: torch.Tensor):
        _, h = self.stage.chunk(x, mask)  # (B, S, D)
        if self.stage.is_last:
            return h
        return h, mask


def target_loss(stage_module: nn.Module):
    """The pipeline's loss_fn(hidden (B, S, D), labels (B, S)): the last stage's true loss, the mean cross-entropy
    of its readout on the target positions (causal_lm_loss's), as the backprop program computes it
    (`StageModule.task_loss`), here on exactly those positions (`gather_targets`, set on the module)."""
    stage_module.gather_targets = True
    return stage_module.task_loss


def window_rows(shard: Shard, window: range, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, mask, labels), each (m*B, S): the window's micro-batches in order, as the runner's stage 0 takes them."""
    index = torch.cat([torch.arange(shard.rows)[micro_batch_rows(mb, shard.rows, batch)] for mb in window])
    return shard.input_ids[index], shard.attention_mask[index], shard.labels[index]
