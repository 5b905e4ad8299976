"""zl_study/grad_alignment.py on tiny-random: the last stage's local gradient is the end-to-end one; bad arms are errors.

    .venv/bin/python -m pytest tests/test_grad_alignment.py
"""

import json
from pathlib import Path

import pytest

from zl_study import grad_alignment as tool

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")]


@pytest.fixture(scope="module")
def demo_train(demo_data) -> Path:
    return demo_data / "train.safetensors"


def test_the_last_stage_agrees_with_backprop_exactly_and_upstream_stages_are_measured(demo_train, tmp_path, capsys):
    out = tmp_path / "alignment.json"
    code = tool.main(["--model", "tiny-random", "--train", str(demo_train), "--stages", "0-1,2-3",
                      "--micro-batches", "6", "--arms", "zl-ce,zl-translator", "--trained", "0,8", "--threads", "1",
                      "--out", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["arm"], r["trained_samples"], r["stage"]) for r in rows] == [
        (arm, n, k) for arm in ("zl-ce", "zl-translator") for n in (0, 8) for k in (0, 1)]
    for r in rows:
        assert r["e2e_norm"] > 0 and r["local_norm"] > 0
        if r["stage"] == 1:  # α 1: the last stage's local loss is the final loss, through the same weights
            assert r["cos"] == pytest.approx(1.0, abs=1e-4) and r["sign"] == pytest.approx(1.0, abs=1e-3)
        else:  # upstream: the readout's CE is not the final loss
            assert -1.0 <= r["cos"] < 0.9999 and -1.0 <= r["sign"] <= 1.0
    assert "| zl-ce | 8 | 0 | 0-1 |" in capsys.readouterr().out


@pytest.mark.parametrize("extra, problem", [
    (["--arms", "backprop"], "not a ZeroLock arm"),
    (["--micro-batches", "0"], "at least 1"),
    (["--micro-batches", "100000"], "rows; use fewer"),
    (["--trained", "-4"], "0 or more"),
])
def test_bad_options_are_one_line_errors(demo_train, extra, problem, capsys):
    code = tool.main(["--model", "tiny-random", "--train", str(demo_train), "--threads", "1", "--stages", "0-1,2-3",
                      *extra])
    assert code == 2
    assert problem in capsys.readouterr().err
