"""The runner's config, typed: one JSON object per stage (`zl_runner --config stage_<k>.json`), the twin of
runner/include/zl/runner_config.h and its field table (runner_config.cpp).

`RunnerConfig` is what `zl train` writes for each stage (zl_device/executorch/launch.py `stage_configs`), what
`zl deploy` pushes (its host paths rewritten to the names the device holds), what recovery edits on a device, and
what `--resume` and the baselines read back (`read_runner_config`). Its fields, their JSON types, which are
required, which are paths and their defaults are checked against the C++ table (`zl_runner --config-fields`) by
tests/test_runner_config.py, so neither side can add, drop or re-default a field alone.

`to_json` writes the required fields and those that differ from the runner's defaults, so a config stays as short
as what it sets, and a runner that predates a field with its default still reads it.

Wire names. The config is a wire format older configs and phones' runners read, so a few keys spell a concept
otherwise than `zl train`'s flag does; `SETTING_NAMES` is the one list of them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from zl_base.json_reader import Bounds, read_typed, typed
from zl_device.formats.schedules import SCHEDULES

#: Settings (zl train's flag / TrainSettings field) whose key in the runner config differs, and that key.
SETTING_NAMES: dict[str, str] = {
    "--window (window)": "window_size",
    "in_flight (tests, experiments)": "in_flight_depth",
    "--grad-dtype (grad_dtype)": "grad_wire_dtype",
    "--stage-lr x --lr (StageSpec.lr)": "optimizer.lr",
    "OptimizerSettings.schedule_kind": "optimizer.schedule.kind",
    "OptimizerSettings.warmup_windows": "optimizer.schedule.warmup_steps",
}

LINK_PROFILES = ("local", "wifi", "mobile", "constrained")  # zl/link_profile.h
LOAD_MODES = ("mmap", "file")
GRAD_WIRE_DTYPES = ("bf16", "f32")
ROLES = ("", "train", "forward")  # "": a config from before roles (the runner infers it from the lr)

_AT_LEAST_0, _AT_LEAST_1 = Bounds(0), Bounds(1)


#: A path field's direction: INPUT names a file the runner reads (`zl deploy` pushes it), OUTPUT one it writes.
INPUT, OUTPUT = "input", "output"


def _path(direction: str, default: str | None = None) -> Any:
    """A field the runner resolves against the config's folder (`base_dir`)."""
    if default is None:
        return field(metadata={"path": direction})
    return field(default=default, metadata={"path": direction})


@dataclass(frozen=True)
class LrScheduleConfig:
    """"optimizer"."schedule" (zl/lr_schedule.h)."""

    kind: Literal["constant", "warmup_cosine"] = "constant"
    warmup_steps: Annotated[int, _AT_LEAST_0] = 0
    total_steps: Annotated[int, _AT_LEAST_0] = 0  # 0: the run's windows
    min_lr_ratio: Annotated[float, Bounds(0, 1)] = 0.0


@dataclass(frozen=True)
class OptimizerConfig:
    """"optimizer" (zl/adamw.h AdamWConfig); the defaults are the runner's, not `zl train`'s (OptimizerSettings)."""

    lr: Annotated[float, _AT_LEAST_0] = 1e-4
    betas: tuple[Annotated[float, Bounds(0, below=1)], Annotated[float, Bounds(0, below=1)]] = (0.9, 0.999)
    eps: Annotated[float, Bounds(above=0)] = 1e-8
    weight_decay: Annotated[float, _AT_LEAST_0] = 0.01
    schedule: LrScheduleConfig = LrScheduleConfig()

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))


@dataclass(frozen=True)
class RunnerConfig:
    """Everything one stage's runner needs (runner_config.h documents each field; `zl_runner --help` prints them).

    Paths are host paths as `zl train` writes them; relative ones resolve against `base_dir`, else the config
    file's folder. Construction checks what the runner would refuse that Python can see (ranges, names, the
    stage's place and role), so a bad config fails where it is made, not on a phone.
    """

    program: str = _path(INPUT)
    stage_index: Annotated[int, _AT_LEAST_0]
    num_stages: Annotated[int, _AT_LEAST_1]
    run_key_file: str = _path(INPUT)
    run_id: str
    window_size: Annotated[int, _AT_LEAST_1]
    num_micro_batches: Annotated[int, _AT_LEAST_1]
    checkpoint_dir: str = _path(OUTPUT)
    base_dir: str = ""
    manifest: str = _path(INPUT, "")
    data_shard: str = _path(INPUT, "")
    listen: str = ""
    downstream: str = ""
    coordinator: str = ""
    in_flight_depth: Annotated[int, _AT_LEAST_1] = 4
    input_timeout_s: Annotated[int, _AT_LEAST_0] = 600
    checkpoint_interval: Annotated[int, _AT_LEAST_1] = 1
    keep_last: Annotated[int, _AT_LEAST_1] = 2
    input_log_dir: str = _path(OUTPUT, "")
    resume: bool = True
    optimizer: OptimizerConfig = OptimizerConfig()
    link_profile: str = "local"
    threads: Annotated[int, _AT_LEAST_0] = 0
    load_mode: str = "mmap"
    log_path: str = _path(OUTPUT, "metrics.jsonl")
    early_forwarding: bool = True
    forward_only_at_lr0: bool = True
    role: str = ""
    accumulator_snapshots: bool = True
    seed: int = 0
    hold_at_micro_batch: Annotated[int, Bounds(-1)] = -1
    schedule: str = "zerolock"
    grad_wire_dtype: str = "bf16"
    keep_activations: bool = False

    def __post_init__(self) -> None:
        problems = [f"{name} '{value}' is not one of {', '.join(repr(c) for c in choices)}"
                    for name, value, choices in (("link_profile", self.link_profile, LINK_PROFILES),
                                                 ("load_mode", self.load_mode, LOAD_MODES),
                                                 ("grad_wire_dtype", self.grad_wire_dtype, GRAD_WIRE_DTYPES),
                                                 ("role", self.role, ROLES),
                                                 ("schedule", self.schedule, SCHEDULES))
                    if value not in choices]
        if not 0 <= self.stage_index < self.num_stages:
            problems.append(f"stage_index {self.stage_index} is not below num_stages {self.num_stages}")
        if len(self.run_id) != 32 or any(c not in "0123456789abcdefABCDEF" for c in self.run_id):
            problems.append(f"run_id '{self.run_id}' is not 32 hex characters")
        if self.role == "forward" and (self.optimizer.lr != 0 or self.is_last or self.schedule != "zerolock"):
            problems.append("role 'forward' (held still) is for a zerolock stage at lr 0 before the last")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def to_json(self) -> dict[str, Any]:
        """The config as the runner reads it: required fields, and the others where they differ from its default."""
        return _written(self)

    @staticmethod
    def from_json(data: Any, label: str, fix: str) -> RunnerConfig:
        """A config from its JSON object, every field checked (type, range, name); errors name `label` and end in
        `fix` (zl_base/json_reader.py)."""
        return typed(RunnerConfig, data, label, fix)


def read_runner_config(path: Path, fix: str) -> RunnerConfig:
    """The runner config at `path` (a stage_<k>.json), checked as `RunnerConfig.from_json` does.

    Raises:
        ZLError: no such file, not JSON, or a field the runner would refuse; the message names the file and `fix`.
    """
    return read_typed(path, RunnerConfig, f"runner config {path}", fix)


def path_fields(direction: str | None = None) -> tuple[str, ...]:
    """The fields that name files or folders (resolved against `base_dir`), in table order; with `direction`, only
    the INPUT files (the ones `zl deploy` pushes) or the OUTPUT ones."""
    return tuple(f.name for f in dataclasses.fields(RunnerConfig)
                 if f.metadata.get("path") and direction in (None, f.metadata["path"]))


def _written(obj: Any) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            nested = _written(value)
            if nested:
                out[f.name] = nested
        elif f.default is dataclasses.MISSING or value != f.default:
            out[f.name] = list(value) if isinstance(value, tuple) else value
    return out
