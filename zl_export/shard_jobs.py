"""Which shards a data source gives (the demo task's splits, or one file) and writing one: `zl data` and `zl train`.

The formats, tokenization and the shard file itself are zl_export/data.py's;
this module decides what to tokenize, with which provenance, at which length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from zl_export import data as zdata
from zl_export.data_columns import DataColumns
from zl_export.tokenizer import Tokenizer

DEMO = "demo"
DEFAULT_SEQ_LEN = 128
SEQ_LEN_STEP = 16  # the demo task's default length is its longest sample rounded up to this


@dataclass
class ShardJob:
    """One shard to write: OUT/<name>.safetensors from `task`, recording `source` in its sidecar."""

    name: str  # the split: train, dev, ...
    task: zdata.Task
    source: dict


def demo_jobs(seed: int) -> list[ShardJob]:
    """The demo task's splits (train, dev), generated from `seed`."""
    from zl_export.demo_task import demo_rows, rows_sha256

    return [ShardJob(name, zdata.demo_task(rows), {"path": DEMO, "sha256": rows_sha256(rows), "demo_seed": seed,
                                                   "rows_in_source": len(rows)})
            for name, rows in demo_rows(seed).items()]


def file_job(path: Path, fmt: str, name: str, labels: list[str] | None = None,
             columns: DataColumns | None = None) -> ShardJob:
    """A .csv/.jsonl file as one shard (`columns`: --prompt-column/--completion-column/--prompt-template).
    Raises ZLError for an unreadable file, an unknown format or a bad row."""
    path = Path(path).expanduser()
    task = zdata.load_task(path, fmt, labels, columns)
    source = {"path": str(path.resolve()), "sha256": zdata.file_sha256(path), "rows_in_source": len(task.examples)}
    if columns is not None and columns.given():
        source["columns"] = asdict(columns)
    return ShardJob(name, task, source)


def default_seq_len(tokenizer: Tokenizer, demo: bool) -> int:
    """128 tokens; for the demo task its longest sample under `tokenizer`, rounded up to 16."""
    if not demo:
        return DEFAULT_SEQ_LEN
    from zl_export.demo_task import demo_rows

    rows = [r for split in demo_rows(0).values() for r in split]
    tokenized, _ = zdata.tokenize(zdata.demo_task(rows), tokenizer, 512)
    longest = int(tokenized.attention_mask.sum(dim=1).max())
    return max(SEQ_LEN_STEP, -(-longest // SEQ_LEN_STEP) * SEQ_LEN_STEP)


def write_shard(job: ShardJob, tokenizer: Tokenizer, model: str, seq_len: int, out_dir: Path, truncate: bool = False,
                extra: dict | None = None, on_rows: Callable[[int], None] | None = None,
                max_targets: int | None = None) -> tuple[Path, dict]:
    """Tokenize `job` and write OUT_DIR/<name>.safetensors with its sidecar.

    Args:
        max_targets: when given, every row must have at most this many target tokens (the programs' target
            slots, `--max-targets`; 0: no limit).

    Returns:
        (the shard's path, its metadata).

    Raises:
        ZLError: as `zl_export.data.tokenize`, or a row with more target tokens than `max_targets`.
    """
    from zl_export.shard import check_target_slots

    tokenized, task = zdata.tokenize(job.task, tokenizer, seq_len, truncate, job.source["path"], on_rows)
    if max_targets is not None:
        check_target_slots(tokenized.labels, max_targets, lambda i: f"{job.source['path']} line {task.examples[i].line}")
    path = Path(out_dir) / f"{job.name}.safetensors"
    meta = zdata.save(path, tokenized, task, tokenizer, model, job.source, extra={"split": job.name, **(extra or {})})
    return path, meta
