"""`zl train` from top to bottom, once for both runtimes:

    data -> programs or model -> deploy or launch -> watch -> collect -> merge -> eval -> report

`run_training` holds the sequence; each step is a function of its own module
(train_data, the runtime's prepare/run/collect, formats.metrics_log's merge,
results.adapter's merge, results.evaluate, results.report). What differs
between the ExecuTorch runtime (executorch_runtime.py: export, deploy, the
coordinator) and the torch runtime (torch_runtime.py: a manifest and a job, the
ranks) is behind `Runtime` (runtime.py), chosen by --runtime from `RUNTIMES`.
A run directory ends up holding what formats/run_layout.py lists
(docs/design#run-outputs).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from zl_base.errors import ZLError
from zl_base.settings import to_json
from zl_device.formats.injection import Injection
from zl_device.formats.run_layout import INCOMPLETE_MARKER, SETTINGS_FILE, RunLayout
from zl_device.formats.runner_config import read_runner_config
from zl_device.run.executorch_runtime import ExecuTorchRuntime
from zl_device.run.resolved_run import check_as_started, resolve_run
from zl_device.run.runtime import Run, RunModel, Runtime, run_event
from zl_device.run.torch_runtime import TorchRuntime
from zl_device.run.train_data import resolve_schedule
from zl_device.run.train_settings import TrainSettings

#: --runtime -> the runtime that runs the stages (their names are TrainSettings.runtime's choices).
RUNTIMES: dict[str, type[Runtime]] = {ExecuTorchRuntime.name: ExecuTorchRuntime, TorchRuntime.name: TorchRuntime}


@dataclass
class TrainResult:
    run_dir: Path
    wall_s: float
    samples: int
    report: dict = field(default_factory=dict)
    eval: dict = field(default_factory=dict)


def run_training(s: TrainSettings, say=print, on_update=None, export_progress=None) -> TrainResult:
    """The whole `zl train` job; `say` prints a step's line, `on_update` gets the stages' states (StageStatus)
    about once a second, `export_progress` (a zl_export.pipeline.ExportProgress) sees the export when the cache has
    none.

    A run that fails leaves RUN_DIR only when `--resume` can continue it, marked so (INCOMPLETE_MARKER); one that
    fails before its stages started leaves nothing (`kept_if_resumable`)."""
    if s.resume:
        s = resumed_settings(s)
    else:
        s = resolve_schedule(s, say)  # zl train's CLI chose it already; tools' settings may leave it to the data
    runtime = RUNTIMES[s.runtime]()
    runtime.check(s)
    start = time.time()
    keep_dir = is_empty_dir(s.out)
    run_dir, spec = reopen_run(s, say) if s.resume else open_run(s, say)
    with kept_if_resumable(run_dir, () if s.resume else runtime.resume_needs, say, keep_dir):
        layout, model = RunLayout(run_dir), RunModel(s.split.model, s.seed)
        # The data first (seconds): the stages' target slots must fit it, and a misfit must fail before the export.
        resolved, shard, dev = resolve_run(s, model.tokenizer, layout, say)
        run = Run(s, resolved, layout, spec, model, say, export_progress)
        return _run(runtime, run, shard, dev, start, on_update)


def _run(runtime: Runtime, run: Run, shard: Path, dev: Path | None, start: float, on_update) -> TrainResult:
    """run_training's steps in RUN_DIR, once it is open and the run resolved."""
    from zl_device.formats.metrics_log import merge_metrics
    from zl_device.results.adapter import merge_checkpoints

    s, layout, say = run.settings, run.layout, run.say
    manifest = runtime.prepare(run, shard)
    num_stages, windows = manifest.num_stages, run.windows
    injection = Injection.parse(s.inject_failure, num_stages, windows.num_windows) if s.inject_failure else None
    if not runtime.run(run, injection, on_update):  # prepared only: the user starts the stages
        return TrainResult(layout.root, time.time() - start, 0)
    record = runtime.collect(run)
    merge_metrics(layout, num_stages, [*record.events, run_event(run, record)])
    merged = merge_checkpoints(layout.checkpoints, layout.manifest, layout.adapter)
    say(f"merge: {merged.numel:,} LoRA parameters of window {merged.window} -> {layout.adapter}")
    result = TrainResult(layout.root, time.time() - start, windows.num_micro_batches * s.export.micro_batch)
    return finish_run(s, run.model, result, dev, say)


def finish_run(s: TrainSettings, model: RunModel, result: TrainResult, dev: Path | None, say) -> TrainResult:
    """A run's last steps: eval (when there is dev data), report, and the run marked finished: its key deleted
    (nothing can resume it any more, PROTOCOL.md §8), then its marker."""
    from zl_device.results.report import write_report

    layout = RunLayout(result.run_dir)
    if dev is not None:
        result.eval = evaluate_run(s, model, layout.root, dev, say)
    result.report = write_report(layout.root)
    layout.run_key.unlink(missing_ok=True)
    for marker in layout.markers:
        marker.unlink(missing_ok=True)
    say(f"report: {layout.report_md}")
    return result


# RUN_DIR/SETTINGS_FILE: the run's settings, as open_run found them; `zl train --resume` continues with these.
# RUN_DIR/INCOMPLETE_MARKER: there from RUN_DIR's creation until the report is written, saying how to continue the
# run: a run that failed or was interrupted leaves it, and a rerun with the same --out moves such a directory aside
# (to RUN_DIR.unfinished-N, logs and all) instead of refusing. Directories of older versions carry the hidden
# LEGACY_INCOMPLETE_MARKER (RunLayout.markers has both). What `--resume` needs besides is each runtime's
# `resume_needs`.


def is_unfinished(run_dir: Path) -> bool:
    """Whether RUN_DIR holds a run that has not finished (its marker is there)."""
    return any(m.is_file() for m in RunLayout(run_dir).markers)


def is_empty_dir(out: Path | str) -> bool:
    """Whether --out is a directory that exists and is empty (a failed run leaves it so, instead of removing it)."""
    path = Path(out).expanduser()
    return path.is_dir() and not any(path.iterdir())


def _marker_text(run_dir: Path) -> str:
    return (f"This run has not finished: zl train failed, was interrupted, or is still running.\n"
            f"Continue it from its checkpoints:  zl train --resume --out {run_dir}\n"
            f"Or start it again:                 zl train --out {run_dir} ...  (moves this directory aside to "
            f"{run_dir.name}.unfinished-N)\n"
            "run.key, the run's key (owner-only), stays here while the run can be resumed; zl train deletes it, "
            "with this file, when the run finishes.\n")


@contextmanager
def kept_if_resumable(run_dir: Path, needs: tuple[str, ...], say, keep_dir: bool = False) -> Iterator[None]:
    """The steps of a run in RUN_DIR. When one fails, RUN_DIR stays (marked unfinished) if `--resume` can continue
    it, i.e. the files `needs` names are there; otherwise everything the run wrote is removed (and RUN_DIR too,
    unless `keep_dir`: it was an empty directory before), so a run that failed before its stages started leaves
    nothing."""
    try:
        yield
    except BaseException:
        if all((run_dir / name).exists() for name in needs):
            say(f"unfinished: {run_dir} is kept; `zl train --resume --out {run_dir}` continues the run "
                f"({INCOMPLETE_MARKER} there says so)")
        else:
            for child in run_dir.iterdir() if run_dir.is_dir() else ():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
            if not keep_dir and run_dir.is_dir():
                run_dir.rmdir()
            say(f"--out {run_dir}: removed what the run wrote; it failed before its stages started, so there is "
                "nothing to resume")
        raise


def open_run(s: TrainSettings, say=print):
    """Check every setting that needs no model or device -- the settings, the devices spec and count,
    --inject-failure, the data files, --samples against the training rows -- before anything slow (the data and
    export steps take minutes) or anything is written; then create RUN_DIR, marked unfinished.

    Returns:
        (run_dir, the parsed --devices spec).
    """
    from zl_device.devices.registry import check_mode
    from zl_device.run.train_data import check_samples
    from zl_device.run.train_settings import DEMO

    run_dir = Path(s.out).expanduser().resolve()
    if run_dir.exists() and not run_dir.is_dir():
        raise ZLError(f"--out {run_dir}: a file, not a directory; pick a new run directory.")
    leftovers = run_dir.exists() and any(run_dir.iterdir())
    if leftovers and not is_unfinished(run_dir):
        raise ZLError(f"--out {run_dir}: the directory exists and is not empty; pick a new run directory "
                      "(a run never overwrites another run's results).")
    s.validate()
    spec = s.devices_spec
    check_mode(spec, s.mode)
    if s.inject_failure:
        Injection.parse(s.inject_failure, s.split.count, s.windows().num_windows)
    if RUNTIMES[s.runtime].uses_devices:
        check_device_count(s, spec, s.split.count)
    for flag, value in (("--data", s.data), ("--eval-data", s.eval_data)):
        if value is not None and value != DEMO and not Path(value).expanduser().exists():
            raise ZLError(f"{flag} {value}: no such file; pass `demo`, a .csv/.jsonl/.parquet/.arrow file, a "
                          "`datasets.save_to_disk` directory or a .safetensors shard.")
    check_samples(s)
    if leftovers:
        aside = _free_name(run_dir, "unfinished")
        run_dir.rename(aside)
        say(f"--out {run_dir}: an unfinished run was there; moved it to {aside} (its logs and checkpoints are kept)")
    run_dir.mkdir(parents=True, exist_ok=True)
    layout = RunLayout(run_dir)
    layout.markers[0].write_text(_marker_text(run_dir))
    layout.settings.write_text(json.dumps(to_json(s), indent=2) + "\n")
    return run_dir, spec


def started_stage_lr(layout: RunLayout, s: TrainSettings) -> tuple[float, ...] | None:
    """The --stage-lr a run's stages started with, from their runner configs (RUN_DIR/stage_<k>.json: the optimizer's
    lr over --lr), for a run started before zl wrote its resolved run (resolved_run.json) and whose settings do not
    record it either; None without configs (a torch run keeps its per-stage lrs in its own job file)."""
    lrs = []
    fix = "restore the file (each device holds a copy), or start the run again without --resume"
    while (config := layout.stage_config(len(lrs))).is_file():
        try:
            lrs.append(read_runner_config(config, fix).optimizer.lr / s.optimizer.lr)
        except ZLError as e:
            raise ZLError(f"--resume --out {layout.root}: {e}") from None
    return tuple(lrs) or None


def resumed_settings(s: TrainSettings) -> TrainSettings:
    """`zl train --resume --out RUN_DIR`: the settings RUN_DIR's run started with, marked to resume (an injected
    failure happens once, so it is dropped). Other options given with --resume are not used. What the run worked
    out from them (its --stage-lr default, sequence length, target slots) comes back from its resolved run
    (resolve_run); for a run older than that file, --stage-lr is read off its runner configs.

    Raises:
        ZLError: RUN_DIR holds no unfinished run.
    """
    from zl_base.json_reader import read_json_file
    from zl_base.settings import from_json

    run_dir = Path(s.out).expanduser().resolve()
    saved = RunLayout(run_dir).settings
    if not saved.is_file():
        raise ZLError(f"--resume --out {run_dir}: no {SETTINGS_FILE} there, so it is not a `zl train` run directory; "
                      "pass the --out of the run to continue.")
    if not is_unfinished(run_dir):
        raise ZLError(f"--resume --out {run_dir}: that run finished (its report is written); nothing to resume.")
    fix = "restore it, or start the run again without --resume"
    data = read_json_file(saved, str(saved), missing="", invalid=fix + ".")
    settings = from_json(TrainSettings, data, str(saved), fix=fix)
    check_as_started(RunLayout(run_dir), "train_settings", saved, data)
    if settings.schedule is None:  # saved before --schedule existed (a run records the schedule its data chose)
        settings = replace(settings, schedule="zerolock")
    if settings.stage_lr is None and not RunLayout(run_dir).resolved.is_file():
        settings = replace(settings, stage_lr=started_stage_lr(RunLayout(run_dir), settings))
    settings = replace(settings, out=run_dir, resume=True, inject_failure=None)
    try:
        settings.validate()
    except ZLError as e:  # a range only the flags' checks know (they name the flag)
        raise ZLError(f"{saved}: {e} {fix[0].upper()}{fix[1:]}.") from None
    return settings


def reopen_run(s: TrainSettings, say):
    """open_run for `--resume`: the same checks, on the existing RUN_DIR, which must hold what its runtime needs
    to continue. Returns (run_dir, the devices spec).

    Raises:
        ZLError: RUN_DIR lacks the runtime's `resume_needs` (the run never started its stages).
    """
    from zl_device.devices.registry import check_mode

    runtime, run_dir = RUNTIMES[s.runtime], Path(s.out)
    missing = [name for name in runtime.resume_needs if not (run_dir / name).exists()]
    if missing:
        raise ZLError(f"--resume --out {run_dir}: no {' or '.join(missing)} there, so that run never started its "
                      "stages; start it again without --resume.")
    say(f"resume: {run_dir} {runtime.resumes_from}")
    s.validate()
    spec = s.devices_spec
    check_mode(spec, s.mode)
    return run_dir, spec


def _free_name(path: Path, tag: str) -> Path:
    """`path` with `.<tag>-N` appended, for the smallest N >= 1 that names nothing yet."""
    n = 1
    while (candidate := path.with_name(f"{path.name}.{tag}-{n}")).exists():
        n += 1
    return candidate


def check_device_count(s: TrainSettings, spec, num_stages: int) -> None:
    if spec.count < num_stages + s.spares:
        raise ZLError(f"--devices {s.devices} gives {spec.count} device(s); {num_stages} stages"
                      f"{f' and {s.spares} spare(s)' if s.spares else ''} need {num_stages + s.spares}.")


def evaluate_run(s: TrainSettings, model: RunModel, run_dir: Path, dev: Path, say) -> dict:
    """Base model and adapter on the dev shard (prompt/completion data: with scored generations); writes
    RUN_DIR/eval.json."""
    from zl_device.results.evaluate import GenerationEval, describe, eval_record, evaluate_with_adapter, limit_rows
    from zl_export.shard import load_shard

    shard = limit_rows(load_shard(dev), s.eval_limit)
    generation = GenerationEval(model.loaded().tokenizer)
    layout = RunLayout(run_dir)
    scores = evaluate_with_adapter(model.loaded().model, shard, layout.adapter, generation=generation)
    result = {"data": str(dev), "rows": shard.rows, **eval_record(scores, shard, generation)}
    layout.eval.write_text(json.dumps(result, indent=2) + "\n")
    say(f"eval on {shard.rows} dev rows: {describe(scores)}")
    return result
