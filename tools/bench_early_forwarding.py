"""Early forwarding on vs off: one localhost pipeline of `zl_runner` processes, twice.

Starts one `zl_runner` per stage of an export (last stage first, each on a
free port), runs N micro-batches with early_forwarding on, then again with it
off (hidden state sent only after phase 2), and prints per stage the medians
of phase 1, phase 2, queue (waiting for input), send and total time from the
runners' telemetry, plus each run's wall time, micro-batches per second and
the median pipeline latency of a micro-batch (stage 0 starts it -> the last
stage finishes it), which early forwarding should shorten by about the
phase 2 of every stage but the last.

    .venv/bin/zl export --model tiny-random --num-stages 3 --seq-len 128 --out /tmp/zl3 --no-check
    .venv/bin/zl data --demo --model tiny-random --seq-len 128 --split train --out /tmp/zl3data
    .venv/bin/python tools/bench_early_forwarding.py --export /tmp/zl3 --shard /tmp/zl3data/train.safetensors
    .venv/bin/python tools/bench_early_forwarding.py ... --link-profile mobile --micro-batches 64 --json out.json

With `--app-stage K` the two runs are instead: every stage as `zl_runner`,
then stage K the Android app's way (libzl_jni.so driven from a JVM by
AppStageDriver: startNative, statusNative polling, as RunnerService does),
both with early forwarding on; the ratio line shows what the app's native
path costs against the bare binary:

    .venv/bin/python tools/bench_early_forwarding.py --export /tmp/zl3 --shard /tmp/zl3data/train.safetensors --app-stage 1

The runner binary is build/runner/zl_runner (or --runner / $ZL_RUNNER_BIN); the JNI library and
the JVM classes are built in the same build tree (build/android_app/jni, needs a JDK).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUN_ID = "00112233445566778899aabbccddeeff"
FIELDS = ("phase1_ms", "phase2_ms", "queue_ms", "send_ms", "total_ms")


def app_stage_command(runner: Path) -> list[str]:
    """The JVM command that runs one stage through libzl_jni.so (AppStageDriver), built in the same build tree as
    `runner` (build/runner/zl_runner: build/android_app/jni)."""
    jni = runner.parent.parent / "android_app" / "jni"
    library, classes = jni / "libzl_jni.so", jni / "host_test_classes"
    if not library.is_file() or not (classes / "com" / "zerolock" / "zl" / "AppStageDriver.class").is_file():
        sys.exit(f"{library} or its JVM classes are not built (needs a JDK); run `cmake --build build -j2`")
    return ["java", f"-Dzl.jni.library={library}", "-cp", str(classes), "com.zerolock.zl.AppStageDriver"]


def run_pipeline(runner: Path, export: Path, shard: Path, run_dir: Path, args, early: bool,
                 app_stage: int | None = None) -> dict:
    """One run; returns {"wall_s", "stages": [{field: median}], "loss_last": [...]} from the telemetry.

    `app_stage`: that stage runs through the app's JNI library instead of zl_runner.
    """
    from zl_export.manifest import read_manifest

    num_stages = read_manifest(export).num_stages
    run_dir.mkdir(parents=True)
    (run_dir / "run.key").write_text(os.urandom(32).hex() + "\n")
    procs, port = {}, None
    start = time.monotonic()
    for k in reversed(range(num_stages)):
        cfg = {
            "program": str(export / f"stage_{k}.pte"), "stage_index": k, "num_stages": num_stages,
            "run_key_file": "run.key", "run_id": RUN_ID, "window_size": args.window_size,
            "num_micro_batches": args.micro_batches, "in_flight_depth": args.depth, "checkpoint_dir": f"ckpt{k}",
            "log_path": f"metrics{k}.jsonl", "early_forwarding": early, "link_profile": args.link_profile,
            "threads": args.threads, "input_timeout_s": 120,
        }
        if k == 0:
            cfg["data_shard"] = str(shard)
        else:
            cfg["listen"] = "127.0.0.1:0"
        if port is not None:
            cfg["downstream"] = f"127.0.0.1:{port}"
        (run_dir / f"stage{k}.json").write_text(json.dumps(cfg))
        out = open(run_dir / f"stdout{k}", "w")
        command = app_stage_command(runner) if k == app_stage else [str(runner)]
        procs[k] = subprocess.Popen(command + ["--config", f"stage{k}.json"], cwd=run_dir, stdout=out,
                                    stderr=open(run_dir / f"stderr{k}", "w"))
        if k > 0:
            port = wait_port(run_dir / f"stdout{k}", procs[k])
    for k, proc in procs.items():
        if proc.wait(timeout=600) != 0:
            sys.exit(f"stage {k} failed:\n{(run_dir / f'stderr{k}').read_text()[-2000:]}")
    wall = time.monotonic() - start
    stages, per_stage = [], []
    for k in range(num_stages):
        lines = [json.loads(x) for x in (run_dir / f"metrics{k}.jsonl").read_text().splitlines()]
        per_stage.append({x["micro_batch"]: x for x in lines if x["type"] == "micro_batch"})
        mbs = [x for x in lines if x["type"] == "micro_batch"][args.warmup:]
        stages.append({f: statistics.median(x[f] for x in mbs) for f in FIELDS})
    # Pipeline latency of micro-batch i: from stage 0 starting it (its line's time minus its total) to the
    # last stage finishing it. Telemetry times are whole milliseconds of the wall clock, same host.
    first, last = per_stage[0], per_stage[-1]
    latency = [last[i]["t_unix_ms"] - (first[i]["t_unix_ms"] - first[i]["total_ms"])
               for i in sorted(first)[args.warmup:] if i in last]
    label = ("on" if early else "off") if args.app_stage is None else (f"app@{app_stage}" if app_stage is not None
                                                                       else "binary")
    return {"label": label, "early_forwarding": early, "app_stage": app_stage, "wall_s": wall, "micro_batches_per_s": args.micro_batches / wall,
            "latency_ms": statistics.median(latency), "stages": stages}


def wait_port(path: Path, proc: subprocess.Popen) -> int:
    for _ in range(3000):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event.get("event") == "listening":
                return int(event["port"])
        if proc.poll() is not None:
            sys.exit(f"a stage exited with {proc.returncode} before listening")
        time.sleep(0.01)
    sys.exit("a stage never reported its port")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--export", type=Path, required=True, help="`zl export` output directory")
    parser.add_argument("--shard", type=Path, required=True, help="stage 0's data shard (.safetensors)")
    parser.add_argument("--runner", type=Path, default=Path(os.environ.get(
        "ZL_RUNNER_BIN", REPO / "build" / "runner" / "zl_runner")), help="zl_runner binary")
    parser.add_argument("--micro-batches", type=int, default=64, help="micro-batches per run")
    parser.add_argument("--window-size", type=int, default=8, help="micro-batches per AdamW step")
    parser.add_argument("--depth", type=int, default=4, help="in_flight_depth D")
    parser.add_argument("--link-profile", default="local", help="local, wifi, mobile or constrained")
    parser.add_argument("--threads", type=int, default=1, help="ExecuTorch threads per stage")
    parser.add_argument("--warmup", type=int, default=2, help="first micro-batches left out of the medians")
    parser.add_argument("--app-stage", type=int, help="compare all-zl_runner against this stage run through the "
                        "app's JNI library (instead of early forwarding on vs off)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    runs = [(True, None), (False, None)] if args.app_stage is None else [(True, None), (True, args.app_stage)]
    results = []
    with tempfile.TemporaryDirectory(prefix="zl_bench_ef_") as tmp:
        for i, (early, app_stage) in enumerate(runs):
            results.append(run_pipeline(args.runner.resolve(), args.export.resolve(), args.shard.resolve(),
                                        Path(tmp) / f"run{i}", args, early, app_stage))
    print(f"{args.micro_batches} micro-batches, window {args.window_size}, D={args.depth}, "
          f"link {args.link_profile}, {args.threads} thread(s) per stage; medians in ms")
    column = "early fwd" if args.app_stage is None else "run"
    print(f"{column:>9} {'stage':>5} " + " ".join(f"{f[:-3]:>8}" for f in FIELDS))
    for r in results:
        for k, s in enumerate(r["stages"]):
            print(f"{r['label']:>9} {k:>5} " + " ".join(f"{s[f]:8.2f}" for f in FIELDS))
        print(f"{'':>9} wall {r['wall_s']:.2f} s, {r['micro_batches_per_s']:.1f} micro-batches/s, "
              f"pipeline latency (stage 0 start to last stage end) median {r['latency_ms']:.1f} ms")
    if args.app_stage is not None:
        k = args.app_stage
        base, app = results[0]["stages"][k], results[1]["stages"][k]
        print(f"stage {k} app/binary: " + ", ".join(f"{f[:-3]} {app[f] / base[f]:.3f}" for f in FIELDS
                                                    if base[f] > 0) +
              f"; throughput {results[1]['micro_batches_per_s'] / results[0]['micro_batches_per_s']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
