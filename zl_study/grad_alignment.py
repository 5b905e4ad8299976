#!/usr/bin/env python3
"""How well does each stage's local loss point where whole-model backprop points?

A ZeroLock stage k trains its LoRA weights on the gradient of its own local
loss (its readout's cross-entropy, plus the KL term). Whole-model backprop
would train the same weights on the gradient of the final loss, which flows
through every later stage. This tool measures, on the same micro-batches and
the same starting weights, how the two gradients of each stage's LoRA weights
agree:

- `cos`: cosine between the local and the end-to-end gradient, summed over
  the micro-batches (the direction a window's mean gradient takes);
- `sign`: ⟨sign(g_local), g_e2e⟩ / ‖g_e2e‖₁, in [-1, 1]. AdamW's first steps
  move each weight by about lr · sign(g); this is the share of the first-order
  decrease of the *final* loss that a step on the local loss achieves,
  relative to the same step on the true gradient (1: as good as backprop,
  0: no better than a random direction, < 0: it raises the final loss).

The last stage's local loss (α 1) is the final loss itself, so its row reads
1.000 / 1.000: the check that the two paths measure the same thing.

Example (label words, then generative rows):

    .venv/bin/python tools/grad_alignment.py --train ../shared/data/agnews/train.csv --format agnews
    .venv/bin/python tools/grad_alignment.py --train ../shared/data/agnews/train.csv --format prompt_completion \\
        --prompt-template "Article: {description}\\nHeadline:" --completion-column title

Arms are the accuracy study's ZeroLock arms (`--arms`, `--arm`, the same
syntax). Results go to stdout (a table) and --out (JSON); a user mistake is
one line on stderr (exit status 2), `ZL_DEBUG=1` shows the traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from zl_base.errors import ZLError
from zl_study import accuracy_study as study
from zl_study import arms as study_arms


def lora_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The stage's LoRA tensors (not its translator: the final loss does not depend on it)."""
    return [p for n, p in module.named_parameters() if p.requires_grad and "lora_" in n]


def agreement(local: torch.Tensor, e2e: torch.Tensor) -> tuple[float, float]:
    """(cosine, sign-step efficiency) of two flat gradients; see the module docstring."""
    cos = torch.nn.functional.cosine_similarity(local.double(), e2e.double(), dim=0).item()
    norm1 = e2e.double().abs().sum().item()
    sign = (torch.sign(local.double()) * e2e.double()).sum().item() / norm1 if norm1 > 0 else float("nan")
    return cos, sign


def flat_grads(params: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def measure(arm: study_arms.Arm, s: study.StudySettings, base_model, split, shard, micro_batches: int, seed: int,
            trained_samples: int = 0) -> list:
    """Both gradients of every stage's LoRA weights, summed over `micro_batches` micro-batches: at the start, or
    after the arm trained on the first `trained_samples` rows (ZeroLock, as the study trains it), on the rows after
    them."""
    import copy

    from zl_device.torch.eager_training import Budget, causal_lm_loss, micro_batch, train_zerolock

    peft_model, modules = study.zerolock_modules(arm, s, copy.deepcopy(base_model), split, shard, seed)
    if trained_samples:
        budget = Budget(trained_samples, s.window, s.micro_batch)
        train_zerolock(modules, shard, budget, s.optimizer(budget), arm.stage_lr)
    params = [lora_params(m) for m in modules]
    every = [p for ps in params for p in ps]
    local_sum = [torch.zeros(sum(p.numel() for p in ps)) for ps in params]
    e2e_sum = [torch.zeros_like(t) for t in local_sum]
    for m in modules:
        m.gather_targets = True
    first = trained_samples // s.micro_batch
    for mb in range(first, first + micro_batches):
        ids, mask, labels = micro_batch(shard, mb, s.micro_batch)
        for p in every:
            p.grad = None
        causal_lm_loss(peft_model, ids, mask, labels).backward()
        for k, ps in enumerate(params):
            e2e_sum[k] += flat_grads(ps)
        for p in every:
            p.grad = None
        x = ids
        for k, m in enumerate(modules):
            h_in, h = m.chunk(x, mask)
            m.loss_terms(h_in, h, labels)[0].backward()
            local_sum[k] += flat_grads(params[k])
            x = h.detach()
    rows = []
    for k, stage in enumerate(split):
        cos, sign = agreement(local_sum[k], e2e_sum[k])
        rows.append({"arm": arm.name, "trained_samples": trained_samples, "stage": k,
                     "layers": f"{stage.first}-{stage.last}", "cos": cos, "sign": sign,
                     "e2e_norm": e2e_sum[k].norm().item(), "local_norm": local_sum[k].norm().item()})
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", type=Path, required=True, help="training rows: .csv/.jsonl (with --format) or a shard")
    ap.add_argument("--format", dest="data_format", default="auto", help="as `zl data --format` (default auto)")
    ap.add_argument("--prompt-column", help="generative CSV: the prompt column")
    ap.add_argument("--completion-column", help="generative CSV: the completion column")
    ap.add_argument("--prompt-template", help="generative CSV: a prompt built from several columns")
    ap.add_argument("--model", default="smollm2-135m", help="as `zl train --model` (default smollm2-135m)")
    ap.add_argument("--stages", help="layer ranges per stage (default: 3 balanced stages)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batches", type=int, default=64, help="micro-batches (of one row) summed (default 64)")
    ap.add_argument("--arms", default="zl-all-stages,zl-ce",
                    help="built-in ZeroLock arms of tools/accuracy_study.py (default zl-all-stages,zl-ce: every stage "
                         "trains on its local loss, so --trained moves them all; zl-default holds all but the last "
                         "still)")
    ap.add_argument("--arm", action="append", default=[], help="an extra ZeroLock arm, the accuracy study's syntax")
    ap.add_argument("--trained", default="0",
                    help="measure after each arm trained on this many samples (comma-separated: several points; "
                         "default 0, the start)")
    ap.add_argument("--seed", type=int, default=0, help="LoRA initialisation and row order")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    err = Console(stderr=True)
    try:
        args = parse_args(argv)
        if args.micro_batches < 1:
            raise ZLError(f"--micro-batches {args.micro_batches}: must be at least 1.")
        trained = study_arms.parse_list(args.trained, int, "--trained")
        if any(n < 0 for n in trained):
            raise ZLError(f"--trained {args.trained}: sample counts must be 0 or more, e.g. --trained 0,256.")
        names = [n.strip() for n in args.arms.split(",") if n.strip()]
        unknown = [n for n in names if n not in study_arms.ARMS or study_arms.ARMS[n].kind != "zerolock"]
        if unknown:
            raise ZLError(f"--arms: {unknown[0]!r} is not a ZeroLock arm of tools/accuracy_study.py; choose from "
                          f"{', '.join(n for n, a in study_arms.ARMS.items() if a.kind == 'zerolock')}.")
        arms = [study_arms.ARMS[n] for n in names] + [study_arms.parse_arm(spec) for spec in args.arm]
        from zl_export.data_columns import DataColumns
        from zl_export.model_family import family_of_model
        from zl_export.model_source import load_model
        from zl_export.stages import balanced_split, format_spec, parse_spec

        columns = DataColumns(args.prompt_column, args.completion_column, args.prompt_template)
        columns.validate()
        s = study.StudySettings(model=args.model, train=args.train, data_format=args.data_format, seq_len=args.seq_len,
                                stages=args.stages, threads=args.threads, columns=columns)
        torch.set_num_threads(s.threads)
        with err.status(f"loading {s.model}"):
            loaded = load_model(s.model, seed=0)
        s.lora = s.lora.for_family(family_of_model(loaded.model))
        layers = loaded.config.num_hidden_layers
        split = parse_spec(s.stages, layers) if s.stages else balanced_split(layers, s.num_stages)
        for arm in arms:
            arm.loss_config().validate(len(split))
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:  # the shard lives as long as the measurement reads it
            shard = study.prepare_shard(s, s.train, "train", loaded.tokenizer, Path(tmp), args.seed)
            if shard.rows < max(trained) + args.micro_batches:
                raise ZLError(f"--micro-batches {args.micro_batches} after --trained {max(trained)}: the data has "
                              f"{shard.rows} rows; use fewer.")
            kind = "label words" if shard.meta.get("label_token_ids") else "generative"
            arms = [study_arms.default_arm_for(arm, len(split)) for arm in arms]  # as the study
            err.print(f"{s.model}, stages {format_spec(split)}, {kind} data, {args.micro_batches} micro-batches, "
                      f"seed {args.seed}")
            rows = []
            for arm in arms:
                for n in trained:
                    with err.status(f"{arm.name}: " + (f"training on {n} samples, then " if n else "") + "gradients"):
                        rows += measure(arm, s, loaded.model, split, shard, args.micro_batches, args.seed, n)
            print(f"| arm | trained samples | stage | layers | cos(local, e2e) | sign-step efficiency |  ({kind} data)")
            print("|---|---|---|---|---|---|")
            for r in rows:
                print(f"| {r['arm']} | {r['trained_samples']} | {r['stage']} | {r['layers']} | {r['cos']:+.3f} "
                      f"| {r['sign']:+.3f} |")
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps({"data": kind, "model": s.model, "stages": format_spec(split),
                                                "micro_batches": args.micro_batches, "seed": args.seed,
                                                "trained": list(trained),
                                                "rows": rows}, indent=2) + "\n")
        return 0
    except ZLError as e:
        if os.environ.get("ZL_DEBUG"):
            raise
        err.print(f"error: {e}", markup=False, highlight=False, soft_wrap=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
