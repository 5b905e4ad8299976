"""Recomputation in the backward: parts of a stage's forward that the joint graph would keep alive until the backward
are computed again there instead (docs/design#recomputation).

In the joint graph (`_export_forward_backward`) every tensor the backward needs stays in planned memory from the
forward to its last use. For the readout of every position that is the (N, V) logits: at seq 256 on Gemma 3's 262k
vocabulary, 256 MiB per copy, several copies. Two pieces fix it:

- `chunked_cross_entropy` computes the readout's cross-entropy in pieces of the vocabulary (an online log-sum-exp):
  no (N, V) tensor exists, each piece's logits are ≤ LOSS_CHUNK_ELEMENTS floats (`needs_chunks` says when). Each
  piece starts at `recompute_from(x)`, an identity op that marks where recomputation may start.
- `recompute_in_backward(ep)`, a pass over the joint graph: each `recompute_from` node opens a region (the forward
  nodes it reaches without passing another one); a large tensor of the region that the backward uses is computed
  again, from the region's start, right before the region's first backward use, and the backward uses that copy.
  The markers are then removed: the program never runs the op.

The same numbers as without it: the copies are the same operations on the same values. The cost is the forward of
each region once more (for the readout: one more LM head matmul a step).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from zl_export.frozen_weights import CompactLinear, WidenedLinear, widened_linear
from zl_export.graph_edit import computed_from, copy_before

# A piece of the readout's logits holds at most this many floats (16 MiB). The readout is computed in pieces when
# its (N, V) logits would be more than LARGE_READOUT_ELEMENTS (64 MiB: Gemma 3's 262k vocabulary at seq 64 and up,
# SmolLM2's at seq 512), or more than one piece under --recompute: computing each piece again costs one more LM head
# matmul a step (SmolLM2's last stage at seq 128: about a fifth of its step), which a run pays only for much memory
# or when it asked for memory over time.
LOSS_CHUNK_ELEMENTS = 1 << 22
LARGE_READOUT_ELEMENTS = 1 << 24


@torch.library.custom_op("zerolock::recompute_from", mutates_args=())
def recompute_from(x: torch.Tensor) -> torch.Tensor:
    """x itself (a copy: a custom op's output may not alias its input), marking the start of a recomputed region."""
    return x.clone()


@recompute_from.register_fake
def _recompute_from_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


recompute_from.register_autograd(lambda ctx, grad: grad)

Piece = Callable[[torch.Tensor], torch.Tensor]  # (…, D) -> (…, rows) logits


def head_pieces(head: nn.Module, positions: int) -> list[tuple[int, int, Piece]]:
    """The LM head as (first row, rows, fn) pieces of ≤ LOSS_CHUNK_ELEMENTS logits for `positions` rows of input.

    `head` is an `nn.Linear`, a `CompactLinear` (pieces never straddle its storage chunks; a piece smaller than a
    chunk widens a row slice of it) or a `SoftCappedHead` around either (each piece soft-capped)."""
    cap = getattr(head, "cap", None)
    inner = head.head if cap is not None else head
    rows_per_piece = max(1, LOSS_CHUNK_ELEMENTS // max(1, positions))
    pieces: list[tuple[int, int, Piece]] = []

    def add(first: int, rows: int, fn: Piece) -> None:
        pieces.append((first, rows, fn if cap is None else lambda x, fn=fn: torch.tanh(fn(x) / cap) * cap))

    if isinstance(inner, CompactLinear):
        # eager training (compact_for_training): autograd keeps each piece's compact rows, not their widening
        linear = WidenedLinear.apply if inner.widen_again else widened_linear
        for i in range(inner.chunks):
            weight, scale = getattr(inner, f"weight_{i}"), getattr(inner, f"scale_{i}", None)
            start = i * inner.chunk_rows
            for a in range(0, weight.shape[0], rows_per_piece):
                b = min(weight.shape[0], a + rows_per_piece)
                bias = None if inner.bias is None else inner.bias[start + a:start + b]
                # The rows are sliced when the piece runs, not here: a slice taken here would be traced (and, in
                # the program, copied) before the first piece runs and held until its own piece's widening, every
                # piece's at once (Gemma 3 270M, int4, 64 pieces: ~76 MiB of planned memory).
                add(start + a, b - a, lambda x, weight=weight, scale=scale, a=a, b=b, bias=bias: _plus(
                    linear(x, *_rows(weight, scale, a, b)), bias))
    elif isinstance(inner, nn.Linear):
        for a in range(0, inner.out_features, rows_per_piece):
            b = min(inner.out_features, a + rows_per_piece)
            bias = None if inner.bias is None else inner.bias[a:b]
            add(a, b - a, lambda x, a=a, b=b, bias=bias: F.linear(x, inner.weight[a:b], bias))
    else:
        raise TypeError(f"head_pieces: an LM head of type {type(inner).__name__} (expected nn.Linear or CompactLinear)")
    return pieces


def _rows(weight: torch.Tensor, scale: torch.Tensor | None, a: int, b: int):
    """Rows a..b of a compact weight and of its scales (the whole chunk as it is)."""
    if (a, b) == (0, weight.shape[0]):
        return weight, scale
    return weight[a:b], None if scale is None else scale[a:b]


def _plus(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias


def chunked_cross_entropy(normed: torch.Tensor, head: nn.Module, targets: torch.Tensor,
                          valid: torch.Tensor) -> torch.Tensor:
    """() the mean cross-entropy over `valid` of the readout `head(normed)`, computed piece by piece of the vocabulary
    (`head_pieces`): loss = logsumexp over pieces of each piece's logsumexp, minus the target's logit.

    Args:
        normed: (…, D) the readout's input (normed hidden states).
        head: the LM head (see `head_pieces`).
        targets: (…) int64 next-token ids (any value where not valid).
        valid: (…) float32, 1.0 where the position counts.
    """
    lses, picked = [], torch.zeros(targets.shape, dtype=torch.float32)
    for first, rows, piece in head_pieces(head, normed[..., 0].numel()):
        logits = piece(recompute_from(normed)).float()  # (…, rows)
        lses.append(torch.logsumexp(logits, dim=-1))  # (…)
        local = targets - first
        inside = (local >= 0) & (local < rows)
        target_logit = logits.gather(-1, local.clamp(0, rows - 1).unsqueeze(-1)).squeeze(-1)  # (…)
        picked = picked + torch.where(inside, target_logit, torch.zeros_like(target_logit))
    nll = torch.logsumexp(torch.stack(lses, dim=-1), dim=-1) - picked  # (…)
    return (nll * valid).sum() / valid.sum().clamp(min=1.0)


def needs_chunks(positions: int, vocab_size: int, recompute: bool) -> bool:
    """Whether a readout of `positions` rows over `vocab_size` is computed in pieces: logits of more than
    LARGE_READOUT_ELEMENTS, or under `--recompute` (`recompute`) of more than one piece."""
    return positions * vocab_size > (LOSS_CHUNK_ELEMENTS if recompute else LARGE_READOUT_ELEMENTS)


def _forward_nodes(ep: torch.export.ExportedProgram) -> set[torch.fx.Node]:
    """The forward: the graph up to the last node the forward's outputs (user outputs and the loss) depend on. The
    joint graph puts the whole forward first (with the aliases it keeps for the backward), then the backward."""
    kinds = {"USER_OUTPUT", "LOSS_OUTPUT"}
    names = {spec.arg.name for spec in ep.graph_signature.output_specs if spec.kind.name in kinds}
    stack = [n for n in ep.graph.nodes if n.name in names]
    seen: set[torch.fx.Node] = set()
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    nodes = list(ep.graph.nodes)
    last = max(i for i, n in enumerate(nodes) if n in seen)
    return set(nodes[: last + 1])


def _backward_users(node: torch.fx.Node, forward: set[torch.fx.Node]) -> list[torch.fx.Node]:
    """The backward's computations that read `node` (not the graph's output, not a shape check such as
    `_assert_tensor_metadata`, which the joint graph leaves beside the forward's tensors)."""
    return [u for u in node.users if u not in forward and u.op == "call_function"
            and not getattr(u.target, "__name__", "").startswith("_assert")]


def _numel(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() if isinstance(val, torch.Tensor) else 0


def recompute_in_backward(ep: torch.export.ExportedProgram) -> int:
    """Compute each `recompute_from` region's large saved tensors again before their backward use (module docstring);
    then drop the markers. Returns how many nodes were copied into the backward.

    A region's tensor counts as large when it has at least a quarter of the region start's elements; smaller ones
    (a piece's log-sum-exp) stay saved and the copies start from them. Nodes computed from constants alone (a
    widened weight) are computed again too, so that the forward's copy is not kept for the backward."""
    graph = ep.graph
    markers = [n for n in graph.nodes if n.op == "call_function"
               and n.target == torch.ops.zerolock.recompute_from.default]
    if not markers:
        return 0
    forward, marked = _forward_nodes(ep), set(markers)
    order = {n: i for i, n in enumerate(graph.nodes)}
    owner: dict[torch.fx.Node, torch.fx.Node | None] = {}  # node -> its region's marker (None: reached from two)
    for marker in markers:
        stack, seen = [marker], set()
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            owner[node] = marker if owner.get(node, marker) is marker else None
            stack.extend(u for u in node.users if u in forward and u not in marked)
    regions: dict[torch.fx.Node, list[torch.fx.Node]] = {m: [] for m in markers}
    for node, marker in owner.items():
        if marker is not None:
            regions[marker].append(node)
    user_inputs = set(ep.graph_signature.user_inputs)
    constant_only = computed_from({n for n in graph.nodes if n.op == "placeholder" and n.name not in user_inputs})

    copied = 0
    for marker in markers:
        limit = _numel(marker) / 4
        saved = [n for n in regions[marker] if n is not marker and _numel(n) >= limit and n.op == "call_function"
                 and _backward_users(n, forward)]
        if not saved:
            continue
        first_use = min((u for n in saved for u in _backward_users(n, forward)), key=order.get)
        needed: set[torch.fx.Node] = set()
        stack = list(saved)
        while stack:  # what the saved tensors are computed from, back to the marker and the small saved tensors
            node = stack.pop()
            if node in needed or node is marker:
                continue
            needed.add(node)
            for arg in node.all_input_nodes:
                in_region = owner.get(arg) is marker and not (_numel(arg) < limit and _backward_users(arg, forward))
                if (in_region or (arg.op == "call_function" and constant_only(arg))) and arg is not marker:
                    stack.append(arg)
        copies = copy_before(graph, needed, first_use, order)
        copied += len(copies)
        for node in saved:
            for user in _backward_users(node, forward):
                user.replace_input_with(node, copies[node])
    for marker in markers:  # x itself: the program never runs the marker
        marker.replace_all_uses_with(marker.args[0])
        graph.erase_node(marker)
    graph.eliminate_dead_code()
    graph.lint()
    ep.graph_module.recompile()
    return copied
