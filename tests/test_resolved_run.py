"""The run resolved once (zl_device/run/resolved_run.py) and the typed stage config both runtimes derive from
(zl_device/formats/stage_spec.py): roles are fields, set by one rule, read by the launch, the torch job and the
runner; `--resume` reads the resolved run back. Fast: no model, no runner."""

import json
from dataclasses import replace

import pytest

from zl_base.errors import ZLError


def settings(**kw):
    """Settings of a run on label words, whose schedule `zl train` chose (zerolock) unless `kw` gives one (None:
    not chosen yet)."""
    from zl_device.run.train_settings import TrainSettings

    return TrainSettings(**{"schedule": "zerolock", **kw})


def test_the_role_follows_one_rule_and_is_checked():
    from zl_device.formats.stage_spec import FORWARD, TRAIN, StageSpec, stage_specs

    assert [s.role for s in stage_specs([0.0, 0.0, 2e-3], "zerolock")] == [FORWARD, FORWARD, TRAIN]
    assert [s.role for s in stage_specs([0.0, 1e-3, 0.0], "zerolock")] == [FORWARD, TRAIN, TRAIN]  # the last: loss
    assert [s.role for s in stage_specs([0.0, 0.0, 2e-3], "async")] == [TRAIN] * 3  # grad_input owed upstream
    with pytest.raises(ValueError, match="only a ZeroLock stage at lr 0 before the last is held still"):
        StageSpec(0, 3, 1e-3, FORWARD, "zerolock")
    with pytest.raises(ValueError, match="only a ZeroLock stage at lr 0 before the last is held still"):
        StageSpec(0, 3, 0.0, FORWARD, "gpipe")
    with pytest.raises(ValueError, match="role in"):
        StageSpec(0, 3, 0.0, "frozen", "zerolock")


def test_a_run_resolves_its_stages_windows_and_optimizer_in_one_place():
    from zl_device.run.resolved_run import ResolvedRun

    r = ResolvedRun.of(settings(samples=10, window=4), 64, 4)
    assert (r.schedule, r.seq_len, r.max_targets, r.stage_lr) == ("zerolock", 64, 4, (0.0, 0.0, 1.0))
    assert [(st.index, st.role, st.lr) for st in r.stages] == [(0, "forward", 0.0), (1, "forward", 0.0),
                                                              (2, "train", r.optimizer.lr)]
    assert (r.windows.num_micro_batches, r.windows.num_windows, r.optimizer.warmup_windows) == (10, 3, 2)
    short = ResolvedRun.of(settings(samples=8, window=4), 64, 4)  # 2 windows: the warm-up leaves the last to the cosine
    assert short.optimizer.warmup_windows == 1
    pipedream = ResolvedRun.of(settings(schedule="pipedream", stage_lr=(1.0, 1.0, 2.0)), 64, 4)
    assert pipedream.schedule == "async" and [st.role for st in pipedream.stages] == ["train"] * 3
    assert [st.lr for st in pipedream.stages] == [pipedream.optimizer.lr * m for m in (1.0, 1.0, 2.0)]
    options = r.export_options(settings(seed=7))
    assert (options.seq_len, options.max_targets, options.seed) == (64, 4, 7)


def test_the_resolved_run_round_trips_and_a_bad_file_is_named(tmp_path):
    from zl_device.formats.run_layout import RunLayout
    from zl_device.run.resolved_run import ResolvedRun

    layout = RunLayout(tmp_path)
    assert ResolvedRun.load(layout) is None  # a run older than the file
    r = ResolvedRun.of(settings(samples=12, stage_lr=(0.0, 1.0, 2.0)), 80, 8)
    r.save(layout)
    assert ResolvedRun.load(layout) == r
    data = json.loads(layout.resolved.read_text())
    layout.resolved.write_text(json.dumps({**data, "version": 99}))
    with pytest.raises(ZLError, match=r"resolved_run.json: not a resolved run this zl reads \(version 99, this zl "
                                      r"reads 1\); resume the run with the zl that started it"):
        ResolvedRun.load(layout)
    layout.resolved.write_text(json.dumps({**data, "stages": [{**data["stages"][2], "role": "forward"}]}))
    with pytest.raises(ZLError, match="only a ZeroLock stage at lr 0 before the last is held still"):
        ResolvedRun.load(layout)
    layout.resolved.write_text('{"version": ')
    with pytest.raises(ZLError, match="resolved_run.json: not valid JSON"):
        ResolvedRun.load(layout)


def test_a_resume_reads_the_resolved_run_back_instead_of_working_it_out_again(tmp_path, monkeypatch):
    """The run started with --stage-lr's default of its time and a sequence length of 48; resumed under a zl whose
    default differs, it continues with those: nothing is worked out again but the data at the saved length."""
    from zl_device.formats.run_layout import RunLayout
    from zl_device.run import resolved_run, train_data
    from zl_device.run.resolved_run import ResolvedRun, resolve_run

    layout = RunLayout(tmp_path)
    started = ResolvedRun.of(settings(stage_lr=(1.0, 1.0, 2.0)), 48, 4)
    started.save(layout)
    seen = {}

    def prepare_data(s, tokenizer, seq_len, data_dir, say):
        seen.update(seq_len=seq_len, max_targets=s.export.max_targets)
        return tmp_path / "train.safetensors", None

    monkeypatch.setattr(train_data, "prepare_data", prepare_data)
    monkeypatch.setattr(resolved_run, "stage_lr_note", lambda *a: pytest.fail("resolved again"))
    got, shard, dev = resolve_run(settings(resume=True, out=tmp_path), None, layout, print)
    assert got == started and seen == {"seq_len": 48, "max_targets": 4}
    assert resolved_run.ResolvedRun.load(layout) == started


def test_the_launch_and_the_torch_job_take_the_role_from_the_resolved_run(tmp_path):
    """The runner config carries the role (the runner checks it against its lr, runner_config_test.cpp); the
    coordinator's display and the torch job read it from the resolved run, not from a learning rate."""
    from types import SimpleNamespace

    from zl_device.executorch.launch import stage_configs
    from zl_device.formats.run_layout import RunLayout
    from zl_device.formats.runner_config import SETTING_NAMES
    from zl_device.run.resolved_run import ResolvedRun
    from zl_device.run.torch_runtime import torch_job
    from zl_device.torch.job import TorchJob

    s = settings(samples=8)
    r = ResolvedRun.of(s, 32, 4)
    manifest = SimpleNamespace(stages=[SimpleNamespace(file=f"stage_{k}.pte") for k in range(3)])
    addresses = SimpleNamespace(stages=[SimpleNamespace(stage=k, config_fields=dict) for k in range(3)])
    devices = [SimpleNamespace(kind="local", cpu_quota=0.5)] * 3
    configs = stage_configs(s, r, manifest, tmp_path, tmp_path / "train.safetensors", addresses, tmp_path / "run.key",
                            "ab" * 16, devices)
    assert [configs[k].threads for k in range(3)] == [1, 1, 1]
    assert [configs[k].role for k in range(3)] == ["forward", "forward", "train"]
    assert [configs[k].optimizer.lr for k in range(3)] == [0.0, 0.0, r.optimizer.lr]
    assert configs[0].optimizer.schedule.warmup_steps == 1  # the resolved (windowed) optimizer's
    backprop = stage_configs(s, ResolvedRun.of(settings(samples=8, schedule="async"), 32, 4), manifest, tmp_path,
                             tmp_path / "train.safetensors", addresses, tmp_path / "run.key", "ab" * 16, devices)
    for wire in SETTING_NAMES.values():  # the written-down wire names are the ones the configs use
        node = backprop[0]
        for part in wire.split("."):
            node = getattr(node, part)

    job = torch_job(s, r, RunLayout(tmp_path), tmp_path / "train.safetensors")
    assert job.roles == ["forward", "forward", "train"] and [job.forward_only(k) for k in range(3)] == [
        True, True, False]
    older = {k: v for k, v in vars(job).items() if k != "roles"}  # a job written before roles: the same rule
    assert TorchJob(**older).roles == job.roles
    assert not replace(job, forward_only_at_lr0=False).forward_only(0)


def test_the_schedule_default_follows_the_data(tmp_path):
    """No --schedule: async on generative rows (every stage on the final loss's gradient, level with backprop on
    headlines), zerolock on label words; the recovery mode follows the chosen schedule unless --recovery was given,
    and the checks that depend on the schedule run on the chosen one. Nothing reads a schedule before it is
    chosen: no placeholder stands in for it."""
    from zl_device.run.resolved_run import ResolvedRun, run_stage_lr
    from zl_device.run.train_data import data_is_generative, resolve_schedule
    from zl_export.data_columns import DataColumns
    from zl_export.data_settings import DataSettings

    unset = settings(schedule=None)
    assert unset.schedule is None and unset.recovery is None
    for asked in (lambda: unset.backprop, lambda: run_stage_lr(unset), lambda: ResolvedRun.of(unset, 32, 4)):
        with pytest.raises(RuntimeError, match="before it was chosen for the data"):
            asked()
    assert settings(schedule=None, keep_activations=True).validate() is None  # the data may choose a backprop one
    generative, words = unset.with_schedule_for(True), unset.with_schedule_for(False)
    assert (generative.schedule, generative.recovery, run_stage_lr(generative)) == ("async", "global", (1.0,) * 3)
    assert (words.schedule, words.recovery, run_stage_lr(words)) == ("zerolock", "local", (0.0, 0.0, 1.0))
    assert settings(schedule="gpipe").with_schedule_for(False).schedule == "gpipe"  # a given schedule stays
    given = settings(schedule=None, recovery="local").with_schedule_for(True)
    assert given.recovery == "local"
    with pytest.raises(ZLError, match="--schedule async --recovery local"):
        given.validate()
    with pytest.raises(ZLError, match="--keep-activations --schedule zerolock"):
        settings(schedule=None, keep_activations=True).with_schedule_for(False).validate()

    news = tmp_path / "news.csv"
    news.write_text("title,description\nRocket lands,A booster landed.\nRates unchanged,The bank held rates.\n")
    rows = DataSettings(columns=DataColumns(prompt_template="Text: {description}\\nTitle:", completion_column="title"))
    labels = tmp_path / "labels.csv"
    labels.write_text("text,label\nRocket lands,science\nRates unchanged,business\n")
    assert data_is_generative(settings(data=str(news), rows=rows))
    assert not data_is_generative(settings(data=str(labels))) and not data_is_generative(settings())  # the demo
    assert not data_is_generative(settings(data=str(tmp_path / "missing.csv")))  # open_run names it next
    said = []
    assert resolve_schedule(settings(schedule=None, data=str(news), rows=rows), said.append).schedule == "async"
    assert len(said) == 1 and said[0].startswith("schedule: async (the default on generative data)")
    assert "headlines-smollm2-135m-1024-async" in said[0]
    assert resolve_schedule(settings(schedule=None, data=str(labels)), said.append).schedule == "zerolock"
    assert len(said) == 1
    assert resolve_schedule(settings(schedule=None, data=str(news), rows=rows)).schedule == "async"
    assert len(said) == 1  # no say: no line


def test_each_device_gets_its_own_thread_count_unless_threads_is_given(monkeypatch):
    """--threads' default: a local device its CPU quota rounded up, or this host's CPUs shared among the stages; a
    phone 0, which its runner turns into its performance cores (zl/cpu_cores.h); a given --threads everywhere."""
    from types import SimpleNamespace

    from zl_device.executorch.launch import device_threads, threads_line

    monkeypatch.setattr("os.cpu_count", lambda: 8)
    local = lambda quota=None: SimpleNamespace(kind="local", cpu_quota=quota)  # noqa: E731
    assert [device_threads(local(q), None, 3) for q in (0.5, 1.0, 1.5, 4.0)] == [1, 1, 2, 4]
    assert device_threads(local(), None, 3) == 2 and device_threads(local(), None, 1) == 8
    assert device_threads(local(), None, 16) == 1
    assert device_threads(SimpleNamespace(kind="adb"), None, 3) == 0
    assert device_threads(SimpleNamespace(kind="adb"), 3, 3) == device_threads(local(0.5), 3, 3) == 3
    assert threads_line([0, 0], None).startswith("threads per stage: the device's performance cores / the device's")
    assert threads_line([2, 2, 2], 2) == "threads per stage: 2 / 2 / 2 (--threads)"



@pytest.mark.parametrize("split, spares, devices", [
    ({}, 0, "local:3"),  # the default 3 stages
    ({"stages": "0-5,6-11,12-16,17-21"}, 0, "local:4"),
    ({"num_stages": 1}, 0, "local:1"),  # the one-device baseline opens no idle devices
    ({"num_stages": 2}, 1, "local:3"),
    ({"stages": "auto"}, 0, "local:3"),  # the plan chooses the stages for the devices: --num-stages' 3
])
def test_without_devices_a_run_gets_one_local_device_per_stage_and_per_spare(split, spares, devices):
    """`zl train --stages 0-5,6-11,12-16,17-21` on its own used to stop with "--devices local:3 gives 3 device(s);
    4 stages need 4"; the default follows the split. What it resolved to is the setting RUN_DIR keeps."""
    from zl_export.options import ModelSplit

    s = settings(split=ModelSplit(**split), spares=spares)
    assert s.devices == devices and s.devices_spec.count == int(devices.split(":")[1])
    assert settings(split=ModelSplit(stages="0-1,2-3"), devices="local:5").devices == "local:5"  # given: kept
