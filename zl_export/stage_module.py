"""One pipeline stage as an `nn.Module` whose forward is the stage's whole local step.

The module owns layers `first..last` of a (PEFT-wrapped) causal LM of a
supported family (zl_export/model_family.py), the rotary embedding, and —
frozen — the final norm and LM head for the readout (soft-capped where the
config says so); stage 0 also owns the token embedding. Its forward follows the program
contract of docs/design#stage-program:

    inputs : input_ids (B,S) int64 | hidden (B,S,D) f32, attention_mask (B,S) int64, labels (B,S) int64
    outputs: hidden (B,S,D) f32 [not on the last stage], loss, task_loss, consistency_loss

`hidden` comes out of `zerolock::pipeline_marker` applied to the detached
chunk output, called before the readout so that it precedes every readout,
loss and backward instruction of the exported program.

A readout is a (D × V) matmul per position, so where it runs sets the cost:

- `max_targets = T > 0` (the exported default, docs/design#omega-readout): the program
  picks the first T target positions of each sample with a one-hot selection
  computed from `labels` inside the program (static shapes: (B, T, S) @
  (B, S, D)) and reads out only those, with a validity mask for empty slots.
  The host checks that no sample has more than T targets
  (`zl_export.shard.check_target_slots`, in `zl data` and `zl train`).
- `max_targets = 0`: every position is read out and the loss masked to Ω.
- `gather_targets = True` (eager only: the accuracy study, references): the
  readouts run on exactly the Ω positions (`nonzero`, a data-dependent shape).

All three give the same loss and gradients when no sample overflows its slots.
"""

import torch
from torch import nn

from custom_ops import pipeline_marker
from zl_export.local_loss import LossConfig, local_loss, shift_targets
from zl_export.model_family import causal_lm, family_of
from zl_export.recompute import chunked_cross_entropy, needs_chunks, recompute_from
from zl_export.stages import StageRange
from zl_export.translator import ReadoutTranslator


def causal_padding_mask(attention_mask: torch.Tensor, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """Additive attention mask (B, 1, S, S): 0 where query i may attend key j, a large negative elsewhere.

    Query i attends key j when j <= i, key j is a real token and, with a sliding `window`, i - j < window. With
    right padding every real query still sees itself; a padding query whose window holds only padding has a fully
    masked row (uniform attention, as in Hugging Face's eager attention; its output is never a target).
    """
    seq = attention_mask.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=attention_mask.device).tril()  # (S, S)
    if window is not None:
        causal = causal & ~torch.ones(seq, seq, dtype=torch.bool, device=attention_mask.device).tril(-window)
    allowed = causal[None, None, :, :] & attention_mask[:, None, None, :].bool()  # (B, 1, S, S)
    neg = torch.finfo(dtype).min
    return torch.zeros(allowed.shape, dtype=dtype, device=attention_mask.device).masked_fill(~allowed, neg)


def target_selection(valid: torch.Tensor, slots: int) -> torch.Tensor:
    """One-hot map of the first `slots` target positions of each sample onto slots 0..slots-1.

    Args:
        valid: (B, S) float32, 1.0 on Ω (from `shift_targets`).
        slots: T, target slots per sample.

    Returns:
        sel (B, T, S) float32: sel[b, t, s] = 1 when s is sample b's t-th target position (0-based), so
        `sel @ x` gathers the targets in order and an unused slot is a zero row. Targets beyond the T-th of
        a sample are dropped: the host checks that none exist (`zl_export.shard.check_target_slots`).
    """
    rank = valid.long().cumsum(1) - 1  # (B, S): index of each target among its sample's targets
    slot = torch.arange(slots, device=valid.device)  # (T,)
    return (rank[:, None, :] == slot[None, :, None]).float() * valid[:, None, :]  # (B, T, S)


class StageModule(nn.Module):
    """Layers `stage.first..stage.last` of `model` with the stage's local loss."""

    def __init__(self, model: nn.Module, stage: StageRange, num_stages: int, loss: LossConfig, seed: int = 0,
                 max_targets: int = 0, readout: bool = True, recompute: bool = False):
        """
        Args:
            model: a `*ForCausalLM` of a supported family, possibly wrapped by PEFT (LoRA modules
                inside its layers are kept and stay trainable).
            stage: the layer range of this stage.
            num_stages: stages in the pipeline; the last one has no hidden output.
            loss: the local loss's settings (α of this stage, KL direction, translator, ...).
            seed: seeds the readout translator (with the stage index folded in).
            max_targets: target slots per sample read out (0: every position, the full readout).
            recompute: mark each layer's input as the start of a region the export computes again in the backward
                (zl_export/recompute.py) instead of keeping the layer's activations.
            readout: own the frozen final norm and LM head (and the translator); without them (an upstream stage of
                the backprop program with no local loss, zl_export/backprop_stage.py) they are not in the module,
                so not in its program either.
        """
        super().__init__()
        lm = causal_lm(model)
        config = lm.config
        self.family = family_of(config.model_type)
        self.stage = stage
        self.is_first = stage.index == 0
        self.is_last = stage.index == num_stages - 1
        self.loss_cfg = loss
        self.alpha = loss.alpha_of(stage.index)
        # Stage 0's consistency target is the embedding readout, unless turned off.
        # The previous readout is needed only for a weighted KL term: none for stage 0 with first_target none, and
        # none at α = 1 (its weight would be 0; the stage then reports consistency_loss 0 and saves a readout).
        self.has_prev_target = not (self.is_first and loss.first_target == "none") and self.alpha < 1.0
        self.max_targets = max_targets
        self.recompute = recompute
        self.gather_targets = False
        self.embed_tokens = lm.model.embed_tokens if self.is_first else None
        self.layers = nn.ModuleList(lm.model.layers[stage.first : stage.last + 1])
        layers = range(stage.first, stage.last + 1)
        self.windows = [self.family.attention_window(config, i) for i in layers]  # None: plain causal
        self.rotary_keys = [self.family.rotary_key(config, i) for i in layers]  # None: the one rotary table
        self.rotary_emb = lm.model.rotary_emb
        self.hidden_size = config.hidden_size  # D
        self.vocab_size = config.vocab_size  # V
        cap = self.family.final_softcap(config)
        self.norm = lm.model.norm if readout else None
        self.lm_head = None if not readout else lm.lm_head if cap is None else SoftCappedHead(lm.lm_head, cap)
        use_translator = readout and loss.translator_rank > 0 and not self.is_last
        self.translator = (ReadoutTranslator(self.hidden_size, loss.translator_rank, seed * 1009 + stage.index)
                           if use_translator else None)

    def readout_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """(…, D) -> (…, D): what this stage's readout feeds the frozen LM head (the final norm, then the
        translator when the stage has one); the plain readout of the previous stage is `lm_head(norm(·))`."""
        normed = self.norm(hidden)
        return normed if self.translator is None else self.translator(normed)

    def chunk(self, x: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stage's layers: (input hidden state h_in, output hidden state h), both (B, S, D)."""
        h_in = self.embed_tokens(x) if self.is_first else x  # (B, S, D)
        batch, seq = attention_mask.shape
        position_ids = torch.arange(seq, device=attention_mask.device).unsqueeze(0).expand(batch, seq)  # (B, S)
        masks = {w: causal_padding_mask(attention_mask, h_in.dtype, w) for w in set(self.windows)}  # (B, 1, S, S)
        tables = {k: self.family.position_embeddings(self.rotary_emb, h_in, position_ids, k)
                  for k in set(self.rotary_keys)}  # (cos, sin), each (B, S, head_dim)
        h = h_in
        for layer, window, key in zip(self.layers, self.windows, self.rotary_keys):
            h = recompute_from(h) if self.recompute else h  # (B, S, D): kept; the layer is computed again
            h = layer(h, attention_mask=masks[window], position_ids=position_ids, position_embeddings=tables[key])
        return h_in, h

    def select_targets(self, labels: torch.Tensor, *states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(targets, valid, *states) at the positions the readout runs on: every position (B, S, ·), the T slots
        per sample (B, T, ·) or, with `gather_targets`, exactly Ω (K, ·); `states` are (B, S, D) hidden states."""
        targets, valid = shift_targets(labels)  # (B, S), (B, S)
        if self.gather_targets:  # eager only: a data-dependent shape
            rows, cols = valid.bool().nonzero(as_tuple=True)  # K target positions
            return (targets[rows, cols], valid[rows, cols], *(x[rows, cols] for x in states))
        if self.max_targets > 0:  # static: T slots per sample
            sel = target_selection(valid, self.max_targets)  # (B, T, S)
            # (B, T, D): bmm, an exact gather whose backward is exact too
            return ((sel.long() * targets[:, None, :]).sum(-1), sel.sum(-1), *(sel @ x for x in states))
        return (targets, valid, *states)

    def task_loss(self, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """() the cross-entropy of the plain readout (final norm, LM head, no translator) of the output hidden
        state h (B, S, D) over Ω: on the last stage, the pipeline's true loss, which the backprop program and the
        torch runtime's backprop schedules differentiate (zl_export/backprop_stage.py, zl_device/torch/backprop.py)."""
        targets, valid, h = self.select_targets(labels, h)
        return self.readout_cross_entropy(self.norm(h), targets, valid)

    def readout_cross_entropy(self, normed: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """() CE over `valid` of the LM head's readout of `normed` (…, D): at once, or in pieces of the vocabulary
        when the (…, V) logits would be large (every position of a big vocabulary) or more than a piece under
        --recompute (`needs_chunks`), where the export also computes each piece again in the backward instead of
        keeping its logits (zl_export/recompute.py)."""
        if needs_chunks(targets.numel(), self.vocab_size, self.recompute):
            return chunked_cross_entropy(normed, self.lm_head, targets, valid)
        return local_loss(self.lm_head(normed), None, targets, valid, 1.0, self.loss_cfg)[0]

    def loss_terms(self, h_in: torch.Tensor, h: torch.Tensor, labels: torch.Tensor):
        """(loss, task_loss, consistency_loss) of the stage from its input and output hidden states."""
        targets, valid, h_in, h = self.select_targets(labels, h_in, h)
        normed = self.readout_input(h)  # (…, D)
        if not self.has_prev_target:  # the CE alone (its weight α does not apply without a consistency term)
            task = self.readout_cross_entropy(normed, targets, valid)
            return task, task, torch.zeros((), dtype=task.dtype)
        # sg(p_{k-1}): the plain readout of the detached input.
        prev_normed = self.norm(h_in.detach())
        if self.gather_targets or self.max_targets > 0:
            # On a few target rows the LM head matmul is bound by reading the (V, D) head from memory (SmolLM2:
            # 113 MB), so both readouts share one pass (a step at α 0.5: −9% eager, −3% ExecuTorch). Not on every
            # position: there the matmul is bound by arithmetic, and the input gradient of the shared matmul would
            # also be computed for the detached rows (+10% a step).
            both = self.lm_head(torch.cat([prev_normed, normed], dim=-2))  # (…, 2n, V)
            prev_logits, logits = both.split(normed.shape[-2], dim=-2)
        else:
            prev_logits, logits = self.lm_head(prev_normed), self.lm_head(normed)
        return local_loss(logits, prev_logits.detach(), targets, valid, self.alpha, self.loss_cfg)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor):
        h_in, h = self.chunk(x, attention_mask)
        # Early forwarding point: everything after this is local to the stage.
        hidden_out = pipeline_marker(h.detach()) if not self.is_last else None  # (B, S, D)
        loss, task, consistency = self.loss_terms(h_in, h, labels)
        # The joint export differentiates `loss` only; the other outputs must not require grad.
        task, consistency = task.detach(), consistency.detach()
        if self.is_last:
            return loss, task, consistency
        return hidden_out, loss, task, consistency

    @property
    def input_names(self) -> list[str]:
        """The program's inputs, in order (docs/design#program-inputs-outputs)."""
        return ["input_ids" if self.is_first else "hidden", "attention_mask", "labels"]

    @property
    def output_names(self) -> list[str]:
        """The program's user outputs, in order (docs/design#program-inputs-outputs)."""
        return ([] if self.is_last else ["hidden"]) + ["loss", "task_loss", "consistency_loss"]

    @property
    def loss_output_index(self) -> int:
        """Position of `loss` among the user outputs (after `hidden`, if any)."""
        return 0 if self.is_last else 1


class SoftCappedHead(nn.Module):
    """The LM head followed by logit soft-capping, c·tanh(logits / c) (a Gemma config's final_logit_softcapping):
    what every readout of the stage computes, as the Hugging Face model's forward does after its head."""

    def __init__(self, head: nn.Module, cap: float):
        super().__init__()
        self.head, self.cap = head, float(cap)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (…, D) -> (…, V)
        return torch.tanh(self.head(x) / self.cap) * self.cap
