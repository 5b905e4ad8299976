"""`--frozen-dtype bf16|int8|int4`: programs with compact frozen weights against an eager float32 model holding the
same (dequantized) weights, through test_export's independent Hugging Face reference."""

import pytest
import torch
from torch import nn

from conftest import native_library_or_skip, widen_chunks
from test_export import _reference, _test_batch
from zl_base.errors import ZLError
from zl_export import exporter, frozen_weights
from zl_export.exporter import build_stage_modules, export_stage, write_program
from zl_export.frozen_weights import (INT4_GROUP, CompactEmbedding, CompactLinear, dequantized, quantize_groups,
                                      quantize_rows)
from zl_export.lora import attach_lora
from zl_export.manifest import build_manifest
from zl_export.model_source import load_model
from zl_export.options import ExportOptions, LoraSettings, LossConfig
from zl_export.stages import parse_spec
from zl_export.training_program import TrainingProgram

SPEC = "0-1,2-3"


def _opts(dtype: str, **kw) -> ExportOptions:
    return ExportOptions(seq_len=16, micro_batch=2, lora=LoraSettings(4, 8.0, ("q_proj", "v_proj")),
                         loss=LossConfig(alpha=(0.5,), translator_rank=0), seed=5, frozen_dtype=dtype, **kw)


def _perturb_lora_b(model: nn.Module) -> None:
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():  # B = 0 at init would make every lora_A gradient 0
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def _fp32_twin(opts: ExportOptions, peft_q: nn.Module) -> nn.Module:
    """A float32 PEFT model whose frozen weights are the dequantized ones and whose LoRA weights are `peft_q`'s."""
    twin = attach_lora(load_model("tiny-random", seed=3).model, opts.lora, seed=opts.seed)
    lora = dict(peft_q.named_parameters())
    with torch.no_grad():
        for name, p in twin.named_parameters():
            p.copy_(lora[name] if "lora_" in name else p)
        for _, _, module, stored in frozen_weights.frozen_modules(twin, opts.frozen_dtype, opts.embedding_dtype):
            module.weight.copy_(dequantized(module.weight, stored))
    return twin


def test_quantize_rows_bounds_the_error_by_half_a_step():
    w = torch.randn(7, 33) * torch.linspace(0.01, 3.0, 7)[:, None]
    w[3] = 0.0  # an all-zero row must not divide by zero
    q, s = quantize_rows(w)
    assert q.dtype == torch.int8 and q.abs().max() == 127
    err = (q.float() * s[:, None] - w).abs()
    assert (err <= s[:, None] / 2 + 1e-7).all()
    assert (dequantized(w, "int8")[3] == 0).all()


def test_quantize_groups_packs_two_a_byte_and_bounds_the_error_by_half_a_step():
    w = torch.randn(5, 4 * INT4_GROUP) * torch.linspace(0.01, 3.0, 4 * INT4_GROUP)
    w[2] = 0.0  # an all-zero row (its groups) must not divide by zero
    w[3, :INT4_GROUP] = 0.3  # a constant group: scale 0, every value its minimum
    packed, params = quantize_groups(w)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 2 * INT4_GROUP)
    assert params.dtype == torch.float16 and params.shape == (5, 2 * 4)
    q = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).float()  # low nibble first, in [0, 15]
    scale, minimum = (params[:, k::2].float().repeat_interleave(INT4_GROUP, dim=1) for k in (0, 1))  # (5, I) each
    back = q * scale + minimum
    assert torch.equal(dequantized(w, "int4"), back)  # the op widens as the format says
    assert q.min() == 0 and q.max() == 15 and (scale >= 0).all()
    # Each value within half a step of its own, plus what float16 rounds off the minimum and the scale (15 steps).
    slack = minimum.abs() * 2 ** -11 + 15 * scale * 2 ** -11 + 1e-7
    assert ((back - w).abs() <= scale / 2 + slack).all()
    groups, back_groups = w.reshape(5, 4, INT4_GROUP), back.reshape(5, 4, INT4_GROUP)
    torch.testing.assert_close(back_groups.amin(-1), groups.amin(-1), rtol=2 ** -10, atol=1e-7)  # the ends, up to
    torch.testing.assert_close(back_groups.amax(-1), groups.amax(-1), rtol=2 ** -9, atol=1e-6)  # float16 rounding
    assert (back[2] == 0).all() and (params[3, :2] == torch.tensor([0.0, 0.3], dtype=torch.float16)).all()


def test_quantize_groups_refuses_values_float16_cannot_carry():
    w = torch.zeros(2, INT4_GROUP)
    w[1, 3] = 1e5
    with pytest.raises(ValueError, match=r"float16 group parameters cannot carry.*1e\+05.*int8 or bf16"):
        quantize_groups(w)


def test_int4_refuses_a_weight_of_a_size_its_groups_do_not_divide():
    with pytest.raises(ValueError, match=r"int4 stores 32 input channels per scale.*\(8, 40\).*--frozen-dtype int8"):
        frozen_weights.compact_frozen_weights(nn.Sequential(nn.Linear(40, 8)).requires_grad_(False), "int4")


# Slow, ~50 s of export each: bf16, since test_tied_head's bf16 case checks a bf16 program (its head chunked) against
# the float32 twin of the dequantized weights through the same kind of reference, and test_export's programs are bf16
# (the default); int8 unchunked, since int8-chunked holds one-chunk weights (the attention projections) beside
# chunked ones (the MLP's, the LM head); int8-chunked, since int4-chunked goes through the same chunking and
# widen_per_use with the other kernel (and the C++ tests check zerolock::widen on int8); int4 layers with bf16 tables
# (--embedding-dtype), both kernels in one program.
@pytest.mark.parametrize("dtype,chunk,tables", [pytest.param("bf16", None, None, marks=pytest.mark.slow),
                                                pytest.param("int8", None, None, marks=pytest.mark.slow),
                                                pytest.param("int8", 64 * 100, None, marks=pytest.mark.slow),
                                                ("int4", 64 * 100, None), ("int4", None, "bf16")],
                         ids=["bf16", "int8", "int8-chunked", "int4-chunked", "int4-bf16-tables"])
def test_compact_programs_match_eager_of_the_same_weights(tmp_path, monkeypatch, dtype, chunk, tables):
    native_library_or_skip()
    if chunk:  # the LM head (320 x 64) in 4 row chunks of <= 100 rows, as TinyLlama's is
        widen_chunks(monkeypatch, chunk)
    loaded = load_model("tiny-random", seed=3)
    opts = _opts(dtype, embedding_dtype=tables)
    peft_q, modules = build_stage_modules(loaded.model, parse_spec(SPEC, 4), opts)
    assert isinstance(modules[0].embed_tokens, CompactEmbedding) and modules[0].embed_tokens.dtype == (tables or dtype)
    assert isinstance(modules[0].lm_head, CompactLinear) and modules[0].lm_head.chunks == (4 if chunk else 1)
    _perturb_lora_b(peft_q)
    entries = [write_program(export_stage(m, peft_q, opts, loaded.config.vocab_size), tmp_path) for m in modules]
    manifest = build_manifest(loaded, opts, entries)
    assert (manifest.options.frozen_dtype, manifest.options.embedding_dtype) == (dtype, tables)
    twin = _fp32_twin(opts, peft_q)
    input_ids, mask, labels = _test_batch(modules, opts, loaded.config.vocab_size)
    hidden, fp32_gap = None, 0.0
    for entry in manifest.stages:
        program = TrainingProgram(tmp_path / entry.file, entry.output_names)
        result = program.step(input_ids if hidden is None else hidden, mask, labels)
        first, last = entry.layers
        ref_h, ref_loss, ref_ce, ref_kl, ref_grads = _reference(twin, first, last, input_ids, mask, labels,
                                                                 opts.loss, hidden_in=hidden, stage=entry.index)
        torch.testing.assert_close(result.outputs["loss"], ref_loss, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(result.outputs["consistency_loss"], ref_kl, rtol=1e-4, atol=1e-7)
        names = {p.program_name: p.name for p in entry.parameters}
        for k, g in result.gradients.items():
            torch.testing.assert_close(g, ref_grads[names[k]], rtol=1e-4, atol=1e-6, msg=names[k])
        if "hidden" in result.outputs:
            torch.testing.assert_close(result.outputs["hidden"], ref_h, rtol=1e-4, atol=1e-5)
            hidden = result.outputs["hidden"].clone()
        # The float32 model gives another loss: the quantization is really in the program.
        fp32 = _reference(_fp32_twin(_opts("fp32"), peft_q), first, last, input_ids, mask, labels, opts.loss,
                          hidden_in=hidden if entry.index else None, stage=entry.index)[1]
        fp32_gap = max(fp32_gap, abs(float(fp32) - float(ref_loss)))
    assert fp32_gap > 1e-6, "the compact program computes the float32 model's loss: nothing was quantized"


def test_compact_programs_are_smaller_and_plan_no_extra_memory(tmp_path, monkeypatch):
    """int8 frozen weights shrink the program; widen_per_use keeps the widened weights out of planned memory."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    def export(dtype):
        loaded = load_model("tiny-random", seed=3)
        opts = _opts(dtype)
        peft, modules = build_stage_modules(loaded.model, parse_spec(SPEC, 4), opts)
        buffer = export_stage(modules[0], peft, opts, loaded.config.vocab_size).buffer
        pte = deserialize_pte_binary(buffer)
        plan = (pte.program if hasattr(pte, "program") else pte).execution_plan[0]
        frozen[dtype] = sum(b.numel() for n, b in modules[0].named_buffers()
                            if n.rsplit(".", 1)[-1].startswith("weight_"))
        return len(buffer), sum(plan.non_const_buffer_sizes)

    frozen = {}  # dtype -> elements of stage 0's compact weight tensors

    cfg = load_model("tiny-random").config
    largest = cfg.vocab_size * cfg.hidden_size * 4  # the LM head widened to float32, bytes
    layer = (2 * cfg.hidden_size ** 2 + 2 * cfg.hidden_size * cfg.num_key_value_heads * cfg.head_dim
             + 3 * cfg.hidden_size * cfg.intermediate_size) * 4  # one layer's frozen projections as float32
    fp32_size, fp32_planned = export("fp32")
    int8_size, int8_planned = export("int8")
    assert int8_size < 0.6 * fp32_size
    # At most one widened weight (the LM head) lives next to the activations.
    assert int8_planned <= fp32_planned + largest
    int4_size, int4_planned = export("int4")
    # int4 packs two weights a byte and adds a float32 scale per 32: 0.375 bytes a weight less than int8's one.
    weights = frozen["int8"]
    assert frozen["int4"] == weights // 2 and int8_size - int4_size >= 0.36 * weights
    assert int4_planned <= fp32_planned + largest
    monkeypatch.setattr(exporter, "widen_per_use", lambda ep: 0)
    _, unsplit_planned = export("int8")
    # Stage 0 has two layers: without widen_per_use their widened weights stay alive from forward to backward.
    assert unsplit_planned > fp32_planned + 1.5 * layer, "widen_per_use should have made a difference"


def test_restore_gives_back_the_float32_model():
    loaded = load_model("tiny-random", seed=3)
    before = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    peft, _ = build_stage_modules(loaded.model, parse_spec(SPEC, 4), _opts("int8"))
    assert frozen_weights.restore_frozen_weights(peft) > 0
    peft.unload()
    after = loaded.model.state_dict()
    assert set(after) == set(before)
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_unknown_frozen_dtype_is_refused():
    with pytest.raises(ZLError, match="--frozen-dtype 'fp8'.*fp32, bf16, int8, int4"):
        _opts("fp8").validate()


def test_the_frozen_dtype_changes_the_export_cache_key():
    from dataclasses import replace

    from zl_device.executorch.export_cache import export_key
    from zl_device.run.train_settings import TrainSettings
    from zl_export.options import ModelSplit

    s = TrainSettings(split=ModelSplit(model="tiny-random"))
    keys = {export_key(s, replace(_opts("fp32"), frozen_dtype=d)) for d in ("fp32", "bf16", "int8", "int4")}
    keys.add(export_key(s, _opts("int4", embedding_dtype="bf16")))
    assert len(keys) == 5


def saved_bytes(fn) -> tuple[torch.Tensor, int]:
    """fn()'s result and the bytes autograd saved for its backward."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total


@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("chunk", [None, 64 * 48])  # one chunk; 3 chunks of 16 rows
def test_widening_again_in_backward_keeps_no_float32_weight_and_computes_the_same(monkeypatch, dtype, chunk):
    if chunk:
        widen_chunks(monkeypatch, chunk)
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=False)
    x = torch.randn(2, 5, 64)
    results = {}
    for again in (False, True):
        compact = CompactLinear(linear, dtype)
        compact.widen_again = again
        xi = x.clone().requires_grad_()
        y, saved = saved_bytes(lambda: compact(xi))
        (y * torch.linspace(-1, 1, 48)).sum().backward()
        results[again] = (y.detach(), xi.grad, saved)
    (y0, g0, saved_once), (y1, g1, saved_again) = results[False], results[True]
    assert torch.equal(y0, y1)
    torch.testing.assert_close(g1, g0, rtol=1e-6, atol=1e-6)
    assert saved_once >= 48 * 64 * 4  # the float32 widening, kept until the backward
    compact_bytes = {"bf16": 48 * 64 * 2, "int8": 48 * 64 + 48 * 4, "int4": 48 * 32 + 48 * 2 * 4}[dtype]
    assert saved_again <= compact_bytes  # only the compact weight (and scale)
    model = nn.Sequential(CompactLinear(nn.Linear(64, 64, bias=False), dtype), nn.ReLU(), CompactLinear(linear, dtype))
    assert frozen_weights.compact_for_training(model) == 2 and all(m.widen_again for m in model
                                                                        if isinstance(m, CompactLinear))


def test_compact_for_training_lets_the_float32_originals_go():
    import gc
    import weakref

    linear, embedding = nn.Linear(64, 48, bias=False), nn.Embedding(100, 64)
    model = nn.ModuleDict({"proj": linear, "embed": embedding}).requires_grad_(False)
    assert frozen_weights.compact_frozen_weights(model, "bf16") == 2
    originals = [weakref.ref(linear.weight), weakref.ref(embedding.weight)]
    del linear, embedding
    gc.collect()
    assert all(r() is not None for r in originals)  # kept for restore_frozen_weights
    assert frozen_weights.compact_for_training(model) == 2
    gc.collect()
    assert all(r() is None for r in originals)  # the stage holds its frozen weights once, compact
    with pytest.raises(ValueError, match="let go of its float32 original"):
        frozen_weights.restore_frozen_weights(model)


@pytest.mark.parametrize("family", ["tiny-random", "tiny-random-qwen2"])  # the LM head untied; tied to the embedding
def test_embedding_dtype_stores_the_embedding_and_head_apart(family, monkeypatch):
    """`--embedding-dtype bf16` beside `--frozen-dtype int4`: the token embedding and the LM head (tied: one set of
    chunks) bf16 in int4's row chunks (an untied embedding in one), every projection int4, LoRA untouched."""
    monkeypatch.setattr(frozen_weights, "INT4_CHUNK_ELEMENTS", 64 * 100)  # the 320 x 64 tables in 4 chunks
    loaded = load_model(family, seed=3)
    peft = attach_lora(loaded.model, LoraSettings(4, 8.0, ("q_proj", "v_proj")), seed=0)
    frozen = [(name, m) for name, m in peft.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))
              and not m.weight.requires_grad]
    assert frozen_weights.compact_frozen_weights(peft, "int4", "bf16") == len(frozen)
    stored = {name: m.dtype for name, m in peft.named_modules() if isinstance(m, (CompactLinear, CompactEmbedding))}
    tables = {n for n in stored if n.endswith(("embed_tokens", "lm_head"))}
    assert len(tables) == 2 and {stored[n] for n in tables} == {"bf16"}
    assert len(stored) == len(frozen) and {d for n, d in stored.items() if n not in tables} == {"int4"}
    embed, head = (peft.get_submodule(n) for n in sorted(tables, key=lambda n: n.endswith("lm_head")))
    assert (embed.weight_0 is head.weight_0) == loaded.config.tie_word_embeddings
    # an embedding of its own keeps one chunk: it widens only the rows it looks up
    tied = loaded.config.tie_word_embeddings
    assert head.chunks == 4 and embed.chunks == (4 if tied else 1) and embed.weight_0.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for n, p in peft.named_parameters() if "lora_" in n)
    # fp32 tables: left as they are, the rest compact
    frozen_weights.restore_frozen_weights(peft)
    assert frozen_weights.compact_frozen_weights(peft, "int8", "fp32") == len(frozen) - 2
    assert isinstance(peft.get_submodule(sorted(tables)[0]), (nn.Linear, nn.Embedding))
    with pytest.raises(ValueError, match="frozen dtype 'int2'"):
        frozen_weights.compact_frozen_weights(peft, "int8", "int2")


def test_unknown_embedding_dtype_is_refused():
    with pytest.raises(ZLError, match="--embedding-dtype 'fp8'.*fp32, bf16, int8, int4"):
        _opts("int4", embedding_dtype="fp8").validate()
    assert _opts("int4", embedding_dtype="bf16").frozen_storage == "int4, embedding and head bf16"
    assert _opts("int4", embedding_dtype="int4").frozen_storage == _opts("int4").frozen_storage == "int4"


@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("chunk", [None, 64 * 30])  # one chunk; 4 chunks of 30 rows (the last of 10)
def test_compact_embedding_looks_up_the_dequantized_rows(monkeypatch, dtype, chunk):
    if chunk:
        widen_chunks(monkeypatch, chunk)
    torch.manual_seed(0)
    embedding = nn.Embedding(100, 64)
    ids = torch.tensor([[0, 29, 30, 59, 60], [99, 1, 31, 90, 0]])
    got = CompactEmbedding(embedding, dtype)(ids)
    torch.testing.assert_close(got, nn.functional.embedding(ids, dequantized(embedding.weight, dtype)), rtol=0, atol=0)


def test_widen_per_use_copies_a_widened_slice_with_its_slice():
    """A readout piece smaller than the head's chunk widens a slice of the constant (zl_export/recompute.py): the
    backward's input gradient gets its own slice and widening, so nothing of the forward's is kept for it."""
    from torch.export import export
    from torch.export.experimental import _export_forward_backward

    from custom_ops import widen
    from zl_export.exporter import _matmuls_to_linear

    class Piece(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("head", torch.randn(12, 8).to(torch.bfloat16))
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            return (torch.tanh(nn.functional.linear(x @ self.w, widen(self.head[2:9]))) ** 2).sum(),

    joint = _export_forward_backward(export(Piece(), (torch.randn(4, 8),), strict=False), joint_loss_index=0)
    _matmuls_to_linear(joint)
    widenings = [n for n in joint.graph.nodes if n.target == torch.ops.zerolock.widen.default]
    assert len(widenings) == 1 and len(widenings[0].users) == 2  # the forward's linear and the backward's mm
    assert frozen_weights.widen_per_use(joint) == 2  # a slice and a widening for the second use
    slices = [n for n in joint.graph.nodes if n.target == torch.ops.aten.slice.Tensor]
    widenings = [n for n in joint.graph.nodes if n.target == torch.ops.zerolock.widen.default]
    assert len(slices) == len(widenings) == 2 and all(len(n.users) == 1 for n in slices + widenings)
