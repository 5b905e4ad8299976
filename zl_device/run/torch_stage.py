"""One stage of `zl train --runtime torch` as one torch.distributed rank (docs/design.md §13).

Rank k builds stage k's `StageModule` in PyTorch eager (the same modules and
LoRA initialisation as the export, zl_export.exporter.build_stage_modules) and
trains it with `StageStep`, the step `train_zerolock` runs, so the result
equals the single-process eager reference. Per micro-batch: input (stage 0: its
shard rows; else the entry from rank k-1) -> phase 1 -> `isend` to rank k+1 ->
phase 2 (local loss, backward) while the send goes on. Per window: AdamW step,
flush (rank k+1 holds every entry of the window), checkpoint in the runner's
format, a `window` telemetry line. Telemetry and checkpoints are the runner's
(docs/design.md §4.5, §4.7), so `zl merge` and `zl report` read them unchanged.

`zl train --runtime torch` writes RUN_DIR/torch_job.json and starts one process
per stage on this host (torch.multiprocessing spawn). The same ranks run under
torchrun, e.g. on a multi-GPU server (NCCL when CUDA is there):

    torchrun --standalone --nproc-per-node 3 --max-restarts 3 -m zl_device.run.torch_stage RUN_DIR/torch_job.json

Recovery is torch elastic's (docs/design.md §13): when a rank fails, the
launcher (zl's, or torchrun's agent with `--max-restarts`) stops every rank and
starts them all again; a restarted rank (`for_attempt`) resumes from the latest
window every stage checkpointed and replays from there.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from zl.errors import ZLError

JOB_FILE = "torch_job.json"
BACKENDS = ("auto", "gloo", "nccl")


@dataclass
class TorchJob:
    """What every rank needs: the run's model, manifest, shard, plan, optimizer and where to write."""

    model: str  # the model spec (`--model`)
    manifest: str  # RUN_DIR/manifest.json: stages, LoRA, loss, shapes, seed
    shard: str  # stage 0's training shard (also the lens calibration rows)
    run_id: str
    window_size: int
    num_micro_batches: int
    micro_batch: int  # B, rows per micro-batch (the manifest's)
    lr: list[float]  # per stage: --lr x --stage-lr
    weight_decay: float
    schedule: dict  # the runner's lr schedule (zl_device/run/lr_schedule.py)
    checkpoint_dir: str  # RUN_DIR/checkpoints; stage k writes stage_<k>/window_NNNNNN/
    metrics_dir: str  # RUN_DIR/stages; stage k appends to stage_<k>/metrics.jsonl
    keep_last: int = 2
    threads: int = 1  # torch intra-op threads per rank
    in_flight: int = 4  # un-received entries per link
    link_timeout_s: float = 600.0
    backend: str = "auto"  # auto: nccl when CUDA is there, else gloo
    pipeline: str = "zerolock"  # or a backprop baseline: gpipe, 1f1b, pipedream (torch_pipeline.py; tools/bench_pipelines.py)
    resume: bool = False  # start after the latest window every stage has checkpointed (docs/design.md §13)
    fail_at: list[int] | None = None  # [stage, micro-batch]: that stage SIGKILLs itself there (--inject-failure)
    # ZeroLock's micro-batches cut to their longest row (eager takes any length); False: the full seq_len, the
    # work the runner's programs and the backprop baselines' fixed-shape stages do (tools/bench_pipelines.py).
    trim_padding: bool = True

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @staticmethod
    def load(path: Path | str) -> TorchJob:
        path = Path(path)
        try:
            return TorchJob(**json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError, TypeError) as e:
            raise ZLError(f"{path}: not a readable {JOB_FILE} ({e}); `zl train --runtime torch` writes one into "
                          "its run directory.") from e


def for_attempt(job: TorchJob, attempt: int) -> TorchJob:
    """The job as the ranks' attempt `attempt` runs it (0: the first; torchrun counts in TORCHELASTIC_RESTART_COUNT,
    zl's launcher passes it): every restart resumes from the latest window every stage checkpointed, and an
    injected failure (`fail_at`) happens in the first attempt only."""
    return job if attempt == 0 else replace(job, resume=True, fail_at=None)


def backend_and_device(backend: str, local_rank: int, local_world: int) -> tuple[str, torch.device]:
    """(process-group backend, this rank's device).

    auto: NCCL on cuda:LOCAL_RANK when this host has a GPU per local rank (NCCL refuses two ranks on one GPU),
    else gloo on CPU. nccl without enough GPUs is an error.
    """
    if backend not in BACKENDS:
        raise ZLError(f"torch job backend {backend!r}: expected one of {', '.join(BACKENDS)}.")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        backend = "nccl" if gpus >= local_world else "gloo"
    if backend == "nccl":
        if gpus < local_world:
            raise ZLError(f"torch job backend nccl: {local_world} ranks on this host but {gpus} GPU(s); NCCL needs "
                          "one GPU per rank. Use backend gloo (or auto).")
        return backend, torch.device("cuda", local_rank)
    return backend, torch.device("cpu")


def run_rank(job: TorchJob, rank: int, world: int, local_rank: int, local_world: int, init_method: str,
             attempt: int = 0) -> None:
    """Join the process group, train stage `rank` to the end of the run, wait for every rank, leave. `attempt`:
    the ranks' attempt (0: the first; a later one resumes, `for_attempt`)."""
    from zl_device.run.torch_pipeline import BASELINES

    job = for_attempt(job, attempt)

    if job.pipeline not in ("zerolock", *BASELINES):
        raise ZLError(f"torch job pipeline {job.pipeline!r}: expected zerolock or one of {', '.join(BASELINES)}.")
    torch.set_num_threads(job.threads)
    backend, device = backend_and_device(job.backend, local_rank, local_world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=job.link_timeout_s)
    store = attempt_store(world, attempt, timeout) if init_method == "env://" else None
    dist.init_process_group(backend, init_method=None if store is not None else init_method, store=store,
                            rank=rank, world_size=world, timeout=timeout)
    try:
        if job.pipeline == "zerolock":
            train_stage(job, rank, world, device, backend)
        else:
            from zl_device.run.torch_pipeline import train_pipelined

            train_pipelined(job, rank, world, device, backend)
        dist.barrier()  # nobody leaves (and closes its connections) while a neighbour still reads
    finally:
        dist.destroy_process_group()


def attempt_store(world: int, attempt: int, timeout: timedelta):
    """Under torchrun, where the workers share the agent's rendezvous store (TORCHELASTIC_USE_AGENT_STORE, torch's
    default), the keys of this attempt only (a prefix per attempt), else None (init_method env:// as it is).

    torchrun keeps that store across restarts, and a restarted gloo group read the failed attempt's peer addresses
    from it and waited on them until the timeout (torch 2.13; with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 each
    attempt gets a new store instead)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    shared = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                           timeout=timeout)
    return dist.PrefixStore(f"zl/attempt_{attempt}", shared)


def build_stage(job: TorchJob, manifest: dict, rank: int):
    """(stage `rank`'s StageModule, its trainable parameters' manifest names by id, where its weights came from).

    The rank loads only its stage's weights where the model's files allow (`load_stage_model`: a GGUF file or a
    model directory with safetensors); otherwise, and for lens translators (fitted through every stage), it loads
    the whole model and frees the other stages' layers."""
    from zl_export.exporter import build_stage_modules, manifest_names
    from zl_export.frozen_weights import compact_for_training
    from zl_export.model_source import load_model, load_stage_model
    from zl_export.options import ExportOptions, LoraSettings, LossConfig
    from zl_export.shard import load_shard
    from zl_export.stages import StageRange
    from zl_export.translator import calibration_batches

    lora = manifest["lora"]
    opts = ExportOptions(seq_len=manifest["seq_len"], micro_batch=manifest["micro_batch"],
                         lora=LoraSettings(lora["rank"], lora["alpha"], tuple(lora["targets"])),
                         loss=LossConfig.from_manifest(manifest["loss"]), seed=manifest["seed"],
                         max_targets=manifest["max_targets"], frozen_dtype=manifest.get("frozen_dtype", "fp32"))
    lens = opts.loss.translator_rank and opts.loss.translator_init == "lens"
    if lens:  # fitting the lenses runs the calibration rows through every stage: the whole model
        loaded = load_model(job.model, seed=manifest["seed"])
    else:  # this stage's weights only, where the model's files allow (load_stage_model)
        first, last = manifest["stages"][rank]["layers"]
        loaded = load_stage_model(job.model, first, last, embedding=rank == 0, seed=manifest["seed"])
    calibration = calibration_batches(load_shard(job.shard)) if lens else None  # as the export fits them
    peft_model, modules = build_stage_modules(
        loaded.model, [StageRange(st["index"], *st["layers"]) for st in manifest["stages"]], opts, calibration)
    module = modules[rank]
    compact_for_training(module)  # bf16/int8: the compact weights only, never float32 copies
    names = manifest_names(module, peft_model)
    names = {id(p): names[id(p)] for p in module.parameters() if p.requires_grad}
    expected = {p["name"] for p in manifest["stages"][rank]["parameters"]}
    if set(names.values()) != expected:
        raise ZLError(f"stage {rank}: its trainable parameters differ from {job.manifest}'s stage {rank} "
                      f"({len(names)} vs {len(expected)}); the manifest is from another model or settings, start "
                      "the run again with `zl train --runtime torch`.")
    source = loaded.source
    del loaded, peft_model, modules  # the other stages' layers go with them
    gc.collect()
    release_free_memory()
    return module, names, source


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim): the other stages' layers, freed after
    the whole model was loaded, would otherwise stay in this rank's RSS. Nothing happens without glibc."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def train_stage(job: TorchJob, rank: int, world: int, device: torch.device, backend: str) -> None:
    from zl_device.run.eager_training import OptimizerSettings, StageStep, micro_batch
    from zl_device.run.torch_link import StageLink
    from zl_device.run.windows import WindowPlan
    from zl_export.manifest import read_manifest_file
    from zl_export.shard import load_shard

    manifest = read_manifest_file(Path(job.manifest))
    if world != len(manifest["stages"]):
        raise ZLError(f"{world} ranks for the {len(manifest['stages'])} stages of {job.manifest}; start exactly one "
                      f"rank per stage (torchrun --nproc-per-node {len(manifest['stages'])}).")
    first, last = rank == 0, rank == world - 1
    batch, hidden = manifest["micro_batch"], manifest["model"]["hidden_size"]
    log = Telemetry(Path(job.metrics_dir) / f"stage_{rank}" / "metrics.jsonl")
    start = time.time()
    module, names, weights = build_stage(job, manifest, rank)
    module.to(device)
    shard = load_shard(job.shard) if first else None
    plan = WindowPlan(job.num_micro_batches, job.window_size)
    step = StageStep(module, job.lr[rank],
                     OptimizerSettings(lr=job.lr[rank], weight_decay=job.weight_decay, schedule=job.schedule),
                     plan.num_windows)
    link = StageLink(rank, world, batch, hidden, device, job.in_flight, job.link_timeout_s,
                     receive_ahead=backend == "gloo")
    setup_s = time.time() - start
    setup_peak = reset_peak_rss()  # the done line's train_peak_rss_mib: training's peak, not the model load's
    # The run starts when every stage is built: process start and model load are not its time. No receive is
    # posted before the barrier: on NCCL a p2p op queued ahead of a collective can deadlock it.
    dist.barrier()
    stage_root = Path(job.checkpoint_dir) / f"stage_{rank}"
    resumed = resume_window(job, rank, stage_root, step, names, device) if job.resume else None
    first_window = 0 if resumed is None else resumed + 1
    if not first:
        link.start_receiving(plan.start(first_window), plan.num_micro_batches)
    log.write({"type": "start", "t_unix_ms": int(time.time() * 1000), "stage": rank, "num_stages": world,
               "pid": os.getpid(), "first_micro_batch": plan.start(first_window),
               "resumed_from_window": resumed, "listen_port": None, "runtime": "torch", "backend": backend,
               "device": str(device), "setup_s": round(setup_s, 3), "weights": weights, "config": asdict(job)})
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for w in range(first_window, plan.num_windows):
        step.start_window()
        for mb in plan.micro_batches(w):
            if job.fail_at == [rank, mb]:
                os.kill(os.getpid(), signal.SIGKILL)  # --inject-failure: die as a crashed process does
            t0 = time.perf_counter()
            if first:
                x, mask, labels = (t.to(device) for t in micro_batch(shard, mb, batch, job.trim_padding))
            else:
                x, mask, labels = link.receive(mb, more=mb + 1 < plan.num_micro_batches)
            t1 = time.perf_counter()
            h = step.begin(x, mask)  # (B, L, D)
            t2 = time.perf_counter()
            send_ms = link.send(mb, h, mask, labels) if not last else 0.0  # early forwarding: before phase 2
            t3 = time.perf_counter()
            loss, task, consistency = step.finish(labels)
            t4 = time.perf_counter()
            log.write({"type": "micro_batch", "t_unix_ms": int(time.time() * 1000), "stage": rank, "window": w,
                       "micro_batch": mb, "phase1_ms": (t2 - t1) * 1e3, "phase2_ms": (t4 - t3) * 1e3,
                       "queue_ms": (t1 - t0) * 1e3, "send_ms": send_ms, "total_ms": (t4 - t0) * 1e3,
                       # PSS only on window lines: reading smaps_rollup costs ~10 ms, a tiny stage's whole step.
                       "loss": loss, "task_loss": task, "consistency_loss": consistency, "pss_mib": None,
                       "temperature_c": None, "early_forwarding": True})
        lr, means = step.end_window()
        flush_ms = link.flush()  # as the runner: commit only what downstream holds
        c0 = time.perf_counter()
        save_window(job, rank, w, plan, {names[id(p)]: p for p in step.params}, step.moments(names),
                    step.optimizer_step, lr)
        log.write({"type": "window", "t_unix_ms": int(time.time() * 1000), "stage": rank, "window": w,
                   "micro_batches": len(plan.micro_batches(w)), "mean_loss": means[0], "mean_task_loss": means[1],
                   "mean_consistency_loss": means[2], "lr": lr, "step": step.optimizer_step,
                   "checkpoint_ms": (time.perf_counter() - c0) * 1e3, "flush_ms": flush_ms, "pss_mib": pss_mib(),
                   "temperature_c": None})
    link.flush()
    log.write({"type": "done", "t_unix_ms": int(time.time() * 1000), "stage": rank,
               "micro_batches": plan.num_micro_batches, "wall_s": round(time.time() - start, 3),
               "optimizer_step": step.optimizer_step, "link": link.stats(), **busy(cpu0, wall0, setup_peak)})


def save_window(job: TorchJob, rank: int, window: int, plan, tensors: dict[str, torch.Tensor],
                moments: dict[str, torch.Tensor], optimizer_step: int, lr: float) -> Path:
    """Stage `rank`'s checkpoint of `window` in the runner's format (torch_checkpoint.py), under the job's
    checkpoint_dir; `tensors` and `moments` by manifest name."""
    from zl_device.run.torch_checkpoint import save_checkpoint

    done = plan.micro_batches(window).stop
    return save_checkpoint(Path(job.checkpoint_dir) / f"stage_{rank}", window, tensors, moments,
                           {"run_id": job.run_id, "stage": rank, "window": window, "last_micro_batch": done - 1,
                            "micro_batches_done": done, "optimizer_step": optimizer_step, "lr": lr,
                            "extra": {"runtime": "torch", "pipeline": job.pipeline, "window_size": job.window_size,
                                      "num_micro_batches": job.num_micro_batches}},
                           job.keep_last)


def resume_window(job: TorchJob, rank: int, stage_root: Path, step, names: dict[int, str],
                  device: torch.device) -> int | None:
    """Restore the latest window every stage has checkpointed (the ranks agree on it with an all-reduce MIN):
    parameters, AdamW moments, step and lr; this stage's later windows are removed (the replay recomputes them,
    bit for bit). Returns that window, or None when some stage has none (the run starts over).

    Raises:
        ZLError: this stage lacks the common window, or the checkpoint is of another run or stage.
    """
    import shutil
    import warnings

    from safetensors.torch import load_file

    from zl_device.run.checkpoints import DEFAULT_LAYOUT as layout

    mine = layout.windows(stage_root) if stage_root.is_dir() else []
    latest = torch.tensor([mine[-1] if mine else -1], dtype=torch.int64, device=device)
    dist.all_reduce(latest, op=dist.ReduceOp.MIN)
    window = int(latest.item())
    for later in [w for w in mine if w > window]:
        shutil.rmtree(stage_root / layout.window_name(later))
    if window < 0:
        return None
    if window not in mine:
        raise ZLError(f"stage {rank}: no checkpoint of window {window} in {stage_root} (it has {mine}), the latest "
                      "window every stage committed, so the run cannot resume; start a new run.")
    where = stage_root / layout.window_name(window)
    progress = json.loads((where / layout.progress_file).read_text())
    if progress.get("run_id") != job.run_id or progress.get("stage") != rank:
        raise ZLError(f"{where}: a checkpoint of run {progress.get('run_id')} stage {progress.get('stage')}, not of "
                      f"this run ({job.run_id}) stage {rank}; resume only the run directory that wrote it.")
    params, moments = load_file(str(where / layout.adapter_file)), load_file(str(where / "optimizer.safetensors"))
    done = progress["optimizer_step"]
    for p in step.params:
        name = names[id(p)]
        with torch.no_grad():
            p.copy_(params[name])
        step.optimizer.state[p] = {"step": torch.tensor(float(done)),
                                   "exp_avg": moments[f"{name}.exp_avg"].to(device),
                                   "exp_avg_sq": moments[f"{name}.exp_avg_sq"].to(device)}
    with warnings.catch_warnings():  # the schedule catches up without optimizer steps, on purpose
        warnings.simplefilter("ignore")
        for _ in range(done):
            step.scheduler.step()
    return window


def busy(cpu0: float, wall0: float, setup_peak_mib: float | None) -> dict:
    """Since (process CPU time, wall time) = (cpu0, wall0): train_s, cpu_s, busy share (CPU / wall: with one
    thread per rank the rest is waiting for neighbours, or for a CPU on an oversubscribed host); the peak RSS
    since `reset_peak_rss` (train_peak_rss_mib) and the process's, set-up included (peak_rss_mib: the larger of it
    and `setup_peak_mib`, what reset_peak_rss returned)."""
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    train_peak = peak_rss_mib()
    peaks = [m for m in (setup_peak_mib, train_peak) if m is not None]
    return {"train_s": round(wall, 4), "cpu_s": round(cpu, 4), "busy_share": round(cpu / wall, 4) if wall > 0 else None,
            "peak_rss_mib": max(peaks) if peaks else None, "train_peak_rss_mib": train_peak}


def reset_peak_rss() -> float | None:
    """Restart the kernel's peak-RSS count (VmHWM) at the current RSS: writing 5 to /proc/self/clear_refs
    (Linux >= 4.0). After set-up, so that the peak afterwards is what training needs: the whole model, loaded
    before the other stages' layers are freed, is not in it. Returns the peak before (MiB; None where the kernel
    has none). Where clear_refs is not writable the count goes on from the process start."""
    before = peak_rss_mib()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return before


def peak_rss_mib() -> float | None:
    """This process's peak RSS (MiB) since it started or since the last `reset_peak_rss`: VmHWM of
    /proc/self/status, anonymous and file-backed pages (a mapped file counts as far as it was read); None where
    there is none. Not getrusage's ru_maxrss: that survives exec, so a child started by a big parent would report
    the parent's peak."""
    from zl_device.devices.backend import sum_field_kib

    try:
        kib = sum_field_kib(Path("/proc/self/status").read_text(), "VmHWM")
    except OSError:
        return None
    return round(kib / 1024, 1) if kib is not None else None


class Telemetry:
    """JSON lines appended to a stage's metrics.jsonl, flushed per line (the runner's telemetry, §4.7)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


def pss_mib() -> float | None:
    """This process's proportional set size (MiB) from /proc/self/smaps_rollup; None where there is none."""
    from zl_device.devices.backend import sum_pss_kib

    try:
        kib = sum_pss_kib(Path("/proc/self/smaps_rollup").read_text())
    except OSError:
        return None
    return kib / 1024.0 if kib is not None else None


def spawned(index: int, job_path: str, world: int, init_method: str, attempt: int = 0) -> None:
    """torch.multiprocessing's entry point: rank `index` of `world` on this host, in the ranks' attempt `attempt`."""
    run_rank(TorchJob.load(job_path), index, world, index, world, init_method, attempt)


def main(argv: list[str] | None = None) -> int:
    """torchrun's entry point: `-m zl_device.run.torch_stage RUN_DIR/torch_job.json` (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR and MASTER_PORT from torchrun; TORCHELASTIC_RESTART_COUNT > 0 after a failure restarted the ranks,
    which then resume, `for_attempt`)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: torchrun --nproc-per-node K -m zl_device.run.torch_stage RUN_DIR/torch_job.json", file=sys.stderr)
        return 2
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        print(f"error: {', '.join(missing)} not set; start the ranks with torchrun (see the module's docstring).",
              file=sys.stderr)
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    try:
        run_rank(TorchJob.load(argv[0]), rank, world, int(os.environ.get("LOCAL_RANK", rank)),
                 int(os.environ.get("LOCAL_WORLD_SIZE", world)), "env://", attempt)
    except ZLError as e:
        if os.environ.get("ZL_DEBUG"):
            raise
        print(f"error: rank {rank}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
