"""Training in PyTorch eager with exactly the runner's semantics: ZeroLock's pipeline and the backprop baselines.

What "the runner's semantics" means (runner/src/runner.cpp, data_shard.cpp, zl/window_plan.h,
zl/adamw.h):

- micro-batch mb of stage 0 takes shard rows [j*B, (j+1)*B) with
  j = mb mod floor(N/B), in order;
- a window is m consecutive micro-batches (the last one may be shorter); the
  gradient of a window is the MEAN of its micro-batches' gradients, and one
  AdamW step (torch's, decoupled weight decay) is taken per window with the
  runner's learning-rate schedule (zl_device/formats/lr_schedule.py);
- in ZeroLock every stage steps its own parameters on its own local loss, and
  stage k's micro-batch mb is computed on the hidden state stage k-1 produced
  for mb with its weights of the same window (parameters change only at window
  ends), so running the stages one after another per micro-batch computes what
  the pipeline computes.

Padding is cut per micro-batch (right padding and causal attention make the
valid positions independent of it) and the readouts run only on the target
positions: the same losses, at eager speed, for the accuracy study
(tools/accuracy_study.py). `tests/test_train.py` checks the ZeroLock trainer
against a `zl train` run's adapter.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from zl_base.errors import ZLError
from zl_device.formats.lr_schedule import OptimizerSettings, lr_factor  # noqa: F401 (OptimizerSettings: re-exported)
from zl_device.formats.stage_spec import stage_specs
from zl_device.formats.windows import WindowPlan
from zl_export.local_loss import shift_targets
from zl_export.shard import Shard


@dataclass(frozen=True)
class Budget:
    """How many micro-batches of how many rows, in windows of how many micro-batches (arithmetic: `WindowPlan`)."""

    samples: int
    window: int
    micro_batch: int = 1

    @property
    def plan(self) -> WindowPlan:
        return WindowPlan.for_samples(self.samples, self.micro_batch, self.window)

    @property
    def num_micro_batches(self) -> int:
        return self.plan.num_micro_batches

    @property
    def num_windows(self) -> int:
        return self.plan.num_windows

    def windows(self) -> list[range]:
        """Micro-batch ids of each window, in order."""
        plan = self.plan
        return [plan.micro_batches(w) for w in range(plan.num_windows)]


def micro_batch_rows(mb: int, rows: int, batch: int) -> slice:
    """Rows of micro-batch `mb`, as the runner's stage 0 takes them: j = mb mod floor(rows/batch), rows [j*B, (j+1)*B)."""
    j = mb % (rows // batch)
    return slice(j * batch, (j + 1) * batch)


def micro_batch(shard: Shard, mb: int, batch: int, trim: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels), each (B, L) int64: cut to the longest row of the micro-batch (right
    padding and causal attention leave every real position's result as it is), or, without `trim`, the shard's
    full length S (the work a program of fixed shapes does)."""
    rows = micro_batch_rows(mb, shard.rows, batch)
    mask = shard.attention_mask[rows]
    length = int(mask.sum(1).max()) if trim else mask.shape[1]
    return shard.input_ids[rows, :length], mask[:, :length], shard.labels[rows, :length]


def adamw_moments(optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
                  names: dict[int, str]) -> dict[str, torch.Tensor]:
    """`optimizer`'s first and second moments of `params` by manifest name (`names`: id -> name), as the runner
    checkpoints them: `<name>.exp_avg`, `<name>.exp_avg_sq`; zeros for a parameter it has not stepped."""
    out = {}
    for p in params:
        state = optimizer.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{names[id(p)]}.{key}"] = state[key].detach() if key in state else torch.zeros_like(p.detach())
    return out


def runner_optimizer(groups: list[dict], opt: OptimizerSettings, num_windows: int):
    """torch AdamW over `groups` (each {"params", "lr"}) with the runner's schedule as a LambdaLR stepped per window."""
    optimizer = torch.optim.AdamW(groups, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: lr_factor(t, opt.schedule, num_windows))
    return optimizer, scheduler


def _step(optimizer, scheduler, params: Sequence[torch.nn.Parameter], count: int) -> float:
    """One window's update on the MEAN gradient of its `count` micro-batches; returns the lr used.

    `.grad` keeps that mean gradient until the next window starts (tests inspect it).
    """
    for p in params:
        if p.grad is not None:
            p.grad /= count
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    return lr


@dataclass
class TrainLog:
    """Per-window figures: mean loss of each window (per stage for ZeroLock), lr, wall time."""

    losses: list[list[float]] = field(default_factory=list)  # [window][stage] mean micro-batch loss (nats)
    task_losses: list[list[float]] = field(default_factory=list)
    consistency_losses: list[list[float]] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    seconds: float = 0.0


# --- ZeroLock ------------------------------------------------------------------------------------------


class StageStep:
    """One ZeroLock stage's training, as every runtime runs it (in one process here, one rank per stage in
    zl_device/torch/schedules/zerolock.py).

    Per micro-batch: `begin` (phase 1: the stage's layers; returns the hidden state to hand downstream),
    then `finish` (phase 2: the local loss and its backward; gradients add up in `.grad`). Per window:
    `start_window`, the micro-batches, `end_window` (one AdamW step on the mean gradient, the runner's lr
    schedule). The readouts run on the target positions only (`gather_targets`).

    `forward_only` (a stage held still by lr 0, not the last: the runner's RunnerConfig::forward_only,
    docs/design#windows-and-adamw): `begin` runs without autograd and there is no `finish`, since its gradients could
    not move the weights; `end_window` only advances the schedule.
    """

    def __init__(self, module: torch.nn.Module, lr: float, opt: OptimizerSettings, num_windows: int,
                 forward_only: bool = False):
        if forward_only and lr != 0:
            raise ValueError(f"a forward-only stage must have lr 0, got {lr}: it would never step")
        module.gather_targets = True
        self.module = module
        self.forward_only = forward_only
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = runner_optimizer([{"params": self.params, "lr": lr}], opt, num_windows)
        self._sums = torch.zeros(3, dtype=torch.float64)  # loss, task, consistency summed over the window
        self._count = 0
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def start_window(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self._sums.zero_()
        self._count = 0

    def begin(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Phase 1 on input ids (stage 0) or the upstream hidden state (B, L, D); returns the output hidden state
        (B, L, D), detached: what the marker hands downstream."""
        if self.forward_only:
            with torch.no_grad():  # no phase 2 follows: keep no activations for a backward
                _, h = self.module.chunk(x, mask)
            return h
        h_in, h = self.module.chunk(x, mask)
        self._pending = (h_in, h)
        return h.detach()

    def finish(self, labels: torch.Tensor) -> tuple[float, float, float]:
        """Phase 2 of the micro-batch `begin` started: local loss, backward; returns (loss, task, consistency)."""
        if self.forward_only:
            raise RuntimeError("StageStep.finish on a forward-only stage: it has no phase 2")
        if self._pending is None:
            raise RuntimeError("StageStep.finish without begin")
        h_in, h = self._pending
        self._pending = None
        loss, task, consistency = self.module.loss_terms(h_in, h, labels)
        loss.backward()
        values = torch.tensor([loss.item(), task.item(), consistency.item()], dtype=torch.float64)
        self._sums += values
        self._count += 1
        return tuple(values.tolist())

    def end_window(self) -> tuple[float, list[float | None]]:
        """The window's AdamW step; returns (lr used, [mean loss, mean task loss, mean consistency loss]).

        A forward-only stage computed no gradient and no loss: its step only counts (the schedule advances as the
        runner's AdamW::skip_step does, parameters and moments stay), and its means are None."""
        if self.forward_only:
            lr = self.optimizer.param_groups[0]["lr"]
            with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": on purpose
                warnings.simplefilter("ignore")
                self.scheduler.step()
            return lr, [None, None, None]
        means = (self._sums / self._count).tolist()
        return _step(self.optimizer, self.scheduler, self.params, self._count), means

    def moments(self, names: dict[int, str]) -> dict[str, torch.Tensor]:
        """AdamW's first and second moments as the runner checkpoints them: `<name>.exp_avg`, `<name>.exp_avg_sq`."""
        return adamw_moments(self.optimizer, self.params, names)

    @property
    def optimizer_step(self) -> int:
        """AdamW steps taken (= committed windows)."""
        return self.scheduler.last_epoch


def train_zerolock(
    modules: Sequence[torch.nn.Module],
    shard: Shard,
    budget: Budget,
    opt: OptimizerSettings,
    stage_lr: Sequence[float] = (1.0,),
    on_window: Callable[[int, TrainLog], None] = lambda w, log: None,
) -> TrainLog:
    """Train every stage's parameters on its local loss, window by window, as the pipeline does (a stage before the
    last at lr 0 runs forward only, as in the runtimes; its entries in the log's losses are None).

    Args:
        modules: the `StageModule`s of one split (zl_export.exporter.build_stage_modules), in order.
        shard: stage 0's training shard.
        budget: samples, window, micro-batch.
        opt: AdamW and schedule; each stage has its own optimizer, as each runner does.
        stage_lr: learning-rate multiplier per stage (one value: all stages).
        on_window: called after each window's step.
    """
    if len(stage_lr) not in (1, len(modules)):
        raise ZLError(f"--stage-lr: {len(stage_lr)} values for {len(modules)} stages; give one or {len(modules)}.")
    if shard.rows < budget.micro_batch:
        raise ZLError(f"shard {shard.path} has {shard.rows} rows, fewer than one micro-batch of {budget.micro_batch}.")
    lrs = [opt.lr * (stage_lr[0] if len(stage_lr) == 1 else stage_lr[k]) for k in range(len(modules))]
    # A stage held still (lr 0) before the last runs forward only, as the runtimes run it
    # (docs/design#windows-and-adamw): its phase 2 could not change anything. Its window losses are None.
    steps = [StageStep(module, spec.lr, opt, budget.num_windows, forward_only=spec.forward_only)
             for module, spec in zip(modules, stage_specs(lrs, "zerolock"))]
    log = TrainLog()
    start = time.perf_counter()
    for w, window in enumerate(budget.windows()):
        for step in steps:
            step.start_window()
        for mb in window:
            x, mask, labels = micro_batch(shard, mb, budget.micro_batch)
            for step in steps:
                x = step.begin(x, mask)
                if not step.forward_only:
                    step.finish(labels)
        ends = [step.end_window() for step in steps]
        means = [[m[i] for _, m in ends] for i in range(3)]  # [term][stage]
        log.losses.append(means[0])
        log.task_losses.append(means[1])
        log.consistency_losses.append(means[2])
        log.lrs.append(ends[0][0])
        on_window(w, log)
    log.seconds = time.perf_counter() - start
    for module in modules:
        module.gather_targets = False
    return log


def stage_parameters(modules: Sequence[torch.nn.Module], peft_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every stage's trainable tensors under their manifest names (PEFT names; translator names for translators)."""
    from zl_export.exporter import manifest_names

    out = {}
    for module in modules:
        names = manifest_names(module, peft_model)
        out.update({names[id(p)]: p.detach().clone() for p in module.parameters() if p.requires_grad})
    return out


# --- backprop baselines ---------------------------------------------------------------------------------


def causal_lm_loss(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the final output over the target positions (position i predicts labels[i+1]).

    The same positions and mean as the task term of the local loss
    (zl_export.local_loss.shift_targets); the LM head runs only on those
    positions. Inputs are right-padded (B, S) int64; the padded tail is cut.
    """
    length = int(mask.sum(1).max())
    ids, mask, labels = ids[:, :length], mask[:, :length], labels[:, :length]  # (B, L)
    targets, valid = shift_targets(labels)  # (B, L), (B, L)
    rows, cols = valid.bool().nonzero(as_tuple=True)  # K target positions
    if len(rows) == 0:
        raise ZLError("a training micro-batch has no target positions (all labels -100); recreate the shard with `zl data`.")
    hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state  # (B, L, d)
    logits = model.get_output_embeddings()(hidden[rows, cols]).float()  # (K, V)
    return torch.nn.functional.cross_entropy(logits, targets[rows, cols])


def train_backprop(
    model: torch.nn.Module,
    shard: Shard,
    budget: Budget,
    opt: OptimizerSettings,
    on_window: Callable[[int, TrainLog], None] = lambda w, log: None,
    versions=None,
) -> TrainLog:
    """Ordinary end-to-end backprop of the trainable parameters of `model` (a PeftModel) over the run's micro-batches.

    `versions` (a zl_device.torch.stale_backprop.WeightVersions) runs each micro-batch on the weight versions an
    asynchronous pipeline would (`running(mb, window)`) and keeps each window's weights for them (`keep(window)`,
    before its step); None is synchronous backprop."""
    if shard.rows < budget.micro_batch:
        raise ZLError(f"shard {shard.path} has {shard.rows} rows, fewer than one micro-batch of {budget.micro_batch}.")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = runner_optimizer([{"params": params, "lr": opt.lr}], opt, budget.num_windows)
    model.train()
    log = TrainLog()
    start = time.perf_counter()
    for w, window in enumerate(budget.windows()):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for mb in window:
            with contextlib.nullcontext() if versions is None else versions.running(mb, w):
                loss = causal_lm_loss(model, *micro_batch(shard, mb, budget.micro_batch))
                loss.backward()  # on the weights running() put in place, into the live parameters' .grad
            total += float(loss.detach())
        if versions is not None:
            versions.keep(w)
        log.lrs.append(_step(optimizer, scheduler, params, len(window)))
        log.losses.append([total / len(window)])
        on_window(w, log)
    log.seconds = time.perf_counter() - start
    model.eval()
    return log


def freeze_lora_below(peft_model: torch.nn.Module, first_layer: int) -> int:
    """Freeze the LoRA parameters of layers < `first_layer` (the last-stage-only baseline); returns how many train."""
    import re

    trainable = 0
    for name, p in peft_model.named_parameters():
        if "lora_" not in name:
            continue
        m = re.search(r"\.layers\.(\d+)\.", name)
        p.requires_grad_(m is not None and int(m.group(1)) >= first_layer)
        trainable += p.numel() if p.requires_grad else 0
    return trainable
