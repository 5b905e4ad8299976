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
import time
from pathlib import Path

from zl.errors import ZLError
from zl_device.run.train_settings import TrainSettings
from zl_device.run.windows import WindowPlan

RUNTIME = "torch"


def check_torch_settings(s: TrainSettings) -> None:
    """Options of the ExecuTorch runtime that `--runtime torch` does not have fail here, before anything runs."""
    from zl_device.devices.registry import parse_devices

    unsupported = [(s.spares, "--spares"), (s.standby, "--standby"), (s.mode != "binary", "--mode")]
    for value, name in unsupported:
        if value:
            raise ZLError(f"{name} is not supported with --runtime torch (a failed stage is not replaced; rerun with "
                          "--resume); drop it or use --runtime executorch.")
    if parse_devices(s.devices).kind != "local":
        raise ZLError(f"--devices {s.devices}: --runtime torch runs its stages as processes on this host (or under "
                      "torchrun, docs/design.md §13), not on phones; drop --devices or use --runtime executorch.")


def run_torch_training(s: TrainSettings, say=print, on_update=None):
    """The whole `zl train --runtime torch` job; returns a train_job.TrainResult. `on_update` gets the stages'
    states (coordinator.StageStatus, from the ranks' telemetry) about once a second."""
    from zl_device.results.adapter import merge_checkpoints
    from zl_device.run.torch_stage import JOB_FILE
    from zl_device.run.train_data import prepare_data, run_max_targets, run_seq_len
    from zl_device.run.train_job import RunModel, TrainResult, finish_run, open_run

    check_torch_settings(s)
    start = time.time()
    if s.resume:
        s.validate()
        run_dir, job, dev = resumed_run(s, say)
        model = RunModel(job.model, json.loads((run_dir / "manifest.json").read_text())["seed"])
    else:
        run_dir, _ = open_run(s)
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
        for line in torchrun_instructions(run_dir, job_path, num_stages):
            say(line)
        return TrainResult(run_dir, time.time() - start, 0)
    say(f"run: {num_stages} stages as torch.distributed ranks on this host, {samples} samples, "
        f"{windows.num_micro_batches} micro-batches in {windows.num_windows} windows of {windows.window_size}")
    watch = RankWatch(run_dir / "stages", num_stages)
    launched, _ = launch_ranks(job_path, num_stages, s.timeout_s,
                               on_poll=(lambda: on_update(watch.poll())) if on_update else None)
    begin_ms, end_ms = training_span(run_dir, num_stages)  # process start-up and model load are not training
    event = {"type": "run", "start_unix_ms": begin_ms, "end_unix_ms": end_ms,
             "launch_s": round(begin_ms / 1000 - launched, 3),
             "samples": samples, "run_id": job.run_id,
             "num_stages": num_stages, "window_size": windows.window_size,
             "num_micro_batches": windows.num_micro_batches, "runtime": RUNTIME,
             "recovery": "resume" if s.resume else None,
             "devices": [f"rank-{k}" for k in range(num_stages)]}
    merge_metrics(run_dir, num_stages, [event])
    merged = merge_checkpoints(run_dir / "checkpoints", run_dir / "manifest.json", run_dir / "adapter")
    say(f"merge: {merged.numel:,} LoRA parameters of window {merged.window} -> {run_dir / 'adapter'}")
    return finish_run(s, model, TrainResult(run_dir, time.time() - start, samples), dev, say)


def torchrun_instructions(run_dir: Path, job_path: Path, num_stages: int) -> list[str]:
    """What to run after `--launcher torchrun`: the ranks under torchrun, then merge and report."""
    return [f"prepared {run_dir}; start its {num_stages} ranks (one per stage) with torchrun:",
            f"  torchrun --standalone --nproc-per-node {num_stages} -m zl_device.run.torch_stage {job_path}",
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


def launch_ranks(job_path: Path, world: int, timeout_s: float, on_poll=None) -> tuple[float, float]:
    """One process per stage on this host (torch.multiprocessing spawn, rendezvous on a free 127.0.0.1 port);
    returns the (start, end) Unix times of the run.

    A rank that fails (an error, a kill) ends the others at once; a run past `timeout_s` is stopped.

    Raises:
        ZLError: naming the stage that failed and its last error line, or the timeout.
    """
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

    from zl_device.run.launch import free_port_base
    from zl_device.run.torch_stage import spawned

    init_method = f"tcp://127.0.0.1:{free_port_base(1)}"
    start = time.time()
    ctx = mp.start_processes(spawned, args=(str(job_path), world, init_method), nprocs=world, join=False,
                             start_method="spawn")
    try:
        while not ctx.join(timeout=1.0):
            if on_poll is not None:
                on_poll()
            if time.time() - start > timeout_s:
                raise ZLError(f"the run took longer than --timeout {timeout_s:g} s and was stopped; raise --timeout.")
    except ProcessRaisedException as e:
        raise ZLError(f"--runtime torch: stage {e.error_index} failed: {_last_line(e.msg)}") from None
    except ProcessExitedException as e:
        how = f"signal {-e.exit_code}" if e.exit_code is not None and e.exit_code < 0 else f"exit code {e.exit_code}"
        raise ZLError(f"--runtime torch: stage {e.error_index} died ({how}); the other stages were stopped. "
                      "Its output is above; out of memory?") from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join()
    return start, time.time()


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
                if kind == "start":
                    st.state = "running"
                elif kind == "micro_batch":
                    st.micro_batches_done, st.last_loss = record["micro_batch"] + 1, record["loss"]
                elif kind == "window":
                    st.last_committed_window, st.pss_mib = record["window"], record["pss_mib"]
                elif kind == "done":
                    st.state = "done"
        return self.status


def _last_line(message: str) -> str:
    """The exception line of a child's traceback text ("zl.errors.ZLError: ..." -> "...")."""
    lines = [ln for ln in message.strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else message
    return last.split("ZLError: ", 1)[1] if "ZLError: " in last else last


def training_span(run_dir: Path, num_stages: int) -> tuple[int, int]:
    """(earliest `start`, latest `done`) t_unix_ms of the ranks: from the barrier after every rank built its stage
    to the last stage's end."""
    from zl_device.run.metrics_log import METRICS, STAGES_DIR, read_lines

    begin, end = [], []
    for k in range(num_stages):  # each rank's last attempt (a resumed run has several)
        lines = read_lines(run_dir / STAGES_DIR / f"stage_{k}" / METRICS)
        begin.append([r["t_unix_ms"] for r in lines if r["type"] == "start"][-1])
        end.append([r["t_unix_ms"] for r in lines if r["type"] == "done"][-1])
    return min(begin), max(end)


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
