"""Run a stage program in-process through ExecuTorch's Python runtime.

Used by `zl export --check`, the tests and the benchmarks; the device side
runs the same program from C++ (`runner/`).
"""

import contextlib
import os
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from zl_base.errors import ZLError


# The `.pte` container: a flatbuffer whose file identifier "ET12" sits at bytes
# 4..8, followed at byte 8 by the extended header
# (magic "eh00", u32 header length, u64 program size, u64 segment base offset,
# u64 segment data size; little-endian). Segments hold the constant weights.
_PTE_IDENTIFIER = b"ET12"
_EXTENDED_HEADER = struct.Struct("<4sIQQQ")


def check_program_file(path: Path) -> None:
    """Check a `.pte` file's header and that its segments fit in the file.

    ExecuTorch's loader maps the file lazily, so a truncated program (an
    interrupted copy or `adb push`) loads without complaint and fails, or
    crashes, only when a method reads the missing bytes. This checks up front.

    Raises:
        ZLError: the file is missing, not an ExecuTorch program, or truncated.
    """
    path = Path(path)
    if not path.is_file():
        raise ZLError(f"{path}: no such program; run `zl export` first.")
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8 + _EXTENDED_HEADER.size)
    if len(head) < 8 or head[4:8] != _PTE_IDENTIFIER:
        raise ZLError(f"{path}: not an ExecuTorch program (no {_PTE_IDENTIFIER.decode()} identifier at byte 4); "
                      "pass a stage_<k>.pte written by `zl export`.")
    if len(head) < 8 + _EXTENDED_HEADER.size:
        raise ZLError(f"{path}: truncated ExecuTorch program ({size} bytes); export or copy it again.")
    magic, _, program_size, segment_base, segment_size = _EXTENDED_HEADER.unpack(head[8:])
    if magic != b"eh00":
        return  # an older container without an extended header: nothing more to check
    need = max(program_size, segment_base + segment_size if segment_size else 0)
    if size < need:
        raise ZLError(f"{path}: truncated ExecuTorch program: {size} bytes, its header says {need}; "
                      "export or copy it again.")


# ExecuTorch's thread pool probes the CPU on first use and logs every /sys file
# it could not open straight to file descriptor 2; on x86 hosts all of them fail.
# The probe runs once per process, so only the first load and step are filtered.
_NATIVE_NOISE = ("cpuinfo_utils.cpp",)
_probe_done = False


@contextlib.contextmanager
def _filtered_native_stderr():
    """Pass native stderr through, minus the CPU-probe lines of _NATIVE_NOISE."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [ln for ln in captured.read().decode(errors="replace").splitlines(keepends=True)
                    if not any(noise in ln for noise in _NATIVE_NOISE)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


@dataclass
class StepResult:
    """User outputs by name (`hidden`, `loss`, `task_loss`, `consistency_loss`) and gradients by program name."""

    outputs: dict[str, torch.Tensor]
    gradients: dict[str, torch.Tensor]


class TrainingProgram:
    """A loaded `stage_<k>.pte`; `step` runs its joint forward+backward once."""

    def __init__(self, path: Path, output_names: list[str]):
        """
        Args:
            path: the `.pte` file.
            output_names: names of the user outputs, in order (from the manifest).

        Raises:
            ZLError: the file is missing or ExecuTorch cannot load it.
        """
        from custom_ops import load_library

        load_library()
        from executorch.extension.training import _load_for_executorch_for_training

        path = Path(path)
        check_program_file(path)
        try:
            with contextlib.nullcontext() if _probe_done else _filtered_native_stderr():
                self._module = _load_for_executorch_for_training(str(path))
        except RuntimeError as e:
            raise ZLError(f"{path}: ExecuTorch could not load the program ({e}); is it a complete `zl export` output?") from e
        self.path = path
        self.output_names = output_names

    def step(self, *inputs: torch.Tensor) -> StepResult:
        global _probe_done
        with contextlib.nullcontext() if _probe_done else _filtered_native_stderr():
            outs = self._module.forward_backward("forward", list(inputs))
        _probe_done = True
        if len(outs) != len(self.output_names):
            raise ZLError(
                f"{self.path}: the program returned {len(outs)} user outputs, the manifest lists "
                f"{len(self.output_names)} ({', '.join(self.output_names)}); the manifest does not belong to this program."
            )
        grads = {k: v.clone() for k, v in self._module.named_gradients().items()}
        return StepResult(dict(zip(self.output_names, outs)), grads)

    def parameters(self) -> dict[str, torch.Tensor]:
        """The program's LoRA parameter tensors by program name (live views: writes change the program)."""
        return self._module.named_parameters()
