"""The pipeline schedules' names, one list for both runtimes (docs/design#backprop-schedules).

`zl train --schedule NAME` offers these: the rows of the schedule table (schedule_table.py), which the torch
runtime runs (zl_device/torch/schedules) and the ExecuTorch runner holds again (runner/src/pipeline_schedule.cpp).
"""

from __future__ import annotations

from zl_device.formats.schedule_table import SCHEDULE_TABLE

#: zerolock: local losses; gpipe, 1f1b, async: end-to-end backprop (async: PipeDream's schedule).
SCHEDULES: tuple[str, ...] = tuple(SCHEDULE_TABLE)
#: Other names a schedule answers to: PipeDream's schedule was `pipedream` before the runner ran it as `async`.
ALIASES: dict[str, str] = {"pipedream": "async"}
#: What `zl train --schedule` accepts.
SCHEDULE_NAMES: tuple[str, ...] = (*SCHEDULES, *ALIASES)


def schedule_name(name: str) -> str:
    """The schedule's own name for `name` (an alias resolved)."""
    return ALIASES.get(name, name)


def is_backprop(name: str) -> bool:
    """An end-to-end backprop schedule: every stage trains on the final loss's gradient, sent upstream."""
    return SCHEDULE_TABLE[schedule_name(name)].backprop
