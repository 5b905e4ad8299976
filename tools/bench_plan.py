"""Issue 27's evidence: a split planned for unequal devices against the even split, in one sitting.

Runs `zl plan` for the devices (a cached calibration is reused; `--recalibrate` measures again), then
`zl train` twice with the same data, samples and settings: once on the plan's even split, once on the planned
split, and prints per split

    records/s          samples / the run's wall time (report.json), the figure a user sees
    pace (ms/mb)       steady pipeline pace: the median gap between consecutive micro-batches finishing at the
                       last stage, after the first window (pipeline fill, program load and warm-up left out)
    slowest (ms)       the slowest stage's median busy time per micro-batch (phase 1 + phase 2 + send; its wait
                       for the upstream stage left out), and which stage it is
    predicted (ms)     the plan's predicted slowest stage for that split, and its error against `slowest`

and the planned/even ratios of records/s and pace. With `--cpu-quota` each local runner is capped at its
share of a CPU (cgroup v1/v2 where the host allows, else a SIGSTOP duty cycle: zl_device/devices/cpu_quota.py),
so unequal phones can be emulated on one host; quotas that add up to more CPUs than the host has make the
stages share cores, and every figure then says less.

    .venv/bin/python tools/bench_plan.py --devices local:3 --cpu-quota 1.0,0.5,0.75 --seq-len 128 \\
        --samples 128 --out runs/bench_plan

The first run exports the model for each split (minutes); later runs reuse the export cache. Results go to
stdout (and `--json`), progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from checkout_zl import checkout_zl  # noqa: E402
from zl_device.formats.run_layout import RunLayout  # noqa: E402
from zl_device.plan.plan_file import Plan, read_plan  # noqa: E402


def zl(args: list[str]) -> None:
    """This checkout's `zl` (not whatever the venv's script was installed from); exits on failure."""
    cmd, env = checkout_zl(args)
    print(f"$ zl {' '.join(args)}", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, cwd=REPO, env=env, stdout=sys.stderr)
    if done.returncode != 0:
        sys.exit(f"zl {' '.join(args)} failed with exit status {done.returncode}")


def steady_pace_ms(events: list[dict], last_stage: int, skip: int) -> float:
    """Median gap between consecutive micro-batches finishing at the last stage, after the first `skip`."""
    done = sorted(e["t_unix_ms"] for e in events if e["type"] == "micro_batch" and e["stage"] == last_stage)
    gaps = [b - a for a, b in zip(done[skip:], done[skip + 1:])]
    if not gaps:
        sys.exit(f"only {len(done)} micro-batches at the last stage: raise --samples above {skip + 2}")
    return statistics.median(gaps)


def busy_ms(stage: dict) -> float:
    """A stage's median time per micro-batch spent working, from report.json (its wait for input left out)."""
    return sum(stage[k]["median"] for k in ("phase1_ms", "phase2_ms", "send_ms"))


def measure(run_dir: Path, window: int) -> dict:
    layout = RunLayout(run_dir)
    report = json.loads(layout.report_json.read_text())
    events = [json.loads(line) for line in layout.metrics.read_text().splitlines() if line.strip()]
    stages = report["stages"]
    busy = [busy_ms(s) for s in stages]
    slowest = max(range(len(busy)), key=busy.__getitem__)
    return {"records_per_s": report["run"]["records_per_s"], "wall_s": report["run"]["wall_s"],
            "pace_ms": steady_pace_ms(events, len(stages) - 1, window), "busy_ms": busy,
            "slowest_stage": slowest, "slowest_ms": busy[slowest],
            "stages": ",".join(f"{s['layers'][0]}-{s['layers'][1]}" for s in stages)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--devices", default="local:3")
    ap.add_argument("--cpu-quota", default="1.0,0.5,0.75", help="per-device CPU caps (local devices)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--samples", type=int, default=128, help="samples per zl train run (default 128)")
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--data", help="zl train --data (default: the built-in demo task)")
    ap.add_argument("--format", dest="data_format")
    ap.add_argument("--eval-limit", type=int, default=16, help="dev rows each run scores (default 16: the "
                    "runs are timed, not judged)")
    ap.add_argument("--recalibrate", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("runs/bench_plan"))
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()

    # Every stage trains (--stage-lr 1), as in docs/benchmarks.md's figures: the default holds all but the last still.
    common = ["--model", args.model, "--devices", args.devices, "--cpu-quota", args.cpu_quota,
              "--seq-len", str(args.seq_len), "--stage-lr", "1"]
    plan_path = args.out / "plan.json"
    taken = [d for d in ("even", "planned") if (args.out / d).exists()]
    if taken:
        sys.exit(f"--out {args.out}: {', '.join(taken)} exist from an earlier run; pick a new --out (a run never "
                 "overwrites another run's results)")
    start = time.monotonic()
    zl(["plan", *common, "--out", str(plan_path), *(["--recalibrate"] if args.recalibrate else [])])
    plan_s = time.monotonic() - start
    plan: Plan = read_plan(plan_path)
    if plan.even_stages is None:
        sys.exit(f"{plan_path}: the plan has no even split to compare with")

    train = ["train", *common, "--truncate", "--samples", str(args.samples), "--window", str(args.window),
             "--eval-limit", str(args.eval_limit)]
    if args.data:
        train += ["--data", args.data] + (["--format", args.data_format] if args.data_format else [])
    rows = {}
    for name, stages, predicted in (("even", plan.even_stages, plan.even_slowest_ms),
                                    ("planned", str(plan_path), plan.slowest_ms)):
        run_dir = args.out / name
        zl([*train, "--stages", stages, "--out", str(run_dir)])
        rows[name] = {**measure(run_dir, args.window), "predicted_slowest_ms": predicted}

    lines = [f"{args.model}, devices {args.devices}, CPU quotas {args.cpu_quota}, seq {args.seq_len}, "
             f"{args.samples} samples per run; zl plan took {plan_s:.0f} s (its calibration: {plan_path})", "",
             "| split | layers | records/s | pace (ms/mb) | slowest stage busy (ms) | predicted (ms) | error |",
             "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        error = (r["predicted_slowest_ms"] - r["slowest_ms"]) / r["slowest_ms"]
        r["prediction_error"] = error
        lines.append(f"| {name} | {r['stages']} | {r['records_per_s']:.3f} | {r['pace_ms']:.0f} | "
                     f"{r['slowest_ms']:.0f} (stage {r['slowest_stage']}) | {r['predicted_slowest_ms']:.0f} | "
                     f"{error:+.1%} |")
    ratio = rows["planned"]["records_per_s"] / rows["even"]["records_per_s"]
    pace_ratio = rows["even"]["pace_ms"] / rows["planned"]["pace_ms"]
    lines += ["", f"planned / even: records/s {ratio:.2f}x, steady pace {pace_ratio:.2f}x"]
    print("\n".join(lines))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": rows,
                                         "records_per_s_ratio": ratio, "pace_ratio": pace_ratio}, indent=1))


if __name__ == "__main__":
    main()
