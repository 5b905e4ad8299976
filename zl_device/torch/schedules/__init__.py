"""The pipeline schedules of the torch runtime, in one table (the interface: base.py `Schedule`).

A torch job's `pipeline` names the schedule its ranks run (harness.py);
`zl train --runtime torch --schedule NAME` and tools/bench_pipelines.py offer
every name here. The three backprop schedules are rows of the schedule table
(zl_device/formats/schedule_table.py) that one executor runs (backprop_ranks.py):
one that only reorders forwards, backwards and steps is a row there, a
one-line subclass and a row below. A schedule of another kind is one new file
in this folder with a `Schedule` subclass and one row below
(docs/design#backprop-baselines shows the example).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from zl_base.errors import ZLError
from zl_device.formats.schedules import schedule_name

if TYPE_CHECKING:
    from zl_device.torch.schedules.base import Schedule

#: name -> "module:Class" in this folder: ZeroLock (local losses) and the end-to-end backprop baselines it is
#: measured against. Imported when a schedule is asked for, so `zl train --schedule`'s choices cost no torch import.
SCHEDULES: dict[str, str] = {
    "zerolock": "zerolock:ZeroLock",
    "gpipe": "backprop_ranks:GPipe",
    "1f1b": "backprop_ranks:OneFOneB",
    "async": "backprop_ranks:PipeDream",
}


def schedule_named(name: str) -> type[Schedule]:
    """The schedule called `name`.

    Raises:
        ZLError: no schedule has that name.
    """
    name = schedule_name(name)
    if name not in SCHEDULES:
        raise ZLError(f"torch job pipeline {name!r}: expected one of {', '.join(SCHEDULES)}.")
    module, cls = SCHEDULES[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)
