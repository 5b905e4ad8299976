"""The pipeline schedules of the torch runtime, in one table (the interface: base.py `Schedule`).

A torch job's `pipeline` names the schedule its ranks run (harness.py);
`zl train --runtime torch --schedule NAME` and tools/bench_pipelines.py offer
every name here. Adding a schedule is one new file in this folder with a
`Schedule` subclass and one row below (docs/design#backprop-baselines shows the example).
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
    "gpipe": "gpipe:GPipe",
    "1f1b": "gpipe:OneFOneB",
    "async": "pipedream:PipeDream",
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
