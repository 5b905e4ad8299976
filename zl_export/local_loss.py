"""The ZeroLock local loss of one stage (docs/design#product).

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

import torch
import torch.nn.functional as F

from zl_export.options import CONSISTENCY_KINDS, LossConfig

IGNORE_INDEX = -100


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
