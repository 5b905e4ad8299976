"""What the backprop baselines share (schedules/gpipe.py, schedules/pipedream.py): the stage as a pipelining
stage, the end-to-end loss, and a window's rows at the full sequence length.

The baselines train the same stages, LoRA, data order, micro-batches, windows
and optimizer as ZeroLock, but end to end: the loss is the final output's
cross-entropy on the target positions (eager_training.causal_lm_loss's) and
its gradient flows back through every stage. Micro-batches keep the full
sequence length S (a pipelining stage has fixed shapes); right padding and
causal attention leave the loss as with the padding cut. Stage 0 and the last
stage both read the shard: ids and mask go in at stage 0, labels are the last
stage's loss target.
"""

from __future__ import annotations

import torch
from torch import nn

from zl_device.torch.eager_training import micro_batch_rows
from zl_export.local_loss import shift_targets
from zl_export.shard import Shard


class PipeStage(nn.Module):
    """A StageModule's layers as a pipelining stage: (ids | hidden, mask) -> (hidden, mask); the last stage returns
    the final-normed hidden state (B, S, D) that the loss reads out."""

    def __init__(self, stage_module: nn.Module):
        super().__init__()
        self.stage = stage_module

    def forward(self, x: torch.Tensor, mask: torch.Tensor):
        _, h = self.stage.chunk(x, mask)  # (B, S, D)
        if self.stage.is_last:
            return self.stage.norm(h)
        return h, mask


def target_loss(lm_head: nn.Module):
    """The pipeline's loss_fn: mean cross-entropy of the LM head on the target positions (causal_lm_loss's)."""

    def loss_fn(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        targets, valid = shift_targets(labels)  # (B, S), (B, S)
        rows, cols = valid.bool().nonzero(as_tuple=True)  # K target positions
        return nn.functional.cross_entropy(lm_head(hidden[rows, cols]).float(), targets[rows, cols])

    return loss_fn


def window_rows(shard: Shard, window: range, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, mask, labels), each (m*B, S): the window's micro-batches in order, as the runner's stage 0 takes them."""
    index = torch.cat([torch.arange(shard.rows)[micro_batch_rows(mb, shard.rows, batch)] for mb in window])
    return shard.input_ids[index], shard.attention_mask[index], shard.labels[index]
