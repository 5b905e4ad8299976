"""Model sources: built-in names, GGUF files, local directories, hub ids, and their errors."""

import json

import pytest
import torch

from zl_base.errors import ZLError
from zl_export import model_source
from zl_export.model_source import load_model, load_tokenizer, resolve


def test_random_models_are_seeded_and_shaped():
    a, b = load_model("tiny-random", seed=1), load_model("tiny-random", seed=1)
    assert a.config.num_hidden_layers == 4 and a.config.model_type == "llama"
    assert a.config._attn_implementation == "eager"
    for (name, pa), (_, pb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.lm_head.weight, load_model("tiny-random", seed=2).model.lm_head.weight)


def test_tinyllama_random_has_the_real_shape():
    cfg = model_source.TINYLLAMA_CONFIG
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (22, 2048, 5632)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (32, 4, 32000)


@pytest.mark.parametrize("name,family,params", [("gemma3-270m-random", "gemma3_text", 268.1e6),
                                                 ("llama3.2-3b-random", "llama", 3212.7e6),
                                                 ("qwen2.5-3b-random", "qwen2", 3085.9e6)])
def test_shape_faithful_models_have_the_published_size(name, family, params):
    """The published parameter counts (Gemma 3 270M: 268M; Llama-3.2-3B: 3.21B; Qwen2.5-3B: 3.09B, tied heads
    counted once), from the configs alone: the weights are built on the meta device."""
    import transformers

    config = model_source.load_config(name)
    assert config.model_type == family
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert abs(sum(p.numel() for p in model.parameters()) - params) < 0.001 * params


def test_unknown_name():
    with pytest.raises(ZLError, match="not a built-in model.*smollm2-135m, tinyllama-random, tiny-random"):
        resolve("tinyllama")


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ZLError, match="no such GGUF file"):
        load_model(str(tmp_path / "model.gguf"))


def test_directory_without_config(tmp_path):
    with pytest.raises(ZLError, match="no config.json"):
        load_model(str(tmp_path))


def test_file_that_is_not_a_model(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ZLError, match="neither a .gguf nor a model directory"):
        load_model(str(f))


def test_non_llama_architecture(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(ZLError, match="architecture 'gpt2' is not supported"):
        load_model(str(tmp_path))


def test_unreachable_hub_id_says_to_use_a_local_directory(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub read the variable when first imported (by an earlier test): without this it retries the
    # hub for ~23 s first.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ZLError, match="download the model once and pass its local directory"):
        load_model("nobody-zl-test/not-a-model")


def _save_tiny_llama_dir(path):
    """A local Hugging Face directory: tiny Llama weights plus a word-level tokenizer built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    loaded = load_model("tiny-random", seed=5)
    loaded.model.save_pretrained(path)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate("the cat sat on mat".split())}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(path)
    return loaded


def test_local_directory_loads_weights_and_tokenizer(tmp_path):
    saved = _save_tiny_llama_dir(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.source == f"dir:{tmp_path}"
    assert loaded.config._attn_implementation == "eager"
    assert torch.equal(loaded.model.lm_head.weight, saved.model.lm_head.weight)
    assert load_tokenizer(str(tmp_path)).encode("the cat") == loaded.tokenizer.encode("the cat")


@pytest.mark.slow
def test_smollm2_gguf_is_converted_once_and_cached(tmp_path, monkeypatch):
    import time

    monkeypatch.setenv("ZL_CACHE_DIR", str(tmp_path))
    first = load_model("smollm2-135m")
    assert (first.config.num_hidden_layers, first.config.hidden_size, first.config.vocab_size) == (30, 576, 49152)
    t0 = time.perf_counter()
    again = load_model("smollm2-135m")
    assert time.perf_counter() - t0 < 10
    assert torch.equal(first.model.lm_head.weight, again.model.lm_head.weight)
    cached = list((tmp_path / "models").iterdir())
    assert len(cached) == 1 and json.loads((cached[0] / "zl_source.json").read_text())["size"] > 0


@pytest.mark.parametrize("tied", [False, True])
def test_a_stage_loads_only_its_layers_and_computes_as_on_the_whole_model(tmp_path, tied):
    """load_stage_model (a torch runtime rank): layers first..last, the final norm and the LM head (+ the embedding
    for stage 0, or when the LM head is the embedding) hold the whole model's values; the other layers stay on the
    meta device; each stage's forward and trainable parameters equal those built on the whole model."""
    from zl_export.exporter import build_stage_modules
    from zl_export.model_source import load_stage_model
    from zl_export.options import ExportOptions
    from zl_export.stages import StageRange

    saved = _save_tiny_llama_dir(tmp_path)
    if tied:  # a model whose LM head is its embedding (SmolLM2): rewrite the directory that way
        saved.model.config.tie_word_embeddings = True
        saved.model.tie_weights()
        saved.model.save_pretrained(tmp_path)
    layers = saved.config.num_hidden_layers
    ranges = [StageRange(0, 0, 0), StageRange(1, 1, layers - 2), StageRange(2, layers - 1, layers - 1)]
    opts = ExportOptions(seq_len=8)
    _, whole = build_stage_modules(load_model(str(tmp_path)).model, ranges, opts)
    torch.manual_seed(0)
    ids, mask = torch.randint(3, 8, (1, 8)), torch.ones(1, 8, dtype=torch.long)
    for k, r in enumerate(ranges):
        part = load_stage_model(str(tmp_path), r.first, r.last, embedding=k == 0).model
        held = {n.split(".")[2] for n, p in part.named_parameters() if not p.is_meta and n.startswith("model.layers.")}
        assert held == {str(i) for i in range(r.first, r.last + 1)}, (k, held)
        assert part.model.embed_tokens.weight.is_meta == (k > 0 and not tied), k
        assert not part.lm_head.weight.is_meta and not part.model.norm.weight.is_meta
        if tied:
            assert part.lm_head.weight is part.model.embed_tokens.weight
        _, modules = build_stage_modules(part, ranges, opts)
        x = ids if k == 0 else torch.randn(1, 8, saved.config.hidden_size)
        with torch.no_grad():
            assert torch.equal(modules[k].chunk(x, mask)[1], whole[k].chunk(x, mask)[1]), k
        mine = [p for p in modules[k].parameters() if p.requires_grad]
        theirs = [p for p in whole[k].parameters() if p.requires_grad]
        assert len(mine) == len(theirs) > 0 and all(torch.equal(a, b) for a, b in zip(mine, theirs)), k


def test_a_stage_of_incomplete_files_is_refused_and_other_sources_load_whole(tmp_path):
    from safetensors.torch import load_file, save_file

    from zl_export.model_source import load_stage_model

    _save_tiny_llama_dir(tmp_path)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(str(weights))
    save_file({k: v for k, v in tensors.items() if not k.startswith("model.layers.1.")}, str(weights))
    with pytest.raises(ZLError, match=r"has no tensor model\.layers\.1\..* incomplete"):
        load_stage_model(str(tmp_path), 1, 1, embedding=False)
    assert load_stage_model(str(tmp_path), 0, 0, embedding=True).model.model.layers[1].mlp.up_proj.weight.is_meta
    # a random model is seeded over every layer, so it is built whole; then what the stage does not hold goes
    random, whole = load_stage_model("tiny-random", 1, 1, embedding=False).model, load_model("tiny-random").model
    held = {n for n, p in random.named_parameters() if not p.is_meta}
    assert held == {n for n in dict(whole.named_parameters())
                    if n.startswith(("model.layers.1.", "model.norm.", "lm_head."))}
    assert all(torch.equal(p, whole.get_parameter(n)) for n, p in random.named_parameters() if n in held)
