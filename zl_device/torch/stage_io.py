"""What a schedule trains through on its rank: the stage, the plan, and the stage's I/O in the runner's formats.

`Rank` is the one place a torch rank writes: its telemetry lines (the runner's
kinds, docs/design#telemetry: `start`, `micro_batch`, `window`, `done`), its
window checkpoints (docs/design#checkpoints-on-disk, checkpoint.py) and, after a restart, reads its
checkpoint back (`resume`). Every schedule (schedules/) writes the same lines
and checkpoints through it, so `zl merge` and `zl report` read any of them.

    rank = Rank(...)                  the harness (harness.py) builds the stage and the Rank
    schedule = schedule_named(name)(rank)   set-up: optimizer, links, data
    rank.write_start(...)             after the ranks' barrier (and the resume point)
    schedule.train(first_window)      micro_batch lines (`rank.write`); per window `rank.commit`
    rank.write_done(...)
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from zl_base.errors import ZLError
from zl_device.formats.checkpoints import DEFAULT_LAYOUT
from zl_device.formats.lr_schedule import OptimizerSettings
from zl_device.formats.tensor_files import check_finite
from zl_device.formats.windows import WindowPlan
from zl_device.torch.checkpoint import read_checkpoint, save_checkpoint
from zl_device.torch.eager_training import adamw_moments
from zl_device.torch.job import TorchJob
from zl_export.manifest import Manifest
from zl_export.shard import Shard


class Telemetry:
    """JSON lines appended to a stage's metrics.jsonl, flushed per line (the runner's telemetry,
docs/design#telemetry)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


@dataclass
class Rank:
    """Stage `index` of `world` on this rank: its module, the job, and its telemetry and checkpoints."""

    job: TorchJob
    index: int
    world: int
    device: torch.device
    backend: str
    manifest: Manifest
    module: torch.nn.Module
    names: dict[int, str]  # id(trainable parameter) -> its manifest name
    log: Telemetry
    started: float = field(default_factory=time.time)  # time.time() before the stage was built: the done line's wall_s
    # (process CPU time, wall time, set-up's peak RSS) when training started (`write_start`); the last commit's end
    _clock: tuple[float, float, float | None] | None = field(default=None, init=False, repr=False)
    _window_t0: float = field(default=0.0, init=False, repr=False)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.world - 1

    @property
    def plan(self) -> WindowPlan:
        return WindowPlan(self.job.num_micro_batches, self.job.window_size)

    @property
    def batch(self) -> int:
        """B, rows per micro-batch (the manifest's)."""
        return self.manifest.options.micro_batch

    @property
    def lr(self) -> float:
        return self.job.lr[self.index]

    @property
    def forward_only(self) -> bool:
        """A stage held still (its role in the job) with the job's `forward_only_at_lr0`: ZeroLock runs its phase 1
        only, as the runner does (RunnerConfig::forward_only, docs/design#windows-and-adamw)."""
        return self.job.forward_only(self.index)

    @property
    def optimizer_settings(self) -> OptimizerSettings:
        return self.job.optimizer(self.index)

    @property
    def trainable(self) -> list[torch.nn.Parameter]:
        """The stage's trainable parameters (LoRA, readout translators), in module order: what a window commits."""
        return [p for p in self.module.parameters() if p.requires_grad]

    def shard(self) -> Shard:
        """The training shard (stage 0's input; the backprop baselines' last stage reads its labels too)."""
        from zl_export.shard import load_shard

        return load_shard(self.job.shard)

    # --- telemetry -------------------------------------------------------------------------------------

    def write(self, kind: str, **fields) -> None:
        """A telemetry line of `kind`: {"type", "t_unix_ms", "stage", **fields}."""
        self.log.write({"type": kind, "t_unix_ms": int(time.time() * 1000), "stage": self.index, **fields})

    def write_start(self, first_window: int, resumed: int | None, setup_s: float, weights: str,
                    setup_peak_mib: float | None, forward_only: bool = False) -> None:
        """The `start` line, after the ranks' barrier: the run's time starts here (process start and model load are
        not in it); the training clocks (CPU, wall, peak RSS) start too. `forward_only`: the schedule runs this
        stage's phase 1 only."""
        self.write("start", num_stages=self.world, pid=os.getpid(), first_micro_batch=self.plan.start(first_window),
                   resumed_from_window=resumed, listen_port=None, runtime="torch", pipeline=self.job.pipeline,
                   backend=self.backend, device=str(self.device), setup_s=round(setup_s, 3), weights=weights,
                   forward_only=forward_only, config=asdict(self.job))
        self._clock = (time.process_time(), time.perf_counter(), setup_peak_mib)
        self._window_t0 = time.perf_counter()

    def commit(self, window: int, optimizer: torch.optim.Optimizer, optimizer_step: int, lr: float,
               **fields) -> None:
        """Window `window` is done (its optimizer step taken): checkpoint the trainable parameters and AdamW's
        moments in the runner's format, then the `window` line (`fields`: mean_loss and the schedule's own).

        Raises:
            ZLError: the window's loss or a weight after its step is nan or inf (a damaged run, as the runner's
                StageRunner::end_window sees it): nothing is checkpointed, the last good window stays the newest.
        """
        self.refuse_non_finite(window, fields.get("mean_loss"))
        c0 = time.perf_counter()
        self.save_window(window, optimizer, optimizer_step, lr)
        now = time.perf_counter()
        self.write("window", window=window, micro_batches=len(self.plan.micro_batches(window)), **fields, lr=lr,
                   step=optimizer_step, window_ms=(now - self._window_t0) * 1e3, checkpoint_ms=(now - c0) * 1e3,
                   pss_mib=pss_mib(), temperature_c=None)
        self._window_t0 = time.perf_counter()

    def refuse_non_finite(self, window: int, mean_loss: float | None) -> None:
        """Raise ZLError (not retried: a restart would replay into the same values) when the window's loss or a
        trainable weight is nan or inf, naming the stage, the window and the last good checkpoint."""
        root, layout = self.checkpoint_root, DEFAULT_LAYOUT
        kept = layout.windows(root) if root.is_dir() else []
        label = f"stage {self.index} window {window}"
        fix = (f"not checkpointed; the stage stops with its last good checkpoint "
               f"({f'window {kept[-1]}' if kept else 'none yet'}). Lower the learning rate (--lr, --stage-lr) or check "
               "the data, and train again")
        if mean_loss is not None and not math.isfinite(mean_loss):
            raise ZLError(f"{label}: the mean loss is {mean_loss}, a damaged run (diverged?); {fix}")
        check_finite({self.names[id(p)]: p.detach() for p in self.trainable}, f"{label}: after the AdamW step", fix)

    def write_done(self, optimizer_step: int, **fields) -> None:
        """The `done` line: the run's micro-batches, wall time since set-up began, steps, the schedule's `fields`,
        and training's CPU, wall and memory figures (`busy`)."""
        cpu0, wall0, setup_peak = self._clock
        self.write("done", micro_batches=self.plan.num_micro_batches, wall_s=round(time.time() - self.started, 3),
                   optimizer_step=optimizer_step, **fields, **busy(cpu0, wall0, setup_peak))

    def fail_if_injected(self, micro_batch: int) -> None:
        """--inject-failure: SIGKILL this rank at `micro_batch` when the job says so, as a crashed process dies."""
        if self.job.fail_at == [self.index, micro_batch]:
            os.kill(os.getpid(), signal.SIGKILL)

    # --- checkpoints -----------------------------------------------------------------------------------

    @property
    def checkpoint_root(self) -> Path:
        """This stage's checkpoint folder: <job checkpoint_dir>/stage_<k>."""
        return DEFAULT_LAYOUT.stage_root(Path(self.job.checkpoint_dir), self.index)

    def save_window(self, window: int, optimizer: torch.optim.Optimizer, optimizer_step: int, lr: float) -> Path:
        """This stage's checkpoint of `window` in the runner's format (checkpoint.py): the trainable tensors and
        `optimizer`'s moments by manifest name."""
        job, done = self.job, self.plan.micro_batches(window).stop
        params = self.trainable
        return save_checkpoint(self.checkpoint_root, window, {self.names[id(p)]: p for p in params},
                               adamw_moments(optimizer, params, self.names),
                               {"run_id": job.run_id, "stage": self.index, "window": window,
                                "last_micro_batch": done - 1, "micro_batches_done": done,
                                "optimizer_step": optimizer_step, "lr": lr,
                                "extra": {"runtime": "torch", "pipeline": job.pipeline,
                                          "window_size": job.window_size, "num_micro_batches": job.num_micro_batches}},
                               job.keep_last)

    def resume(self, optimizer: torch.optim.Optimizer, scheduler) -> int | None:
        """Restore the latest window every stage has checkpointed (the ranks agree on it with an all-reduce MIN):
        the trainable parameters, `optimizer`'s AdamW moments and step, and `scheduler`'s lr; this stage's later
        windows are removed (the replay recomputes them, bit for bit). Returns that window, or None when some stage
        has none (the run starts over). Every rank must call it: the all-reduce is collective.

        Raises:
            ZLError: this stage lacks the common window, or the checkpoint is of another run or stage.
        """
        layout, root = DEFAULT_LAYOUT, self.checkpoint_root
        mine = layout.windows(root) if root.is_dir() else []
        latest = torch.tensor([mine[-1] if mine else -1], dtype=torch.int64, device=self.device)
        dist.all_reduce(latest, op=dist.ReduceOp.MIN)
        window = int(latest.item())
        for later in [w for w in mine if w > window]:
            shutil.rmtree(root / layout.window_name(later))
        if window < 0:
            return None
        if window not in mine:
            raise ZLError(f"stage {self.index}: no checkpoint of window {window} in {root} (it has {mine}), the "
                          "latest window every stage committed, so the run cannot resume; start a new run.")
        params, moments, progress = read_checkpoint(root / layout.window_name(window), self.job.run_id, self.index)
        done = progress["optimizer_step"]
        for p in self.trainable:
            name = self.names[id(p)]
            with torch.no_grad():
                p.copy_(params[name])
            optimizer.state[p] = {"step": torch.tensor(float(done)),
                                  "exp_avg": moments[f"{name}.exp_avg"].to(self.device),
                                  "exp_avg_sq": moments[f"{name}.exp_avg_sq"].to(self.device)}
        with warnings.catch_warnings():  # the schedule catches up without optimizer steps, on purpose
            warnings.simplefilter("ignore")
            for _ in range(done):
                scheduler.step()
        return window


# --- a rank's figures ---------------------------------------------------------------------------------


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


def pss_mib() -> float | None:
    """This process's proportional set size (MiB) from /proc/self/smaps_rollup; None where there is none."""
    from zl_device.devices.backend import sum_pss_kib

    try:
        kib = sum_pss_kib(Path("/proc/self/smaps_rollup").read_text())
    except OSError:
        return None
    return kib / 1024.0 if kib is not None else None
