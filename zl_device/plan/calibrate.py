"""Calibration: each device's stage timed and its memory read at two layer counts, on the devices themselves.

A round is a short `zl train` on the run's devices with the run's model, data, sequence length and export options,
through the same code (export cache, deploy, `zl_runner`, the coordinator, the pull; zl_device/run/): every stage
gets `n` layers, micro-batch after micro-batch, and its telemetry says what each phase took (costs.py). Two rounds,
n = 1 and n = ceil(L / K) (the even split's largest stage, for L layers over K stages), fit each device's time and
PSS as fixed + per-layer costs at its own position (stage 0 embeds, the last stage has no marker: its phase 1 is in
its phase 2). The second round spans the layer counts a plan chooses from, so a plan interpolates rather than
extrapolates: with rounds of 1 and 3 layers the slope came from a 2-layer difference of a few noisy medians, and
on SmolLM2 (30 layers, 3 stages) an error of 10 ms per layer became 100 ms per stage and a split worse than even.

The round's programs give every stage the model's layers 0..n-1 (`CalibrationSplit`): a stage's cost depends on
how many layers it runs, not which (every layer has the same shape), so two small exports (cached like any other,
$ZL_CACHE_DIR/exports) serve every later plan of this model and export options, whatever the devices.

A round runs each stage as the run will: a stage the run holds still (`--stage-lr` 0, by default every stage but
the last; `forward_only_stages`) runs forward only (docs/design#windows-and-adamw), so what is measured of it is a held
stage's phase 1, send and PSS (no readout, so none of the LM head's pages; no optimizer state), not a trained one's: on
Gemma 3 270M a held stage peaked at 207 MiB where the trained one reached 534. The others train, and their phase 2
is measured too.

A calibration is cached per device, stage position, role and settings ($ZL_CACHE_DIR/calibrations/<key>.json: key =
the device -- a local device's name, quota, host and runner build; a phone's serial and mode -- the stage index and
count, whether the stage runs forward only, the model, the data and every option that changes a stage's work, the
schedule among them: a backprop stage runs another program, and with --keep-activations one forward less); a plan
whose every stage is cached runs nothing and loads no model. `zl plan --recalibrate` measures again (a phone's new
runner build, a hotter day).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
import shutil
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

from zl_base.errors import ZLError
from zl_base.settings import to_json
from zl_device.devices.backend import RUNNER_STDERR
from zl_device.devices.registry import LOCAL, DevicesSpec
from zl_device.plan.costs import WARMUP_MICRO_BATCHES, Measured, StageCost, measure
from zl_device.run.train_settings import DEMO, TrainSettings
from zl_export.options import ModelSplit
from zl_export.stages import StageRange

log = logging.getLogger(__name__)

#: Bump when what a round measures or how it is fitted changes (2: rounds 1 and L/K; 3: held stages forward only).
CALIBRATION_VERSION = 3
#: Micro-batches per round: the warm-up, then the ones measured.
ROUND_MICRO_BATCHES = WARMUP_MICRO_BATCHES + 8
#: A round of a few micro-batches that takes longer than this has a device that is stuck.
ROUND_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class CalibrationSplit(ModelSplit):
    """Every stage runs the model's layers 0..layers-1 (a calibration round's programs; not a training split)."""

    layers: int = 1

    def ranges(self, num_layers: int) -> list[StageRange]:
        if self.layers > num_layers:
            raise ZLError(f"calibration with {self.layers} layers per stage: the model has {num_layers}.")
        return [StageRange(k, 0, self.layers - 1) for k in range(self.num_stages)]

    @property
    def key(self) -> str:
        return f"calibration:{self.num_stages}x{self.layers}"

    @property
    def chosen_by_default(self) -> bool:
        return False  # its ranges are its own: zl train's default split must not replace them


@dataclass
class Calibration:
    """Every stage's cost model and what the plan needs of the model and data, fresh or from the cache."""

    costs: list[StageCost]
    rounds: list[list[Measured]]  # per stage
    num_layers: int
    hidden_size: int
    seq_len: int
    max_targets: int | None
    cache_files: list[Path]
    measured_now: bool

    def entry_bytes(self, micro_batch: int) -> int:
        """One DATA entry between stages: hidden (B, S, D) float32 plus mask and labels (B, S) int64
        (zl_device/executorch/launch.py `entry_bytes`)."""
        return micro_batch * self.seq_len * self.hidden_size * 4 + 2 * micro_batch * self.seq_len * 8


def device_names(spec: DevicesSpec) -> list[str]:
    """The devices' names as the backends give them (local-i, or the serials), without opening them."""
    return [f"local-{i}" for i in range(spec.count)] if spec.kind == LOCAL else list(spec.serials)


def device_identity(spec: DevicesSpec, index: int, quota: float | None, mode: str) -> dict:
    """What makes a device's calibration valid: a local device is this host with a quota and a runner build; a
    phone is its serial, running the stage the way --mode says."""
    if spec.kind == LOCAL:
        from zl_device.devices.local import host_runner_binary

        runner = host_runner_binary()
        st = runner.stat()
        return {"kind": LOCAL, "host": platform.node(), "cpus": os.cpu_count(), "name": f"local-{index}",
                "cpu_quota": quota, "runner": [str(runner.resolve()), st.st_size, st.st_mtime_ns]}
    return {"kind": spec.kind, "serial": spec.serials[index], "mode": mode}


def model_identity(spec: str) -> dict:
    """The model: a built-in or hub name as it is (their weights are pinned: a packaged version, a hub revision
    read once), a file or directory with its size and mtime. Without zl_export.model_source (torch): a cached plan
    loads no model code at all."""
    path = Path(spec).expanduser()
    if not path.exists():
        return {"spec": spec}
    probe = path / "config.json" if path.is_dir() else path
    st = probe.stat()
    return {"spec": spec, "path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def data_identity(s: TrainSettings) -> dict:
    if s.data == DEMO:
        return {"data": DEMO}
    path = Path(s.data).expanduser().resolve()
    st = path.stat()
    return {"data": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def forward_only_stages(s: TrainSettings, num_stages: int) -> list[bool]:
    """Which of `num_stages` stages run phase 1 only: the roles the run resolves (`run_stage_specs`,
    docs/design#windows-and-adamw); without a --stage-lr, its default: under ZeroLock the stages before the last run
    forward only."""
    from zl_device.run.resolved_run import run_stage_specs

    return [spec.forward_only for spec in run_stage_specs(s, num_stages)]


def cache_key(s: TrainSettings, spec: DevicesSpec, stage: int, quota: float | None) -> dict:
    """Everything a stage's measured cost depends on (module docstring)."""
    return {"v": CALIBRATION_VERSION, "device": device_identity(spec, stage, quota, s.mode), "stage": stage,
            "num_stages": s.split.num_stages, "forward_only": forward_only_stages(s, s.split.num_stages)[stage],
            "model": model_identity(s.split.model), "data": data_identity(s),
            "rows": to_json(s.rows), "export": to_json(s.export), "threads": s.threads, "load_mode": s.load_mode,
            "accumulator_snapshots": s.accumulator_snapshots, "in_flight": s.in_flight,
            "schedule": s.schedule, "keep_activations": s.keep_activations, "grad_dtype": s.grad_dtype,
            "micro_batches": ROUND_MICRO_BATCHES}


def calibration_dir() -> Path:
    """$ZL_CACHE_DIR/calibrations (zl_export.model_source.cache_dir's root, read here without importing torch)."""
    return Path(os.environ.get("ZL_CACHE_DIR", Path.home() / ".cache" / "zl")) / "calibrations"


def cache_file(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return calibration_dir() / f"{digest}.json"


def calibrate(s: TrainSettings, spec: DevicesSpec, quotas: list[float | None], *, recalibrate: bool = False,
              say=print, export_progress=None) -> Calibration:
    """Each stage's cost model on its device: from the cache when every stage has one, else measured now.

    Args:
        s: the run's settings (its model, data, shapes, devices; `split.num_stages` stages on the first devices).
        quotas: the CPU quota of each of the first `num_stages` devices (None: uncapped or a phone).

    Raises:
        ZLError: more stages than the model has layers, or a device that fails calibration (named, with why).
    """
    num_stages = s.split.num_stages
    names = device_names(spec)[:num_stages]
    keys = [cache_key(s, spec, k, quotas[k]) for k in range(num_stages)]
    files = [cache_file(key) for key in keys]
    if not recalibrate:
        cached = [_read_entry(f, key) for f, key in zip(files, keys)]
        if all(c is not None for c in cached):
            first = cached[0]
            check_stage_count(num_stages, first["num_layers"], s.split.model)
            say(f"calibration: cached for {', '.join(names)} ({calibration_dir()})")
            return Calibration([StageCost.from_json(c["fit"]) for c in cached],
                               [[Measured.from_json(m) for m in c["rounds"]] for c in cached], first["num_layers"],
                               first["hidden_size"], first["seq_len"], first["max_targets"], files, False)
    return _measure(s, spec, names, keys, files, say, export_progress)


def check_stage_count(num_stages: int, num_layers: int, model: str) -> None:
    if num_stages > num_layers:
        raise ZLError(f"--num-stages {num_stages}: {model} has only {num_layers} layers, so at most {num_layers} "
                      f"stages of one layer each; use --num-stages {num_layers} or fewer.")


def _read_entry(path: Path, key: dict) -> dict | None:
    try:
        entry = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    # The digest names the file; the key inside guards against a collision or a hand-edited file.
    return entry if json.dumps(entry.get("key"), sort_keys=True, default=str) == json.dumps(
        key, sort_keys=True, default=str) else None


def _measure(s: TrainSettings, spec: DevicesSpec, names: list[str], keys: list[dict], files: list[Path], say,
             export_progress) -> Calibration:
    from zl_device.formats.run_layout import RunLayout
    from zl_device.run.resolved_run import resolve_run
    from zl_device.run.runtime import RunModel

    num_stages = s.split.num_stages
    model = RunModel(s.split.model, s.seed)
    work = calibration_dir() / f"work-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    quiet = _export_lines_only(say)
    started = False  # a round ran: its device logs are worth keeping when the calibration fails
    try:
        config = model.loaded().config  # the export needs it anyway; the stage count is checked before any work
        num_layers, hidden = config.num_hidden_layers, config.hidden_size
        check_stage_count(num_stages, num_layers, s.split.model)
        # The run's sequence length and target slots, resolved from its data as `zl train` will (the rounds'
        # programs must have the run's shapes).
        resolved, shard, _ = resolve_run(replace(s, resume=False), model.tokenizer, RunLayout(work), quiet)
        seq_len, max_targets = resolved.seq_len, resolved.max_targets
        layer_counts = round_layers(num_layers, num_stages)
        rounds: list[list[Measured]] = [[] for _ in range(num_stages)]
        for n in layer_counts:
            say(f"calibration: {n} layer(s) per stage on {', '.join(names)}, {ROUND_MICRO_BATCHES} micro-batches")
            started = True
            lines = run_round(s, n, model, shard, resolved, spec, work / f"layers-{n}", quiet, export_progress)
            for k in range(num_stages):
                m = measure(n, lines[k])
                if m is None:
                    raise ZLError(f"calibration failed on {names[k]} (stage {k}, {n} layer(s) per stage): its "
                                  "telemetry has no micro-batch past the warm-up; see its runner.err.")
                rounds[k].append(m)
    except BaseException:
        if started:
            say(f"calibration: the rounds' folders are kept in {work} (device logs under devices/ and logs/)")
        else:
            shutil.rmtree(work, ignore_errors=True)
        raise
    shutil.rmtree(work, ignore_errors=True)
    costs = [StageCost.fit(r) for r in rounds]
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    for k, (key, path) in enumerate(zip(keys, files)):
        path.parent.mkdir(parents=True, exist_ok=True)
        entry = {"key": key, "device": names[k], "stage": k, "created": created, "num_layers": num_layers,
                 "hidden_size": hidden, "seq_len": seq_len, "max_targets": max_targets,
                 "rounds": [m.to_json() for m in rounds[k]], "fit": costs[k].to_json()}
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(entry, indent=2) + "\n")
        tmp.replace(path)
    return Calibration(costs, rounds, num_layers, hidden, seq_len, max_targets, files, True)


def round_layers(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage of the calibration rounds: 1, and the even split's largest stage (one round when that is 1)."""
    return sorted({1, -(-num_layers // num_stages)})


def round_settings(s: TrainSettings, layers: int, out: Path) -> TrainSettings:
    """The run's settings for one calibration round: `layers` layers on every stage, one window of
    ROUND_MICRO_BATCHES micro-batches, the stages the run holds still at lr 0 (forward only) and the others at
    lr 1, no recovery (a device that fails calibration is reported, not nursed) and no device policy (a round takes
    seconds; a pause would only stretch it)."""
    split = CalibrationSplit(model=s.split.model, num_stages=s.split.num_stages, layers=layers)
    stage_lr = tuple(0.0 if held else 1.0 for held in forward_only_stages(s, s.split.num_stages))
    return replace(s, split=split, samples=ROUND_MICRO_BATCHES * s.export.micro_batch, window=ROUND_MICRO_BATCHES,
                   out=out, runtime="executorch", recovery="local", max_restarts=0, spares=0, inject_failure=None,
                   standby=False, resume=False, keep_device_files=False, stage_lr=stage_lr, timeout_s=ROUND_TIMEOUT_S,
                   policy=type(s.policy)())


def run_round(s: TrainSettings, layers: int, model, shard: Path, resolved, spec: DevicesSpec, out: Path, say,
              export_progress=None) -> list[list[dict]]:
    """One calibration round on the devices; every stage's telemetry lines.

    Raises:
        ZLError: a device failed: named, with the last line of its runner's error output.
    """
    from zl_device.formats.metrics_log import read_lines
    from zl_device.formats.run_layout import RunLayout
    from zl_device.run.executorch_runtime import ExecuTorchRuntime
    from zl_device.run.resolved_run import ResolvedRun
    from zl_device.run.runtime import Run

    rs = round_settings(s, layers, out)
    out.mkdir(parents=True)
    layout = RunLayout(out)
    # The round's own stages and windows, with the run's resolved shapes (`resolved`: the run's ResolvedRun).
    run = Run(rs, ResolvedRun.of(rs, resolved.seq_len, resolved.max_targets), layout, spec, model, say,
              export_progress)
    runtime = ExecuTorchRuntime()
    runtime.prepare(run, shard)
    try:
        runtime.run(run, None, None)
    except ZLError as e:
        raise _failure(getattr(runtime, "devices", [])[:s.split.num_stages], layers, e) from e
    runtime.collect(run)
    return [read_lines(layout.stage_metrics(k)) if layout.stage_metrics(k).is_file() else []
            for k in range(s.split.num_stages)]


def _failure(devices, layers: int, error: ZLError) -> ZLError:
    """The device whose runner failed (not one the coordinator stopped after it), and why."""
    for k, device in enumerate(devices):
        code = device.exit_code()
        if code not in (None, 0, 3, -15):  # 3 / SIGTERM: stopped after another stage failed
            err = (device.read_text(RUNNER_STDERR) or "").strip().splitlines()
            why = err[-1] if err else f"its runner exited with status {code}"
            return ZLError(f"calibration failed on {device.name} (stage {k}, {layers} layer(s) per stage): {why}. "
                           "Fix that device or leave it out of --devices.")
    named = re.match(r"stage (\d+)\b", str(error))  # the coordinator's "stage K failed ..." (a stuck runner)
    if named and int(named.group(1)) < len(devices):
        k = int(named.group(1))
        return ZLError(f"calibration failed on {devices[k].name} (stage {k}, {layers} layer(s) per stage): {error}")
    return ZLError(f"calibration failed: {error}")


def _export_lines_only(say):
    """A round's `say`: the export's lines (a first export takes minutes); not the run's advice on --resume,
    which is no run to resume."""
    return lambda line: say(line) if str(line).startswith("export:") else log.info("%s", line)
