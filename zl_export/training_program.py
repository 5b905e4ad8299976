"""Run a stage program in-process through ExecuTorch's Python runtime.

Used by `zl export --check`, the tests and the benchmarks; the device side
runs the same program from C++ (`android_app/native`).
"""

from dataclasses import dataclass
from pathlib import Path

import torch

from zl.errors import ZLError


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
        if not path.is_file():
            raise ZLError(f"{path}: no such program; run `zl export` first.")
        try:
            self._module = _load_for_executorch_for_training(str(path))
        except RuntimeError as e:
            raise ZLError(f"{path}: ExecuTorch could not load the program ({e}); is it a complete `zl export` output?") from e
        self.path = path
        self.output_names = output_names

    def step(self, *inputs: torch.Tensor) -> StepResult:
        outs = self._module.forward_backward("forward", list(inputs))
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
