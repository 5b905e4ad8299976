"""Issue 43 (Hardening III), the input files: no data, prompt, model or shard file hangs or crashes `zl`; each bad
one ends in one ZLError line naming the file, the line (or tensor, or position) and the fix."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zl_base.errors import ZLError
from zl_base.json_nesting import nests_deeper_than
from zl_export import data
from zl_export.records import read_records

# --- item 1: the nesting check is linear (it was a backtracking pattern: ~1 h for this 1 MB line) ---------------

_HANG_LINE = '{"' + "[" * 33 + '\\"' * 500_000  # an unclosed string of escaped quotes after 33 brackets: 1 MB


def test_a_1_mb_line_of_escaped_quotes_is_checked_in_well_under_a_second(tmp_path):
    path = tmp_path / "hang.jsonl"
    path.write_text('{"prompt": "p", "completion": "c"}\n' + _HANG_LINE + "\n")
    start = time.perf_counter()
    with pytest.raises(ZLError, match=r"hang.jsonl line 2: not valid JSON"):
        read_records(path)
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("text,deeper", [
    ('{"a": ' + "[" * 40 + "]" * 40 + "}", True),
    ('{"a": "' + "[" * 40 + '"}', False),  # brackets inside a string do not nest
    ('{"a": "\\"' + "[" * 40 + '"}', False),  # nor after an escaped quote
    ('{"a": ' + "[" * 31 + "]" * 31 + "}", False),  # 32 levels: the limit
    ('{"a": ' + "[" * 32 + "]" * 32 + "}", True),
])
def test_the_shared_nesting_check_counts_levels_outside_strings(text, deeper):
    assert nests_deeper_than(text, 32) is deeper
    assert nests_deeper_than(text.encode(), 32) is deeper


def test_frames_and_records_share_the_one_nesting_check():
    """No second copy of the string pattern or depth count (the copy in records.py was the backtracking one)."""
    from conftest import REPO

    for name in ("zl_device/formats/frames.py", "zl_export/records.py"):
        source = (REPO / name).read_text()
        assert "nests_deeper_than" in source and "re.compile" not in source, name


def test_clean_agnews_text_is_linear_on_unclosed_markup():
    start = time.perf_counter()
    assert data.clean_agnews_text("<" * 200_000) == "<" * 200_000  # no ">": was quadratic, ~20 s
    assert data.clean_agnews_text("<" * 1000 + "b>x") == "<" * 999 + " x"  # a tag holds no "<"
    assert data.clean_agnews_text("a <b>bold</b> &lt;i&gt;c") == "a bold c"
    assert time.perf_counter() - start < 1.0


def test_device_output_parsers_are_linear_on_blank_lines():
    """The line-anchored patterns over dumpsys output let `\\s*` run across newlines: quadratic in blank lines
    (20,000 of them took 0.4-1.0 s per pattern). They now stay on their line, CRLF output (older adb) included."""
    from zl_device.devices.adb import parse_battery_temperature
    from zl_device.devices.app import parse_meminfo_total_pss_kib
    from zl_device.devices.readings import parse_dumpsys_battery, parse_thermal_status

    blank = "\n" * 40_000
    start = time.perf_counter()
    for parse in (parse_dumpsys_battery, parse_thermal_status, parse_meminfo_total_pss_kib, parse_battery_temperature):
        parse(blank)
    assert time.perf_counter() - start < 0.5
    crlf = "Current Battery Service state:\r\n  AC powered: true\r\n  level: 80\r\n  temperature: 312\r\n"
    readings = parse_dumpsys_battery(crlf)
    assert (readings.temperature_c, readings.battery_pct, readings.charging) == (31.2, 80.0, True)
    assert parse_battery_temperature(crlf) == 31.2 and parse_thermal_status("Thermal Status: 2\r\n") == 2
    assert parse_meminfo_total_pss_kib("   TOTAL    123456    1000\r\n") == 123456


# --- item 3: a lone surrogate is one line naming where -------------------------------------------------------------

def test_a_lone_surrogate_in_a_jsonl_row_names_the_line(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text('{"prompt": "ok", "completion": " c"}\n{"prompt":"a\\ud800b","completion":" c"}\n')
    with pytest.raises(ZLError, match=r"s.jsonl line 2: a lone surrogate U\+D800 at character 2, .*full pair"):
        read_records(path)


def test_a_lone_surrogate_in_chat_content_names_the_line_and_message(tmp_path):
    from zl_export.chat import parse_prompt_messages

    path = tmp_path / "chat.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x\\udc00"}]}\n')
    with pytest.raises(ZLError, match=r"chat.jsonl line 1: a lone surrogate U\+DC00"):
        data.load_task(path)
    with pytest.raises(ZLError, match=r"p.jsonl line 3: message 0: a lone surrogate U\+D83D"):
        parse_prompt_messages([{"role": "user", "content": "\ud83d"}], "p.jsonl line 3")


def test_a_generate_argument_that_is_not_utf8_is_one_line():
    from zl.commands.generate import read_prompts

    bad = b"caf\xff".decode("utf-8", "surrogateescape")  # how Python hands over an argv of non-UTF-8 bytes
    with pytest.raises(ZLError, match=r"prompt argument 2: a lone surrogate U\+DCFF at character 4"):
        read_prompts(["fine", bad], None)


def test_zl_data_on_a_lone_surrogate_exits_2_with_one_line_and_writes_nothing(tmp_path):
    from conftest import REPO

    (tmp_path / "s.jsonl").write_text('{"prompt":"a\\ud800b","completion":" c"}\n')
    proc = subprocess.run([sys.executable, "-m", "zl.cli", "data", "--input", str(tmp_path / "s.jsonl"), "--model",
                           "tiny-random", "--out", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True,
                          timeout=180, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "s.jsonl line 1: a lone surrogate U+D800" in lines[0], proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()


# --- item 4: no silent coercion of JSONL keys and values ----------------------------------------------------------

@pytest.mark.parametrize("line,problem", [
    ('{"prompt":"lower","Prompt":"UPPER","completion":"c"}',
     r"line 1: keys 'prompt' and 'Prompt' name the same column \(keys are matched ignoring case"),
    ('{"prompt":"first","prompt":"second","completion":"c"}', r"line 1: key 'prompt' twice; zl would silently keep"),
    ('{"prompt":"p"," completion ":"a","completion":"b"}', r"line 1: keys ' completion ' and 'completion' name"),
    ('{"messages":[{"role":"user","role":"assistant","content":"x"}]}', r"line 1: key 'role' twice"),
])
def test_two_keys_naming_one_column_are_an_error(tmp_path, line, problem):
    path = tmp_path / "k.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ZLError, match=problem):
        read_records(path)


@pytest.mark.parametrize("row,problem", [
    ({"prompt": True, "completion": "c"}, r"column 'prompt' is a JSON boolean \(true\); expected text"),
    ('{"prompt": "p", "completion": 1e999}', r"column 'completion' is a JSON number \(inf\); expected text"),
    ({"prompt": 7, "completion": "c"}, r"column 'prompt' is a JSON number \(7\); expected text"),
    ({"prompt": None, "completion": "c"}, r"column 'prompt' is a JSON null; expected text"),
    ({"text": "t", "label": False}, r"column 'label' is a JSON boolean \(false\); expected text"),
    ({"text": 2.5, "label": "a"}, r"column 'text' is a JSON number \(2.5\); expected text"),
])
def test_a_value_that_is_not_text_is_named_not_coerced(tmp_path, row, problem):
    path = tmp_path / "v.jsonl"
    path.write_text((row if isinstance(row, str) else json.dumps(row)) + "\n")
    with pytest.raises(ZLError, match=rf"v.jsonl line 1: {problem}"):
        data.load_task(path)


def test_a_value_that_is_not_text_is_named_with_prompt_columns(tmp_path):
    from zl_export.data_columns import DataColumns

    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question": False, "answer": "a"}) + "\n")
    with pytest.raises(ZLError, match=r"q.jsonl line 1: column 'question' is a JSON boolean \(false\)"):
        data.load_task(path, cols=DataColumns(prompt_column="question", completion_column="answer"))


@pytest.mark.parametrize("line,problem", [
    ('{"prompt": ' + "[" * 5000 + "]" * 5000 + "}", r"p.jsonl line 2: JSON nested deeper than 32 levels"),  # was a RecursionError
    ('{"prompt": "a", "prompt": "b"}', r"p.jsonl line 2: key 'prompt' twice"),
])
def test_a_generate_prompt_file_line_is_read_as_data_lines_are(tmp_path, line, problem):
    from zl.commands.generate import read_prompts

    (tmp_path / "p.jsonl").write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ZLError, match=problem):
        read_prompts([], tmp_path / "p.jsonl")


def test_chat_content_that_is_not_text_is_named(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 1e9}]})
                    + "\n")
    with pytest.raises(ZLError, match=r"c.jsonl line 1: message 1 is an object, expected an object with a string "
                                      r"'role' and 'content' \(its 'content' is a JSON number \(1000000000.0\)\)"):
        data.load_task(path)


def test_integer_class_labels_and_keys_in_any_case_still_read(tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_text(json.dumps({"Text": "rain", "label": 1}) + "\n" + json.dumps({" text ": "sun", "LABEL": 2}) + "\n")
    task = data.load_task(path, "text_label")
    assert [e.completion for e in task.examples] == ["1", "2"]


# --- item 5: a shard's token ids are checked against the vocabulary when it is opened ------------------------------

def _damaged_shard(demo_dev: Path, out: Path, value: int, row: int = 3, position: int = 5) -> Path:
    """A copy of the demo dev shard (and its sidecar) with input_ids[row, position] = `value`."""
    import shutil

    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(demo_dev))
    tensors["input_ids"][row, position] = value
    save_file(tensors, str(out / "dev.safetensors"))
    shutil.copy(demo_dev.with_suffix(".json"), out / "dev.json")
    return out / "dev.safetensors"


@pytest.mark.parametrize("value", [10**9, -5])
def test_a_token_id_outside_the_vocabulary_names_shard_row_position_and_vocabulary(demo_data, tmp_path, value):
    from zl_export.shard import load_shard
    from zl_export.tokenizer import ByteTokenizer

    path = _damaged_shard(demo_data / "dev.safetensors", tmp_path / "bad", value)
    with pytest.raises(ZLError, match=rf"shard {path}: input_ids row 3 position 5 holds token id {value}, outside the "
                                      r"258 ids of the tokenizer of bytes \(0 to 257\); the shard is damaged"):
        load_shard(path).check_matches(tokenizer=ByteTokenizer())
    load_shard(demo_data / "dev.safetensors").check_matches(tokenizer=ByteTokenizer())  # the intact shard passes


def test_a_label_outside_the_vocabulary_is_refused_and_minus_100_is_not(demo_data):
    from zl_export.shard import load_shard
    from zl_export.tokenizer import ByteTokenizer

    shard = load_shard(demo_data / "dev.safetensors")
    assert (shard.labels == -100).any()
    shard.labels[0, -1] = 258
    with pytest.raises(ZLError, match=r"labels row 0 position \d+ holds token id 258"):
        shard.check_matches(tokenizer=ByteTokenizer())


def test_zl_eval_on_a_shard_with_a_bad_token_id_exits_2_with_one_line(demo_data, tmp_path):
    from conftest import REPO

    path = _damaged_shard(demo_data / "dev.safetensors", tmp_path / "bad", 10**9)
    proc = subprocess.run([sys.executable, "-m", "zl.cli", "eval", "--data", str(path), "--model", "tiny-random",
                           "--json-out", str(tmp_path / "eval.json")], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "input_ids row 3 position 5 holds token id 1000000000" in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "eval.json").exists()


def test_zl_train_refuses_a_shard_with_a_bad_token_id_before_the_export(demo_data, tmp_path):
    from dataclasses import replace

    from zl_device.run.train_data import prepare_data
    from zl_device.run.train_settings import TrainSettings
    from zl_export.tokenizer import ByteTokenizer

    path = _damaged_shard(demo_data / "dev.safetensors", tmp_path / "bad", -5)
    s = replace(TrainSettings(), data=str(path), out=tmp_path / "run")
    with pytest.raises(ZLError, match=r"input_ids row 3 position 5 holds token id -5"):
        prepare_data(s, ByteTokenizer(), json.loads(path.with_suffix(".json").read_text())["seq_len"],
                     tmp_path / "data", lambda *_: None)
