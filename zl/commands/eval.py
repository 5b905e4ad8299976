"""`zl eval`: accuracy and NLL of a base model, and of a merged LoRA adapter, on a shard."""

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from zl.errors import ZLError
from zl.paths import check_out_file

console = Console()
err_console = Console(stderr=True)


def eval_command(
    data: Annotated[Path, typer.Option("--data", "-d", help="Shard to score: SPLIT.safetensors written by `zl data` (e.g. its dev split).",
                                       show_default=False)],
    model: Annotated[
        str | None,
        typer.Option("--model", "-m", help="Base model: smollm2-135m, tiny-random, a hub id or a directory "
                     "(default: the adapter's base model from its zl_merge.json, else smollm2-135m).", show_default=False),
    ] = None,
    adapter: Annotated[
        Path | None,
        typer.Option("--adapter", "-a", help="PEFT adapter directory (from `zl merge`); scored next to the base model.",
                     show_default=False),
    ] = None,
    limit: Annotated[int | None, typer.Option("--limit", help="Score only the first N rows of the shard.", show_default=False)] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", "-b", help="Rows per forward pass.")] = 16,
    seed: Annotated[int, typer.Option("--seed", help="Seed of random-weight models (tiny-random, tinyllama-random); use the export's.")] = 0,
    json_out: Annotated[Path | None, typer.Option("--json-out", help="Also write the figures to this JSON file.", show_default=False)] = None,
) -> None:
    """Score a model on a shard: label-word accuracy (classification shards) and mean NLL per label token.

    The prediction for a row is the label word with the highest likelihood
    after its prompt; NLL is in nats per completion token (with the
    end-of-sequence token). With --adapter the base model and the adapted
    model are scored on the same rows and shown side by side.

    Examples:

      zl eval --data runs/demo-data/dev.safetensors

      zl eval --model smollm2-135m --adapter runs/r1/adapter --data runs/demo-data/dev.safetensors --json-out runs/r1/eval.json

      zl eval --model tiny-random --data runs/tiny-data/dev.safetensors --limit 32 --batch-size 8
    """
    from zl_device.results.adapter import MERGE_INFO, check_adapter_dir
    from zl_device.results.evaluate import evaluate_with_adapter, limit_rows
    from zl_export.model_source import load_model
    from zl_export.options import DEFAULT_MODEL
    from zl_export.shard import load_shard

    if batch_size < 1:
        raise ZLError(f"--batch-size {batch_size}: must be at least 1.")
    check_out_file(json_out, "--json-out", "eval.json")  # before minutes of scoring
    if adapter is not None:
        check_adapter_dir(adapter)  # before minutes of scoring the base model
    trained_on = _adapter_model(adapter / MERGE_INFO) if adapter is not None else None
    if model is None:
        model = trained_on or DEFAULT_MODEL
    elif trained_on is not None and trained_on != model:
        err_console.print(f"[yellow]note:[/] the adapter was trained on {trained_on}, scoring it on --model {model}.")
    shard = limit_rows(load_shard(data), limit)
    with err_console.status(f"loading {model}"):
        loaded = load_model(model, seed=seed)
    shard.check_matches(tokenizer_name=loaded.tokenizer.name)

    with _row_progress(shard.rows) as on_batch:
        results = evaluate_with_adapter(loaded.model, shard, adapter, batch_size, on_batch)
    _print_table(results, shard, model, adapter)
    if json_out is not None:
        report = {
            "model": model,
            "adapter_dir": str(adapter) if adapter is not None else None,
            "data": str(data),
            "rows": shard.rows,
            "batch_size": batch_size,
            "label_words": shard.label_words,
            "results": {name: r.to_dict() for name, r in results.items()},  # "base", and "adapter" with --adapter
        }
        json_out.parent.mkdir(parents=True, exist_ok=True)
        tmp = json_out.with_name(json_out.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        os.replace(tmp, json_out)
        console.print(f"figures written to {json_out}")


def _adapter_model(info: Path) -> str | None:
    """The base model name recorded by `zl merge`, if the adapter has zl_merge.json."""
    try:
        return json.loads(info.read_text())["model"]["name"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


@contextmanager
def _row_progress(rows: int) -> Iterator[Callable[[str, int], None]]:
    """A progress bar over rows per scored model, on stderr (transient; nothing is drawn when stderr is not a
    terminal)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("scoring {task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err_console, transient=True) as progress:
        bars: dict[str, int] = {}

        def on_batch(label: str, n: int) -> None:
            if label not in bars:
                bars[label] = progress.add_task(label, total=rows)
            progress.advance(bars[label], n)

        yield on_batch


def _print_table(results: dict, shard, model: str, adapter: Path | None) -> None:
    title = f"{model}{' + ' + str(adapter) if adapter else ''} on {shard.path} ({shard.rows} rows)"
    table = Table(title=title)
    table.add_column("metric")
    for name in results:
        table.add_column(name, justify="right")
    if "adapter" in results:
        table.add_column("Δ", justify="right")
    base = results["base"]

    def row(metric: str, value, fmt: str, delta: bool = True) -> None:
        cells = [("—" if value(r) is None else format(value(r), fmt)) for r in results.values()]
        if "adapter" in results and not delta:
            cells.append("")
        elif "adapter" in results:
            a, b = value(results["adapter"]), value(base)
            cells.append("—" if a is None or b is None else format(a - b, "+" + fmt))
        table.add_row(metric, *cells)

    row("accuracy", lambda r: r.accuracy, ".3f")
    row("NLL / label token (nats)", lambda r: r.nll, ".4f")
    row("label tokens", lambda r: r.label_tokens, "d", delta=False)
    row("seconds", lambda r: r.seconds, ".1f", delta=False)
    console.print(table)
    if base.accuracy is None:
        console.print("no label words in the shard's sidecar: accuracy needs a classification shard (text_label, agnews, demo).")


COMMANDS = {"eval": eval_command}
