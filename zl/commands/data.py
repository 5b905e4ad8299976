"""`zl data`: tokenize a CSV/JSONL file (or the built-in demo task) into training shards.

The options come from `DataArgs` (a settings tree, zl_base/settings.py); how rows become samples (--format, the column
options, --truncate, --seq-len) is `DataSettings`, which `zl train` nests too, so those are declared once.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import typer

from zl_base.errors import ZLError
from zl.options import settings_command
from zl.paths import check_out_dir
from zl_base.settings import check_fields, nested, setting
from zl_export.data_settings import DataSettings
from zl_export.options import DEFAULT_MODEL

EXAMPLE = (
    "\n\nEach row becomes prompt + completion + end-of-sequence tokens, right-padded to --seq-len; the loss covers "
    "the completion and end-of-sequence only. Formats: prompt_completion (JSONL/CSV prompt, completion; other columns "
    "with --prompt-column, --completion-column, --prompt-template), chat (JSONL messages: the last assistant turn is "
    "learned, the turns before it are the prompt, in the tokenizer's chat template), sharegpt (conversations of "
    "from/value turns, read as chat), alpaca (instruction, optional input, output, in the Alpaca prompt), "
    "text_label, agnews. Files: .csv, .jsonl, .parquet, .arrow, or a `datasets.save_to_disk` directory."
    """

Examples:

  zl data --input qa.jsonl --max-targets 32 --out runs/qa-data

  zl data --input chats.jsonl --format chat --seq-len 256 --truncate --out runs/chat-data

  zl data --input alpaca_data.parquet --out runs/alpaca-data       # Alpaca rows, Parquet (format detected)

  zl data --input ~/datasets/sharegpt/train --seq-len 512 --truncate --out runs/sg   # datasets.save_to_disk

  zl data --input news.csv --prompt-template "Text: {description}\\nTitle:" --completion-column title --out runs/titles

  zl data --input ../shared/data/agnews/train.csv --format agnews --out runs/data

  zl data --demo --out runs/demo-data
"""
)


@dataclass(frozen=True)
class DataArgs:
    """`zl data`'s options."""

    out: Path | None = setting(None, "Directory for SPLIT.safetensors and SPLIT.json (created).", flag="--out -o")
    input: str | None = setting(None, "A .csv, .jsonl, .parquet or .arrow file, a `datasets.save_to_disk` directory, "
                                      "or `demo` for the built-in demo task.",
                                flag="--input -i")
    demo: bool = setting(False, "Same as --input demo: write the demo task's train and dev shards.", flag="--demo")
    rows: DataSettings = nested(DataSettings)  # --format, the column options, --truncate, --seq-len: as `zl train`
    model: str = setting(DEFAULT_MODEL, "Whose tokenizer to use: smollm2-135m, tiny-random, a hub id or a "
                                        "directory.", flag="--model -m")
    split: str | None = setting(None, "Shard name: writes OUT/SPLIT.safetensors (default train; the demo writes train "
                                      "and dev).")
    limit: int | None = setting(None, "Keep only the first N rows (after shuffling).")
    shuffle: bool = setting(True, "Shuffle the rows (seeded) before --limit.")
    seed: int = setting(0, "Seed for shuffling and for generating the demo task.")
    max_targets: int | None = setting(None, "Fail on a row with more target tokens (completion + end-of-sequence) "
                                            "than this: the --max-targets of the programs that will train on the "
                                            "shard (0: no limit).")
    labels: str | None = setting(None, "text_label: comma-separated label values, in the order the prompt lists "
                                       "them (default: the file's labels, sorted). Use the same list for train and dev.")

    def validate(self) -> None:
        """Every check that needs no file or tokenizer. Raises ZLError naming the flag, the value and the fix."""
        if self.demo and self.input not in (None, "demo"):
            raise ZLError(f"--demo and --input {self.input} both given; pass one of them.")
        if self.input is None and not self.demo:
            raise ZLError("no input: pass --input FILE (.csv, .jsonl, .parquet or .arrow), or --demo for the built-in "
                          "demo task.")
        if self.out is None:
            raise ZLError("no --out: pass the directory for the shards, e.g. --out runs/data.")
        if self.is_demo and self.rows.format not in ("auto", "text_label"):
            raise ZLError(f"--format {self.rows.format} does not apply to the demo task; drop --format.")
        if self.is_demo and self.rows.columns.given():
            raise ZLError("--prompt-column, --completion-column and --prompt-template do not apply to the demo task; "
                          "drop them.")
        check_out_dir(self.out, "--out")
        check_fields(self)
        self.rows.validate()  # --seq-len's range, before anything is allocated: rows x seq_len int64 tensors
        if self.max_targets is not None and self.max_targets < 0:
            raise ZLError(f"--max-targets {self.max_targets}: expected 0 (no limit) or the programs' target slots, "
                          "e.g. 16.")
        if self.split is not None and not self.split.replace("-", "").replace("_", "").isalnum():
            raise ZLError(f"--split {self.split!r}: expected a plain name like train or dev (it names the output file).")

    @property
    def is_demo(self) -> bool:
        return self.demo or self.input == "demo"


def run_data(args: DataArgs) -> None:
    """Read and check the input, load the tokenizer, tokenize and write each shard (nothing is written on an error)."""
    from zl_export import data as zdata
    from zl_export import shard_jobs
    from zl_export.model_source import load_tokenizer

    args.validate()
    # The input file is read and checked before the tokenizer loads (which may download it).
    if args.is_demo:
        jobs = shard_jobs.demo_jobs(args.seed)
        if args.split is not None and args.split not in [job.name for job in jobs]:
            raise ZLError(f"--split {args.split}: the demo task has the splits {', '.join(job.name for job in jobs)}.")
        jobs = [job for job in jobs if args.split in (None, job.name)]
    else:
        labels = args.labels.split(",") if args.labels else None
        jobs = [shard_jobs.file_job(Path(args.input), args.rows.format, args.split or "train", labels,
                                    args.rows.columns)]
    tokenizer = load_tokenizer(args.model)
    seq_len = args.rows.seq_len or shard_jobs.default_seq_len(tokenizer, args.is_demo)
    for job in jobs:
        job.task = zdata.select(job.task, args.limit, args.shuffle, args.seed)
        with _row_progress(len(job.task.examples)) as on_rows:
            target, meta = shard_jobs.write_shard(
                job, tokenizer, args.model, seq_len, args.out, args.rows.truncate,
                extra={"shuffle": args.shuffle, "seed": args.seed, "limit": args.limit, "truncate": args.rows.truncate},
                on_rows=on_rows, max_targets=args.max_targets,
            )
        cut = zdata.truncation_summary(meta, seq_len)
        if cut:
            typer.echo(f"{job.name}: {cut}", err=True)
        typer.echo(
            f"{job.name}: {meta['rows']} rows x {meta['seq_len']} tokens, {meta['label_tokens']} label tokens, "
            f"at most {meta['max_target_tokens']} per row, "
            f"longest {meta['max_length']}, {meta['truncated_rows']} truncated, {meta['dropped_rows']} dropped "
            f"-> {target}"
        )


@contextmanager
def _row_progress(total: int) -> Iterator[Callable[[int], None]]:
    """A tokenizing progress bar on stderr (transient; none when stderr is not a terminal)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("tokenizing"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    console = Console(stderr=True)
    # Off without a terminal: a stopped live display still writes a blank line, which would precede the error line.
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
        bar = progress.add_task("tokenize", total=total)
        yield lambda n: progress.advance(bar, n)


data_command = settings_command(DataArgs, run_data, "Tokenize training data into shards for stage 0 and `zl eval`."
                                + EXAMPLE)
COMMANDS = {"data": data_command}
