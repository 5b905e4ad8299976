"""Frozen weights in fewer bytes: bf16, int8 with a scale per output channel, or int4 with a scale and a minimum per
group of 32 input channels (docs/design#frozen-weights).

Only LoRA (and translator) parameters train; every other linear weight, the
LM head and the token embedding are constants of the stage program, and they
are most of its bytes (TinyLlama stage 0-6: 1.7 GB as float32). With
`--frozen-dtype bf16|int8|int4` they are stored compact and widened to float32
per use inside the program:

    bf16: y = x @ W.float().T
    int8: y = (x @ Q.float().T) * s     W ≈ Q * s[:, None], Q = round(W / s), s = max|W_row| / 127
    int4: y = x @ (Q * s_g + m_g).T     per group g of 32 columns of a row (llama.cpp's Q4_1): m_g its minimum,
                                        s_g = (its maximum - m_g) / 15, both float16, Q = round((W - m_g) / s_g)
                                        in [0, 15]

The int8 scale is per output channel, so it applies to the matmul's output (V
multiplies, not V × D); an int4 group's scale and minimum are applied while
widening (`zerolock::widen_int4`), two values packed in a byte, 0.625 bytes a
weight with its float16 pairs (int8: 1, bf16: 2). A weight is stored in row chunks
(`compact_rows`); a tied embedding and LM head share the same chunk tensors,
so the table is held once, in stage 0's program too. LoRA weights,
gradients, activations and AdamW state stay float32. The eager model and the
program compute the same quantized model: `zl export --check` and the tests
compare them.

In the joint graph a widened weight would live from the forward to the
backward (the input gradient needs it again) and memory planning would keep
every one of them: a float32 copy of all frozen weights. `widen_per_use`
gives each use its own short-lived widening instead. Eager autograd has the
same problem (it saves the widened weight of every layer of every micro-batch
in flight); `compact_for_training` sets a module's compact linears to save
the compact weight and widen it again for the input gradient (`WidenedLinear`),
as the torch runtime's stages do.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from custom_ops import widen, widen_int4
from zl_export.graph_edit import computed_from, copy_before
from zl_export.options import FROZEN_DTYPES
# A widened weight of more elements than this is widened in row chunks (the LM head: 32,000 × 2,048 would be a
# 262 MB float32 temporary; 4 chunks of 8,000 rows are 66 MB each).
CHUNK_ELEMENTS = 1 << 24
# int4's chunks (`chunk_elements`): a float32 widening is 6.4x its int4 bytes, so where the frozen weights are stored
# for memory the transient is kept to 4 MiB (TinyLlama's last stage at seq 256 with --recompute: -40 MiB peak, a
# step 1.00-1.03x; docs/benchmarks.md, "Memory").
INT4_CHUNK_ELEMENTS = 1 << 20
INT4_GROUP = 32  # int4: input channels per scale and minimum (llama.cpp's Q4_1 and ExecuTorch's 8da4w use 32 too)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: (Q (O, I) int8, s (O,) float32) with W ≈ Q * s[:, None]; all-zero rows get s = 1."""
    amax = weight.detach().float().abs().amax(dim=1)  # (O,)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(weight.detach().float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 per group of INT4_GROUP columns, llama.cpp's Q4_1 grid: (packed (O, I/2) uint8, params (O, 2 I/INT4_GROUP)
    float16) with W ≈ Q * s + m per group, params holding each group's (s, m). m is the group's minimum and
    s = (maximum - m) / 15, both rounded to float16 before Q = round((W - m) / s) is taken in [0, 15], so a group's
    minimum and maximum come back to within float16's rounding and the rest to within half a step; a constant group
    gets s = 0 (every Q = 0). Byte j holds columns 2j (low nibble) and 2j + 1."""
    rows, columns = weight.shape
    if columns % INT4_GROUP:
        raise ValueError(f"--frozen-dtype int4 stores {INT4_GROUP} input channels per scale, and a weight of shape "
                         f"{tuple(weight.shape)} has {columns}; use --frozen-dtype int8 for this model")
    groups = weight.detach().float().reshape(rows, columns // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # (O, I/G)
    if not (torch.isfinite(low).all() and torch.isfinite(high).all()
            and max(-float(low.min()), float(high.max())) <= torch.finfo(torch.float16).max):
        raise ValueError(f"--frozen-dtype int4: a weight of shape {tuple(weight.shape)} holds values that float16 "
                         f"group parameters cannot carry (largest magnitude {groups.abs().max():.3g}); "
                         f"use --frozen-dtype int8 or bf16 for this model")
    minimum = low.to(torch.float16)
    scale = ((high - minimum.float()).clamp(min=0) / 15).to(torch.float16)  # a minimum rounded up: not below 0
    step = scale.float().unsqueeze(-1)
    shifted = groups - minimum.float().unsqueeze(-1)
    q = torch.where(step > 0, torch.round(shifted / torch.where(step > 0, step, 1.0)), 0.0).clamp(0, 15)
    q = q.to(torch.int16).reshape(rows, columns)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
    return packed.contiguous(), torch.stack([scale, minimum], dim=-1).reshape(rows, -1).contiguous()


def dequantized(weight: torch.Tensor, dtype: str) -> torch.Tensor:
    """The float32 weight the program computes with when `weight` is stored as `dtype` (the eager reference)."""
    if dtype == "fp32":
        return weight.detach().float().clone()
    if dtype == "bf16":
        return weight.detach().to(torch.bfloat16).float()
    if dtype == "int4":
        return widen_int4(*quantize_groups(weight))
    q, s = quantize_rows(weight)
    return q.float() * s[:, None]


def widened(weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Compact rows as float32: int4 (uint8, packed) with its groups' scales and minimums applied; bf16/int8 without
    (an int8 scale is per output channel and goes on the matmul's output)."""
    return widen_int4(weight, scale) if weight.dtype == torch.uint8 else widen(weight)


def output_scale(weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor | None:
    """The scale per output channel to apply after the matmul: int8's, or None (bf16; int4 applies its own)."""
    return None if weight.dtype == torch.uint8 else scale


def widened_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x @ widened(W).T, times the int8 scale per output channel (None for bf16 and int4)."""
    y = F.linear(x, widened(weight, scale))
    scale = output_scale(weight, scale)
    return y if scale is None else y * scale


class WidenedLinear(torch.autograd.Function):
    """y = x @ widened(W).T, times the int8 scale s per output: autograd saves the compact W (and s), not its float32
    widening, and the backward widens W again for the input gradient dx = (dy * s) @ widened(W). W is frozen, so it
    gets no gradient and x need not be saved."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight, scale)
        return widened_linear(x, weight, scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight, scale = ctx.saved_tensors
        per_output = output_scale(weight, scale)
        if per_output is not None:
            grad = grad * per_output
        return grad @ widened(weight, scale), None, None


def chunk_elements(dtype: str) -> int:
    """The most elements a row chunk of a `dtype` weight holds: INT4_CHUNK_ELEMENTS for int4, else CHUNK_ELEMENTS."""
    return INT4_CHUNK_ELEMENTS if dtype == "int4" else CHUNK_ELEMENTS


def compact_rows(weight: torch.Tensor, dtype: str, elements: int | None = None,
                 ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """`weight` (O, I) as `dtype` ("bf16", "int8" or "int4") in row chunks of ≤ `elements` (default
    `chunk_elements(dtype)`): per chunk (compact rows, their scales: int8 one per row, int4 a (scale, minimum) pair
    per row and group, bf16 None). A scale covers part of one row, so chunking does not change a value."""
    rows = max(1, (elements or chunk_elements(dtype)) // max(1, weight.shape[1]))
    quantize = {"int8": quantize_rows, "int4": quantize_groups}.get(dtype)
    return [quantize(part) if quantize else (part.to(torch.bfloat16).contiguous(), None)
            for part in weight.detach().split(rows, dim=0)]


def _register_chunks(module: nn.Module, chunks: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
    """The chunks as buffers `weight_<i>` (and `scale_<i>` for int8): the tensors themselves, not copies, so two
    modules given the same chunks (a tied embedding and LM head) hold them once."""
    module.chunks, module.chunk_rows = len(chunks), chunks[0][0].shape[0]
    for i, (weight, scale) in enumerate(chunks):
        module.register_buffer(f"weight_{i}", weight)
        if scale is not None:
            module.register_buffer(f"scale_{i}", scale)


class CompactLinear(nn.Module):
    """A frozen `nn.Linear` stored as bf16, int8 + per-row scale or int4 + group scales and minimums, in row chunks of
    ≤ `chunk_elements` (`compact_rows`); a bias (Qwen2's q/k/v projections) stays float32 (O values) and is added
    after the widened matmul. `chunks` gives the compact rows to use (shared with a tied embedding; default: made
    from `linear`).

    `widen_again = True` (eager only; `compact_for_training`): the backward widens the weight again instead of
    autograd keeping the forward's float32 copy. The export keeps it False and gets the same from `widen_per_use`.
    """

    widen_again = False

    def __init__(self, linear: nn.Linear, dtype: str, chunks: list | None = None):
        super().__init__()
        self._original = (linear,)  # a tuple: not a submodule, so not part of the program (restore_frozen_weights)
        self.dtype, self.in_features, self.out_features = dtype, linear.in_features, linear.out_features
        _register_chunks(self, chunks if chunks is not None else compact_rows(linear.weight, dtype))
        self.bias = None if linear.bias is None else nn.Buffer(linear.bias.detach().float().clone())  # (O,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (…, I) -> (…, O)
        outs = []
        for i in range(self.chunks):
            weight, scale = getattr(self, f"weight_{i}"), getattr(self, f"scale_{i}", None)
            # (…, rows); autograd keeps the compact weight with widen_again, else the forward's widening
            outs.append(WidenedLinear.apply(x, weight, scale) if self.widen_again else widened_linear(x, weight, scale))
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return y if self.bias is None else y + self.bias


class CompactEmbedding(nn.Module):
    """A frozen `nn.Embedding` stored as bf16, int8 or int4 (with their scales), in the row chunks of a
    `CompactLinear` of the same table; only the looked-up rows are widened. An embedding that scales its rows
    (Gemma's `embed_scale`, sqrt(D)) keeps doing so.

    Stored like the head, a tied embedding (Gemma 3, Qwen2.5, SmolLM2: `lm_head.weight is embed_tokens.weight`) uses
    the head's chunks (`chunks`, from `compact_frozen_weights`): the table is held once in memory and in stage 0's
    program (one constant per chunk, not a whole-table copy beside the head's chunks: +320 MiB for Gemma 3 270M).
    """

    def __init__(self, embedding: nn.Embedding, dtype: str, chunks: list | None = None):
        super().__init__()
        self.dtype = dtype
        self._original = (embedding,)  # see CompactLinear
        _register_chunks(self, chunks if chunks is not None else compact_rows(embedding.weight, dtype))
        scale = getattr(embedding, "embed_scale", None)
        self.embed_scale = None if scale is None else nn.Buffer(scale.detach().float().clone(), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, S) -> (B, S, D)
        rows = None
        for i in range(self.chunks):
            table, scale = getattr(self, f"weight_{i}"), getattr(self, f"scale_{i}", None)
            first = i * self.chunk_rows  # the chunk holds ids first .. first + len(table) - 1
            # Ids of other chunks read some row of this one (clamped) and are masked out below; an id past the
            # table stays out of range in the last chunk, so the lookup refuses it as an unchunked one would.
            local = ids if first == 0 else (ids - first).clamp(min=0)
            local = local.clamp(max=table.shape[0] - 1) if i + 1 < self.chunks else local
            if table.dtype == torch.uint8:  # int4: the looked-up rows and their groups' parameters, widened together
                part = widen_int4(F.embedding(local, table), F.embedding(local, scale))  # (B, S, D)
            else:
                part = widen(F.embedding(local, table))  # (B, S, D)
                part = part if scale is None else part * scale[local].unsqueeze(-1)
            # Chunk by chunk in order: the last chunk starting at or before an id holds it.
            rows = part if rows is None else torch.where((ids >= first).unsqueeze(-1), part, rows)
        return rows if self.embed_scale is None else rows * self.embed_scale


def compact_for_training(module: nn.Module) -> int:
    """Ready `module`'s compact weights for eager training only (the torch runtime's stages); returns how many.

    Every CompactLinear widens its weight again in the backward (autograd then keeps the compact weights, not a
    float32 copy per layer and micro-batch in flight), and every compact module lets go of the float32 original it
    kept for `restore_frozen_weights` / `full_precision`, which then refuse it: otherwise the stage would hold its
    frozen weights twice, compact and float32.
    """
    compact = [m for m in module.modules() if isinstance(m, (CompactLinear, CompactEmbedding))]
    for m in compact:
        m._original = ()
        if isinstance(m, CompactLinear):
            m.widen_again = True
    return len(compact)


def _original(child: nn.Module) -> nn.Module:
    if not child._original:
        raise ValueError("this compact module let go of its float32 original (compact_for_training); "
                         "build the model again to get the float32 weights back")
    return child._original[0]


def frozen_modules(model: nn.Module, dtype: str, embedding_dtype: str | None = None):
    """Every frozen `nn.Linear` and `nn.Embedding` of `model` with the dtype it is stored in: (parent, name, module,
    dtype).

    The vocabulary's tables, the token embedding and the LM head (tied or not: a frozen linear whose weight is an
    embedding's, or of an embedding's shape, V x D), take `embedding_dtype` when given (`--embedding-dtype`); every
    other module `dtype`. Trainable linears (LoRA, translators) are left out.
    """
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Embedding)}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not (isinstance(child, (nn.Linear, nn.Embedding)) and not child.weight.requires_grad):
                continue
            table = isinstance(child, nn.Embedding) or tuple(child.weight.shape) in shapes
            yield parent, name, child, (embedding_dtype or dtype) if table else dtype


def compact_frozen_weights(model: nn.Module, dtype: str, embedding_dtype: str | None = None) -> int:
    """Replace every frozen `nn.Linear` and `nn.Embedding` of `model` (in place) by its compact form.

    Call after LoRA is attached (PEFT wraps the original `nn.Linear`s; their `base_layer`s are replaced here).
    Trainable linears (LoRA, translators) are left alone. Modules that share a weight (a tied embedding and LM
    head) share its compact chunks: one copy in memory and in the program, as the float32 model has.

    Args:
        embedding_dtype: the token embedding's and LM head's storage when not `dtype` (`frozen_modules`); they are
            stored in `dtype`'s chunks (`chunk_elements`).

    Returns:
        how many modules were replaced (those stored as "fp32" are not).
    """
    for d in (dtype, embedding_dtype):
        if d is not None and d not in FROZEN_DTYPES:
            raise ValueError(f"frozen dtype {d!r}: expected one of {', '.join(FROZEN_DTYPES)}")
    count, made = 0, {}  # id(float32 weight) -> (weight, its compact chunks)
    frozen = list(frozen_modules(model, dtype, embedding_dtype))
    matmuls = {id(m.weight) for _, _, m, _ in frozen if isinstance(m, nn.Linear)}
    for parent, name, child, stored in frozen:
        if stored == "fp32":
            continue
        # A weight shared by two modules (a tied embedding and LM head) gets one set of compact chunks. `made`
        # keeps the weight too, so its id cannot be reused by another tensor meanwhile.
        if id(child.weight) not in made:
            # Chunked as the export's --frozen-dtype chooses: bf16 tables beside int4 layers widen in int4's small
            # chunks too (SmolLM2's last stage at seq 256: a 36 MiB float32 slice of the head otherwise). An
            # embedding no matmul shares widens only the rows it looks up: small chunks would only make every lookup
            # gather from more of them, paging in each one's ends (TinyLlama's stage 0: +25 MiB file-backed at 2^20).
            own = isinstance(child, nn.Embedding) and id(child.weight) not in matmuls
            elements = CHUNK_ELEMENTS if own else chunk_elements(dtype)
            made[id(child.weight)] = (child.weight, compact_rows(child.weight, stored, elements))
        compact = CompactLinear if isinstance(child, nn.Linear) else CompactEmbedding
        setattr(parent, name, compact(child, stored, made[id(child.weight)][1]))
        count += 1
    return count


def restore_frozen_weights(model: nn.Module) -> int:
    """Undo `compact_frozen_weights`: put the original float32 modules back (in place); returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, (CompactLinear, CompactEmbedding)):
                setattr(parent, name, _original(child))
                count += 1
    return count


@contextlib.contextmanager
def full_precision(model: nn.Module):
    """Within the block, `model` computes with its original float32 frozen weights (the loss gap of the check)."""
    swapped = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, (CompactLinear, CompactEmbedding)):
                setattr(parent, name, _original(child))
                swapped.append((parent, name, child))
    try:
        yield bool(swapped)
    finally:
        for parent, name, child in swapped:
            setattr(parent, name, child)


WIDENINGS = (torch.ops.zerolock.widen.default, torch.ops.zerolock.widen_int4.default)


def widen_per_use(ep: torch.export.ExportedProgram) -> int:
    """Give every use of a widened constant its own `zerolock::widen` right before it; returns the nodes added.

    A widening (`zerolock::widen` of a bf16/int8 constant, `zerolock::widen_int4` of an int4 one) used by the
    forward matmul and again by the backward's input gradient would otherwise stay alive in planned memory between
    the two. A widening of a slice of a constant (a readout piece smaller than the head's chunk,
    zl_export/recompute.py) is copied with the slices it reads, so that no slice stays alive either.
    """
    graph, added = ep.graph, 0
    constants = {n for n in graph.nodes if n.op == "placeholder"
                 and n.target in {**ep.graph_signature.inputs_to_buffers, **ep.graph_signature.inputs_to_parameters}}
    from_constants = computed_from(constants)
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target in WIDENINGS and len(node.users) > 1
                and node.all_input_nodes and all(from_constants(a) for a in node.all_input_nodes)):
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        chain, stack = set(), [node]  # the widening and the slices (views) of constants it reads
        while stack:
            n = stack.pop()
            if n.op == "call_function" and n not in chain:
                chain.add(n)
                stack.extend(n.all_input_nodes)
        for user in sorted(node.users, key=order.get)[1:]:
            copies = copy_before(graph, chain, user, order)
            user.replace_input_with(node, copies[node])
            added += len(copies)
    graph.lint()
    ep.graph_module.recompile()
    return added
