"""The backprop schedules on the ranks: GPipe, 1F1B and PipeDream (docs/design#backprop-baselines), each rank running
its stage's list of actions from the schedule table (zl_device/formats/schedule_table.py), as the runner does.

The comparison ZeroLock is measured against (tools/bench_pipelines.py): the same stages, LoRA, data order,
micro-batches, windows and optimizer as a `--runtime torch` run, trained end to end on the final output's
cross-entropy (backprop.py). A schedule is its row of the table; one executor (`ScheduledStage`) runs any row's
lists, so the three differ only in the order of their forwards, backwards and steps:

- GPipe (`gpipe`): all m forwards of a window, then all m backwards, then the step (a flush per window);
- 1F1B (`1f1b`): after K-1-k forwards, one forward then one backward, so stage k keeps at most K-k micro-batches'
  activations instead of m; the window still drains before its step (a window of fewer micro-batches than the
  warm-up runs as GPipe, which is what the warm-up would do anyway);
- PipeDream (`async`), as the PipeDream paper (Narayanan et al., SOSP 2019) runs it: 1F1B without the flush, over
  the whole run's micro-batches. A stage takes its AdamW step (the window's mean gradient, the runner's schedule)
  as soon as the backwards of its window's micro-batches are done, so stages step at different times and a
  micro-batch's forward on stage k may see an older weight version than its neighbours'.

Every step is the mean gradient over the window's micro-batches (`.grad` = their sum / m), then one AdamW step with
the runner's lr schedule. The translator a ZeroLock loss may add gets no gradient here and is committed as
initialised.

Weight stashing: a forward runs on a copy of the stage's current LoRA weights (the base is frozen, so LoRA is all
that changes); the autograd graph keeps that copy, so the micro-batch's backward on this stage uses the weights its
forward used, even after the stage has stepped since. One copy per weight version, shared by the micro-batches
that ran forward on it (under a flush, one per window: the copy is the current weights). A stage holds at most as
many micro-batches' activations as its list has in flight (`max_in_flight`: K-k under 1F1B and PipeDream, m under
GPipe) and, under PipeDream, two weight versions (`in_flight_max`, `stash_versions_max` on the `done` line).

Link: plain `isend`/`irecv` of fixed shapes — forward hidden (B, S, D) and mask (B, S) int64 to k+1, the gradient
of the hidden state (B, S, D) back to k-1. Sends never block the schedule (kept until complete); every receive
waits at most `timeout_s`. On gloo, which moves a message only once its receive is posted, the next forward's and
the next backward's receives are posted as soon as the previous one of the kind has been taken (`_recv`), so
transfers overlap compute as the ZeroLock link's receiving thread lets them (link.py); on NCCL a receive waiting in
a neighbour pair's stream would hold up the sends queued behind it, so there each is posted when needed.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable

import torch
from torch import nn

from zl_base.errors import ZLError
from zl_device.formats.lr_schedule import OptimizerSettings
from zl_device.formats.schedule_table import FORWARD, SCHEDULE_TABLE, STEP, stage_actions
from zl_device.formats.windows import WindowPlan
from zl_device.torch.backprop import PipeStage, target_loss, window_rows
from zl_device.torch.eager_training import runner_optimizer
from zl_device.torch.schedules.base import CrossRankBackprop
from zl_device.torch.stage_io import Rank
from zl_export.backprop_stage import backprop_objective

TAG_HIDDEN, TAG_MASK, TAG_GRAD = 0, 1, 2

# (ids, mask, labels) of one global micro-batch, each (B, S) int64; stage 0 and the last stage read them.
Batches = Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


#: The table's rows whose final-loss gradient crosses the ranks: what `ScheduledStage` runs.
KINDS = tuple(name for name, rule in SCHEDULE_TABLE.items() if rule.backprop)


class ScheduledStage:
    """One rank of a backprop pipeline over stage `module`'s layers, running its list of actions under `schedule`
    (a row of the schedule table) for a whole run of `plan`'s windows."""

    def __init__(self, module: nn.Module, rank: int, world: int, device: torch.device, schedule: str, lr: float,
                 opt: OptimizerSettings, plan: WindowPlan, timeout_s: float = 600.0):
        if schedule not in KINDS:
            raise ValueError(f"schedule {schedule!r}: expected one of {KINDS}")
        module.train()  # LoRA dropout is 0; train mode only so nothing skips autograd
        self.module, self.rank, self.world, self.device, self.plan = module, rank, world, device, plan
        self.schedule = schedule
        self.pipe = PipeStage(module)
        # LoRA only: a readout translator is ZeroLock's and gets no gradient here.
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad and "lora_" in n]
        self.names = [f"stage.{n}" for n, _ in named]  # PipeStage's names, for functional_call
        self.params = [p for _, p in named]
        self.loss_fn = target_loss(module)
        self.optimizer, self.scheduler = runner_optimizer([{"params": self.params, "lr": lr}], opt, plan.num_windows)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.version = 0  # optimizer steps taken by this stage
        self._stash: tuple[int, list[torch.Tensor]] | None = None
        self.in_flight_max = 0
        self.stash_versions_max = 0
        self._posted: dict[str, tuple[int, torch.Tensor, object]] = {}  # kind -> (mb, buffer, its irecv)

    def _stashed(self) -> tuple[int, list[torch.Tensor]]:
        """The current weight version's copy of the LoRA weights (made at its first forward)."""
        if self._stash is None or self._stash[0] != self.version:
            self._stash = (self.version, [p.detach().clone().requires_grad_() for p in self.params])
        return self._stash

    def _wait(self, work, what: str, mb: int) -> None:
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as e:
            raise ZLError(f"{self.schedule} stage {self.rank}: {what} of micro-batch {mb} did not complete within "
                          f"{self.timeout.total_seconds():.0f} s ({e}); a neighbouring stage hung or died.") from e

    def _recv(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int, what: str, mb: int,
              ahead: bool) -> torch.Tensor:
        """Micro-batch `mb`'s tensor of kind `key` from `src`; with `ahead`, the same kind's receive for mb+1 is
        posted before this returns (if the plan has one). Receives of one kind come in micro-batch order."""
        import torch.distributed as dist

        def post(m: int) -> None:
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            self._posted[key] = (m, buf, dist.irecv(buf, src=src, tag=tag))

        if key not in self._posted:
            post(mb)
        posted_mb, buf, work = self._posted.pop(key)
        assert posted_mb == mb, (key, posted_mb, mb)  # stage_actions takes each kind in micro-batch order
        if ahead and mb + 1 < self.plan.num_micro_batches:
            post(mb + 1)
        self._wait(work, what, mb)
        return buf

    def run(self, batches: Batches | None, hidden_shape: tuple[int, int, int],
            on_window: Callable[[int, float | None, float], None] | None = None) -> None:
        """Train the whole plan: this stage's list of actions (`stage_actions`), each as it comes. `batches` (stage 0
        and the last stage) gives a micro-batch's full-length rows; `hidden_shape` is (B, S, D); `on_window(window,
        mean loss on the last stage else None, lr)` follows each of this stage's AdamW steps, when `.grad` holds
        that window's mean gradient (and still does after the run, the last window's)."""
        import torch.distributed as dist

        first, last = self.rank == 0, self.rank == self.world - 1
        if (first or last) and batches is None:
            raise ZLError(f"{self.schedule} stage {self.rank}: the first and last stages need the micro-batches.")
        plan, (b, s, d) = self.plan, hidden_shape
        dtype = self.module.norm.weight.dtype
        in_flight: dict[int, tuple] = {}  # mb -> (input, output or loss, stashed version, stashed weights)
        sends: list[tuple] = []  # (work, tensor, what, mb): a tensor lives until its send completes
        ahead = self.device.type == "cpu"  # gloo: post the next receive of a kind early (module docstring)
        grad_sum = [torch.zeros_like(p) for p in self.params]
        losses: list[float] = []
        for action in stage_actions(self.schedule, self.rank, self.world, plan):
            sends = [x for x in sends if not x[0].is_completed()]
            mb = action.micro_batch
            if action.kind == STEP:  # after the backward of the window's last micro-batch
                window = plan.window_of(mb)
                count = len(plan.micro_batches(window))
                for p, acc in zip(self.params, grad_sum):
                    p.grad = acc / count  # the window's mean gradient
                    acc.zero_()
                lr = self.optimizer.param_groups[0]["lr"]
                self.optimizer.step()
                self.scheduler.step()
                self.version += 1
                if on_window is not None:
                    on_window(window, sum(losses) / len(losses) if last else None, lr)
                losses = []
                continue
            if action.kind == FORWARD:
                if first:
                    x, mask, _ = (t.to(self.device) for t in batches(mb))  # (B, S) ids
                    if tuple(x.shape) != (b, s):
                        raise ZLError(f"{self.schedule} stage 0: micro-batch {mb} has shape {tuple(x.shape)}, expected "
                                      f"(B, S) = {(b, s)} (the manifest's micro_batch and seq_len); the shard and "
                                      "manifest disagree: prepare the run again.")
                else:
                    x = self._recv("hidden", (b, s, d), dtype, self.rank - 1, TAG_HIDDEN, "hidden state", mb,
                                   ahead).requires_grad_()
                    mask = self._recv("mask", (b, s), torch.int64, self.rank - 1, TAG_MASK, "mask", mb, ahead)
                version, weights = self._stashed()
                out = torch.func.functional_call(self.pipe, dict(zip(self.names, weights)), (x, mask))
                if last:
                    out = self.loss_fn(out, batches(mb)[2].to(self.device))  # () mean CE of the micro-batch
                    losses.append(float(out.detach()))
                else:
                    h = out[0].detach().contiguous()  # (B, S, D)
                    sends += [(dist.isend(h, self.rank + 1, tag=TAG_HIDDEN), h, "hidden state", mb),
                              (dist.isend(mask, self.rank + 1, tag=TAG_MASK), mask, "mask", mb)]
                    out = out[0]
                in_flight[mb] = (x, out, version, weights)
                self.in_flight_max = max(self.in_flight_max, len(in_flight))
                self.stash_versions_max = max(self.stash_versions_max, len({v[2] for v in in_flight.values()}))
                continue
            x, out, _, weights = in_flight.pop(mb)
            upstream = None if last else self._recv("gradient", (b, s, d), dtype, self.rank + 1, TAG_GRAD,
                                                    "gradient", mb, ahead)
            inputs = weights if first else [*weights, x]
            # on the stashed weights; upstream, the backprop program's objective <h, grad_hidden>
            # (docs/design#backprop-program)
            grads = torch.autograd.grad(out if last else backprop_objective(out, upstream), inputs)
            for acc, g in zip(grad_sum, grads):
                acc += g
            if not first:
                gx = grads[-1].contiguous()  # (B, S, D)
                sends.append((dist.isend(gx, self.rank - 1, tag=TAG_GRAD), gx, "gradient", mb))
        for work, _, what, mb in sends:
            self._wait(work, f"sending the {what}", mb)


class TableBackprop(CrossRankBackprop):
    """A backprop schedule on the ranks: `ScheduledStage` over the whole run under the table's row `name`; a stage
    commits a window at its own step (under a flush every stage steps once the window has drained)."""

    def __init__(self, rank: Rank):
        super().__init__(rank, ScheduledStage(rank.module, rank.index, rank.world, rank.device, self.name, rank.lr,
                                              rank.optimizer_settings, rank.plan, timeout_s=rank.job.link_timeout_s))

    def train(self, first_window: int) -> dict:
        rank, shard, batch = self.rank, self.shard, self.rank.batch
        hidden_shape = (batch, rank.manifest.options.seq_len, rank.module.norm.weight.shape[-1])  # (B, S, D)
        batches = None if shard is None else (lambda mb: window_rows(shard, range(mb, mb + 1), batch))
        self.pipe.run(batches, hidden_shape,
                      lambda w, loss, lr: rank.commit(w, self.optimizer, self.scheduler.last_epoch, lr, mean_loss=loss))
        return {"in_flight_max": self.pipe.in_flight_max, "stash_versions_max": self.pipe.stash_versions_max}


@functools.cache
def table_schedule(name: str) -> type[TableBackprop]:
    """The torch runtime's schedule for the table's backprop row `name` (gpipe, 1f1b, async): `TableBackprop` under
    that name.

    Raises:
        ValueError: not a backprop row.
    """
    if name not in KINDS:
        raise ValueError(f"schedule {name!r}: expected one of {KINDS}")
    return type(f"TableBackprop[{name}]", (TableBackprop,), {"name": name, "__doc__": TableBackprop.__doc__})
