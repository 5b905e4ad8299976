"""What a device says about its heat and power: the inputs of `zl train`'s device policies
(docs/design#device-policies).

One reading (`DeviceReadings`) holds a temperature, the battery level, whether
the device is on external power and Android's thermal status. Where each
comes from:

- local (`local:N`, a process on this host): sysfs, the first CPU thermal
  zone (as the runner's telemetry picks it), the `Battery` power supply's
  `capacity`, and "on power" when a mains/USB supply is `online` or the
  battery is `Charging`/`Full` (`linux_readings`);
- a phone in `--mode binary`: one `adb shell` running `dumpsys battery`
  (level/scale, `AC/USB/Wireless/Dock powered`, temperature in tenths of °C)
  and `dumpsys thermalservice`'s `Thermal Status` (`adb_readings`);
- a phone in `--mode app`: the app's `device_state.json` (BatteryManager and
  `PowerManager.getThermalStatus()`, written once a second by
  `RunnerService` while a stage runs) when it is at most
  `APP_READINGS_MAX_AGE_S` old on the phone's own clock; else as in binary
  mode, since the service is gone while its stage is paused (`app_readings`).

Every reader takes an override: a JSON object file (`{"temperature_c": 61,
"battery_pct": 80, "charging": true, "thermal_status": 0}`, any subset) whose
values replace the device's own, so tests and experiments can make one device
hot or flat while the others read their sensors. A value that was not
measured is None, never made up; a phone on USB is always "on power" (the
cable charges it).
"""

from __future__ import annotations

import json
import math
import re
import shlex
from dataclasses import dataclass, fields, replace
from pathlib import Path

from zl_base.errors import ZLError
from zl_device.devices.local import thermal_zone_celsius

#: The file `RunnerService` keeps its readings in, in the app's files folder (the device's workdir).
APP_READINGS_FILE = "device_state.json"
#: The app rewrites its file every second while a stage runs; older than this, the service is gone (the stage
#: ended or was paused) and the reading comes from dumpsys instead.
APP_READINGS_MAX_AGE_S = 10.0
#: Android's PowerManager.THERMAL_STATUS_* names, by value (API 29).
THERMAL_STATUS_NAMES = ("NONE", "LIGHT", "MODERATE", "SEVERE", "CRITICAL", "EMERGENCY", "SHUTDOWN")


@dataclass(frozen=True)
class DeviceReadings:
    """One reading of a device; None where it has no such sensor or the value was not readable."""

    temperature_c: float | None = None  # battery on a phone, the CPU thermal zone on Linux
    battery_pct: float | None = None  # 0-100
    charging: bool | None = None  # on external power (charger, USB, dock, wireless)
    thermal_status: int | None = None  # Android's PowerManager thermal status, 0 (NONE) - 6 (SHUTDOWN)
    source: str = ""  # sysfs | dumpsys | app, "+override" when an override file replaced values

    def summary(self) -> str:
        """"41.5 °C, battery 80%, on power, thermal NONE" (what was measured)."""
        parts = []
        if self.temperature_c is not None:
            parts.append(f"{self.temperature_c:.1f} °C")
        if self.battery_pct is not None:
            parts.append(f"battery {self.battery_pct:.0f}%")
        if self.charging is not None:
            parts.append("on power" if self.charging else "on battery")
        if self.thermal_status is not None:
            parts.append(f"thermal {thermal_status_name(self.thermal_status)}")
        return ", ".join(parts) or "nothing measured"

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def thermal_status_name(status: int) -> str:
    return THERMAL_STATUS_NAMES[status] if 0 <= status < len(THERMAL_STATUS_NAMES) else str(status)


# --- overrides ---------------------------------------------------------------------------------------------------

_OVERRIDE_KEYS = {"temperature_c": (-40.0, 150.0), "battery_pct": (0.0, 100.0), "thermal_status": (0, 6)}


def read_override(path: Path | None) -> dict:
    """The values an override file sets (an empty dict when there is no file, or it is empty: a writer that
    truncated it and has not written yet).

    Raises:
        ZLError: the file is not a JSON object of the known keys with values in range.
    """
    if path is None:
        return {}
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise ZLError(f"readings override {path}: cannot read it ({e.strerror}).") from None
    if not text.strip():
        return {}
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ZLError(f"readings override {path}: not JSON ({e}); write an object such as "
                      '{"temperature_c": 61, "battery_pct": 80, "charging": true}.') from None
    if not isinstance(data, dict):
        raise ZLError(f"readings override {path}: expected a JSON object, got {type(data).__name__}.")
    known = {*_OVERRIDE_KEYS, "charging"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ZLError(f"readings override {path}: unknown key(s) {', '.join(unknown)}; the keys are "
                      f"{', '.join(sorted(known))}.")
    for key, value in data.items():
        if value is None:
            continue
        if key == "charging":
            ok = isinstance(value, bool)
        else:
            low, high = _OVERRIDE_KEYS[key]
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                  and low <= value <= high and (key != "thermal_status" or isinstance(value, int)))
        if not ok:
            want = "true or false" if key == "charging" else "a number in [{}, {}]".format(*_OVERRIDE_KEYS[key])
            raise ZLError(f"readings override {path}: {key} {value!r}: expected {want} (or null).")
    return data


def with_override(readings: DeviceReadings, path: Path | None) -> DeviceReadings:
    """`readings` with the values of the override file at `path` in place of the device's own."""
    values = read_override(path)
    if not values:
        return readings
    return replace(readings, **values, source=f"{readings.source}+override" if readings.source else "override")


# --- Linux (local devices) ----------------------------------------------------------------------------------------

def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def power_supply_readings(root: Path = Path("/sys/class/power_supply")) -> tuple[float | None, bool | None]:
    """(battery %, on power) from a power_supply sysfs folder; None for what it does not tell.

    The battery is the first supply of type `Battery` whose scope is not `Device` (a mouse's or a stylus's
    battery is not the machine's). On power: any `Mains`, `USB`, `Wireless` ... supply `online`, or the
    battery `Charging` / `Full`; off power when there are supplies and none says so. A machine with no power
    supply listed (most desktops, containers) tells neither.
    """
    if not root.is_dir():
        return None, None
    battery_pct, battery_status, online, found = None, None, False, False
    for supply in sorted(root.iterdir()):
        kind = (_read(supply / "type") or "").lower()
        if not kind:
            continue
        found = True
        if kind == "battery":
            if (_read(supply / "scope") or "").lower() == "device" or battery_pct is not None:
                continue
            capacity = _read(supply / "capacity")
            if capacity is not None and capacity.lstrip("-").isdigit() and 0 <= int(capacity) <= 100:
                battery_pct = float(capacity)
                battery_status = (_read(supply / "status") or "").lower()
        elif _read(supply / "online") == "1":
            online = True
    if not found:
        return None, None
    return battery_pct, online or battery_status in ("charging", "full")


def linux_readings(root: Path = Path("/"), override: Path | None = None) -> DeviceReadings:
    """This host's readings from sysfs under `root` (a fake tree in tests), then `override`."""
    battery, charging = power_supply_readings(root / "sys/class/power_supply")
    readings = DeviceReadings(temperature_c=thermal_zone_celsius(root / "sys/class/thermal"), battery_pct=battery,
                              charging=charging, source="sysfs")
    return with_override(readings, override)


# --- Android --------------------------------------------------------------------------------------------------------

def parse_dumpsys_battery(text: str) -> DeviceReadings:
    """`dumpsys battery`: level / scale in %, any `... powered: true` as on power, temperature (tenths of °C).

    A value `dumpsys battery set ...` forced is read as such (how to try the policies on a phone by hand)."""
    def field(name: str) -> str | None:
        m = re.search(rf"^[ \t]*{name}:[ \t]*(\S+)[ \t\r]*$", text, re.MULTILINE)
        return m.group(1) if m else None

    level, scale, tenths = field("level"), field("scale"), field("temperature")
    battery = None
    if level is not None and level.lstrip("-").isdigit():
        top = int(scale) if scale is not None and scale.isdigit() and int(scale) > 0 else 100
        battery = 100.0 * int(level) / top if 0 <= int(level) <= top else None
    powered = re.findall(r"^[ \t]*\w+ powered:[ \t]*(true|false)[ \t\r]*$", text, re.MULTILINE)
    celsius = int(tenths) / 10.0 if tenths is not None and tenths.lstrip("-").isdigit() else None
    return DeviceReadings(temperature_c=celsius if celsius is not None and -40.0 < celsius < 150.0 else None,
                          battery_pct=battery, charging=("true" in powered) if powered else None, source="dumpsys")


def parse_thermal_status(text: str) -> int | None:
    """`Thermal Status: N` of `dumpsys thermalservice` (Android 10+); None when absent."""
    m = re.search(r"^[ \t]*Thermal Status:[ \t]*(\d+)[ \t\r]*$", text, re.MULTILINE)
    return int(m.group(1)) if m and int(m.group(1)) < len(THERMAL_STATUS_NAMES) else None


#: One round trip for everything binary mode reads; `grep` keeps thermalservice's long sensor list off the wire.
_ADB_READINGS = "dumpsys battery; dumpsys thermalservice 2>/dev/null | grep 'Thermal Status'"


def adb_readings(device, override: Path | None = None) -> DeviceReadings:
    """A phone's readings over `adb shell` (`device` is an AdbDevice), then `override`.

    Raises:
        ZLError: adb failed (the phone went away).
    """
    out = device.shell(_ADB_READINGS, "read the battery and thermal status")
    return with_override(replace(parse_dumpsys_battery(out), thermal_status=parse_thermal_status(out)), override)


def parse_app_readings(uptime: str, text: str, max_age_s: float = APP_READINGS_MAX_AGE_S) -> DeviceReadings | None:
    """The app's `device_state.json` when it is fresh: its `elapsed_realtime_ms` (SystemClock.elapsedRealtime(),
    time since boot) at most `max_age_s` behind the phone's `/proc/uptime` read in the same shell. None when it
    is missing, garbled or stale."""
    try:
        now_ms = float(uptime.split()[0]) * 1000.0
        data = json.loads(text)
        age_s = (now_ms - float(data["elapsed_realtime_ms"])) / 1000.0
    except (ValueError, IndexError, KeyError, TypeError):
        return None
    if not (isinstance(data, dict) and -1.0 <= age_s <= max_age_s):
        return None

    def number(key: str) -> float | None:
        value = data.get(key)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    status = data.get("thermal_status")
    charging = data.get("charging")
    return DeviceReadings(temperature_c=number("temperature_c"), battery_pct=number("battery_pct"),
                          charging=charging if isinstance(charging, bool) else None,
                          thermal_status=status if isinstance(status, int) and not isinstance(status, bool)
                          and 0 <= status < len(THERMAL_STATUS_NAMES) else None, source="app")


def app_readings(device, override: Path | None = None) -> DeviceReadings:
    """A phone in `--mode app`: the app's own readings while its service runs, dumpsys otherwise, then `override`.

    Raises:
        ZLError: adb failed.
    """
    path = device.path(APP_READINGS_FILE)
    out = device.shell(f"cat /proc/uptime; echo '---'; cat {shlex.quote(path)} 2>/dev/null",
                       "read the app's device state")
    uptime, _, text = out.partition("---")
    readings = parse_app_readings(uptime.strip(), text.strip())
    return with_override(readings, override) if readings is not None else adb_readings(device, override)


def read_device(device, override: Path | None = None) -> DeviceReadings:
    """The readings of any `Device`: its backend decides where they come from (module docstring).

    Raises:
        ZLError: the device cannot be reached, or the override file is malformed.
    """
    if device.kind == "local":
        return linux_readings(override=override)
    if device.kind == "adb":
        return adb_readings(device, override) if device.runs_runner_binary else app_readings(device, override)
    raise ZLError(f"{device.name}: {device.kind} devices report no temperature or battery readings; drop "
                  "--max-temperature, --min-battery and --require-charging for them.")
