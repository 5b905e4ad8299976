"""Where a run's checkpoints live: the runner's layout (runner/include/zl/checkpoint.h), in one place for Python.

    <checkpoint root>/stage_<k>/window_000012/adapter.safetensors   F32, PEFT names
    <checkpoint root>/stage_<k>/window_000012/optimizer.safetensors AdamW moments (`<name>.exp_avg`, `.exp_avg_sq`)
    <checkpoint root>/stage_<k>/window_000012/progress.json         stage, window, run_id, micro_batches_done, ...
    <checkpoint root>/stage_<k>/accumulator.safetensors             the window in progress's gradient sum so far

On a device a stage's runner writes the window directories into its own
`checkpoint_dir`; pulled to the host they sit under RUN_DIR/checkpoints/stage_<k>/.
The coordinator reads them on the devices (recovery), the merge on the host.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CheckpointLayout:
    """Where a stage's checkpoints live under the checkpoint root.

    `stage_dir` is formatted with the stage index `k` (the runner's
    `checkpoint_dir` per stage, relative to the root); window directories match
    `window_pattern` (the runner's `checkpoint_dir_name`: `window_` + 6 digits)
    and hold `adapter_file`, `optimizer_file` and `progress_file`. Anything else in a stage
    directory (the runner's `.tmp-*` of an interrupted save, `input_log/`) is
    ignored.
    """

    stage_dir: str = "stage_{k}"
    window_pattern: str = r"window_(\d+)"
    window_dir: str = "window_{window:06d}"
    adapter_file: str = "adapter.safetensors"
    optimizer_file: str = "optimizer.safetensors"
    progress_file: str = "progress.json"
    input_log_dir: str = "input_log"  # the runner's input_log_dir default, under checkpoint_dir
    #: the runner's accumulator snapshot (docs/design#recovery-in-detail)
    accumulator_file: str = "accumulator.safetensors"
    #: An optimizer file that holds no tensor because its moments are all zero (a stage held still that never
    #: stepped, docs/design#checkpoints-on-disk) says so in this metadata key and value (the runner's
    #: kZeroMomentsKey/Value).
    zero_moments: tuple[str, str] = ("moments", "zero")

    def stage_root(self, root: Path, k: int) -> Path:
        return Path(root) / self.stage_dir.format(k=k)

    def window_name(self, window: int) -> str:
        """window_000012 for window 12."""
        return self.window_dir.format(window=window)

    def window_numbers(self, names: Iterable[str]) -> list[int]:
        """The window numbers among directory entry `names`, ascending; other names are ignored."""
        pattern = re.compile(self.window_pattern)
        return sorted(int(m.group(1)) for n in names if (m := pattern.fullmatch(n)))

    def windows(self, stage_root: Path) -> list[int]:
        """Window numbers of the checkpoint directories under a host `stage_root`, ascending.

        The runner renames a window directory into place only once it is
        complete, so a listed window that lacks a file is corrupt (an error when
        read), not a save in progress.
        """
        return self.window_numbers(e.name for e in stage_root.iterdir() if e.is_dir())

    def device_window(self, checkpoint_dir: str, window: int) -> str:
        """A window's directory on a device, under the stage's runner `checkpoint_dir` (POSIX path)."""
        return posixpath.join(checkpoint_dir, self.window_name(window))

    def device_progress(self, checkpoint_dir: str, window: int) -> str:
        """A window's progress.json on a device."""
        return posixpath.join(self.device_window(checkpoint_dir, window), self.progress_file)

    def device_input_log(self, checkpoint_dir: str) -> str:
        """The stage's durable input log on a device (`zl train` leaves the runner's input_log_dir at its default)."""
        return posixpath.join(checkpoint_dir, self.input_log_dir)

    def device_accumulator(self, checkpoint_dir: str) -> str:
        """The stage's accumulator snapshot on a device (the window in progress, runner
        accumulator_snapshot.h)."""
        return posixpath.join(checkpoint_dir, self.accumulator_file)


def snapshot_metadata(data: bytes) -> dict | None:
    """The string metadata of an accumulator snapshot's safetensors header (`data`: the file's bytes, or at
    least its header); None for anything that is not a complete zl-accumulator version 1 header."""
    import json

    if len(data) < 8:
        return None
    size = int.from_bytes(data[:8], "little")
    if size > len(data) - 8:
        return None
    try:
        meta = json.loads(data[8:8 + size]).get("__metadata__") or {}
    except (ValueError, AttributeError):
        return None
    if meta.get("format") != "zl-accumulator" or meta.get("version") != "1":
        return None
    return meta


DEFAULT_LAYOUT = CheckpointLayout()
