"""Reading the safetensors files a run leaves (checkpoints, merged adapters): readable, and finite.

    tensors = read_tensors(path, "checkpoint file runs/r1/.../adapter.safetensors", "merge another --window.")
    check_finite(tensors, "stage 1 window 3: checkpoint file ...", "merge an earlier --window.")

A file cut short or garbled is a one-line ZLError instead of safetensors' SafetensorError; a tensor holding nan or
inf is a damaged run (it diverged, or the file was damaged on disk): its weights would score NLL nan and generate
token 0 forever, so `zl merge`, `zl eval`, `zl generate` and a resumed torch stage refuse it, naming where it is.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from zl_base.errors import ZLError

if TYPE_CHECKING:
    import torch


def read_tensors(path: Path | str, label: str, fix: str) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file `path`.

    Args:
        label: how the error names the file, e.g. "--adapter runs/r1/adapter: adapter_model.safetensors".
        fix: the end of the error: what to do instead.

    Raises:
        ZLError: "<label>: not a readable safetensors file (<why>); <fix>" (truncated, garbled, unreadable).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ZLError(f"{label}: not a readable safetensors file ({e}); {fix}") from e


def check_finite(tensors: dict[str, torch.Tensor], label: str, fix: str) -> None:
    """Raise ZLError naming the first tensor (in name order) that holds nan or inf, how many of its values do, and
    `fix`; float tensors only (token ids and masks cannot be non-finite)."""
    import torch

    for name in sorted(tensors):
        t = tensors[name]
        if not t.is_floating_point():
            continue
        finite = torch.isfinite(t)
        if bool(finite.all()):
            continue
        bad = t[~finite]
        kinds = "nan" if bool(bad.isnan().all()) else "inf" if not bool(bad.isnan().any()) else "nan and inf"
        raise ZLError(f"{label}: {name} holds {bad.numel()} non-finite value(s) ({kinds}) of {t.numel()}, a damaged "
                      f"run; {fix}")
