"""A torch rank's checkpoints, in the runner's format (docs/design#checkpoints-on-disk), so `zl merge` reads them.

    <root>/stage_<k>/window_000012/adapter.safetensors    the stage's trainable tensors, manifest names, F32
                                  /optimizer.safetensors  "<name>.exp_avg", "<name>.exp_avg_sq", F32
                                  /progress.json          format "zl-checkpoint", version 1, run_id, stage, window, ...

As the runner does: written into `.tmp-window_000012-<pid>/`, each file and the
directory fsynced, renamed into place (the rename is the commit), the oldest
windows beyond `keep_last` removed afterwards. `read_checkpoint` loads one back
for a restarted rank (stage_io.Rank.resume). File names: formats/checkpoints.py.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from zl_base.errors import ZLError
from zl_base.json_reader import read_typed
from zl_device.formats.checkpoints import DEFAULT_LAYOUT
from zl_device.formats.tensor_files import check_finite, read_tensors

FORMAT_VERSION = 1


def save_checkpoint(stage_root: Path, window: int, tensors: dict[str, torch.Tensor], moments: dict[str, torch.Tensor],
                    progress: dict, keep_last: int = 2) -> Path:
    """Write one window's checkpoint of a stage and return its directory.

    Args:
        stage_root: RUN_DIR/checkpoints/stage_<k>.
        tensors: the stage's trainable tensors by manifest name.
        moments: AdamW moments, `<name>.exp_avg` / `<name>.exp_avg_sq`.
        progress: run_id, stage, window, last_micro_batch, micro_batches_done, optimizer_step, lr, extra.
    """
    from safetensors.torch import save_file

    layout = DEFAULT_LAYOUT
    stage_root.mkdir(parents=True, exist_ok=True)
    final = stage_root / layout.window_name(window)
    tmp = stage_root / f".tmp-{layout.window_name(window)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    metadata = {"format": "pt", "run_id": str(progress["run_id"]), "window": str(window)}
    cpu = {n: t.detach().to("cpu", torch.float32).contiguous() for n, t in tensors.items()}
    save_file(cpu, str(tmp / layout.adapter_file), metadata=metadata)
    save_file({n: t.detach().to("cpu", torch.float32).contiguous() for n, t in moments.items()},
              str(tmp / layout.optimizer_file), metadata=metadata)
    record = {"format": "zl-checkpoint", "version": FORMAT_VERSION, **progress,
              "created_unix_ms": int(time.time() * 1000),
              "params": [{"name": n, "shape": list(t.shape)} for n, t in cpu.items()]}
    (tmp / layout.progress_file).write_text(json.dumps(record, indent=2) + "\n")
    for name in (layout.adapter_file, layout.optimizer_file, layout.progress_file):
        _fsync(tmp / name)
    _fsync(tmp)
    if final.exists():  # a rerun of the same window replaces it
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(stage_root)
    for old in layout.windows(stage_root)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(stage_root / layout.window_name(old), ignore_errors=True)
    return final


def read_checkpoint(where: Path, run_id: str, stage: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor],
                                                                   dict]:
    """(tensors, AdamW moments, progress) of the window checkpoint `where` (a window_NNNNNN directory). An
    optimizer file marked as all-zero moments without tensors (the runner writes one for a stage held still,
    docs/design#checkpoints-on-disk) reads as zeros of the tensors' shapes.

    Raises:
        ZLError: the checkpoint is of another run or stage, a file is unreadable, or a weight or moment is nan or
            inf (a damaged run: resuming would train on from it).
    """
    from safetensors import safe_open

    layout = DEFAULT_LAYOUT
    fix = "the checkpoint is damaged; start the run again without --resume"
    progress = read_typed(where / layout.progress_file, dict[str, Any], str(where / layout.progress_file), fix)
    if progress.get("run_id") != run_id or progress.get("stage") != stage:
        raise ZLError(f"{where}: a checkpoint of run {progress.get('run_id')} stage {progress.get('stage')}, not of "
                      f"this run ({run_id}) stage {stage}; resume only the run directory that wrote it.")
    label = f"stage {stage} window {progress.get('window')}: checkpoint file {where}"
    fix = "the run diverged or the file was damaged, so it cannot resume from it; start it again (with a lower --lr)."
    tensors, moments = (read_tensors(where / name, f"{label}/{name}", fix)
                        for name in (layout.adapter_file, layout.optimizer_file))
    for name, found in ((layout.adapter_file, tensors), (layout.optimizer_file, moments)):
        check_finite(found, f"{label}/{name}", fix)
    if not moments:
        key, value = layout.zero_moments
        with safe_open(str(where / layout.optimizer_file), "pt") as f:
            if (f.metadata() or {}).get(key) == value:
                moments = {f"{n}.{m}": torch.zeros_like(t) for n, t in tensors.items()
                           for m in ("exp_avg", "exp_avg_sq")}
    return tensors, moments, progress


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
