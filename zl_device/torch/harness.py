"""The rank harness of the torch runtime: one stage of a torch job as one torch.distributed rank
(docs/design#torch-runtime).

Rank k joins the process group, builds stage k's `StageModule` in PyTorch eager
(the same modules and LoRA initialisation as the export,
zl_export.exporter.build_stage_modules), and trains it under the job's schedule
(schedules/: ZeroLock, or a backprop baseline) through its `Rank` (stage_io.py),
which writes the runner's telemetry and checkpoints (docs/design#checkpoints-on-disk, #telemetry),
so `zl merge` and `zl report` read them unchanged.

`zl train --runtime torch` writes RUN_DIR/torch_job.json and starts one process
per stage on this host (launcher.py, torch.multiprocessing spawn: `spawned`).
The same ranks run under torchrun, e.g. on a multi-GPU server (NCCL when CUDA is
there; `main`, also `python -m zl_device.torch`):

    torchrun --standalone --nproc-per-node 3 --max-restarts 3 -m zl_device.torch RUN_DIR/torch_job.json

Recovery is torch elastic's (docs/design#torch-runtime): when a rank fails, the
launcher (zl's, or torchrun's agent with `--max-restarts`) stops every rank and
starts them all again; a restarted rank (`for_attempt`) resumes from the latest
window every stage checkpointed and replays from there.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from zl_base.errors import ZLError
from zl_device.formats.run_layout import stage_metrics
from zl_device.torch.job import TorchJob, for_attempt
from zl_device.torch.schedules import schedule_named
from zl_device.torch.stage_io import Rank, Telemetry, reset_peak_rss
from zl_export.manifest import Manifest

BACKENDS = ("auto", "gloo", "nccl")


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
    job = for_attempt(job, attempt)
    schedule_named(job.pipeline)  # an unknown schedule fails before the process group
    torch.set_num_threads(job.threads)
    backend, device = backend_and_device(job.backend, local_rank, local_world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=job.link_timeout_s)
    store = attempt_store(world, attempt, timeout) if init_method == "env://" else None
    dist.init_process_group(backend, init_method=None if store is not None else init_method, store=store,
                            rank=rank, world_size=world, timeout=timeout)
    try:
        train_rank(job, rank, world, device, backend)
        dist.barrier()  # nobody leaves (and closes its connections) while a neighbour still reads
    finally:
        dist.destroy_process_group()


def train_rank(job: TorchJob, rank: int, world: int, device: torch.device, backend: str) -> None:
    """Stage `rank`'s whole run under the job's schedule, in the process group: build, barrier, resume point,
    `start` line, the schedule's windows, `done` line."""
    from zl_export.manifest import read_manifest

    schedule_class = schedule_named(job.pipeline)
    manifest = read_manifest(job.manifest)
    stages = manifest.num_stages
    if world != stages:
        raise ZLError(f"{world} ranks for the {stages} stages of {job.manifest}; start exactly one rank per stage "
                      f"(torchrun --nproc-per-node {stages}).")
    log = Telemetry(stage_metrics(Path(job.metrics_dir), rank))
    started = time.time()
    module, names, weights = build_stage(job, manifest, rank)
    module.to(device)
    stage = Rank(job, rank, world, device, backend, manifest, module, names, log, started)
    schedule = schedule_class(stage)
    setup_s = time.time() - started
    setup_peak = reset_peak_rss()  # the done line's train_peak_rss_mib: training's peak, not the model load's
    # The run starts when every stage is built: process start and model load are not its time. No schedule posts
    # a receive before the barrier: on NCCL a p2p op queued ahead of a collective can deadlock it.
    dist.barrier()
    resumed = stage.resume(schedule.optimizer, schedule.scheduler) if job.resume and schedule.resumable else None
    first_window = 0 if resumed is None else resumed + 1
    stage.write_start(first_window, resumed, setup_s, weights, setup_peak, forward_only=schedule.forward_only)
    extra = schedule.train(first_window)
    stage.write_done(schedule.scheduler.last_epoch, **extra)


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


def build_stage(job: TorchJob, manifest: Manifest, rank: int):
    """(stage `rank`'s StageModule, its trainable parameters' manifest names by id, where its weights came from).

    The rank loads only its stage's weights where the model's files allow (`load_stage_model`: a GGUF file or a
    model directory with safetensors); otherwise, and for lens translators (fitted through every stage), it loads
    the whole model and frees the other stages' layers."""
    from zl_export.exporter import build_stage_modules, manifest_names
    from zl_export.frozen_weights import compact_for_training
    from zl_export.model_source import load_model, load_stage_model
    from zl_export.shard import load_shard
    from zl_export.translator import calibration_batches

    opts = manifest.options
    lens = opts.loss.translator_rank and opts.loss.translator_init == "lens"
    if lens:  # fitting the lenses runs the calibration rows through every stage: the whole model
        loaded = load_model(job.model, seed=opts.seed)
    else:  # this stage's weights only, where the model's files allow (load_stage_model)
        first, last = manifest.stages[rank].layers
        loaded = load_stage_model(job.model, first, last, embedding=rank == 0, seed=opts.seed)
    calibration = calibration_batches(load_shard(job.shard)) if lens else None  # as the export fits them
    peft_model, modules = build_stage_modules(
        loaded.model, [st.range for st in manifest.stages], opts, calibration)
    module = modules[rank]
    compact_for_training(module)  # bf16/int8: the compact weights only, never float32 copies
    names = manifest_names(module, peft_model)
    names = {id(p): names[id(p)] for p in module.parameters() if p.requires_grad}
    expected = {p.name for p in manifest.stages[rank].parameters}
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


def spawned(index: int, job_path: str, world: int, init_method: str, attempt: int = 0) -> None:
    """torch.multiprocessing's entry point: rank `index` of `world` on this host, in the ranks' attempt `attempt`."""
    run_rank(TorchJob.load(job_path), index, world, index, world, init_method, attempt)


def main(argv: list[str] | None = None) -> int:
    """torchrun's entry point: `-m zl_device.torch RUN_DIR/torch_job.json` (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR and MASTER_PORT from torchrun; TORCHELASTIC_RESTART_COUNT > 0 after a failure restarted the ranks,
    which then resume, `for_attempt`)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: torchrun --nproc-per-node K -m zl_device.torch RUN_DIR/torch_job.json", file=sys.stderr)
        return 2
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        print(f"error: {', '.join(missing)} not set; start the ranks with torchrun (see zl_device/torch/harness.py).",
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
