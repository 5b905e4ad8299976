"""The split `zl train` uses without `--stages`: the stages' expected costs balanced, from the model's shape and what
each stage runs (docs/design#default-split).

A pipeline trains at the pace of its slowest stage (split.py), so the even split (`balanced_split`: the same layer
count per stage) leaves a stage idle wherever its layers cost less than another's. Without a calibration (`zl plan`
measures the devices; this needs nothing), a stage's cost per micro-batch is predicted as

    cost(k) = n_k x L x c(role_k) + head(k)

    L        one decoder layer's forward, in multiply-accumulates per sample: S x (the q, k, v, o and MLP projections
             + 2 x S x heads x head_dim for the attention scores and their weighted sum)
    c        what the stage runs per layer, in forwards, measured on the runner (SmolLM2-135M, stages of 10 layers at
             0.5 CPU, bf16 frozen weights, docs/benchmarks.md "K devices against one": a forward 29-30 ms, the
             backward 38 ms):
               held still (lr 0)                          1    the forward only
               trained (ZeroLock; the last stage)         2.3  forward, then the backward through frozen weights
               upstream under gpipe / 1f1b / async        3.3  forward; when the gradient comes, forward again and
                                                               backward (2.3 with --keep-activations: no second
                                                               forward)
    head(k)  the readout (final norm, LM head) where the stage has one (the last stage; a ZeroLock stage training on
             its local loss), per pass hidden x vocab x (T + 28): the T target slots' products, and a pass over the
             whole head's frozen weights (widened from bf16, read) that costs about 28 multiply-accumulates per
             weight, fitted to the last stage's 113 ms beyond its layers; twice where the stage trains (forward and
             the gradient through it)

These reproduce what was measured: held stages 43-44 ms against the trained last stage's 132 ms on the README's
run (even split), and `zl plan --schedule async`'s calibrated 0-8/9-17/18-29 for SmolLM2. `best_split` then minimises
the slowest stage exactly (its `Split.slowest_ms` and `total_ms` hold these predicted costs here, in
multiply-accumulates, not milliseconds: only their ratios are read).

The split is balanced only where every stage trains. Under ZeroLock's default the stages before the last are held
still: balancing would move layers off the trained last stage (13/13/4 of SmolLM2's 30), so fewer layers would learn
and the adapter would change; that trade is the user's to make with --stages (or `zl plan`), and the default split
stays even there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from zl_device.formats.schedules import is_backprop
from zl_device.formats.stage_spec import FORWARD, StageSpec
from zl_device.run.split import Split, best_split, evaluate

#: Forwards per layer by what a stage runs (module docstring).
HELD, TRAINED, BACKPROP_UPSTREAM, BACKPROP_UPSTREAM_KEPT = 1.0, 2.3, 3.3, 2.3
#: A pass over the LM head's frozen weights, in multiply-accumulates per weight (module docstring).
HEAD_PASS_PER_WEIGHT = 28


@dataclass(frozen=True)
class ModelShape:
    """What the cost model reads of a model's config."""

    num_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config) -> ModelShape:
        """From a transformers config (Llama, Qwen2/3, Phi-3, Gemma 3 text)."""
        text = getattr(config, "text_config", None) or config
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(text.num_hidden_layers, text.hidden_size, text.intermediate_size, heads,
                   getattr(text, "num_key_value_heads", None) or heads, head_dim, text.vocab_size)

    def layer_macs(self, seq_len: int) -> float:
        """One decoder layer's forward per sample, in multiply-accumulates."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        projections = self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate
        return seq_len * (projections + 2 * seq_len * q)

    def head_macs(self, readout_positions: int) -> float:
        """One pass through the readout per sample: the LM head's products at `readout_positions`, and the pass over
        its weights."""
        return (readout_positions + HEAD_PASS_PER_WEIGHT) * self.hidden * self.vocab


def stage_costs(shape: ModelShape, specs: Sequence[StageSpec], seq_len: int, readout_positions: int,
                keep_activations: bool = False):
    """cost(k, first, last) per micro-batch (module docstring), for `split.best_split`."""
    layer, head = shape.layer_macs(seq_len), shape.head_macs(readout_positions)

    def cost(k: int, first: int, last: int) -> float:
        spec, n = specs[k], last - first + 1
        is_last = k == len(specs) - 1
        if spec.role == FORWARD:
            return n * layer * HELD
        if is_backprop(spec.schedule):
            per = TRAINED if is_last else (BACKPROP_UPSTREAM_KEPT if keep_activations else BACKPROP_UPSTREAM)
            return n * layer * per + (2 * head if is_last else 0.0)
        return n * layer * TRAINED + 2 * head  # ZeroLock training: a readout of its own (the last: the model's)

    return cost


def balanced_and_even(shape: ModelShape, specs: Sequence[StageSpec], seq_len: int, readout_positions: int,
                      keep_activations: bool = False) -> tuple[Split, Split] | None:
    """(the split whose predicted slowest stage is fastest, the even split), both with their predicted costs; None
    with one stage or where the even split is already the fastest."""
    from zl_export.stages import balanced_split

    k = len(specs)
    if k < 2:
        return None
    cost = stage_costs(shape, specs, seq_len, readout_positions, keep_activations)
    even = evaluate(tuple((r.first, r.last) for r in balanced_split(shape.num_layers, k)), cost)
    best = best_split(shape.num_layers, k, cost)
    if best is None or best.ranges == even.ranges or best.slowest_ms >= even.slowest_ms:
        return None
    return best, even


def default_split(shape: ModelShape, specs: Sequence[StageSpec], seq_len: int, readout_positions: int,
                  keep_activations: bool = False) -> tuple[Split, Split] | None:
    """`balanced_and_even` where every stage trains; None where a stage is held still (the module docstring says
    why), with one stage, or where the even split is already the fastest."""
    if any(spec.role == FORWARD for spec in specs):
        return None
    return balanced_and_even(shape, specs, seq_len, readout_positions, keep_activations)
