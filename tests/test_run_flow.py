"""The one `zl train` flow (zl_device/run/train_job.py) over its two runtimes, and the torch runtime's schedule table.

Fast: no model, no ranks. The flow end to end is tests/test_train.py (ExecuTorch) and tests/test_torch_runtime.py
(torch, slow).
"""

import ast
import json

import pytest

from conftest import REPO, load_tool
from zl_base.errors import ZLError


def test_every_runtime_option_has_a_runtime():
    from zl_device.run import train_settings
    from zl_device.run.train_job import RUNTIMES

    assert set(RUNTIMES) == set(train_settings.RUNTIMES)
    assert all(cls.name == name for name, cls in RUNTIMES.items())


def test_the_run_event_is_one_line_for_both_runtimes():
    from zl_device.formats.run_layout import RunLayout
    from zl_device.run.resolved_run import ResolvedRun
    from zl_device.run.runtime import Run, RunRecord, run_event
    from zl_device.run.train_settings import TrainSettings
    from zl_export.options import ModelSplit

    s = TrainSettings(samples=10, window=4, split=ModelSplit(num_stages=2), schedule="zerolock")
    run = Run(s, ResolvedRun.of(s, 64, 4), RunLayout("."), None, None, print)
    record = RunRecord([], 1_000, 5_000, "ab" * 16, ["rank-0", "rank-1"], {"launch_s": 1.5})
    event = run_event(run, record)
    assert event == {"type": "run", "start_unix_ms": 1_000, "end_unix_ms": 5_000, "samples": 10, "run_id": "ab" * 16,
                     "num_stages": 2, "window_size": 4, "num_micro_batches": 10, "recovery": "local",
                     "devices": ["rank-0", "rank-1"], "launch_s": 1.5}


def test_the_fold_leaves_lifecycle_to_the_coordinator_unless_asked():
    """The coordinator learns that a stage started or ended from its process: a `done` line must not mark a
    runner done before it exits (its exit status decides), nor a `start` line count a restart. The torch watch,
    which has only the lines, asks for them."""
    from zl_device.formats.stage_status import StageStatus, fold_telemetry

    lines = [{"type": "start", "first_micro_batch": 0}, {"type": "micro_batch", "micro_batch": 3, "loss": 2.0},
             {"type": "window", "window": 1, "mean_loss": 1.5, "pss_mib": 12.0}, {"type": "done"},
             {"type": "start", "first_micro_batch": 2, "resumed_from_window": 0}]
    coordinator, watch = StageStatus(0, "local-0"), StageStatus(0, "rank-0")
    for record in lines:
        fold_telemetry(coordinator, record, 1.0)
        fold_telemetry(watch, record, 1.0, lifecycle=True)
    assert (coordinator.state, coordinator.restarts, coordinator.micro_batches_done) == ("running", 0, 4)
    assert (coordinator.last_committed_window, coordinator.last_loss, coordinator.pss_mib) == (1, 1.5, 12.0)
    assert (watch.state, watch.restarts, watch.micro_batches_done, watch.last_committed_window) == ("running", 1, 2, 0)


def test_a_forward_only_stage_shows_that_it_is_held_still_instead_of_a_missing_loss():
    """A stage held still by lr 0 writes null losses and `forward_only: true`: the display says so ("lr 0: forward
    only"), not "-" as for a loss not yet seen."""
    from zl.commands.train import loss_text
    from zl_device.formats.stage_status import StageStatus, fold_telemetry

    held, fresh = StageStatus(0, "local-0"), StageStatus(1, "local-1")
    for record in ({"type": "start", "first_micro_batch": 0, "forward_only": True},
                   {"type": "micro_batch", "micro_batch": 0, "loss": None, "forward_only": True},
                   {"type": "window", "window": 0, "mean_loss": None, "forward_only": True}):
        fold_telemetry(held, record, 1.0)
    assert held.forward_only and held.last_loss is None and held.last_committed_window == 0
    assert loss_text(held) == "lr 0: forward only" and loss_text(fresh) == "-"
    fold_telemetry(fresh, {"type": "micro_batch", "micro_batch": 0, "loss": 2.25, "forward_only": False}, 1.0)
    assert loss_text(fresh) == "2.2500" and not fresh.forward_only


def test_resume_needs_what_its_runtime_needs_before_anything_runs(tmp_path):
    """`--resume` on a run directory whose runtime's files are missing fails at once, naming them (the ExecuTorch
    runtime used to find out only at its launch, after the data and export steps)."""
    from zl_device.run.train_job import run_training
    from zl_device.run.train_settings import TrainSettings

    for runtime, needs in (("executorch", "run.key or stage_0.json"), ("torch", "torch_job.json")):
        run_dir = tmp_path / runtime
        run_dir.mkdir()
        (run_dir / "UNFINISHED.txt").write_text("unfinished\n")
        (run_dir / "train_settings.json").write_text(json.dumps({"runtime": runtime}))
        said = []
        with pytest.raises(ZLError, match=f"no {needs} there, so that run never started its stages"):
            run_training(TrainSettings(resume=True, out=run_dir), say=said.append)
        assert said == [] and sorted(p.name for p in run_dir.iterdir()) == ["UNFINISHED.txt", "train_settings.json"]


def test_a_resume_of_a_run_older_than_its_resolved_run_reads_the_stage_lr_off_its_configs(tmp_path):
    """A run started before zl wrote resolved_run.json, whose settings do not record --stage-lr either, resumes
    with the multipliers its stages' configs hold (a run with one reads it back: tests/test_resolved_run.py)."""
    from zl_base.settings import to_json
    from zl_device.formats.run_layout import RunLayout
    from zl_device.formats.runner_config import OptimizerConfig, RunnerConfig
    from zl_device.run.train_job import resumed_settings
    from zl_device.run.train_settings import TrainSettings

    layout = RunLayout(tmp_path)
    (tmp_path / "UNFINISHED.txt").write_text("unfinished\n")
    started = TrainSettings(out=tmp_path)
    layout.settings.write_text(json.dumps(to_json(started)))
    lr = started.optimizer.lr
    for k, m in enumerate((1.0, 1.0, 2.0)):  # every stage trained, the last at twice the lr
        config = RunnerConfig(program=f"stage_{k}.pte", stage_index=k, num_stages=3, run_key_file="run.key",
                              run_id="ab" * 16, window_size=2, num_micro_batches=8, checkpoint_dir="checkpoints",
                              optimizer=OptimizerConfig(lr=lr * m))
        layout.stage_config(k).write_text(json.dumps(config.to_json()))
    assert resumed_settings(TrainSettings(resume=True, out=tmp_path)).stage_lr == (1.0, 1.0, 2.0)

    layout.stage_config(1).write_text('{"optimizer": ')  # a config cut short
    with pytest.raises(ZLError, match=r"^--resume --out .*: runner config .*stage_1.json: .*JSON.*; restore the file "
                                      r"\(each device holds a copy\)"):
        resumed_settings(TrainSettings(resume=True, out=tmp_path))
    layout.resolved.write_text("{}")  # a run with a resolved run: its configs are not read
    assert resumed_settings(TrainSettings(resume=True, out=tmp_path)).stage_lr is None


def test_the_torch_runtime_runs_every_schedule_of_the_table_under_its_name():
    from zl_device.formats.schedules import SCHEDULES
    from zl_device.torch.schedules import schedule_named
    from zl_device.torch.schedules.backprop_ranks import TableBackprop
    from zl_device.torch.schedules.base import Schedule

    assert list(SCHEDULES) == ["zerolock", "gpipe", "1f1b", "async"]
    classes = {name: schedule_named(name) for name in SCHEDULES}
    # Every backprop row runs on the one executor of the table's lists, under its own name, one class each.
    assert [name for name, cls in classes.items() if issubclass(cls, TableBackprop)] == ["gpipe", "1f1b", "async"]
    assert schedule_named("gpipe") is classes["gpipe"]
    assert all(issubclass(cls, Schedule) and cls.name == name for name, cls in classes.items())
    assert [name for name, cls in classes.items() if cls.resumable] == ["zerolock"]
    with pytest.raises(ZLError, match="pipeline 'zero-bubble': expected one of zerolock, gpipe, 1f1b, async"):
        schedule_named("zero-bubble")
    assert schedule_named("pipedream") is classes["async"]  # async's first name


def test_bench_pipelines_offers_every_schedule():
    from zl_device.formats.schedules import SCHEDULES

    bench_pipelines = load_tool("bench_pipelines")

    assert set(SCHEDULES) <= set(bench_pipelines.CHOICES)
    assert set(bench_pipelines.PIPELINES) == {*SCHEDULES, bench_pipelines.RUNNER}


def _imports(package: str) -> dict[str, set[str]]:
    """zl_device modules each module of `package` (a folder under zl_device/) imports, anywhere in its code."""
    found = {}
    for path in sorted((REPO / "zl_device" / package).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
        found[str(path.relative_to(REPO))] = {n for n in names if n.startswith("zl_device.")}
    return found


def test_the_torch_package_stands_below_the_run_flow():
    """zl_device/torch (ranks, schedules, launcher) imports no part of zl_device/run: the flow drives it through
    run/torch_runtime.py, so there is no way back up."""
    for path, names in _imports("torch").items():
        assert not {n for n in names if n.startswith("zl_device.run")}, path
