"""The typed runner config (zl_device/formats/runner_config.py) against the C++ runner's field table
(runner/src/runner_config.cpp, printed by `zl_runner --config-fields`): same fields, JSON types,
required fields, path fields and defaults; what Python writes reads back the same, and what the runner would
refuse fails where the config is made."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import typing

import pytest

from zl_base.errors import ZLError
from zl_device.formats.runner_config import (INPUT, OUTPUT, SETTING_NAMES, LrScheduleConfig, OptimizerConfig,
                                             RunnerConfig, path_fields, read_runner_config)

RUN_ID = "00112233445566778899aabbccddeeff"


def minimal(**changes) -> RunnerConfig:
    fields = dict(program="stage_1.pte", stage_index=1, num_stages=3, run_key_file="run.key", run_id=RUN_ID,
                  window_size=4, num_micro_batches=10, checkpoint_dir="checkpoints", listen="127.0.0.1:0",
                  downstream="127.0.0.1:7002")
    return RunnerConfig(**{**fields, **changes})


def _json_type(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return _json_type(args[0])
    if origin is typing.Literal:
        return _json_type(type(args[0]))
    if origin is tuple:
        return f"[{', '.join(_json_type(a) for a in args)}]"
    if dataclasses.is_dataclass(tp):
        return "object"
    return {str: "string", int: "integer", float: "number", bool: "boolean"}[tp]


def python_rows(cls=RunnerConfig, prefix: str = "") -> dict[str, dict]:
    """The dataclasses' fields as `zl_runner --config-fields` rows, keyed by dotted path."""
    hints = typing.get_type_hints(cls, include_extras=True)
    rows = {}
    for f in dataclasses.fields(cls):
        path, kind = prefix + f.name, _json_type(hints[f.name])
        required = f.default is dataclasses.MISSING
        row = {"path": path, "type": kind, "required": required, "is_path": bool(f.metadata.get("path"))}
        if kind == "object":
            rows[path] = row
            rows.update(python_rows(hints[f.name], path + "."))
            continue
        if not required:
            row["default"] = list(f.default) if isinstance(f.default, tuple) else f.default
        rows[path] = row
    return rows


def test_the_typed_config_is_the_runners_field_table(runner_binary):
    """Every row of the C++ table has its Python field with the same type, required-ness, path-ness and default,
    and Python has no field the runner would refuse as unknown."""
    out = subprocess.run([str(runner_binary), "--config-fields"], capture_output=True, text=True, timeout=30,
                         check=True).stdout
    cpp = {row["path"]: row for row in json.loads(out)}
    py = python_rows()
    assert sorted(py) == sorted(cpp), (sorted(set(py) - set(cpp)), sorted(set(cpp) - set(py)))
    for path, row in cpp.items():
        assert py[path] == row, path
    for wire in SETTING_NAMES.values():  # the written-down wire names are fields of the table
        assert wire in cpp, wire


@pytest.fixture(scope="module")
def runner_binary():
    from zl_device.devices.local import host_runner_binary

    try:
        return host_runner_binary()
    except ZLError as e:
        pytest.skip(str(e))


def test_json_holds_what_differs_from_the_runners_defaults_and_reads_back_the_same(tmp_path):
    cfg = minimal(optimizer=OptimizerConfig(lr=2e-3, schedule=LrScheduleConfig(kind="warmup_cosine", warmup_steps=2)),
                  role="train", threads=2, schedule="async", grad_wire_dtype="f32")
    data = cfg.to_json()
    assert data["optimizer"] == {"lr": 2e-3, "schedule": {"kind": "warmup_cosine", "warmup_steps": 2}}
    assert "in_flight_depth" not in data and "log_path" not in data  # the runner's defaults
    assert (data["schedule"], data["grad_wire_dtype"], data["threads"]) == ("async", "f32", 2)
    assert RunnerConfig.from_json(json.loads(json.dumps(data)), "test", "fix") == cfg
    path = tmp_path / "stage_1.json"
    path.write_text(json.dumps(data))
    assert read_runner_config(path, "fix it") == cfg
    zerolock = minimal(role="train").to_json()  # a ZeroLock config names no schedule, as before the typed config
    assert "schedule" not in zerolock and "grad_wire_dtype" not in zerolock


@pytest.mark.parametrize("changes, words", [
    ({"schedule": "pipedream"}, ["schedule 'pipedream'", "'async'"]),
    ({"run_id": "abc"}, ["run_id 'abc'", "32 hex"]),
    ({"stage_index": 3}, ["stage_index 3", "num_stages 3"]),
    ({"role": "forward"}, ["role 'forward'", "lr 0"]),
    ({"load_mode": "heap"}, ["load_mode 'heap'", "'mmap'"]),
])
def test_a_config_the_runner_would_refuse_fails_where_it_is_made(changes, words):
    with pytest.raises(ValueError) as e:
        minimal(**changes)
    for word in words:
        assert word in str(e.value)


def test_a_bad_file_names_itself_the_field_and_the_fix(tmp_path):
    data = minimal().to_json()
    path = tmp_path / "stage_1.json"
    for bad, field_words in (({**data, "window": 4}, '"window" is no field'),
                             ({**data, "window_size": "4"}, '"window_size" is "4", expected an integer'),
                             ({**data, "optimizer": {"betas": [0.9]}}, '"optimizer.betas"'),
                             ({k: v for k, v in data.items() if k != "run_id"}, '"run_id" is missing')):
        path.write_text(json.dumps(bad))
        with pytest.raises(ZLError) as e:
            read_runner_config(path, "restore it")
        assert str(path) in str(e.value) and field_words in str(e.value) and "restore it" in str(e.value)
    path.write_text('{"program": ')
    with pytest.raises(ZLError, match="restore it"):
        read_runner_config(path, "restore it")


def test_path_fields_by_direction():
    assert path_fields(INPUT) == ("program", "run_key_file", "manifest", "data_shard")
    assert path_fields(OUTPUT) == ("checkpoint_dir", "input_log_dir", "log_path")
    assert set(path_fields()) == set(path_fields(INPUT)) | set(path_fields(OUTPUT))
