"""`zl train`'s device policies: pause a device that is too hot, too flat or off its charger
(docs/design#device-policies).

The coordinator reads every stage's device every `read_every_s` seconds
(zl_device/devices/readings.py) and asks this policy two questions:

- `breach(readings)`: is a limit crossed? Then the device's stage finishes the
  window it is in, checkpoints, and is paused (the coordinator's pause).
- `holds(readings)`: may a paused device train again? Only once every
  limit is back in range *with a margin* (hysteresis), so a device hovering at
  its limit does not pause and resume every window.

    --max-temperature C   pauses at a temperature ≥ C or Android's thermal status SEVERE or worse;
                          resumes at ≤ C − 3 °C and thermal status LIGHT or better
    --min-battery PCT     pauses below PCT %; resumes at PCT + 5 %
    --require-charging    pauses off external power; resumes back on it

A reading the device did not give neither pauses nor resumes it: a paused
device waits until it can be seen to be in range. `zl train` checks before the
deploy that every device gives each reading its policy needs (`check_devices`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from zl_base.errors import ZLError
from zl_base.settings import check_fields, flag, setting
from zl_device.devices.readings import DeviceReadings, read_device, thermal_status_name

#: --max-temperature's range in °C: below 30 a phone at room temperature might never resume; no sensor of a device
#: that still runs reads above 110 (CPU packages throttle near 100).
MAX_TEMPERATURE_RANGE_C = (30.0, 110.0)
#: --min-battery's range in %: resuming needs PCT + RESUME_ABOVE_PCT, at most a full battery.
MIN_BATTERY_RANGE_PCT = (1, 95)
#: Hysteresis: a hot device resumes this far below --max-temperature ...
RESUME_BELOW_C = 3.0
#: ... a flat one this far above --min-battery.
RESUME_ABOVE_PCT = 5
#: Android's thermal status at which the OS throttles hard (PowerManager.THERMAL_STATUS_SEVERE): hot whatever the
#: battery sensor says; a device paused for it resumes at THERMAL_STATUS_LIGHT or below.
HOT_THERMAL_STATUS, COOL_THERMAL_STATUS = 3, 1


def _check_temperature(value: float | None, name: str) -> None:
    low, high = MAX_TEMPERATURE_RANGE_C
    if value is not None and not low <= value <= high:
        raise ZLError(f"{name} {value:g}: expected a temperature between {low:g} and {high:g} °C (a phone's battery "
                      f"runs at 25-45 °C, a CPU at 40-95 °C), e.g. {name} 45.")


def _check_battery(value: int | None, name: str) -> None:
    low, high = MIN_BATTERY_RANGE_PCT
    if value is not None and not low <= value <= high:
        raise ZLError(f"{name} {value}: expected a battery level between {low} and {high} % (a paused device "
                      f"resumes {RESUME_ABOVE_PCT} points above it), e.g. {name} 20.")


@dataclass(frozen=True)
class DevicePolicy:
    """When a device may train; off unless one of the three options is given."""

    max_temperature_c: float | None = setting(
        None, f"Pause a device whose temperature (battery on a phone, CPU on Linux) reaches C °C, or whose Android "
              f"thermal status is SEVERE, after its current window; it resumes {RESUME_BELOW_C:g} °C below.",
        flag="--max-temperature", check=_check_temperature)
    min_battery_pct: int | None = setting(
        None, f"Pause a device whose battery falls below PCT % after its current window; it resumes at PCT + "
              f"{RESUME_ABOVE_PCT}.", flag="--min-battery", check=_check_battery)
    require_charging: bool = setting(
        False, "Pause a device that is off external power after its current window, until it is plugged in again "
               "(a phone on USB is always on power).", flag="--require-charging")
    # Not on the command line: tests and experiments set them.
    readings_override: Path | None = setting(
        None, "A folder of <device name>.json files whose values replace that device's readings "
              "(zl_device/devices/readings.py).", cli=False)
    read_every_s: float = setting(2.0, "Seconds between two readings of a device.", cli=False)

    @property
    def active(self) -> bool:
        return self.max_temperature_c is not None or self.min_battery_pct is not None or self.require_charging

    def validate(self) -> None:
        check_fields(self)
        if self.read_every_s <= 0:
            raise ZLError(f"read_every_s {self.read_every_s:g}: must be a positive number of seconds.")

    def read(self, device) -> DeviceReadings:
        """The device's readings, with its override file when there is a folder of them.

        Raises:
            ZLError: the device cannot be reached, or its override file is malformed.
        """
        override = self.readings_override / f"{device.name}.json" if self.readings_override else None
        return read_device(device, override)

    # --- the two questions --------------------------------------------------------------------------------------

    def breach(self, r: DeviceReadings) -> tuple[str, str] | None:
        """(kind, reason) of the first limit `r` crosses, kind one of temperature, thermal_status, battery,
        charging; None when none is crossed (or not measured)."""
        limit = self.max_temperature_c
        if limit is not None and r.temperature_c is not None and r.temperature_c >= limit:
            return "temperature", f"{r.temperature_c:.1f} °C ≥ {limit:g} °C ({_flag('max_temperature_c')})"
        if limit is not None and r.thermal_status is not None and r.thermal_status >= HOT_THERMAL_STATUS:
            return "thermal_status", (f"thermal status {thermal_status_name(r.thermal_status)} "
                                      f"({_flag('max_temperature_c')})")
        floor = self.min_battery_pct
        if floor is not None and r.battery_pct is not None and r.battery_pct < floor:
            return "battery", f"battery {r.battery_pct:.0f}% < {floor}% ({_flag('min_battery_pct')})"
        if self.require_charging and r.charging is False:
            return "charging", f"off external power ({_flag('require_charging')})"
        return None

    def holds(self, r: DeviceReadings) -> str | None:
        """Why a paused device may not train yet (the hysteresis margins of the module docstring); None when it
        may."""
        limit = self.max_temperature_c
        if limit is not None:
            if r.temperature_c is None:
                return "no temperature reading"
            if r.temperature_c > limit - RESUME_BELOW_C:
                return f"{r.temperature_c:.1f} °C, resumes at {limit - RESUME_BELOW_C:g} °C"
            if r.thermal_status is not None and r.thermal_status > COOL_THERMAL_STATUS:
                return (f"thermal status {thermal_status_name(r.thermal_status)}, resumes at "
                        f"{thermal_status_name(COOL_THERMAL_STATUS)}")
        floor = self.min_battery_pct
        if floor is not None:
            if r.battery_pct is None:
                return "no battery reading"
            if r.battery_pct < floor + RESUME_ABOVE_PCT:
                return f"battery {r.battery_pct:.0f}%, resumes at {floor + RESUME_ABOVE_PCT}%"
        if self.require_charging and r.charging is not True:
            return "off external power" if r.charging is False else "no power reading"
        return None

    def missing(self, r: DeviceReadings) -> list[tuple[str, str]]:
        """The readings this policy needs that `r` lacks, as (option, reading), e.g. ("--min-battery", "battery
        level")."""
        out = []
        if self.max_temperature_c is not None and r.temperature_c is None and r.thermal_status is None:
            out.append((_flag("max_temperature_c"), "temperature"))
        if self.min_battery_pct is not None and r.battery_pct is None:
            out.append((_flag("min_battery_pct"), "battery level"))
        if self.require_charging and r.charging is None:
            out.append((_flag("require_charging"), "power supply"))
        return out

    def check_devices(self, devices: Sequence, read: Callable[[object], DeviceReadings] | None = None) -> None:
        """Read every device once: each must give the readings the policy needs (before anything is deployed).

        Raises:
            ZLError: naming the first device that lacks one, the option that needs it and the fix.
        """
        if not self.active:
            return
        read = read or self.read
        for device in devices:
            lacking = self.missing(read(device))
            if lacking:
                option, what = lacking[0]
                raise ZLError(f"{option}: {device.name} reports no {what}, so the policy could never pause or "
                              f"resume it; drop {option}, or use devices that report it.")


def _flag(name: str) -> str:
    return flag(DevicePolicy, name)
