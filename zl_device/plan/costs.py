"""What a device's stage costs, per micro-batch, as a function of its layer count: measured, then fitted.

A calibration round (calibrate.py) runs every device's stage with n layers for a few micro-batches; the runner's
telemetry (docs/design#telemetry) gives per micro-batch `phase1_ms` (input to the marker: the layers' forward),
`phase2_ms` (readout, loss, backward), `send_ms`, `queue_ms`, `total_ms` and `pss_mib`. From each round:

    phase1, phase2   medians over the micro-batches after the warm-up
    other            the smallest send_ms (sealing the hidden state; a larger one waited on back-pressure, which is
                     the downstream stage's time, not this one's) + the median of what total_ms has beyond input,
                     phases, send and, under a backprop schedule, the wait for the gradient (another stage's time;
                     docs/design#backprop-schedules): accumulating the gradients
    pss              the highest PSS the stage reached (MiB)

Two rounds at different layer counts give each quantity as `fixed + per_layer x n` (least squares over the
rounds). The model assumes every layer of the model costs the same (true of the Llama, Qwen and Phi-3 families;
Gemma 3's sliding-window layers are cheaper than its global ones only beyond the window) and that the fixed part
(embedding, readout, loss, the runtime) does not change with n. A slope that comes out below zero (noise on a busy
host) is taken as zero, the mean as the fixed part. Not counted: the AdamW step, flush and checkpoint at each
window end (once per window, not per micro-batch).

A stage held still by lr 0 runs phase 1 and the send only (docs/design#windows-and-adamw): its time is phase1 + other
(`StageCost.ms(n, forward_only=True)`; other's accumulation share, which such a stage skips, is a fraction of a
millisecond). Calibration rounds train (lr > 0), so their phase 2 is measured; the lines of a forward-only run
have phase2_ms 0, which `measure` takes as it is.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

#: Micro-batches at the start of a calibration run left out of the figures (program pages faulted in, caches
#: warm, the pipeline filling).
WARMUP_MICRO_BATCHES = 2


@dataclass(frozen=True)
class Measured:
    """One calibration round of one stage: its layer count and what the runner measured."""

    layers: int
    phase1_ms: float
    phase2_ms: float
    other_ms: float
    pss_mib: float | None
    micro_batches: int  # how many the medians are over

    @property
    def total_ms(self) -> float:
        return self.phase1_ms + self.phase2_ms + self.other_ms

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Measured:
        return cls(**data)


def measure(layers: int, lines: list[dict], warmup: int = WARMUP_MICRO_BATCHES) -> Measured | None:
    """The figures of one stage's telemetry lines (`micro_batch` and `window` records); None without any
    micro-batch after the warm-up."""
    mbs = sorted((r for r in lines if r.get("type") == "micro_batch"), key=lambda r: r["micro_batch"])
    steady = mbs[warmup:]
    if not steady:
        return None

    def num(r: dict, key: str) -> float:
        value = r.get(key)
        return float(value) if value is not None else 0.0

    sends = [num(r, "send_ms") for r in steady]
    rest = [max(0.0, num(r, "total_ms") - num(r, "queue_ms") - num(r, "send_ms") - num(r, "phase1_ms")
                - num(r, "phase2_ms") - num(r, "grad_wait_ms")) for r in steady]
    pss = [float(r["pss_mib"]) for r in lines if r.get("type") in ("micro_batch", "window") and r.get("pss_mib")]
    return Measured(layers=layers,
                    phase1_ms=statistics.median(num(r, "phase1_ms") for r in steady),
                    phase2_ms=statistics.median(num(r, "phase2_ms") for r in steady),
                    other_ms=min(sends) + statistics.median(rest),
                    pss_mib=max(pss) if pss else None,
                    micro_batches=len(steady))


@dataclass(frozen=True)
class Linear:
    """fixed + per_layer x n."""

    fixed: float
    per_layer: float

    def at(self, layers: int) -> float:
        return self.fixed + self.per_layer * layers

    @classmethod
    def fit(cls, points: list[tuple[int, float]]) -> Linear:
        """Least squares over (layers, value) points; one distinct layer count gives a flat line (the only split
        such a model allows is one layer per stage); a negative slope is noise: flat at the mean."""
        xs, ys = [float(x) for x, _ in points], [float(y) for _, y in points]
        mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
        var = sum((x - mean_x) ** 2 for x in xs)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var if var else 0.0
        if slope < 0:
            return cls(mean_y, 0.0)
        return cls(mean_y - slope * mean_x, slope)


@dataclass(frozen=True)
class StageCost:
    """A device's stage cost model at one position of the pipeline (fitted from its `Measured` rounds)."""

    phase1: Linear
    phase2: Linear
    other: Linear
    pss: Linear | None  # None: the device reports no PSS

    def ms(self, layers: int, forward_only: bool = False) -> float:
        """Predicted time per micro-batch with `layers` layers; `forward_only`: a stage held still by lr 0, which
        runs no phase 2."""
        phase2 = 0.0 if forward_only else self.phase2.at(layers)
        return self.phase1.at(layers) + phase2 + self.other.at(layers)

    def pss_mib(self, layers: int) -> float | None:
        return self.pss.at(layers) if self.pss is not None else None

    @classmethod
    def fit(cls, rounds: list[Measured]) -> StageCost:
        with_pss = [(m.layers, m.pss_mib) for m in rounds if m.pss_mib is not None]
        return cls(phase1=Linear.fit([(m.layers, m.phase1_ms) for m in rounds]),
                   phase2=Linear.fit([(m.layers, m.phase2_ms) for m in rounds]),
                   other=Linear.fit([(m.layers, m.other_ms) for m in rounds]),
                   pss=Linear.fit(with_pss) if with_pss else None)

    def to_json(self) -> dict:
        return {name: (asdict(line) if line is not None else None)
                for name, line in (("phase1", self.phase1), ("phase2", self.phase2), ("other", self.other),
                                   ("pss", self.pss))}

    @classmethod
    def from_json(cls, data: dict) -> StageCost:
        return cls(**{name: (Linear(**value) if value is not None else None) for name, value in data.items()})
