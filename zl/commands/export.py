"""`zl export`: cut a model into per-stage ExecuTorch training programs (the work is zl_export/pipeline.py)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from zl_base.errors import ZLError
from zl.options import settings_command
from zl.paths import check_out_dir
from zl_base.settings import check_fields, flag, nested, setting
from zl_export.manifest import Manifest
from zl_export.options import ExportOptions, ModelSplit, ProgramSettings
from zl_export.pipeline import ExportProgress

EXAMPLE = """

Examples:

  zl export                                             # SmolLM2-135M, 3 balanced stages, one checked step

  zl export --model tinyllama-random --stages 0-6,7-13,14-21 --out runs/tinyllama --no-check

  zl export --stages runs/plan.json --seq-len 128      # the split `zl plan` chose

  zl export --program backprop --model tiny-random     # programs that take grad_hidden and give grad_input

  zl export --frozen-dtype int4 --embedding-dtype bf16  # 4-bit layers, the embedding and LM head in bf16
"""

console = Console()


@dataclass(frozen=True)
class ExportArgs:
    """`zl export`'s options: the model split, the output folder, the export options and the check."""

    split: ModelSplit = nested(ModelSplit)
    out: Path = setting(Path("runs/export"), "Output directory for stage_<k>.pte and manifest.json.",
                        check=check_out_dir)
    options: ExportOptions = nested(ExportOptions)
    program: ProgramSettings = nested(ProgramSettings)
    check: bool = setting(True, "Run one training step of every stage through ExecuTorch and compare with PyTorch eager.")
    calibration: Path | None = setting(None, "A shard (from `zl data`) whose first 64 rows fit the readout lenses of "
                                             "--translator-init lens (only then); default: the built-in demo task's "
                                             "rows.")

    def validate(self) -> None:
        """Every check that needs no model, before it loads: the options, --out, --calibration.

        Raises:
            ZLError: naming the flag, the value and the fix.
        """
        check_fields(self)
        self.split.validate()
        self.options.validate()
        self.options.loss.validate(self.split.count)
        self.program.validate()
        if self.calibration is None:
            return
        name, loss = flag(ExportArgs, "calibration"), self.options.loss
        if not (loss.translator_rank and loss.translator_init == "lens"):
            raise ZLError(f"{name} {self.calibration}: only lens translators (--translator-init lens, --translator-rank "
                          f"1 or more) are fitted on calibration rows; these start as {loss.translator_init} with "
                          f"rank {loss.translator_rank}, so the file would be ignored. Add --translator-init lens or "
                          f"drop {name}.")
        from zl_export.shard import load_shard

        try:
            load_shard(self.calibration)
        except ZLError as e:
            raise ZLError(f"{name} {self.calibration}: expected a shard from `zl data`; {e}") from None


def run_export(args: ExportArgs) -> None:
    from zl_device.plan.plan_file import split_of_plan
    from zl_export.pipeline import export_pipeline

    args = replace(args, split=split_of_plan(args.split, args.options))  # --stages plan.json: the plan's ranges
    args.validate()  # before the model loads (seconds to minutes) or anything is written
    with RichExportProgress() as progress:
        export_pipeline(args.split, args.out, args.options, args.check, progress, calibration=args.calibration,
                        program=args.program)


class RichExportProgress(ExportProgress):
    """Draws an export: a spinner while loading, a bar per stage, the summary table and the check's table."""

    PHASES = 5  # the exporter's phases per stage, for the bars

    def __init__(self) -> None:
        self._bars: Progress | None = None
        self._tasks: dict[int, int] = {}
        self._stages: dict = {}

    def __enter__(self) -> RichExportProgress:
        return self

    def __exit__(self, *exc) -> None:
        self._stop_bars()

    def loading(self, model: str) -> AbstractContextManager:
        first_gguf = " (a GGUF is converted to float32 once, ~30 s)" if model.endswith(".gguf") or model == "smollm2-135m" else ""
        return console.status(f"loading {model}{first_gguf}")

    def loaded(self, model: str, loaded, stages, load_s: float) -> None:
        from zl_export.stages import format_spec

        cfg = loaded.config
        console.print(
            f"[bold]{model}[/]: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
            f"vocab {cfg.vocab_size} (loaded in {load_s:.1f} s); stages {format_spec(stages)}"
        )
        self._bars = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                              TextColumn("{task.fields[phase]}"), TimeElapsedColumn(), console=console)
        self._bars.start()
        self._tasks = {s.index: self._bars.add_task(f"stage {s.index} (layers {s})", total=self.PHASES, phase="waiting")
                       for s in stages}
        self._stages = {s.index: s for s in stages}

    def stage_phase(self, index: int, phase: str) -> None:
        if phase == "writing":
            self._bars.update(self._tasks[index], phase=phase)
        else:
            self._bars.update(self._tasks[index], advance=1, phase=phase)

    def stage_done(self, index: int, size_bytes: int, export_s: float) -> None:
        done = f"{size_bytes / 2**20:.1f} MiB in {export_s:.1f} s"
        self._bars.update(self._tasks[index], completed=self.PHASES, phase=done)
        if not console.is_terminal:  # no live display in a log: one line per stage instead
            console.print(f"stage {index} (layers {self._stages[index]}): {done}")

    def exported(self, manifest: Manifest, shown_dir: Path) -> None:
        self._stop_bars()
        table = Table(title=f"exported to {shown_dir}")
        for col in ("stage", "layers", "LoRA params", ".pte MiB", "export s"):
            table.add_column(col, justify="right")
        for s in manifest.stages:
            n = sum(_numel(p.shape) for p in s.parameters)
            table.add_row(str(s.index), f"{s.layers[0]}-{s.layers[1]}", f"{n:,}", f"{s.size_bytes / 2**20:.1f}",
                          f"{s.export_s:.1f}")
        console.print(table)

    def checking(self) -> AbstractContextManager:
        return console.status("one training step per stage: ExecuTorch and PyTorch eager")

    def checked(self, checks) -> None:
        # A backprop program's step (docs/design#backprop-program) reports its loss (on upstream stages <h,
        # grad_hidden>), no CE or KL.
        table = Table(title="one training step on a demo-task sample: ExecuTorch runtime vs PyTorch eager")
        # With --frozen-dtype bf16/int8, eager computes with the same compact weights; "loss fp32" is eager with
        # the float32 weights, the price of the compact ones.
        quantized = any(r.fp32_loss is not None for r in checks)
        cols = ("stage", "loss ET", "loss eager", "CE", "KL", "|Δ|loss", "|Δ|grad", "ET ms")
        for col in cols + (("loss fp32", "Δ vs fp32") if quantized else ()):
            table.add_column(col, justify="right", no_wrap=True, min_width=len(col))
        for r in checks:
            o = r.et.outputs
            extra = ()
            if quantized and r.fp32_loss is not None:
                extra = (f"{r.fp32_loss:.5f}", f"{float(r.eager.outputs['loss']) - r.fp32_loss:+.1e}")
            terms = [f"{float(o[k]):.3f}" if k in o else "-" for k in ("task_loss", "consistency_loss")]
            table.add_row(
                str(r.index), f"{float(o['loss']):.5f}", f"{float(r.eager.outputs['loss']):.5f}", *terms,
                f"{r.loss_diff():.1e}", f"{r.grad_diff():.1e}", f"{r.et_ms:.0f}", *extra,
            )
        console.print(table)

    def _stop_bars(self) -> None:
        if self._bars is not None:
            self._bars.stop()
            self._bars = None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


export_command = settings_command(
    ExportArgs, run_export, "Export one ExecuTorch training program per pipeline stage, plus manifest.json." + EXAMPLE)
COMMANDS = {"export": export_command}
