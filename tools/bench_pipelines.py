"""ZeroLock (torch runtime and ExecuTorch runner) vs GPipe, 1F1B and PipeDream on the same local ranks (E1).

Prepares one run as `zl train --runtime torch --launcher torchrun` does (data,
manifest, RUN_DIR/torch_job.json), then runs its ranks once per pipeline —
`zerolock` (local losses, no backward across stages), `gpipe`, `1f1b` and
`async` (end-to-end backprop; every schedule of the schedule table,
zl_device/formats/schedules.py SCHEDULES) — with the same split, LoRA, data order, micro-batches
of the full --seq-len, windows and optimizer, one process per stage
(torch.multiprocessing spawn, gloo); and `zerolock-et`, the same job as `zl train` runs it by default: the
exported stage programs on `zl_runner`s, one per stage on this host. Every
pipeline writes a checkpoint per window; from each stage's telemetry and the
merged adapter:

- records/s: samples / (first stage ready after set-up -> last stage done);
- peak RSS per rank during training (MiB): torch ranks reset the kernel's peak count (VmHWM) once their stage is
  built, so the whole model they load first (and free) is not in it; a runner loads only its program, so its
  process peak (VmHWM) is its training peak. Also the torch ranks' process peak, model load included;
- busy share per rank: process CPU time / wall time over training (one thread per rank, so the rest is waiting
  for a neighbour, or for a CPU when ranks outnumber cores: read it on a host with a core per rank);
- dev accuracy and NLL of each pipeline's merged adapter on the same dev rows (and of the base model);
- PipeDream only: most micro-batches in flight per rank and most weight versions stashed at once per rank.

Ranks on one host are not devices: a rank waiting in a bubble gives its core to the others, and loopback is
not a phone's Wi-Fi. `--cpus-per-rank C` caps every rank at C CPUs in a control group of its own (busy share is
then of that quota), and `--link-mbit B` makes all traffic between the ranks share one B Mbit/s link
(zl_study/emulated_devices.py; both need root and change the host only while a pipeline runs).

It prints a table, writes the figures (--json) and a plot of throughput and memory per pipeline
(OUT/pipelines.png, or --plot).

    nice -n 10 .venv/bin/python tools/bench_pipelines.py --model tiny-random --samples 64 --window 8 --seq-len 64
    .venv/bin/python tools/bench_pipelines.py --model smollm2-135m --samples 32 --window 8 --seq-len 128 --json e1.json
    sudo .venv/bin/python tools/bench_pipelines.py --model smollm2-135m --samples 64 --window 4 --seq-len 128 \\
        --cpus-per-rank 0.66 --link-mbit 50 --no-eval   # 3 devices of 2/3 of a core on one 50 Mbit/s link
    .venv/bin/python tools/bench_pipelines.py --model tinyllama-random --stages 0-6,7-13,14-21 --samples 8 \\
        --window 4 --seq-len 128 --pipelines zerolock,async --no-eval   # memory
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from zl_device.formats.schedules import SCHEDULES  # noqa: E402

RUNNER = "zerolock-et"  # the ExecuTorch runner: `zl train`'s default runtime
TRIMMED = "zerolock-trimmed"  # `zl train --runtime torch` as it runs by default: micro-batches cut to their longest row
BASELINES = tuple(name for name in SCHEDULES if name != "zerolock")  # the schedules ZeroLock is measured against
PIPELINES = ("zerolock", RUNNER, *BASELINES)  # the default set: every schedule of the table, and the runner
CHOICES = (*PIPELINES, TRIMMED)


def settings(args, out: Path, runtime: str):
    """The `zl train` settings every pipeline shares (one job: split, data, LoRA, windows, optimizer, seed)."""
    from zl_device.run.train_settings import TrainSettings
    from zl_export.data_settings import DataSettings
    from zl_export.options import ExportOptions, ModelSplit

    return TrainSettings(split=ModelSplit(args.model, args.stages, args.num_stages), data=args.data,
                         eval_data=args.eval_data,
                         rows=DataSettings(format=args.format, truncate=args.truncate, seq_len=args.seq_len),
                         samples=args.samples, window=args.window, out=out,
                         export=ExportOptions(micro_batch=args.micro_batch, frozen_dtype=args.frozen_dtype),
                         runtime=runtime, launcher="torchrun" if runtime == "torch" else "spawn", threads=args.threads, seed=args.seed,
                         devices=f"local:{args.ranks}", eval_limit=args.eval_limit, timeout_s=args.timeout,
                         stage_lr=(1.0,),  # every stage trains, as every layer does under the backprop schedules
                         schedule="zerolock")  # the runner's arm is ZeroLock's (zl train's default on generative rows is async)


def prepare(args, out: Path) -> Path:
    """The run directory of the benchmark's job (data, manifest, torch_job.json), via `zl train`'s torch path."""
    from zl_device.run.train_job import run_training

    return run_training(settings(args, out / "prepared", "torch"), say=lambda line: None).run_dir


def last_attempt_lines(run_dir: Path, world: int) -> list[list[dict]]:
    """Each stage's telemetry lines of its last attempt (from its last `start` line)."""
    from zl_device.formats.metrics_log import stage_lines
    from zl_device.formats.run_layout import RunLayout

    return [rank[max(i for i, r in enumerate(rank) if r["type"] == "start"):]
            for rank in stage_lines(RunLayout(run_dir), world)]


def figures(pipeline: str, lines: list[list[dict]], samples: int, begin_key: str) -> dict:
    """A pipeline's figures from its stages' telemetry; the span starts at the earliest `begin_key` of the `start`
    lines (the torch ranks' start follows their set-up barrier; the runner's ready_unix_ms its program load)."""
    start = min(r[begin_key] for rank in lines for r in rank if r["type"] == "start")
    done = [next(r for r in rank if r["type"] == "done") for rank in lines]
    wall_s = (max(d["t_unix_ms"] for d in done) - start) / 1e3
    windows = [r for r in lines[-1] if r["type"] == "window"]
    return {"pipeline": pipeline, "samples": samples, "wall_s": wall_s, "records_per_s": samples / wall_s,
            "train_peak_rss_mib": [d.get("train_peak_rss_mib", d.get("peak_rss_mib")) for d in done],
            "peak_rss_mib": [d["peak_rss_mib"] for d in done], "busy_share": [d["busy_share"] for d in done],
            "last_stage_first_loss": windows[0]["mean_loss"], "last_stage_last_loss": windows[-1]["mean_loss"],
            "in_flight_max": [d.get("in_flight_max") for d in done],
            "stash_versions_max": [d.get("stash_versions_max") for d in done]}


@contextlib.contextmanager
def emulated(args, pipeline: str):
    """The devices a pipeline runs on: a CPU quota per rank and the shared link, where asked for (a no-op
    otherwise); checks on exit that every rank had its quota."""
    from zl_study.emulated_devices import CpuQuota, ShapedLoopback

    with contextlib.ExitStack() as stack:
        if args.link_mbit:
            stack.enter_context(ShapedLoopback(args.link_mbit))
        quota = stack.enter_context(CpuQuota(args.cpus_per_rank)) if args.cpus_per_rank else None
        yield
        if quota is not None and quota.placed < args.ranks:
            raise SystemExit(f"{pipeline}: only {quota.placed} of {args.ranks} ranks were put under "
                             f"--cpus-per-rank; its figures are not those of separate devices.")


def run_torch(prepared: Path, pipeline: str, out: Path, timeout_s: float) -> dict:
    """Run the prepared job's ranks as `pipeline` and merge their last window into OUT/adapter; its figures."""
    from zl_device.formats.run_layout import RunLayout
    from zl_device.results.adapter import merge_checkpoints
    from zl_device.torch.job import TorchJob
    from zl_device.torch.launcher import launch_ranks

    given, ran = RunLayout(prepared), RunLayout(out)
    job = TorchJob.load(given.torch_job)
    job.pipeline = "zerolock" if pipeline == TRIMMED else pipeline
    # Every pipeline computes the full seq_len, as the runner's programs and the baselines' fixed-shape stages do;
    # only zerolock-trimmed cuts its micro-batches to their longest row (--runtime torch's default).
    job.trim_padding = pipeline == TRIMMED
    job.metrics_dir, job.checkpoint_dir = str(ran.stages), str(ran.checkpoints)
    out.mkdir(parents=True)
    path = ran.torch_job
    job.save(path)
    world = job.num_stages
    launch_ranks(path, world, timeout_s, max_restarts=0)  # a benchmark that fails fails
    merge_checkpoints(ran.checkpoints, given.manifest, ran.adapter)
    result = figures(pipeline, last_attempt_lines(out, world), job.num_micro_batches * job.micro_batch,
                     "t_unix_ms")
    result["adapter"] = str(ran.adapter)
    return result


def run_runner(args, out: Path) -> dict:
    """The same job through `zl train` on the ExecuTorch runner (local devices, one runner per stage); its figures,
    adapter and the run's own eval (the same dev rows and scoring as `score`'s)."""
    from zl_device.formats.run_layout import RunLayout
    from zl_device.run.train_job import run_training

    s = settings(args, out, "executorch")
    if args.no_eval:
        s.eval_limit = 1  # `zl train` scores the dev rows it has; one row costs least
    result = run_training(s, say=lambda line: print(f"  {line}", file=sys.stderr, flush=True))
    lines = last_attempt_lines(result.run_dir, args.ranks)
    figs = figures(RUNNER, lines, result.samples, "ready_unix_ms")
    figs["adapter"] = str(RunLayout(result.run_dir).adapter)
    if result.eval and not args.no_eval:
        figs["accuracy"], figs["nll"] = result.eval["adapter"]["accuracy"], result.eval["adapter"]["nll"]
    return figs


def score(args, prepared: Path, results: list[dict]) -> dict | None:
    """Accuracy and NLL of the base model and of each result's adapter on the prepared dev rows (in place, as
    `accuracy` and `nll`); returns the base model's, or None without dev rows."""
    from zl_device.formats.run_layout import RunLayout
    from zl_device.results.adapter import load_adapter
    from zl_device.results.evaluate import evaluate, limit_rows
    from zl_export.model_source import load_model
    from zl_export.shard import load_shard

    dev = RunLayout(prepared).dev_shard
    if not dev.is_file():
        print("eval: no dev rows (pass --eval-data, or use the demo task); accuracy not measured", file=sys.stderr)
        return None
    shard = limit_rows(load_shard(dev), args.eval_limit)
    model = load_model(args.model, seed=args.seed).model
    base = evaluate(model, shard)
    for r in results:
        if "accuracy" in r:  # scored by its own run (the runner's), on the same rows
            continue
        adapted = load_adapter(model, r["adapter"])
        scored = evaluate(adapted, shard)
        r["accuracy"], r["nll"] = scored.accuracy, scored.nll
        model = adapted.unload()  # the base model again, for the next adapter
    print(f"eval: {shard.rows} dev rows", file=sys.stderr)
    return {"rows": shard.rows, "accuracy": base.accuracy, "nll": base.nll}


def table(results: list[dict], base: dict | None) -> str:
    def per_rank(values, fmt):  # None: not measured (no /proc VmHWM on this host)
        return " / ".join("-" if v is None else fmt(v) for v in values)

    rows = ["| pipeline | records/s | wall (s) | peak RSS in training per rank (MiB) | process peak RSS per rank "
            "(MiB) | busy share per rank | dev accuracy | dev NLL | last stage loss, first -> last window | "
            "in flight / stashed versions per rank |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        stash = " / ".join(f"{a}/{b}" for a, b in zip(r["in_flight_max"], r["stash_versions_max"]) if a is not None)
        acc = f"{r['accuracy']:.1%}" if r.get("accuracy") is not None else "-"
        nll = f"{r['nll']:.3f}" if r.get("nll") is not None else "-"
        rows.append(f"| {r['pipeline']} | {r['records_per_s']:.2f} | {r['wall_s']:.1f} | "
                    f"{per_rank(r['train_peak_rss_mib'], lambda m: f'{m:.0f}')} | "
                    f"{per_rank(r['peak_rss_mib'], lambda m: f'{m:.0f}')} | "
                    f"{per_rank(r['busy_share'], lambda b: f'{b:.0%}')} | {acc} | {nll} | "
                    f"{r['last_stage_first_loss']:.3f} -> {r['last_stage_last_loss']:.3f} | {stash or '-'} |")
    if base is not None:
        acc = f"{base['accuracy']:.1%}" if base["accuracy"] is not None else "-"
        rows.append(f"| base model (no training) | | | | | | {acc} | {base['nll']:.3f} | | |")
    return "\n".join(rows)


def ratios(results: list[dict]) -> list[str]:
    """ZeroLock's (torch runtime) records/s and peak training RSS against each backprop pipeline's."""
    from zl_study.study_tables import ratio_line

    by = {r["pipeline"]: r for r in results}
    zl = by.get("zerolock")
    lines = []
    for other in (*BASELINES, RUNNER):
        if zl is None or other not in by:
            continue
        lines.append(ratio_line(f"zerolock vs {other}", zl, by[other], "records_per_s", "train_peak_rss_mib",
                                "peak RSS in training per rank"))
    return lines


def plot(results: list[dict], path: Path) -> Path:
    """Records/s per pipeline and peak training RSS per rank, side by side (matplotlib's Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    speed, memory = fig.subplots(1, 2)
    names = [r["pipeline"] for r in results]
    speed.bar(names, [r["records_per_s"] for r in results], color="tab:blue")
    speed.set_ylabel("records/s")
    speed.set_title("throughput")
    ranks = len(results[0]["train_peak_rss_mib"])
    width = 0.8 / ranks
    for k in range(ranks):
        memory.bar([i + (k - (ranks - 1) / 2) * width for i in range(len(results))],
                   [r["train_peak_rss_mib"][k] or 0 for r in results], width, label=f"stage {k}")  # 0: unmeasured
    memory.set_xticks(range(len(results)), names)
    memory.set_ylabel("MiB")
    memory.set_title("peak RSS in training, per stage")
    memory.legend()
    for ax in (speed, memory):
        ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-random", help="--model of zl train (e.g. tiny-random, smollm2-135m).")
    parser.add_argument("--stages", default=None, help="Layer ranges per stage, e.g. 0-1,2-2,3-3.")
    parser.add_argument("--num-stages", type=int, default=3, help="Balanced split (without --stages); ranks = stages.")
    parser.add_argument("--data", default="demo", help="demo, a .csv/.jsonl file or a shard, as zl train --data.")
    parser.add_argument("--eval-data", default=None, help="Dev rows for the accuracy (the demo task brings its own).")
    parser.add_argument("--format", default="auto", help="Format of a .csv/.jsonl --data, as zl train --format.")
    parser.add_argument("--truncate", action="store_true", help="Cut over-long prompts from the left (zl train "
                        "--truncate), e.g. the demo task under a byte tokenizer (tinyllama-random) at --seq-len 128.")
    parser.add_argument("--samples", type=int, default=64, help="Training samples.")
    parser.add_argument("--frozen-dtype", default="fp32", choices=("fp32", "bf16", "int8", "int4"),
                        help="Frozen weights of every pipeline (zl train --frozen-dtype; default fp32, the same "
                             "weights as the backprop baselines' usual setting).")
    parser.add_argument("--window", type=int, default=8, help="Micro-batches per AdamW step (the pipelines' m).")
    parser.add_argument("--micro-batch", type=int, default=1, help="Rows per micro-batch.")
    parser.add_argument("--seq-len", type=int, default=64, help="Tokens per sample.")
    parser.add_argument("--threads", type=int, default=1, help="Threads per rank (torch) or runner.")
    parser.add_argument("--seed", type=int, default=0, help="LoRA init, data order, random-weight models.")
    parser.add_argument("--pipelines", default=",".join(PIPELINES),
                        help=f"Which to run, comma-separated, from {','.join(CHOICES)}; {TRIMMED} is ZeroLock on "
                             "torch with its micro-batches cut to their longest row, as `zl train --runtime torch` "
                             "runs (the others all compute the full --seq-len).")
    parser.add_argument("--cpus-per-rank", type=float, default=None,
                        help="Cap each rank at this many CPUs (a cgroup each; root), so a rank's idle time is not "
                             "another's, as on separate devices; e.g. 0.66 for 3 ranks on 2 cores.")
    parser.add_argument("--link-mbit", type=float, default=None,
                        help="All traffic between the ranks shares one link of this many Mbit/s (tc tbf on "
                             "loopback while a pipeline runs; root), like phones on one Wi-Fi access point.")
    parser.add_argument("--eval-limit", type=int, default=200, help="Dev rows scored per pipeline.")
    parser.add_argument("--no-eval", action="store_true", help="Skip the accuracy (memory or speed runs).")
    parser.add_argument("--out", type=Path, default=None, help="Working directory (default: a temporary one).")
    parser.add_argument("--timeout", type=float, default=3600.0, help="Seconds per pipeline run.")
    parser.add_argument("--json", type=Path, default=None, help="Also write the figures here.")
    parser.add_argument("--plot", type=Path, default=None, help="The plot's path (default OUT/pipelines.png).")
    args = parser.parse_args(argv)
    chosen = [p.strip() for p in args.pipelines.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in CHOICES]
    if unknown or not chosen:
        parser.error(f"--pipelines {args.pipelines}: choose from {','.join(CHOICES)}")
    for flag, value in (("--cpus-per-rank", args.cpus_per_rank), ("--link-mbit", args.link_mbit)):
        if value is not None and not value > 0:
            parser.error(f"{flag} {value:g}: give a positive number (or leave it out: no emulation)")
    args.ranks = len(args.stages.split(",")) if args.stages else args.num_stages
    if args.link_mbit:  # a kill (SIGTERM) unwinds too, so the loopback's shaping is removed
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    out = args.out or Path(tempfile.mkdtemp(prefix="zl-bench-pipelines-"))
    prepared = prepare(args, out)
    results = []
    for pipeline in chosen:
        print(f"{pipeline}: {args.ranks} ranks ...", file=sys.stderr, flush=True)
        with emulated(args, pipeline):
            if pipeline == RUNNER:
                results.append(run_runner(args, out / pipeline))
            else:
                results.append(run_torch(prepared, pipeline, out / pipeline, args.timeout))
        if args.cpus_per_rank:  # CPU time over wall time, as a share of what the rank may use
            results[-1]["busy_share"] = [b / args.cpus_per_rank for b in results[-1]["busy_share"]]
    base = None if args.no_eval else score(args, prepared, results)
    print(table(results, base))
    for line in ratios(results):
        print(line)
    figure = plot(results, args.plot or out / "pipelines.png")
    print(f"plot: {figure}", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results,
                                         "base": base}, indent=2) + "\n")
    return results


if __name__ == "__main__":
    from zl_base.errors import ZLError

    try:
        main()
    except ZLError as e:  # bad input or a failed run: the message names it and the fix
        sys.exit(f"bench_pipelines: {e}")
