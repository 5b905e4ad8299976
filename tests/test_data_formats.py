"""The data formats people fine-tune with (issue 55 item 1): Alpaca and ShareGPT rows, and Parquet/Arrow files
(how Hugging Face datasets are stored and shared) for every format, read with pyarrow; bad rows are the same
one-line errors as JSONL rows, naming the row."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from zl.commands.data import data_command
from zl_base.errors import ZLError
from zl_export import data
from zl_export.shard import load_shard

ALPACA = [
    {"instruction": "Give the capital of France.", "input": "", "output": "Paris."},
    {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"},
    {"instruction": "Name a colour.", "output": "Blue."},  # no input column in this row
]
SHAREGPT = [
    {"conversations": [{"from": "system", "value": "Answer in one word."},
                       {"from": "human", "value": "Capital of France?"}, {"from": "gpt", "value": "Paris"}]},
    {"conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "Hi!"}]},
]
PROMPTS = [{"prompt": "2 + 2 =", "completion": " 4"}, {"prompt": "3 + 3 =", "completion": " 6"}]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list) -> Path:
    keys = list(dict.fromkeys(k for r in rows for k in r))  # a table has every column: null where a row has none
    pq.write_table(pa.Table.from_pydict({k: [r.get(k) for r in rows] for k in keys}), path)
    return path


def write_save_to_disk(directory: Path, rows: list, parts: int = 2) -> Path:
    """A directory as `datasets.Dataset.save_to_disk` writes one: Arrow IPC stream files listed in state.json."""
    directory.mkdir(parents=True)
    names = []
    for k in range(parts):
        name = f"data-{k:05d}-of-{parts:05d}.arrow"
        table = pa.Table.from_pylist(rows[k::parts])
        with pa.OSFile(str(directory / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        names.append(name)
    (directory / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names],
                                                      "_split": "train"}))
    (directory / "dataset_info.json").write_text("{}")
    return directory


def test_alpaca_rows_get_the_alpaca_prompt_with_and_without_an_input(tmp_path):
    task = data.load_task(write_jsonl(tmp_path / "a.jsonl", ALPACA))  # detected from the columns
    assert task.format == "prompt_completion" and [ex.completion for ex in task.examples] == ["Paris.", "Bonjour",
                                                                                              "Blue."]
    first, second, third = (ex.prompt for ex in task.examples)
    assert first == data.ALPACA_PROMPT_NO_INPUT.format(instruction="Give the capital of France.")
    assert second == data.ALPACA_PROMPT.format(instruction="Translate to French.", input="Good morning")
    assert second.endswith("### Instruction:\nTranslate to French.\n\n### Input:\nGood morning\n\n### Response:\n")
    assert third.startswith("Below is an instruction that describes a task. Write a response")
    # --prompt-template over the same columns instead of Alpaca's prompt
    from zl_export.data_columns import DataColumns

    cols = DataColumns(prompt_template="Q: {instruction}\\nA:", completion_column="output")
    assert data.load_task(tmp_path / "a.jsonl", cols=cols).examples[0].prompt == "Q: Give the capital of France.\nA:"


def test_sharegpt_rows_are_chat_rows(tmp_path):
    task = data.load_task(write_jsonl(tmp_path / "s.jsonl", SHAREGPT))
    chat_rows = [{"messages": [{"role": {"human": "user", "gpt": "assistant"}.get(t["from"], t["from"]),
                                "content": t["value"]} for t in r["conversations"]]} for r in SHAREGPT]
    same = data.load_task(write_jsonl(tmp_path / "c.jsonl", chat_rows))
    assert task.format == same.format == "chat"
    assert [(ex.prompt, ex.completion, ex.messages) for ex in task.examples] == [
        (ex.prompt, ex.completion, ex.messages) for ex in same.examples]


@pytest.mark.parametrize("rows, problem", [
    ([{"conversations": [{"from": "bot", "value": "x"}]}], "turn 0 is from 'bot'; expected one of system, human"),
    ([{"conversations": [{"from": "human", "value": 3}]}], "turn 0 is .*expected an object with a string 'from' and "
                                                           "'value'"),
    ([{"conversations": "hi"}], "'conversations' is .*expected a list of turns"),
    ([{"conversations": [{"from": "human", "value": "hi"}]}], "no assistant turn"),
    ([{"instruction": "x", "input": 5, "output": "y"}], "column 'input' is a JSON number \\(5\\); expected text"),
    ([{"instruction": "x", "output": ""}], "column 'output' is empty"),
    ([{"instruction": "x", "input": "y"}], "match no format"),
])
def test_bad_alpaca_and_sharegpt_rows_are_one_line_naming_the_row(tmp_path, rows, problem):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ZLError, match=problem):
        data.load_task(path)
    with pytest.raises(ZLError, match=f"{path.name} line 1: {problem}" if "match no" not in problem else problem):
        data.load_task(path)


@pytest.mark.parametrize("rows", [PROMPTS, ALPACA, SHAREGPT], ids=["prompt_completion", "alpaca", "sharegpt"])
def test_parquet_arrow_and_save_to_disk_read_as_jsonl_does(tmp_path, rows):
    want = data.load_task(write_jsonl(tmp_path / "rows.jsonl", rows))
    sources = [write_parquet(tmp_path / "rows.parquet", rows), write_save_to_disk(tmp_path / "saved", rows, parts=1)]
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(tmp_path / "rows.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)  # the Arrow *file* format (feather v2), besides datasets' stream files
    sources.append(tmp_path / "rows.arrow")
    for source in sources:
        got = data.load_task(source)
        assert got.format == want.format, source
        assert [(ex.line, ex.prompt, ex.completion, ex.messages) for ex in got.examples] == [
            (ex.line, ex.prompt, ex.completion, ex.messages) for ex in want.examples], source


def test_a_save_to_disk_directory_reads_its_files_in_order_numbering_rows_across_them(tmp_path):
    rows = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(5)]
    saved = write_save_to_disk(tmp_path / "saved", rows, parts=2)  # rows 0,2,4 then 1,3
    task = data.load_task(saved)
    assert [(ex.line, ex.prompt) for ex in task.examples] == [(1, "p0"), (2, "p2"), (3, "p4"), (4, "p1"), (5, "p3")]


def test_bad_parquet_and_arrow_input_is_one_line(tmp_path):
    bad = write_parquet(tmp_path / "bad.parquet", [{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": ""}])
    with pytest.raises(ZLError, match=f"^{bad} row 2: column 'completion' is empty"):
        data.load_task(bad)
    (tmp_path / "garbage.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ZLError, match="garbage.parquet: not a readable Parquet file .*; write it again"):
        data.load_task(tmp_path / "garbage.parquet")
    (tmp_path / "garbage.arrow").write_bytes(b"\xff" * 64)
    with pytest.raises(ZLError, match="garbage.arrow: not a readable Arrow file"):
        data.load_task(tmp_path / "garbage.arrow")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ZLError, match="empty: a directory without .arrow files"):
        data.load_task(tmp_path / "empty")
    numbers = write_parquet(tmp_path / "n.parquet", [{"prompt": 1, "completion": "b"}])
    with pytest.raises(ZLError, match=f"^{numbers} row 1: column 'prompt' is a JSON number \\(1\\); expected text"):
        data.load_task(numbers)
    keys = write_parquet(tmp_path / "k.parquet", [{"Prompt": "a", "prompt": "b", "completion": "c"}])
    with pytest.raises(ZLError, match=f"^{keys} row 1: keys 'Prompt' and 'prompt' name the same column"):
        data.load_task(keys)


def test_zl_data_writes_a_shard_from_a_parquet_alpaca_file(tmp_path):
    app = typer.Typer(add_completion=False)
    app.command("data")(data_command)
    app.command("unused")(lambda: None)
    source = write_parquet(tmp_path / "alpaca.parquet", ALPACA * 4)
    result = CliRunner().invoke(app, ["data", "-i", str(source), "--model", "tiny-random", "--seq-len", "256",
                                      "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    shard = load_shard(next((tmp_path / "out").glob("*.safetensors")))
    assert shard.input_ids.shape == (12, 256)
    meta = json.loads(next((tmp_path / "out").glob("*.json")).read_text())
    assert meta["format"] == "prompt_completion"


def test_generate_file_reads_sharegpt_alpaca_and_parquet_prompts_as_zl_data_renders_them(tmp_path):
    from zl.commands.generate import read_prompts

    rows = [{"conversations": [{"from": "human", "value": "Hi there"}]},
            {"instruction": "Translate to French.", "input": "Good morning"},
            {"instruction": "Name a colour."},
            {"prompt": "2 + 2 ="}]
    for path in (write_jsonl(tmp_path / "p.jsonl", rows), write_parquet(tmp_path / "p.parquet", rows)):
        prompts = read_prompts([], path)
        assert [p.text for p in prompts] == ["Hi there",
                                             data.ALPACA_PROMPT.format(instruction="Translate to French.",
                                                                       input="Good morning"),
                                             data.ALPACA_PROMPT_NO_INPUT.format(instruction="Name a colour."),
                                             "2 + 2 ="], path
        assert prompts[0].messages == [{"role": "user", "content": "Hi there"}]
    assert read_prompts([], tmp_path / "p.parquet")[1].where == f"--file {tmp_path / 'p.parquet'} row 2"
    write_parquet(tmp_path / "bad.parquet", [{"conversations": [{"from": "gpt", "value": "x"}]}])
    with pytest.raises(ZLError, match=f"^--file {tmp_path / 'bad.parquet'} row 1: the conversation ends with an "
                                      "assistant turn"):
        read_prompts([], tmp_path / "bad.parquet")
