"""`zl plan` end to end on tiny-random with local devices at unequal CPU quotas (issue 27 items 1, 2): the
calibration rounds run real `zl_runner`s, the second plan reads the cache, a device that fails is named, and
`zl train --stages auto` trains on the planned split.

Slow: the two calibration exports (and the planned split's, for `zl train`) take minutes on a small machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, native_library_or_skip
from zl_base.errors import ZLError

pytestmark = pytest.mark.slow

RUNNER = Path(os.environ.get("ZL_RUNNER_BIN", REPO / "build" / "runner" / "zl_runner"))
QUOTAS = (1.0, 0.15)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One cache for the module: the calibration exports are made once, then reused by every test."""
    native_library_or_skip()
    if not RUNNER.is_file():
        pytest.skip(f"{RUNNER} not built; run `bash setup.sh`")
    return tmp_path_factory.mktemp("plan-cache")


@pytest.fixture
def env(cache, monkeypatch):
    monkeypatch.setenv("ZL_CACHE_DIR", str(cache))
    return cache


def settings():
    from zl_device.run.train_settings import TrainSettings
    from zl_export.data_settings import DataSettings
    from zl_export.options import ModelSplit

    return TrainSettings(split=ModelSplit("tiny-random", num_stages=2), devices="local:2", cpu_quota=QUOTAS,
                         rows=DataSettings(seq_len=64))


def test_calibration_measures_each_device_then_a_second_plan_reads_the_cache(env, monkeypatch):
    from zl_device.plan import calibrate
    from zl_device.plan.calibrate import ROUND_MICRO_BATCHES, round_layers
    from zl_device.plan.costs import WARMUP_MICRO_BATCHES
    from zl_device.plan.planner import PlanSettings, make_plan
    from zl_export.stages import parse_spec

    said = []
    plan = make_plan(settings(), PlanSettings(), say=said.append)
    assert any(line.startswith("calibration: 1 layer(s) per stage on local-0, local-1") for line in said)
    assert len(parse_spec(plan.stages, 4)) == 2 and plan.num_layers == 4 and plan.seq_len == 64
    for k, entry in enumerate(plan.calibration):
        assert [m["layers"] for m in entry["rounds"]] == round_layers(4, 2) == [1, 2] and entry["measured_now"]
        for m in entry["rounds"]:
            assert m["micro_batches"] == ROUND_MICRO_BATCHES - WARMUP_MICRO_BATCHES and m["pss_mib"] > 0
            if k == 0:  # held still by the default --stage-lr, it is calibrated as it will run: forward only
                assert m["phase1_ms"] > 0 and m["phase2_ms"] == 0
            else:  # the last stage has no marker: its phase 1 only stages the inputs, the step is all phase 2
                assert m["phase1_ms"] < m["phase2_ms"] / 4
        assert Path(entry["cache"]).is_file()
    assert all(p.total_ms > 0 and p.pss_mib > 0 and p.budget_mib > 0 for p in plan.per_stage)
    assert plan.cpu_quota == list(QUOTAS)

    monkeypatch.setattr(calibrate, "run_round", lambda *a, **k: pytest.fail("a cached device was calibrated again"))
    again = make_plan(settings(), PlanSettings(), say=said.append)
    assert again.stages == plan.stages and again.slowest_ms == pytest.approx(plan.slowest_ms)
    assert said[-1].startswith("calibration: cached for local-0, local-1")


def test_a_device_that_fails_calibration_is_named_with_its_reason(env, monkeypatch):
    from zl_device.devices.local import LocalDevice
    from zl_device.plan.planner import PlanSettings, make_plan

    real = LocalDevice._command

    def command(self):
        if self.name == "local-1":
            return ["sh", "-c", "echo 'zl_runner: cannot map the program: out of memory' >&2; exit 1", "sh"]
        return real(self)

    monkeypatch.setattr(LocalDevice, "_command", command)
    with pytest.raises(ZLError, match=r"^calibration failed on local-1 \(stage 1, 1 layer\(s\) per stage\): "
                                      r"zl_runner: cannot map the program: out of memory\. Fix that device"):
        make_plan(settings(), PlanSettings(recalibrate=True), say=lambda line: None)


def test_train_with_stages_auto_trains_on_the_planned_split(env, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "zl.cli", "train", "--model", "tiny-random", "--devices", "local:2",
           "--num-stages", "2", "--cpu-quota", ",".join(map(str, QUOTAS)), "--seq-len", "64", "--stages", "auto",
           "--samples", "8", "--window", "4", "--eval-limit", "4", "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "ZL_CACHE_DIR": str(env)},
                          timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "calibration: cached for local-0, local-1" in done.stdout  # the plan of the test above
    plan = json.loads((out / "plan.json").read_text())
    trained = json.loads((out / "train_settings.json").read_text())
    assert trained["split"]["stages"] == plan["stages"] and trained["cpu_quota"] == list(QUOTAS)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("type") == "micro_batch" for r in metrics) == 2 * 8
