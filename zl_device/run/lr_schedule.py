"""The runner's learning-rate schedule (android_app/native/include/zl/lr_schedule.h), in Python.

For the PyTorch references that must apply exactly the runner's updates
(tests, baselines): `torch.optim.lr_scheduler.LambdaLR(opt, lambda t: lr_factor(t, schedule, windows))`.
"""

import math


def lr_factor(t: int, schedule: dict, total_steps: int) -> float:
    """Multiplier of the base lr at optimizer step t (0-based).

    constant: 1. warmup_cosine: (t+1)/W for t < W, then a cosine from 1 down to
    min_lr_ratio at step T (`total_steps`, 0 = `total_steps` argument: the number of windows).
    """
    if schedule.get("kind", "constant") == "constant":
        return 1.0
    w, r = schedule.get("warmup_steps", 0), schedule.get("min_lr_ratio", 0.0)
    total = schedule.get("total_steps", 0) or total_steps
    if t < w:
        return (t + 1) / w
    p = min(max((t - w) / max(1, total - w), 0.0), 1.0)
    return r + (1 - r) * 0.5 * (1 + math.cos(math.pi * p))
