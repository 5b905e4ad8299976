"""A stage as one link of end-to-end backprop: it takes the gradient of its output and gives its input's.

The backprop program (`zl export --program backprop`, docs/design#backprop-program) is this module exported as today's
programs are (zl_export/exporter.py). From the stage's input — stage 0: input_ids (B,S); stage k > 0: the hidden
state it received (B,S,D), stashed since its forward — and `grad_hidden` (B,S,D), the gradient of the final loss
with respect to its output hidden state h_out, it computes the LoRA gradients of

    loss = <h_out, grad_hidden> + w * local_loss        (stages before the last; w = --local-weight, default 0)
    loss = CE(readout(h_out), targets) over Ω           (the last stage: the pipeline's true loss)

and the gradient of its input, `grad_input` (B,S,D), which goes upstream as the previous stage's `grad_hidden`
(none on stage 0). The surrogate <h_out, g> has exactly the parameter gradients of the final loss (its gradient
through h_out is g, the chain rule's upstream factor), so chaining the programs from the last stage back is
whole-model backprop cut at the stage boundaries.

    inputs : input_ids (B,S) int64 | hidden (B,S,D) f32, attention_mask (B,S) int64, labels (B,S) int64,
             grad_hidden (B,S,D) f32 [not on the last stage]
    outputs: hidden (B,S,D) f32 [not on the last stage], loss, local_loss [w > 0 only],
             grad_input (B,S,D) f32 [not on stage 0]

An upstream stage without a local loss (w = 0) needs no readout, so its module owns no final norm, LM head or
translator and its program holds none of their bytes. `hidden` still comes out of the pipeline marker, so the
program's phase 1 is the chunk forward (docs/design#marker): a runner can forward a micro-batch with it, park it, and
run the whole step later, when the gradient arrives, recomputing the forward from the stashed input.

`grad_input` is the gradient of a user input: `torch.export`'s joint graph computes it when the example input
requires grad, and the exporter moves it among the user outputs (`exporter.input_gradients_as_outputs`), so the
program keeps ExecuTorch's training convention (user outputs, LoRA gradients, LoRA parameters) unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from custom_ops import pipeline_marker
from zl_export.local_loss import LossConfig
from zl_export.options import check_local_weight
from zl_export.stage_module import StageModule
from zl_export.stages import StageRange
from zl_export.training_program import StepResult


def backprop_objective(h: torch.Tensor, grad_hidden: torch.Tensor) -> torch.Tensor:
    """() <h, grad_hidden>, summed over (B, S, D): a scalar whose gradient through h is grad_hidden, so its backward
    gives the stage's parameters and input their gradients of the final loss (torch.autograd.grad's
    `grad_outputs`, as one scalar a joint export can differentiate)."""
    return (h * grad_hidden).sum()


class BackpropStage(StageModule):
    """Layers `stage.first..stage.last` of `model` as a link of end-to-end backprop (the module docstring)."""

    def __init__(self, model: nn.Module, stage: StageRange, num_stages: int, loss: LossConfig, seed: int = 0,
                 max_targets: int = 0, local_weight: float = 0.0, recompute: bool = False):
        """
        Args:
            model, stage, num_stages, loss, seed, max_targets, recompute: as `StageModule`'s (the local loss's
                settings matter only with a local weight; the last stage's loss is always the true CE).
            local_weight: w, the weight of the stage's local loss added to the surrogate (not on the last stage).

        Raises:
            ZLError: a negative or non-finite weight.
        """
        check_local_weight(local_weight)
        is_last = stage.index == num_stages - 1
        super().__init__(model, stage, num_stages, loss, seed=seed, max_targets=max_targets,
                         readout=is_last or local_weight > 0, recompute=recompute)
        self.local_weight = 0.0 if is_last else float(local_weight)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
                grad_hidden: torch.Tensor | None = None):
        """x: input_ids (B,S) | hidden (B,S,D); grad_hidden (B,S,D) except on the last stage. Returns the user
        outputs of `forward_names` (grad_input is autograd's: the exporter adds it to the program's outputs)."""
        h_in, h = self.chunk(x, attention_mask)  # (B, S, D) each
        if self.is_last:
            return (self.task_loss(h, labels),)
        hidden_out = pipeline_marker(h.detach())  # (B, S, D): phase 1 ends here (docs/design#marker)
        loss = backprop_objective(h, grad_hidden)
        if self.local_weight == 0.0:
            return hidden_out, loss
        local = self.loss_terms(h_in, h, labels)[0]
        return hidden_out, loss + self.local_weight * local, local.detach()

    @property
    def forward_names(self) -> list[str]:
        """What `forward` returns, in order."""
        if self.is_last:
            return ["loss"]
        return ["hidden", "loss"] + (["local_loss"] if self.local_weight > 0 else [])

    @property
    def output_names(self) -> list[str]:
        """The program's user outputs: `forward_names`, then `grad_input` (not on stage 0)."""
        return self.forward_names + ([] if self.is_first else ["grad_input"])

    @property
    def input_names(self) -> list[str]:
        """The program's inputs, in order."""
        first = "input_ids" if self.is_first else "hidden"
        return [first, "attention_mask", "labels"] + ([] if self.is_last else ["grad_hidden"])


def backprop_step(module: BackpropStage, x: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
                  grad_hidden: torch.Tensor | None = None) -> StepResult:
    """The backprop program's step in PyTorch eager: the outputs of `module.output_names` (grad_input from autograd)
    and the LoRA gradients by program name, as `TrainingProgram.step` returns them. Zeroes `.grad` first.

    Args:
        x: input_ids (B,S) int64 | the stashed input hidden state (B,S,D).
        grad_hidden: (B,S,D) the gradient of the final loss w.r.t. the stage's output (None on the last stage).
    """
    module.zero_grad(set_to_none=True)
    if not module.is_first:
        x = x.detach().requires_grad_()
    args = (x, attention_mask, labels) if module.is_last else (x, attention_mask, labels, grad_hidden)
    outputs = dict(zip(module.forward_names, module(*args)))
    outputs["loss"].backward()
    if not module.is_first:
        outputs["grad_input"] = x.grad  # (B, S, D)
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    return StepResult({k: v.detach() for k, v in outputs.items()}, grads)


Step = Callable[..., StepResult]  # step(k, *inputs) -> stage k's StepResult: a program's or `backprop_step`'s


def backprop_chain(step: Step, modules: list[BackpropStage], ids: torch.Tensor, attention_mask: torch.Tensor,
                   labels: torch.Tensor) -> list[StepResult]:
    """One micro-batch of end-to-end backprop through every stage, as a pipeline runs it: the forward (each stage's
    step with a zero gradient: its hidden state does not depend on it), then from the last stage back, each stage's
    grad_input as the previous stage's grad_hidden, each on its input from the forward.

    Args:
        step: runs stage k on its inputs (input_ids | hidden, attention_mask, labels[, grad_hidden]).
        modules: the stages, in order (their hidden sizes and which is last).
        ids, attention_mask, labels: stage 0's inputs, (B, S) int64 each.

    Returns:
        The backward pass's steps, in stage order: the last one's `loss` is the true loss, stage k > 0's
        `grad_input` its input's gradient, every step's `gradients` its LoRA gradients of the true loss.
    """
    inputs, x = [], ids
    for k, module in enumerate(modules[:-1]):
        inputs.append(x)
        zero = torch.zeros(*attention_mask.shape, module.hidden_size)  # (B, S, D)
        x = step(k, x, attention_mask, labels, zero).outputs["hidden"].clone()
    inputs.append(x)
    results: list[StepResult | None] = [None] * len(modules)
    grad: tuple[torch.Tensor, ...] = ()  # the last stage takes none
    for k in reversed(range(len(modules))):
        results[k] = step(k, inputs[k], attention_mask, labels, *grad)
        if k > 0:
            grad = (results[k].outputs["grad_input"].clone(),)  # (B, S, D)
    return results
