"""`zl train` from top to bottom: export -> data -> deploy -> run -> pull -> merge -> eval -> report.

Each step is one function; `run_training` calls them in order. A run
directory ends up holding (DESIGN.md §6):

    RUN_DIR/manifest.json            the export's manifest (programs stay in the export cache)
    RUN_DIR/data/train.safetensors   the shard stage 0 trains on (+ dev.safetensors when there is one)
    RUN_DIR/run.key, stage_<k>.json  the run key and the stage configs as generated
    RUN_DIR/devices/local-<i>/       local devices' working folders
    RUN_DIR/logs/<device>/           runner output, configs, telemetry as pulled
    RUN_DIR/stages/stage_<k>/metrics.jsonl, RUN_DIR/metrics.jsonl (merged, with coordinator events)
    RUN_DIR/checkpoints/stage_<k>/window_*/
    RUN_DIR/adapter/                 the PEFT adapter of the whole model
    RUN_DIR/eval.json, report.json, report.md, plots/
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import secrets
import shutil
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from zl.errors import ZLError
from zl_device.run.train_settings import DEMO, TrainSettings

log = logging.getLogger(__name__)

EXPORT_CACHE_VERSION = 2  # bump when the exporter's output changes for the same options


def effective_seq_len(s: TrainSettings) -> int:
    """--seq-len, or its default for the model and data (computed once, then kept in `s`)."""
    if s.seq_len is None:
        s.seq_len = default_seq_len(s.split.model, s.data)
    return s.seq_len


def default_seq_len(model: str, data: str) -> int:
    """128 tokens, or for the demo task the longest sample under the model's tokenizer rounded up to 16."""
    from zl_export.model_source import load_tokenizer
    from zl_export.shard_jobs import DEFAULT_SEQ_LEN, default_seq_len as shard_seq_len

    if data != DEMO:
        return DEFAULT_SEQ_LEN
    return shard_seq_len(load_tokenizer(model), demo=True)


@dataclass
class TrainResult:
    run_dir: Path
    wall_s: float
    samples: int
    report: dict = field(default_factory=dict)
    eval: dict = field(default_factory=dict)


# --- 1. export (cached) -------------------------------------------------------------------------------


def export_key(s: TrainSettings) -> str:
    """A hash of what determines the stage programs: model identity, split and export options."""
    from zl_export.model_source import resolve

    kind, path = resolve(s.split.model)
    identity = {"spec": s.split.model, "kind": kind}
    if path is not None:
        probe = path / "config.json" if path.is_dir() else path
        st = probe.stat()
        identity.update(path=str(path.resolve()), size=st.st_size, mtime_ns=st.st_mtime_ns)
    opts = s.export_options(effective_seq_len(s))
    blob = {"v": EXPORT_CACHE_VERSION, "model": identity, "stages": s.split.key,
            "opts": {"seq_len": opts.seq_len, "micro_batch": opts.micro_batch, "seed": opts.seed,
                     "lora": asdict(opts.lora), "loss": asdict(opts.loss)}}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:16]


def export_cached(s: TrainSettings, say, progress=None) -> tuple[Path, dict]:
    """The export directory for `s`: reused from the cache when complete, else exported into it.

    `progress` (a zl_export.pipeline.ExportProgress) sees the export when there is one.
    """
    from zl_export.manifest import load_manifest
    from zl_export.pipeline import export_pipeline
    from zl_export.model_source import cache_dir

    root = s.export_cache or cache_dir() / "exports"
    target = root / export_key(s)
    if (target / "manifest.json").is_file():
        try:
            manifest = load_manifest(target)
            if all((target / st["file"]).is_file() and (target / st["file"]).stat().st_size == st["size_bytes"]
                   for st in manifest["stages"]):
                say(f"export: reusing {target}")
                return target, manifest
        except ZLError as e:
            log.warning("export cache %s is unusable (%s); exporting again", target, e)
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    manifest = export_pipeline(s.split, tmp, s.export_options(effective_seq_len(s)), progress=progress,
                               shown_dir=target).manifest
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target, manifest


# --- 2. data -------------------------------------------------------------------------------------------


def prepare_data(s: TrainSettings, data_dir: Path, say) -> tuple[Path, Path | None]:
    """Tokenize the training data (and dev data) with the model's tokenizer into `data_dir`.

    Returns:
        (train shard, dev shard or None).
    """
    from zl_export import data as zdata
    from zl_export.model_source import load_tokenizer
    from zl_export.shard import load_shard
    from zl_export.shard_jobs import ShardJob, demo_jobs, file_job, write_shard

    seq_len = effective_seq_len(s)
    tokenizer = load_tokenizer(s.split.model)
    data_dir.mkdir(parents=True, exist_ok=True)

    def write(job: ShardJob) -> Path:
        path, meta = write_shard(job, tokenizer, s.split.model, seq_len, data_dir, s.truncate, extra={"seed": s.seed})
        say(f"data: {job.name} {meta['rows']} rows x {seq_len} tokens -> {path}")
        return path

    def from_file(spec: str, name: str) -> Path:
        path = Path(spec).expanduser()
        if path.suffix == ".safetensors":
            shard = load_shard(path)
            if shard.seq_len != seq_len:
                raise ZLError(f"--data {spec}: the shard has seq_len {shard.seq_len}, the programs {seq_len}; pass "
                              f"--seq-len {shard.seq_len} or re-tokenize with `zl data --seq-len {seq_len}`.")
            return path
        job = file_job(path, s.data_format, name)
        job.task = zdata.select(job.task, None, True, s.seed)
        return write(job)

    if s.data == DEMO:
        paths = {job.name: write(job) for job in demo_jobs(s.seed)}
        return paths["train"], (from_file(s.eval_data, "dev") if s.eval_data else paths.get("dev"))
    return from_file(s.data, "train"), (from_file(s.eval_data, "dev") if s.eval_data else None)


# --- 3. plan and deploy --------------------------------------------------------------------------------


def free_port_base(count: int, start: int = 20000, stop: int = 60000) -> int:
    """A base port with `count` consecutive free ports on 127.0.0.1 (local devices share this host)."""
    rng = secrets.SystemRandom()
    for _ in range(200):
        base = rng.randrange(start, stop - count)
        socks = []
        try:
            for p in range(base, base + count):
                sock = socket.socket()
                sock.bind(("127.0.0.1", p))
                socks.append(sock)
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise ZLError("found no free local ports for the stages; is the host out of ports?")


def stage_configs(s: TrainSettings, manifest: dict, export_dir: Path, shard: Path, plan, key_file: Path,
                  run_id: str, num_micro_batches: int) -> dict[int, dict]:
    """The runner config of every stage (host paths; deploy pushes the files and rewrites them)."""
    num_stages = len(manifest["stages"])
    num_windows = math.ceil(num_micro_batches / s.window)
    schedule = {"kind": "warmup_cosine", "warmup_steps": min(s.warmup_windows, max(0, num_windows - 1)),
                "min_lr_ratio": 0.1}
    configs = {}
    for addresses in plan.stages:
        k = addresses.stage
        cfg = {
            "program": str(export_dir / manifest["stages"][k]["file"]),
            "manifest": str(export_dir / "manifest.json"),
            "stage_index": k,
            "num_stages": num_stages,
            "run_key_file": str(key_file),
            "run_id": run_id,
            "window_size": s.window,
            "num_micro_batches": num_micro_batches,
            "in_flight_depth": s.in_flight,
            "checkpoint_dir": "checkpoints",
            # Global recovery rolls every stage back to the last window all committed: keep them all.
            "keep_last": num_windows + 1 if s.recovery == "global" else 2,
            "log_path": "metrics.jsonl",
            "threads": s.threads,
            "optimizer": {"lr": s.stage_lr_of(k), "weight_decay": 0.0, "schedule": schedule},
            **addresses.config_fields(),
        }
        if k == 0:
            cfg["data_shard"] = str(shard)
        configs[k] = cfg
    return configs


def entry_bytes(manifest: dict, k: int) -> int:
    """Bytes of one input entry of stage k: a DATA frame's tensors (stage 0: a shard row)."""
    b, sl, d = manifest["micro_batch"], manifest["seq_len"], manifest["model"]["hidden_size"]
    return 3 * b * sl * 8 if k == 0 else b * sl * d * 4 + 2 * b * sl * 8


# --- 4. collect ----------------------------------------------------------------------------------------


def collect_metrics(run_dir: Path, devices, num_stages: int, events: list[dict]) -> Path:
    """Per-stage telemetry into RUN_DIR/stages/stage_<k>/, then the merged RUN_DIR/metrics.jsonl."""
    from zl_device.run.metrics_log import METRICS, STAGES_DIR

    lines: list[str] = []
    for k in range(num_stages):
        pulled = run_dir / "logs" / devices[k].name / METRICS
        target = run_dir / STAGES_DIR / f"stage_{k}" / METRICS
        if pulled.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(pulled, target)
            lines += [ln for ln in pulled.read_text().splitlines() if ln.strip()]
    lines += [json.dumps(e) for e in events]
    merged = run_dir / METRICS
    merged.write_text("\n".join(lines) + "\n")
    return merged


def evaluate_run(s: TrainSettings, run_dir: Path, dev: Path, say) -> dict:
    """Base model and adapter on the dev shard; writes RUN_DIR/eval.json."""
    from zl_device.results.evaluate import evaluate_with_adapter, limit_rows
    from zl_export.model_source import load_model
    from zl_export.shard import load_shard

    shard = limit_rows(load_shard(dev), s.eval_limit)
    scores = evaluate_with_adapter(load_model(s.split.model, seed=s.seed).model, shard, run_dir / "adapter")
    before, after = scores["base"], scores["adapter"]
    result = {"data": str(dev), "rows": shard.rows, "base": before.to_dict(), "adapter": after.to_dict()}
    (run_dir / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    acc = (f"accuracy {before.accuracy:.1%} -> {after.accuracy:.1%}, " if before.accuracy is not None else "")
    say(f"eval on {shard.rows} dev rows: {acc}NLL {before.nll:.3f} -> {after.nll:.3f} nats/token")
    return result


# --- the job -------------------------------------------------------------------------------------------


def run_training(s: TrainSettings, say=print, on_update=None, export_progress=None) -> TrainResult:
    """The whole `zl train` job; `say` prints a step's line, `on_update` gets the coordinator's stage states,
    `export_progress` (a zl_export.pipeline.ExportProgress) sees the export when the cache has none."""
    from zl_device.run.control import ControlServer
    from zl_device.run.coordinator import Coordinator, Injection, StagePlan
    from zl_device.devices.deploy import deploy, deploy_stage, pull
    from zl_device.devices.registry import check_mode, open_devices, parse_devices
    from zl_device.devices.network import apply_tunnels, plan_addresses
    from zl_device.results.report import write_report

    start = time.time()
    run_dir = Path(s.out).expanduser().resolve()
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ZLError(f"--out {run_dir}: the directory exists and is not empty; pick a new run directory "
                      "(a run never overwrites another run's results).")
    s.validate()
    spec = parse_devices(s.devices)
    check_mode(spec, s.mode)  # before the export, which takes minutes
    run_dir.mkdir(parents=True, exist_ok=True)

    export_dir, manifest = export_cached(s, say, export_progress)
    shutil.copyfile(export_dir / "manifest.json", run_dir / "manifest.json")
    num_stages = len(manifest["stages"])
    if spec.count < num_stages + s.spares:
        raise ZLError(f"--devices {s.devices} gives {spec.count} device(s); {num_stages} stages"
                      f"{f' and {s.spares} spare(s)' if s.spares else ''} need {num_stages + s.spares}.")
    shard, dev = prepare_data(s, run_dir / "data", say)
    num_micro_batches = math.ceil(s.samples / s.export.micro_batch)
    num_windows = math.ceil(num_micro_batches / s.window)
    injection = Injection.parse(s.inject_failure, num_stages, num_windows) if s.inject_failure else None

    devices = open_devices(spec, run_dir, link_profile=s.link_profile, mode=s.mode)
    stage_devices, spares = devices[:num_stages], devices[num_stages:num_stages + s.spares]
    key_file = run_dir / "run.key"
    key_file.write_text(secrets.token_hex(32) + "\n")
    key_file.chmod(0o600)
    run_id = secrets.token_hex(16)
    with ControlServer(bytes.fromhex(key_file.read_text().strip()), bytes.fromhex(run_id),
                       host="127.0.0.1" if spec.kind == "local" else "0.0.0.0") as control:
        base = free_port_base(num_stages) if spec.kind == "local" else None
        plan = plan_addresses(stage_devices, coordinator_port=control.address[1],
                              **({"stage_port": base} if base else {}))
        if plan.tunnels:  # phones only on USB: stage links and the control channel go through this host
            apply_tunnels(plan, stage_devices)
        configs = stage_configs(s, manifest, export_dir, shard, plan, key_file, run_id, num_micro_batches)
        deployed = {k: dict(cfg) for k, cfg in configs.items()}
        if injection:
            deployed[injection.stage]["hold_at_micro_batch"] = injection.hold_micro_batch(s.window)
        for k, cfg in deployed.items():
            (run_dir / f"stage_{k}.json").write_text(json.dumps(cfg, indent=2) + "\n")
        say(f"deploy: {num_stages} stages to {', '.join(d.name for d in stage_devices)}"
            + (f" (spares: {', '.join(d.name for d in spares)})" if spares else "")
            + (" in the app" if s.mode == "app" else ""))
        results = deploy(stage_devices, export_dir, deployed)
        plans = [StagePlan(k, d, r.config, "metrics.jsonl", "checkpoints", entry_bytes(manifest, k))
                 for k, (d, r) in enumerate(zip(stage_devices, results))]

        def redeploy(device, k):
            deploy_stage(device, export_dir, k, configs[k], manifest=manifest)

        coordinator = Coordinator(plans, s.window, num_micro_batches, control, s.recovery, injection, spares,
                                  s.heartbeat_timeout_s, s.timeout_s, redeploy)
        say(f"run: {s.samples} samples, {num_micro_batches} micro-batches in {num_windows} windows of {s.window}, "
            f"recovery {s.recovery}" + (f", failure injected at stage {injection.stage} window {injection.window}"
                                       if injection else ""))
        run_start = time.time()
        try:
            events = coordinator.run(on_update)
        except BaseException:
            coordinator.stop_all()
            pull([p.device for p in plans], run_dir)
            raise
        finally:
            for device in devices:
                if hasattr(device, "remove_tunnels") and plan.tunnels:
                    device.remove_tunnels()
        run_end = time.time()
    used = [p.device for p in plans]
    pull(used, run_dir)
    events.append({"type": "run", "start_unix_ms": int(run_start * 1000), "end_unix_ms": int(run_end * 1000),
                   "samples": num_micro_batches * s.export.micro_batch, "run_id": run_id, "num_stages": num_stages,
                   "window_size": s.window, "num_micro_batches": num_micro_batches, "recovery": s.recovery,
                   "devices": [d.name for d in used],
                   "control_heartbeats": [st.heartbeat_seen for st in coordinator.status]})
    collect_metrics(run_dir, used, num_stages, events)

    from zl_device.results.adapter import merge_checkpoints

    merged = merge_checkpoints(run_dir / "checkpoints", run_dir / "manifest.json", run_dir / "adapter")
    say(f"merge: {merged.numel:,} LoRA parameters of window {merged.window} -> {run_dir / 'adapter'}")
    result = TrainResult(run_dir, time.time() - start, num_micro_batches * s.export.micro_batch)
    if dev is not None:
        result.eval = evaluate_run(s, run_dir, dev, say)
    result.report = write_report(run_dir)
    say(f"report: {run_dir / 'report.md'}")
    return result
