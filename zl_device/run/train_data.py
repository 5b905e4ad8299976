"""`zl train`'s data step: the training shard (and dev shard) at the programs' sequence length.

    RUN_DIR/data/train.safetensors   the shard stage 0 trains on (+ dev.safetensors when there is one)
"""

from __future__ import annotations

from pathlib import Path

from zl_base.errors import ZLError
from zl_device.run.train_settings import DEMO, MAX_EPOCHS, TrainSettings
from zl_export.tokenizer import Tokenizer


def training_rows(s: TrainSettings) -> int:
    """The rows of the training data, read but not tokenized: the demo task's train split, a .csv/.jsonl file's
    rows, or a shard's. Raises ZLError for a file that cannot be read (as the data step would, later)."""
    if s.data == DEMO:
        from zl_export.demo_task import DEMO_TRAIN_ROWS

        return DEMO_TRAIN_ROWS
    path = Path(s.data).expanduser()
    if path.suffix == ".safetensors":
        from zl_export.shard import load_shard

        return load_shard(path).rows
    from zl_export import data as zdata

    return len(zdata.load_task(path, s.rows.format, None, s.rows.columns).examples)


def shard_is_generative(shard: Path) -> bool:
    """Whether a shard holds generative rows: it records no label words (`label_token_ids`)."""
    from zl_export.shard import shard_meta

    return not shard_meta(shard).get("label_token_ids")


def data_is_generative(s: TrainSettings) -> bool:
    """Whether the training data is generative rows (prompt/completion, chat) rather than label words, read but not
    tokenized: the demo task is label words; a shard says so itself (shard_is_generative); a data file (.csv,
    .jsonl, .parquet, .arrow) by its format. A missing file counts as label words (the run's own check refuses it by
    name next); one that cannot be read raises the data step's ZLError."""
    if s.data == DEMO:
        return False
    path = Path(s.data).expanduser()
    if not path.exists():
        return False
    if path.suffix == ".safetensors":
        return shard_is_generative(path)
    from zl_export import data as zdata

    return not zdata.load_task(path, s.rows.format, None, s.rows.columns).label_words


def check_samples(s: TrainSettings) -> None:
    """--samples goes over the training rows at most MAX_EPOCHS times (before the run starts: a run of 10**12
    samples would train until killed).

    Raises:
        ZLError: more samples than that, or a training file that cannot be read.
    """
    rows = training_rows(s)
    if rows and s.samples > MAX_EPOCHS * rows:  # no rows at all: the data step says so
        raise ZLError(f"--samples {s.samples}: {-(-s.samples // rows):,} passes over the {rows} training rows of "
                      f"--data {s.data}; a run makes at most {MAX_EPOCHS} ({MAX_EPOCHS * rows:,} samples), more only "
                      f"fits the same rows again. Pass --samples {MAX_EPOCHS * rows} or less; to train longer, give "
                      "--data more rows.")


def run_seq_len(s: TrainSettings, tokenizer: Tokenizer) -> int:
    """--seq-len, else 128, or for the demo task its longest sample under `tokenizer` rounded up to 16."""
    from zl_export.shard_jobs import default_seq_len

    return s.rows.seq_len if s.rows.seq_len is not None else default_seq_len(tokenizer, demo=s.data == DEMO)


def run_max_targets(s: TrainSettings, shard: Path, say) -> int:
    """The programs' target slots per sample for training on `shard` (before the export).

    --max-targets when given (every row must fit it); else fitted to the shard: its largest target count
    rounded up to a multiple of 4 (AG News and the demo task: 4 slots), so the readout runs on a few
    positions more than the loss needs at most, and similar data shares one cached export.

    Raises:
        ZLError: a row has more target tokens than an explicit --max-targets.
    """
    from zl_export.shard import fitted_target_slots, load_shard

    data = load_shard(shard)
    if s.export.max_targets is not None:
        data.check_target_slots(s.export.max_targets)
        return s.export.max_targets
    need, slots = fitted_target_slots(data.labels)
    say(f"data: up to {need} target tokens per sample -> {slots} target slots (--max-targets)")
    return slots


def resolve_schedule(s: TrainSettings, say=None) -> TrainSettings:
    """`s` with --schedule's default chosen for the run's data (TrainSettings.with_schedule_for: async on
    generative rows, zerolock on label words), said in one line when `say` is given: the one place the default
    meets the data. `zl train` and `zl plan` call it first; what runs after reads `chosen_schedule`."""
    if s.schedule is not None:
        return s
    generative = data_is_generative(s)
    chosen = s.with_schedule_for(generative)
    if generative and say is not None:
        say(f"schedule: {chosen.schedule} (the default on generative data): every stage trains on the final loss's "
            "gradient, level with whole-model backprop where holding the stages before the last still stays "
            "behind (study headlines-smollm2-135m-1024-async); --schedule zerolock is faster and lighter.")
    return chosen


def prepare_data(s: TrainSettings, tokenizer: Tokenizer, seq_len: int, data_dir: Path, say) -> tuple[Path, Path | None]:
    """Tokenize the training data (and dev data) with the model's tokenizer into `data_dir`.

    Returns:
        (train shard, dev shard or None).
    """
    from zl_export import data as zdata
    from zl_export.shard import load_shard
    from zl_export.shard_jobs import ShardJob, demo_jobs, file_job, write_shard

    data_dir.mkdir(parents=True, exist_ok=True)

    def write(job: ShardJob) -> Path:
        # The training rows must fit an explicit --max-targets (named by their source line); dev rows are scored in eager.
        slots = s.export.max_targets if job.name == "train" else None
        path, meta = write_shard(job, tokenizer, s.split.model, seq_len, data_dir, s.rows.truncate, extra={"seed": s.seed},
                                 max_targets=slots)
        cut = zdata.truncation_summary(meta, seq_len)
        say(f"data: {job.name} {meta['rows']} rows x {seq_len} tokens -> {path}" + (f" ({cut})" if cut else ""))
        return path

    def from_file(spec: str, name: str) -> Path:
        path = Path(spec).expanduser()
        if path.suffix == ".safetensors":
            shard = load_shard(path)
            if shard.seq_len != seq_len:
                raise ZLError(f"--data {spec}: the shard has seq_len {shard.seq_len}, the programs {seq_len}; pass "
                              f"--seq-len {shard.seq_len} or re-tokenize with `zl data --seq-len {seq_len}`.")
            shard.check_matches(tokenizer=tokenizer)  # the model's tokenizer, and its BOS (a Gemma shard made before)
            return path
        job = file_job(path, s.rows.format, name, columns=s.rows.columns)
        job.task = zdata.select(job.task, None, True, s.seed)
        return write(job)

    if s.data == DEMO:
        paths = {job.name: write(job) for job in demo_jobs(s.seed)}
        return paths["train"], (from_file(s.eval_data, "dev") if s.eval_data else paths.get("dev"))
    return from_file(s.data, "train"), (from_file(s.eval_data, "dev") if s.eval_data else None)
