"""`zl data`: reading inputs, tokenizing, shards, the demo task, label-word scoring and the CLI command."""

import json
import re
from pathlib import Path

import pytest
import torch
import typer
from safetensors.torch import save_file
from typer.testing import CliRunner

from zl.commands.data import data_command
from zl_base.errors import ZLError
from zl_export import data
from zl_export.demo_task import DEMO_SEQ_LEN, TOPIC_COLORS, demo_rows
from zl_export.shard import load_shard, sidecar_path
from zl_export.tokenizer import ByteTokenizer

from conftest import SHARED_DATA, brute_force_label_scores

AGNEWS = SHARED_DATA / "agnews"
BYTES = ByteTokenizer()


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_csv(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def make_shard(tmp_path: Path, rows: list[dict], seq_len: int = 32, truncate: bool = False, fmt: str = "auto"):
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    task = data.load_task(src, fmt)
    tokenized, task = data.tokenize(task, BYTES, seq_len, truncate, str(src))
    meta = data.save(tmp_path / "out" / "train.safetensors", tokenized, task, BYTES, "tiny-random",
                     {"path": str(src), "sha256": data.file_sha256(src)})
    return tokenized, task, meta


class WordTokenizer:
    """A word-piece stand-in: " word" is one token, like SmolLM2's " world" (ids from a growing vocabulary)."""

    name = "words"
    eos_token_id = 0
    pad_token_id = 1

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [self.vocab.setdefault(piece, len(self.vocab) + 2) for piece in re.findall(r"\s*\S+|\s+", text)]

    def decode(self, ids: list[int]) -> str:
        inverse = {v: k for k, v in self.vocab.items()}
        return "".join(inverse.get(i, "") for i in ids)


# ---------------------------------------------------------------- round trip


def test_shard_round_trip_prompt_completion(tmp_path):
    rows = [{"prompt": "Q: 2+2?", "completion": " A: 4"}, {"prompt": "Hello", "completion": " world!"}]
    tokenized, _, meta = make_shard(tmp_path, rows, seq_len=24)
    shard = load_shard(tmp_path / "out" / "train.safetensors")
    for name in ("input_ids", "attention_mask", "labels"):
        assert torch.equal(getattr(shard, name), getattr(tokenized, name))
        assert getattr(shard, name).dtype == torch.int64
    assert (shard.rows, shard.seq_len) == (2, 24)
    for i, row in enumerate(rows):
        prompt, completion = BYTES.encode(row["prompt"]), BYTES.encode(row["completion"]) + [BYTES.eos_token_id]
        n = len(prompt) + len(completion)
        assert shard.input_ids[i, :n].tolist() == prompt + completion
        assert shard.input_ids[i, n:].eq(BYTES.pad_token_id).all()  # right padding
        assert shard.attention_mask[i].tolist() == [1] * n + [0] * (24 - n)
        assert shard.labels[i, : len(prompt)].eq(-100).all()  # no loss on the prompt
        assert shard.labels[i, len(prompt) : n].tolist() == completion  # completion + eos
        assert shard.labels[i, n:].eq(-100).all()  # no loss on padding
        assert shard.labels[i, n - 1] == BYTES.eos_token_id
    assert meta["label_tokens"] == sum(len(r["completion"].encode()) + 1 for r in rows)
    assert meta["tokens"] == int(shard.attention_mask.sum())
    assert meta["format"] == "prompt_completion" and meta["label_words"] is None
    assert meta["source"]["sha256"] == data.file_sha256(tmp_path / "in.jsonl")
    assert meta["tokenizer"]["model"] == "tiny-random"


def test_text_label_csv_puts_space_where_label_words_differ(tmp_path):
    src = write_csv(tmp_path / "t.csv", 'text,label\n"good, fine",pos\nawful,neg\nmeh,neg\n')
    task = data.load_task(src)
    assert task.format == "text_label" and task.label_words == ["neg", "pos"]
    assert task.examples[0].prompt == "good, fine\nLabel (neg or pos):"
    # Bytes: " neg" and " pos" share the space byte, so the space ends the prompt.
    _, byte_task = data.tokenize(task, BYTES, 64)
    assert byte_task.label_words == ["neg", "pos"] and byte_task.examples[0].prompt.endswith(": ")
    # Word pieces: " neg" / " pos" are single distinct tokens, so the space starts the completion.
    _, word_task = data.tokenize(task, WordTokenizer(), 64)
    assert word_task.label_words == [" neg", " pos"] and word_task.examples[0].prompt.endswith(":")
    assert word_task.prompt_template == data.TEXT_LABEL_TEMPLATE


def test_labels_option_orders_and_checks_labels(tmp_path):
    src = write_csv(tmp_path / "t.csv", "text,label\na,x\nb,y\n")
    assert data.load_task(src, "text_label", ["y", "x", "z"]).label_words == ["y", "x", "z"]
    with pytest.raises(ZLError, match=r"line 3: label 'y' is not in --labels x,z"):
        data.load_task(src, "text_label", ["x", "z"])


def test_jsonl_format_detection_and_explicit_format(tmp_path):
    src = write_jsonl(tmp_path / "x.jsonl", [{"text": "a", "label": "b", "prompt": "p", "completion": "c"}])
    assert data.load_task(src).format == "prompt_completion"
    assert data.load_task(src, "text_label").format == "text_label"


def test_micro_batches_drop_the_last_partial_batch(tmp_path):
    rows = [{"prompt": f"p{i}", "completion": f" c{i}"} for i in range(5)]
    make_shard(tmp_path, rows, seq_len=16)
    shard = load_shard(tmp_path / "out" / "train.safetensors")
    batches = list(shard.micro_batches(2))
    assert len(batches) == 2
    assert torch.equal(batches[1]["input_ids"], shard.input_ids[2:4])
    assert set(batches[0]) == {"input_ids", "attention_mask", "labels"}
    with pytest.raises(ZLError, match="micro-batch size 6 .* 5 rows"):
        list(shard.micro_batches(6))
    with pytest.raises(ZLError, match="micro-batch size 0"):
        list(shard.micro_batches(0))


def test_check_matches_names_seq_len_and_tokenizer(tmp_path):
    make_shard(tmp_path, [{"prompt": "p", "completion": " c"}], seq_len=16)
    shard = load_shard(tmp_path / "out" / "train.safetensors")
    shard.check_matches(seq_len=16, tokenizer_name="bytes")
    with pytest.raises(ZLError, match="seq_len 16, the program expects 128"):
        shard.check_matches(seq_len=128)
    with pytest.raises(ZLError, match="tokenized for 'bytes'"):
        shard.check_matches(tokenizer_name="smollm2-135m")


# ---------------------------------------------------------------- errors


def test_over_long_row_names_line_length_and_fix(tmp_path):
    rows = [{"prompt": "short", "completion": " ok"}, {"prompt": "x" * 40, "completion": " yes"}]
    with pytest.raises(ZLError) as e:
        make_shard(tmp_path, rows, seq_len=32)
    msg = str(e.value)
    assert "line 2" in msg and "45 tokens" in msg and "--seq-len 32" in msg and "--truncate" in msg


def test_over_long_csv_row_counts_the_header_line(tmp_path):
    src = write_csv(tmp_path / "t.csv", "prompt,completion\na,b\n" + "p" * 50 + ",c\n")
    task = data.load_task(src)
    with pytest.raises(ZLError, match=r"line 3: 52 tokens .*--seq-len 16"):
        data.tokenize(task, BYTES, 16, source=str(src))


def test_truncate_keeps_the_completion_and_cuts_the_prompt_from_the_left(tmp_path):
    rows = [{"prompt": "0123456789" * 4, "completion": " answer"}]
    tokenized, _, meta = make_shard(tmp_path, rows, seq_len=20, truncate=True)
    completion = BYTES.encode(" answer") + [BYTES.eos_token_id]
    kept_prompt = BYTES.encode(rows[0]["prompt"])[-(20 - len(completion)) :]
    assert tokenized.input_ids[0].tolist() == kept_prompt + completion
    assert tokenized.labels[0, -len(completion) :].tolist() == completion
    assert tokenized.labels[0, : -len(completion)].eq(-100).all()
    assert meta["truncated_rows"] == 1 and meta["max_length"] == 20


def test_truncate_drops_rows_whose_completion_does_not_fit_and_counts_them(tmp_path):
    rows = [{"prompt": "p" * 30, "completion": " ok"},  # cut: 30 + 4 > 16
            {"prompt": "p", "completion": " much longer"},  # fits: 1 + 12 + eos
            {"prompt": "p", "completion": " far too long for it"},  # dropped: 21 tokens with eos
            {"prompt": "short", "completion": " yes"}]
    tokenized, task, meta = make_shard(tmp_path, rows, seq_len=16, truncate=True)
    assert [e.line for e in task.examples] == [1, 2, 4] and tokenized.input_ids.shape == (3, 16)
    assert (meta["rows"], meta["truncated_rows"], meta["dropped_rows"], meta["dropped_lines"]) == (3, 1, 1, [3])
    assert data.truncation_summary(meta, 16) == ("1 row had their prompt cut from the left, 1 row dropped: completion "
                                                 "longer than --seq-len 16 allows (line 3)")
    for i in range(3):  # every kept completion whole
        completion = BYTES.encode(task.examples[i].completion) + [BYTES.eos_token_id]
        assert tokenized.labels[i][tokenized.labels[i] != -100].tolist() == completion
    with pytest.raises(ZLError, match=r"no row left: the completion of every row \(1\) is longer than --seq-len 8 "
                                      r"allows .* Raise --seq-len to at least 14\.$"):
        make_shard(tmp_path, [{"prompt": "p", "completion": " much longer"}], seq_len=8, truncate=True)
    with pytest.raises(ZLError, match=r"line 1: the completion alone is 13 tokens \(with end-of-sequence\), which "
                                      r"leaves no room for the prompt in --seq-len 8\. .*--truncate to drop such rows"):
        make_shard(tmp_path, [{"prompt": "p", "completion": " much longer"}], seq_len=8)  # strict: an error


def test_empty_file(tmp_path):
    with pytest.raises(ZLError, match="no data rows"):
        data.load_task(write_csv(tmp_path / "e.csv", ""))
    with pytest.raises(ZLError, match="no data rows"):
        data.load_task(write_csv(tmp_path / "h.csv", "prompt,completion\n"))
    with pytest.raises(ZLError, match="no data rows"):
        data.load_task(write_csv(tmp_path / "e.jsonl", "\n\n"))


def test_unknown_columns_name_found_and_expected(tmp_path):
    src = write_csv(tmp_path / "c.csv", "question,answer\na,b\n")
    with pytest.raises(ZLError) as e:
        data.load_task(src)
    msg = str(e.value)
    assert "question, answer" in msg and "prompt, completion" in msg and "text, label" in msg
    with pytest.raises(ZLError, match=r"needs the columns text, label.*missing: text"):
        data.load_task(write_csv(tmp_path / "d.csv", "label,body\na,b\n"), "text_label")


def test_empty_field_names_line_and_column(tmp_path):
    src = write_jsonl(tmp_path / "f.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": "  "}])
    with pytest.raises(ZLError, match=r"line 2: column 'completion' is empty"):
        data.load_task(src)
    src = write_csv(tmp_path / "f.csv", "text,label\nhello,\n")
    with pytest.raises(ZLError, match=r"line 2: column 'label' is empty"):
        data.load_task(src)


def test_bad_format_missing_file_and_bad_extension(tmp_path):
    src = write_csv(tmp_path / "ok.csv", "prompt,completion\na,b\n")
    with pytest.raises(ZLError, match="--format 'csvx' is not a known format; expected one of auto"):
        data.load_task(src, "csvx")
    with pytest.raises(ZLError, match="no such file"):
        data.load_task(tmp_path / "missing.csv")
    with pytest.raises(ZLError, match="unknown file type '.txt'"):
        data.load_task(write_csv(tmp_path / "x.txt", "prompt,completion\na,b\n"))


def test_malformed_jsonl_and_ragged_csv(tmp_path):
    with pytest.raises(ZLError, match="line 2: not valid JSON"):
        data.load_task(write_csv(tmp_path / "b.jsonl", '{"prompt": "a", "completion": "b"}\n{oops\n'))
    with pytest.raises(ZLError, match="line 3: 3 fields, but the header has 2"):
        data.load_task(write_csv(tmp_path / "r.csv", "prompt,completion\na,b\na,b,c\n"))


def test_limit_and_shuffle_are_seeded(tmp_path):
    rows = [{"prompt": f"p{i}", "completion": f" c{i}"} for i in range(20)]
    task = data.load_task(write_jsonl(tmp_path / "s.jsonl", rows))
    a = [e.line for e in data.select(task, 5, True, 1).examples]
    assert a == [e.line for e in data.select(task, 5, True, 1).examples]
    assert a != [e.line for e in data.select(task, 5, True, 2).examples]
    assert [e.line for e in data.select(task, 3, False, 0).examples] == [1, 2, 3]
    with pytest.raises(ZLError, match="--limit 0"):
        data.select(task, 0, False, 0)


# ---------------------------------------------------------------- load_shard validation


def test_load_shard_missing_file_sidecar_and_directory(tmp_path):
    with pytest.raises(ZLError, match="no such file"):
        load_shard(tmp_path / "nope.safetensors")
    with pytest.raises(ZLError, match="is a directory"):
        load_shard(tmp_path)
    make_shard(tmp_path, [{"prompt": "p", "completion": " c"}], seq_len=8)
    path = tmp_path / "out" / "train.safetensors"
    sidecar_path(path).unlink()
    with pytest.raises(ZLError, match="sidecar .*train.json is missing"):
        load_shard(path)


def _rewrite(path: Path, good, **tensors):
    t = {"input_ids": good.input_ids, "attention_mask": good.attention_mask, "labels": good.labels}
    t.update(tensors)
    save_file({k: v for k, v in t.items() if v is not None}, str(path))


def test_load_shard_rejects_dtype_shape_and_count_mismatches(tmp_path):
    make_shard(tmp_path, [{"prompt": "p", "completion": " c"}, {"prompt": "q", "completion": " d"}], seq_len=8)
    path = tmp_path / "out" / "train.safetensors"
    good = load_shard(path)
    _rewrite(path, good, labels=good.labels.to(torch.int32))
    with pytest.raises(ZLError, match="labels is torch.int32, expected torch.int64"):
        load_shard(path)
    _rewrite(path, good, labels=good.labels[:, :4].clone())
    with pytest.raises(ZLError, match=r"labels has shape \[2, 4\], expected"):
        load_shard(path)
    _rewrite(path, good, input_ids=good.input_ids[:1].clone(), attention_mask=good.attention_mask[:1].clone(),
             labels=good.labels[:1].clone())
    with pytest.raises(ZLError, match="sidecar says 2 rows x 8 tokens, the tensors are 1 x 8"):
        load_shard(path)
    path.write_bytes(b"garbage")
    with pytest.raises(ZLError, match="not a readable safetensors file"):
        load_shard(path)


# ---------------------------------------------------------------- AG News


@pytest.mark.skipif(not (AGNEWS / "dev.csv").is_file(), reason=f"AG News subset not present at {AGNEWS}")
def test_agnews_dev_sample(tmp_path):
    task = data.load_task(AGNEWS / "dev.csv", "agnews")
    assert data.load_task(AGNEWS / "dev.csv").format == "agnews"  # detected from the columns
    assert len(task.examples) == 800
    assert task.label_words == ["world", "sports", "business", "tech"]
    assert {e.completion for e in task.examples} == set(task.label_words)
    assert not any("#39;" in e.prompt or "&lt;" in e.prompt for e in task.examples)
    assert task.examples[0].prompt.endswith("\nTopic (world, sports, business or tech):")
    # Byte tokens: label words start with distinct letters, so the first completion byte tells them apart.
    sample = data.select(task, 32, True, 0)
    tokenized, sample = data.tokenize(sample, BYTES, 128, truncate=True)
    firsts = {BYTES.encode(w)[0] for w in sample.label_words}
    assert len(firsts) == 4
    for i in range(32):
        start = int((tokenized.labels[i] != -100).nonzero()[0])
        assert int(tokenized.labels[i, start]) in firsts


def test_clean_agnews_text():
    assert data.clean_agnews_text("Pilots #39; union pays \\$300 for\\five &lt;b&gt;jets&lt;/b&gt;") == (
        "Pilots' union pays $300 for five jets"
    )
    assert data.clean_agnews_text("knee  #151; another") == "knee \u2014 another"


def test_agnews_headerless_and_bad_label(tmp_path):
    src = write_csv(tmp_path / "a.csv", '3,"Stocks up","Markets rose, again."\n2,Win,Team won.\n')
    task = data.load_task(src, "agnews")
    assert [e.completion for e in task.examples] == ["business", "sports"]
    bad = write_csv(tmp_path / "b.csv", "label,title,description\n7,t,d\n")
    with pytest.raises(ZLError, match="line 2: AG News label '7' is not one of 1-4"):
        data.load_task(bad, "agnews")


# ---------------------------------------------------------------- demo task


def test_demo_rows_are_seeded_balanced_short_and_disjoint():
    a, b, c = demo_rows(0), demo_rows(0), demo_rows(1)
    assert a == b and a != c
    train, dev = {r["text"] for r in a["train"]}, {r["text"] for r in a["dev"]}
    assert len(train) == len(a["train"]) == 256 and len(dev) == len(a["dev"]) == 128
    assert not train & dev
    for split in a.values():
        counts = {color: sum(r["label"] == color for r in split) for color in TOPIC_COLORS.values()}
        assert len(set(counts.values())) == 1
    assert len({w[0] for w in TOPIC_COLORS.values()}) == 4  # distinct first bytes


def test_demo_shard_fits_the_byte_tokenizer_at_the_demo_seq_len(tmp_path):
    task = data.demo_task(demo_rows(0)["dev"])
    tokenized, task = data.tokenize(task, BYTES, DEMO_SEQ_LEN)
    assert tokenized.stats["max_length"] <= DEMO_SEQ_LEN
    assert task.format == "demo" and task.label_words == list(TOPIC_COLORS.values())
    with pytest.raises(ZLError, match="multiple of 4"):
        demo_rows(0, train_rows=10)


# ---------------------------------------------------------------- scoring


def test_label_word_accuracy_matches_brute_force_on_tiny_model(tmp_path):
    from zl_export.model_source import load_model
    from zl_export.scoring import label_word_accuracy

    model = load_model("tiny-random", seed=3).model
    task = data.select(data.demo_task(demo_rows(0)["dev"]), 24, False, 0)
    tokenized, task = data.tokenize(task, BYTES, DEMO_SEQ_LEN)
    data.save(tmp_path / "dev.safetensors", tokenized, task, BYTES, "tiny-random", {"path": "demo"})
    shard = load_shard(tmp_path / "dev.safetensors")
    acc, nll = label_word_accuracy(model, shard, batch_size=5)
    ref_acc, ref_nll = brute_force_label_scores(model, shard)
    assert acc == pytest.approx(ref_acc)
    assert nll == pytest.approx(ref_nll, rel=1e-5)
    assert 0.0 <= acc <= 1.0 and nll > 0


def test_label_word_accuracy_needs_label_words(tmp_path):
    from zl_export.model_source import load_model
    from zl_export.scoring import label_word_accuracy

    make_shard(tmp_path, [{"prompt": "p", "completion": " c"}], seq_len=8)
    with pytest.raises(ZLError, match="has no label words"):
        label_word_accuracy(load_model("tiny-random").model, load_shard(tmp_path / "out" / "train.safetensors"))


# ---------------------------------------------------------------- CLI


def _app() -> typer.Typer:
    app = typer.Typer(add_completion=False)
    app.command("data")(data_command)
    app.callback()(lambda: None)
    return app


def test_cli_demo_writes_train_and_dev(tmp_path):
    result = CliRunner().invoke(_app(), ["data", "--demo", "--model", "tiny-random", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert re.search(r"^train: 256 rows x 64 tokens, \d+ label tokens, .*train\.safetensors$", result.stdout, re.M)
    assert re.search(r"^dev: 128 rows x 64 tokens", result.stdout, re.M)
    dev = load_shard(tmp_path / "dev.safetensors")
    assert dev.meta["split"] == "dev" and dev.meta["source"]["path"] == "demo"
    assert dev.label_words == list(TOPIC_COLORS.values())


def test_cli_file_with_split_limit_and_errors(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": f"row {i}", "label": "ab"[i % 2]} for i in range(10)])
    out = tmp_path / "out"
    args = ["data", "-i", str(src), "--model", "tiny-random", "--seq-len", "32", "--split", "dev", "--limit", "4", "-o", str(out)]
    result = CliRunner().invoke(_app(), args)
    assert result.exit_code == 0, result.output
    shard = load_shard(out / "dev.safetensors")
    assert shard.rows == 4 and shard.seq_len == 32 and shard.meta["limit"] == 4
    result = CliRunner().invoke(_app(), ["data", "-i", str(src), "--seq-len", "8", "--model", "tiny-random", "-o", str(out)])
    assert isinstance(result.exception, ZLError) and "--seq-len 8" in str(result.exception)
    result = CliRunner().invoke(_app(), ["data", "-o", str(out)])
    assert isinstance(result.exception, ZLError) and "no input" in str(result.exception)
    result = CliRunner().invoke(_app(), ["data", "--demo", "-i", str(src), "-o", str(out)])
    assert isinstance(result.exception, ZLError) and "both given" in str(result.exception)


def test_max_targets_names_the_line_the_count_and_the_fix(tmp_path):
    """Programs read out --max-targets target slots per sample; a row with more must fail, naming itself."""
    from zl_export import shard_jobs

    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Q: 2+2?", "completion": " 4"},
                                              {"prompt": "Hello", "completion": " world!"}])
    job = shard_jobs.file_job(src, "auto", "train")
    path, meta = shard_jobs.write_shard(job, BYTES, "tiny-random", 32, tmp_path / "ok", max_targets=8)
    assert meta["max_target_tokens"] == 8  # " world!" is 7 bytes, + end-of-sequence
    with pytest.raises(ZLError, match=r"in\.jsonl line 2: 8 target tokens, more than the programs' 7 target slots; "
                                      r"pass --max-targets 8 or more \(0 reads out every position\)\.$"):
        shard_jobs.write_shard(job, BYTES, "tiny-random", 32, tmp_path / "bad", max_targets=7)
    shard = load_shard(path)
    with pytest.raises(ZLError, match=r"ok/train\.safetensors row 0: 3 target tokens, .* 2 target slots \(1 more row too\); "
                                      r"pass --max-targets 8 or more"):
        shard.check_target_slots(2)
    shard.check_target_slots(8)
    shard.check_target_slots(0)  # full readout: no limit
    args = ["data", "-i", str(src), "--model", "tiny-random", "--seq-len", "32", "-o", str(tmp_path / "cli")]
    result = CliRunner().invoke(_app(), args + ["--max-targets", "4"])
    assert isinstance(result.exception, ZLError) and "line 2: 8 target tokens" in str(result.exception)
    result = CliRunner().invoke(_app(), args + ["--max-targets", "8"])
    assert result.exit_code == 0 and "at most 8 per row" in result.stdout


def test_cli_help_has_an_example():
    result = CliRunner().invoke(_app(), ["data", "--help"])
    assert result.exit_code == 0 and "zl data --demo" in result.output


# ---------------------------------------------------------------- SmolLM2 (slow: first use converts the GGUF)


@pytest.mark.slow
def test_smollm2_label_words_are_single_distinct_tokens_and_demo_is_short():
    from zl_export.model_source import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    for words in (list(data.AGNEWS_LABELS.values()), list(TOPIC_COLORS.values())):
        assert data.label_separator(tok, words) == ""
        ids = [tok.encode(" " + w) for w in words]
        assert all(len(i) == 1 for i in ids) and len({i[0] for i in ids}) == len(words)
    tokenized, _ = data.tokenize(data.demo_task(demo_rows(0)["train"]), tok, DEMO_SEQ_LEN)
    assert tokenized.stats["max_length"] <= 40


@pytest.mark.slow
def test_smollm2_base_model_is_near_chance_on_the_demo(tmp_path):
    from zl_export.model_source import load_model
    from zl_export.scoring import label_word_accuracy

    loaded = load_model("smollm2-135m")
    tokenized, task = data.tokenize(data.demo_task(demo_rows(0)["dev"]), loaded.tokenizer, DEMO_SEQ_LEN)
    data.save(tmp_path / "dev.safetensors", tokenized, task, loaded.tokenizer, "smollm2-135m", {"path": "demo"})
    acc, nll = label_word_accuracy(loaded.model, load_shard(tmp_path / "dev.safetensors"))
    assert acc < 0.45 and nll > 2.0
