"""The readout translator: a small trainable map in front of a non-final stage's frozen LM head.

The frozen final norm + LM head were trained to read the *last* layer's
hidden state. Read off layer 10 of 30 they see features in another basis, so
an early stage's CE gradient (and the KL towards it downstream) asks the stage
to bend its hidden state towards the last layer's space, distorting what the
next stage receives. A translator (as tuned-lens readouts and InfoPro's local
heads do) lets the readout adapt to the stage instead:

    T(u) = u ⊙ (1 + d) + (u · Aᵀ) · Bᵀ        u = Norm(h) (…, D), d (D,), A (r, D), B (D, r)

d and B start at zero, so T starts as the identity and the stage's first
loss equals the paper's. A is seeded like LoRA's `lora_A` (Kaiming-uniform).
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


def translator_name(stage: int, param: str) -> str:
    """Manifest/checkpoint name of translator parameter `param` ("scale", "down", "up") of stage `stage`."""
    return f"{NAME_PREFIX}.stage_{stage}.{param}"


def is_translator_name(name: str) -> bool:
    return name.startswith(NAME_PREFIX + ".")
