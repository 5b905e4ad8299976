"""The split of consecutive layers over the stages that paces the pipeline fastest and fits every device.

A pipeline trains one micro-batch per interval of its slowest stage: every other stage waits for it. So the best
split of L layers over K devices (stage k on device k, in --devices order) minimises the largest stage time

    max_k  cost(k, first_k, last_k)      subject to  fits(k, first_k, last_k) for every k,

where stage k owns layers first_k..last_k, the ranges are consecutive, each holds at least one layer and together
they cover 0..L-1. Among the splits that reach that minimum the one with the smallest sum of stage times wins (its
fast stages waste the least; on a phone that is battery), then the one that gives earlier stages fewer layers.

`best_split` solves it exactly by dynamic programming over (stages placed, layers covered): O(K L^2) evaluations
of `cost` (K=3, L=30: 2,700), against the C(L-1, K-1) splits a search would try. It takes any cost per range, so
layers need not cost the same; the planner's costs are linear in the layer count (zl_device/plan/costs.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

#: (stage, first layer, last layer) -> milliseconds per micro-batch of that stage with those layers.
RangeCost = Callable[[int, int, int], float]
#: (stage, first layer, last layer) -> whether the device of that stage holds those layers (memory).
RangeFits = Callable[[int, int, int], bool]


@dataclass(frozen=True)
class Split:
    """Layer ranges per stage (inclusive), with the slowest stage's time and the sum of all stage times."""

    ranges: tuple[tuple[int, int], ...]
    slowest_ms: float
    total_ms: float

    @property
    def spec(self) -> str:
        """The split as --stages writes it, e.g. 0-12,13-20,21-29."""
        return ",".join(f"{a}-{b}" for a, b in self.ranges)

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(b - a + 1 for a, b in self.ranges)


def _at_most(value: float, bound: float) -> bool:
    """value <= bound up to rounding: the same sum computed in another order may differ in its last bits."""
    return value <= bound + 1e-9 * max(1.0, abs(bound))


def _less(value: float, than: float) -> bool:
    """value < than by more than rounding (a tie keeps the first split found: earlier stages fewer layers)."""
    return than == math.inf or value < than - 1e-9 * max(1.0, abs(than))


def best_split(num_layers: int, num_stages: int, cost: RangeCost, fits: RangeFits | None = None) -> Split | None:
    """The split minimising (slowest stage, sum of stages) lexicographically; None when no split fits.

    Raises:
        ValueError: fewer than one stage, or more stages than layers (the callers say so in the user's terms
            first).
    """
    if num_stages < 1 or num_stages > num_layers:
        raise ValueError(f"{num_stages} stages for {num_layers} layers")
    fits = fits or (lambda k, a, b: True)
    inf = math.inf
    L, K = num_layers, num_stages

    def ok(k: int, a: int, b: int) -> bool:
        return fits(k, a, b) and math.isfinite(cost(k, a, b))

    # Pass 1: slow[k][j] = the smallest possible slowest stage when stages 0..k-1 cover layers 0..j-1.
    slow = [[inf] * (L + 1) for _ in range(K + 1)]
    slow[0][0] = 0.0
    for k in range(1, K + 1):
        for j in range(k, L - (K - k) + 1):  # leave at least one layer to each later stage
            for i in range(k - 1, j):  # stage k-1 owns layers i..j-1
                if slow[k - 1][i] < inf and ok(k - 1, i, j - 1):
                    slow[k][j] = min(slow[k][j], max(slow[k - 1][i], cost(k - 1, i, j - 1)))
    bound = slow[K][L]
    if bound == inf:
        return None
    # Pass 2: among splits whose every stage is within `bound`, the smallest sum; parent[k][j] = i.
    total = [[inf] * (L + 1) for _ in range(K + 1)]
    parent = [[-1] * (L + 1) for _ in range(K + 1)]
    total[0][0] = 0.0
    for k in range(1, K + 1):
        for j in range(k, L - (K - k) + 1):
            for i in range(k - 1, j):
                if total[k - 1][i] == inf or not ok(k - 1, i, j - 1):
                    continue
                c = cost(k - 1, i, j - 1)
                if _at_most(c, bound) and _less(total[k - 1][i] + c, total[k][j]):
                    total[k][j], parent[k][j] = total[k - 1][i] + c, i
    ranges, j = [], L
    for k in range(K, 0, -1):
        i = parent[k][j]
        ranges.append((i, j - 1))
        j = i
    ranges.reverse()
    costs = [cost(k, a, b) for k, (a, b) in enumerate(ranges)]
    return Split(tuple(ranges), max(costs), sum(costs))


def evaluate(ranges: tuple[tuple[int, int], ...], cost: RangeCost) -> Split:
    """A given split with its slowest and summed stage times."""
    costs = [cost(k, a, b) for k, (a, b) in enumerate(ranges)]
    return Split(tuple(ranges), max(costs), sum(costs))
