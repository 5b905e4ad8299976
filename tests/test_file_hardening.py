"""Issue 56 (Hardening IV), the files a run reads back and the programs it is given: every bad one is one ZLError
line naming the file, the field and the fix (`zl train --stages plan.json`, `zl train --resume`, `zl generate
--program`, `zl deploy --program`), and a resumed run continues exactly the run that was started."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from zl_base.errors import ZLError
from zl_base.json_reader import Bounds, first_difference, typed

# --- the typed reader ------------------------------------------------------------------------------------------------


def test_the_typed_reader_names_the_field_path_the_value_and_the_expectation():
    from typing import Annotated

    from zl_device.formats.windows import WindowPlan

    assert typed(WindowPlan, {"num_micro_batches": 8, "window_size": 4}, "f", "fix") == WindowPlan(8, 4)
    cases = [
        (dict[str, WindowPlan], {"a": {"num_micro_batches": 8, "window_size": 0}},
         '"a.window_size" is 0, expected at least 1'),
        (WindowPlan, {"num_micro_batches": 8.0, "window_size": 4}, '"num_micro_batches" is 8.0, expected an integer'),
        (WindowPlan, {"num_micro_batches": True, "window_size": 4}, '"num_micro_batches" is true, expected an '
                                                                     "integer"),
        (WindowPlan, {"num_micro_batches": 8}, '"window_size" is missing'),
        (WindowPlan, {"num_micro_batches": 8, "window_size": 4, "x": 1}, '"x" is no field of WindowPlan'),
        (WindowPlan, [8, 4], "the file is \\[8, 4\\], expected an object"),
        (tuple[float, ...], [1.0, float("inf")], '"\\[1\\]" is Infinity, expected a finite number'),
        (tuple[int, int], [1], "the file is \\[1\\], expected a list of 2 values"),
        (Annotated[float, Bounds(above=0)], 0, "the file is 0, expected more than 0"),
        (Annotated[float, Bounds(0, below=1)], 1.0, "the file is 1.0, expected less than 1"),
        (str | None, 3, "the file is 3, expected a string"),
    ]
    for tp, value, problem in cases:
        with pytest.raises(ZLError, match=f"^f: {problem}; fix.$"):
            typed(tp, value, "f", "fix")
    assert typed(tuple[float, ...], 0.5, "f", "fix") == (0.5,)  # one number for all, as older files wrote it
    assert typed(WindowPlan | None, None, "f", "fix") is None


def test_first_difference_walks_objects_and_lists_in_key_order():
    assert first_difference({"a": [1, {"b": 2}], "c": 3}, {"a": [1, {"b": 2}], "c": 3}) is None
    assert first_difference({"a": [1, {"b": 2}]}, {"a": [1, {"b": 5}]}) == ("a[1].b", 2, 5)
    assert first_difference({"a": 1}, {"a": 1, "z": 2})[0] == "z"
    assert first_difference({"a": True}, {"a": 1}) == ("a", True, 1)  # a bool is no number
    assert first_difference({"a": 1}, {"a": 1.0}) is None  # the same number


def test_deep_nesting_and_bad_bytes_are_one_line(tmp_path):
    from zl_base.json_reader import read_json_file

    for text, problem in ((b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nests deeper than 64 levels"),
                          (b'{"a": "\xff"}', r"not a text file \(invalid start byte at byte 7\)"),
                          (b'{"a": 1' + b"0" * 5000 + b"}", "not valid JSON"),  # over Python's 4,300 digits
                          (b"", "not valid JSON")):
        (tmp_path / "f.json").write_bytes(text)
        with pytest.raises(ZLError, match=f"^label: {problem}.*; fix it.$"):
            read_json_file(tmp_path / "f.json", "label", missing="make it.", invalid="fix it.")


# --- zl train --stages plan.json: the 12 tracebacks of the re-probe, and more -------------------------------------


def _plan_json(tmp_path) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    from test_plan import a_plan

    from zl_device.plan.plan_file import write_plan

    return json.loads(write_plan(a_plan(), tmp_path / "good.json").read_text())


def _stage(d, **kw):
    return {**d, "per_stage": [{**d["per_stage"][0], **kw}] + d["per_stage"][1:]}


PLAN_CASES = [
    ("stages a number", lambda d: {**d, "stages": 7}, '"stages" is 7, expected a string'),
    ("stages a list", lambda d: {**d, "stages": ["0-1", "2-2", "3-3"]}, '"stages" is .*, expected a string'),
    ("per_stage a string", lambda d: {**d, "per_stage": "x"}, '"per_stage" is "x", expected a list of'),
    ("per_stage of numbers", lambda d: {**d, "per_stage": [1, 2, 3]}, '"per_stage\\[0\\]" is 1, expected an object'),
    ("a timing a string", lambda d: _stage(d, phase1_ms="fast"), '"per_stage\\[0\\].phase1_ms" is "fast", expected a '
                                                                 "finite number"),
    ("a timing negative", lambda d: _stage(d, other_ms=-1), '"per_stage\\[0\\].other_ms" is -1, expected at least 0'),
    ("layers of one", lambda d: _stage(d, layers=[0]), '"per_stage\\[0\\].layers" is \\[0\\], expected a list of 2'),
    ("link a list", lambda d: {**d, "link": [1]}, '"link" is \\[1\\], expected an object'),
    ("link mbps a string", lambda d: {**d, "link": {**d["link"], "mbps": "x"}}, '"link.mbps" is "x", expected a finite'),
    ("cpu_quota a string", lambda d: {**d, "cpu_quota": "1,0.5"}, '"cpu_quota" is "1,0.5", expected a list of'),
    ("cpu_quota of strings", lambda d: {**d, "cpu_quota": ["a"]}, '"cpu_quota\\[0\\]" is "a", expected a finite'),
    ("slowest a string", lambda d: {**d, "predicted_slowest_ms": "x"}, '"predicted_slowest_ms" is "x", expected'),
    ("even split's slowest", lambda d: {**d, "even_split": {"stages": "0-3", "predicted_slowest_ms": [1]}},
     '"even_split.predicted_slowest_ms" is \\[1\\], expected'),
    ("seq_len a bool", lambda d: {**d, "seq_len": True}, '"seq_len" is true, expected an integer'),
    ("seq_len huge", lambda d: {**d, "seq_len": 10**9}, '"seq_len" is 1000000000, expected at most 8192'),
    ("num_layers 1e400", lambda d: json.dumps(d).replace('"num_layers": 4', '"num_layers": 1e400'),
     '"num_layers" is Infinity, expected an integer'),
    ("deep nesting", lambda d: json.dumps(d)[:-1] + ', "calibration": ' + "[" * 3000 + "]" * 3000 + "}",
     "nests deeper than 64 levels"),
]


@pytest.mark.parametrize("name,edit,problem", PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_a_plan_file_with_a_wrong_field_is_one_line_naming_it(tmp_path, name, edit, problem):
    from zl_device.plan.plan_file import read_plan

    edited = edit(_plan_json(tmp_path))
    path = tmp_path / "plan.json"
    path.write_text(edited if isinstance(edited, str) else json.dumps(edited))
    with pytest.raises(ZLError, match=f"^--stages {path}: {problem}.*; make it again with `zl plan`.$"):
        read_plan(path)


def test_zl_train_on_a_bad_plan_exits_2_with_one_line(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**_plan_json(tmp_path), "stages": 7}))
    proc = subprocess.run([sys.executable, "-m", "zl.cli", "train", "--model", "tiny-random", "--stages", str(path),
                           "--devices", "local:3", "--out", str(tmp_path / "run")], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (f'error: --stages {path}: "stages" is 7, expected a string; make it '
                                                    "again with `zl plan`.")
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


# --- zl train --resume: the resolved run and the settings, read back and bound to the run's start ---------------


def _started_run(tmp_path, monkeypatch):
    """A run directory as `zl train` leaves it once its stages started: settings, resolved run, and the record of
    both. Returns (layout, settings to resume with)."""
    from zl_device.formats.run_layout import RunLayout
    from zl_device.run import resolved_run, train_data
    from zl_device.run.resolved_run import resolve_run
    from zl_device.run.train_job import open_run
    from zl_device.run.train_settings import TrainSettings

    s = replace(TrainSettings(schedule="zerolock"), out=tmp_path / "run", samples=64)
    run_dir, _ = open_run(s)
    layout = RunLayout(run_dir)
    monkeypatch.setattr(train_data, "prepare_data", lambda *a: (tmp_path / "train.safetensors", None))
    monkeypatch.setattr(train_data, "run_seq_len", lambda *a: 48)
    monkeypatch.setattr(train_data, "shard_is_generative", lambda shard: False)
    monkeypatch.setattr(resolved_run, "stage_lr_note", lambda s, shard: None)
    monkeypatch.setattr(train_data, "run_max_targets", lambda *a: 4)
    resolve_run(s, None, layout, lambda line: None)
    return layout, TrainSettings(resume=True, out=run_dir)


def _resume(layout, resume_with):
    from zl_device.run.resolved_run import resolve_run
    from zl_device.run.train_job import resumed_settings

    return resolve_run(resumed_settings(resume_with), None, layout, lambda line: None)


def _edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data, indent=2))


RESUME_CASES = [  # (what, the edit of resolved_run.json's text, the message)
    ("invalid UTF-8", lambda t: t.encode().replace(b'"schedule"', b'"sch\xffedule"'), "not a text file"),
    ("deep nesting", lambda t: t.rstrip()[:-1] + ', "x": ' + "[" * 3000 + "]" * 3000 + "}",
     "nests deeper than 64 levels"),
    ("two stage entries for three stages", lambda t: json.dumps({**json.loads(t), "stages": json.loads(t)["stages"][:2]}),
     '"stage_lr" has 3 multiplier\\(s\\) for 2 stage\\(s\\)'),
    ("window_size 0", lambda t: t.replace('"window_size": 4', '"window_size": 0'),
     '"windows.window_size" is 0, expected at least 1'),
    ("seq_len 1e9", lambda t: t.replace('"seq_len": 48', '"seq_len": 1e9'),
     '"seq_len" is 1000000000.0, expected an integer'),
    ("seq_len 10**9", lambda t: t.replace('"seq_len": 48', '"seq_len": 1000000000'),
     '"seq_len" is 1000000000, expected at most 8192'),
    ("eps 0", lambda t: t.replace('"eps": 1e-08', '"eps": 0'), '"optimizer.eps" is 0, expected more than 0'),
    ("a role the rule does not give", lambda t: t.replace('"role": "train"', '"role": "forward"', 1),
     '"stages\\[2\\]" is not a valid StageSpec'),  # stages 0 and 1 are held still already
]


@pytest.mark.parametrize("name,edit,problem", RESUME_CASES, ids=[c[0] for c in RESUME_CASES])
def test_an_edited_resolved_run_that_does_not_read_is_one_line(tmp_path, monkeypatch, name, edit, problem):
    layout, again = _started_run(tmp_path, monkeypatch)
    text = layout.resolved.read_text()
    edited = edit(text)
    assert edited != text, "the edit changed nothing"
    layout.resolved.write_bytes(edited if isinstance(edited, bytes) else edited.encode())
    with pytest.raises(ZLError, match=f"^{layout.resolved}: {problem}.*; restore it, or start the run again without "
                                      "--resume.$"):
        _resume(layout, again)


@pytest.mark.parametrize("file,path,change,shown", [
    ("resolved", ("optimizer", "lr"), lambda v: v * 10, "is 0.02, the run started with 0.002"),
    ("resolved", ("windows", "num_micro_batches"), lambda v: v * 2, "is 128, the run started with 64"),
    ("resolved", ("optimizer", "eps"), lambda v: 1e-6, "is 1e-06, the run started with 1e-08"),
    ("settings", ("optimizer", "lr"), lambda v: v * 10, "is 0.02, the run started with 0.002"),
    ("settings", ("samples",), lambda v: 128, "is 128, the run started with 64"),
])
def test_a_resume_continues_the_run_that_started_or_names_the_field_that_changed(tmp_path, monkeypatch, file, path,
                                                                                 change, shown):
    """The re-probe: an unfinished run whose resolved_run.json had its lr x10, its micro-batches doubled or eps
    changed resumed with exit 0 and trained another adapter. Now it is refused, naming the field."""
    layout, again = _started_run(tmp_path, monkeypatch)
    resolved, _, _ = _resume(layout, again)  # untouched: resumes
    target = layout.resolved if file == "resolved" else layout.settings

    def edit(data):
        *parents, last = path
        for key in parents:
            data = data[key]
        data[last] = change(data[last])

    _edit(target, edit)
    field = ".".join(path)
    with pytest.raises(ZLError, match=f'^--resume: {target} "{field}" {shown} \\(its checkpoints were trained with '
                                      r"it, started_run.json\); put it back, or start a new run"):
        _resume(layout, again)


def test_a_resolved_run_for_another_stage_count_is_refused(tmp_path, monkeypatch):
    """Consistent in itself (2 stages) but not the run's split (3): the launch indexed past it (IndexError)."""
    from zl_device.run.resolved_run import ResolvedRun

    layout, again = _started_run(tmp_path, monkeypatch)
    two = ResolvedRun.of(replace(again, schedule="zerolock", split=replace(again.split, num_stages=2)), 48, 4)
    two.save(layout)
    layout.started.unlink()  # a run from before the record: the count is still checked
    with pytest.raises(ZLError, match=f'^{layout.resolved}: "stages" has 2 stage\\(s\\), the run has 3'):
        _resume(layout, again)


# --- zl generate --program / zl deploy --program: the program is the one exported, with its tokenizer -----------


@pytest.fixture
def program(tmp_path):
    """A stand-in program of `zl export-model` (bytes, not a real program: the checks come before loading) with
    its tokenizer files and record."""
    from zl_export.inference_program import write_tokenizer_files
    from zl_export.program_record import NEEDED_METHODS, write_program_record
    from zl_export.tokenizer import ByteTokenizer

    out = tmp_path / "out" / "model.pte"
    out.parent.mkdir()
    out.write_bytes(bytes(range(256)) * 8192)  # 2 MiB
    files = write_tokenizer_files(ByteTokenizer(), out.parent)
    write_program_record(out, "tiny-random", "none", 48, "in-place", [*NEEDED_METHODS, "get_n_layers"], files)
    return out


def _flip(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if at is None else at
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


PROGRAM_CASES = [
    ("one byte flipped in the middle", lambda p: _flip(p), "its sha256 is not the one exported"),
    ("truncated", lambda p: p.write_bytes(p.read_bytes()[:1000]), "1000 bytes, 2097152 were exported"),
    ("empty", lambda p: p.write_bytes(b""), "0 bytes, 2097152 were exported"),
    ("garbage without a record", lambda p: (p.write_bytes(b"garbage"), p.with_name("model.pte.json").unlink()),
     "no model.pte.json beside it, so it is no inference program of `zl export-model`"),
    ("a garbage record", lambda p: p.with_name("model.pte.json").write_text("[1, 2"), "its record model.pte.json: not "
                                                                                     "valid JSON"),
    ("a record of something else", lambda p: p.with_name("model.pte.json").write_text('{"format": "zl-plan"}'),
     "its record model.pte.json: not a record of `zl export-model`"),
    ("a record with a wrong field", lambda p: _edit(p.with_name("model.pte.json"), lambda d: d.update(max_seq_len="x")),
     'its record model.pte.json: "max_seq_len" is "x", expected an integer'),
    ("methods a training stage has", lambda p: _edit(p.with_name("model.pte.json"),
                                                    lambda d: d.update(methods=["forward"])),
     "the program has no method get_max_seq_len, get_eos_ids, get_vocab_size"),
    ("no tokenizer", lambda p: p.with_name("tokenizer.json").unlink(), "its tokenizer file .*tokenizer.json: no such "
                                                                      "file; put back the tokenizer.json"),
    ("a garbage tokenizer", lambda p: p.with_name("tokenizer.json").write_text("{}"),
     "its tokenizer file .*tokenizer.json: 2 bytes"),
]


@pytest.mark.parametrize("name,damage,problem", PROGRAM_CASES, ids=[c[0] for c in PROGRAM_CASES])
def test_a_program_that_is_not_the_exported_one_is_refused_by_generate_and_deploy(program, tmp_path, name, damage,
                                                                                  problem):
    from zl_device.devices.deploy import deploy_program
    from zl_device.devices.registry import open_devices
    from zl_export.program_record import check_program

    assert check_program(program).model == "tiny-random"
    damage(program)
    with pytest.raises(ZLError, match=f"^--program {program}: {problem}"):
        check_program(program)
    with pytest.raises(ZLError, match=f"^--program {program}: {problem}"):
        deploy_program(open_devices("local:1", tmp_path / "run"), program)
    assert not (tmp_path / "run" / "devices" / "local-0" / "model.pte").exists()  # nothing pushed


def test_a_training_stage_program_in_the_program_runner_is_one_line(tmp_path):
    """ProgramRunner, which `zl export-model --check` uses on a program it just wrote, refuses a program without the
    LLM methods by name (it was `KeyError: 'get_max_seq_len'`)."""
    import torch
    from executorch.exir import to_edge

    from zl_device.results.program_runner import ProgramRunner

    exported = torch.export.export(torch.nn.Linear(2, 2).eval(), (torch.zeros(1, 2),))
    path = tmp_path / "stage.pte"
    path.write_bytes(to_edge(exported).to_executorch().buffer)
    with pytest.raises(ZLError, match=f"^--program {path}: the program has no method get_max_seq_len, get_eos_ids, "
                                      "get_vocab_size, so it is no inference program of `zl export-model`"):
        ProgramRunner(path)


# --- the other files --resume and zl merge read back -------------------------------------------------------------


def test_a_damaged_stage_config_torch_job_or_checkpoint_progress_is_one_line(tmp_path):
    from zl_device.executorch.launch import saved_run_key
    from zl_device.results.adapter import _read_progress
    from zl_device.torch.job import TorchJob

    (tmp_path / "run.key").write_text("00" * 32 + "\n")
    config = {"program": "x", "stage_index": 0, "num_stages": 2, "run_key_file": "run.key", "run_id": "ab" * 16,
              "window_size": 2, "num_micro_batches": 4, "checkpoint_dir": "checkpoints"}
    for text, problem in (("[1]", 'the file is \\[1\\], expected an object'),
                          (json.dumps({**config, "run_id": 7}), '"run_id" is 7, expected a string'),
                          (json.dumps({**config, "run_id": "ab"}),
                           "the file is not a valid RunnerConfig \\(run_id 'ab' is not 32 hex"),
                          ("{", "not valid JSON")):
        (tmp_path / "stage_0.json").write_text(text)
        with pytest.raises(ZLError, match=f"stage_0.json: {problem}.*; restore it \\(each device holds a copy\\)"):
            saved_run_key(tmp_path)
    (tmp_path / "stage_0.json").write_text(json.dumps(config))
    assert saved_run_key(tmp_path)[1] == "ab" * 16

    job = tmp_path / "torch_job.json"
    TorchJob("tiny-random", "m.json", "s.safetensors", "ab", 2, 8, 1, [0.002] * 3, 0.0, {"kind": "constant"}, "c",
             "m").save(job)
    assert TorchJob.load(job).num_stages == 3
    _edit(job, lambda d: d.update(lr="fast"))
    with pytest.raises(ZLError, match=r"torch_job.json \(torch_job.json\): \"lr\" is \"fast\", expected a list of "
                                      r"numbers; `zl train --runtime torch` writes one"):
        TorchJob.load(job)

    progress = tmp_path / "progress.json"
    progress.write_text("[]")
    with pytest.raises(ZLError, match=r"checkpoint file .*progress.json: the file is \[\], expected an object; the "
                                      "checkpoint is corrupt, merge another --window."):
        _read_progress(progress, 0, 0)
