"""The backprop baseline of issue 4: one process, ordinary end-to-end backprop, same data, budget and optimizer as `zl train`.

Fine-tunes the whole model with PEFT LoRA (same rank, alpha, targets, seed
and initialisation as the export, dropout 0) on the standard causal-LM loss
of the final output, over exactly the micro-batches a ZeroLock run's stage 0
reads (micro-batch mb takes shard rows [j*B, (j+1)*B) with
j = mb mod floor(N/B), runner/src/data_shard.cpp DataShard::micro_batch). The
gradient is the MEAN over each window of m micro-batches (k for a short last
window) and one `torch.optim.AdamW` step is taken per window, with the
runner's learning-rate schedule (zl/lr_schedule.h) as a `LambdaLR`. Then it
scores the base model and the trained model on the dev shard with
`zl_device.results.evaluate.evaluate` (accuracy and NLL per label token), prints a
table (with the ZeroLock adapter's row from `--zl-eval`) and writes
`--json-out`.

    # after `zl train --out runs/train`: data, model and hyper-parameters from the run directory
    .venv/bin/python tools/train_backprop_baseline.py --run-dir runs/train \\
        --zl-eval runs/train/eval.json --json-out runs/train/backprop_baseline.json
    # explicit shards (from `zl data`) and settings; the defaults are those of `zl train`
    .venv/bin/python tools/train_backprop_baseline.py --model tiny-random \\
        --train runs/tiny-data/train.safetensors --dev runs/tiny-data/dev.safetensors --samples 32 --window 4

Results go to stdout, progress and notes to stderr; a user mistake is one
line on stderr (exit status 2), `ZL_DEBUG=1` shows the traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from zl_base.errors import ZLError
from zl_base.json_reader import read_json_file
from zl_device.formats.lr_schedule import OptimizerSettings
from zl_device.formats.run_layout import RunLayout
from zl_device.formats.runner_config import read_runner_config
from zl_device.torch.eager_training import Budget, TrainLog
from zl_device.torch.eager_training import train_backprop as eager_train_backprop
from zl_export.manifest import read_manifest
from zl_export.options import DEFAULT_MODEL, LoraSettings
from zl_export.shard import Shard

log = logging.getLogger(__name__)

DEFAULT_SAMPLES = 256
DEFAULT_WINDOW = 8
#: `zl train`'s optimizer and schedule (zl_device/formats/lr_schedule.py): the baseline's defaults without --run-dir.
ZL_TRAIN_OPTIMIZER = OptimizerSettings()


# --- settings ------------------------------------------------------------------------------------------


@dataclass
class BaselineSettings:
    """What the baseline trains on and with; `settings_from_run_dir` fills it from a `zl train` run."""

    model: str = DEFAULT_MODEL
    seed: int = 0  # LoRA initialisation and random-weight models, as `zl export --seed`
    train: Path | None = None
    dev: Path | None = None
    samples: int = DEFAULT_SAMPLES
    window: int = DEFAULT_WINDOW  # micro-batches per AdamW step
    micro_batch: int = 1  # rows per micro-batch (the export's --micro-batch)
    seq_len: int | None = None  # the programs' seq_len when known (run dir): the shards must match it
    optimizer: OptimizerSettings = ZL_TRAIN_OPTIMIZER  # AdamW and the runner's lr schedule, as `zl train` sets them
    lora: LoraSettings = field(default_factory=LoraSettings)
    threads: int = 2
    eval_limit: int | None = None
    eval_batch_size: int = 16
    source: str = "command line"  # or the run directory the settings came from

    @property
    def budget(self) -> Budget:
        return Budget(self.samples, self.window, self.micro_batch)

    @property
    def num_micro_batches(self) -> int:
        return self.budget.num_micro_batches

    @property
    def num_windows(self) -> int:
        return self.budget.num_windows

    def schedule(self) -> dict:
        """The lr schedule as the runner runs it (zl/lr_schedule.h): every field, with T = the number of windows
        when the settings say 0 (runner_config.cpp does the same)."""
        opt = self.optimizer
        total = opt.total_steps or (self.num_windows if opt.schedule_kind == "warmup_cosine" else 0)
        return {"kind": opt.schedule_kind, "warmup_steps": opt.warmup_windows, "total_steps": total,
                "min_lr_ratio": opt.min_lr_ratio}

    def check_budget(self) -> None:
        """Samples, window, micro-batch and threads are at least 1 (before anything divides by them)."""
        for name, value in (("--samples", self.samples), ("--window", self.window), ("--micro-batch", self.micro_batch),
                            ("--threads", self.threads)):
            if value < 1:
                raise ZLError(f"{name} {value}: must be at least 1.")

    def check_schedule(self) -> None:
        """The runner's LrSchedule::validate, with its messages."""
        s = self.schedule()
        if s["kind"] not in ("constant", "warmup_cosine"):
            raise ZLError(f"schedule kind {s['kind']!r}: expected constant or warmup_cosine.")
        if s["kind"] == "constant":
            return
        if s["warmup_steps"] < 0:
            raise ZLError(f"schedule.warmup_steps must be >= 0, got {s['warmup_steps']}.")
        if s["total_steps"] < s["warmup_steps"]:
            raise ZLError(f"schedule.total_steps ({s['total_steps']}) must be >= warmup_steps ({s['warmup_steps']}).")
        if not 0.0 <= s["min_lr_ratio"] <= 1.0:
            raise ZLError(f"schedule.min_lr_ratio must be in [0, 1], got {s['min_lr_ratio']}.")

    def validate(self) -> None:
        """Everything `run` needs; raises ZLError naming the bad value."""
        self.check_budget()
        opt = self.optimizer
        if not opt.lr > 0:
            raise ZLError(f"--lr {opt.lr}: must be positive (zl train uses {ZL_TRAIN_OPTIMIZER.lr}).")
        if not all(0.0 <= b < 1.0 for b in opt.betas):
            raise ZLError(f"betas {list(opt.betas)}: each must be in [0, 1).")
        if opt.eps < 0 or opt.weight_decay < 0:
            raise ZLError(f"eps {opt.eps}, weight_decay {opt.weight_decay}: must not be negative.")
        self.lora.validate()
        self.check_schedule()
        if self.train is None:
            raise ZLError("no training data: pass --train SHARD.safetensors (from `zl data`) or --run-dir RUN_DIR.")

    def to_dict(self) -> dict:
        """What --json-out records: every setting, the optimizer's fields at the top level and the schedule as the
        runner runs it."""
        opt, d = self.optimizer, {}
        for f in fields(self):
            if f.name == "optimizer":
                d.update(lr=opt.lr, betas=list(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay,
                         schedule=self.schedule())
            else:
                d[f.name] = getattr(self, f.name)
        d.update(train=str(self.train) if self.train else None, dev=str(self.dev) if self.dev else None,
                 lora={**asdict(self.lora), "targets": list(self.lora.targets)},
                 num_micro_batches=self.num_micro_batches, num_windows=self.num_windows)
        return d


def _read_json(path: Path, what: str) -> dict:
    return read_json_file(path, str(path), missing=what, invalid="the run directory is damaged; train again.")


def run_lr(layout: RunLayout) -> float:
    """A run's base learning rate (`zl train --lr`): its settings' (RUN_DIR/train_settings.json), not a stage
    config's, which is --lr times that stage's --stage-lr multiplier (0 for a stage held still, stage 0 by default).
    A run directory without settings (zl before they were kept) gives its first trained stage's lr.

    Raises:
        ZLError: the settings hold no lr, or (without settings) no stage config has a positive one.
    """
    if layout.settings.is_file():
        try:
            return float(_read_json(layout.settings, "")["optimizer"]["lr"])
        except (KeyError, TypeError, ValueError) as e:
            raise ZLError(f"--run-dir {layout.root}: {layout.settings} holds no optimizer lr ({type(e).__name__}: "
                          f"{e}); was it written by `zl train`? Pass the run's --lr.") from None
    lrs = []
    while (config := layout.stage_config(len(lrs))).is_file():
        lrs.append(read_runner_config(config, "pass the run's --lr (was the file written by `zl train`?)").optimizer.lr)
    trained = [lr for lr in lrs if lr > 0]
    if not trained:
        raise ZLError(f"--run-dir {layout.root}: no {layout.settings.name} and no stage config with a positive lr "
                      f"(stage lrs {lrs}); pass the run's --lr.")
    return trained[0]


def settings_from_run_dir(run_dir: Path | str, lr: float | None = None) -> BaselineSettings:
    """Data, model and hyper-parameters of a `zl train` run directory.

    Reads RUN_DIR/stage_0.json (window_size, num_micro_batches, optimizer,
    data_shard), RUN_DIR/manifest.json (model, seed, seq_len, micro_batch,
    LoRA) and, unless `lr` (--lr) is given, the run's base lr (`run_lr`:
    stage 0's own is 0 when it is held still). The shards are
    RUN_DIR/data/train.safetensors (else the config's data_shard) and
    RUN_DIR/data/dev.safetensors when present.

    Raises:
        ZLError: not a run directory, or a config/manifest without the fields zl train writes.
    """
    run_dir = Path(run_dir).expanduser()
    if not run_dir.is_dir():
        raise ZLError(f"--run-dir {run_dir}: no such directory; pass the --out directory of a `zl train` run.")
    layout = RunLayout(run_dir)
    hint = f"pass the --out directory of a `zl train` run that got as far as deploying (is {run_dir} one?)"
    stage0 = read_runner_config(layout.stage_config(0), hint)
    manifest = read_manifest(layout.manifest)
    opts = manifest.options
    window, num_micro_batches = stage0.window_size, stage0.num_micro_batches
    optimizer = OptimizerSettings.from_config(stage0.optimizer)  # what the file leaves out: the runner's default
    train = layout.train_shard
    if not train.is_file() and stage0.data_shard:
        train = Path(stage0.data_shard)
    dev = layout.dev_shard
    return BaselineSettings(
        model=manifest.model.name,
        seed=opts.seed,
        train=train,
        dev=dev if dev.is_file() else None,
        samples=num_micro_batches * opts.micro_batch,
        window=window,
        micro_batch=opts.micro_batch,
        seq_len=opts.seq_len,
        optimizer=replace(optimizer, lr=run_lr(layout) if lr is None else lr),
        lora=opts.lora,
        source=str(run_dir),
    )


# --- data ----------------------------------------------------------------------------------------------


def load_shards(s: BaselineSettings, tokenizer, vocab_size: int) -> tuple[Shard, Shard | None]:
    """The train and dev shards, checked against each other, the programs' seq_len and the model's tokenizer.

    Raises:
        ZLError: a missing or malformed shard, a seq_len or tokenizer mismatch, or fewer rows than a micro-batch.
    """
    from zl_export.shard import load_shard

    train = load_shard(s.train)
    dev = load_shard(s.dev) if s.dev is not None else None
    for shard in (train, dev):
        if shard is None:
            continue
        shard.check_matches(seq_len=s.seq_len, tokenizer=tokenizer)  # its name and its BOS
        top = int(shard.input_ids.max())
        if top >= vocab_size:
            raise ZLError(f"shard {shard.path}: token id {top} is outside the model's vocabulary of {vocab_size}; "
                          f"was it tokenized for another model than {s.model}?")
    if dev is not None and dev.seq_len != train.seq_len:
        raise ZLError(f"--dev {dev.path} has seq_len {dev.seq_len}, --train {train.path} has {train.seq_len}; "
                      "tokenize both with the same `zl data --seq-len`.")
    if train.rows < s.micro_batch:
        raise ZLError(f"--train {train.path} has {train.rows} rows, fewer than one micro-batch of {s.micro_batch}; "
                      "prepare more rows or lower --micro-batch.")
    return train, dev


# --- training ------------------------------------------------------------------------------------------


def train_backprop(model: torch.nn.Module, shard: Shard, s: BaselineSettings,
                   on_window=lambda w, loss, lr: None) -> TrainLog:
    """Train the LoRA parameters of `model` (a PeftModel) with end-to-end backprop over the run's micro-batches.

    The loop is zl_device.torch.eager_training.train_backprop (shared with the accuracy study).

    Args:
        model: the PEFT-wrapped model; only parameters with requires_grad train.
        shard: the training shard (stage 0's data).
        s: budget and optimizer settings.
        on_window: called after each step with (window index, mean loss, lr).

    Returns:
        the window losses (one value per window: [[loss], ...]), lrs and seconds.
    """
    return eager_train_backprop(model, shard, s.budget, s.optimizer,
                                lambda w, log: on_window(w, log.losses[-1][0], log.lrs[-1]))


# --- the command ---------------------------------------------------------------------------------------


def read_zl_eval(path: Path) -> dict:
    """RUN_DIR/eval.json of `zl train`: {"rows", "base": {...}, "adapter": {...}}."""
    data = _read_json(path, "pass the eval.json of a `zl train` run that had a dev split.")
    if not isinstance(data.get("adapter"), dict) or "nll" not in data["adapter"]:
        raise ZLError(f"--zl-eval {path}: no \"adapter\" figures; expected the eval.json `zl train` writes.")
    return data


def build_settings(args: argparse.Namespace) -> BaselineSettings:
    """Settings from --run-dir (if given), then every option given on the command line on top."""
    s = settings_from_run_dir(args.run_dir, args.lr) if args.run_dir else BaselineSettings()
    given = {k: v for k, v in vars(args).items() if v is not None}
    for name in ("model", "seed", "train", "dev", "samples", "window", "micro_batch", "threads", "eval_limit",
                 "eval_batch_size"):
        if name in given:
            setattr(s, name, given[name])
    optimizer = {name: given[name] for name in ("lr", "eps", "weight_decay", "betas") if name in given}
    s.optimizer = replace(s.optimizer, **optimizer)
    if any(k in given for k in ("lora_rank", "lora_alpha", "lora_targets")):
        targets = (tuple(t.strip() for t in given["lora_targets"].split(",") if t.strip())
                   if "lora_targets" in given else s.lora.targets)
        s.lora = LoraSettings(given.get("lora_rank", s.lora.rank), given.get("lora_alpha", s.lora.alpha), targets)
    s.check_budget()
    if not args.run_dir:  # zl train's warm-up for this many windows (a run dir's configs have it already)
        s.optimizer = s.optimizer.for_windows(s.num_windows)
    flags = (("schedule", "schedule_kind"), ("warmup_windows", "warmup_windows"), ("min_lr_ratio", "min_lr_ratio"))
    schedule = {field: given[name] for name, field in flags if name in given}
    s.optimizer = replace(s.optimizer, **schedule)
    s.validate()
    return s


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:3]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", type=Path, help="a `zl train --out` directory: data, model and settings from its "
                    "stage_0.json, manifest.json and train_settings.json (its --lr; options below override them)")
    ap.add_argument("--model", help=f"as `zl train --model` (default {DEFAULT_MODEL})")
    ap.add_argument("--seed", type=int, help="LoRA initialisation and random-weight models (default 0)")
    ap.add_argument("--train", type=Path, help="training shard (.safetensors from `zl data`)")
    ap.add_argument("--dev", type=Path, help="dev shard to score base and trained model on")
    ap.add_argument("--samples", type=int, help=f"training samples, wrapping over the shard (default {DEFAULT_SAMPLES})")
    ap.add_argument("--window", type=int, help=f"micro-batches per AdamW step (default {DEFAULT_WINDOW})")
    ap.add_argument("--micro-batch", type=int, help="rows per micro-batch (default 1)")
    ap.add_argument("--lr", type=float, help=f"base learning rate (default {ZL_TRAIN_OPTIMIZER.lr})")
    ap.add_argument("--betas", type=float, nargs=2, help="AdamW betas (default %g %g)" % ZL_TRAIN_OPTIMIZER.betas)
    ap.add_argument("--eps", type=float, help=f"AdamW eps (default {ZL_TRAIN_OPTIMIZER.eps})")
    ap.add_argument("--weight-decay", type=float,
                    help=f"AdamW decoupled weight decay (default {ZL_TRAIN_OPTIMIZER.weight_decay})")
    ap.add_argument("--schedule", choices=("constant", "warmup_cosine"), help="lr schedule (default warmup_cosine)")
    ap.add_argument("--warmup-windows", type=int,
                    help=f"W (default min({ZL_TRAIN_OPTIMIZER.warmup_windows}, windows-1))")
    ap.add_argument("--min-lr-ratio", type=float,
                    help=f"cosine floor as a fraction of lr (default {ZL_TRAIN_OPTIMIZER.min_lr_ratio})")
    ap.add_argument("--lora-rank", type=int, help="LoRA rank (default 8)")
    ap.add_argument("--lora-alpha", type=float, help="LoRA alpha (default 16)")
    ap.add_argument("--lora-targets", help="comma-separated projections (default: every one of the model family's, as zl train)")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default 2; on a busy machine 1 can be "
                    "far faster: spinning threads wait on each other)")
    ap.add_argument("--eval-limit", type=int, help="score only the first N dev rows (default: all, or as many as --zl-eval)")
    ap.add_argument("--eval-batch-size", type=int, help="dev rows per forward pass (default 16)")
    ap.add_argument("--zl-eval", type=Path, help="RUN_DIR/eval.json: show the ZeroLock adapter's row alongside")
    ap.add_argument("--json-out", type=Path, help="write settings, figures and times here")
    ap.add_argument("--save-adapter", type=Path, help="also save the trained PEFT adapter in this directory")
    return ap.parse_args(argv)


def run(argv: list[str] | None = None) -> dict:
    """The whole baseline; returns what --json-out gets. Raises ZLError on user mistakes."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from zl_device.results.evaluate import evaluate, limit_rows
    from zl_export.lora import attach_lora
    from zl_export.model_source import load_model

    args = parse_args(argv)
    s = build_settings(args)
    err = Console(stderr=True)
    zl_eval = read_zl_eval(args.zl_eval) if args.zl_eval else None
    torch.set_num_threads(s.threads)
    wall_start = time.perf_counter()

    with err.status(f"loading {s.model}"):
        loaded = load_model(s.model, seed=s.seed)
    s.lora = s.lora.for_family(loaded.family)  # no --lora-targets: the family's default, recorded as such
    train, dev = load_shards(s, loaded.tokenizer, int(loaded.config.vocab_size))
    if dev is not None:
        limit = s.eval_limit
        if limit is None and zl_eval is not None and int(zl_eval.get("rows", dev.rows)) < dev.rows:
            limit = int(zl_eval["rows"])
            err.print(f"note: scoring the first {limit} dev rows, as many as {args.zl_eval} did.")
        dev = limit_rows(dev, limit)
    else:
        err.print("note: no dev shard (--dev or RUN_DIR/data/dev.safetensors): training only, nothing is scored.")
    err.print(f"backprop baseline: {s.model}, {s.num_micro_batches} micro-batches of {s.micro_batch} from {train.path} "
              f"({train.rows} rows) in {s.num_windows} windows of {s.window}, lr {s.optimizer.lr:g}, {s.threads} threads "
              f"(settings from {s.source})")

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn())

    def score(model, label: str):
        with Progress(*columns, console=err, transient=True) as progress:
            bar = progress.add_task(f"scoring {label}", total=dev.rows)
            return evaluate(model, dev, s.eval_batch_size, lambda rows: progress.advance(bar, rows))

    base = score(loaded.model, "base") if dev is not None else None
    peft_model = attach_lora(loaded.model, s.lora, seed=s.seed)  # the same initial LoRA weights as the export
    with Progress(*columns, TextColumn("{task.fields[loss]}"), console=err, transient=True) as progress:
        bar = progress.add_task("training", total=s.num_windows, loss="")

        def on_window(w: int, loss: float, lr: float) -> None:
            progress.update(bar, advance=1, loss=f"loss {loss:.3f}, lr {lr:.2e}")
            log.info("window %d: loss %.4f lr %.3e", w, loss, lr)

        trained = train_backprop(peft_model, train, s, on_window)
    losses = [window[0] for window in trained.losses]  # one loss per window: the whole model's
    err.print(f"trained in {trained.seconds:.1f} s: window loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    after = score(peft_model, "backprop") if dev is not None else None
    if args.save_adapter:
        peft_model.save_pretrained(str(args.save_adapter))
        err.print(f"adapter saved to {args.save_adapter}")

    report = {
        "settings": s.to_dict(),
        "train": {"path": str(train.path), "rows": train.rows, "seq_len": train.seq_len},
        "dev": {"path": str(dev.path), "rows": dev.rows} if dev is not None else None,
        "base": base.to_dict() if base else None,
        "backprop": after.to_dict() if after else None,
        "zerolock": zl_eval.get("adapter") if zl_eval else None,
        "zerolock_eval": str(args.zl_eval) if args.zl_eval else None,
        "training": {"seconds": trained.seconds, "window_losses": losses, "window_lrs": trained.lrs},
        "wall_s": time.perf_counter() - wall_start,
    }
    print_table(report, Console(), s, err)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json_out.with_name(args.json_out.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        os.replace(tmp, args.json_out)
        err.print(f"figures written to {args.json_out}")
    return report


def print_table(report: dict, console, s: BaselineSettings, err) -> None:
    """base / ZeroLock (from --zl-eval) / backprop on the dev rows."""
    from rich.table import Table

    if report["base"] is None:
        return
    rows = [("base", report["base"])]
    if report["zerolock"] is not None:
        rows.append(("ZeroLock adapter (eval.json)", report["zerolock"]))
    rows.append(("backprop LoRA", report["backprop"]))
    table = Table(title=f"{s.model} on {report['dev']['path']} ({report['dev']['rows']} rows), "
                        f"{s.samples} samples, window {s.window}")
    for name, justify in (("model", "left"), ("accuracy", "right"), ("NLL / label token (nats)", "right"),
                          ("eval seconds", "right")):
        table.add_column(name, justify=justify)
    for name, r in rows:
        acc = "—" if r.get("accuracy") is None else f"{r['accuracy']:.3f}"
        table.add_row(name, acc, f"{r['nll']:.4f}", f"{r.get('seconds', float('nan')):.1f}")
    console.print(table)
    zl_eval = report["zerolock_eval"]
    if zl_eval is not None:
        theirs = json.loads(Path(zl_eval).read_text()).get("base", {})
        if theirs and abs(theirs.get("nll", 0.0) - report["base"]["nll"]) > 1e-3:
            err.print(f"[yellow]note:[/] the base NLL in {zl_eval} ({theirs['nll']:.4f}) differs from this run's "
                      f"({report['base']['nll']:.4f}): another model, seed or set of dev rows?")


def main() -> None:
    from zl_base.entry import run_cli

    run_cli(run)


if __name__ == "__main__":
    main()
