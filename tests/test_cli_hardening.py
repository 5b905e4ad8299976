"""Issue 12 item 14: `zl data` and `zl train` validate their inputs before any work, a failed run never blocks its
rerun, and `zl train` without a terminal prints plain progress lines."""

import json
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from zl_base.errors import ZLError
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


# --- Issue 28 item 6: a bad command line is one error line (exit 2), before any work or any file is written. ---

def _zl(*args, cwd: Path) -> "subprocess.CompletedProcess[str]":
    """`zl ARGS` as a user runs it, in `cwd` (so a relative path it wrongly wrote would land there)."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    return subprocess.run([sys.executable, "-m", "zl.cli", *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=180, env={**os.environ, "PYTHONPATH": str(REPO)})


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _refused(proc, *words: str) -> str:
    """The one error line of a refused command; it must contain `words` (the value, the limit, the fix)."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and proc.stderr.rstrip().endswith(lines[0]), proc.stderr[-3000:]
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def _demo_dev_shard(folder: Path) -> Path:
    """The demo task's dev shard for tiny-random (its byte tokenizer), as `zl data --demo --split dev` writes it."""
    from zl_export import shard_jobs
    from zl_export.model_source import load_tokenizer

    job = next(j for j in shard_jobs.demo_jobs(0) if j.name == "dev")
    return shard_jobs.write_shard(job, load_tokenizer("tiny-random"), "tiny-random", 64, folder)[0]


@pytest.mark.parametrize("case", ["data", "export"])
def test_out_on_an_existing_file_is_refused(tmp_path, case):
    (tmp_path / "taken").write_text("a file the user keeps")
    args = {"data": ["data", "--demo", "--model", "tiny-random"],
            "export": ["export", "--model", "tiny-random", "--no-check"]}[case]
    before = _files(tmp_path)
    line = _refused(_zl(*args, "--out", "taken", cwd=tmp_path), "--out taken: a file, not a directory",
                    "pass a new directory, e.g. --out taken.d")
    assert _files(tmp_path) == before and (tmp_path / "taken").read_text() == "a file the user keeps", line


def test_eval_json_out_on_a_directory_is_refused_before_scoring(tmp_path):
    shard = _demo_dev_shard(tmp_path / "data")
    (tmp_path / "figures").mkdir()
    before = _files(tmp_path)
    _refused(_zl("eval", "--model", "tiny-random", "--data", shard, "--limit", "8", "--json-out", "figures",
                 cwd=tmp_path), "--json-out figures: a directory, not a file", "--json-out figures/eval.json")
    assert _files(tmp_path) == before, "no figures.tmp or anything else"


def test_data_seq_len_above_the_cap_is_refused_before_allocating(tmp_path):
    from zl_export.options import MAX_SEQ_LEN

    _refused(_zl("data", "--demo", "--model", "tiny-random", "--seq-len", 100_000_000, "--out", "shards", cwd=tmp_path),
             "--seq-len 100000000:", f"at most {MAX_SEQ_LEN} tokens", f"--seq-len {MAX_SEQ_LEN} or less")
    assert _files(tmp_path) == []


@pytest.mark.parametrize("args, words", [
    (["--devices", "local:100000"], ["--devices local:100000:", "at most 64 local devices", "local:N with N up to 64"]),
    (["--samples", 10**12], ["--samples 1000000000000:", "3,906,250,000 passes over the 256 training rows",
                            "at most 100 (25,600 samples)", "--samples 25600 or less", "give --data more rows"]),
    (["--seq-len", 100_000], ["--seq-len 100000:", "at most 8192 tokens"]),
    (["--stages", ""], ["--stages '': an empty stage spec", "drop --stages for a balanced split"]),
])
def test_zl_train_refuses_out_of_range_options_before_writing(tmp_path, args, words):
    """Each of these used to start a run (100,000 device folders, a run of 10^12 samples, the default split)."""
    _refused(_zl("train", "--model", "tiny-random", *args, "--out", "run", cwd=tmp_path), *words)
    assert _files(tmp_path) == []


def test_export_refuses_an_empty_stage_spec(tmp_path):
    _refused(_zl("export", "--model", "tiny-random", "--stages", "", "--no-check", "--out", "ex", cwd=tmp_path),
             "--stages '': an empty stage spec")
    assert _files(tmp_path) == []


@pytest.mark.parametrize("lens, words", [
    (False, ["--calibration noise.bin: only lens translators", "Add --translator-init lens or drop --calibration"]),
    (True, ["--calibration noise.bin: expected a shard from `zl data`", "Recreate the shard with `zl data`"]),
])
def test_export_calibration_is_refused_unless_lens_uses_a_real_shard(tmp_path, lens, words):
    (tmp_path / "noise.bin").write_bytes(bytes(range(256)) * 16)
    before = _files(tmp_path)
    extra = ["--translator-init", "lens"] if lens else []
    _refused(_zl("export", "--model", "tiny-random", "--calibration", "noise.bin", *extra, "--no-check", "--out", "ex",
                 cwd=tmp_path), *words)
    assert _files(tmp_path) == before


def test_a_run_that_fails_before_its_stages_start_leaves_nothing(tmp_path):
    """--stages beyond the model's layers is found once the model loads (after the data step wrote RUN_DIR/data):
    nothing could be resumed, so nothing stays."""
    proc = _zl("train", "--model", "tiny-random", "--stages", "0-1,2-100", "--out", "run", cwd=tmp_path)
    _refused(proc, "--stages '0-1,2-100': stage 1 range '2-100' reaches layer 100")
    assert "removed what the run wrote" in " ".join(proc.stdout.split()), proc.stdout  # rich wraps at 80 columns
    assert _files(tmp_path) == []


def test_kept_if_resumable_keeps_only_a_run_resume_can_continue(tmp_path):
    from zl_device.run.train_job import kept_if_resumable

    said = []
    for name, needs, keep_dir in (("resumable", ("run.key",), False), ("early", ("run.key",), False),
                                  ("users-empty-dir", ("run.key",), True)):
        run_dir = tmp_path / name
        (run_dir / "data").mkdir(parents=True)
        (run_dir / "data" / "train.safetensors").write_text("half-made")
        if name == "resumable":
            (run_dir / "run.key").write_text("k")
        with pytest.raises(RuntimeError), kept_if_resumable(run_dir, needs, said.append, keep_dir):
            raise RuntimeError("the run failed")
    assert (tmp_path / "resumable" / "data" / "train.safetensors").is_file()
    assert f"`zl train --resume --out {tmp_path / 'resumable'}` continues the run" in said[0]
    assert not (tmp_path / "early").exists() and "nothing to resume" in said[1]
    assert list((tmp_path / "users-empty-dir").iterdir()) == []  # emptied, not removed: the user made it


def test_an_unfinished_run_says_how_to_resume(tmp_path):
    from zl_device.run.train_job import INCOMPLETE_MARKER, open_run

    run_dir, _ = open_run(_settings(tmp_path / "run"))
    marker = run_dir / INCOMPLETE_MARKER
    assert not marker.name.startswith("."), "visible in a plain ls"
    assert f"zl train --resume --out {run_dir}\n" in marker.read_text()
    assert "run.key" in marker.read_text()
    # A run directory of an older zl (hidden marker) is still an unfinished run: moved aside, not refused.
    old = tmp_path / "old"
    old.mkdir()
    (old / ".zl-incomplete").write_text("")
    (old / "logs").mkdir()
    open_run(_settings(old))
    assert (tmp_path / "old.unfinished-1" / "logs").is_dir()


# --- Issue 43: non-finite float options, the framework's own usage errors, `zl plan --out` before calibrating ---

def _float_options() -> list[tuple[str, type, object]]:
    """(command, settings tree, Leaf) of every float option (or float list) of every `zl` command."""
    import importlib
    import pkgutil

    import zl.commands
    from zl_base.settings import leaves

    found = []
    for info in pkgutil.iter_modules(zl.commands.__path__):
        for name, command in getattr(importlib.import_module(f"zl.commands.{info.name}"), "COMMANDS", {}).items():
            found += [(name, command.settings, leaf) for leaf in leaves(command.settings) if leaf.base is float]
    return found


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_float_option_of_every_command_refuses_non_finite_values(value):
    """nan passes every range check (`nan <= 0` is False): `zl generate --sample --temperature nan` used to sample."""
    from zl_base.settings import build

    options = _float_options()
    assert {"generate", "train", "plan", "export"} <= {c for c, _, _ in options}, options
    for command, tree, leaf in options:
        given = f"1,{value}" if leaf.is_tuple else float(value)
        flag = leaf.flag.split()[0]
        with pytest.raises(ZLError, match=f"^{flag} .*not a finite number; give a number, e.g. {flag} "):
            build(tree, {leaf.name: given})


def test_generate_with_a_nan_temperature_is_one_line_before_loading_anything(tmp_path):
    _refused(_zl("generate", "--sample", "--temperature", "nan", "--adapter", "nowhere", "hi", cwd=tmp_path),
             "--temperature nan: not a finite number", "e.g. --temperature 1.0")
    _refused(_zl("train", "--model", "tiny-random", "--stage-lr", "1,inf", "--out", "run", cwd=tmp_path),
             "--stage-lr 1,inf: inf is not a finite number")
    assert _files(tmp_path) == []


@pytest.mark.parametrize("args, words", [
    (["train", "--max-temperature", "abc"], ["zl train --max-temperature 'abc': input should be a valid number",
                                             "see `zl train --help`"]),
    (["data", "--seq-len", "1.5"], ["zl data --seq-len '1.5': input should be a valid integer"]),
    (["eval", "--seedd", "1"], ["zl eval: No such option: --seedd (Possible options: --seed)"]),
    (["generate", "--top-p"], ["Option '--top-p' requires an argument"]),
    (["frob"], ["zl: No such command 'frob'", "see `zl --help`"]),
])
def test_the_frameworks_usage_errors_are_one_line(tmp_path, args, words):
    """typer printed these in a six-line box (and `python -m zl.cli` as the program's name)."""
    proc = _zl(*args, cwd=tmp_path)
    _refused(proc, *words)
    assert "─" not in proc.stderr and "Usage:" not in proc.stderr, proc.stderr


def test_plan_out_on_a_directory_is_refused_before_calibrating(tmp_path):
    """It used to calibrate every device (minutes), then fail with IsADirectoryError, leaving .DIR.tmp behind."""
    (tmp_path / "plans").mkdir()
    before = _files(tmp_path)
    t0 = time.monotonic()
    _refused(_zl("plan", "--model", "tiny-random", "--devices", "local:2", "--num-stages", "2", "--out", "plans",
                 cwd=tmp_path), "--out plans: a directory, not a file", "--out plans/plan.json")
    assert time.monotonic() - t0 < 60
    assert _files(tmp_path) == before
