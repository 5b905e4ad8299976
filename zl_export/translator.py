"""The readout translator: a small trainable map in front of a non-final stage's frozen LM head.

The frozen final norm + LM head were trained to read the *last* layer's
hidden state. Read off layer 10 of 30 they see features in another basis, so
an early stage's CE gradient (and the KL towards it downstream) asks the stage
to bend its hidden state towards the last layer's space, distorting what the
next stage receives. A translator (as tuned-lens readouts and InfoPro's local
heads do) lets the readout adapt to the stage instead:

    T(u) = u ⊙ (1 + d) + (u · Aᵀ) · Bᵀ        u = Norm(h) (…, D), d (D,), A (r, D), B (D, r)

With `translator_init="identity"`, d and B start at zero, so T starts as the
identity and the stage's first loss equals the paper's; A is seeded like
LoRA's `lora_A` (Kaiming-uniform). With `translator_init="lens"` T starts as
a *tuned lens*: the least-squares map from the normed hidden state at the
end of the stage to the normed hidden state at the end of the model, fitted
at export time on calibration rows through the frozen base model (the host
holds the whole model; nothing crosses devices at run time), kept to rank r
around the identity (d = 0, A·B from the SVD of W − I). On SmolLM2-135M the
plain readout of layer 10 has a cross-entropy of ~46 nats on AG News label
tokens, a lens fitted on 48 AG News rows ~11 (the last layer: ~10.5).
The translator trains with the stage's LoRA weights, lives in its
checkpoints, and is kept out of the merged PEFT adapter: the fine-tuned model
does not use it; it is an early-exit head of that stage.
"""

import math

import torch
from torch import nn

# Manifest name prefix: `zl.translator.stage_<k>.<param>`; not a PEFT name, so merge knows to skip it.
NAME_PREFIX = "zl.translator"


class ReadoutTranslator(nn.Module):
    """Diagonal + rank-r map on the normed hidden state; the identity at initialisation."""

    def __init__(self, hidden: int, rank: int, seed: int):
        """
        Args:
            hidden: D, the model's hidden size.
            rank: r >= 1.
            seed: seeds A (with the stage index folded in by the caller).
        """
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        bound = 1.0 / math.sqrt(hidden)  # kaiming_uniform_(a=sqrt(5)) on a (r, D) weight, as nn.Linear and LoRA's A
        self.scale = nn.Parameter(torch.zeros(hidden))  # d (D,)
        self.down = nn.Parameter((torch.rand(rank, hidden, generator=gen) * 2 - 1) * bound)  # A (r, D)
        self.up = nn.Parameter(torch.zeros(hidden, rank))  # B (D, r)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        """(…, D) normed hidden state -> (…, D)."""
        return u * (1.0 + self.scale) + (u @ self.down.t()) @ self.up.t()

    @torch.no_grad()
    def start_from(self, lens: torch.Tensor) -> None:
        """Start as the rank-r approximation of `lens` (D, D; u -> u @ lens) around the identity."""
        rank = self.down.shape[0]
        u, s, vh = torch.linalg.svd(lens.double() - torch.eye(lens.shape[0], dtype=torch.float64))
        self.scale.zero_()
        self.down.copy_((u[:, :rank] * s[:rank]).t())  # A (r, D): u @ Aᵀ = coordinates in the top singular basis
        self.up.copy_(vh[:rank].t())  # B (D, r)


CALIBRATION_ROWS = 64


def calibration_batches(shard, rows: int = CALIBRATION_ROWS, batch: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first `rows` rows of a shard as (input_ids, attention_mask) batches, each cut to its longest row."""
    out = []
    for start in range(0, min(rows, shard.rows), batch):
        mask = shard.attention_mask[start:start + batch]
        length = int(mask.sum(1).max())
        out.append((shard.input_ids[start:start + batch, :length], mask[:, :length]))
    return out


@torch.no_grad()
def fit_lenses(modules: list, batches: list[tuple[torch.Tensor, torch.Tensor]], ridge: float = 1e-3) -> dict[int, torch.Tensor]:
    """Least-squares maps W_k (D, D) with Norm(h_k) @ W_k ≈ Norm(h_last), over every real token of `batches`.

    Args:
        modules: the `StageModule`s of the split, in order (their frozen weights; LoRA B is zero at this point).
        batches: (input_ids (B, S) int64, attention_mask (B, S) int64) calibration rows.
        ridge: Tikhonov term, relative to the mean diagonal of XᵀX (keeps the solve stable with few tokens).

    Returns:
        {stage index: W} for every stage but the last.
    """
    xs: dict[int, list[torch.Tensor]] = {m.stage.index: [] for m in modules}
    for ids, mask in batches:
        x = ids
        for m in modules:
            _, x = m.chunk(x, mask)
            xs[m.stage.index].append(m.norm(x)[mask.bool()].double())  # (tokens, D)
    target = torch.cat(xs[modules[-1].stage.index])  # (N, D)
    lenses = {}
    for m in modules[:-1]:
        x = torch.cat(xs[m.stage.index])  # (N, D)
        gram = x.t() @ x
        gram += ridge * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=gram.dtype)
        lenses[m.stage.index] = torch.linalg.solve(gram, x.t() @ target).float()  # (D, D)
    return lenses


def translator_name(stage: int, param: str) -> str:
    """Manifest/checkpoint name of translator parameter `param` ("scale", "down", "up") of stage `stage`."""
    return f"{NAME_PREFIX}.stage_{stage}.{param}"


def is_translator_name(name: str) -> bool:
    return name.startswith(NAME_PREFIX + ".")
