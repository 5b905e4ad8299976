"""`zl eval`: accuracy and NLL of a base model, and of a merged LoRA adapter, on a shard; perplexity and scored
greedy generations on prompt/completion shards."""

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from zl_base.errors import ZLError
from zl.options import settings_command
from zl.paths import check_out_file
from zl_base.settings import REQUIRED, setting
from zl_device.results.generation import GENERATE_ROWS, MARGIN_TOKENS, SAMPLE_ROWS, choose_base

console = Console()
err_console = Console(stderr=True)


@dataclass(frozen=True)
class EvalArgs:
    """`zl eval`'s options."""

    data: Path = setting(REQUIRED, "Shard to score: SPLIT.safetensors written by `zl data` (e.g. its dev split).",
                         flag="--data -d")
    model: str | None = setting(None, "Base model: smollm2-135m, tiny-random, a hub id or a directory (default: the "
                                      "adapter's base model from its zl_merge.json, else smollm2-135m).",
                                flag="--model -m")
    adapter: Path | None = setting(None, "PEFT adapter directory (from `zl merge`); scored next to the base model.",
                                   flag="--adapter -a")
    limit: int | None = setting(None, "Score only the first N rows of the shard.")
    batch_size: int = setting(16, "Rows per forward pass.", flag="--batch-size -b")
    seed: int | None = setting(None, "Seed of random-weight models (tiny-random, tinyllama-random) (default: the "
                                     "adapter's, from its zl_merge.json, else 0).")
    force_base: bool = setting(False, "Score --adapter on the --model (or --seed) given even when it was trained on "
                                      "another base (refused otherwise: its scores there say nothing of it).",
                               flag="--force-base")
    generate_rows: int = setting(GENERATE_ROWS, "Prompt/completion shards: generate greedily for the first N rows "
                                                "(0: no generations).")
    max_new_tokens: int | None = setting(None, "Tokens per generation (default: each row's completion length, with "
                                               f"end-of-sequence, + {MARGIN_TOKENS}).")
    samples: int = setting(SAMPLE_ROWS, "Rows whose generations are shown side by side (and kept in --json-out).")
    json_out: Path | None = setting(None, "Also write the figures to this JSON file.")

    def validate(self) -> None:
        """The checks that need no file: raises ZLError naming the flag, the value and the fix."""
        if self.batch_size < 1:
            raise ZLError(f"--batch-size {self.batch_size}: must be at least 1.")
        if self.samples < 0:
            raise ZLError(f"--samples {self.samples}: must be 0 (none) or more, e.g. --samples {SAMPLE_ROWS}.")
        check_out_file(self.json_out, "--json-out", "eval.json")  # before minutes of scoring


EVAL_DOC = """Score a model on a shard: label-word accuracy (classification shards) or perplexity and generations
(prompt/completion shards), and mean NLL per label token.

The prediction for a row is the label word with the highest likelihood
after its prompt; NLL is in nats per completion token (with the
end-of-sequence token), perplexity is exp(NLL). On shards without label
words the model also continues the prompt of the first --generate-rows
rows greedily; each generation is scored against the row's completion by
exact match (equal but for whitespace at either end) and ROUGE-L
(F-measure, rouge-score). With --adapter the base model and the adapted
model are scored on the same rows and shown side by side.

Examples:

  zl eval --data runs/demo-data/dev.safetensors

  zl eval --model smollm2-135m --adapter runs/r1/adapter --data runs/demo-data/dev.safetensors --json-out runs/r1/eval.json

  zl eval --model tiny-random --data runs/tiny-data/dev.safetensors --limit 32 --batch-size 8

  zl eval --adapter runs/r1/adapter --data runs/r1/data/dev.safetensors --generate-rows 20 --max-new-tokens 48
"""


def run_eval(args: EvalArgs) -> None:
    """Score the base model (and the adapter) on the shard; print the tables; write --json-out."""
    from zl_device.results.adapter import check_adapter_dir
    from zl_device.results.evaluate import GenerationEval, eval_record, evaluate_with_adapter, limit_rows
    from zl_export.model_source import load_model
    from zl_export.options import DEFAULT_MODEL
    from zl_export.shard import load_shard

    args.validate()
    data, model, adapter, seed, json_out = args.data, args.model, args.adapter, args.seed, args.json_out
    if adapter is not None:
        check_adapter_dir(adapter)  # before minutes of scoring the base model
        model, seed, note = choose_base(adapter, model, seed, DEFAULT_MODEL, force=args.force_base)
        if note:
            err_console.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    model, seed = model or DEFAULT_MODEL, 0 if seed is None else seed
    shard = limit_rows(load_shard(data), args.limit)
    with err_console.status(f"loading {model}"):
        loaded = load_model(model, seed=seed)
    shard.check_matches(tokenizer=loaded.tokenizer)
    generation = GenerationEval(loaded.tokenizer, args.generate_rows, args.max_new_tokens)
    generation.validate()

    with _row_progress(shard.rows, min(args.generate_rows, shard.rows)) as on_batch:
        results = evaluate_with_adapter(loaded.model, shard, adapter, args.batch_size, on_batch, generation)
    record = eval_record(results, shard, generation, args.samples)
    _print_table(results, shard, model, adapter)
    _print_samples(record.get("samples", []))
    if json_out is not None:
        report = {
            "model": model,
            "adapter_dir": str(adapter) if adapter is not None else None,
            "data": str(data),
            "rows": shard.rows,
            "batch_size": args.batch_size,
            "label_words": shard.label_words,
            "results": {name: record[name] for name in results},  # "base", and "adapter" with --adapter
            **{key: record[key] for key in ("generation", "samples") if key in record},
        }
        json_out.parent.mkdir(parents=True, exist_ok=True)
        tmp = json_out.with_name(json_out.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        os.replace(tmp, json_out)
        console.print(f"figures written to {json_out}")


@contextmanager
def _row_progress(rows: int, generated_rows: int) -> Iterator[Callable[[str, int], None]]:
    """A progress bar over rows per scored model, and per model's generations, on stderr (transient; nothing is
    drawn when stderr is not a terminal)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err_console, transient=True) as progress:
        bars: dict[str, int] = {}

        def on_batch(label: str, n: int) -> None:
            if label not in bars:
                generating = label.endswith(" generations")
                bars[label] = progress.add_task(f"generating {label.split()[0]}" if generating else f"scoring {label}",
                                                total=generated_rows if generating else rows)
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

    if base.accuracy is not None:
        row("accuracy", lambda r: r.accuracy, ".3f")
    row("NLL / label token (nats)", lambda r: r.nll, ".4f")
    if base.perplexity is not None:
        row("perplexity", lambda r: r.perplexity, ".3f")
    if base.generated_rows:
        row("exact match", lambda r: r.exact_match, ".3f")
        row("ROUGE-L", lambda r: r.rouge_l, ".3f")
        row("generated rows", lambda r: r.generated_rows, "d", delta=False)
    row("label tokens", lambda r: r.label_tokens, "d", delta=False)
    row("seconds", lambda r: r.seconds, ".1f", delta=False)
    console.print(table)
    if base.accuracy is None:
        console.print("no label words in the shard's sidecar (prompt/completion data): no accuracy; perplexity and "
                      "generations instead.")


def _print_samples(samples: list[dict]) -> None:
    """The sample rows side by side: prompt, reference and each model's generation."""
    if not samples:
        return
    names = [k for k in samples[0] if k not in ("row", "prompt", "reference")]
    table = Table(title=f"generations of the first {len(samples)} rows (greedy)", show_lines=True)
    for column in ("row", "prompt", "reference", *names):
        table.add_column(column, justify="right" if column == "row" else "left", overflow="fold")
    for s in samples:
        table.add_row(str(s["row"]), *(_shown(s[c]) for c in ("prompt", "reference", *names)))
    console.print(table)


def _shown(text: str, limit: int = 200) -> Text:
    """A cell's text as it is (no markup), the prompt's start elided past `limit` characters."""
    from zl_device.results.generation import visible

    return Text(visible(text if len(text) <= limit else "…" + text[-limit:]))


eval_command = settings_command(EvalArgs, run_eval, EVAL_DOC)
COMMANDS = {"eval": eval_command}
