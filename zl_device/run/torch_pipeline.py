"""Backprop baselines on the same ranks: GPipe and 1F1B (torch.distributed.pipelining) over ZeroLock's split.

The comparison ZeroLock is measured against (tools/bench_pipelines.py): the
same stages, LoRA, data order, micro-batches, windows and optimizer as a
`--runtime torch` run (torch_stage.py), but trained end to end — the loss is
the final output's cross-entropy (eager_training.causal_lm_loss) and its
gradient flows back through every stage, so each rank holds activations until
their backward comes back:

- GPipe (`ScheduleGPipe`): all m forwards of a window, then all m backwards;
- 1F1B (`Schedule1F1B`): after a warm-up, one forward then one backward, so a
  stage keeps at most K-k micro-batches' activations instead of m (a window of
  fewer than K micro-batches runs as GPipe: 1F1B's warm-up would hold them all).

One window = one `schedule.step` over its m micro-batches of B rows;
`scale_grads` makes the gradient the mean over them (the runner's mean
gradient), then one AdamW step with the runner's schedule (no `.grad /= m`:
the schedule has scaled it). Micro-batches keep the full sequence length S (a
pipelining stage has fixed shapes); right padding and causal attention leave
the loss as with the padding cut. Stage 0 and the last stage both read the
shard: ids and mask go in at stage 0, labels are the last stage's loss target.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from zl_device.run.eager_training import OptimizerSettings, micro_batch_rows, runner_optimizer
from zl_export.local_loss import shift_targets
from zl_export.shard import Shard

SCHEDULES = ("gpipe", "1f1b")  # torch.distributed.pipelining's, one flush per window
BASELINES = (*SCHEDULES, "pipedream")  # + asynchronous 1F1B with weight stashing (torch_pipedream.py)


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


class PipelinedStage:
    """One rank of a GPipe or 1F1B pipeline over stage `module`'s layers, trained window by window."""

    def __init__(self, module: nn.Module, rank: int, world: int, device: torch.device, schedule: str, lr: float,
                 opt: OptimizerSettings, num_windows: int):
        from torch.distributed.pipelining import PipelineStage

        if schedule not in SCHEDULES:
            raise ValueError(f"schedule {schedule!r}: expected one of {SCHEDULES}")
        module.train()  # LoRA dropout is 0; train mode only so nothing skips autograd
        self.module, self.rank, self.world, self.kind = module, rank, world, schedule
        # LoRA only: a readout translator is ZeroLock's and gets no gradient here.
        self.params = [p for n, p in module.named_parameters() if p.requires_grad and "lora_" in n]
        self.stage = PipelineStage(PipeStage(module), rank, world, device)
        # Every rank passes the loss: a schedule without one runs forward only (only the last stage calls it).
        self.loss_fn = target_loss(module.lm_head)
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


def train_pipelined(job, rank: int, world: int, device: torch.device, backend: str) -> None:
    """Rank `rank` of a GPipe / 1F1B / PipeDream run of a torch job (`job.pipeline`): the job's stages, data, plan and
    optimizer; telemetry `start`, `window` (last stage: mean loss) and `done` lines, and a checkpoint per window in
    the runner's format as ZeroLock's ranks write (so the baselines pay the same, and `zl merge` / `zl eval` read
    their adapter). The translator a ZeroLock loss may add gets no gradient here and is saved as initialised."""
    import os
    import time

    import torch.distributed as dist

    from zl_device.run.eager_training import adamw_moments
    from zl_device.run.torch_stage import Telemetry, build_stage, busy, pss_mib, reset_peak_rss, save_window
    from zl_device.run.windows import WindowPlan
    from zl_export.manifest import read_manifest_file
    from zl_export.shard import load_shard

    manifest = read_manifest_file(Path(job.manifest))
    module, names, weights = build_stage(job, manifest, rank)
    module.to(device)
    batch = manifest["micro_batch"]
    shard = load_shard(job.shard) if rank in (0, world - 1) else None
    plan = WindowPlan(job.num_micro_batches, job.window_size)
    opt = OptimizerSettings(lr=job.lr[rank], weight_decay=job.weight_decay, schedule=job.schedule)
    log = Telemetry(Path(job.metrics_dir) / f"stage_{rank}" / "metrics.jsonl")
    if job.pipeline == "pipedream":
        from zl_device.run.torch_pipedream import PipeDreamStage

        pipe = PipeDreamStage(module, rank, world, device, job.lr[rank], opt, plan, timeout_s=job.link_timeout_s)
    else:
        pipe = PipelinedStage(module, rank, world, device, job.pipeline, job.lr[rank], opt, plan.num_windows)
    trainable = [p for p in module.parameters() if p.requires_grad]
    setup_peak = reset_peak_rss()  # the done line's train_peak_rss_mib: training's peak, not the model load's
    dist.barrier()
    log.write({"type": "start", "t_unix_ms": int(time.time() * 1000), "stage": rank, "num_stages": world,
               "pid": os.getpid(), "runtime": "torch", "pipeline": job.pipeline, "backend": backend,
               "weights": weights})
    cpu0, wall0 = time.process_time(), time.perf_counter()
    t0 = time.perf_counter()

    def window_line(w: int, loss: float | None, lr: float) -> None:
        nonlocal t0
        c0 = time.perf_counter()
        save_window(job, rank, w, plan, {names[id(p)]: p for p in trainable},
                    adamw_moments(pipe.optimizer, trainable, names), pipe.scheduler.last_epoch, lr)
        log.write({"type": "window", "t_unix_ms": int(time.time() * 1000), "stage": rank, "window": w,
                   "micro_batches": len(plan.micro_batches(w)), "mean_loss": loss, "lr": lr,
                   "window_ms": (time.perf_counter() - t0) * 1e3, "checkpoint_ms": (time.perf_counter() - c0) * 1e3,
                   "pss_mib": pss_mib(), "temperature_c": None})
        t0 = time.perf_counter()

    extra: dict = {}
    if job.pipeline == "pipedream":
        hidden_shape = (batch, manifest["seq_len"], module.norm.weight.shape[-1])  # (B, S, D)
        pipe.run(None if shard is None else lambda mb: window_rows(shard, range(mb, mb + 1), batch), hidden_shape,
                 window_line)
        extra = {"in_flight_max": pipe.in_flight_max, "stash_versions_max": pipe.stash_versions_max}
    else:
        for w in range(plan.num_windows):
            window = plan.micro_batches(w)
            if shard is not None:
                ids, mask, labels = (t.to(device) for t in window_rows(shard, window, batch))
            else:
                ids = mask = labels = None
            loss = pipe.backward_window(ids, mask, labels, len(window))
            window_line(w, loss, pipe.step())
    log.write({"type": "done", "t_unix_ms": int(time.time() * 1000), "stage": rank,
               "micro_batches": plan.num_micro_batches, **busy(cpu0, wall0, setup_peak), **extra})
