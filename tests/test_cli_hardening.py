"""Issue 12 item 14: `zl data` and `zl train` validate their inputs before any work, a failed run never blocks its
rerun, and `zl train` without a terminal prints plain progress lines."""

import json
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from zl.errors import ZLError
from zl_export import data


def test_binary_csv_is_a_clear_error(tmp_path):
    path = tmp_path / "bin.csv"
    path.write_bytes(b"prompt,completion\n" + bytes(range(128, 256)) * 4 + b"\n")
    with pytest.raises(ZLError, match="not UTF-8 text"):
        data.read_records(path)


def test_csv_with_a_huge_field_is_a_clear_error(tmp_path):
    path = tmp_path / "big.csv"
    path.write_text("prompt,completion\n" + "a" * 200_000 + ",b\n")
    with pytest.raises(ZLError, match="not a readable CSV"):
        data.read_records(path)


def test_csv_with_a_nul_byte_is_rejected(tmp_path):
    path = tmp_path / "nul.csv"
    path.write_text("prompt,completion\nhel\0lo,world\n")
    with pytest.raises(ZLError, match="line 2: a NUL byte"):
        data.read_records(path)


def test_deeply_nested_jsonl_is_a_clear_error(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text(json.dumps({"prompt": "p", "completion": "c"}) + "\n"
                    + '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + ', "completion": "c"}\n')
    with pytest.raises(ZLError, match="line 2: JSON nested deeper than 32"):
        data.read_records(path)


def test_jsonl_with_a_huge_integer_is_a_clear_error(tmp_path):
    path = tmp_path / "int.jsonl"
    path.write_text('{"prompt": ' + "9" * 5000 + ', "completion": "c"}\n')
    with pytest.raises(ZLError, match="line 1: not usable JSON"):
        data.read_records(path)


def _settings(out: Path, **kw):
    from zl_device.run.train_settings import TrainSettings

    return replace(TrainSettings(), out=out, **kw)


def test_bad_inject_failure_fails_before_any_work(tmp_path):
    from zl_device.run.train_job import open_run

    t0 = time.monotonic()
    with pytest.raises(ZLError, match="stage 9 does not exist"):
        open_run(_settings(tmp_path / "run", inject_failure="9@1"))
    with pytest.raises(ZLError, match="window 999 does not exist"):
        open_run(_settings(tmp_path / "run", inject_failure="1@999"))
    with pytest.raises(ZLError, match="--data nothing-here.csv: no such file"):
        open_run(_settings(tmp_path / "run", data="nothing-here.csv"))
    assert time.monotonic() - t0 < 5
    assert not (tmp_path / "run").exists(), "a rejected run leaves no --out behind"


def test_a_failed_run_never_blocks_its_rerun(tmp_path):
    from zl_device.run.train_job import INCOMPLETE_MARKER, open_run

    out = tmp_path / "run"
    run_dir, _ = open_run(_settings(out))
    (run_dir / "data").mkdir()
    (run_dir / "data" / "train.safetensors").write_text("half-made")  # then the run failed
    said = []
    run_dir, _ = open_run(_settings(out), say=said.append)
    assert said and "moved it to" in said[0]
    assert sorted(p.name for p in run_dir.iterdir()) == [INCOMPLETE_MARKER, "train_settings.json"]
    # What the failed run left is kept, beside the new run.
    aside = tmp_path / "run.unfinished-1"
    assert (aside / "data" / "train.safetensors").read_text() == "half-made"
    (run_dir / "data").mkdir()  # the rerun fails too: the next one moves it to -2
    open_run(_settings(out))
    assert (tmp_path / "run.unfinished-2" / "data").is_dir() and aside.is_dir()
    # A finished run (no marker) is never overwritten.
    (run_dir / INCOMPLETE_MARKER).unlink()
    (run_dir / "report.md").write_text("results")
    with pytest.raises(ZLError, match="exists and is not empty"):
        open_run(_settings(out))


def _status(state="running", done=3):
    return SimpleNamespace(index=0, device="local-0", state=state, micro_batches_done=done, last_committed_window=0,
                           last_loss=2.5, pss_mib=100.0, restarts=0)


def test_plain_progress_prints_a_line_per_stage_at_a_steady_pace():
    from zl.commands.train import PlainProgress

    lines, now = [], [0.0]
    p = PlainProgress(16, lines.append, interval_s=10, clock=lambda: now[0])
    p([_status(), _status()])
    assert len(lines) == 2 and lines[0].startswith("stage 0 (local-0): running, micro-batch 3/16")
    for t in (1, 2, 5, 9):
        now[0] = t
        p([_status(), _status()])
    assert len(lines) == 2  # not every update: a steady pace
    now[0] = 10.5
    p([_status(done=8), _status()])
    assert len(lines) == 4 and "micro-batch 8/16" in lines[2]
    now[0] = 11
    p([_status("failed"), _status()])  # a state change prints at once
    assert len(lines) == 6 and "failed" in lines[4]


def test_zl_train_without_a_terminal_prints_progress(monkeypatch, capsys, tmp_path):
    import zl.commands.train as train_cmd
    from zl_device.run import train_job

    def fake_run_training(settings, say, on_update, export_progress):
        say("data: ...")
        on_update([_status(done=1)])
        on_update([_status("done", done=16)])
        return SimpleNamespace(report={"ok": 1}, wall_s=1.0, samples=16, run_dir=tmp_path)

    monkeypatch.setattr(train_job, "run_training", fake_run_training)
    monkeypatch.setattr(train_cmd, "console", train_cmd.Console(file=__import__("sys").stdout, force_terminal=False))
    train_cmd.run_train(_settings(tmp_path / "run"))
    out = capsys.readouterr().out
    assert "stage 0 (local-0): running, micro-batch 1/" in out
    assert "stage 0 (local-0): done, micro-batch 16/" in out


def test_zl_data_on_a_binary_file_is_one_error_line_not_a_traceback(tmp_path):
    """The whole command line (one process: importing torch takes seconds); the other bad files above go through
    the same read_records."""
    import subprocess
    import sys

    name = "bin.csv"
    (tmp_path / name).write_bytes(b"prompt,completion\n" + bytes(range(128, 256)) + b"\n")
    out = subprocess.run([sys.executable, "-m", "zl.cli", "data", "--input", str(tmp_path / name), "--model",
                          "tiny-random", "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.startswith("error: ") and "Traceback" not in out.stderr, out.stderr[-2000:]
