"""The files a stage keeps on its device, as the coordinator reads and prunes them (docs/design#recovery-in-detail): its
window checkpoints, its accumulator snapshot and its input log; where a restart continues from them, and the runner's
error output.

`DeviceFiles` holds no state of its own: recovery.py and pauses.py ask it about a stage's files through the
`StagePlan` they work on (stage_table.py).
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import replace

from zl_base.json_reader import loads
from zl_device.devices.backend import Device
from zl_device.executorch.stage_table import StagePlan
from zl_device.formats.checkpoints import DEFAULT_LAYOUT, CheckpointLayout, snapshot_metadata
from zl_device.formats.runner_config import RunnerConfig
from zl_device.formats.windows import WindowPlan

log = logging.getLogger(__name__)

# How long a local restart waits for outputs the failed stage sent just before it died to reach the next stage's
# input log (in its socket buffer, or being fsynced) before it gives up the failed stage's accumulator snapshot.
IN_FLIGHT_GRACE_S = 3.0


class DeviceFiles:
    """A stage's checkpoints, accumulator snapshot and input log on its device (module docstring)."""

    def __init__(self, windows: WindowPlan, layout: CheckpointLayout = DEFAULT_LAYOUT):
        self.windows = windows
        self.layout = layout

    def checkpoint_windows(self, plan: StagePlan) -> list[int]:
        return self.layout.window_numbers(plan.device.listdir(plan.checkpoint_dir))

    def latest_checkpoint_window(self, plan: StagePlan) -> int:
        windows = self.checkpoint_windows(plan)
        return windows[-1] if windows else -1

    def latest_checkpoint_mb(self, plan: StagePlan) -> int:
        """micro_batches_done of the stage's latest checkpoint (0 without one)."""
        w = self.latest_checkpoint_window(plan)
        if w < 0:
            return 0
        text = plan.device.read_text(self.layout.device_progress(plan.checkpoint_dir, w))
        try:
            done = json.loads(text or "{}").get("micro_batches_done", self.windows.done_after(w))
            return done if isinstance(done, int) and not isinstance(done, bool) else self.windows.done_after(w)
        except (ValueError, AttributeError, RecursionError):  # damaged: the runner refuses it itself on --resume
            return self.windows.done_after(w)

    def resume_point_mb(self, plan: StagePlan) -> int:
        """Where a restart of the stage continues: its accumulator snapshot's micro_batches_done when that continues
        the window after its latest checkpoint (the runner's check, accumulator_snapshot.h), else the
        checkpoint's."""
        window = self.latest_checkpoint_window(plan)
        committed = self.latest_checkpoint_mb(plan)
        path = self.layout.device_accumulator(plan.checkpoint_dir)
        meta = snapshot_metadata(_read_bytes(plan.device, path)) if plan.device.exists(path) else None
        try:
            done, accumulated = int(meta["micro_batches_done"]), int(meta["accumulated"])
            usable = (int(meta["window"]) == window + 1 and int(meta["stage"]) == plan.index
                      and 0 < accumulated and done == committed + accumulated
                      and done < min(self.windows.done_after(window + 1), self.windows.num_micro_batches))
        except (TypeError, KeyError, ValueError):
            usable = False
        return done if usable else committed

    def drop_snapshot_of_lost_sends(self, plan: StagePlan, down: StagePlan | None, grace_s: float = 0.0) -> None:
        """Remove the stage's accumulator snapshot when the next stage (`down`; None: it is the last) lacks an output
        of a micro-batch it covers, so that the restart replays the window from the checkpoint (exact,
        docs/design#recovery-in-detail) and sends those again.

        A snapshot is written after a micro-batch's phase 2, not once downstream acknowledged its hidden state (that
        holds only at a commit, docs/design#window-end): sent entries still un-acknowledged live in the sender's
        memory and die with its process. A restart continuing from the snapshot never computes them again, and the
        next stage would wait for them forever (the run of `--max-restarts 0 --inject-failure 1@1`, then `--resume`:
        stage 0 went on to a snapshot of micro-batches 8-10, stage 1 had logged up to 7). Checked after the kill,
        against what the next stage holds durably: everything below its latest checkpoint, plus its input log. A
        next stage that commits meanwhile only makes that look smaller, so a race costs a replay, never a hang.

        `grace_s`: while the next stage still runs (a local restart), an output the killed stage sent just before
        it died may still sit in the next stage's socket buffer, on its way to the log; wait up to this long for
        the missing entries to land before giving up the snapshot (on a loaded host the receiver can lag).
        """
        if down is None:
            return  # the last stage sends nothing
        committed, resume_at = self.latest_checkpoint_mb(plan), self.resume_point_mb(plan)
        if resume_at <= committed:
            return  # no usable snapshot: the restart replays from the checkpoint anyway
        deadline = time.monotonic() + grace_s
        while True:
            held_below = self.latest_checkpoint_mb(down)
            logged = {mb for name in down.device.listdir(self.layout.device_input_log(down.checkpoint_dir))
                      if (mb := input_log_entry_micro_batch(name)) is not None}
            missing = [mb for mb in range(committed, resume_at) if mb >= held_below and mb not in logged]
            if not missing or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if missing:
            log.info("stage %d: accumulator snapshot (micro-batches %d-%d) not used: stage %d never received "
                     "micro-batch %d; replaying from the checkpoint (micro-batch %d)", plan.index, committed,
                     resume_at - 1, down.index, missing[0], committed)
            plan.device.remove(self.layout.device_accumulator(plan.checkpoint_dir))

    def remove_checkpoints_after(self, plan: StagePlan, window: int) -> None:
        for w in self.checkpoint_windows(plan):
            if w > window:
                plan.device.remove(self.layout.device_window(plan.checkpoint_dir, w))

    def remove_input_log_after(self, plan: StagePlan, window: int) -> None:
        """Input-log entries of windows after `window`: after a rollback upstream sends them again, and stale
        ones left in the log would count against the link's in-flight depth (the receiver stops reading)."""
        folder = self.layout.device_input_log(plan.checkpoint_dir)
        for name in plan.device.listdir(folder):
            entry_window = input_log_entry_window(name)
            if entry_window is not None and entry_window > window:
                plan.device.remove(f"{folder}/{name}")

    def remove_accumulator(self, plan: StagePlan) -> None:
        plan.device.remove(self.layout.device_accumulator(plan.checkpoint_dir))

    def clear_hold(self, plan: StagePlan) -> None:
        """Drop hold_at_micro_batch from the stage's config on its device, so the restart runs through."""
        text = plan.device.read_text(plan.config)
        if not text:
            return
        label, fix = f"{plan.device.name}:{plan.config}", "redeploy the stage"
        cfg = RunnerConfig.from_json(loads(text, label, fix), label, fix)
        if cfg.hold_at_micro_batch != -1:
            plan.device.write_text(plan.config, json.dumps(replace(cfg, hold_at_micro_batch=-1).to_json(), indent=2)
                                   + "\n")


_INPUT_LOG_ENTRY = re.compile(r"entry-(\d+)-w(\d+)\.zlf")


def input_log_entry_window(name: str) -> int | None:
    """The window of an input-log file `entry-<micro_batch>-w<window>.zlf` (runner/include/zl/input_log.h);
    None for any other name."""
    match = _INPUT_LOG_ENTRY.fullmatch(name)
    return int(match.group(2)) if match else None


def input_log_entry_micro_batch(name: str) -> int | None:
    """The micro-batch of an input-log file `entry-<micro_batch>-w<window>.zlf`; None for any other name (a `.tmp`
    being written, a `.corrupt` one)."""
    match = _INPUT_LOG_ENTRY.fullmatch(name)
    return int(match.group(1)) if match else None


def _read_bytes(device: Device, path: str) -> bytes:
    """A binary file of a device: read in place where its files are on this host, else pulled (read_from is
    text-only over adb)."""
    if device.files_on_host:
        return device.read_from(path, 0)
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "file"
        device.pull(path, local)
        return local.read_bytes()


def stderr_tail(device: Device, lines: int = 5) -> str:
    """The last `lines` non-empty lines of the runner's error output on `device`, on one line."""
    text = device.read_text("runner.err") or ""
    tail = [ln for ln in text.strip().splitlines() if ln.strip()][-lines:]
    return " | ".join(tail) or "(no output)"
