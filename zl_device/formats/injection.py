"""--inject-failure STAGE@WINDOW: a failure injected into a run, the same way in both runtimes.

The ExecuTorch runtime parks the stage's runner after the middle micro-batch of the window and the coordinator
SIGKILLs it there (zl_device/executorch/coordinator.py); the torch runtime's rank dies at that micro-batch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from zl_base.errors import ZLError
from zl_device.formats.windows import WindowPlan


@dataclass(frozen=True)
class Injection:
    """--inject-failure STAGE@WINDOW: kill `stage` with SIGKILL in the middle of `window` (0-based)."""

    stage: int
    window: int

    @staticmethod
    def parse(text: str, num_stages: int, num_windows: int) -> Injection:
        m = re.fullmatch(r"\s*(\d+)\s*@\s*(\d+)\s*", text)
        if not m:
            raise ZLError(f"--inject-failure {text!r}: expected STAGE@WINDOW, e.g. 1@2 (stage 1 in window 2).")
        stage, window = int(m.group(1)), int(m.group(2))
        if stage >= num_stages:
            raise ZLError(f"--inject-failure {text}: stage {stage} does not exist; stages are 0-{num_stages - 1}.")
        if window >= num_windows:
            raise ZLError(f"--inject-failure {text}: window {window} does not exist; the run has windows "
                          f"0-{num_windows - 1}.")
        return Injection(stage, window)

    def hold_micro_batch(self, windows: WindowPlan) -> int:
        """The micro-batch the stage parks after (the runner) or dies at (torch): the middle of the window."""
        return windows.middle(self.window)
