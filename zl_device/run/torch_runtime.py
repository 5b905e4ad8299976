"""`zl train --runtime torch`: the same job as the ExecuTorch runtime, with the stages as torch.distributed ranks.

    data -> manifest (no programs: nothing is exported) -> RUN_DIR/torch_job.json -> one rank per stage
    (zl_device/run/torch_stage.py) -> metrics.jsonl -> merge -> eval -> report

The run directory has what a runner run leaves for `zl merge`, `zl eval` and
`zl report` (docs/design.md §6, §13): manifest.json (stages, parameters,
shapes; `"runtime": "torch"`, no `file` per stage), data/, torch_job.json,
stages/stage_<k>/metrics.jsonl, metrics.jsonl (with the `run` event),
checkpoints/stage_<k>/window_NNNNNN/, adapter/, eval.json, report.*.
"""

from __future__ import annotations

import json
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from zl.errors import ZLError
from zl_device.run.train_settings import MAX_RESTARTS, TrainSettings
from zl_device.run.windows import WindowPlan

RUNTIME = "torch"


def check_torch_settings(s: TrainSettings) -> None:
    """Options of the ExecuTorch runtime that `--runtime torch` does not have fail here, before anything runs."""
    from zl_device.devices.registry import parse_devices

    unsupported = [(s.spares, "--spares"), (s.standby, "--standby"), (s.mode != "binary", "--mode"),
                   (s.recovery == "local", "--recovery local")]
    for value, name in unsupported:
        if value:
            raise ZLError(f"{name} is not supported with --runtime torch (a failed rank restarts every rank from the "
                          "latest window all stages checkpointed, as torch elastic does); drop it or use --runtime "
                          "executorch.")
    if parse_devices(s.devices).kind != "local":
        raise ZLError(f"--devices {s.devices}: --runtime torch runs its stages as processes on this host (or under "
                      "torchrun, docs/design.md §13), not on phones; drop --devices or use --runtime executorch.")


def run_torch_training(s: TrainSettings, say=print, on_update=None):
    """The whole `zl train --runtime torch` job; returns a train_job.TrainResult. `on_update` gets the stages'
    states (coordinator.StageStatus, from the ranks' telemetry) about once a second."""
    from zl_device.run.torch_stage import JOB_FILE
    from zl_device.run.train_job import is_empty_dir, kept_if_resumable, open_run

    check_torch_settings(s)
    start = time.time()
    job = dev = None
    keep_dir = is_empty_dir(s.out)
    if s.resume:
        s.validate()
        run_dir, job, dev = resumed_run(s, say)
    else:
        run_dir, _ = open_run(s, say)
    # --resume needs the job file: a run that fails before it is written leaves nothing behind.
    with kept_if_resumable(run_dir, () if s.resume else (JOB_FILE,), say, keep_dir):
        return _run(s, run_dir, job, dev, start, say, on_update)


def _run(s: TrainSettings, run_dir: Path, job, dev: Path | None, start: float, say, on_update):
    """run_torch_training's steps in RUN_DIR, once it is open (`job` and `dev`: those of the run to resume)."""
    from zl_device.results.adapter import merge_checkpoints
    from zl_device.run.torch_stage import JOB_FILE
    from zl_device.run.train_data import prepare_data, run_max_targets, run_seq_len
    from zl_device.run.train_job import RunModel, TrainResult, finish_run

    if s.resume:
        model = RunModel(job.model, json.loads((run_dir / "manifest.json").read_text())["seed"])
    else:
        model = RunModel(s.split.model, s.seed)
        seq_len = run_seq_len(s, model.tokenizer)
        shard, dev = prepare_data(s, model.tokenizer, seq_len, run_dir / "data", say)
        opts = s.export_options(seq_len, run_max_targets(s, shard, say))
        write_manifest(s, opts, model.loaded(), shard, run_dir)
        job = torch_job(s, run_dir, shard)
    num_stages = len(job.lr)
    windows = WindowPlan(job.num_micro_batches, job.window_size)
    samples = job.num_micro_batches * job.micro_batch
    job_path = run_dir / JOB_FILE
    job.save(job_path)
    if s.launcher == "torchrun":  # the user starts the ranks: the run ends here, prepared
        for line in torchrun_instructions(run_dir, job_path, num_stages, s.max_restarts):
            say(line)
        return TrainResult(run_dir, time.time() - start, 0)
    say(f"run: {num_stages} stages as torch.distributed ranks on this host, {samples} samples, "
        f"{windows.num_micro_batches} micro-batches in {windows.num_windows} windows of {windows.window_size}")
    watch = RankWatch(run_dir / "stages", num_stages)
    launched, _, failures = launch_ranks(
        job_path, num_stages, s.timeout_s, on_poll=(lambda: on_update(watch.poll())) if on_update else None,
        max_restarts=s.max_restarts,
        on_restart=lambda f: say(f"stage {f.stage} {f.reason}: restarting every rank from the latest window all "
                                 "stages checkpointed"))
    # process start-up and model load are not training
    begin_ms, end_ms = training_span(run_dir, num_stages, since_ms=int(launched * 1000))
    event = {"type": "run", "start_unix_ms": begin_ms, "end_unix_ms": end_ms,
             "launch_s": round(begin_ms / 1000 - launched, 3),
             "samples": samples, "run_id": job.run_id,
             "num_stages": num_stages, "window_size": windows.window_size,
             "num_micro_batches": windows.num_micro_batches, "runtime": RUNTIME,
             "recovery": "global", "resumed": s.resume,
             "devices": [f"rank-{k}" for k in range(num_stages)]}
    merge_metrics(run_dir, num_stages, [*recovery_events(run_dir, num_stages, windows, failures), event])
    merged = merge_checkpoints(run_dir / "checkpoints", run_dir / "manifest.json", run_dir / "adapter")
    say(f"merge: {merged.numel:,} LoRA parameters of window {merged.window} -> {run_dir / 'adapter'}")
    return finish_run(s, model, TrainResult(run_dir, time.time() - start, samples), dev, say)


def torchrun_instructions(run_dir: Path, job_path: Path, num_stages: int,
                          max_restarts: int = MAX_RESTARTS) -> list[str]:
    """What to run after `--launcher torchrun`: the ranks under torchrun, then merge and report."""
    return [f"prepared {run_dir}; start its {num_stages} ranks (one per stage) with torchrun:",
            f"  torchrun --standalone --nproc-per-node {num_stages} --max-restarts {max_restarts} "
            f"-m zl_device.run.torch_stage {job_path}",
            "  (after a failure torchrun restarts every rank; they resume from the latest window all stages "
            "checkpointed)",
            "  (on several nodes: --nnodes N --nproc-per-node <stages per node> --rdzv-backend c10d "
            f"--rdzv-endpoint HOST:PORT on each, with {run_dir} on a filesystem all nodes share)",
            "then:",
            f"  zl merge --checkpoints {run_dir / 'checkpoints'} --manifest {run_dir / 'manifest.json'} "
            f"--out {run_dir / 'adapter'}",
            f"  zl report {run_dir}"]


def write_manifest(s: TrainSettings, opts, loaded, shard: Path, run_dir: Path) -> dict:
    """RUN_DIR/manifest.json as an export writes it, less the programs: stages, their parameters (manifest names,
    shapes), LoRA, loss, shapes, seed; `"runtime": "torch"`. The base model keeps no LoRA layers afterwards."""
    from zl_export.exporter import build_stage_modules, input_specs, manifest_names, output_specs
    from zl_export.frozen_weights import restore_frozen_weights
    from zl_export.manifest import build_manifest, write_manifest as write
    from zl_export.pipeline import calibration_rows
    from zl_export.translator import is_translator_name

    opts.validate(loaded.config.max_position_embeddings)
    stages = s.split.ranges(loaded.config.num_hidden_layers)
    lens_rows, lens_source = calibration_rows(opts, loaded, shard)
    peft_model, modules = build_stage_modules(loaded.model, stages, opts, lens_rows)
    try:
        hidden = loaded.config.hidden_size
        entries = []
        for module in modules:
            names = manifest_names(module, peft_model)
            params = [{"name": names[id(p)], "shape": list(p.shape),
                       **({"role": "translator"} if is_translator_name(names[id(p)]) else {})}
                      for p in module.parameters() if p.requires_grad]
            entries.append({"index": module.stage.index, "layers": [module.stage.first, module.stage.last],
                            "inputs": input_specs(module, opts, hidden), "outputs": output_specs(module, opts, hidden),
                            "parameters": params})
    finally:
        restore_frozen_weights(peft_model)  # float32 frozen weights again (--frozen-dtype bf16/int8), for the eval
        peft_model.unload()  # eval loads the adapter onto the base model
    manifest = build_manifest(loaded, opts, entries)
    manifest["runtime"] = RUNTIME
    if lens_source is not None:
        manifest["loss"]["calibration"] = lens_source
    write(manifest, run_dir)
    return manifest


def resumed_run(s: TrainSettings, say):
    """(run_dir, its job set to resume, its dev shard or None) for `--resume --out RUN_DIR`.

    Raises:
        ZLError: RUN_DIR holds no torch job.
    """
    from zl_device.run.torch_stage import JOB_FILE, TorchJob

    run_dir = Path(s.out).expanduser().resolve()
    if not (run_dir / JOB_FILE).is_file():
        raise ZLError(f"--resume --out {run_dir}: no {JOB_FILE} there; pass the directory of a `zl train --runtime "
                      "torch` run (one that failed or was stopped).")
    job = TorchJob.load(run_dir / JOB_FILE)
    job.resume, job.fail_at = True, None  # an injected failure happens once
    dev = run_dir / "data" / "dev.safetensors"
    say(f"resume: {run_dir} from the latest window every stage checkpointed")
    return run_dir, job, (dev if dev.is_file() else None)


def torch_job(s: TrainSettings, run_dir: Path, shard: Path):
    """The ranks' job: the runner configs' optimizer, plan and schedule (launch.stage_configs), for torch."""
    from zl_device.run.coordinator import Injection
    from zl_device.run.torch_stage import TorchJob

    num_stages = len(json.loads((run_dir / "manifest.json").read_text())["stages"])
    windows = s.windows()
    fail_at = None
    if s.inject_failure:
        injection = Injection.parse(s.inject_failure, num_stages, windows.num_windows)
        fail_at = [injection.stage, injection.hold_micro_batch(windows)]
    schedule = {"kind": "warmup_cosine", "warmup_steps": min(s.warmup_windows, max(0, windows.num_windows - 1)),
                "min_lr_ratio": 0.1}
    return TorchJob(model=s.split.model, manifest=str(run_dir / "manifest.json"), shard=str(Path(shard).resolve()),
                    run_id=secrets.token_hex(16), window_size=windows.window_size,
                    num_micro_batches=windows.num_micro_batches,
                    lr=[s.stage_lr_of(k) for k in range(num_stages)], weight_decay=0.0, schedule=schedule,
                    checkpoint_dir=str(run_dir / "checkpoints"), metrics_dir=str(run_dir / "stages"),
                    threads=s.threads, in_flight=s.in_flight, link_timeout_s=s.link_timeout_s,
                    micro_batch=s.export.micro_batch, fail_at=fail_at,
                    # Neighbours commit at most a window apart, so K+1 windows hold one every stage has (resume).
                    keep_last=num_stages + 1)


@dataclass
class RankFailure:
    """A failure of the ranks' attempt: the stage, what happened, when it was seen and when the ranks restarted."""

    stage: int
    reason: str
    t_unix_ms: int
    restart_unix_ms: int | None = None  # None: no restart (the run failed)


def launch_ranks(job_path: Path, world: int, timeout_s: float, on_poll=None, max_restarts: int = MAX_RESTARTS,
                 on_restart=None) -> tuple[float, float, list[RankFailure]]:
    """One process per stage on this host (torch.multiprocessing spawn, rendezvous on a free 127.0.0.1 port);
    returns the (start, end) Unix times of the run and its failures. `on_poll()` is called about once a second,
    `on_restart(failure)` before the ranks start again after one.

    Recovery is torch elastic's (docs/design.md §13): a rank that dies (a signal, an exit, an exception other than
    a `ZLError`) ends the others at once, and all ranks start again, up to `max_restarts` times, resuming from the
    latest window every stage checkpointed (`torch_stage.for_attempt`). A `ZLError` in a rank (a bad job, a
    neighbour past --link-timeout) is not retried; a run past `timeout_s` is stopped.

    Raises:
        ZLError: naming the stage that failed and its last error line, or the timeout.
    """
    start = time.time()
    failures: list[RankFailure] = []
    while True:
        failure = _run_attempt(job_path, world, len(failures), start, timeout_s, on_poll)
        if failure is None:
            return start, time.time(), failures
        stage, reason, retry = failure
        failures.append(RankFailure(stage, reason, int(time.time() * 1000)))
        if not retry or len(failures) > max_restarts:
            after = f" (after {len(failures) - 1} restart(s) of every rank)" if len(failures) > 1 else ""
            hint = " Its output is above; out of memory?" if reason.startswith("died") else ""
            raise ZLError(f"--runtime torch: stage {stage} {reason}{after}; the other stages were stopped.{hint}")
        if on_restart is not None:
            on_restart(failures[-1])
        failures[-1].restart_unix_ms = int(time.time() * 1000)


def _run_attempt(job_path: Path, world: int, attempt: int, start: float, timeout_s: float,
                 on_poll) -> tuple[int, str, bool] | None:
    """The ranks' attempt `attempt` to the end: None when every rank finished, else (the failed stage, what
    happened, whether a restart may help). The ranks still alive are stopped on the way out."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

    from zl_device.run.launch import free_port_base
    from zl_device.run.torch_stage import spawned

    init_method = f"tcp://127.0.0.1:{free_port_base(1)}"
    ctx = mp.start_processes(spawned, args=(str(job_path), world, init_method, attempt), nprocs=world, join=False,
                             start_method="spawn")
    try:
        while not ctx.join(timeout=1.0):
            if on_poll is not None:
                on_poll()
            if time.time() - start > timeout_s:
                raise ZLError(f"the run took longer than --timeout {timeout_s:g} s and was stopped; raise --timeout.")
        return None
    except ProcessRaisedException as e:
        # A neighbour of a rank that was killed can fail first (its connection reset): blame the killed one.
        killed = _killed_rank(ctx.processes)
        if killed is not None:
            return killed
        deliberate = "ZLError: " in _last_line_raw(e.msg)
        return e.error_index, f"failed: {_last_line(e.msg)}", not deliberate
    except ProcessExitedException as e:
        return e.error_index, _death(e.exit_code), True
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join()


def _killed_rank(processes) -> tuple[int, str, bool] | None:
    """(stage, what happened, True) for the first rank that a signal ended, if any: not SIGTERM, which
    torch.multiprocessing's join sends the ranks still alive once one failed."""
    for k, p in enumerate(processes):
        if p.exitcode is not None and p.exitcode < 0 and p.exitcode != -signal.SIGTERM:
            return k, _death(p.exitcode), True
    return None


def _death(exit_code: int | None) -> str:
    return f"died ({f'signal {-exit_code}' if exit_code is not None and exit_code < 0 else f'exit code {exit_code}'})"


class RankWatch:
    """The ranks' progress for the live display, read from the new lines of their metrics.jsonl files."""

    def __init__(self, stages_dir: Path, num_stages: int):
        from zl_device.run.coordinator import StageStatus

        self.paths = [stages_dir / f"stage_{k}" / "metrics.jsonl" for k in range(num_stages)]
        self.offsets = [0] * num_stages
        self.status = [StageStatus(k, f"rank-{k}") for k in range(num_stages)]

    def poll(self) -> list:
        for k, path in enumerate(self.paths):
            if not path.is_file():
                continue
            with open(path, encoding="utf-8") as f:
                f.seek(self.offsets[k])
                text = f.read()
            complete = text[:text.rfind("\n") + 1]  # a line being written waits for the next poll
            self.offsets[k] += len(complete.encode("utf-8"))
            st = self.status[k]
            for line in complete.splitlines():
                record = json.loads(line)
                kind = record["type"]
                if kind == "start":  # a later one: the ranks restarted after a failure (or a --resume)
                    st.restarts += st.state != "starting"
                    st.state = "running"
                elif kind == "micro_batch":
                    st.micro_batches_done, st.last_loss = record["micro_batch"] + 1, record["loss"]
                elif kind == "window":
                    st.last_committed_window, st.pss_mib = record["window"], record["pss_mib"]
                elif kind == "done":
                    st.state = "done"
        return self.status


def _last_line_raw(message: str) -> str:
    """The exception line of a child's traceback text."""
    lines = [ln for ln in message.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else message


def _last_line(message: str) -> str:
    """The exception line of a child's traceback text, its ZLError class name cut ("zl.errors.ZLError: ..." ->
    "...")."""
    last = _last_line_raw(message)
    return last.split("ZLError: ", 1)[1] if "ZLError: " in last else last


def training_span(run_dir: Path, num_stages: int, since_ms: int = 0) -> tuple[int, int]:
    """(earliest `start`, latest `done`) t_unix_ms of the ranks since `since_ms` (this launch: not the attempts of
    a run that `--resume` continues): from the barrier after every rank built its stage to the last stage's end,
    restarts after failures included."""
    begin, end = [], []
    for lines in stage_lines(run_dir, num_stages):
        begin.append(min(r["t_unix_ms"] for r in lines if r["type"] == "start" and r["t_unix_ms"] >= since_ms))
        end.append([r["t_unix_ms"] for r in lines if r["type"] == "done"][-1])
    return min(begin), max(end)


def stage_lines(run_dir: Path, num_stages: int) -> list[list[dict]]:
    """Every rank's telemetry lines (RUN_DIR/stages/stage_<k>/metrics.jsonl), stage by stage."""
    from zl_device.run.metrics_log import METRICS, STAGES_DIR, read_lines

    return [read_lines(run_dir / STAGES_DIR / f"stage_{k}" / METRICS) for k in range(num_stages)]


def recovery_events(run_dir: Path, num_stages: int, windows: WindowPlan, failures: list[RankFailure]) -> list[dict]:
    """The coordinator's `failure`, `restart` and `recovered` events (docs/design.md §4.7) of the ranks' restarts,
    from their telemetry, so that `zl report` shows the recoveries as it does the runners'. A global recovery:
    the restart is every rank's; recovered is when the stage downstream of the failed one (itself, if last)
    commits the window that was in flight at the failure."""
    lines = stage_lines(run_dir, num_stages)
    events: list[dict] = []
    for f in failures:
        held = [_done_at(ls, f.t_unix_ms) for ls in lines]
        in_flight = windows.window_of(min(held[f.stage], windows.num_micro_batches - 1))
        events.append({"type": "failure", "stage": f.stage, "t_unix_ms": f.t_unix_ms, "detected_after_ms": None,
                       "window": in_flight, "micro_batch": held[f.stage], "reason": f.reason})
        if f.restart_unix_ms is None:
            continue
        restarted = [min((r for r in ls if r["type"] == "start" and r["t_unix_ms"] >= f.restart_unix_ms),
                         key=lambda r: r["t_unix_ms"], default=None) for ls in lines]
        replayed = sum(max(h - r["first_micro_batch"], 0) for h, r in zip(held, restarted) if r is not None)
        events.append({"type": "restart", "stage": f.stage, "t_unix_ms": f.restart_unix_ms, "scope": "global",
                       "replayed_micro_batches": replayed, "replay_bytes": None, "device": f"rank-{f.stage}",
                       "rolled_back_to_window": next((r["resumed_from_window"] for r in restarted if r), None),
                       "standby": False})
        downstream = min(f.stage + 1, num_stages - 1)
        commit = min((r["t_unix_ms"] for r in lines[downstream] if r["type"] == "window"
                      and r["window"] == in_flight and r["t_unix_ms"] >= f.restart_unix_ms), default=None)
        if commit is not None:
            events.append({"type": "recovered", "stage": f.stage, "t_unix_ms": commit,
                           "recovery_ms": float(commit - f.restart_unix_ms),
                           "since_failure_ms": float(commit - f.t_unix_ms), "downstream_stage": downstream,
                           "window": in_flight})
    return events


def _done_at(lines: list[dict], t_unix_ms: int) -> int:
    """The micro-batches a stage had done at `t_unix_ms` in its attempt then running (from its last `start` line
    before; 0 if it had not started), from its telemetry lines."""
    starts = [r for r in lines if r["type"] == "start" and r["t_unix_ms"] <= t_unix_ms]
    if not starts:
        return 0
    since, first = starts[-1]["t_unix_ms"], starts[-1]["first_micro_batch"]
    return max((r["micro_batch"] + 1 for r in lines if r["type"] == "micro_batch"
                and since <= r["t_unix_ms"] <= t_unix_ms), default=first)


def merge_metrics(run_dir: Path, num_stages: int, events: list[dict]) -> Path:
    """RUN_DIR/metrics.jsonl: every stage's lines (each in its order) and then `events`."""
    from zl_device.run.metrics_log import METRICS, STAGES_DIR

    lines: list[str] = []
    for k in range(num_stages):
        path = run_dir / STAGES_DIR / f"stage_{k}" / METRICS
        if path.is_file():
            lines += [ln for ln in path.read_text().splitlines() if ln.strip()]
    lines += [json.dumps(e) for e in events]
    merged = run_dir / METRICS
    merged.write_text("\n".join(lines) + "\n")
    return merged
