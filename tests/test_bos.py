"""Beginning-of-sequence tokens: every sample starts with the BOS id exactly when the model's tokenizer adds one by
default (Gemma, Llama 2), once, and everywhere text becomes ids: `zl data`/`zl train` shards (so `zl eval` and the
accuracy study, which read them), `zl eval` generation prompts and `zl generate` prompts. Truncation keeps it; the
sidecar records it, so a shard made before zl added it is recognized. SmolLM2 and the byte tokenizer get none: their
shards are byte-identical to before.

The BOS-adding tokenizer is built here, offline: one token per ASCII character, `<s>` put first by its
post-processor as Gemma's and Llama 2's are. The real Gemma 3 and SmolLM2 tokenizers are used when their conversions
are cached under ~/.cache/zl/models; those tests skip otherwise.
"""

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from zl_base.errors import ZLError
from zl_device.results import generation
from zl_device.results.generation import score_generations, side_by_side, split_row
from zl_export import data
from zl_export.model_source import cache_dir
from zl_export.shard import load_shard, sidecar_path
from zl_export.tokenizer import ByteTokenizer, HFTokenizer, encode_prompt

BOS, EOS = 1, 2
ROWS = [{"prompt": "Q: What is the capital of France?\nA:", "completion": " Paris"},
        {"prompt": "Translate to French: good morning\n", "completion": "bonjour"},
        {"prompt": "A much longer prompt that will need to lose its start when the rows are cut to fit the sequence, "
                   "so that truncation from the left is covered too.", "completion": " ok"}]
CHAT = [{"messages": [{"role": "system", "content": "Answer in one word."},
                      {"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris"}]},
        {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]}]
NEWS = ("label,title,description\n"
        "4,Rocket lands,\"A reusable booster landed upright, the company said.\"\n"
        "3,Rates unchanged,The central bank kept rates where they were.\n")
# A template that writes the BOS itself, as Gemma's and Llama 2's do ({{ bos_token }}).
BOS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")


def ascii_tokenizer(adds_bos: bool = True, chat_template: str | None = None, name: str = "ascii") -> HFTokenizer:
    """A Hugging Face fast tokenizer with one token per ASCII character (ids < 100, so tiny-random's vocabulary of
    258 holds them) and `<s>` (id 1) as its BOS token, which it puts first by default only when `adds_bos`
    (like SmolLM2's `<|im_start|>` otherwise: a BOS token that is never added)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>", "\n", *map(chr, range(32, 127))])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    raw.decoder = decoders.Fuse()
    if adds_bos:
        raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>")
    if chat_template:
        tok.chat_template = chat_template
    return HFTokenizer(tok, name)


def cached_tokenizer(prefix: str, name: str) -> HFTokenizer:
    """The tokenizer of a built-in model from its cached conversion (~/.cache/zl/models/PREFIX-*); skips without
    one, rather than converting a GGUF for minutes."""
    from transformers import AutoTokenizer

    found = sorted(d for d in (cache_dir() / "models").glob(f"{prefix}-*") if (d / "tokenizer.json").is_file())
    if not found:
        pytest.skip(f"no cached {name} conversion under {cache_dir() / 'models'}; load the model once to make it")
    return HFTokenizer(AutoTokenizer.from_pretrained(found[0]), name)


def write(directory: Path) -> dict[str, Path]:
    files = {"pc": directory / "pc.jsonl", "chat": directory / "chat.jsonl", "news": directory / "news.csv"}
    files["pc"].write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    files["chat"].write_text("".join(json.dumps(r) + "\n" for r in CHAT))
    files["news"].write_text(NEWS)
    return files


def rows_of(tokenized) -> list[list[int]]:
    """Each row's ids up to its padding."""
    return [tokenized.input_ids[i, : int(m.sum())].tolist() for i, m in enumerate(tokenized.attention_mask)]


# ---------------------------------------------------------------- deciding the BOS


def test_bos_is_what_the_tokenizer_adds_by_default_not_whether_it_has_one():
    adds, never = ascii_tokenizer(True), ascii_tokenizer(False)
    assert adds._tok.bos_token_id == never._tok.bos_token_id == BOS  # both have a BOS token...
    assert (adds.bos_token_id, never.bos_token_id, ByteTokenizer().bos_token_id) == (BOS, None, None)  # ...one adds it
    assert adds.encode("hi") == never.encode("hi") == [77, 78]  # ASCII code - 27; pieces never get the BOS
    assert encode_prompt(adds, "hi") == [BOS, 77, 78] and encode_prompt(never, "hi") == [77, 78]
    assert encode_prompt(ByteTokenizer(), "hi") == list(b"hi")


@pytest.fixture(scope="module")
def gemma3():
    """gemma3-270m's tokenizer (262k tokens: loading it takes half a minute on a busy machine, hence `slow`)."""
    return cached_tokenizer("gemma-3-270m-q4_k_m", "gemma3-270m")


@pytest.mark.slow
def test_gemma3_tokenizer_adds_bos(gemma3):
    # Its add_bos_token says False, yet its post-processor adds <bos>: the behaviour decides.
    assert gemma3._tok.add_bos_token is False
    assert gemma3.bos_token_id == 2 and encode_prompt(gemma3, "The cat")[0] == 2 and gemma3.encode("The cat")[0] != 2


def test_smollm2_tokenizer_adds_no_bos():
    smollm2 = cached_tokenizer("SmolLM2-135M-Instruct.Q4_1", "smollm2-135m")
    assert smollm2._tok.bos_token_id == 1 and smollm2.bos_token_id is None  # <|im_start|>: a BOS never added


# ---------------------------------------------------------------- shards


def test_shard_rows_start_with_bos_and_the_labels_shift_by_one(tmp_path):
    src = write(tmp_path)["pc"]
    task = data.load_task(src)
    with_bos, kept = data.tokenize(task, ascii_tokenizer(True), 256)
    without, _ = data.tokenize(task, ascii_tokenizer(False), 256)
    for row, ex, plain in zip(rows_of(with_bos), kept.examples, rows_of(without)):
        assert row == [BOS] + ascii_tokenizer().encode(ex.prompt + ex.completion) + [EOS] == [BOS] + plain
        assert row.count(BOS) == 1
    # The same rows one position later: ids, mask and labels (prompt and BOS -100, completion + eos its ids).
    assert torch.equal(with_bos.input_ids[:, 1:], without.input_ids[:, :-1]) and (with_bos.input_ids[:, 0] == BOS).all()
    assert torch.equal(with_bos.labels[:, 1:], without.labels[:, :-1]) and (with_bos.labels[:, 0] == -100).all()
    assert torch.equal(with_bos.attention_mask.sum(1), without.attention_mask.sum(1) + 1)
    assert with_bos.stats["label_tokens"] == without.stats["label_tokens"]


def test_sidecar_records_the_bos_and_label_words_stay_pieces(tmp_path):
    tok = ascii_tokenizer()
    task = data.load_task(write(tmp_path)["news"])
    tokenized, task = data.tokenize(task, tok, 256)
    meta = data.save(tmp_path / "news.safetensors", tokenized, task, tok, "ascii", {"path": "news.csv"})
    assert meta["tokenizer"]["bos_token_id"] == BOS and load_shard(tmp_path / "news.safetensors").bos_token_id == BOS
    assert all(ids[0] != BOS for ids in meta["label_token_ids"])  # scored after the prompt, never a sample's start
    assert (tokenized.input_ids[:, 0] == BOS).all()


def test_left_truncation_cuts_after_the_bos(tmp_path):
    tok = ascii_tokenizer()
    src = tmp_path / "long.jsonl"
    src.write_text(json.dumps({"prompt": "0123456789abcdef", "completion": " ok"}) + "\n"
                   + json.dumps({"prompt": "xy", "completion": " ten chars"}) + "\n")
    task = data.load_task(src)
    tokenized, kept = data.tokenize(task, tok, 12, truncate=True)
    # 12 = BOS + 7 prompt tokens (the last ones) + " ok" + eos; " ten chars" + eos (11) leaves the prompt no room
    # after the BOS, so that row is dropped (without a BOS it would keep one prompt token).
    assert rows_of(tokenized) == [[BOS] + tok.encode("9abcdef ok") + [EOS]]
    labels = tokenized.labels[0].tolist()
    assert labels[:8] == [-100] * 8 and labels[8:] == tok.encode(" ok") + [EOS]
    stats = tokenized.stats
    assert (stats["truncated_rows"], stats["dropped_rows"], [e.line for e in kept.examples]) == (1, 1, [1])
    assert data.tokenize(task, ascii_tokenizer(False), 12, truncate=True)[0].stats["dropped_rows"] == 0
    with pytest.raises(ZLError, match=r"line 1: 21 tokens \(beginning-of-sequence 1, prompt 16, completion 3, "
                                      r"end-of-sequence 1\) do not fit --seq-len 12 \(1 more rows are too long\)"):
        data.tokenize(task, tok, 12)
    with pytest.raises(ZLError, match="no row left.*beginning-of-sequence.*at least 13"):
        data.tokenize(data.Task(task.examples[1:], task.format, None), tok, 11, truncate=True)
    with pytest.raises(ZLError, match="--seq-len 2: too small.*after the beginning-of-sequence token"):
        data.tokenize(task, tok, 2)


def test_a_chat_template_that_writes_the_bos_does_not_double_it(tmp_path):
    src = write(tmp_path)["chat"]
    task = data.load_task(src)
    templated = ascii_tokenizer(chat_template=BOS_TEMPLATE)
    tokenized, kept = data.tokenize(task, templated, 256)
    assert kept.chat_template == "tokenizer" and kept.examples[0].prompt.startswith("<s><system>")  # written as text
    plain, plain_kept = data.tokenize(task, ascii_tokenizer(), 256)  # no template: the plain fallback
    assert plain_kept.chat_template == "plain"
    for row in rows_of(tokenized) + rows_of(plain):
        assert row[0] == BOS and row.count(BOS) == 1


# ---------------------------------------------------------------- old shards


def _forget_bos(shard: Path) -> None:
    """Rewrite the sidecar as zl wrote it before it recorded (and prepended) BOS."""
    side = sidecar_path(shard)
    meta = json.loads(side.read_text())
    del meta["tokenizer"]["bos_token_id"]
    side.write_text(json.dumps(meta))


def test_check_matches_remakes_stale_bos_shards_and_keeps_old_shards_of_tokenizers_without_bos(tmp_path):
    src = write(tmp_path)["pc"]
    task = data.load_task(src)
    for name, tok in (("bos", ascii_tokenizer(name="m")), ("bytes", ByteTokenizer())):
        tokenized, _ = data.tokenize(task, tok, 256)
        data.save(tmp_path / f"{name}.safetensors", tokenized, task, tok, tok.name, {"path": "x"})
    load_shard(tmp_path / "bos.safetensors").check_matches(tokenizer=ascii_tokenizer(name="m"))
    with pytest.raises(ZLError, match=r"bos.safetensors: its rows start with BOS id 1, the tokenizer of m starts "
                                      r"samples with none\. Rebuild the data with `zl data \.\.\. --model m`"):
        load_shard(tmp_path / "bos.safetensors").check_matches(tokenizer=ascii_tokenizer(False, name="m"))
    # Made before the fix: no record, no BOS in the rows. Stale for a tokenizer that adds one, valid for the others.
    for name in ("bos", "bytes"):
        _forget_bos(tmp_path / f"{name}.safetensors")
    stale = load_shard(tmp_path / "bos.safetensors")
    assert stale.bos_token_id is None
    with pytest.raises(ZLError, match="no beginning-of-sequence token, the tokenizer of m starts samples with BOS id 1 "
                                      r"\(the shard predates zl adding it\)"):
        stale.check_matches(tokenizer=ascii_tokenizer(name="m"))
    stale.check_matches(tokenizer_name="m")  # the name alone says nothing about BOS
    load_shard(tmp_path / "bytes.safetensors").check_matches(seq_len=256, tokenizer=ByteTokenizer())
    with pytest.raises(ZLError, match="tokenized for 'bytes', the model uses 'm'"):
        load_shard(tmp_path / "bytes.safetensors").check_matches(tokenizer=ascii_tokenizer(name="m"))


def test_an_old_smollm2_shard_stays_valid(tmp_path):
    tok = cached_tokenizer("SmolLM2-135M-Instruct.Q4_1", "smollm2-135m")
    task = data.load_task(write(tmp_path)["news"])
    tokenized, task = data.tokenize(task, tok, 256)
    data.save(tmp_path / "old.safetensors", tokenized, task, tok, "smollm2-135m", {"path": "news.csv"})
    _forget_bos(tmp_path / "old.safetensors")
    load_shard(tmp_path / "old.safetensors").check_matches(tokenizer=tok)


# ---------------------------------------------------------------- unchanged without a BOS

# sha256 of the (input_ids, attention_mask, labels) bytes of the four shards `_digest` makes, computed with zl before
# it prepended BOS: a BOS (or any other change) for these tokenizers changes them.
BEFORE = {
    "bytes": "21f0df169b3f0ee402e24484411dc3149c61920311aac5fca06680d8b7c49809",
    "smollm2": "e644e67009e31b34b080c3e07a447a177e59b95787938dcfde263f154d68d180",
}


def _digest(tok, directory: Path) -> str:
    files = write(directory)
    h = hashlib.sha256()
    for name, seq_len, truncate in (("pc", 256, False), ("pc", 24, True), ("chat", 256, False), ("news", 256, False)):
        tokenized, _ = data.tokenize(data.load_task(files[name]), tok, seq_len, truncate)
        for t in (tokenized.input_ids, tokenized.attention_mask, tokenized.labels):
            h.update(t.numpy().tobytes())
    return h.hexdigest()


def test_byte_tokenizer_shards_are_byte_identical_to_before(tmp_path):
    assert _digest(ByteTokenizer(), tmp_path) == BEFORE["bytes"]


def test_smollm2_shards_are_byte_identical_to_before(tmp_path):
    tok = cached_tokenizer("SmolLM2-135M-Instruct.Q4_1", "smollm2-135m")
    assert _digest(tok, tmp_path) == BEFORE["smollm2"]


@pytest.mark.slow
def test_gemma3_shards_start_with_bos_once(tmp_path, gemma3):
    tok = gemma3
    files = write(tmp_path)
    for name in ("pc", "chat", "news"):
        tokenized, _ = data.tokenize(data.load_task(files[name]), tok, 256)
        assert all(row[0] == 2 and row.count(2) == 1 for row in rows_of(tokenized)), name
    full, _ = data.tokenize(data.load_task(files["pc"]), tok, 256)
    cut, _ = data.tokenize(data.load_task(files["pc"]), tok, 16, truncate=True)
    long = rows_of(full)[2]  # the long prompt: its BOS, then the prompt's last tokens and the completion
    assert cut.stats["truncated_rows"] >= 1 and rows_of(cut)[2] == [2] + long[-15:] and (cut.input_ids[:, 0] == 2).all()


# ---------------------------------------------------------------- zl eval and zl generate


@pytest.fixture
def captured_prompts(monkeypatch):
    """The prompts every `generate_ids` call gets (the real one still runs)."""
    prompts, real = [], generation.generate_ids

    def spy(model, tokenizer, batch, *args, **kwargs):
        prompts.extend(batch)
        return real(model, tokenizer, batch, *args, **kwargs)

    monkeypatch.setattr(generation, "generate_ids", spy)
    return prompts


def test_eval_generates_from_the_shard_prompts_with_their_bos(tmp_path, captured_prompts):
    from zl_export.model_source import load_model

    tok = ascii_tokenizer()
    task = data.load_task(write(tmp_path)["pc"])
    tokenized, task = data.tokenize(task, tok, 256)
    data.save(tmp_path / "pc.safetensors", tokenized, task, tok, "ascii", {"path": "pc.jsonl"})
    shard = load_shard(tmp_path / "pc.safetensors")
    scores = score_generations(load_model("tiny-random").model, tok, shard, rows=3, max_new_tokens=2)
    assert captured_prompts == [encode_prompt(tok, ex.prompt) for ex in task.examples]
    assert captured_prompts == [split_row(shard, r)[0] for r in range(3)] and all(p[0] == BOS for p in captured_prompts)
    shown = side_by_side(shard, tok, {"adapter": scores.texts})
    assert [s["prompt"] for s in shown] == [ex.prompt for ex in task.examples]  # the BOS is not part of the text


def test_generate_prompts_are_tokenized_as_zl_data_tokenizes_them(tmp_path, monkeypatch, captured_prompts):
    from generative_fixtures import memorized_adapter
    from zl.commands.generate import generate_command
    from zl_export import model_source

    tok = ascii_tokenizer(name="tiny-random")
    real_load = model_source.load_model
    monkeypatch.setattr(model_source, "load_model",
                        lambda spec, seed=0: dataclasses.replace(real_load(spec, seed=seed), tokenizer=tok))
    adapter = memorized_adapter(tmp_path / "adapter", None, steps=0)  # untrained: only the prompts matter here
    app = typer.Typer(add_completion=False)
    app.command("generate")(generate_command)
    app.command("unused")(lambda: None)
    result = CliRunner().invoke(app, ["generate", "--adapter", str(adapter), "--model", "tiny-random", "-n", "2",
                                      ROWS[0]["prompt"]])
    assert result.exit_code == 0, result.output
    task = data.load_task(write(tmp_path)["pc"])
    tokenized, _ = data.tokenize(task, tok, 256)
    shard_prompt = tokenized.input_ids[0, : int((tokenized.labels[0] != -100).nonzero()[0])].tolist()
    assert captured_prompts == [shard_prompt, shard_prompt]  # base, then adapter: the ids training saw
    assert shard_prompt[:2] == [BOS, tok.encode("Q")[0]]
