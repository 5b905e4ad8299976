"""A tied LM head (Gemma 3, Qwen2.5, SmolLM2: `lm_head.weight is embed_tokens.weight`) with compact frozen weights:
stage 0 holds the table once, in memory and in its program, where it used to hold it as the embedding and again as
the head's row chunks (Gemma 3 270M: +320 MiB of .pte in bf16), and computes what an independent float32 model of
the same (dequantized) weights computes.

The head is cut in row chunks as Gemma 3 270M's is (11 chunks there, 3 here). Unchunked, the old code already
stored the table once: ExecuTorch's emitter merges constants of identical bytes.
"""

import itertools

import pytest
import torch
from torch import nn

from conftest import native_library_or_skip, widen_chunks
from test_model_families import _reference, assert_step_equals
from zl_export.exporter import build_stage_modules, example_inputs, export_stage, write_program
from zl_export.frozen_weights import CompactEmbedding, dequantized, quantize_rows
from zl_export.lora import attach_lora
from zl_export.model_source import load_model
from zl_export.options import ExportOptions, LoraSettings, LossConfig
from zl_export.stages import parse_spec
from zl_export.training_program import TrainingProgram

NAME = "tiny-random-gemma3"  # tied head, embedding scale √D, final soft-capping
CHUNK = 64 * 128  # its 320 x 64 head in 3 row chunks of ≤ 128 rows; every other weight stays one chunk


def _stored_rows(table: torch.Tensor, dtype: str) -> list[bytes]:
    """The table's rows as a compact weight stores them (bf16, int8 or float32 bytes); only rows distinct from the
    others and not all zero (Gemma's padding row), so a row's bytes appear nowhere but in a copy of the table."""
    stored = {"fp32": lambda w: w.detach().float(), "bf16": lambda w: w.detach().to(torch.bfloat16),
              "int8": lambda w: quantize_rows(w)[0]}[dtype](table)
    rows = [r.contiguous().view(torch.uint8).numpy().tobytes() for r in stored]
    once = {r for r in rows if rows.count(r) == 1 and any(r)}
    assert len(once) > 0.9 * len(rows)
    return sorted(once)


def _copies(blob: bytes, rows: list[bytes]) -> set[int]:
    """How many times each row appears in `blob`: {1} when the table is held once."""
    return {blob.count(r) for r in rows}


def _fp32_twin(opts: ExportOptions, peft_model: nn.Module) -> nn.Module:
    """A float32 PEFT model of `NAME` (nn.Linear / nn.Embedding, its head tied) whose frozen weights are the
    dequantized ones and whose LoRA weights are `peft_model`'s."""
    twin = attach_lora(load_model(NAME, seed=3).model, opts.lora, seed=opts.seed)
    assert twin.get_base_model().lm_head.weight is twin.get_base_model().model.embed_tokens.weight
    lora, done = dict(peft_model.named_parameters()), set()
    with torch.no_grad():
        for name, p in twin.named_parameters():
            if "lora_" in name:
                p.copy_(lora[name])
        for module in twin.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and not module.weight.requires_grad \
                    and id(module.weight) not in done:  # the tied table once
                module.weight.copy_(dequantized(module.weight, opts.frozen_dtype))
                done.add(id(module.weight))
    return twin


@pytest.mark.parametrize("dtype", ["bf16", "int8", "fp32"])
def test_stage_0_holds_the_tied_table_once_and_computes_the_reference(tmp_path, monkeypatch, dtype,
                                                                       one_torch_thread):
    native_library_or_skip()
    widen_chunks(monkeypatch, CHUNK)
    loaded = load_model(NAME, seed=3)
    table = loaded.model.model.embed_tokens.weight
    assert loaded.model.lm_head.weight is table
    rows = _stored_rows(table, dtype)
    opts = ExportOptions(seq_len=24, micro_batch=2, lora=LoraSettings(4, 8.0, loaded.family.lora_targets),
                         loss=LossConfig(alpha=0.5, translator_rank=0), seed=5, max_targets=5, frozen_dtype=dtype)
    peft_model, modules = build_stage_modules(loaded.model, parse_spec("0-1,2-3", 4), opts)
    stage = modules[0]
    if dtype != "fp32":
        assert stage.lm_head.head.chunks == 3 and isinstance(stage.embed_tokens, CompactEmbedding)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():  # B = 0 at init would make every lora_A gradient 0
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)

    # In memory: the stage's tensors (each once: parameters() and buffers() skip a tensor seen before).
    tensors = [t for t in itertools.chain(stage.parameters(), stage.buffers()) if t.dim()]
    held = b"".join(t.detach().contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)
    assert _copies(held, rows) == {1}
    # In the program.
    program = export_stage(stage, peft_model, opts, loaded.config.vocab_size)
    assert _copies(program.buffer, rows) == {1}

    # The program's step equals the HF model of the dequantized weights, cut with hooks.
    entry = write_program(program, tmp_path)
    ids, mask, labels = example_inputs(stage, opts, loaded.config.vocab_size, seed=7)
    assert set((ids // 128).unique().tolist()) == {0, 1, 2}  # the embedding reads every chunk
    result = TrainingProgram(tmp_path / entry.file, entry.output_names).step(ids, mask, labels)
    twin = _fp32_twin(opts, peft_model)
    ref_h, ref_loss, ref_ce, ref_kl, ref_grads = _reference(twin, 0, 1, ids, mask, labels, 0.5)
    torch.testing.assert_close(result.outputs["hidden"], ref_h, rtol=1e-4, atol=1e-5)
    assert_step_equals(result, entry, ref_loss, ref_ce, ref_kl, ref_grads)


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_a_chunked_embedding_looks_up_every_row_as_the_whole_table(monkeypatch, dtype):
    """Ids at both ends of every chunk (100-row chunks of a 250-row table: the last one short) read the row of the
    dequantized table, Gemma's √D scale applied; an id past the table is refused as by nn.Embedding."""
    widen_chunks(monkeypatch, 16 * 100)
    torch.manual_seed(0)
    embedding = nn.Embedding(250, 16)
    embedding.embed_scale = torch.tensor(4.0)
    compact = CompactEmbedding(embedding, dtype)
    assert compact.chunks == 3
    ids = torch.tensor([[0, 99, 100, 199], [200, 249, 5, 150]])
    torch.testing.assert_close(compact(ids), dequantized(embedding.weight, dtype)[ids] * 4.0, rtol=0, atol=0)
    with pytest.raises(IndexError):
        compact(torch.tensor([[250]]))
