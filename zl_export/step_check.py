"""One training step of every stage through ExecuTorch, next to the same step in PyTorch eager.

Stage k>0 takes the hidden state that stage k-1 produced in the same runtime,
as in the pipeline; with backprop programs (docs/design#backprop-program) stage k<K-1 also takes the
gradient stage k+1 gave in the same runtime. Used by `zl export --check` and by
the tests.
"""

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from zl_base.errors import ZLError
from zl_export.manifest import Manifest
from zl_export.options import ExportOptions
from zl_export.stage_module import StageModule
from zl_export.training_program import StepResult, TrainingProgram


@dataclass
class StageCheck:
    index: int
    et: StepResult
    eager: StepResult
    et_ms: float
    eager_ms: float
    fp32_loss: float | None = None  # eager loss with the float32 frozen weights (--frozen-dtype bf16/int8 only)

    def loss_diff(self) -> float:
        """The largest absolute difference of the scalar outputs (the losses)."""
        return max(abs(float(self.et.outputs[k]) - float(v)) for k, v in self.eager.outputs.items() if v.dim() == 0)

    def grad_diff(self) -> float:
        """The largest absolute difference of the LoRA gradients and, on a backprop program, of grad_input."""
        pairs = [(self.et.gradients[k], v) for k, v in self.eager.gradients.items()]
        if "grad_input" in self.eager.outputs:
            pairs.append((self.et.outputs["grad_input"], self.eager.outputs["grad_input"]))
        return max((a - b).abs().max().item() for a, b in pairs)


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
    export_dir: Path, manifest: Manifest, modules: list[StageModule], first_inputs: tuple[torch.Tensor, ...]
) -> list[StageCheck]:
    """Run one step of every stage in ExecuTorch and in eager, chaining hidden states.

    Args:
        export_dir: holds the `.pte` files named in `manifest`.
        manifest: the export's manifest.
        modules: the eager stage modules with the exported weights.
        first_inputs: (input_ids, attention_mask, labels) for stage 0.
    """
    from zl_export.frozen_weights import full_precision

    results = []
    x_et = x_eager = x_fp32 = first_inputs[0]
    mask, labels = first_inputs[1], first_inputs[2]
    for entry, module in zip(manifest.stages, modules):
        program = TrainingProgram(Path(export_dir) / entry.file, entry.output_names)
        t0 = time.perf_counter()
        et = program.step(x_et, mask, labels)
        t1 = time.perf_counter()
        eager = eager_step(module, x_eager, mask, labels)
        t2 = time.perf_counter()
        fp32 = None
        with full_precision(module) as compact:
            if compact:  # the same step on the float32 weights, on the float32 chain of hidden states
                fp32 = eager_step(module, x_fp32, mask, labels)
        results.append(StageCheck(entry.index, et, eager, (t1 - t0) * 1e3, (t2 - t1) * 1e3,
                                  None if fp32 is None else float(fp32.outputs["loss"])))
        if "hidden" in et.outputs:
            x_et, x_eager = et.outputs["hidden"], eager.outputs["hidden"]
            x_fp32 = fp32.outputs["hidden"] if fp32 is not None else x_eager
    return results


def check_backprop_pipeline(export_dir: Path, manifest: Manifest, modules: list, first_inputs: tuple) -> list[StageCheck]:
    """One micro-batch of end-to-end backprop through the backprop programs (docs/design#backprop-program), next to the
    same chain in eager (`BackpropStage`, `backprop_step`): each runtime chains its own hidden states forward and
    gradients back (`backprop_chain`). Arguments as `check_pipeline`'s; the times are the backward pass's step of each
    stage."""
    from zl_export.backprop_stage import backprop_chain, backprop_step

    programs = [TrainingProgram(Path(export_dir) / e.file, e.output_names) for e in manifest.stages]
    ms: dict[tuple[str, int], float] = {}  # (runtime, stage) -> the last step's ms: the backward pass's

    def timed(runtime: str, run):
        def step(k: int, *inputs: torch.Tensor) -> StepResult:
            t0 = time.perf_counter()
            result = run(k, *inputs)
            ms[runtime, k] = (time.perf_counter() - t0) * 1e3
            return result
        return step

    ids, mask, labels = first_inputs
    et = backprop_chain(timed("et", lambda k, *x: programs[k].step(*x)), modules, ids, mask, labels)
    eager = backprop_chain(timed("eager", lambda k, *x: backprop_step(modules[k], *x)), modules, ids, mask, labels)
    return [StageCheck(e.index, a, b, ms["et", k], ms["eager", k])
            for k, (e, a, b) in enumerate(zip(manifest.stages, et, eager))]


def check_agreement(results: list[StageCheck]) -> None:
    """Raise ZLError when a stage's ExecuTorch losses differ from eager by more than 1e-4 (relative)."""
    worst = max(r.loss_diff() / max(1.0, abs(float(r.eager.outputs["loss"]))) for r in results)
    if worst > 1e-4:
        raise ZLError(
            f"the ExecuTorch programs disagree with PyTorch eager (relative loss difference {worst:.2e} > 1e-4); "
            "please report this with the command you ran."
        )


def demo_inputs(tokenizer, first: StageModule, opts: ExportOptions, vocab_size: int) -> tuple:
    """Stage 0's inputs for the check: the first demo-task samples, so the losses are those of real text.

    Falls back to random token ids when a demo sample does not fit the programs' seq_len.
    """
    from zl_export import data as zdata
    from zl_export.demo_task import demo_rows
    from zl_export.exporter import example_inputs

    rows = demo_rows(0)["dev"][: opts.micro_batch]
    try:
        tokenized, _ = zdata.tokenize(zdata.demo_task(rows), tokenizer, opts.seq_len)
    except ZLError:
        return example_inputs(first, opts, vocab_size, seed=1)[:3]  # (a backprop stage's grad_hidden aside)
    return tokenized.input_ids, tokenized.attention_mask, tokenized.labels
