"""E2, the paper's way: recovery latency of local vs global recovery on the ExecuTorch runner.

Fails stage 1 (SIGKILL, `--inject-failure 1@W`) once per run in each window W
of `--fail-windows` (default W4-W7 of the 12 windows of 96 samples, micro-batch
1, window 8) and runs every arm for each W, interleaved (W4: every arm, then
W5: every arm, ...), so a host busy with other jobs slows all arms alike:

    local+standby   --recovery local  --standby   (the failed stage's hot standby takes over)
    global+standby  --recovery global --standby   (every stage's standby takes over after the rollback)
    local           --recovery local              (a new process maps its program and loads its method)
    global          --recovery global
    local-no-snapshots  --recovery local --no-accumulator-snapshots  (the window replayed from the checkpoint)

Local recovery continues the failed stage's window from its accumulator
snapshot (docs/design#recovery-in-detail); global recovery removes the snapshots and
replays every stage from the common checkpoint.

plus, first in every round, one failure-free run: the reference of that
round's arms for the adapters (bit for bit), the wall time and the
failure-free span below. Per run it reads RUN_DIR/metrics.jsonl:

- latency: the coordinator's `recovered.since_failure_ms`, from the SIGKILL to the
  commit of the window that was in flight (W) by the stage downstream of the
  failed one (stage 2), as the coordinator sees it (WINDOW_COMMITTED frame);
- its breakdown, from the coordinator's events and the failed stage's new
  `start` line (every clock is this host's): kill -> restart issued (detection:
  the runner's exit seen by the 50 ms loop, then the checkpoint look-up);
  restart -> process running its setup (cold: exec, dynamic loading; standby:
  the SIGUSR1); program load (cold only: map the program, load the method,
  plan memory); restore + links (checkpoint, input log, listen, connect) up to
  the start line; replay: until the failed stage's last replayed micro-batch
  (the one it was killed in) is done again; rest of the window at the failed
  stage up to its commit of W; downstream: from that commit to stage 2's;
- failure-free: the same span in the failure-free run (from the failed
  stage's send of the micro-batch it is killed after, i.e. its line's time
  minus its phase 2, to stage 2's window line), the work the window still
  needed anyway; lost = latency (to stage 2's window line) - failure-free,
  what the failure cost (on a host where the stages share cores it can be
  negative: with the failed stage down its neighbours stop and leave it the
  CPU);
- caught up: the first five phases, from the SIGKILL until the failed stage
  has redone the micro-batch it was killed in, i.e. is back where it was:
  what recovery itself costs, without the window's work still to come;
- micro-batches and bytes replayed (the coordinator's `restart` event), the
  run's wall time lost against the failure-free run (noisy: the whole run),
  and whether the adapter equals the failure-free one.

    .venv/bin/python tools/bench_recovery.py --data /work/shared/data/agnews/train.csv --format agnews \\
        --seq-len 32 --out /tmp/e2 --json /tmp/e2/e2.json

The first run exports the model into the export cache (minutes); later runs reuse it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
from checkout_zl import checkout_zl  # noqa: E402
ARMS = {
    "local+standby": ["--recovery", "local", "--standby"],
    "global+standby": ["--recovery", "global", "--standby"],
    "local": ["--recovery", "local"],
    "global": ["--recovery", "global"],
    "local-no-snapshots": ["--recovery", "local", "--no-accumulator-snapshots"],
}
PHASES = ("to_restart_ms", "process_ms", "program_load_ms", "restore_links_ms", "replay_ms", "rest_of_window_ms",
          "downstream_ms")


def zl_train(args, out: Path, extra: list[str]) -> float:
    """One `zl train` run into `out`; returns its wall time in seconds (of the whole command)."""
    cmd, env = checkout_zl(["train", "--model", args.model, "--stages", args.stages,
           "--data", args.data, "--samples", str(args.samples), "--window", str(args.window),
           "--micro-batch", str(args.micro_batch), "--threads", str(args.threads), "--out", str(out),
           "--stage-lr", "1"])  # every stage trains, so the failed stage 1 has a training state to recover
    if args.format:
        cmd += ["--format", args.format]
    if args.seq_len:
        cmd += ["--seq-len", str(args.seq_len), "--truncate"]
    cmd += extra
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return time.monotonic() - start


def read_events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def run_wall_s(events: list[dict]) -> float:
    run = next(e for e in events if e["type"] == "run")
    return (run["end_unix_ms"] - run["start_unix_ms"]) / 1000.0


def breakdown(events: list[dict], failed: int, window: int, downstream: int) -> dict:
    """The recovery of the one failure in `events`, in phases (see the module docstring)."""
    failure = next(e for e in events if e["type"] == "failure")
    restart = next(e for e in events if e["type"] == "restart")
    recovered = next(e for e in events if e["type"] == "recovered")
    restart_ms = restart["t_unix_ms"]
    # The failed stage's runs: its `start` lines; the last one began after the restart.
    starts = [e for e in events if e["type"] == "start" and e["stage"] == failed]
    start = starts[-1]
    since_failure = recovered["since_failure_ms"]
    to_restart = since_failure - recovered["recovery_ms"]
    setup_at = start["took_over_unix_ms"] if start.get("standby") else start["setup_start_unix_ms"]
    loaded_at = max(start["program_loaded_unix_ms"], setup_at)
    held = failure["micro_batch"]  # micro-batches done by the failed stage: its last replayed one is this - 1 ...
    # ... or, when it was killed while computing micro-batch `held`, that one; take the last done before the kill.
    replayed_lines = [e for e in events if e["type"] == "micro_batch" and e["stage"] == failed
                      and e["t_unix_ms"] >= start["ready_unix_ms"] and e["window"] == window]
    last_replayed = [e for e in replayed_lines if e["micro_batch"] <= max(held, start["first_micro_batch"])]
    replay_end = max((e["t_unix_ms"] for e in last_replayed), default=start["ready_unix_ms"])
    commit = next(e["t_unix_ms"] for e in events if e["type"] == "window" and e["stage"] == failed
                  and e["window"] == window and e["t_unix_ms"] >= start["ready_unix_ms"])
    downstream_commit = restart_ms + recovered["recovery_ms"]
    kill_ms = restart_ms - to_restart
    # The downstream commit by its own window line, as failure_free_ms measures it in the clean run.
    downstream_line = next(e["t_unix_ms"] for e in events if e["type"] == "window" and e["stage"] == downstream
                           and e["window"] == window and e["t_unix_ms"] >= kill_ms)
    phases = {
        "to_restart_ms": to_restart,
        "process_ms": setup_at - restart_ms,
        "program_load_ms": loaded_at - setup_at,
        "restore_links_ms": start["ready_unix_ms"] - loaded_at,
        "replay_ms": replay_end - start["ready_unix_ms"],
        "rest_of_window_ms": commit - replay_end,
        "downstream_ms": downstream_commit - commit if failed != downstream else 0.0,
    }
    return {
        "since_failure_ms": since_failure,
        # Back where it was: the failed stage has redone the micro-batch it was killed in.
        "caught_up_ms": sum(phases[k] for k in PHASES[:5]),
        "to_downstream_line_ms": downstream_line - kill_ms,
        "recovery_ms": recovered["recovery_ms"],
        "phases": phases,
        "standby": restart.get("standby"),
        "replayed_micro_batches": restart["replayed_micro_batches"],
        "replay_bytes": restart["replay_bytes"],
        "cold_program_load_ms": start["program_load_ms"],
        "micro_batch_total_ms": statistics.median(e["total_ms"] for e in events if e["type"] == "micro_batch"
                                                  and e["stage"] == failed),
    }


def failure_free_ms(clean: list[dict], failed: int, window: int, held: int, downstream: int) -> float:
    """In the failure-free run: from the moment the failed stage would have been killed (micro-batch `held`
    sent downstream, before its phase 2: its line's time minus its phase 2) to the downstream stage's commit of
    `window` (its window line). What a recovery latency would be if recovery cost nothing."""
    line = next(e for e in clean if e["type"] == "micro_batch" and e["stage"] == failed and e["micro_batch"] == held)
    commit = next(e for e in clean if e["type"] == "window" and e["stage"] == downstream and e["window"] == window)
    return commit["t_unix_ms"] - (line["t_unix_ms"] - line["phase2_ms"])


def adapters_equal(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file
    import torch

    x, y = load_file(str(a / "adapter" / "adapter_model.safetensors")), load_file(str(b / "adapter" / "adapter_model.safetensors"))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def summarize(settings: dict, results: list[dict]) -> dict:
    """Prints the E2 table (medians per arm) of `results`; returns it by arm."""
    from types import SimpleNamespace

    a = SimpleNamespace(**{k.replace("-", "_"): v for k, v in settings.items()})
    arms = list(dict.fromkeys(r["arm"] for r in results))
    for r in results:  # results of a version of this script without the column
        r.setdefault("caught_up_ms", sum(r["phases"][k] for k in PHASES[:5]))
    downstream = min(a.stage + 1, len(a.stages.split(",")) - 1)
    print("\nE2: fail stage %d in windows %s of %d (%d samples, micro-batch %d, window %d), %s stages %s, "
          "seq_len %s" % (a.stage, a.fail_windows, -(-a.samples // (a.micro_batch * a.window)),
                          a.samples, a.micro_batch, a.window, a.model, a.stages, a.seq_len or "default"))
    print("medians over the failure windows; ms; latency = SIGKILL -> stage %d commits the window in flight\n"
          % downstream)
    header = ["arm", "latency", "failure-free", "lost", "caught up", "restart", "process", "load", "restore+links", "replay",
              "rest of W", "downstream", "replayed mb", "replay bytes", "run wall lost s", "identical"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    summary = {}
    for arm in arms:
        rs = [r for r in results if r["arm"] == arm]
        med = {k: statistics.median(r["phases"][k] for r in rs) for k in PHASES}
        summary[arm] = {"latency_ms": statistics.median(r["since_failure_ms"] for r in rs),
                        "failure_free_ms": statistics.median(r["failure_free_ms"] for r in rs),
                        "lost_ms": statistics.median(r["lost_ms"] for r in rs),
                        "caught_up_ms": statistics.median(r["caught_up_ms"] for r in rs), **med,
                        "replayed_micro_batches": statistics.median(r["replayed_micro_batches"] for r in rs),
                        "replay_bytes": statistics.median(r["replay_bytes"] for r in rs),
                        "lost_s": statistics.median(r["lost_s"] for r in rs),
                        "identical": all(r["identical"] for r in rs)}
        s = summary[arm]
        print(f"| {arm} | {s['latency_ms']:.0f} | {s['failure_free_ms']:.0f} | {s['lost_ms']:.0f} | "
              f"{s['caught_up_ms']:.0f} | " + " | ".join(f"{med[k]:.0f}" for k in PHASES)
              + f" | {s['replayed_micro_batches']:.0f} | {s['replay_bytes']:,.0f} | {s['lost_s']:.2f} | "
              + ("yes" if s["identical"] else "NO") + " |")
    for x, y in (("local+standby", "global+standby"), ("local", "global"), ("local+standby", "global"),
                 ("local-no-snapshots", "global")):
        if x in summary and y in summary:
            print(f"\n{x} / {y}: latency {summary[x]['latency_ms'] / summary[y]['latency_ms']:.2f}x, "
                  f"lost {summary[x]['lost_ms'] / summary[y]['lost_ms']:.2f}x, "
                  f"caught up {summary[x]['caught_up_ms'] / summary[y]['caught_up_ms']:.2f}x", end="")
    print()
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--stages", default="0-9,10-19,20-29")
    p.add_argument("--data", help="training data (.csv/.jsonl or a shard), e.g. AG News train.csv")
    p.add_argument("--format", default=None, help="its format for zl train, e.g. agnews")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (prompts cut from the left)")
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--stage", type=int, default=1, help="the stage that fails")
    p.add_argument("--fail-windows", default="4,5,6,7")
    p.add_argument("--arms", default="local+standby,global+standby,local,global",
                   help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--repeats", type=int, default=1, help="rounds over the failure windows")
    p.add_argument("--out", type=Path, help="a new folder for the runs")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--summarize", type=Path, default=None, help="only print the table of an earlier --json")
    args = p.parse_args(argv)
    if args.summarize:
        saved = json.loads(args.summarize.read_text())
        summarize(saved["settings"], saved["runs"])
        return 0
    if args.out is None or args.data is None:
        p.error("--data (training data, e.g. AG News train.csv) and --out (a new folder for the runs) are required")
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        p.error(f"--arms {','.join(unknown)}: expected some of {', '.join(ARMS)}")
    windows = [int(w) for w in args.fail_windows.split(",")]
    args.out.mkdir(parents=True, exist_ok=False)
    downstream = args.stage + 1  # the last stage's own commit when it is the one that fails
    num_stages = len(args.stages.split(","))
    downstream = min(downstream, num_stages - 1)

    print(f"load average before: {os.getloadavg()}", flush=True)
    results, clean_walls = [], []
    for n, w in enumerate(w for _ in range(args.repeats) for w in windows):
        # A failure-free run in every round: the reference of that round's arms (a shared host's load drifts).
        clean_dir = args.out / f"clean-{n}"
        zl_train(args, clean_dir, [])
        clean_events = read_events(clean_dir)
        clean_wall = run_wall_s(clean_events)
        clean_walls.append(clean_wall)
        print(f"  W{w} failure-free run: {clean_wall:.2f} s", flush=True)
        for arm in arms:
            run_dir = args.out / f"{arm.replace('+', '-')}-w{w}-{n}"
            zl_train(args, run_dir, ARMS[arm] + ["--inject-failure", f"{args.stage}@{w}"])
            events = read_events(run_dir)
            r = breakdown(events, args.stage, w, downstream)
            r.update(arm=arm, window=w, wall_s=run_wall_s(events), identical=adapters_equal(clean_dir, run_dir),
                     load_average=os.getloadavg()[0])
            r["lost_s"] = r["wall_s"] - clean_wall
            held = w * args.window + max(0, args.window // 2 - 1)  # Injection.hold_micro_batch
            r["failure_free_ms"] = failure_free_ms(clean_events, args.stage, w, held, downstream)
            r["lost_ms"] = r["to_downstream_line_ms"] - r["failure_free_ms"]
            results.append(r)
            print(f"  W{w} {arm:15s} {r['since_failure_ms']:8.0f} ms (failure-free {r['failure_free_ms']:.0f}, "
                  f"lost {r['lost_ms']:.0f})  replayed {r['replayed_micro_batches']:3d} "
                  f"({r['replay_bytes']:,} B)  identical {r['identical']}  "
                  + " ".join(f"{k[:-3]}={v:.0f}" for k, v in r["phases"].items()), flush=True)

    settings = vars(args) | {"out": str(args.out), "json": str(args.json) if args.json else None}
    summary = summarize(settings, results)
    print(f"\n\nload average after: {os.getloadavg()}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"settings": settings, "clean_wall_s": clean_walls, "runs": results,
                                         "summary": summary},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
