"""PipeDream's asynchronous schedule in one process: whole-model backprop on each stage's stashed weight version.

What an asynchronous pipeline computes does not depend on timing, only on each
stage's order of operations (the async row of zl_device/formats/schedule_table.py): stage k
of K runs w_k = K-1-k warm-up forwards, then one forward and one backward
alternately, with no flush at window ends, and takes its AdamW step after the
backward of its window's last micro-batch. So the forward of micro-batch j on
stage k comes after the backwards of micro-batches 0 .. j-w_k-1, and runs on
the weight version (steps taken)

    v(k, j) = window_of(j - w_k)      for j >= w_k, else 0

whereas synchronous backprop (GPipe, a flush per window) runs every stage on
window_of(j). With weight stashing the backward of j on stage k uses the same
version as its forward, and the gradient it sends upstream was computed on the
downstream stages' versions for j. So micro-batch j's whole forward and
backward is ordinary backprop through a model whose stage k holds version
v(k, j), and its gradients are applied to the stage's current weights at its
next step. That is what `train_stale_backprop` does, at eager speed, for the
accuracy study (zl_study) and as the reference the runtimes' asynchronous
schedule is checked against (tests/test_torch_pipedream.py). With m >= K, only
the first w_k micro-batches of each window (stage k) see weights one step old;
the last stage never does.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence

import torch

from zl_base.errors import ZLError
from zl_device.formats.lr_schedule import OptimizerSettings
from zl_device.formats.schedule_table import forward_version
from zl_device.formats.windows import WindowPlan
from zl_device.torch.eager_training import Budget, TrainLog, train_backprop
from zl_export.shard import Shard

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def stashed_version(stage: int, num_stages: int, mb: int, plan: WindowPlan) -> int:
    """The weight version (AdamW steps taken) stage `stage` of `num_stages` runs micro-batch `mb` on under
    PipeDream's schedule: the steps it took before its forward of `mb` (module docstring; the schedule table's)."""
    return forward_version("async", stage, num_stages, plan, mb)


def stage_parameters(model: torch.nn.Module, stage_layers: Sequence[range]) -> list[list[torch.nn.Parameter]]:
    """The trainable parameters of `model` (a PeftModel) per stage, by the layer index in their names.

    Raises:
        ZLError: a trainable parameter is in no stage's layers (outside the layers, or a layer no stage has).
    """
    stages: list[list[torch.nn.Parameter]] = [[] for _ in stage_layers]
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        m = _LAYER.search(name)
        owner = [k for k, layers in enumerate(stage_layers) if m is not None and int(m.group(1)) in layers]
        if not owner:
            raise ZLError(f"trainable parameter {name} is in none of the stages' layers "
                          f"({', '.join(f'{r.start}-{r.stop - 1}' for r in stage_layers)}); an asynchronous "
                          "schedule assigns every trainable weight to the stage that holds its layer.")
        stages[owner[0]].append(p)
    return stages


class WeightVersions:
    """Each stage's older weight versions while a micro-batch may still run on them, for `train_backprop`."""

    def __init__(self, model: torch.nn.Module, stage_layers: Sequence[range], plan: WindowPlan):
        self.stages = stage_parameters(model, stage_layers)
        self.plan = plan
        # kept[k][v]: stage k's weights after v steps.
        self.kept: list[dict[int, list[torch.Tensor]]] = [{} for _ in self.stages]

    @contextlib.contextmanager
    def running(self, mb: int, window: int) -> Iterator[None]:
        """Every stage holds the version it runs micro-batch `mb` of `window` on; its current weights after."""
        swapped = []  # (param, its current data) while it holds an older version
        try:
            for k, ps in enumerate(self.stages):
                v = stashed_version(k, len(self.stages), mb, self.plan)
                if v != window:
                    for p, old in zip(ps, self.kept[k][v]):
                        swapped.append((p, p.data))
                        p.data = old
            yield
        finally:
            for p, data in swapped:
                p.data = data

    def keep(self, window: int) -> None:
        """Keep `window`'s weights (before its step) for the next window's early micro-batches, and drop the
        versions no later micro-batch runs on."""
        for k, ps in enumerate(self.stages):
            self.kept[k][window] = [p.detach().clone() for p in ps]
        if self.plan.exists(window + 1):
            first = self.plan.start(window + 1)
            for k in range(len(self.stages)):
                oldest = stashed_version(k, len(self.stages), first, self.plan)
                self.kept[k] = {v: t for v, t in self.kept[k].items() if v >= oldest}


def train_stale_backprop(
    model: torch.nn.Module,
    shard: Shard,
    budget: Budget,
    opt: OptimizerSettings,
    stage_layers: Sequence[range],
    on_window: Callable[[int, TrainLog], None] = lambda w, log: None,
) -> TrainLog:
    """End-to-end backprop of `model`'s trainable (LoRA) weights as PipeDream's asynchronous schedule computes it
    on the stages `stage_layers` (layer indices per stage): each micro-batch on every stage's stashed version.

    Returns the window losses (the final loss's mean per window, as `train_backprop`'s), lrs and seconds.

    Raises:
        ZLError: a trainable parameter in no stage's layers.
    """
    return train_backprop(model, shard, budget, opt, on_window, WeightVersions(model, stage_layers, budget.plan))
