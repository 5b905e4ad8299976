"""`zl export`: cut a model into per-stage ExecuTorch training programs."""

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from zl.errors import ZLError
from zl.options import settings_command
from zl.settings import nested, setting
from zl_export.options import ExportOptions, ModelSplit

if TYPE_CHECKING:
    from zl_export.stage_module import StageModule

EXAMPLE = """

Examples:

  zl export                                             # SmolLM2-135M, 3 balanced stages, one checked step

  zl export --model tinyllama-random --stages 0-6,7-13,14-21 --out runs/tinyllama --no-check
"""

console = Console()
err_console = Console(stderr=True)


@dataclass(frozen=True)
class ExportArgs:
    """`zl export`'s options: the model split, the output folder, the export options and the check."""

    split: ModelSplit = nested(ModelSplit)
    out: Path = setting(Path("runs/export"), "Output directory for stage_<k>.pte and manifest.json.")
    options: ExportOptions = nested(ExportOptions)
    check: bool = setting(True, "Run one training step of every stage through ExecuTorch and compare with PyTorch eager.")


def run_export(args: ExportArgs) -> None:
    export_pipeline(args.split, args.out, args.options, args.check)


def export_pipeline(split: ModelSplit, out: Path, opts: ExportOptions, check: bool, final_dir: Path | None = None) -> dict:
    """Load the model, split it, export every stage into `out` with a progress display; returns the manifest.

    Also used by `zl train`, which exports into a temporary `out` and renames it to `final_dir` (the name shown).
    Raises ZLError for bad options, model sources and stage specs.
    """
    from zl_export.exporter import build_stage_modules, export_stage, write_program
    from zl_export.manifest import build_manifest, write_manifest
    from zl_export.model_source import load_model
    from zl_export.stages import format_spec

    model = split.model
    opts.validate()
    first_gguf = " (a GGUF is converted to float32 once, ~30 s)" if model.endswith(".gguf") or model == "smollm2-135m" else ""
    with console.status(f"loading {model}{first_gguf}"):
        t0 = time.perf_counter()
        loaded = load_model(model, seed=opts.seed)
        load_s = time.perf_counter() - t0
    cfg = loaded.config
    opts.validate(cfg.max_position_embeddings)
    stages = split.ranges(cfg.num_hidden_layers)
    console.print(
        f"[bold]{model}[/]: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size} "
        f"(loaded in {load_s:.1f} s); stages {format_spec(stages)}"
    )
    peft_model, modules = build_stage_modules(loaded.model, stages, opts)
    out.mkdir(parents=True, exist_ok=True)
    entries = []
    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[phase]}"),
        TimeElapsedColumn(), console=console,
    ) as progress:
        tasks = [progress.add_task(f"stage {s.index} (layers {s})", total=5, phase="waiting") for s in stages]
        for module, task in zip(modules, tasks):
            def on_phase(phase: str, task=task) -> None:
                progress.update(task, advance=1, phase=phase)

            program = export_stage(module, peft_model, opts, cfg.vocab_size, on_phase)
            progress.update(task, phase="writing")
            entries.append(write_program(program, out))
            done = f"{len(program.buffer) / 2**20:.1f} MiB in {program.export_s:.1f} s"
            progress.update(task, completed=5, phase=done)
            if not console.is_terminal:  # no live display in a log: one line per stage instead
                console.print(f"stage {module.stage.index} (layers {module.stage}): {done}")
            del program
    manifest = build_manifest(loaded, opts, entries)
    write_manifest(manifest, out)
    _print_summary(manifest, final_dir or out)
    if check:
        _run_check(out, manifest, modules, _check_inputs(loaded.tokenizer, modules[0], opts, cfg.vocab_size))
    return manifest


def _check_inputs(tokenizer, first: "StageModule", opts: ExportOptions, vocab_size: int) -> tuple:
    """Stage 0's inputs for the check: the first demo-task samples, so the losses are those of real text.

    Falls back to random token ids when a demo sample does not fit --seq-len.
    """
    from zl_export import data as zdata
    from zl_export.demo_task import demo_rows
    from zl_export.exporter import example_inputs

    rows = demo_rows(0)["dev"][: opts.micro_batch]
    try:
        tokenized, _ = zdata.tokenize(zdata.demo_task(rows), tokenizer, opts.seq_len)
    except ZLError:
        return example_inputs(first, opts, vocab_size, seed=1)
    return tokenized.input_ids, tokenized.attention_mask, tokenized.labels


def _print_summary(manifest: dict, out: Path) -> None:
    table = Table(title=f"exported to {out}")
    for col in ("stage", "layers", "LoRA params", ".pte MiB", "export s"):
        table.add_column(col, justify="right")
    for s in manifest["stages"]:
        n = sum(_numel(p["shape"]) for p in s["parameters"])
        table.add_row(str(s["index"]), f"{s['layers'][0]}-{s['layers'][1]}", f"{n:,}", f"{s['size_bytes'] / 2**20:.1f}", f"{s['export_s']:.1f}")
    console.print(table)


def _run_check(out: Path, manifest: dict, modules, first_inputs) -> None:
    from zl_export.step_check import check_pipeline

    with console.status("one training step per stage: ExecuTorch and PyTorch eager"):
        results = check_pipeline(out, manifest, modules, first_inputs)
    table = Table(title="one training step on a demo-task sample: ExecuTorch runtime vs PyTorch eager")
    for col in ("stage", "loss ET", "loss eager", "CE", "KL", "|Δ|loss", "|Δ|grad", "ET ms"):
        table.add_column(col, justify="right", no_wrap=True, min_width=len(col))
    worst = 0.0
    for r in results:
        o = r.et.outputs
        table.add_row(
            str(r.index), f"{float(o['loss']):.5f}", f"{float(r.eager.outputs['loss']):.5f}", f"{float(o['task_loss']):.3f}",
            f"{float(o['consistency_loss']):.3f}", f"{r.loss_diff():.1e}", f"{r.grad_diff():.1e}", f"{r.et_ms:.0f}",
        )
        worst = max(worst, r.loss_diff() / max(1.0, abs(float(r.eager.outputs["loss"]))))
    console.print(table)
    if worst > 1e-4:
        raise ZLError(
            f"the ExecuTorch programs disagree with PyTorch eager (relative loss difference {worst:.2e} > 1e-4); "
            "please report this with the command you ran."
        )


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


export_command = settings_command(
    ExportArgs, run_export, "Export one ExecuTorch training program per pipeline stage, plus manifest.json." + EXAMPLE)


COMMANDS = {"export": export_command}
