"""Global recovery's rollback (zl_device/executorch/recovery.py `Recovery.roll_back`, docs/design#recovery-in-detail) on
local device folders: checkpoints and input-log entries after the last window every stage committed are removed, nothing
at or before it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from zl_base.errors import ZLError
from zl_device.devices.local import LocalDevice
from zl_device.executorch.coordinator import Coordinator, StagePlan
from zl_device.executorch.device_files import input_log_entry_micro_batch, input_log_entry_window
from zl_device.formats.windows import WindowPlan


def _stage(root: Path, k: int, windows: list[int], log_windows: list[int]) -> StagePlan:
    device = LocalDevice(f"local-{k}", str(root / f"local-{k}"))
    ckpt = root / f"local-{k}" / "checkpoints"
    for w in windows:
        (ckpt / f"window_{w:06d}").mkdir(parents=True)
        (ckpt / f"window_{w:06d}" / "progress.json").write_text(f'{{"micro_batches_done": {4 * (w + 1)}}}')
    (ckpt / "input_log").mkdir(parents=True, exist_ok=True)
    for w in log_windows:
        for mb in range(4 * w, 4 * w + 4):
            (ckpt / "input_log" / f"entry-{mb:020d}-w{w:020d}.zlf").write_bytes(b"frame")
    return StagePlan(k, device, f"stage_{k}.json", "metrics.jsonl", "checkpoints", 100)


def test_rollback_removes_checkpoints_and_input_log_entries_after_the_common_window(tmp_path):
    # Stage 2 is ahead: it committed window 3 and logged window 4's inputs; stage 1 only committed window 1 and holds
    # the inputs of windows 2-4 (sent before the failure). A restart at window 2 must not find window 2-4 entries
    # from before it: upstream sends them again.
    plans = [_stage(tmp_path, 0, [0, 1, 2], []), _stage(tmp_path, 1, [0, 1], [2, 3, 4]),
             _stage(tmp_path, 2, [1, 2, 3], [4])]
    coordinator = Coordinator(plans, WindowPlan(32, 4), recovery="global")
    common, replayed, _ = coordinator.recovery.roll_back()
    assert common == 1
    for k in range(3):
        folder = tmp_path / f"local-{k}" / "checkpoints"
        assert sorted(p.name for p in folder.glob("window_*")) == [f"window_{w:06d}" for w in (0, 1) if k < 2
                                                                  or w == 1]
        assert [input_log_entry_window(p.name) for p in (folder / "input_log").iterdir()] == []
    assert all(s.micro_batches_done == 8 and s.last_committed_window == 1 for s in coordinator.status)


def test_input_log_entry_names():
    assert input_log_entry_window(f"entry-{7:020d}-w{1:020d}.zlf") == 1
    assert input_log_entry_window("entry-7-w12.zlf") == 12
    assert input_log_entry_micro_batch(f"entry-{7:020d}-w{1:020d}.zlf") == 7
    for other in ("entry-7-w12.zlf.tmp", "entry-7-w12.zlf.corrupt", "window_000001", "entry--w1.zlf"):
        assert input_log_entry_window(other) is None and input_log_entry_micro_batch(other) is None


def test_a_stage_that_fails_past_max_restarts_ends_the_run(tmp_path):
    """--max-restarts: the failure after the last allowed restart stops the run, naming the stage and the count."""
    plans = [_stage(tmp_path, k, [0], []) for k in range(2)]
    coordinator = Coordinator(plans, WindowPlan(32, 4), recovery="global", max_restarts=1)
    coordinator.status[1].restarts = 1
    with pytest.raises(ZLError, match="stage 1 failed 2 times .exited with status -9.; giving up"):
        coordinator._failed(1, time.monotonic(), "exited with status -9")
    assert coordinator.events[-1]["type"] == "failure" and coordinator.events[-1]["stage"] == 1
