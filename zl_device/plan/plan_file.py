"""A plan on disk (`zl plan --out plan.json`): the split, what it was planned for, and what it predicts.

    {"format": "zl-plan", "version": 1, "stages": "0-12,13-20,21-29",
     "model": ..., "num_layers": ..., "seq_len": ..., "micro_batch": ..., "frozen_dtype": ..., "max_targets": ...,
     "devices": "local:3", "device_names": [...], "mode": "binary", "cpu_quota": [1.0, 0.5, 0.75] | null,
     "schedule": "async", "keep_activations": false, "recompute": false,
     "predicted_slowest_ms": ..., "link": {"mbps": null, "entry_bytes": ..., "ms": 0.0},
     "per_stage": [{"stage", "device", "layers": [first, last], "phase1_ms", "phase2_ms", "other_ms", "total_ms",
                    "pss_mib", "budget_mib", "forward_only"}, ...],
     "even_split": {"stages": ..., "predicted_slowest_ms": ...} | null, "calibration": [...]}

A `forward_only` stage (held still by `--stage-lr` 0, docs/design#windows-and-adamw) runs no phase 2: its total_ms is
phase1_ms + other_ms, and its phase2_ms (what it would take with phase 2) is listed but not counted. Plans written
before the field existed have none: every stage counts its phase 2.

`schedule` and `keep_activations` are what the stages were timed under (`zl plan --schedule`, or the schedule the
data chooses): a backprop stage runs another program than a ZeroLock one, its upstream stages a second forward unless
activations are kept, so a split balanced for one paces another wrongly (docs/design#backprop-schedules). Plans written
before these fields have none (null): only their held stages are checked against a run.

`recompute`: the split fits the devices' memory budgets only with `--recompute` (each layer recomputed in the
backward, docs/design#recomputation), which `zl plan` turns on when no split fits without it; `zl train --stages
plan.json` then trains with it, `zl export --stages plan.json` asks for it.

`zl train --stages plan.json` and `zl export --stages plan.json` take its `stages`, after checking that the plan
was made for the model (and, for `zl train`, the devices, quotas and shapes) they are given: a split predicted for
other devices or another sequence length is no plan for this run. `zl train --stages auto` plans on the spot.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

from zl_base.errors import ZLError
from zl_base.json_reader import Bounds, read_json_file, shown, typed
from zl_export.options import MAX_SEQ_LEN

PLAN_FORMAT = "zl-plan"
PLAN_VERSION = 1
#: A run planned with `--stages auto` keeps its plan here (RUN_DIR/plan.json) once it finishes.
PLAN_FILE = "plan.json"
#: `--stages auto`: plan the split now (zl train).
AUTO = "auto"


def is_plan_file(stages: str | None) -> bool:
    """A --stages value that names a plan file rather than layer ranges."""
    return stages is not None and stages.strip().endswith(".json")


@dataclass
class StagePrediction:
    """One stage of a plan: its device, layers and predicted figures (ms per micro-batch, PSS MiB)."""

    stage: int
    device: str
    layers: tuple[int, int]
    phase1_ms: float
    phase2_ms: float
    other_ms: float
    pss_mib: float | None
    budget_mib: float | None
    forward_only: bool = False  # held still by lr 0: no phase 2 (docs/design#windows-and-adamw)

    @property
    def total_ms(self) -> float:
        return self.phase1_ms + (0.0 if self.forward_only else self.phase2_ms) + self.other_ms

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0] + 1


@dataclass
class Plan:
    """A split of a model's layers over devices, with what it was planned for and what it predicts."""

    stages: str  # --stages spec
    model: str
    num_layers: int
    seq_len: int
    micro_batch: int
    frozen_dtype: str
    max_targets: int | None
    devices: str  # the --devices value
    device_names: list[str]
    mode: str
    cpu_quota: list[float | None] | None  # per device (local devices only)
    per_stage: list[StagePrediction]
    link_mbps: float | None = None
    entry_bytes: int = 0  # one hidden-state entry between stages
    link_ms: float = 0.0
    even_stages: str | None = None
    even_slowest_ms: float | None = None
    calibration: list[dict] = field(default_factory=list)  # per device: cache file, rounds measured, fit
    schedule: str | None = None  # the schedule the stages were timed under; None: a plan from before the field
    keep_activations: bool = False
    recompute: bool = False  # the stages were timed (and fit) with --recompute
    embedding_dtype: str | None = None  # --embedding-dtype; None: as frozen_dtype (and plans from before it)

    @property
    def slowest_ms(self) -> float:
        """The predicted pipeline pace: its slowest stage, or the link when that is slower."""
        return max([p.total_ms for p in self.per_stage] + [self.link_ms])

    def to_json(self) -> dict:
        return {
            "format": PLAN_FORMAT, "version": PLAN_VERSION, "stages": self.stages, "model": self.model,
            "num_layers": self.num_layers, "seq_len": self.seq_len, "micro_batch": self.micro_batch,
            "frozen_dtype": self.frozen_dtype, "embedding_dtype": self.embedding_dtype,
            "max_targets": self.max_targets, "devices": self.devices,
            "device_names": self.device_names, "mode": self.mode, "cpu_quota": self.cpu_quota,
            "schedule": self.schedule, "keep_activations": self.keep_activations, "recompute": self.recompute,
            "predicted_slowest_ms": self.slowest_ms,
            "link": {"mbps": self.link_mbps, "entry_bytes": self.entry_bytes, "ms": self.link_ms},
            "per_stage": [{**asdict(p), "layers": list(p.layers), "total_ms": p.total_ms} for p in self.per_stage],
            "even_split": (None if self.even_stages is None else
                           {"stages": self.even_stages, "predicted_slowest_ms": self.even_slowest_ms}),
            "calibration": self.calibration,
        }

    @classmethod
    def from_json(cls, data: Any, where: str = "plan") -> Plan:
        """Raises ZLError: not a plan of this version, or a field missing, mistyped or out of range (named)."""
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise ZLError(f"{where}: not a plan written by `zl plan` (no \"format\": \"{PLAN_FORMAT}\"); make one with "
                          "`zl plan --out plan.json`.")
        if data.get("version") != PLAN_VERSION:
            raise ZLError(f"{where}: plan version {shown(data.get('version'))}, this zl reads version {PLAN_VERSION}; "
                          "run `zl plan` again.")
        f = typed(_PlanFile, data, where, "make it again with `zl plan`")
        stages = [StagePrediction(**{k: v for k, v in asdict(p).items() if k != "total_ms"}) for p in f.per_stage]
        link, even = f.link or _LinkRecord(), f.even_split
        return cls(stages=f.stages, model=f.model, num_layers=f.num_layers, seq_len=f.seq_len,
                   micro_batch=f.micro_batch, frozen_dtype=f.frozen_dtype, embedding_dtype=f.embedding_dtype,
                   max_targets=f.max_targets,
                   devices=f.devices, device_names=list(f.device_names), mode=f.mode,
                   cpu_quota=None if f.cpu_quota is None else list(f.cpu_quota), per_stage=stages,
                   link_mbps=link.mbps, entry_bytes=link.entry_bytes, link_ms=link.ms,
                   even_stages=even.stages if even else None,
                   even_slowest_ms=even.predicted_slowest_ms if even else None,
                   calibration=list(f.calibration), schedule=f.schedule, keep_activations=f.keep_activations,
                   recompute=f.recompute)


# plan.json as written (Plan.to_json), for the typed reader: every field's type and range
_Ms = Annotated[float, Bounds(0)]
_Count = Annotated[int, Bounds(0)]


@dataclass(frozen=True)
class _StageRecord:
    stage: _Count
    device: str
    layers: tuple[_Count, _Count]
    phase1_ms: _Ms
    phase2_ms: _Ms
    other_ms: _Ms
    pss_mib: _Ms | None
    budget_mib: _Ms | None
    forward_only: bool = False
    total_ms: _Ms | None = None


@dataclass(frozen=True)
class _LinkRecord:
    mbps: Annotated[float, Bounds(0)] | None = None
    entry_bytes: _Count = 0
    ms: _Ms = 0.0


@dataclass(frozen=True)
class _EvenRecord:
    stages: str
    predicted_slowest_ms: _Ms | None = None


@dataclass(frozen=True)
class _PlanFile:
    format: str
    version: int
    stages: str
    model: str
    num_layers: Annotated[int, Bounds(1, 100_000)]
    seq_len: Annotated[int, Bounds(2, MAX_SEQ_LEN)]
    micro_batch: Annotated[int, Bounds(1, 100_000)]
    frozen_dtype: str
    devices: str
    device_names: tuple[str, ...]
    mode: str
    per_stage: tuple[_StageRecord, ...]
    max_targets: _Count | None = None
    embedding_dtype: str | None = None
    cpu_quota: tuple[Annotated[float, Bounds(0.01, 4096)] | None, ...] | None = None
    schedule: str | None = None
    keep_activations: bool = False
    recompute: bool = False
    predicted_slowest_ms: _Ms | None = None
    link: _LinkRecord | None = None
    even_split: _EvenRecord | None = None
    calibration: tuple[dict[str, Any], ...] = ()


def write_plan(plan: Plan, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(plan.to_json(), indent=2) + "\n")
    tmp.replace(path)
    return path


def read_plan(path: Path | str, flag: str = "--stages") -> Plan:
    """Raises ZLError: no such file, not JSON, or not a plan."""
    path = Path(path).expanduser()
    data = read_json_file(path, f"{flag} {path}", missing=f"make the plan with `zl plan --out {path}`, or give "
                          "layer ranges (e.g. 0-9,10-19,20-29) or `auto`.", invalid="make it again with `zl plan`.")
    return Plan.from_json(data, f"{flag} {path}")


def check_plan_matches(plan: Plan, where: str, *, model: str, seq_len: int | None = None,
                       micro_batch: int | None = None, frozen_dtype: str | None = None,
                       embedding_dtype: str | None = None, devices: str | None = None,
                       mode: str | None = None, cpu_quota: list[float | None] | None = None,
                       checked_devices: bool = False) -> None:
    """Raise ZLError when the plan was made for another model, shape or set of devices than the command's.

    Args:
        embedding_dtype: compared (as frozen_dtype where None, on both sides) when frozen_dtype is given.
        checked_devices: compare devices, mode and quotas too (zl train; zl export has no devices).
    """
    fix = f"run `zl plan` for these settings, or pass its stages yourself (--stages {plan.stages})"
    pairs = [("--model", plan.model, model), ("--seq-len", plan.seq_len, seq_len),
             ("--micro-batch", plan.micro_batch, micro_batch), ("--frozen-dtype", plan.frozen_dtype, frozen_dtype)]
    if frozen_dtype is not None:
        pairs.append(("--embedding-dtype", plan.embedding_dtype or plan.frozen_dtype, embedding_dtype or frozen_dtype))
    if checked_devices:
        pairs += [("--devices", plan.devices, devices), ("--mode", plan.mode, mode),
                  ("--cpu-quota", _shown_quota(plan.cpu_quota), _shown_quota(cpu_quota))]
    for flag, planned, given in pairs:
        if given is not None and planned != given:
            raise ZLError(f"{where}: the plan was made for {flag} {planned}, this command has {flag} {given}; {fix}.")


def _shown_quota(quota: list[float | None] | None) -> str:
    if quota is None or all(q is None for q in quota):
        return "none"
    return ",".join("none" if q is None else f"{q:g}" for q in quota)


def split_of_plan(split, opts):
    """`zl export --stages plan.json`: the `ModelSplit` with the plan's layer ranges, checked against the export's
    model and shapes (`opts`: its ExportOptions); any other split as it is.

    Raises:
        ZLError: `auto` (no devices to plan on), no such plan, or one made for another model or shape.
    """
    from dataclasses import replace

    if split.stages is not None and split.stages.strip() == AUTO:
        raise ZLError("--stages auto plans on the devices, and zl export has none; run `zl plan --out plan.json` "
                      "with the run's --devices, then `zl export --stages plan.json`.")
    if not is_plan_file(split.stages):
        return split
    plan = read_plan(split.stages)
    check_plan_matches(plan, f"--stages {split.stages}", model=split.model, seq_len=opts.seq_len,
                       micro_batch=opts.micro_batch, frozen_dtype=opts.frozen_dtype,
                       embedding_dtype=opts.embedding_dtype)
    if plan.recompute and not opts.recompute:
        raise ZLError(f"--stages {split.stages}: the plan's split fits its devices' memory only with --recompute "
                      "(`zl plan` turned it on); add --recompute.")
    return replace(split, stages=plan.stages)
