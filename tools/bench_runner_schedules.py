"""The runner's schedules side by side: ZeroLock held still and training, gpipe, 1f1b and async (issue 39, E2).

Runs one `zl train` job (the same split, data, LoRA, windows, optimizer and seed) once per schedule on the
ExecuTorch runner, 3 local devices by default, once per link profile (the runner's emulation, both ways:
`local`, i.e. idle, and `constrained`, 30 ms and 50 Mbit/s), and reads each stage's telemetry:

    records/s          samples over the span from the first runner ready to the last done
    peak PSS per stage the largest pss_mib a stage reported (micro-batch and window lines)
    bytes per record   down (DATA frames and their headers, sender bytes_sent) and up (ACKs and GRAD frames,
                       receiver bytes_sent), per sample, summed over the links
    grad delay         the largest number of micro-batches a stage sent between a DATA entry and its GRAD
    busy per stage     its phase 1 + phase 2 time over its span from ready to done: what is left is waiting
                       (for input, for a gradient, on back-pressure) and the window ends
    grad wait          a stage's median wait for the gradient a backward needed (the link's round trip not hidden)

The schedules: `zerolock-held` (zl train's default: the stages before the last forward only), `zerolock-all`
(--stage-lr 1: every stage on its local loss), `gpipe`, `1f1b`, `async` (every stage on the final loss's gradient,
docs/design#backprop-schedules), and on request `1f1b-keep` and `async-keep` (the same with --keep-activations: no
second forward in the backward, one program instance per micro-batch in flight). It prints a table per link profile and
the ratios the issue asks for (async against 1f1b and against the held-still default).

    .venv/bin/python tools/bench_runner_schedules.py --model smollm2-135m --samples 64 --window 4 --seq-len 128 \\
        --data ../shared/data/agnews/train.csv --format agnews --truncate --cpu-quota 0.5 --json runs/bench-schedules.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from zl_export.options import FROZEN_DTYPES  # noqa: E402  (after the repository is on the path)

#: name -> (zl train --schedule or None for its default, --stage-lr or None for its default, --keep-activations)
SCHEDULES: dict[str, tuple[str | None, tuple[float, ...] | None, bool]] = {
    "default": (None, None, False),  # what zl train picks for the data: async on generative rows, else zerolock-held
    "zerolock-held": ("zerolock", None, False),
    "zerolock-all": ("zerolock", (1.0,), False),
    "gpipe": ("gpipe", None, False),
    "1f1b": ("1f1b", None, False),
    "async": ("async", None, False),
    "1f1b-keep": ("1f1b", None, True),
    "async-keep": ("async", None, True),
}
DEFAULT_SCHEDULES = ("zerolock-held", "zerolock-all", "gpipe", "1f1b", "async")
PROFILES = ("local", "constrained")


def run_one(args, name: str, profile: str, out: Path) -> dict:
    """One `zl train` of `name` on `profile` links; its figures from the stages' telemetry."""
    from zl_device.run.train_job import run_training
    from zl_device.run.train_settings import TrainSettings
    from zl_export.data_settings import DataSettings
    from zl_export.options import ExportOptions, ModelSplit

    schedule, stage_lr, keep = SCHEDULES[name]
    export = ExportOptions(micro_batch=1, frozen_dtype=args.frozen_dtype, recompute=args.recompute)
    s = TrainSettings(split=ModelSplit(args.model, args.stages, args.num_stages), data=args.data,
                      eval_data=None if args.data == "demo" else args.data, eval_limit=1,
                      rows=DataSettings(format=args.format, seq_len=args.seq_len, truncate=args.truncate),
                      samples=args.samples, window=args.window, out=out, export=export,
                      threads=args.threads, seed=args.seed, devices=f"local:{args.ranks}", schedule=schedule,
                      stage_lr=stage_lr, keep_activations=keep, link_profile=profile, grad_dtype=args.grad_dtype,
                      cpu_quota=(args.cpu_quota,) if args.cpu_quota else None, timeout_s=args.timeout)
    result = run_training(s, say=lambda line: print(f"  {line}", file=sys.stderr, flush=True))
    return {"pipeline": name, "profile": profile, **run_figures(result.run_dir, args.ranks, result.samples)}


def run_figures(run_dir: Path, ranks: int, samples: int) -> dict:
    """A finished run's figures from its stages' telemetry (each stage's last attempt)."""
    from zl_device.formats.metrics_log import stage_lines
    from zl_device.formats.run_layout import RunLayout

    lines = stage_lines(RunLayout(run_dir), ranks)
    lines = [rank[max(i for i, r in enumerate(rank) if r["type"] == "start"):] for rank in lines]  # last attempt
    starts = [next(r for r in rank if r["type"] == "start") for rank in lines]
    done = [next(r for r in rank if r["type"] == "done") for rank in lines]
    wall_s = (max(d["t_unix_ms"] for d in done) - min(r["ready_unix_ms"] for r in starts)) / 1e3
    pss = [max((r["pss_mib"] for r in rank if r.get("pss_mib") is not None), default=None) for rank in lines]
    down = sum(d["sender"]["bytes_sent"] for d in done if "sender" in d)
    up = sum(d["receiver"]["bytes_sent"] for d in done if "receiver" in d)
    windows = [r for r in lines[-1] if r["type"] == "window"]
    busy, grad_wait = [], []
    for rank, start, end in zip(lines, starts, done):
        mbs = [r for r in rank if r["type"] == "micro_batch"]
        compute_ms = sum((r.get("phase1_ms") or 0) + (r.get("phase2_ms") or 0) for r in mbs)
        busy.append(compute_ms / max(end["t_unix_ms"] - start["ready_unix_ms"], 1))
        waits = [r["grad_wait_ms"] for r in mbs if r.get("grad_wait_ms") is not None]
        grad_wait.append(statistics.median(waits) if waits else None)
    return {"samples": samples, "wall_s": wall_s, "records_per_s": samples / wall_s, "peak_pss_mib": pss,
            "peak_rss_mib": [d["peak_rss_mib"] for d in done],
            "bytes_down_per_record": down / samples, "bytes_up_per_record": up / samples,
            "max_grad_delay": [d["sender"].get("max_grad_delay") for d in done if "sender" in d],
            "busy": busy, "median_grad_wait_ms": grad_wait,
            "last_stage_first_loss": windows[0]["mean_loss"], "last_stage_last_loss": windows[-1]["mean_loss"]}


def cells(r: dict) -> tuple[str, str, str, str]:
    """A run's schedule (with its round), peak PSS, busy share and grad wait per stage, as table cells."""
    name = r["pipeline"] if r.get("round") is None else f"{r['pipeline']} (round {r['round'] + 1})"
    pss = " / ".join("-" if m is None else f"{m:.0f}" for m in r["peak_pss_mib"])
    busy = " / ".join(f"{b:.0%}" for b in r["busy"])
    wait = " / ".join("-" if w is None else f"{w:.0f}" for w in r["median_grad_wait_ms"])
    return name, pss, busy, wait


def table(results: list[dict]) -> str:
    rows = ["| link | schedule | records/s | wall (s) | peak PSS per stage (MiB) | busy per stage | grad wait (ms) "
            "| bytes/record down | bytes/record up | max grad delay (mb) | last stage loss, first -> last window |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        name, pss, busy, wait = cells(r)
        delay = " / ".join(str(d) for d in r["max_grad_delay"] if d) or "-"
        rows.append(f"| {r['profile']} | {name} | {r['records_per_s']:.3f} | {r['wall_s']:.1f} | {pss} | "
                    f"{busy} | {wait} | {r['bytes_down_per_record']:,.0f} | {r['bytes_up_per_record']:,.0f} | "
                    f"{delay} | {r['last_stage_first_loss']:.3f} -> {r['last_stage_last_loss']:.3f} |")
    return "\n".join(rows)


def ratios(results: list[dict]) -> list[str]:
    """async's (and async-keep's) records/s against 1f1b's and the held-still default's, and its peak PSS against the
    others', per link profile and round; with several rounds, also the median of each records/s ratio over them."""
    from zl_study.study_tables import ratio_line

    lines = []
    rounds = sorted({r.get("round") or 0 for r in results})
    by_pair: dict[str, list[float]] = {}
    for profile in dict.fromkeys(r["profile"] for r in results):
        for n in rounds:
            by = {r["pipeline"]: r for r in results if r["profile"] == profile and (r.get("round") or 0) == n}
            for subject in ("async", "async-keep"):
                a = by.get(subject)
                if a is None:
                    continue
                for other in ("1f1b", "1f1b-keep", "async", "gpipe", "zerolock-held", "zerolock-all"):
                    if other not in by or other == subject:
                        continue
                    pair = f"{profile}: {subject} vs {other}"
                    label = pair if len(rounds) == 1 else f"{pair} (round {n + 1})"
                    lines.append(ratio_line(label, a, by[other], "records_per_s", "peak_pss_mib",
                                            "peak PSS per stage"))
                    by_pair.setdefault(pair, []).append(a["records_per_s"] / by[other]["records_per_s"])
    if len(rounds) > 1:
        for pair, values in by_pair.items():
            shown = ", ".join(f"{v:.2f}x" for v in values)
            lines.append(f"{pair}: records/s median {statistics.median(values):.2f}x over {len(values)} rounds ({shown})")
    return lines


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """What every run of a runner benchmark takes (tools/bench_scaling.py too): the model, data, budget, runner
    settings and where the results go."""
    parser.add_argument("--model", default="tiny-random", help="--model of zl train (e.g. smollm2-135m).")
    parser.add_argument("--data", default="demo", help="demo, a .csv/.jsonl file or a shard, as zl train --data.")
    parser.add_argument("--format", default="auto", help="Format of a .csv/.jsonl --data, as zl train --format.")
    parser.add_argument("--truncate", action="store_true", help="Cut over-long prompts from the left (zl train "
                        "--truncate), e.g. AG News at --seq-len 128.")
    parser.add_argument("--samples", type=int, default=32, help="Training samples (micro-batches of 1).")
    parser.add_argument("--window", type=int, default=4, help="Micro-batches per AdamW step.")
    parser.add_argument("--seq-len", type=int, default=64, help="Tokens per sample.")
    parser.add_argument("--threads", type=int, default=1, help="ExecuTorch threads per runner.")
    parser.add_argument("--seed", type=int, default=0, help="LoRA init, data order, random-weight models.")
    parser.add_argument("--grad-dtype", default="bf16", choices=("bf16", "f32"), help="GRAD frames on the wire.")
    parser.add_argument("--frozen-dtype", default="bf16", choices=FROZEN_DTYPES,
                        help="How the programs hold the frozen weights (zl train --frozen-dtype).")
    parser.add_argument("--recompute", action="store_true", help="Recompute each layer in the backward (zl train "
                        "--recompute): less memory, a slower step.")
    parser.add_argument("--cpu-quota", type=float, default=None,
                        help="CPUs per local device (zl train --cpu-quota), e.g. 0.5 for 3 devices on 2 cores: "
                             "leave the host some CPU, or stages busy at once slow each other (docs/benchmarks.md).")
    parser.add_argument("--out", type=Path, default=None, help="Working directory (default: a temporary one).")
    parser.add_argument("--timeout", type=float, default=3600.0, help="Seconds per run.")
    parser.add_argument("--json", type=Path, default=None, help="Also write the figures here.")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser)
    parser.add_argument("--stages", default=None, help="Layer ranges per stage, e.g. 0-9,10-19,20-29.")
    parser.add_argument("--num-stages", type=int, default=3, help="Balanced split (without --stages).")
    parser.add_argument("--schedules", default=",".join(DEFAULT_SCHEDULES),
                        help=f"From {','.join(SCHEDULES)} (-keep: --keep-activations).")
    parser.add_argument("--profiles", default=",".join(PROFILES), help="Link profiles: local, wifi, mobile, "
                                                                        "constrained (the runner's emulation).")
    parser.add_argument("--rounds", type=int, default=1,
                        help="Run every schedule this many times, round by round (each round every profile and "
                             "schedule in turn), and report each round's ratios and their median: a shared host's "
                             "speed drifts within a sitting, and neighbouring runs compare best.")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.schedules.split(",") if n.strip()]
    profiles = [p.strip() for p in args.profiles.split(",") if p.strip()]
    if not names or any(n not in SCHEDULES for n in names):
        parser.error(f"--schedules {args.schedules}: choose from {','.join(SCHEDULES)}")
    args.ranks = len(args.stages.split(",")) if args.stages else args.num_stages
    out = args.out or Path(tempfile.mkdtemp(prefix="zl-bench-schedules-"))
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1")
    results = []
    for n in range(args.rounds):  # one sitting: every schedule on one profile, then the next; then again
        for profile in profiles:
            for name in names:
                print(f"{name} on {profile} links (round {n + 1} of {args.rounds}) ...", file=sys.stderr, flush=True)
                suffix = "" if args.rounds == 1 else f"-{n + 1}"
                r = run_one(args, name, profile, out / f"{profile}-{name}{suffix}")
                results.append(r if args.rounds == 1 else {**r, "round": n})
    print(table(results))
    for line in ratios(results):
        print(line)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                        indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
