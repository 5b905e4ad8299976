"""The pipeline schedules' names, one list for both runtimes (docs/design#backprop-schedules).

`zl train --schedule NAME` offers these; the torch runtime's table (zl_device/torch/schedules) has a class for each,
the ExecuTorch runner's config takes the same names (runner/include/zl/pipeline_schedule.h).
"""

from __future__ import annotations

#: zerolock: local losses; gpipe, 1f1b, async: end-to-end backprop (async: PipeDream's schedule).
SCHEDULES: tuple[str, ...] = ("zerolock", "gpipe", "1f1b", "async")
#: Other names a schedule answers to: PipeDream's schedule was `pipedream` before the runner ran it as `async`.
ALIASES: dict[str, str] = {"pipedream": "async"}
#: What `zl train --schedule` accepts.
SCHEDULE_NAMES: tuple[str, ...] = (*SCHEDULES, *ALIASES)


def schedule_name(name: str) -> str:
    """The schedule's own name for `name` (an alias resolved)."""
    return ALIASES.get(name, name)


def is_backprop(name: str) -> bool:
    """An end-to-end backprop schedule: every stage trains on the final loss's gradient, sent upstream."""
    return schedule_name(name) != "zerolock"
