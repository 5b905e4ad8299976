"""The pipeline schedules of the torch runtime, in one table (the interface: base.py `Schedule`).

A torch job's `pipeline` names the schedule its ranks run (harness.py);
`zl train --runtime torch --schedule NAME` and tools/bench_pipelines.py offer
every schedule of the schedule table (zl_device/formats/schedule_table.py).
Its backprop rows (gpipe, 1f1b, async) need nothing here: one executor runs
any row's lists (backprop_ranks.py), so a schedule that only reorders
forwards, backwards and steps is a row there (and its C++ twin's). A schedule
of another kind is one new file in this folder with a `Schedule` subclass and
one row below (docs/design#backprop-baselines shows the example).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from zl_base.errors import ZLError
from zl_device.formats.schedule_table import SCHEDULE_TABLE
from zl_device.formats.schedules import schedule_name

if TYPE_CHECKING:
    from zl_device.torch.schedules.base import Schedule

#: name -> "module:Class" in this folder, for a schedule with a class of its own: ZeroLock's local losses. Imported
#: when asked for, so `zl train --schedule`'s choices cost no torch import.
SCHEDULES: dict[str, str] = {
    "zerolock": "zerolock:ZeroLock",
}


def schedule_named(name: str) -> type[Schedule]:
    """The schedule called `name`: its class above, or for every other backprop row of the schedule table (the
    end-to-end baselines ZeroLock is measured against: gpipe, 1f1b, async) the one executor of the table's lists.

    Raises:
        ZLError: no schedule has that name.
    """
    name = schedule_name(name)
    if name in SCHEDULES:
        module, cls = SCHEDULES[name].split(":")
        return getattr(importlib.import_module(f"{__name__}.{module}"), cls)
    if name in SCHEDULE_TABLE and SCHEDULE_TABLE[name].backprop:
        from zl_device.torch.schedules.backprop_ranks import table_schedule

        return table_schedule(name)
    raise ZLError(f"torch job pipeline {name!r}: expected one of {', '.join(SCHEDULE_TABLE)}.")
