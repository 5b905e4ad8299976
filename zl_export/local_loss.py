"""The ZeroLock local loss of one stage (DESIGN.md §1).

    p_k = softmax(T_k(Norm(h_k)) · W_lmᵀ)                       T_k: readout translator (identity unless enabled)
    L_k = α_k · CE(p_k, y) + (1-α_k) · g · KL(p_k ‖ sg(p_{k-1}))   (kl_rev, the paper's Eq. 5)
                                   or g · KL(sg(p_{k-1}) ‖ p_k)     (kl_fwd)

CE and KL are averaged over the valid target positions Ω: position i is valid
when `labels[i+1] != -100` (labels are aligned with the input ids, as in
Hugging Face, so position i predicts token i+1). The last position never has
a target. `g` is 1, or with `gate="target_prob"` the previous readout's
probability of the true next token (a stage follows its predecessor only
where the predecessor is right). The previous readout `p_{k-1}` is always the
plain frozen readout (no translator: the previous stage's lives on another
device); stage 0's is the readout of the token embeddings, or nothing with
`first_target="none"` (then stage 0 trains on CE alone).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zl.errors import ZLError

IGNORE_INDEX = -100
CONSISTENCY_KINDS = ("kl_rev", "kl_fwd")
FIRST_TARGETS = ("embedding", "none")
GATES = ("none", "target_prob")
LOSS_PRESETS = ("paper",)


@dataclass(frozen=True)
class LossConfig:
    """What each stage's local loss is made of (recorded in `manifest.json` under "loss")."""

    alpha: tuple[float, ...] = (0.5,)
    """CE weight α_k in (0, 1]: one value for every stage, or one per stage (`--alpha 0.3,0.7,1.0`)."""
    consistency: str = "kl_rev"
    """KL direction: kl_rev = KL(p_k‖p_k-1) (the paper's Eq. 5) or kl_fwd = KL(p_k-1‖p_k)."""
    first_target: str = "embedding"
    """What stage 0's consistency term points at: the readout of the token embeddings (paper) or none (CE only)."""
    translator_rank: int = 0
    """Rank of a trainable readout translator (diagonal + low-rank map before the frozen LM head) on every
    non-final stage; 0 = none (the paper's plain readout)."""
    gate: str = "none"
    """Consistency weight per position: none (1) or target_prob (the previous readout's probability of the target)."""

    def __post_init__(self) -> None:
        # A single float is accepted for α (Python callers, manifests of format 1 before per-stage α).
        alpha = self.alpha
        if isinstance(alpha, (int, float)):
            object.__setattr__(self, "alpha", (float(alpha),))
        else:
            object.__setattr__(self, "alpha", tuple(float(a) for a in alpha))

    def alpha_of(self, stage: int) -> float:
        """α of stage `stage` (the single value when one is given for all stages)."""
        return self.alpha[0] if len(self.alpha) == 1 else self.alpha[stage]

    def validate(self, num_stages: int | None = None) -> None:
        """Raises ZLError naming the option, the value seen and the fix."""
        shown = ",".join(f"{a:g}" for a in self.alpha)
        if not self.alpha or not all(0.0 < a <= 1.0 for a in self.alpha):
            raise ZLError(f"--alpha {shown}: α weighs CE against KL and must lie in (0, 1] (one value, or one per "
                          "stage); the paper uses 0.5.")
        if num_stages is not None and len(self.alpha) not in (1, num_stages):
            raise ZLError(f"--alpha {shown}: {len(self.alpha)} values for {num_stages} stages; give one value for all "
                          f"stages or exactly {num_stages}.")
        if self.consistency not in CONSISTENCY_KINDS:
            raise ZLError(f"--consistency {self.consistency!r}: choose kl_rev (KL(p_k‖p_k-1), the paper's) or kl_fwd.")
        if self.first_target not in FIRST_TARGETS:
            raise ZLError(f"--first-target {self.first_target!r}: choose embedding (the paper's) or none.")
        if self.gate not in GATES:
            raise ZLError(f"--gate {self.gate!r}: choose none (the paper's) or target_prob.")
        if self.translator_rank < 0:
            raise ZLError(f"--translator-rank {self.translator_rank}: must be 0 (no translator) or a rank >= 1.")

    def to_manifest(self) -> dict:
        return {"alpha": list(self.alpha), "consistency": self.consistency, "first_target": self.first_target,
                "translator_rank": self.translator_rank, "gate": self.gate}

    @classmethod
    def from_manifest(cls, loss: dict) -> "LossConfig":
        """The config a manifest's "loss" records (older manifests: only alpha and consistency)."""
        return cls(**{k: v for k, v in loss.items() if k in cls.__dataclass_fields__})


def shift_targets(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets and validity for each position.

    Args:
        labels: (B, S) int64, aligned with the inputs.

    Returns:
        targets (B, S) int64 (ignored positions hold 0) and valid (B, S) float32,
        1.0 on Ω. The last position is never valid.
    """
    nxt = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)  # (B, S)
    valid = nxt != IGNORE_INDEX
    targets = torch.where(valid, nxt, torch.zeros_like(nxt))
    return targets, valid.to(torch.float32)


def local_loss(
    logits: torch.Tensor,
    prev_logits: torch.Tensor | None,
    targets: torch.Tensor,
    valid: torch.Tensor,
    alpha: float,
    cfg: LossConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Local loss of a stage from its readout and the previous readout, over any batch of positions.

    Args:
        logits: (..., V) readout logits of this stage's output hidden state,
            at every position (B, S, V) or at the target positions only (K, V).
        prev_logits: (..., V) readout logits of the hidden state the stage
            received (stage 0: of the token embeddings), treated as constant;
            None when the stage has no consistency target.
        targets: (...) int64 next-token targets (any value where not valid).
        valid: (...) float32, 1.0 on Ω.
        alpha: this stage's CE weight.
        cfg: KL direction and gate.

    Returns:
        (loss, task_loss, consistency_loss), scalars. With no valid position
        all three are 0 (the count is clamped to 1), never NaN.
    """
    count = valid.sum().clamp(min=1.0)
    logp = F.log_softmax(logits.float(), dim=-1)  # (..., V)
    nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (...)
    task = (nll * valid).sum() / count
    if prev_logits is None:
        consistency = torch.zeros((), dtype=task.dtype)
        return task, task, consistency
    logq = F.log_softmax(prev_logits.detach().float(), dim=-1)  # (..., V)
    if cfg.consistency == "kl_rev":  # KL(p_k ‖ p_{k-1})
        kl = (logp.exp() * (logp - logq)).sum(-1)  # (...)
    elif cfg.consistency == "kl_fwd":  # KL(p_{k-1} ‖ p_k)
        kl = (logq.exp() * (logq - logp)).sum(-1)  # (...)
    else:
        raise ValueError(f"unknown consistency {cfg.consistency!r}; expected one of {CONSISTENCY_KINDS}")
    weight = valid
    if cfg.gate == "target_prob":  # follow the previous readout only as far as it predicts the target
        weight = valid * logq.gather(-1, targets.unsqueeze(-1)).squeeze(-1).exp()
    consistency = (kl * weight).sum() / count
    loss = alpha * task + (1.0 - alpha) * consistency
    return loss, task, consistency
