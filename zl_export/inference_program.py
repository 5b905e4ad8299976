"""An ExecuTorch inference program of a (merged) model: text generation with a KV cache, for phones.

    model (float32, adapter merged)  ->  torchao weight quantization (int8 | int4 | none)
      ->  a KV cache written in place (zl_export/kv_cache.py: llama::update_cache + custom_sdpa; transformers'
          static cache where a model's attention needs it)  ->  torch.export (prompt length dynamic)
      ->  tanh GELU written out  ->  to_edge_transform_and_lower(XnnpackPartitioner)  ->  to_executorch  ->  FILE.pte

The program has one method, `forward(input_ids (1, S) int64, cache_position (S,) int64) -> logits (1, S, V)`, the
signature of `transformers.integrations.executorch.TorchExportableModuleForDecoderOnlyLM` (what optimum-executorch
exports and the ExecuTorch LLM runners call): the S tokens are written into the KV cache at `cache_position`, so a
prompt is prefilled in one call and each new token is one call at the next position. Its constant methods
(`get_max_seq_len`, `get_eos_ids`, ...: `program_metadata`) are the ones the runners read.

Quantization (torchao source transforms through executorch's `quantize_model_`, so XNNPACK gets the patterns it
fuses):
- int8: linear layers int8 per output channel with activations quantized per token on the fly (XNNPACK
  qd8-f32-qc8w), the embedding int8 per row;
- int4: linear layers int4 in groups of 32 input channels, activations int8 per token (qd8-f32-qb4w), the
  embedding int4 in groups of 32.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from zl_base.errors import ZLError
from zl_export.kv_cache import InPlaceCacheDecoder, cache_ops_refusal

log = logging.getLogger(__name__)

QUANTIZATIONS = ("none", "int8", "int4")
# --quantize -> (linear config, embedding config) of executorch's quantize_model_ (see the module docstring).
_SCHEMES = {"int8": ("8da8w", "8w"), "int4": ("8da4w", "4w")}
GROUP_SIZE = 32  # int4: input channels per scale; every quantized weight's inner size must be a multiple
DEFAULT_MAX_SEQ_LEN = 512
# --kv-cache: written in place by ExecuTorch's LLM ops (zl_export/kv_cache.py), or transformers' static cache (a copy
# of the cache per token, slower; plain ATen ops, for a runtime built without ExecuTorch's LLM custom ops).
KV_CACHES = ("in-place", "static")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # what the runners read, next to the program


@dataclass
class ProgramInfo:
    """What `export_program` wrote and how long it took."""

    path: Path
    bytes: int
    quantize: str
    max_seq_len: int
    seconds: float
    metadata: dict
    kv_cache: str = "in-place"  # what the program holds (KV_CACHES): "static" where the model needed it
    data: Path | None = None  # --shared-base: the base weights' data file (base.ptd) the program loads with it


def merged_model(peft_model: torch.nn.Module) -> torch.nn.Module:
    """The base model with the LoRA adapter folded into its weights (W + B A · alpha/r), in eval mode.

    PEFT's `merge_and_unload` changes the wrapped model in place: the PEFT model is spent afterwards.
    """
    model = peft_model.merge_and_unload()
    return model.eval().requires_grad_(False)


def check_quantization(model: torch.nn.Module, quantize: str, family: str) -> None:
    """Raise unless `quantize` is known and fits every weight it would quantize (int4's groups of 32).

    Raises:
        ZLError: an unknown name, or a layer whose input size is not a multiple of the group size.
    """
    if quantize not in QUANTIZATIONS:
        raise ZLError(f"--quantize {quantize}: not one of {', '.join(QUANTIZATIONS)}; e.g. --quantize int8.")
    if quantize != "int4":
        return
    for name, module in model.named_modules():  # a LoRA layer's own linears stay float (--shared-base)
        if is_lora_weight(name):
            continue
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and module.weight.shape[-1] % GROUP_SIZE:
            raise ZLError(f"--quantize int4: {family}'s layer {name} has {module.weight.shape[-1]} input channels, "
                          f"not a multiple of int4's group of {GROUP_SIZE}; use --quantize int8 or none.")


#: --shared-base: the frozen base weights' data file beside the program, and how a LoRA weight is told from them.
SHARED_BASE = "base"  # -> base.ptd


def is_lora_weight(name: str) -> bool:
    """A LoRA weight of a PEFT model's layer (kept in the program), by its name (`...q_proj.lora_A.default.weight`,
    or a graph placeholder's `p_..._q_proj_lora_a_default_weight`); anything else is the base's."""
    lowered = name.lower()
    return "lora_a" in lowered or "lora_b" in lowered


def export_program(model: torch.nn.Module, out: Path, quantize: str = "none", max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
                   eos_ids: tuple[int, ...] = (), bos_id: int | None = None, kv_cache: str = "in-place",
                   shared_base: bool = False) -> ProgramInfo:
    """Quantize `model` (in place), export it with a KV cache of `max_seq_len` positions, lower it to XNNPACK and
    write the program to `out` (under a temporary name, renamed when complete).

    Args:
        model: a float32 Hugging Face causal LM of a supported family (a merged one: `merged_model`).
        quantize: one of QUANTIZATIONS (checked by `check_quantization` first).
        max_seq_len: positions of the KV cache: prompt plus generated tokens, at most.
        eos_ids, bos_id: the tokenizer's, recorded for the LLM runners (`get_eos_ids`, `get_bos_id`).
        kv_cache: one of KV_CACHES; "in-place" falls back to "static" (logged) for a model whose attention the
            in-place ops cannot express (`cache_ops_refusal`). `ProgramInfo.kv_cache` says which was written.
        shared_base: `model` is a PEFT model's LoRA-carrying model, unmerged; every weight but the LoRA ones goes to
            `out.parent / "base.ptd"` (ExecuTorch's program-data separation), the same bytes for every adapter of
            that base, and the program keeps the graph and the LoRA weights (`ProgramInfo.data`). `quantize`
            then quantizes the base's layers only: the LoRA weights stay float in the program.
    """
    from transformers import GenerationConfig
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    start = time.perf_counter()
    model.eval().requires_grad_(False)
    if quantize != "none":
        _quantize(model, quantize, base_only=shared_base)
    refusal = cache_ops_refusal(model, max_seq_len) if kv_cache == "in-place" else "--kv-cache static"
    if refusal is None:
        wrapper = InPlaceCacheDecoder(model, max_seq_len)
    else:
        log.info("KV cache: transformers' static cache (a copy of the cache per token): %s", refusal)
        model.generation_config = GenerationConfig(use_cache=True, cache_implementation="static",
                                                   cache_config={"batch_size": 1, "max_cache_len": max_seq_len})
        wrapper = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=max_seq_len)
    example = torch.zeros((1, 2), dtype=torch.int64)  # (1, S): a prompt of S tokens; S is dynamic
    seq = torch.export.Dim("seq_len", min=1, max=max_seq_len - 1)
    kwargs = {"input_ids": example, "cache_position": torch.arange(2)}
    dynamic = {"input_ids": {1: seq}, "cache_position": {0: seq}}
    try:
        with torch.no_grad():
            # strict: non-strict export lifts the cache's tensors as constants aliasing its buffers, which
            # run_decompositions then refuses (torch 2.13, transformers 5.24).
            if refusal is None:
                exported = torch.export.export(wrapper, (), kwargs, dynamic_shapes=dynamic, strict=True)
            else:
                exported = wrapper.export(**kwargs, dynamic_shapes=dynamic, strict=True)
            if shared_base:  # the XNNPACK delegate's weights are tagged on the unlifted graph, then exported again
                from executorch.exir.passes.external_constants_pass import delegate_external_constants_pass_unlifted

                unlifted = exported.module()
                delegate_external_constants_pass_unlifted(unlifted, _base_tag)
                exported = torch.export.export(unlifted, (), kwargs, dynamic_shapes=dynamic, strict=True)
    finally:
        if refusal is None:
            wrapper.restore()
    metadata = program_metadata(model.config, max_seq_len, eos_ids, bos_id, in_place_cache=refusal is None)
    log.info("lowering to XNNPACK (%s)", quantize)
    program = lower_to_executorch(exported, metadata, external=_base_tag if shared_base else None)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    tmp.write_bytes(program.buffer)
    data = None
    if shared_base:
        import tempfile

        with tempfile.TemporaryDirectory(dir=out.parent, prefix=".base-") as staged:
            program.write_tensor_data_to_file(staged)
            data = out.parent / f"{SHARED_BASE}.ptd"
            written = Path(staged) / data.name
            if data.exists() and data.read_bytes() != written.read_bytes():
                raise ZLError(f"--out: {data} exists and holds another base's weights (another model or --quantize); "
                              "write the program to another directory, or remove it.")
            os.replace(written, data)
    os.replace(tmp, out)
    return ProgramInfo(out, out.stat().st_size, quantize, max_seq_len, time.perf_counter() - start, metadata,
                       "in-place" if refusal is None else "static", data)


def _base_tag(node) -> str | None:
    """A constant's data file: the base's, or None for a LoRA weight, which stays in the program. For the
    delegate's constants (a get_attr, `delegate_external_constants_pass_unlifted`) and the ones it left to the
    program (a placeholder, `ExecutorchBackendConfig.external_constants`) alike."""
    return None if is_lora_weight(node.name) or is_lora_weight(str(node.target)) else SHARED_BASE


def lower_to_executorch(exported: torch.export.ExportedProgram, constant_methods: dict | None = None,
                        external=None):
    """`exported` delegated to XNNPACK and made an ExecuTorch program (an `ExecutorchProgramManager`: `.buffer` is
    the .pte's bytes), with `constant_methods` beside its methods; `external(node)` names the data file of a
    constant kept outside the program (None: inside)."""
    from executorch.backends.xnnpack._passes.convert_to_linear import ConvertToLinearPass
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass

    edge = to_edge_transform_and_lower(tanh_gelu_written_out(exported), partitioner=[XnnpackPartitioner()],
                                       compile_config=EdgeCompileConfig(_check_ir_validity=False),
                                       constant_methods=constant_methods)
    # As executorch's LLMEdgeManager.to_executorch: linears left outside XNNPACK run as op_linear (not transpose +
    # mm), quantized embeddings become quantized_decomposed::embedding_{byte,4bit} (quant fusion), inputs are not
    # planned into the arena (the runner passes its own), and sizes follow the dynamic prompt length.
    edge = edge.transform([ConvertToLinearPass()])
    return edge.to_executorch(ExecutorchBackendConfig(
        extract_delegate_segments=True, do_quant_fusion_and_const_prop=True,
        memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False),
        sym_shape_eval_pass=ConstraintBasedSymShapeEvalPass(), external_constants=external or False))


def tanh_gelu_written_out(exported: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """`exported` with every tanh-approximated GELU replaced by the ops of its formula,
    0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) (PyTorch's own decomposition); exact GELUs are kept.

    XNNPACK's GELU in executorch 1.5 drops `approximate` and computes the exact (erf) GELU, up to 4.7e-4 away per
    activation: Gemma's gelu_pytorch_tanh, through 18 layers, put Gemma 3 270M's logits 5.3e-3 (relative) from the
    model. Written out, every op (mul, add, tanh) still runs in the delegate. Upstream fix: pytorch/executorch#22851
    (a newer runtime, which phones may not have).
    """
    from torch._decomp import get_decompositions

    gelu = torch.ops.aten.gelu.default
    reference = get_decompositions([gelu])[gelu]

    def tanh_only(x: torch.Tensor, approximate: str = "none"):
        # NotImplemented: keep this GELU as it is (the tracer then records aten.gelu itself).
        return reference(x, approximate=approximate) if approximate == "tanh" else NotImplemented

    if not any(n.target is gelu for n in exported.graph.nodes):
        return exported
    return exported.run_decompositions({gelu: tanh_only})


def program_metadata(config, max_seq_len: int, eos_ids: tuple[int, ...], bos_id: int | None,
                     in_place_cache: bool = True) -> dict:
    """The constant methods ExecuTorch's LLM runners read (names as examples/models/llama/export_llama_lib.py and
    optimum-executorch write them); `use_sdpa_with_kv_cache` says the program attends with llama::custom_sdpa."""
    metadata = {
        "get_max_seq_len": max_seq_len,
        "get_max_context_len": max_seq_len,
        "get_vocab_size": int(config.vocab_size),
        "get_n_layers": int(config.num_hidden_layers),
        "use_kv_cache": True,
        "use_sdpa_with_kv_cache": in_place_cache,
        "enable_dynamic_shape": True,
        "get_eos_ids": list(eos_ids),
    }
    if bos_id is not None:
        metadata["get_bos_id"] = bos_id
    return metadata


def _quantize(model: torch.nn.Module, quantize: str, base_only: bool = False) -> None:
    """torchao weight quantization of the linear layers and the embedding, in place (`_SCHEMES`).

    base_only (--shared-base): a PEFT model's base layers only, each LoRA layer's own linears left float; the
    quantized weights are then unwrapped into plain tensors (torchao's `unwrap_tensor_subclass`), so that the
    export's constants are those tensors, which the data-file tags follow into base.ptd. (Left wrapped, the
    lowering unwraps them into new constants that carry no tag, and the base's weights stay in the program.)
    """
    from executorch.extension.llm.export.quantize import quantize_model_

    linear, embedding = _SCHEMES[quantize]
    # padding_idx only shapes training (that row gets no gradient); the lookup is the same without it, and with it
    # aten.embedding carries an argument the quant-fusion pattern of embedding_byte/4bit does not match, leaving a
    # dequantize_affine no runtime kernel implements (SmolLM2, Phi-3: pad_token_id is set).
    model.get_input_embeddings().padding_idx = None
    if model.lm_head.weight is model.model.embed_tokens.weight:
        # Tied (SmolLM2, Qwen2.5, Gemma 3): each side gets its own quantized copy, in its own layout.
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone(), requires_grad=False)
    # quantize_model_ reports on stdout; a library's output goes to the log.
    hidden = _lora_layers_hidden(model) if base_only else contextlib.nullcontext()
    with contextlib.redirect_stdout(io.StringIO()) as said, hidden:
        quantize_model_(model, qlinear_config=linear, qembedding_config=embedding,
                        qlinear_group_size=None if quantize == "int8" else GROUP_SIZE,
                        qembedding_group_size=None if quantize == "int8" else GROUP_SIZE)
    for line in said.getvalue().splitlines():
        log.info("%s", line.strip())
    if base_only:
        from torchao.utils import unwrap_tensor_subclass

        unwrap_tensor_subclass(model)


@contextlib.contextmanager
def _lora_layers_hidden(model: torch.nn.Module):
    """`model` with each PEFT LoRA layer's own linears (its `lora_A`, `lora_B`: `is_lora_weight`; its base_layer is
    the base's) taken out of its module tree for the duration (put back after), so that what walks the tree
    (torchao's quantize_) sees the base's layers alone."""
    hidden = [(m, name, m._modules.pop(name)) for m in list(model.modules())
              for name in [n for n, child in m.named_children()
                           if is_lora_weight(n) and isinstance(child, torch.nn.ModuleDict)]]
    try:
        yield
    finally:
        for module, name, child in hidden:
            module._modules[name] = child


def write_tokenizer_files(tokenizer, directory: Path, force: bool = False) -> list[Path]:
    """Write the tokenizer files the ExecuTorch LLM runners read (tokenizer.json, tokenizer_config.json) into
    `directory`; returns their paths. A byte tokenizer (the random models) is written as a byte-level BPE without
    merges: the same ids (byte b is id b, then end of sequence and padding).

    Files of the same name already there are kept when identical (programs of one model share them) and replaced
    only with `force`.

    Raises:
        ZLError: a tokenizer file beside the program that differs (another model's), without `force`.
    """
    import shutil

    directory.mkdir(parents=True, exist_ok=True)
    with _staged_tokenizer_files(tokenizer, directory) as (staged, names):
        _refuse_another_tokenizer(staged, names, directory, force)
        for name in names:
            shutil.move(str(staged / name), directory / name)
    return [directory / n for n in names]


def check_tokenizer_files(tokenizer, directory: Path, force: bool = False) -> None:
    """What `write_tokenizer_files` would refuse, without writing anything: run before the export, so that a
    conflict costs no minutes of exporting and leaves no program behind.

    Raises:
        ZLError: a tokenizer file in `directory` that differs from `tokenizer`'s, without `force`.
    """
    if force or not any((directory / n).exists() for n in TOKENIZER_FILES):
        return
    with _staged_tokenizer_files(tokenizer, directory) as (staged, names):
        _refuse_another_tokenizer(staged, names, directory, force)


@contextlib.contextmanager
def _staged_tokenizer_files(tokenizer, directory: Path):
    """`tokenizer`'s runner files written into a temporary folder in `directory` (same file system, so they can be
    moved in); yields (that folder, the names written)."""
    import tempfile

    with tempfile.TemporaryDirectory(dir=directory, prefix=".tokenizer-") as tmp:
        staged = Path(tmp)
        if hasattr(tokenizer, "save"):
            tokenizer.save(str(staged))
        else:
            _byte_tokenizer_json(tokenizer, staged)
        yield staged, [n for n in TOKENIZER_FILES if (staged / n).is_file()]


def _refuse_another_tokenizer(staged: Path, names: list[str], directory: Path, force: bool) -> None:
    for name in names:
        there = directory / name
        if there.exists() and not force and there.read_bytes() != (staged / name).read_bytes():
            raise ZLError(f"--out: {there} exists and holds another tokenizer; pass --force to replace it, or "
                          "write the program to another directory.")


def _byte_tokenizer_json(tokenizer, directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()  # byte -> the printable character byte-level BPE spells it with
    vocab = {chars[b]: b for b in range(256)}
    specials = {"<eos>": tokenizer.eos_token_id, "<pad>": tokenizer.pad_token_id}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials))
    if tok.token_to_id("<eos>") != specials["<eos>"] or tok.token_to_id("<pad>") != specials["<pad>"]:
        raise AssertionError("byte tokenizer ids out of order")  # a change of the ByteTokenizer's ids
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "pad_token": "<pad>",
         "bos_token": None, "add_bos_token": False}, indent=2) + "\n")
