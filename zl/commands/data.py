"""`zl data`: tokenize a CSV/JSONL file (or the built-in demo task) into training shards."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from zl.errors import ZLError
from zl.paths import check_out_dir
from zl_export.options import MAX_SEQ_LEN, check_seq_len


def data_command(
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for SPLIT.safetensors and SPLIT.json (created).",
                                      show_default=False)],
    input_: Annotated[
        str | None,
        typer.Option("--input", "-i", help="A .csv or .jsonl file, or `demo` for the built-in demo task.", show_default=False),
    ] = None,
    demo: Annotated[bool, typer.Option("--demo", help="Same as --input demo: write the demo task's train and dev shards.")] = False,
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            "-f",
            help="auto (from the columns), prompt_completion (prompt,completion), text_label (text,label) "
            "or agnews (label,title,description with labels 1-4).",
        ),
    ] = "auto",
    model: Annotated[
        str, typer.Option("--model", "-m", help="Whose tokenizer to use: smollm2-135m, tiny-random, a hub id or a directory.")
    ] = "smollm2-135m",
    seq_len: Annotated[
        int | None,
        typer.Option("--seq-len", help=f"Tokens per sample (2 to {MAX_SEQ_LEN}), padded on the right (default 128; the "
                     "demo task: its longest sample, rounded up to 16).", show_default=False),
    ] = None,
    split: Annotated[
        str | None,
        typer.Option("--split", help="Shard name: writes OUT/SPLIT.safetensors (default train; the demo writes train and dev).",
                     show_default=False),
    ] = None,
    limit: Annotated[int | None, typer.Option("--limit", help="Keep only the first N rows (after shuffling).", show_default=False)] = None,
    truncate: Annotated[
        bool, typer.Option("--truncate", help="Cut over-long prompts from the left, keeping the completion, instead of failing.")
    ] = False,
    shuffle: Annotated[bool, typer.Option("--shuffle/--no-shuffle", help="Shuffle the rows (seeded) before --limit.")] = True,
    seed: Annotated[int, typer.Option("--seed", help="Seed for shuffling and for generating the demo task.")] = 0,
    max_targets: Annotated[
        int | None,
        typer.Option("--max-targets", help="Fail on a row with more target tokens (completion + end-of-sequence) than "
                     "this: the --max-targets of the programs that will train on the shard (0: no limit).",
                     show_default=False),
    ] = None,
    labels: Annotated[
        str | None,
        typer.Option("--labels", help="text_label: comma-separated label values, in the order the prompt lists them "
                     "(default: the file's labels, sorted). Use the same list for train and dev.", show_default=False),
    ] = None,
) -> None:
    """Tokenize training data into shards for stage 0 and `zl eval`.

    Each row becomes prompt + completion + end-of-sequence tokens, right-padded to --seq-len; the loss covers the completion and end-of-sequence only.

    Examples:

      zl data --input ../shared/data/agnews/train.csv --format agnews --out runs/data

      zl data --input ../shared/data/agnews/dev.csv --format agnews --split dev --out runs/data

      zl data --demo --out runs/demo-data

      zl data --input qa.jsonl --max-targets 32 --out runs/qa-data
    """
    from zl_export import data as zdata
    from zl_export import shard_jobs
    from zl_export.model_source import load_tokenizer

    if demo and input_ not in (None, "demo"):
        raise ZLError(f"--demo and --input {input_} both given; pass one of them.")
    if input_ is None and not demo:
        raise ZLError("no input: pass --input FILE (.csv or .jsonl), or --demo for the built-in demo task.")
    is_demo = demo or input_ == "demo"
    if is_demo and fmt not in ("auto", "text_label"):
        raise ZLError(f"--format {fmt} does not apply to the demo task; drop --format.")
    check_out_dir(out, "--out")
    check_seq_len(seq_len, "--seq-len")  # before anything is allocated: rows x seq_len int64 tensors
    if max_targets is not None and max_targets < 0:
        raise ZLError(f"--max-targets {max_targets}: expected 0 (no limit) or the programs' target slots, e.g. 16.")
    if split is not None and not split.replace("-", "").replace("_", "").isalnum():
        raise ZLError(f"--split {split!r}: expected a plain name like train or dev (it names the output file).")
    # The input file is read and checked before the tokenizer loads (which may download it).
    if is_demo:
        jobs = shard_jobs.demo_jobs(seed)
        if split is not None and split not in [job.name for job in jobs]:
            raise ZLError(f"--split {split}: the demo task has the splits {', '.join(job.name for job in jobs)}.")
        jobs = [job for job in jobs if split in (None, job.name)]
    else:
        jobs = [shard_jobs.file_job(Path(input_), fmt, split or "train", labels.split(",") if labels else None)]
    tokenizer = load_tokenizer(model)
    seq_len = seq_len or shard_jobs.default_seq_len(tokenizer, is_demo)
    for job in jobs:
        job.task = zdata.select(job.task, limit, shuffle, seed)
        with _row_progress(len(job.task.examples)) as on_rows:
            target, meta = shard_jobs.write_shard(
                job, tokenizer, model, seq_len, out, truncate,
                extra={"shuffle": shuffle, "seed": seed, "limit": limit, "truncate": truncate}, on_rows=on_rows,
                max_targets=max_targets,
            )
        typer.echo(
            f"{job.name}: {meta['rows']} rows x {meta['seq_len']} tokens, {meta['label_tokens']} label tokens, "
            f"at most {meta['max_target_tokens']} per row, "
            f"longest {meta['max_length']}, {meta['truncated_rows']} truncated -> {target}"
        )


@contextmanager
def _row_progress(total: int) -> Iterator[Callable[[int], None]]:
    """A tokenizing progress bar on stderr (transient; rich draws nothing when stderr is not a terminal)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("tokenizing"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        bar = progress.add_task("tokenize", total=total)
        yield lambda n: progress.advance(bar, n)


COMMANDS = {"data": data_command}
