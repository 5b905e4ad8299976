"""Model families (zl_export/model_family.py) on their tiny random models: what each family declares is true of its
Hugging Face model, the stage modules compute what the Hugging Face model computes (its own masks, rotary tables,
embedding scale and soft-capping, cut with hooks), LoRA targets go by the family's names, `zl export` programs equal
that reference, and an unsupported architecture is one clean error.

The reference writes the loss of docs/design#product with `F.cross_entropy` / `F.kl_div` and reads out through the
model's own head with the config's soft-capping — no code shared with `StageModule` or `local_loss`.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import native_library_or_skip
from zl_base.errors import ZLError
from zl_export.exporter import build_stage_modules, example_inputs, export_stage, write_program
from zl_export.frozen_weights import CompactEmbedding, CompactLinear, dequantized
from zl_export.lora import attach_lora
from zl_export.manifest import build_manifest
from zl_export.model_family import FAMILIES, family_of
from zl_export.model_source import load_model, load_stage_model
from zl_export.options import ExportOptions, LoraSettings, LossConfig
from zl_export.stages import parse_spec
from zl_export.training_program import TrainingProgram

MODELS = {"llama": "tiny-random", "qwen2": "tiny-random-qwen2", "qwen3": "tiny-random-qwen3",
          "phi3": "tiny-random-phi3", "gemma3_text": "tiny-random-gemma3"}
OTHERS = [m for k, m in MODELS.items() if k != "llama"]  # Llama's export is tests/test_export.py's
SPLIT = "0-1,2-3"
SLOTS = 5  # Ω-readout target slots, fewer than a row of example_inputs has targets


def test_every_family_has_a_tiny_model():
    assert sorted(MODELS) == sorted(f.key for f in FAMILIES)


def randomize_lora_b(peft_model) -> None:
    """LoRA B random (seeded), so every LoRA gradient is nonzero (B = 0 at init makes every lora_A gradient 0)."""
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def _build(name: str, max_targets: int, frozen_dtype: str = "bf16"):
    """The model with LoRA on every projection of its family (B random, so every gradient is nonzero), cut in 2."""
    loaded = load_model(name, seed=3)
    opts = ExportOptions(seq_len=24, micro_batch=2, lora=LoraSettings(4, 8.0, loaded.family.lora_targets),
                         loss=LossConfig(alpha=0.5, translator_rank=0), seed=5, max_targets=max_targets,
                         frozen_dtype=frozen_dtype)
    peft_model, modules = build_stage_modules(loaded.model, parse_spec(SPLIT, 4), opts)
    randomize_lora_b(peft_model)
    return loaded, peft_model, modules, opts


def _readout(base, h: torch.Tensor) -> torch.Tensor:
    """(…, D) -> (…, V): final norm, LM head and the config's soft-capping, as the HF model's forward applies them."""
    logits = base.lm_head(base.model.norm(h))
    cap = getattr(base.config, "final_logit_softcapping", None)
    return logits if cap is None else torch.tanh(logits / cap) * cap


def assert_step_equals(result, entry, ref_loss, ref_ce, ref_kl, ref_grads) -> None:
    """A program's step (TrainingProgram.step) equals the reference's loss terms and every LoRA gradient, each
    gradient named by the manifest entry's parameters and nonzero."""
    torch.testing.assert_close(result.outputs["loss"], ref_loss, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(result.outputs["task_loss"], ref_ce, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(result.outputs["consistency_loss"], ref_kl, rtol=1e-4, atol=1e-8)
    by_program_name = {p.program_name: p.name for p in entry.parameters}
    got = {by_program_name[k]: v for k, v in result.gradients.items()}
    assert set(got) == set(ref_grads) and ref_grads
    for n, g in ref_grads.items():
        assert g.abs().max() > 0, n
        torch.testing.assert_close(got[n], g, rtol=1e-4, atol=1e-6, msg=n)


def _reference(peft_model, first, last, ids, mask, labels, alpha, hidden_in=None):
    """Stage `first..last` through the HF model with hooks: (hidden_out, loss, ce, kl, LoRA grads by PEFT name).

    `hidden_in` replaces the input of layer `first` (a program's hidden state, for stage k > 0)."""
    base = peft_model.get_base_model()
    layers, captured = base.model.layers, {}

    def pre(module, args, kwargs):
        h = (hidden_in if hidden_in is not None else (args[0] if args else kwargs["hidden_states"])).detach()
        captured["in"] = h
        return ((h, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": h})

    def post(module, args, kwargs, output):
        captured["out"] = output[0] if isinstance(output, tuple) else output

    handles = [layers[first].register_forward_pre_hook(pre, with_kwargs=True),
               layers[last].register_forward_hook(post, with_kwargs=True)]
    try:
        peft_model.zero_grad(set_to_none=True)
        base.model(input_ids=ids, attention_mask=mask)
    finally:
        for h in handles:
            h.remove()
    h_in, h_out = captured["in"], captured["out"]
    logits = _readout(base, h_out)[:, :-1]  # (B, S-1, V)
    prev = _readout(base, h_in)[:, :-1].detach()
    targets = labels[:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
    kl_pos = F.kl_div(F.log_softmax(prev, -1), F.log_softmax(logits, -1), log_target=True, reduction="none").sum(-1)
    kl = kl_pos[targets != -100].mean()  # KL(p_k ‖ p_k-1) over Ω
    loss = alpha * ce + (1 - alpha) * kl
    loss.backward()
    grads = {}
    for n, p in peft_model.named_parameters():
        if "lora_" in n and p.grad is not None and first <= int(n.split(".layers.")[1].split(".")[0]) <= last:
            grads[n.replace(".default.", ".")] = p.grad.clone()
    return h_out.detach(), loss.detach(), ce.detach(), kl.detach(), grads


def test_the_declared_traits_hold_on_each_tiny_model():
    """Each flag of a family is true of its Hugging Face model (and false of Llama's), so the tests below exercise
    what the family declares."""
    for family in FAMILIES:
        model = load_model(MODELS[family.key]).model
        cfg, layer = model.config, model.model.layers[0]
        attn = layer.self_attn
        linears = {n.split(".")[-1] for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
        assert linears == set(family.lora_targets), family.name
        assert (attn.q_proj.bias is not None if hasattr(attn, "q_proj") else False) == family.qkv_bias, family.name
        assert hasattr(attn, "q_norm") == family.qk_norm, family.name
        assert hasattr(attn, "qkv_proj") == family.fused_projections, family.name
        norm = type(model.model.norm)(cfg.hidden_size, eps=1e-6)
        with torch.no_grad():
            norm.weight.zero_()  # (1 + w) RMSNorm still normalizes; w RMSNorm gives 0
        assert bool(norm(torch.ones(1, cfg.hidden_size)).abs().sum() > 0) == family.norm_plus_one, family.name
        ids = torch.tensor([[5, 7]])
        scaled = not torch.equal(model.model.embed_tokens(ids), model.model.embed_tokens.weight[ids])
        assert scaled == family.embedding_scale, family.name
        windows = [family.attention_window(cfg, i) for i in range(cfg.num_hidden_layers)]
        assert any(w is not None for w in windows) == (family.key in ("phi3", "gemma3_text")), family.name
        keys = {family.rotary_key(cfg, i) for i in range(cfg.num_hidden_layers)}
        assert (len(keys) == 2) == family.rotary_per_layer_type, family.name
        assert (family.final_softcap(cfg) is not None) == (family.key == "gemma3_text"), family.name
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == bool(cfg.tie_word_embeddings)


@pytest.mark.parametrize("name", list(MODELS.values()))
@pytest.mark.parametrize("slots,dtype", [(0, "fp32"), (SLOTS, "bf16")])
def test_stage_modules_equal_the_hf_model_with_hooks(name, slots, dtype, one_torch_thread):
    """Eager stage modules against the HF model cut with hooks: hidden state, loss terms and every LoRA gradient."""
    loaded, peft_model, modules, opts = _build(name, slots, dtype)
    ids, mask, labels = example_inputs(modules[0], opts, loaded.config.vocab_size, seed=7)
    assert (mask == 0).any() and (labels == -100).any()
    base = peft_model.get_base_model()
    with torch.no_grad():  # the reference's readout is the HF model's own logits
        torch.testing.assert_close(_readout(base, _last_hidden(base, ids, mask)),
                                   base(input_ids=ids, attention_mask=mask).logits, rtol=1e-5, atol=1e-5)
    x = ids
    for m in modules:
        first, last = m.stage.first, m.stage.last
        ref_h, ref_loss, ref_ce, ref_kl, ref_grads = _reference(peft_model, first, last, ids, mask, labels, 0.5)
        peft_model.zero_grad(set_to_none=True)
        h_in, h = m.chunk(x, mask)
        loss, ce, kl = m.loss_terms(h_in, h, labels)
        loss.backward()
        torch.testing.assert_close(h, ref_h, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(ce, ref_ce, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(kl, ref_kl, rtol=1e-5, atol=1e-9)
        assert float(ref_kl) > 1e-5, "a zero KL would not test the consistency term"
        got = {n.replace(".default.", "."): p.grad for n, p in peft_model.named_parameters()
               if "lora_" in n and p.grad is not None}
        assert set(got) == set(ref_grads) and ref_grads
        for n, g in ref_grads.items():
            assert g.abs().max() > 0, n
            torch.testing.assert_close(got[n], g, rtol=1e-4, atol=1e-7, msg=n)
        x = h.detach()


def _last_hidden(base, ids, mask):
    """The input of the HF model's final norm (its last layer's output)."""
    out = {}
    handle = base.model.layers[-1].register_forward_hook(
        lambda mod, args, o: out.setdefault("h", o[0] if isinstance(o, tuple) else o))
    try:
        base.model(input_ids=ids, attention_mask=mask)
    finally:
        handle.remove()
    return out["h"]


def test_lora_targets_go_by_the_family_and_a_wrong_one_names_the_valid_ones():
    for family in FAMILIES:
        loaded = load_model(MODELS[family.key])
        peft_model = attach_lora(loaded.model, LoraSettings(2, 4.0, family.lora_targets))
        names = {n for n, _ in peft_model.named_parameters() if "lora_A" in n}
        for i in range(loaded.config.num_hidden_layers):
            for t in family.lora_targets:
                assert any(f".layers.{i}." in n and f".{t}.lora_A" in n for n in names), (family.name, i, t)
        peft_model.unload()
        wrong = "q_proj" if family.fused_projections else "qkv_proj"
        with pytest.raises(ZLError) as e:
            attach_lora(loaded.model, LoraSettings(2, 4.0, (wrong, "o_proj")))
        msg = str(e.value)
        assert "\n" not in msg and family.name in msg and ",".join(family.lora_targets) in msg, msg
    with pytest.raises(ZLError, match="w_proj is not a projection of any supported model.*qkv_proj"):
        LoraSettings(2, 4.0, ("q_proj", "w_proj")).validate()


def test_unsupported_architectures_are_one_clean_error(tmp_path):
    from transformers import GPT2Config

    with pytest.raises(ZLError) as e:
        family_of("mamba", "some/model")
    msg = str(e.value)
    assert "\n" not in msg and "'mamba' is not supported" in msg
    assert all(t in msg for t in ("llama", "qwen2", "qwen3", "phi3", "gemma3_text")), msg
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(ZLError, match=r"--model .*architecture 'gpt2' is not supported.*Gemma 3 \(gemma3_text\)"):
        load_model(str(tmp_path))


def test_compact_linear_keeps_a_bias_and_compact_embedding_its_scale():
    torch.manual_seed(0)
    linear, x = nn.Linear(16, 12, bias=True), torch.randn(3, 16)
    gemma = load_model("tiny-random-gemma3").model.model.embed_tokens
    ids = torch.tensor([[1, 4, 9]])
    for dtype in ("bf16", "int8"):
        expected = F.linear(x, dequantized(linear.weight, dtype), linear.bias)
        torch.testing.assert_close(CompactLinear(linear, dtype)(x), expected, rtol=1e-5, atol=1e-6)
        rows = dequantized(gemma.weight, dtype)[ids] * 64 ** 0.5  # Gemma: embeddings × sqrt(D)
        torch.testing.assert_close(CompactEmbedding(gemma, dtype)(ids), rows, rtol=1e-5, atol=1e-6)
    assert float(gemma.embed_scale) == pytest.approx(64 ** 0.5)


@pytest.mark.parametrize("name", OTHERS)
def test_a_stage_loads_from_files_as_on_the_whole_model(tmp_path, name):
    """load_stage_model builds the family's model on the meta device and loads one stage: the buffers no file
    holds (both rotary tables, Gemma's embedding scale) are computed again, so the stage computes the same."""
    loaded = load_model(name, seed=4)
    loaded.model.save_pretrained(tmp_path)
    _save_word_tokenizer(tmp_path)
    ranges = parse_spec(SPLIT, 4)
    opts = ExportOptions(seq_len=8, lora=LoraSettings(2, 4.0, loaded.family.lora_targets[:1]))
    _, whole = build_stage_modules(load_model(str(tmp_path)).model, ranges, opts)
    ids, mask = torch.randint(3, 300, (1, 8), generator=torch.Generator().manual_seed(0)), torch.ones(1, 8, dtype=torch.long)
    x = ids
    for k, r in enumerate(ranges):
        part = load_stage_model(str(tmp_path), r.first, r.last, embedding=k == 0).model
        _, modules = build_stage_modules(part, ranges, opts)
        with torch.no_grad():
            got, want = modules[k].chunk(x, mask)[1], whole[k].chunk(x, mask)[1]
        assert torch.equal(got, want), (name, k)
        x = want


def _save_word_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "cat": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(path)


@pytest.mark.parametrize("name", OTHERS)
def test_export_of_a_two_stage_split_equals_the_reference(tmp_path, name):
    """`zl export`'s programs (Ω readout, bf16 frozen weights: the defaults) against the HF model with hooks: the
    hidden state, the loss terms and every LoRA gradient, stage 1 fed stage 0's ExecuTorch hidden state."""
    native_library_or_skip()
    loaded, peft_model, modules, opts = _build(name, SLOTS)
    entries = [write_program(export_stage(m, peft_model, opts, loaded.config.vocab_size), tmp_path) for m in modules]
    manifest = build_manifest(loaded, opts, entries)
    assert manifest.to_json()["model"]["family"] == loaded.family.key
    assert manifest.to_json()["model"]["family_traits"] == loaded.family.traits()
    ids, mask, labels = example_inputs(modules[0], opts, loaded.config.vocab_size, seed=7)
    hidden = None
    for entry in manifest.stages:
        program = TrainingProgram(tmp_path / entry.file, entry.output_names)
        result = program.step(ids if hidden is None else hidden, mask, labels)
        first, last = entry.layers
        ref_h, ref_loss, ref_ce, ref_kl, ref_grads = _reference(peft_model, first, last, ids, mask, labels, 0.5,
                                                                hidden_in=hidden)
        assert_step_equals(result, entry, ref_loss, ref_ce, ref_kl, ref_grads)
        if "hidden" in result.outputs:
            torch.testing.assert_close(result.outputs["hidden"], ref_h, rtol=1e-4, atol=1e-5)
            hidden = result.outputs["hidden"].clone()


def test_the_adapter_zl_merge_writes_loads_with_peft_on_each_family(tmp_path):
    """`zl merge` writes the manifest's PEFT names (`peft_names`) and `adapter_config`; `PeftModel.from_pretrained`
    on a fresh model of the family loads them and computes what the adapted model computed."""
    import json

    from peft import PeftModel
    from safetensors.torch import save_file

    from zl_export.lora import adapter_config, peft_names

    ids = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(1))
    for family in FAMILIES:
        name, out = MODELS[family.key], tmp_path / family.key
        settings = LoraSettings(2, 4.0, family.lora_targets)
        peft_model = attach_lora(load_model(name, seed=2).model, settings, seed=3)
        with torch.no_grad():
            for n, p in peft_model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.2)
            want = peft_model(input_ids=ids).logits
        names = peft_names(peft_model)
        out.mkdir()
        save_file({names[id(p)]: p.detach().contiguous() for p in peft_model.parameters() if id(p) in names},
                  str(out / "adapter_model.safetensors"))
        (out / "adapter_config.json").write_text(json.dumps(adapter_config(settings, name)))
        loaded = PeftModel.from_pretrained(load_model(name, seed=2).model, str(out))
        with torch.no_grad():
            got, base = loaded(input_ids=ids).logits, load_model(name, seed=2).model(input_ids=ids).logits
        assert not torch.allclose(got, base), f"{family.name}: the adapter must change the outputs to test anything"
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=family.name)
