"""`zl generate` (issue 26 item 4): prompts from arguments, a file or stdin through the base model and the adapter,
streamed and labelled; greedy is deterministic, sampling reproducible with --seed; a run trained on chat rows gets
its prompts rendered as its training prompts were (same token ids); bad input is one line, exit 2."""

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
import typer
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from zl_base.entry import run_cli
from zl.commands.generate import generate_command
from zl_base.errors import ZLError
from zl_device.results.generation import Decoding, generate_ids, split_row
from zl_export.model_source import load_model
from zl_export.shard import load_shard
from zl_export.tokenizer import ByteTokenizer

from conftest import REPO
from generative_fixtures import CHAT_ROWS, ROWS, chat_run, memorized_adapter, prompt_completion_shard, write_rows

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning"),  # PEFT calls a deprecated transformers API
    pytest.mark.usefixtures("one_torch_thread"),
]

APP = typer.Typer(add_completion=False)
APP.command("generate")(generate_command)
APP.command("unused")(lambda: None)  # two commands, so `generate` is a subcommand as in `zl`


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    shard = prompt_completion_shard(tmp_path_factory.mktemp("pc"))
    return memorized_adapter(tmp_path_factory.mktemp("memorized") / "adapter", shard)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, adapter):
    """A finished run directory as far as `zl generate` looks: its adapter/."""
    run = tmp_path_factory.mktemp("run")
    shutil.copytree(adapter, run / "adapter")
    return run


@pytest.fixture(scope="module")
def chat_run_dir(tmp_path_factory):
    """A run trained on CHAT_ROWS: data/train.safetensors and its sidecar (plain fallback), adapter/."""
    return chat_run(tmp_path_factory.mktemp("chat") / "run")


def generate(tmp_path, *args, input: str | None = None, stderr: list | None = None) -> tuple[str, dict]:
    """Run `zl generate ... --json-out` and return (stdout, the JSON); stderr is appended to `stderr`."""
    out = tmp_path / "generated.json"  # replaced by every call
    result = CliRunner().invoke(APP, ["generate", *map(str, args), "--json-out", str(out)], input=input)
    assert result.exit_code == 0, result.output
    if stderr is not None:
        stderr.append(result.stderr)
    return result.stdout, json.loads(out.read_text())


def test_arguments_base_then_adapter_labelled_and_streamed(adapter, tmp_path):
    stdout, saved = generate(tmp_path, "--adapter", adapter, "-n", "12", ROWS[0]["prompt"], ROWS[1]["prompt"])
    assert "tiny-random base vs adapter" in stdout and "greedy" in stdout
    assert "prompt 1/2" in stdout and "prompt 2/2" in stdout and "  Q: colour of the sky?\n  A:\n" in stdout
    assert re.search(r"\n  base    │ [^\n]* …\n  adapter │  blue\n", stdout)  # base runs to the budget, adapter stops
    assert re.search(r"\n  adapter │  apple\n", stdout)
    for row, out in zip(ROWS, saved["outputs"]):
        assert out["prompt"] == row["prompt"] and out["adapter"] == row["completion"] != out["base"]
        assert (out["adapter_stopped"], out["base_stopped"], out["base_tokens"]) == ("eos", "max_new_tokens", 12)
    assert saved["model"] == "tiny-random" and saved["decoding"] == {"sample": False}


def test_run_dir_with_a_file_jsonl_and_stdin(run_dir, tmp_path):
    _, by_argument = generate(tmp_path, "--run", run_dir, "-n", "6", *(r["prompt"] for r in ROWS))
    jsonl = write_rows(tmp_path / "prompts.jsonl")  # prompt and completion fields: the completion is ignored
    _, by_file = generate(tmp_path, "--run", run_dir, "-n", "6", "--file", jsonl)
    _, by_stdin = generate(tmp_path, "--run", run_dir, "-n", "6", input=jsonl.read_text())
    assert by_file["outputs"] == by_stdin["outputs"] == by_argument["outputs"]
    assert [o["adapter"] for o in by_file["outputs"]] == [r["completion"] for r in ROWS]

    (tmp_path / "lines.txt").write_text("hello\n\nworld\n")
    _, plain = generate(tmp_path, "--run", run_dir, "-n", "4", "--file", tmp_path / "lines.txt")
    _, piped = generate(tmp_path, "--run", run_dir, "-n", "4", "extra", "--file", "-", input="hello\nworld\n")
    assert [o["prompt"] for o in plain["outputs"]] == ["hello", "world"]
    assert [o["prompt"] for o in piped["outputs"]] == ["extra", "hello", "world"]
    assert piped["outputs"][1:] == plain["outputs"]


def test_greedy_is_deterministic_and_sampling_reproducible(adapter, tmp_path):
    prompts = ["hello", ROWS[2]["prompt"]]
    _, greedy = generate(tmp_path, "--adapter", adapter, "-n", "10", *prompts)
    assert generate(tmp_path, "--adapter", adapter, "-n", "10", *prompts)[1] == greedy
    sampled = [generate(tmp_path, "--adapter", adapter, "-n", "10", "--sample", "--seed", seed, *prompts)[1] for seed in (3, 3, 4)]
    assert sampled[0] == sampled[1] and sampled[0]["decoding"]["seed"] == 3
    texts = [[(o["base"], o["adapter"]) for o in s["outputs"]] for s in (greedy, *sampled)]
    assert texts[1] != texts[0] and texts[3] != texts[1]  # sampling is not greedy; another seed, other text

    loaded = load_model("tiny-random")
    state = torch.get_rng_state()
    ids = loaded.tokenizer.encode("hello")
    first = generate_ids(loaded.model, loaded.tokenizer, [ids], 8, Decoding(True, 0.8, 0.9, seed=5))
    assert torch.equal(torch.get_rng_state(), state)  # the caller's random stream is left alone
    assert generate_ids(loaded.model, loaded.tokenizer, [ids], 8, Decoding(True, 0.8, 0.9, seed=5)) == first


def _user(row: dict) -> str:
    return row["messages"][-2]["content"]


def test_a_chat_run_renders_prompts_with_the_ids_training_used(chat_run_dir, tmp_path):
    shard = load_shard(chat_run_dir / "data" / "train.safetensors")
    assert shard.meta["format"] == "chat" and shard.meta["chat_template"] == "plain"
    stdout, saved = generate(tmp_path, "--run", chat_run_dir, "-n", "8", _user(CHAT_ROWS[0]), _user(CHAT_ROWS[1]))
    _, system = generate(tmp_path, "--run", chat_run_dir, "-n", "8", "--system", "Answer in one word.",
                         _user(CHAT_ROWS[2]))
    for out, row in zip(saved["outputs"] + system["outputs"], range(3)):
        # The ids the model gets are the shard's prompt part of the same conversation, so the adapter answers.
        assert ByteTokenizer().encode(out["rendered_prompt"]) == split_row(shard, row)[0]
        assert out["adapter"] == CHAT_ROWS[row]["messages"][-1]["content"] != out["base"]
    assert saved["outputs"][0]["rendered_prompt"] == "<|user|>\ncolour of the sky?\n<|assistant|>\n"
    sidecar = chat_run_dir / "data" / "train.json"
    assert saved["chat"] == {"template": "plain", "system": None, "from": f"as the run trained: {sidecar}"}
    assert system["chat"]["system"] == "Answer in one word."
    # What the user typed is shown, the rendering only with --show-prompt.
    assert f"prompts: chat, plain <|user|> fallback (as the run trained: {sidecar})" in stdout
    assert "prompt 1/2 (42 tokens)\n  colour of the sky?\n  base" in stdout and "<|user|>\n" not in stdout
    shown, _ = generate(tmp_path, "--run", chat_run_dir, "-n", "2", "--show-prompt", _user(CHAT_ROWS[0]))
    assert "(42 tokens)\n  <|user|>\n  colour of the sky?\n  <|assistant|>\n" in shown


def test_no_chat_and_an_adapter_folder_send_prompts_verbatim(chat_run_dir, tmp_path):
    prompt = _user(CHAT_ROWS[0])
    stdout, off = generate(tmp_path, "--run", chat_run_dir, "-n", "4", "--no-chat", prompt)
    assert off["outputs"][0]["rendered_prompt"] == prompt and off["chat"] is None
    assert f"prompt 1/1 ({len(prompt)} tokens)" in stdout and "prompts: verbatim (--no-chat)" in stdout

    _, on = generate(tmp_path, "--run", chat_run_dir, "-n", "8", prompt)
    err = []
    stdout, by_adapter = generate(tmp_path, "--adapter", chat_run_dir / "adapter", "-n", "4", prompt, stderr=err)
    assert by_adapter["outputs"][0]["rendered_prompt"] == prompt and "prompts: verbatim (--adapter records" in stdout
    assert "trained on chat rows; pass --chat (or --run" in " ".join(err[0].split())  # the run beside it says so
    _, forced = generate(tmp_path, "--adapter", chat_run_dir / "adapter", "-n", "8", "--chat", prompt)
    assert forced["outputs"] == on["outputs"] and forced["chat"]["from"] == "--chat"


def test_messages_rows_in_a_jsonl_file(chat_run_dir, tmp_path):
    rows = [{"messages": r["messages"][:-1]} for r in CHAT_ROWS]  # each conversation up to its reply
    jsonl = write_rows(tmp_path / "chats.jsonl", rows + [{"prompt": _user(CHAT_ROWS[1])}])
    stdout, saved = generate(tmp_path, "--run", chat_run_dir, "-n", "8", "--file", jsonl)
    shard = load_shard(chat_run_dir / "data" / "train.safetensors")
    for row, out in enumerate(saved["outputs"][:3]):
        assert ByteTokenizer().encode(out["rendered_prompt"]) == split_row(shard, row)[0]
        assert out["messages"] == rows[row]["messages"] and out["prompt"] == _user(CHAT_ROWS[row])
    assert [o["adapter"] for o in saved["outputs"]] == ["blue", "apple", "four", "apple"]
    assert "\n  system: Answer in one word.\n  user: two plus two?\n" in stdout
    # A conversation is rendered as one even where plain prompts go verbatim (an adapter folder's default).
    stdout, by_adapter = generate(tmp_path, "--adapter", chat_run_dir / "adapter", "-n", "8", "--file", jsonl)
    assert '; "messages" rows as chat, plain <|user|> fallback' in stdout
    assert [o["rendered_prompt"] for o in by_adapter["outputs"]] == [o["rendered_prompt"] for o in saved["outputs"][:3]] + [_user(CHAT_ROWS[1])]


def _other_models_adapter(directory, adapter):
    """An adapter with tiny-random's parameter names but SmolLM2's width (576): made for another model."""
    directory.mkdir()
    shutil.copy(adapter / "adapter_config.json", directory)
    names = load_file(str(adapter / "adapter_model.safetensors"))
    save_file({n: torch.zeros(8, 576) if "lora_A" in n else torch.zeros(576, 8) for n in names},
              str(directory / "adapter_model.safetensors"))
    return directory


def test_bad_inputs_are_one_line_errors(adapter, tmp_path):
    (tmp_path / "unfinished").mkdir()
    (tmp_path / "unfinished" / "UNFINISHED.txt").write_text("resume with ...")
    (tmp_path / "other_dir").mkdir()
    (tmp_path / "empty_run" / "adapter").mkdir(parents=True)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\n{"prompt": "cut\n')
    (tmp_path / "noprompt.jsonl").write_text('{"text": "hi"}\n')
    (tmp_path / "blank.jsonl").write_text('{"prompt": "  "}\n')
    user, reply = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}
    write_rows(tmp_path / "reply.jsonl", [{"messages": [user]}, {"messages": [user, reply]}])
    write_rows(tmp_path / "convo.jsonl", [{"messages": [user]}])
    write_rows(tmp_path / "role.jsonl", [{"messages": [{"role": "tool", "content": "x"}, user]}])
    write_rows(tmp_path / "blank_user.jsonl", [{"messages": [{"role": "user", "content": " "}]}])
    other = _other_models_adapter(tmp_path / "other_model", adapter)
    a = ["--adapter", str(adapter)]
    cases = [
        (["hi"], None, "pass either --run RUN_DIR"),
        (["--run", str(tmp_path), *a, "hi"], None, "and not both"),
        (["--run", str(tmp_path / "nope"), "hi"], None, "nope: no such directory"),
        (["--run", str(tmp_path / "unfinished"), "hi"], None, "the run has not finished; continue it with `zl train --resume"),
        (["--run", str(tmp_path / "other_dir"), "hi"], None, "not a finished `zl train` run directory"),
        (["--run", str(tmp_path / "empty_run"), "hi"], None, "--run " + str(tmp_path / "empty_run" / "adapter") + ": adapter_config.json is missing"),
        (["--adapter", str(tmp_path / "other_dir"), "hi"], None, "other_dir: adapter_config.json is missing"),
        (["--adapter", str(other), "hi"], None, "does not fit this model"),
        ([*a, "hi", ""], None, "prompt argument 2 is empty"),
        (a, "", "no prompts: pass them as arguments"),
        (a, "\n  \n", "no prompts"),
        ([*a, "--file", str(tmp_path / "bad.jsonl")], None, "bad.jsonl line 2: not valid JSON"),
        ([*a, "--file", str(tmp_path / "noprompt.jsonl")], None, 'noprompt.jsonl line 1: no "prompt" field or "messages"'),
        ([*a, "--file", str(tmp_path / "reply.jsonl")], None,
         "reply.jsonl line 2: the conversation ends with an assistant turn; a prompt's last message must be the user turn"),
        ([*a, "--file", str(tmp_path / "role.jsonl")], None,
         "role.jsonl line 1: message 0 has role 'tool'; expected one of system, user, assistant"),
        ([*a, "--file", str(tmp_path / "blank_user.jsonl")], None, "blank_user.jsonl line 1: the last user turn is empty"),
        ([*a, "--no-chat", "--file", str(tmp_path / "convo.jsonl")], None,
         'convo.jsonl line 1: a "messages" row is a conversation, which --no-chat cannot send verbatim'),
        ([*a, "--system", "Be brief.", "hi"], None, "--system: prompts go verbatim (--adapter records no training data"),
        ([*a, "--chat", "--system", " ", "hi"], None, "--system is empty"),
        ([*a, "--file", str(tmp_path / "blank.jsonl")], None, 'blank.jsonl line 1: an empty "prompt"'),
        ([*a, "--file", str(tmp_path / "missing.txt")], None, "missing.txt: no such file"),
        ([*a, "-n", "0", "hi"], None, "--max-new-tokens 0: must be at least 1"),
        ([*a, "-n", "600", "hi"], None, "exceed tiny-random's context of 512 tokens"),
        ([*a, "--sample", "--temperature", "0", "hi"], None, "--temperature 0: must be positive"),
        ([*a, "--sample", "--top-p", "1.5", "hi"], None, "--top-p 1.5: must be in (0, 1]"),
        ([*a, "--json-out", str(tmp_path), "hi"], None, "a directory, not a file"),
    ]
    for args, stdin, message in cases:
        result = CliRunner().invoke(APP, ["generate", *args], input=stdin)
        assert isinstance(result.exception, ZLError), (args, result.output)
        assert message in str(result.exception) and "\n" not in str(result.exception), (args, str(result.exception))


def test_the_zl_command_line_exits_2_with_one_line(adapter, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        run_cli(lambda: APP(["generate", "--run", str(tmp_path / "nope"), "hi"], prog_name="zl"))
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --run ") and err.count("\n") == 1
    (tmp_path / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "Hi"}, '
                                         '{"role": "assistant", "content": "Hello"}]}\n')
    with pytest.raises(SystemExit) as exited:
        run_cli(lambda: APP(["generate", "--adapter", str(adapter), "--file", str(tmp_path / "chat.jsonl")],
                            prog_name="zl"))
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: --file ") and "line 1: the conversation ends with an assistant turn" in err

    listing = subprocess.run([sys.executable, "-m", "zl.cli", "--help"], capture_output=True, text=True, cwd=REPO)
    assert re.search(r"│ generate\s+Continue prompts with the base model", listing.stdout), listing.stdout
    helped = CliRunner().invoke(APP, ["generate", "--help"])
    assert helped.exit_code == 0 and "zl generate --run runs/r1" in helped.output


@pytest.mark.parametrize("damage", ["truncated", "nan"])
def test_a_damaged_adapter_is_one_line_before_any_model_loads(adapter, tmp_path, capsys, damage):
    """Issue 43: a truncated adapter_model.safetensors was a SafetensorError traceback; a NaN one printed \\x00
    tokens."""
    damaged = tmp_path / "adapter"
    shutil.copytree(adapter, damaged)
    weights = damaged / "adapter_model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:-100])
    else:
        save_file({n: torch.full_like(t, float("nan")) for n, t in load_file(str(weights)).items()}, str(weights))
    with pytest.raises(SystemExit) as exited:
        run_cli(lambda: APP(["generate", "--adapter", str(damaged), "hi"], prog_name="zl"))
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: --adapter {damaged}: adapter_model.safetensors: ")
    assert ("not a readable safetensors file" if damage == "truncated" else "non-finite value(s) (nan)") in err, err


def test_another_base_than_the_adapters_is_refused_unless_forced(adapter):
    """Issue 43: an adapter on a base it was not trained on says nothing of itself; refused, naming both bases."""
    result = CliRunner().invoke(APP, ["generate", "--adapter", str(adapter), "--model", "tiny-random-qwen2", "hi"])
    assert isinstance(result.exception, ZLError), result.output
    assert str(result.exception).startswith(f"--adapter {adapter}: trained on tiny-random, not on "
                                            "tiny-random-qwen2 (seed 0) (--model tiny-random-qwen2); ")
    assert "pass --force-base to use tiny-random-qwen2 (seed 0) anyway" in str(result.exception)
    forced = CliRunner().invoke(APP, ["generate", "--adapter", str(adapter), "--model", "tiny-random-qwen2",
                                      "--force-base", "-n", "2", "hi"])
    assert "note: the adapter was trained on tiny-random; using tiny-random-qwen2 (seed 0)" in forced.stderr
    assert forced.exit_code == 0, forced.output  # same shapes and names: PEFT loads it; the user asked for it
