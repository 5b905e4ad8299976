"""ZeroLock (`--runtime torch`) vs GPipe, 1F1B and PipeDream on the same local ranks: throughput, memory, busy share.

Prepares one run as `zl train --runtime torch --launcher torchrun` does (data,
manifest, RUN_DIR/torch_job.json), then runs its ranks once per pipeline —
`zerolock` (local losses, no backward across stages), `gpipe`, `1f1b` and
`pipedream` (end-to-end backprop, zl_device/run/torch_pipeline.py and
torch_pipedream.py) — with the same split,
LoRA, data order, micro-batches, windows and optimizer, one process per stage
(torch.multiprocessing spawn, gloo). From each rank's `done` telemetry line:

- records/s: samples / (first rank's start after the set-up barrier -> last rank's done);
- peak RSS per rank (MiB, `ru_maxrss`): model, activations kept for backward, buffers;
- busy share per rank: process CPU time / wall time over training (one thread per rank, so the rest is waiting
  for a neighbour, or for a CPU when ranks outnumber cores: read it on a host with a core per rank);
- PipeDream only: most micro-batches in flight per rank (activations held for their backward) and most weight
  versions stashed at once per rank.

    nice -n 10 .venv/bin/python tools/bench_pipelines.py --model tiny-random --samples 64 --window 8 --seq-len 64
    .venv/bin/python tools/bench_pipelines.py --model smollm2-135m --samples 32 --window 8 --json bench.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PIPELINES = ("zerolock", "gpipe", "1f1b", "pipedream")


def prepare(args, out: Path) -> Path:
    """The run directory of the benchmark's job (data, manifest, torch_job.json), via `zl train`'s torch path."""
    from zl_device.run.train_job import run_training
    from zl_device.run.train_settings import TrainSettings
    from zl_export.options import ExportOptions, ModelSplit

    settings = TrainSettings(split=ModelSplit(args.model, args.stages, args.num_stages), data=args.data,
                             samples=args.samples, window=args.window, seq_len=args.seq_len, out=out / "prepared",
                             export=ExportOptions(micro_batch=args.micro_batch, frozen_dtype=args.frozen_dtype), runtime="torch",
                             launcher="torchrun", threads=args.threads, seed=args.seed)
    return run_training(settings, say=lambda line: None).run_dir


def run_one(prepared: Path, pipeline: str, out: Path, timeout_s: float) -> dict:
    """Run the prepared job's ranks as `pipeline`; returns its figures from the ranks' telemetry."""
    from zl_device.run.metrics_log import read_lines
    from zl_device.run.torch_runtime import launch_ranks
    from zl_device.run.torch_stage import JOB_FILE, TorchJob

    job = TorchJob.load(prepared / JOB_FILE)
    job.pipeline = pipeline
    job.metrics_dir, job.checkpoint_dir = str(out / "stages"), str(out / "checkpoints")
    out.mkdir(parents=True)
    path = out / JOB_FILE
    job.save(path)
    world = len(job.lr)
    launch_ranks(path, world, timeout_s)
    lines = [read_lines(out / "stages" / f"stage_{k}" / "metrics.jsonl") for k in range(world)]
    start = min(r["t_unix_ms"] for rank in lines for r in rank if r["type"] == "start")
    done = [next(r for r in rank if r["type"] == "done") for rank in lines]
    wall_s = (max(d["t_unix_ms"] for d in done) - start) / 1e3
    windows = [r for r in lines[-1] if r["type"] == "window"]
    micro_batch = json.loads((prepared / "manifest.json").read_text())["micro_batch"]
    samples = job.num_micro_batches * micro_batch
    return {"pipeline": pipeline, "samples": samples, "wall_s": wall_s, "records_per_s": samples / wall_s,
            "peak_rss_mib": [d["peak_rss_mib"] for d in done], "busy_share": [d["busy_share"] for d in done],
            "last_stage_first_loss": windows[0]["mean_loss"], "last_stage_last_loss": windows[-1]["mean_loss"],
            "in_flight_max": [d.get("in_flight_max") for d in done],
            "stash_versions_max": [d.get("stash_versions_max") for d in done]}


def table(results: list[dict]) -> str:
    rows = ["| pipeline | records/s | wall (s) | peak RSS per rank (MiB) | busy share per rank | last stage loss, "
            "first -> last window | in flight / stashed versions per rank |", "|---|---|---|---|---|---|---|"]
    for r in results:
        stash = " / ".join(f"{a}/{b}" for a, b in zip(r["in_flight_max"], r["stash_versions_max"]) if a is not None)
        rows.append(f"| {r['pipeline']} | {r['records_per_s']:.2f} | {r['wall_s']:.1f} | "
                    f"{' / '.join(f'{m:.0f}' for m in r['peak_rss_mib'])} | "
                    f"{' / '.join(f'{b:.0%}' for b in r['busy_share'])} | "
                    f"{r['last_stage_first_loss']:.3f} -> {r['last_stage_last_loss']:.3f} | {stash or '-'} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-random", help="--model of zl train (e.g. tiny-random, smollm2-135m).")
    parser.add_argument("--stages", default=None, help="Layer ranges per stage, e.g. 0-1,2-2,3-3.")
    parser.add_argument("--num-stages", type=int, default=3, help="Balanced split (without --stages); ranks = stages.")
    parser.add_argument("--data", default="demo", help="demo, a .csv/.jsonl file or a shard, as zl train --data.")
    parser.add_argument("--samples", type=int, default=64, help="Training samples.")
    parser.add_argument("--frozen-dtype", default="fp32", choices=("fp32", "bf16", "int8"),
                        help="Frozen weights of every pipeline (zl train --frozen-dtype; default fp32, the same "
                             "weights as the backprop baselines' usual setting).")
    parser.add_argument("--window", type=int, default=8, help="Micro-batches per AdamW step (the pipelines' m).")
    parser.add_argument("--micro-batch", type=int, default=1, help="Rows per micro-batch.")
    parser.add_argument("--seq-len", type=int, default=64, help="Tokens per sample.")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank.")
    parser.add_argument("--seed", type=int, default=0, help="LoRA init, data order, random-weight models.")
    parser.add_argument("--pipelines", default=",".join(PIPELINES), help="Which to run, comma-separated.")
    parser.add_argument("--out", type=Path, default=None, help="Working directory (default: a temporary one).")
    parser.add_argument("--timeout", type=float, default=3600.0, help="Seconds per pipeline run.")
    parser.add_argument("--json", type=Path, default=None, help="Also write the figures here.")
    args = parser.parse_args(argv)
    chosen = [p.strip() for p in args.pipelines.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in PIPELINES]
    if unknown or not chosen:
        parser.error(f"--pipelines {args.pipelines}: choose from {','.join(PIPELINES)}")
    out = args.out or Path(tempfile.mkdtemp(prefix="zl-bench-pipelines-"))
    prepared = prepare(args, out)
    results = []
    for pipeline in chosen:
        print(f"{pipeline}: {args.num_stages if not args.stages else len(args.stages.split(','))} ranks ...",
              file=sys.stderr, flush=True)
        results.append(run_one(prepared, pipeline, out / pipeline, args.timeout))
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                        indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
