"""Update windows: a run's micro-batches in windows of m, one AdamW step (and checkpoint) at each window's end.

    micro-batch:  0 1 2 3 | 4 5 6 7 | 8 9        (10 micro-batches, m = 4)
    window:       0       | 1       | 2          (3 windows; the last is short)

The runner (runner/) does the same arithmetic in C++.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated

from zl_base.json_reader import Bounds


@dataclass(frozen=True)
class WindowPlan:
    """`num_micro_batches` micro-batches in windows of `window_size`."""

    num_micro_batches: Annotated[int, Bounds(0)]
    window_size: Annotated[int, Bounds(1)]  # a file read back is checked against these (zl_base/json_reader.py)

    @staticmethod
    def for_samples(samples: int, micro_batch: int, window_size: int) -> WindowPlan:
        """The plan of a run over `samples` samples in micro-batches of `micro_batch` (the last may be short)."""
        return WindowPlan(math.ceil(samples / micro_batch), window_size)

    @property
    def num_windows(self) -> int:
        return math.ceil(self.num_micro_batches / self.window_size)

    def window_of(self, micro_batch: int) -> int:
        """The window micro-batch `micro_batch` (0-based) belongs to; with a count of done micro-batches, the
        window in flight."""
        return micro_batch // self.window_size

    def start(self, window: int) -> int:
        """The first micro-batch of `window`."""
        return window * self.window_size

    def micro_batches(self, window: int) -> range:
        """The micro-batches of `window` (the last window's may be fewer than `window_size`)."""
        return range(self.start(window), min(self.start(window + 1), self.num_micro_batches))

    def done_after(self, window: int) -> int:
        """Micro-batches done once `window` is committed (window -1: none)."""
        return (window + 1) * self.window_size

    def middle(self, window: int) -> int:
        """A micro-batch half-way through `window` (where failure injection parks a stage)."""
        return self.start(window) + max(0, self.window_size // 2 - 1)

    def exists(self, window: int) -> bool:
        """Whether the run has `window` (a window at or after the end has no micro-batch)."""
        return 0 <= window and self.start(window) < self.num_micro_batches
