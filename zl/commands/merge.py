"""`zl merge`: turn the stages' LoRA checkpoints into one PEFT adapter."""

from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from zl.options import settings_command
from zl_base.settings import REQUIRED, setting

console = Console()
err_console = Console(stderr=True)


@dataclass(frozen=True)
class MergeArgs:
    """`zl merge`'s options."""

    checkpoints: Path = setting(REQUIRED, "Checkpoint root of a run: holds "
                                          "stage_<k>/window_NNNNNN/adapter.safetensors.", flag="--checkpoints -c")
    manifest: Path = setting(REQUIRED, "manifest.json of the export the run trained (or its directory).",
                             flag="--manifest -m")
    out: Path = setting(REQUIRED, "Adapter directory to write (created; adapter files in it are replaced).",
                        flag="--out -o")
    window: int | None = setting(None, "Merge this window of every stage instead of the latest (all stages must "
                                       "have it).")


MERGE_DOC = """Merge each stage's checkpoint into one PEFT LoRA adapter for the whole model.

Takes the latest window every stage has committed (or --window N), checks
that every LoRA parameter of the manifest is there exactly once with its
shape, and writes adapter_config.json, adapter_model.safetensors and
zl_merge.json to --out; PeftModel.from_pretrained(base_model, OUT) and
`zl eval --adapter OUT` load it.

Examples:

  zl merge --checkpoints runs/r1/checkpoints --manifest runs/export/manifest.json --out runs/r1/adapter

  zl merge -c runs/r1/checkpoints -m runs/export -o runs/r1/adapter-w3 --window 3
"""


def run_merge(args: MergeArgs) -> None:
    from zl_device.results.adapter import merge_checkpoints

    checkpoints = args.checkpoints
    result = merge_checkpoints(checkpoints, args.manifest, args.out, args.window)
    table = Table(title=f"merged window {result.window} of {len(result.stages)} stages from {checkpoints} -> {result.out}")
    for col in ("stage", "checkpoint", "tensors", "parameters", "micro-batches", "steps"):
        if col == "checkpoint":
            table.add_column(col, no_wrap=True, min_width=len("stage_0/window_000000"))
        else:
            table.add_column(col, justify="right")
    for s in result.stages:
        done, total = s.progress.get("micro_batches_done"), (s.progress.get("extra") or {}).get("num_micro_batches")
        table.add_row(
            str(s.index), _relative(s.path.parent, checkpoints), str(s.tensors), f"{s.numel:,}",
            f"{done}/{total}" if total is not None else str(done), str(s.progress.get("optimizer_step")),
        )
    console.print(table)
    console.print(
        f"adapter: {sum(s.tensors for s in result.stages)} tensors, {result.numel:,} parameters, "
        f"rank {result.config['r']}, targets {','.join(result.config['target_modules'])} "
        f"(base model {result.config['base_model_name_or_path']})"
    )
    if not result.finished:
        err_console.print(
            "[yellow]note:[/] the checkpoints do not cover the whole run (see micro-batches); "
            "this adapter is an intermediate state."
        )


def _relative(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


merge_command = settings_command(MergeArgs, run_merge, MERGE_DOC)
COMMANDS = {"merge": merge_command}
