"""Accuracy study: ZeroLock's local-loss variants against backprop LoRA, side by side, per budget and seed.

For a model, a classification data set, a list of budgets and a list of seeds
it trains and scores on the dev rows (all of them by default):

    base            the model without an adapter
    backprop        LoRA over the whole model, end-to-end backprop (the baseline of zl_study/backprop_baseline.py)
    backprop-last   LoRA on the last stage's layers only, the others frozen: the cheapest honest
                    competitor of any pipeline method
    async           backprop's LoRA and loss on the asynchronous pipeline schedule (PipeDream: no flush,
                    weight stashing): micro-batch j runs on stage k's weights of window_of(j - (K-1-k))
                    (zl_device/torch/stale_backprop.py)
    zl-*            ZeroLock, each stage on its local loss, in PyTorch eager with exactly the runner's
                    semantics (zl_device.torch.eager_training): the paper's loss and the variants below;
                    zl-default is whatever `zl train` does by default (its loss, frozen dtype and
                    --stage-lr: the stages before the last held still, the last training);
                    zl-all-stages is the default loss with every stage training

An arm with `frozen_dtype` bf16, int8 or int4 (zl-translator-bf16, zl-translator-int8, or `frozen_dtype=` in
--arm, of any kind: `kind=async;frozen_dtype=int4`) trains and is scored with the frozen weights stored that way
(`zl export --frozen-dtype`; `embedding_dtype=bf16` stores the embedding and LM head apart,
`--embedding-dtype`); one with
`lora_targets=q_proj/k_proj/...` or `lora_rank=` in --arm trains with LoRA settings of its own (ZeroLock or
backprop; the built-in arms keep the study's --lora-*). `lr=` gives an arm a peak learning rate of its own and `kind=backprop`,
`kind=backprop-last` or `kind=async` makes an --arm a backprop arm; `--reference NAME` pairs every arm with that one instead of
`backprop` (e.g. backprop at an lr where it is stable, when the study's diverges).

A seed sets the LoRA initialisation and the data order (which training rows,
in which order); for one seed every arm sees the same micro-batches in the same
order, the same LoRA initialisation, AdamW settings and learning-rate schedule
as `zl train`, and every arm is scored on the same dev rows. Per arm and seed
it records dev accuracy (label word with the highest likelihood), NLL per label
token, each dev row's result, training and scoring time, the mean loss of each
window, and for ZeroLock the early-exit accuracy and NLL of every stage (the
stage's readout, translator included, used as the classifier), which shows
which stage holds the model back. The tables give each arm's mean and standard
error over the seeds and its paired difference to the reference arm
(whole-model backprop) with a 95% interval over rows and seeds
(zl_study/comparison.py says how). Dev rows that chose an arm or
its lr are no unbiased judge of it: `--held-out N` keeps the last N of each
seed's shuffled training rows out of training and scores every trained arm
on them too, in a second paired table.

    .venv/bin/python tools/accuracy_study.py --train ../shared/data/agnews/train.csv \\
        --dev ../shared/data/agnews/dev.csv --format agnews --samples 1024 --seeds 0,1,2 \\
        --arms base,backprop,backprop-last,zl-default --out runs/study
    .venv/bin/python tools/accuracy_study.py ... --arms base,backprop,zl-paper \\
        --arm "zl-mine:alpha=0.3/0.7/1;translator_rank=8;stage_lr=1/1/2"
    .venv/bin/python tools/accuracy_study.py ... --samples 4096 --arms zl-default \\
        --arm "backprop-2e-3:kind=backprop;lr=0.002" --reference backprop-2e-3
    .venv/bin/python tools/accuracy_study.py ... --samples 1024 --held-out 1000 --arms backprop,zl-default

Each finished arm is cached as OUT/arms/<samples>-<arm>-seed<seed>.json (the
base model, scored once: OUT/arms/0-base.json) with the settings it ran with,
so a study stopped half-way resumes where it stopped; change a setting and the
affected arms run again. Results: OUT/study.json, OUT/study.md (tables) and
OUT/accuracy.png (accuracy against samples, ± one standard error).
Results go to stdout, progress and notes to stderr; a user mistake is one
line on stderr (exit status 2), `ZL_DEBUG=1` shows the traceback.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from zl_base.errors import ZLError
from zl_device.torch.eager_training import Budget, OptimizerSettings
from zl_export.data_columns import DataColumns
from zl_export.options import ExportOptions, LoraSettings
from zl_study.arms import (ARMS, DEFAULT_ARMS, REFERENCE_ARM, Arm, default_arm_for, held_still, parse_arm, parse_list,
                           without_held_exits)

STUDY_VERSION = 2  # 2: seeds, per-row results
SHOWN_GENERATIONS = 8  # generations kept per generative arm (study.md shows them side by side)


# --- settings ------------------------------------------------------------------------------------------


@dataclass
class StudySettings:
    model: str = "smollm2-135m"
    train: Path | None = None
    dev: Path | None = None
    data_format: str = "auto"
    truncate: bool = True
    seq_len: int = 128
    samples: tuple[int, ...] = (256, 1024)
    stages: str | None = None
    num_stages: int = 3
    window: int = 4
    micro_batch: int = 1
    lr: float = OptimizerSettings.lr  # zl train's optimizer defaults (zl_device/formats/lr_schedule.py)
    warmup_windows: int = OptimizerSettings.warmup_windows
    min_lr_ratio: float = OptimizerSettings.min_lr_ratio
    lora: LoraSettings = field(default_factory=LoraSettings)
    seeds: tuple[int, ...] = (0, 1, 2)
    threads: int = 2
    eval_limit: int | None = None
    eval_batch_size: int = 16
    columns: DataColumns = field(default_factory=DataColumns)  # prompt/completion columns (generative data)
    generate_rows: int | None = None  # dev rows generated for (generative data; None: all)
    held_out: int | None = None  # the last N rows of each seed's shuffled training rows: never trained on, scored

    def training_rows(self, train):
        """(the rows arms train on, the held-out rows or None) of one seed's shuffled training shard."""
        from zl_device.results.evaluate import limit_rows, tail_rows

        if self.held_out is None:
            return train, None
        if train.rows - self.held_out < max(self.samples):
            raise ZLError(f"--held-out {self.held_out}: {train.path} has {train.rows} rows, which leaves "
                          f"{train.rows - self.held_out} to train on, fewer than --samples {max(self.samples)}; "
                          f"hold out at most {train.rows - max(self.samples)} rows.")
        return limit_rows(train, train.rows - self.held_out), tail_rows(train, self.held_out)

    def optimizer(self, budget: Budget, arm: Arm | None = None) -> OptimizerSettings:
        """`zl train`'s AdamW settings and schedule for `budget` (zl_device/executorch/launch.py stage_configs), at `arm`'s
        own peak lr where it has one."""
        lr = self.lr if arm is None or arm.lr is None else arm.lr
        return OptimizerSettings(lr=lr, warmup_windows=self.warmup_windows,
                                 min_lr_ratio=self.min_lr_ratio).for_windows(budget.num_windows)

    def fingerprint(self, arm: Arm, samples: int, seed: int) -> str:
        """What determines an arm's result at `seed`: a cached arm with another fingerprint runs again."""
        fields = {k: str(v) for k, v in asdict(self).items()
                  if k not in ("samples", "seeds", "threads", "eval_batch_size")}
        for name, unset in (("columns", not self.columns.given()), ("generate_rows", self.generate_rows is None),
                            ("held_out", self.held_out is None)):
            if unset:  # studies cached before generative data keep their fingerprints
                del fields[name]
        if "columns" in fields and self.columns.prompt_template is not None:
            # A newline typed into --prompt-template and one written \n are the same prompt (render_template expands
            # the escape): both spellings are one study, in the escaped one's fingerprint.
            escaped = self.columns.prompt_template.replace("\n", "\\n").replace("\t", "\\t")
            fields["columns"] = str({**asdict(self.columns), "prompt_template": escaped})
        fields["seed"] = str(seed)
        if arm.kind == "base":  # scoring only: the training settings and the seed do not matter
            fields = {k: fields[k] for k in ("model", "dev", "data_format", "truncate", "seq_len", "eval_limit",
                                              "columns", "generate_rows") if k in fields}  # base: no held-out rows
        arm_fields = asdict(arm)
        if arm.frozen_dtype == "fp32":  # arms cached before frozen_dtype existed keep their fingerprint
            del arm_fields["frozen_dtype"]
        if not arm.lora:  # and those cached before arms had LoRA settings of their own
            del arm_fields["lora"]
        if arm.lr is None:  # or a learning rate of their own
            del arm_fields["lr"]
        if arm.embedding_dtype is None:  # or an embedding stored apart
            del arm_fields["embedding_dtype"]
        blob = {"v": STUDY_VERSION, "arm": arm_fields, "samples": samples if arm.kind != "base" else 0, **fields}
        return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:16]


# --- data ----------------------------------------------------------------------------------------------


def prepare_shard(s: StudySettings, path: Path, split: str, tokenizer, out: Path, seed: int = 0):
    """`path` as a shard: loaded when it is one (.safetensors from `zl data`; then every seed reads its rows in the
    same order), else tokenized into OUT/data/<split>.safetensors the way `zl train` does (zl_export.shard_jobs, rows
    shuffled with `seed`) and reused while the file is unchanged."""
    from zl_export import data as zdata
    from zl_export.shard import load_shard
    from zl_export.shard_jobs import file_job, write_shard

    if path.suffix == ".safetensors":
        shard = load_shard(path)
        shard.check_matches(tokenizer=tokenizer)
        return shard
    target = out / "data" / f"{split}.safetensors"
    if target.is_file():
        shard = load_shard(target)
        if (shard.meta.get("source", {}).get("sha256") == zdata.file_sha256(path) and shard.seq_len == s.seq_len
                and shard.meta.get("seed") == seed and shard.bos_token_id == tokenizer.bos_token_id):
            return shard
    job = file_job(path, s.data_format, split, columns=s.columns if s.columns.given() else None)
    job.task = zdata.select(job.task, None, True, seed)
    written, _ = write_shard(job, tokenizer, s.model, s.seq_len, out / "data", s.truncate, extra={"seed": seed})
    return load_shard(written)


# --- one arm -------------------------------------------------------------------------------------------


def zerolock_modules(arm: Arm, s: StudySettings, model, split, train, seed: int):
    """`model` with the ZeroLock `arm`'s LoRA and cut into its stage modules (build_stage_modules), as `zl train`
    exports it for `train`: target slots fitted to its longest completion, translators calibrated on it, and the
    arm's frozen dtype (trained and scored on the same compact weights).

    Returns:
        (peft model, stage modules).
    """
    from zl_export.exporter import build_stage_modules
    from zl_export.shard import fitted_target_slots
    from zl_export.translator import calibration_batches

    opts = ExportOptions(seq_len=s.seq_len, micro_batch=s.micro_batch, lora=arm.lora_settings(s.lora),
                         loss=arm.loss_config(), max_targets=fitted_target_slots(train.labels)[1], seed=seed,
                         frozen_dtype=arm.frozen_dtype, embedding_dtype=arm.embedding_dtype)
    return build_stage_modules(model, split, opts, calibration_batches(train))


def run_arm(arm: Arm, samples: int, seed: int, s: StudySettings, base_model, split, train, dev, progress,
            tokenizer=None, held=None) -> dict:
    """Train (unless base) a fresh copy of the model as `arm` on `samples` samples at `seed`, score it on `dev`
    (and, given `held`, on those rows too: result["held_out"]).

    With `tokenizer` (generative dev data) the scoring is completion NLL and greedy generations (ROUGE-L, exact
    match) instead of label-word accuracy."""
    from zl_device.torch.eager_training import (freeze_lora_below, train_backprop, train_zerolock)
    from zl_device.torch.stale_backprop import train_stale_backprop
    from zl_study.early_exit import EarlyExitModel
    from zl_device.results.evaluate import evaluate
    from zl_export.frozen_weights import compact_frozen_weights
    from zl_export.lora import attach_lora

    budget = Budget(samples, s.window, s.micro_batch)
    label = f"{arm.name} @ {samples}" + (f", seed {seed}" if arm.kind != "base" else "")
    result = {"arm": arm.name, "kind": arm.kind, "samples": samples, "seed": seed if arm.kind != "base" else None,
              "note": arm.note}
    model = copy.deepcopy(base_model)
    modules, log = None, None
    bar = progress.add_task(label, total=budget.num_windows if arm.kind != "base" else 1, loss="")

    every = max(1, budget.num_windows // 10)

    def on_window(w, train_log) -> None:
        loss = "loss " + "/".join("-" if x is None else f"{x:.2f}" for x in train_log.losses[-1])  # -: forward only
        progress.update(bar, advance=1, loss=loss)
        if not progress.console.is_terminal and (w + 1) % every == 0:  # a log file: a plain line now and then
            progress.console.print(f"{label}: window {w + 1}/{budget.num_windows}, {loss}")

    if arm.kind == "zerolock":
        peft_model, modules = zerolock_modules(arm, s, model, split, train, seed)
        result["trainable"] = sum(p.numel() for m in modules for p in m.parameters() if p.requires_grad)
        log = train_zerolock(modules, train, budget, s.optimizer(budget, arm), arm.stage_lr, on_window)
        trained = peft_model
    elif arm.kind in ("backprop", "backprop-last", "async"):
        trained = attach_lora(model, arm.lora_settings(s.lora), seed=seed)  # the same initial LoRA weights as the export
        # trained and scored on them, as a zerolock arm (fp32: as is)
        compact_frozen_weights(trained, arm.frozen_dtype, arm.embedding_dtype)
        if arm.kind == "backprop-last":
            freeze_lora_below(trained, split[-1].first)
        result["trainable"] = sum(p.numel() for p in trained.parameters() if p.requires_grad)
        if arm.kind == "async":  # each stage of the split on its stashed weight version
            log = train_stale_backprop(trained, train, budget, s.optimizer(budget, arm),
                                       [range(r.first, r.last + 1) for r in split], on_window)
        else:
            log = train_backprop(trained, train, budget, s.optimizer(budget, arm), on_window)
    else:
        trained = model
        progress.update(bar, advance=1)
    if log is not None:
        result.update(train_s=log.seconds, window_losses=log.losses)
        if log.task_losses:
            result.update(window_task_losses=log.task_losses, window_consistency_losses=log.consistency_losses)
    progress.update(bar, description=f"{label}: scoring", loss="")
    score, scored = score_rows(trained, dev, s, tokenizer)
    result.update(scored)
    if tokenizer is not None:
        result["generations"] = score.generations[:SHOWN_GENERATIONS]
    shown = _shown(scored)
    if held is not None:
        progress.update(bar, description=f"{label}: scoring {held.rows} held-out rows")
        result["held_out"] = score_rows(trained, held, s, tokenizer)[1]
        shown += f", held out {_shown(result['held_out'])}"
    if modules is not None:  # each trained stage's readout as the model: NLL (and accuracy on classification data)
        exits = [None if held_still(arm, k, len(modules)) else evaluate(EarlyExitModel(modules, k), dev, s.eval_batch_size)
                 for k in range(len(modules) - 1)]  # a stage held still (lr 0): its readout learnt nothing; None
        result["early_exit_accuracy"] = [e and e.accuracy for e in exits] + [score.accuracy]
        result["early_exit_nll"] = [e and e.nll for e in exits] + [score.nll]
    progress.update(bar, description=f"{label}: {shown}")
    return result


def score_rows(model, shard, s: StudySettings, tokenizer=None) -> tuple:
    """`model` scored on every row of `shard`: (the Score, the record's fields: accuracy, nll, eval_s, each row's
    result and, on generative data, ROUGE-L, exact match and how many rows were generated for)."""
    from zl_device.results.evaluate import GenerationEval, evaluate

    generation = None
    if tokenizer is not None:
        generation = GenerationEval(tokenizer, rows=shard.rows if s.generate_rows is None else s.generate_rows)
    score = evaluate(model, shard, s.eval_batch_size, per_row=True, generation=generation)
    rows = {"nll_sum": score.per_row.nll_sum, "tokens": score.per_row.tokens}
    fields = {"accuracy": score.accuracy, "nll": score.nll, "eval_s": score.seconds, "rows": rows}
    if generation is None:
        rows["correct"] = score.per_row.correct
    else:
        rows.update(rouge_l=score.row_rouge_l, exact=score.row_exact)
        fields.update(rouge_l=score.rouge_l, exact_match=score.exact_match, generated_rows=score.generated_rows)
    return score, fields


def _shown(fields: dict) -> str:
    """score_rows' fields in a progress line: accuracy, or ROUGE-L and NLL on generative data."""
    return f"{fields['accuracy']:.1%}" if "rouge_l" not in fields else \
        f"ROUGE-L {fields['rouge_l']:.3f}, NLL {fields['nll']:.3f}"


def held_out_results(results: list[dict]) -> list[dict]:
    """The trained arms' records with their held-out scores in place of the dev ones (no early exits there)."""
    return [{**{k: v for k, v in r.items() if not k.startswith("early_exit")}, **r["held_out"]}
            for r in results if r.get("held_out")]


# --- the study -----------------------------------------------------------------------------------------


def run_study(s: StudySettings, arms: list[Arm], out: Path, err, report_only: bool = False,
              reference: str = REFERENCE_ARM) -> dict:
    """Train and score every (budget, seed, arm) not cached in OUT/arms; with `report_only`, only tabulate the
    cached ones. The tables pair every arm with `reference`."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from zl_device.results.evaluate import limit_rows
    from zl_study.study_tables import markdown, plot, summary_table
    from zl_export.model_family import family_of_model
    from zl_export.model_source import load_model
    from zl_export.stages import balanced_split, format_spec, parse_spec

    torch.set_num_threads(s.threads)
    with err.status(f"loading {s.model}"):
        loaded = load_model(s.model, seed=0)  # the model is fixed; the seeds vary LoRA and data
    cfg = loaded.config
    family = family_of_model(loaded.model)
    s.lora = s.lora.for_family(family)  # no --lora-targets: the family's default, as zl train (and in the fingerprint)
    s.lora.validate(family)
    split = parse_spec(s.stages, cfg.num_hidden_layers) if s.stages else balanced_split(cfg.num_hidden_layers,
                                                                                       s.num_stages)
    for arm in arms:
        arm.lora_settings(s.lora).validate(family)
        arm.loss_config().validate(len(split))
        if len(arm.stage_lr) not in (1, len(split)):
            raise ZLError(f"arm {arm.name}: stage_lr has {len(arm.stage_lr)} values for {len(split)} stages.")
    dev = limit_rows(prepare_shard(s, s.dev, "dev", loaded.tokenizer, out), s.eval_limit)
    generative = not dev.meta.get("label_token_ids")  # prompt/completion rows: NLL and generations, not accuracy
    arms = [default_arm_for(arm, len(split)) for arm in arms]
    trains = {seed: s.training_rows(prepare_shard(s, s.train, f"train-seed{seed}", loaded.tokenizer, out, seed))
              for seed in s.seeds}  # seed -> (rows to train on, held-out rows or None)
    train_rows = trains[s.seeds[0]][0].rows
    err.print(f"study: {s.model}, stages {format_spec(split)}, {train_rows} train rows, {dev.rows} dev rows, "
              f"samples {', '.join(map(str, s.samples))}, seeds {', '.join(map(str, s.seeds))}, window {s.window}, "
              f"lr {s.lr:g}, {s.threads} threads"
              + (f", {s.held_out} held-out rows per seed" if s.held_out else ""))
    results = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[loss]}"))
    with Progress(*columns, console=err) as progress:
        for samples in s.samples:
            for seed in s.seeds:
                for arm in arms:
                    if arm.kind == "base" and seed != s.seeds[0]:
                        continue  # scored once: no training, nothing seeded
                    key = "0-base" if arm.kind == "base" else f"{samples}-{arm.name}-seed{seed}"
                    cached = out / "arms" / f"{key}.json"
                    fp = s.fingerprint(arm, samples, seed)
                    stored = json.loads(cached.read_text()) if cached.is_file() else {}
                    if stored.get("fingerprint") == fp:
                        result = without_held_exits(arm, stored)
                    elif report_only:
                        err.print(f"{key}: not in {cached.parent} with these settings; left out")
                        continue
                    else:
                        start = time.perf_counter()
                        train, held = trains[seed]
                        result = run_arm(arm, samples, seed, s, loaded.model, split, train, dev, progress,
                                         loaded.tokenizer if generative else None,
                                         held if arm.kind != "base" else None)
                        result.update(fingerprint=fp, wall_s=time.perf_counter() - start)
                        _write_json(cached, result)
                    results.append({**result, "samples": samples})
    study = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(s).items()},
             "stages": format_spec(split), "train_rows": train_rows, "dev_rows": dev.rows,
             "metric": "rouge_l" if generative else "accuracy",
             "arms": [asdict(a) for a in arms], "reference": reference, "results": results}
    study["summary"] = summary_table(results, reference, study["metric"])
    if s.held_out:  # the same arms on each seed's held-out training rows (the base model, scored once, has none)
        study["held_out_rows"] = s.held_out
        study["held_out_summary"] = summary_table(held_out_results(results), reference, study["metric"])
    if generative:  # the first dev rows, each arm's generation (first seed) next to the reference
        from zl_device.results.generation import side_by_side

        texts = {f"{r['arm']} @ {r['samples']}" if r["kind"] != "base" else r["arm"]: r["generations"]
                 for r in results if r.get("generations") and r.get("seed") in (None, s.seeds[0])}
        study["generations"] = side_by_side(dev, loaded.tokenizer, texts, rows=4)
    study = json.loads(json.dumps(study, default=str))  # what study.json holds (tuples as lists)
    _write_json(out / "study.json", study)
    (out / "study.md").write_text(markdown(study))
    plot(study, out / "accuracy.png")
    return study


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


# --- command line --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[3:5]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", type=Path, required=True, help="training rows: .csv/.jsonl (with --format) or a shard")
    ap.add_argument("--dev", type=Path, required=True, help="dev rows to score on: .csv/.jsonl or a shard")
    ap.add_argument("--format", dest="data_format", default="auto", help="format of .csv/.jsonl files (see `zl data`)")
    ap.add_argument("--model", default="smollm2-135m", help="as `zl train --model` (default smollm2-135m)")
    ap.add_argument("--samples", default="256,1024", help="budgets, comma-separated (default 256,1024)")
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                    help=f"built-in arms to run, comma-separated (default {','.join(DEFAULT_ARMS)}; all: {','.join(ARMS)})")
    ap.add_argument("--arm", action="append", default=[], metavar="NAME:key=value;...",
                    help="an extra ZeroLock arm, e.g. 'zl-x:alpha=0.3/0.7/1;translator_rank=8;stage_lr=1/1/2'")
    ap.add_argument("--stages", help="layer ranges per stage (default: --num-stages balanced)")
    ap.add_argument("--num-stages", type=int, default=3, help="balanced split (default 3)")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per sample (default 128)")
    ap.add_argument("--no-truncate", dest="truncate", action="store_false",
                    help="fail on over-long prompts instead of cutting them from the left")
    ap.add_argument("--window", type=int, default=4, help="micro-batches per AdamW step (default 4, as zl train)")
    ap.add_argument("--micro-batch", type=int, default=1, help="rows per micro-batch (default 1)")
    ap.add_argument("--lr", type=float, default=OptimizerSettings.lr,
                    help=f"AdamW learning rate (default {OptimizerSettings.lr:g}, as zl train)")
    ap.add_argument("--lora-rank", type=int, default=8, help="LoRA rank (default 8)")
    ap.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA alpha (default 16)")
    ap.add_argument("--lora-targets", help="projections with adapters (default: the model family's, as zl train: "
                                           "every projection of its layers)")
    ap.add_argument("--seeds", default="0,1,2",
                    help="seeds of the LoRA init and data order, comma-separated; every arm runs at each (default 0,1,2)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--eval-limit", type=int, help="score only the first N dev rows (default: all)")
    ap.add_argument("--prompt-column", help="generative data: the column holding the prompt (as zl data)")
    ap.add_argument("--completion-column", help="generative data: the column holding the completion (as zl data)")
    ap.add_argument("--prompt-template", help="generative data: build the prompt from columns, e.g. "
                                              "\"Article: {description}\\nHeadline:\" (as zl data)")
    ap.add_argument("--eval-batch-size", type=int, default=16,
                    help="dev rows per forward pass when scoring and generating (default 16; more is faster on "
                         "many cores; the figures change only by float rounding)")
    ap.add_argument("--generate-rows", type=int,
                    help="generative data: greedy generations for the first N dev rows (default: all)")
    ap.add_argument("--held-out", type=int,
                    help="keep the last N of each seed's shuffled training rows out of training and score every "
                         "trained arm on them too: a test set no choice was tuned on (study.md's held-out table)")
    ap.add_argument("--out", type=Path, default=Path("runs/study"), help="results and cache (default runs/study)")
    ap.add_argument("--reference",
                    help="the arm every other is paired with (default backprop, when the study has it), e.g. a backprop arm at its own lr: "
                         "--arm 'backprop-2e-3:kind=backprop;lr=0.002' --reference backprop-2e-3")
    ap.add_argument("--report-only", action="store_true",
                    help="train nothing: tabulate the arms already cached in OUT/arms (e.g. from runs split across machines)")
    return ap.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[StudySettings, list[Arm]]:
    samples = parse_list(args.samples, int, "--samples")
    seeds = parse_list(args.seeds, int, "--seeds")
    if len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ZLError(f"--seeds {args.seeds}: give distinct seeds of at least 0, e.g. 0,1,2.")
    for flag, value in (("--samples", min(samples)), ("--window", args.window), ("--micro-batch", args.micro_batch),
                        ("--eval-batch-size", args.eval_batch_size),
                        ("--threads", args.threads), ("--num-stages", args.num_stages),
                        ("--held-out", 1 if args.held_out is None else args.held_out)):
        if value < 1:
            raise ZLError(f"{flag} {value}: must be at least 1.")
    if not args.lr > 0:
        raise ZLError(f"--lr {args.lr}: must be positive.")
    for flag, path in (("--train", args.train), ("--dev", args.dev)):
        if not path.is_file():
            raise ZLError(f"{flag} {path}: no such file; pass a .csv/.jsonl data file or a shard from `zl data`.")
    targets = None if args.lora_targets is None else tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
    lora = LoraSettings(args.lora_rank, args.lora_alpha, targets)
    lora.validate()
    columns = DataColumns(args.prompt_column, args.completion_column, args.prompt_template)
    columns.validate()
    if args.generate_rows is not None and args.generate_rows < 1:
        raise ZLError(f"--generate-rows {args.generate_rows}: must be at least 1 (or leave it out: every dev row).")
    names = [n.strip() for n in args.arms.split(",") if n.strip()]
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        raise ZLError(f"--arms: unknown arm {unknown[0]!r}; choose from {', '.join(ARMS)} (or add one with --arm).")
    arms = [ARMS[n] for n in names] + [parse_arm(spec) for spec in args.arm]
    if not arms:
        raise ZLError("no arms to run: pass --arms and/or --arm.")
    if args.reference is not None and args.reference not in [a.name for a in arms]:
        raise ZLError(f"--reference {args.reference}: not among this study's arms ({', '.join(a.name for a in arms)}); "
                      f"add it to --arms or --arm, or name one of those.")
    s = StudySettings(model=args.model, train=args.train, dev=args.dev, data_format=args.data_format,
                      truncate=args.truncate, seq_len=args.seq_len, samples=samples, stages=args.stages,
                      num_stages=args.num_stages, window=args.window, micro_batch=args.micro_batch, lr=args.lr,
                      lora=lora, seeds=seeds, threads=args.threads, eval_limit=args.eval_limit, columns=columns,
                      generate_rows=args.generate_rows, eval_batch_size=args.eval_batch_size, held_out=args.held_out)
    return s, arms


def run(argv: list[str] | None = None) -> dict:
    from rich.console import Console

    args = parse_args(argv)
    s, arms = build(args)
    err = Console(stderr=True)
    study = run_study(s, arms, args.out, err, args.report_only, args.reference or REFERENCE_ARM)
    Console().print((args.out / "study.md").read_text())
    err.print(f"written: {args.out / 'study.json'}, {args.out / 'study.md'}, {args.out / 'accuracy.png'}")
    return study


def main() -> None:
    from zl_base.entry import run_cli

    run_cli(run)


if __name__ == "__main__":
    main()
