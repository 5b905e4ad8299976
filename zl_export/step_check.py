"""One training step of every stage through ExecuTorch, next to the same step in PyTorch eager.

Stage k>0 takes the hidden state that stage k-1 produced in the same runtime,
as in the pipeline. Used by `zl export --check` and by the tests.
"""

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from zl_export.stage_module import StageModule
from zl_export.training_program import StepResult, TrainingProgram


@dataclass
class StageCheck:
    index: int
    et: StepResult
    eager: StepResult
    et_ms: float
    eager_ms: float

    def loss_diff(self) -> float:
        return max(abs(float(self.et.outputs[k]) - float(self.eager.outputs[k])) for k in ("loss", "task_loss", "consistency_loss"))

    def grad_diff(self) -> float:
        return max((self.et.gradients[k] - self.eager.gradients[k]).abs().max().item() for k in self.eager.gradients)


def eager_step(module: StageModule, *inputs: torch.Tensor) -> StepResult:
    """The stage's step in PyTorch eager: outputs and LoRA gradients by program name."""
    module.zero_grad(set_to_none=True)
    outs = module(*inputs)
    names = ([] if module.is_last else ["hidden"]) + ["loss", "task_loss", "consistency_loss"]
    outputs = dict(zip(names, outs))
    outputs["loss"].backward()
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    return StepResult({k: v.detach() for k, v in outputs.items()}, grads)


def check_pipeline(
    export_dir: Path, manifest: dict, modules: list[StageModule], first_inputs: tuple[torch.Tensor, ...]
) -> list[StageCheck]:
    """Run one step of every stage in ExecuTorch and in eager, chaining hidden states.

    Args:
        export_dir: holds the `.pte` files named in `manifest`.
        manifest: the export's manifest.
        modules: the eager stage modules with the exported weights.
        first_inputs: (input_ids, attention_mask, labels) for stage 0.
    """
    results = []
    x_et = x_eager = first_inputs[0]
    mask, labels = first_inputs[1], first_inputs[2]
    for entry, module in zip(manifest["stages"], modules):
        program = TrainingProgram(Path(export_dir) / entry["file"], [o["name"] for o in entry["outputs"]])
        t0 = time.perf_counter()
        et = program.step(x_et, mask, labels)
        t1 = time.perf_counter()
        eager = eager_step(module, x_eager, mask, labels)
        t2 = time.perf_counter()
        results.append(StageCheck(entry["index"], et, eager, (t1 - t0) * 1e3, (t2 - t1) * 1e3))
        if "hidden" in et.outputs:
            x_et, x_eager = et.outputs["hidden"], eager.outputs["hidden"]
    return results
