"""The ZeroLock local loss of one stage (DESIGN.md §1).

    p_k = softmax(Norm(h_k) · W_lmᵀ)
    L_k = α · CE(p_k, y) + (1-α) · KL(p_k ‖ sg(p_{k-1}))        (kl_rev, the paper's Eq. 5)
                              or KL(sg(p_{k-1}) ‖ p_k)          (kl_fwd)

CE and KL are averaged over the valid target positions Ω: position i is valid
when `labels[i+1] != -100` (labels are aligned with the input ids, as in
Hugging Face, so position i predicts token i+1). The last position never has
a target.
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
    logits: torch.Tensor, prev_logits: torch.Tensor, labels: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Local loss of a stage from its readout and the previous readout.

    Args:
        logits: (B, S, V) readout logits of this stage's output hidden state.
        prev_logits: (B, S, V) readout logits of the hidden state the stage
            received (stage 0: of the token embeddings); treated as constant.
        labels: (B, S) int64, -100 where ignored.
        cfg: α and the KL direction.

    Returns:
        (loss, task_loss, consistency_loss), scalars. With no valid position
        all three are 0 (the count is clamped to 1), never NaN.
    """
    targets, valid = shift_targets(labels)  # (B, S), (B, S)
    count = valid.sum().clamp(min=1.0)
    logp = F.log_softmax(logits.float(), dim=-1)  # (B, S, V)
    logq = F.log_softmax(prev_logits.detach().float(), dim=-1)  # (B, S, V)
    nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, S)
    task = (nll * valid).sum() / count
    if cfg.consistency == "kl_rev":  # KL(p_k ‖ p_{k-1})
        kl = (logp.exp() * (logp - logq)).sum(-1)  # (B, S)
    elif cfg.consistency == "kl_fwd":  # KL(p_{k-1} ‖ p_k)
        kl = (logq.exp() * (logq - logp)).sum(-1)  # (B, S)
    else:
        raise ValueError(f"unknown consistency {cfg.consistency!r}; expected one of {CONSISTENCY_KINDS}")
    consistency = (kl * valid).sum() / count
    loss = cfg.alpha * task + (1.0 - cfg.alpha) * consistency
    return loss, task, consistency
