"""`zl train` from top to bottom: data -> export -> deploy -> run -> pull -> merge -> eval -> report.

`run_training` calls one function per step; the steps live in their own
modules (export_cache, train_data, launch, collect). A run directory ends up
holding (docs/design.md §6):

    RUN_DIR/manifest.json            the export's manifest (programs stay in the export cache)
    RUN_DIR/data/train.safetensors   the shard stage 0 trains on (+ dev.safetensors when there is one)
    RUN_DIR/run.key, stage_<k>.json  the run key (deleted when the run finishes) and the stage configs
    RUN_DIR/UNFINISHED.txt           until the run finishes: how to continue it (`zl train --resume`)
    RUN_DIR/devices/local-<i>/       local devices' working folders
    RUN_DIR/logs/<device>/           runner output, configs, telemetry as pulled
    RUN_DIR/stages/stage_<k>/metrics.jsonl, RUN_DIR/metrics.jsonl (merged, with coordinator events)
    RUN_DIR/checkpoints/stage_<k>/window_*/
    RUN_DIR/adapter/                 the PEFT adapter of the whole model
    RUN_DIR/eval.json, report.json, report.md, plots/
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from zl.errors import ZLError
from zl.settings import to_json
from zl_device.run.launch import RUN_KEY
from zl_device.run.train_settings import TrainSettings


@dataclass
class TrainResult:
    run_dir: Path
    wall_s: float
    samples: int
    report: dict = field(default_factory=dict)
    eval: dict = field(default_factory=dict)


class RunModel:
    """The run's model, loaded at most once: its tokenizer for the data, the model for the export and the eval."""

    def __init__(self, spec: str, seed: int):
        self.spec, self.seed = spec, seed
        self._tokenizer = None
        self._loaded = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from zl_export.model_source import load_tokenizer

            self._tokenizer = self._loaded.tokenizer if self._loaded is not None else load_tokenizer(self.spec)
        return self._tokenizer

    def loaded(self):
        """The `LoadedModel` (base weights; the export leaves no LoRA layers in it)."""
        if self._loaded is None:
            from zl_export.model_source import load_model

            self._loaded = load_model(self.spec, seed=self.seed)
        return self._loaded


def run_training(s: TrainSettings, say=print, on_update=None, export_progress=None) -> TrainResult:
    """The whole `zl train` job; `say` prints a step's line, `on_update` gets the coordinator's stage states,
    `export_progress` (a zl_export.pipeline.ExportProgress) sees the export when the cache has none.

    A run that fails leaves RUN_DIR only when `--resume` can continue it, marked so (INCOMPLETE_MARKER); one that
    fails before its stages started leaves nothing (`kept_if_resumable`)."""
    if s.resume:
        s = resumed_settings(s)
    if s.runtime == "torch":  # the stages as torch.distributed ranks: zl_device/run/torch_runtime.py
        from zl_device.run.torch_runtime import run_torch_training

        return run_torch_training(s, say, on_update)
    start = time.time()
    keep_dir = is_empty_dir(s.out)
    run_dir, spec = reopen_run(s, say) if s.resume else open_run(s, say)
    with kept_if_resumable(run_dir, () if s.resume else RESUME_NEEDS, say, keep_dir):
        return _run(s, run_dir, spec, start, say, on_update, export_progress)


def _run(s: TrainSettings, run_dir: Path, spec, start: float, say, on_update, export_progress) -> TrainResult:
    """run_training's steps in RUN_DIR, once it is open."""
    from zl_device.devices.registry import open_devices
    from zl_device.run.collect import collect
    from zl_device.run.coordinator import Injection
    from zl_device.run.export_cache import export_cached
    from zl_device.run.launch import launch
    from zl_device.run.train_data import prepare_data, run_max_targets, run_seq_len

    model = RunModel(s.split.model, s.seed)
    seq_len = run_seq_len(s, model.tokenizer)
    # The data first (seconds): the programs' target slots must fit it, and a misfit must fail before the export.
    shard, dev = prepare_data(s, model.tokenizer, seq_len, run_dir / "data", say)
    opts = s.export_options(seq_len, run_max_targets(s, shard, say))
    export_dir, manifest = export_cached(s, opts, model.loaded, say, export_progress, calibration=shard)
    shutil.copyfile(export_dir / "manifest.json", run_dir / "manifest.json")
    num_stages = len(manifest["stages"])
    windows = s.windows()
    injection = Injection.parse(s.inject_failure, num_stages, windows.num_windows) if s.inject_failure else None

    devices = open_devices(spec, run_dir, link_profile=s.link_profile, mode=s.mode)
    try:
        with launch(s, devices, spec.kind == "local", run_dir, export_dir, manifest, shard, windows, injection,
                    say) as launched:
            events, run_times = supervise(launched, run_dir, on_update)
    except BaseException:
        # The devices keep what `zl train --resume` needs (key, shard, input logs); a finished resume removes them.
        say(f"devices: the run key, data shard and input logs stay on the devices for `zl train --resume --out "
            f"{run_dir}`")
        raise
    events.append(run_event(s, launched, num_stages, run_times))
    collect(run_dir, launched.devices, num_stages, events, say)
    forget_device_files(s, devices, say)  # every device: a failed stage's first one and spares too
    result = TrainResult(run_dir, time.time() - start, windows.num_micro_batches * s.export.micro_batch)
    return finish_run(s, model, result, dev, say)


def finish_run(s: TrainSettings, model: RunModel, result: TrainResult, dev: Path | None, say) -> TrainResult:
    """A run's last steps, both runtimes: eval (when there is dev data), report, and the run marked finished: its
    key deleted (nothing can resume it any more, PROTOCOL.md §8), then its marker."""
    from zl_device.results.report import write_report

    if dev is not None:
        result.eval = evaluate_run(s, model, result.run_dir, dev, say)
    result.report = write_report(result.run_dir)
    (result.run_dir / RUN_KEY).unlink(missing_ok=True)
    for marker in (INCOMPLETE_MARKER, LEGACY_INCOMPLETE_MARKER):
        (result.run_dir / marker).unlink(missing_ok=True)
    say(f"report: {result.run_dir / 'report.md'}")
    return result


# The run's settings, as open_run found them: `zl train --resume` continues with these.
SETTINGS_FILE = "train_settings.json"

# In RUN_DIR from its creation until the report is written, saying how to continue the run: a run that failed or
# was interrupted leaves it, and a rerun with the same --out moves such a directory aside (to RUN_DIR.unfinished-N,
# logs and all) instead of refusing. Directories of older versions carry the hidden LEGACY_INCOMPLETE_MARKER.
INCOMPLETE_MARKER = "UNFINISHED.txt"
LEGACY_INCOMPLETE_MARKER = ".zl-incomplete"
# What `zl train --resume` needs in RUN_DIR (the ExecuTorch runtime; --runtime torch: its torch_job.json): without
# them a failed run cannot be continued, and leaves nothing behind.
RESUME_NEEDS = (RUN_KEY, "stage_0.json")


def is_unfinished(run_dir: Path) -> bool:
    """Whether RUN_DIR holds a run that has not finished (its marker is there)."""
    return any((run_dir / m).is_file() for m in (INCOMPLETE_MARKER, LEGACY_INCOMPLETE_MARKER))


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
    from zl_device.devices.registry import check_mode, parse_devices
    from zl_device.run.coordinator import Injection
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
    spec = parse_devices(s.devices)
    check_mode(spec, s.mode)
    if s.inject_failure:
        Injection.parse(s.inject_failure, s.split.count, s.windows().num_windows)
    if s.runtime != "torch":  # torch runs one rank per stage, whatever --devices says
        check_device_count(s, spec, s.split.count)
    for flag, value in (("--data", s.data), ("--eval-data", s.eval_data)):
        if value is not None and value != DEMO and not Path(value).expanduser().is_file():
            raise ZLError(f"{flag} {value}: no such file; pass `demo`, a .csv/.jsonl file or a .safetensors shard.")
    check_samples(s)
    if leftovers:
        aside = _free_name(run_dir, "unfinished")
        run_dir.rename(aside)
        say(f"--out {run_dir}: an unfinished run was there; moved it to {aside} (its logs and checkpoints are kept)")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / INCOMPLETE_MARKER).write_text(_marker_text(run_dir))
    (run_dir / SETTINGS_FILE).write_text(json.dumps(to_json(s), indent=2) + "\n")
    return run_dir, spec


def resumed_settings(s: TrainSettings) -> TrainSettings:
    """`zl train --resume --out RUN_DIR`: the settings RUN_DIR's run started with, marked to resume (an injected
    failure happens once, so it is dropped). Other options given with --resume are not used.

    Raises:
        ZLError: RUN_DIR holds no unfinished run.
    """
    from zl.settings import from_json

    run_dir = Path(s.out).expanduser().resolve()
    saved = run_dir / SETTINGS_FILE
    if not saved.is_file():
        raise ZLError(f"--resume --out {run_dir}: no {SETTINGS_FILE} there, so it is not a `zl train` run directory; "
                      "pass the --out of the run to continue.")
    if not is_unfinished(run_dir):
        raise ZLError(f"--resume --out {run_dir}: that run finished (its report is written); nothing to resume.")
    settings = from_json(TrainSettings, json.loads(saved.read_text()), str(saved))
    return replace(settings, out=run_dir, resume=True, inject_failure=None)


def reopen_run(s: TrainSettings, say):
    """open_run for `--resume`: the same checks, on the existing RUN_DIR. Returns (run_dir, the devices spec)."""
    from zl_device.devices.registry import check_mode, parse_devices

    say(f"resume: {s.out} with its own settings ({SETTINGS_FILE}), every stage from its checkpoints")
    s.validate()
    spec = parse_devices(s.devices)
    check_mode(spec, s.mode)
    return Path(s.out), spec


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


def supervise(launched, run_dir: Path, on_update) -> tuple[list[dict], tuple[float, float]]:
    """Run the pipeline to its end; returns the coordinator's events and the run's (start, end) Unix times.

    On a failure the stages are stopped and what they wrote is pulled before the error goes on.
    """
    from zl_device.devices.deploy import pull

    run_start = time.time()
    try:
        events = launched.coordinator.run(on_update)
    except BaseException:
        launched.coordinator.stop_all()
        pull(launched.devices, run_dir)
        raise
    return events, (run_start, time.time())


def forget_device_files(s: TrainSettings, devices, say) -> None:
    """The run key, shard and input logs leave the devices once a finished run is pulled, unless
    --keep-device-files (a run that fails keeps them for --resume)."""
    from zl_device.devices.deploy import remove_run_files

    if s.keep_device_files:
        say("devices: run key, data shard and input logs kept (--keep-device-files)")
        return
    try:
        removed = remove_run_files(devices)
    except ZLError as e:  # a phone gone by now: say so, the run's result stands
        say(f"devices: could not remove the run key, data shard and input logs: {e}")
        return
    if removed:
        say(f"devices: removed the run key, data shard and input logs ({len(removed)} paths)")


def run_event(s: TrainSettings, launched, num_stages: int, times: tuple[float, float]) -> dict:
    """The `run` event of metrics.jsonl (schema in zl_device/run/metrics_log.py)."""
    run_start, run_end = times
    return {"type": "run", "start_unix_ms": int(run_start * 1000), "end_unix_ms": int(run_end * 1000),
            "samples": launched.windows.num_micro_batches * s.export.micro_batch, "run_id": launched.run_id,
            "num_stages": num_stages, "window_size": launched.windows.window_size,
            "num_micro_batches": launched.windows.num_micro_batches,
            "recovery": s.recovery, "devices": [d.name for d in launched.devices],
            "control_heartbeats": [st.heartbeat_seen for st in launched.coordinator.status]}


def evaluate_run(s: TrainSettings, model: RunModel, run_dir: Path, dev: Path, say) -> dict:
    """Base model and adapter on the dev shard (prompt/completion data: with scored generations); writes
    RUN_DIR/eval.json."""
    from zl_device.results.evaluate import GenerationEval, describe, eval_record, evaluate_with_adapter, limit_rows
    from zl_export.shard import load_shard

    shard = limit_rows(load_shard(dev), s.eval_limit)
    generation = GenerationEval(model.loaded().tokenizer)
    scores = evaluate_with_adapter(model.loaded().model, shard, run_dir / "adapter", generation=generation)
    result = {"data": str(dev), "rows": shard.rows, **eval_record(scores, shard, generation)}
    (run_dir / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    say(f"eval on {shard.rows} dev rows: {describe(scores)}")
    return result
