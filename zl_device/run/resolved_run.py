"""`zl train`'s run, resolved once: everything the settings leave to be worked out, worked out in one place.

    RUN_DIR/resolved_run.json   the resolved run; `zl train --resume` reads it back instead of working it out again

The settings tree (train_settings.py) is what the user gave; some of it is only known once the model and the data
are: the sequence length (--seq-len, or the demo task's longest sample), the target slots (--max-targets, or fitted
to the training rows), --stage-lr's default for the split and the schedule, each stage's role and learning rate
(`StageSpec`, zl_device/formats/stage_spec.py), the run's update windows and the optimizer's warm-up for them.
`resolve_run` works these out from the settings and the data, after the split is (`--stages auto` or a plan file:
zl_device/plan/planner.py); both runtimes and the launch read them from the `ResolvedRun`. A resumed run reads
the one it started with, so it continues with the same values even under a zl whose defaults have changed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Annotated, Any

from zl_base.errors import ZLError
from zl_base.json_reader import Bounds, first_difference, read_json_file, read_typed, shown, typed
from zl_device.formats.lr_schedule import OptimizerSettings
from zl_device.formats.run_layout import RunLayout
from zl_device.formats.schedules import SCHEDULES, schedule_name
from zl_device.formats.stage_spec import StageSpec, stage_specs
from zl_device.formats.windows import WindowPlan
from zl_device.run.train_settings import TrainSettings, default_stage_lr
from zl_export.options import MAX_SEQ_LEN, ExportOptions

#: resolved_run.json's format; a file of another version is refused by `load` (the run cannot be resumed by it).
RESOLVED_VERSION = 1


@dataclass(frozen=True)
class ResolvedRun:
    """One run's values that depend on the model, the data or the split (module docstring)."""

    schedule: str  # the schedule's own name (`pipedream` given: async)
    seq_len: int  # tokens per sample: the programs' and the shards' sequence length
    max_targets: int  # target slots per sample in the programs
    stage_lr: tuple[float, ...]  # --stage-lr, one multiplier per stage (its default resolved)
    stages: tuple[StageSpec, ...]  # each stage's role and learning rate
    windows: WindowPlan  # the run's micro-batches in update windows
    optimizer: OptimizerSettings  # --lr's AdamW and schedule, the warm-up capped for these windows

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @classmethod
    def of(cls, s: TrainSettings, seq_len: int, max_targets: int) -> ResolvedRun:
        """The run of settings `s` (its split resolved) with the data's `seq_len` and `max_targets`."""
        multipliers, windows = run_stage_lr(s), s.windows()
        return cls(schedule_name(s.chosen_schedule), seq_len, max_targets, multipliers, _specs(s, multipliers), windows,
                   s.optimizer.for_windows(windows.num_windows))

    def export_options(self, s: TrainSettings) -> ExportOptions:
        """The export's options: the settings' with this run's sequence length, target slots and seed."""
        return s.export_options(self.seq_len, self.max_targets)

    def to_json(self) -> dict:
        return {"version": RESOLVED_VERSION, "schedule": self.schedule, "seq_len": self.seq_len,
                "max_targets": self.max_targets, "stage_lr": list(self.stage_lr),
                "stages": [asdict(st) for st in self.stages], "windows": asdict(self.windows),
                "optimizer": {**asdict(self.optimizer), "betas": list(self.optimizer.betas)}}

    @classmethod
    def from_json(cls, data: Any, source: str) -> ResolvedRun:
        """Raises ZLError naming `source` and the field: a file of another version, or a field missing, mistyped,
        out of range or at odds with the others (stages and multipliers one per stage, in order, on the schedule)."""
        fix = "restore it, or start the run again without --resume"
        if not isinstance(data, dict) or data.get("version") != RESOLVED_VERSION:
            found = shown(data.get("version")) if isinstance(data, dict) else f"a {type(data).__name__}"
            raise ZLError(f"{source}: not a resolved run this zl reads (version {found}, this zl reads "
                          f"{RESOLVED_VERSION}); resume the run with the zl that started it, or start it again "
                          "without --resume.")
        f = typed(_ResolvedFile, data, source, fix)
        n = len(f.stages)
        problem = None
        if f.schedule not in SCHEDULES:
            problem = f'"schedule" is {shown(f.schedule)}, expected one of {", ".join(SCHEDULES)}'
        elif n == 0 or len(f.stage_lr) != n:
            problem = f'"stage_lr" has {len(f.stage_lr)} multiplier(s) for {n} stage(s)'
        elif any(st.num_stages != n for st in f.stages):
            said = next(st.num_stages for st in f.stages if st.num_stages != n)
            problem = f'"stages" has {n} entries, and one says the run has {said} stages'
        else:
            for k, st in enumerate(f.stages):
                if (st.index, st.num_stages, st.schedule) != (k, n, f.schedule):
                    problem = (f'"stages[{k}]" is stage {st.index} of {st.num_stages} on {st.schedule}, expected stage '
                               f"{k} of {n} on {f.schedule}")
                    break
        if problem is not None:
            raise ZLError(f"{source}: {problem}; {fix}.")
        return cls(f.schedule, f.seq_len, f.max_targets, f.stage_lr, f.stages, f.windows, f.optimizer)

    def save(self, layout: RunLayout) -> None:
        layout.resolved.write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, layout: RunLayout) -> ResolvedRun | None:
        """RUN_DIR's resolved run; None for a run started before zl wrote one (`--resume` works it out again)."""
        path = layout.resolved
        if not path.is_file():
            return None
        data = read_json_file(path, str(path), missing="", invalid="restore it, or start the run again without "
                                                                  "--resume.")
        return cls.from_json(data, str(path))


@dataclass(frozen=True)
class _ResolvedFile:
    """resolved_run.json as `ResolvedRun.to_json` writes it, with each field's type and range (the typed reader)."""

    version: int
    schedule: str
    seq_len: Annotated[int, Bounds(2, MAX_SEQ_LEN)]
    max_targets: Annotated[int, Bounds(0, MAX_SEQ_LEN)]
    stage_lr: tuple[Annotated[float, Bounds(0)], ...]
    stages: tuple[StageSpec, ...]
    windows: WindowPlan
    optimizer: OptimizerSettings


def record_start(layout: RunLayout, resolved: ResolvedRun) -> None:
    """Write RUN_DIR/started_run.json: train_settings.json and `resolved` (resolved_run.json) as the run starts,
    what its checkpoints are trained with. `--resume` checks both files against it (`check_as_started`), so an
    edited file (a learning rate, a window, AdamW's eps) is refused instead of silently training another adapter. A
    layout without settings (a calibration round's work folder, zl_device/plan/calibrate.py) is no run to resume:
    nothing."""
    if not layout.settings.is_file():
        return
    record = {"train_settings": json.loads(layout.settings.read_text()), "resolved_run": resolved.to_json()}
    tmp = layout.started.with_name(f".{layout.started.name}.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(layout.started)


def check_as_started(layout: RunLayout, key: str, path: Path, current: Any) -> None:
    """Raise ZLError when `current`, the JSON value of `path` (RUN_DIR's train_settings.json, key "train_settings",
    or resolved_run.json, "resolved_run"), differs from what the run started with (`record_start`). A run started
    before zl recorded it passes.

    Raises:
        ZLError: '--resume: <path> "<field>" is X, the run started with Y ...', or an unreadable record.
    """
    if not layout.started.is_file():
        return
    fix = "restore it from a copy of the run directory, or start the run again without --resume"
    record = read_typed(layout.started, dict[str, Any], str(layout.started), fix)
    if key not in record:
        raise ZLError(f'{layout.started}: "{key}" is missing; {fix}.')
    found = first_difference(current, record[key])
    if found is not None:
        field, now, then = found
        raise ZLError(f'--resume: {path} "{field or "(the file)"}" is {shown(now)}, the run started with '
                      f"{shown(then)} (its checkpoints were trained with it, {layout.started.name}); put it back, or "
                      "start a new run with the settings you want (zl train --out NEW_DIR ...).")


def run_stage_lr(s: TrainSettings, num_stages: int | None = None) -> tuple[float, ...]:
    """--stage-lr as one multiplier per stage of the split (or of `num_stages` stages), the one place its default is
    worked out: when not given, under a backprop schedule every stage trains, under ZeroLock the stages before the
    last are held still and the last trains (default_stage_lr); one value given is every stage's.

    Raises:
        RuntimeError: --schedule's default not chosen yet (train_data.resolve_schedule comes first).
    """
    n = s.split.count if num_stages is None else num_stages
    given = s.stage_lr
    if given is None:
        given = (1.0,) if s.backprop else default_stage_lr(n)
    return tuple(float(m) for m in given) * n if len(given) == 1 else tuple(float(m) for m in given)


def run_stage_specs(s: TrainSettings, num_stages: int | None = None) -> tuple[StageSpec, ...]:
    """Every stage's role and learning rate (--lr x its multiplier) for settings `s`, its split resolved (or
    `num_stages` stages: the planner weighs splits of other counts)."""
    return _specs(s, run_stage_lr(s, num_stages))


def _specs(s: TrainSettings, multipliers: tuple[float, ...]) -> tuple[StageSpec, ...]:
    """The stages at --lr x `multipliers` on the settings' schedule."""
    return stage_specs([s.optimizer.lr * m for m in multipliers], schedule_name(s.chosen_schedule))


def stage_lr_note(s: TrainSettings, shard: Path) -> str | None:
    """A line to say about --stage-lr on the data in `shard` (generative rows or label words), or None: its default,
    which holds the stages before the last still, or which study (docs/studies/README.md) to read when the user's
    --stage-lr trains them. Messages cite studies by name, not their figures. (The multipliers themselves are
    worked out in one place, run_stage_lr.)"""
    from zl_device.run.train_data import shard_is_generative

    stages = s.split.count
    if stages < 2 or s.backprop:  # a backprop schedule trains every stage on the final loss's gradient
        return None
    held = ",".join(f"{m:g}" for m in default_stage_lr(stages))
    if s.stage_lr is None:
        said = (f"--stage-lr {held} (the default): the stages before the last run forward only and the last stage "
                "trains. In every study this matched or beat every stage training on its own readout "
                "(--stage-lr 1), on label words and on generative data (docs/studies/README.md).")
        if shard_is_generative(shard):  # where the held stages cost quality and end-to-end gradients win it back
            said += (" On generative data it stays behind whole-model backprop; --schedule async (the default there) "
                     "trains every stage on the final loss's gradient and came level with backprop, at about half the "
                     "records/s "
                     "(study headlines-smollm2-135m-1024-async).")
        return said
    if all(spec.forward_only for spec in run_stage_specs(s)[:-1]):
        return None
    if shard_is_generative(shard):
        return ("note: generative data with the stages before the last training on their own readouts: in "
                "the study headlines-smollm2-135m-1024-local-losses that left the model worse than the base "
                f"model, while the last stage alone (--stage-lr {held}, the default) came close to whole-model "
                "backprop. See docs/studies/README.md.")
    return ("note: the stages before the last train on their own readouts. On AG News label words that tied "
            f"holding them still (--stage-lr {held}, the default) on SmolLM2-135M and lost clearly on Gemma 3 "
            "270M (studies agnews-smollm2-135m-1024-local-losses, agnews-gemma3-270m-1024). See "
            "docs/studies/README.md.")


def resolve_run(s: TrainSettings, tokenizer, layout: RunLayout, say) -> tuple[ResolvedRun, Path, Path | None]:
    """The run of settings `s` in RUN_DIR `layout`, resolved from them and the data, which it tokenizes into
    RUN_DIR/data/ first (seconds: the target slots must fit the rows, and a misfit must fail before the export).
    A resumed run (`s.resume`) reads RUN_DIR's resolved run back and re-tokenizes the data at its sequence length.

    Returns:
        (the resolved run, the training shard, the dev shard or None).

    Raises:
        ZLError: as the data step (prepare_data); a resumed run's rows that do not fit its programs' target slots.
    """
    from zl_device.run.train_data import prepare_data, run_max_targets, run_seq_len

    saved = ResolvedRun.load(layout) if s.resume else None
    if saved is not None:
        # as read (typed: an edit that reads is kept, a value that does not is refused before)
        check_as_started(layout, "resolved_run", layout.resolved, saved.to_json())
        if saved.num_stages != s.split.count:
            raise ZLError(f'{layout.resolved}: "stages" has {saved.num_stages} stage(s), the run has {s.split.count} '
                          f"({s.split.stages or s.split.count}); restore it, or start the run again without --resume.")
        shard, dev = prepare_data(replace(s, export=replace(s.export, max_targets=saved.max_targets)), tokenizer,
                                  saved.seq_len, layout.data, say)
        return saved, shard, dev
    seq_len = run_seq_len(s, tokenizer)
    shard, dev = prepare_data(s, tokenizer, seq_len, layout.data, say)
    note = stage_lr_note(s, shard)  # what the studies say of --stage-lr or its default
    if note is not None:
        say(note)
    resolved = ResolvedRun.of(s, seq_len, run_max_targets(s, shard, say))
    resolved.save(layout)
    record_start(layout, resolved)
    return resolved, shard, dev
