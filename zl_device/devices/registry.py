"""`--devices`: `local:3` (three local devices) or `SERIAL1,SERIAL2,...` (phones over adb), and `--mode`.

    open_devices("local:3", run_dir=Path("runs/demo"))   # runs/demo/devices/local-0 .. local-2
    open_devices("R58M123,R58M456")                      # two phones, checked online and arm64-v8a
    open_devices("R58M123,R58M456", mode="app")          # the same phones, stages run in the app
    open_devices("local:3", run_dir=..., cpu_quota=(1.0, 0.5, 0.75))   # three unequal "phones" on this host
    open_devices("local:3", run_dir=..., runner_binary=PHONE_RUNNER, runner_prefix="qemu-aarch64")  # the phone build

`--mode binary` (the default) runs a phone's stage as `zl_runner` in /data/local/tmp/zerolock;
`--mode app` in the app com.zerolock.zl (zl_device/devices/app.py). Local devices run the host build, or
`--runner PATH` under `--runner-prefix CMD` (the static phone build under qemu-aarch64); phones in binary mode
get `--runner PATH` instead of their default build (deploy.android_runner_binary).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from zl_base.errors import ZLError
from zl_device.devices.backend import Device

LOCAL = "local"
#: Most local devices `local:N` opens: each is a runner process and a working folder on this host, and a pipeline
#: needs one per stage (at most one stage per layer; the built-in models have 4 to 30 layers) plus its spares.
MAX_LOCAL_DEVICES = 64
LINK_PROFILES = ("local", "wifi", "mobile", "constrained")
RUNNER_HELP = ("The zl_runner binary the devices run: local devices' (default: this host's build), or phones' in "
               "--mode binary (default: tools/build_phone_runner.sh's static arm64 build). E.g. the phone build "
               "build-phone/zl/runner/zl_runner on local devices, with --runner-prefix qemu-aarch64.")
RUNNER_PREFIX_HELP = ("Local devices: the command their runner is started under, e.g. qemu-aarch64 to run an arm64 "
                      "--runner on this host (quoted when it has arguments).")
#: How a phone runs its stage: the zl_runner binary over `adb shell`, or the app's foreground service.
MODES = ("binary", "app")
MODE_HELP = ("How phones run their stage: `binary` (zl_runner started over adb in /data/local/tmp/zerolock) or `app` "
             "(the com.zerolock.zl app's foreground service, files in /sdcard/Android/data/com.zerolock.zl/files; "
             "`zl deploy --mode app` installs the APK: $ZL_ANDROID_APK, else the debug build of tools/build_android.sh). "
             "Phones only.")


@dataclass(frozen=True)
class DevicesSpec:
    """A parsed --devices value: `count` local devices, or the listed phone serials."""

    kind: str  # "local" | "adb"
    count: int
    serials: tuple[str, ...] = ()


def parse_devices(spec: str) -> DevicesSpec:
    """Parse `local`, `local:N` or a comma-separated list of adb serials.

    Raises:
        ZLError: empty, a bad count, or a serial listed twice.
    """
    text = spec.strip()
    if not text:
        raise ZLError("--devices is empty; pass local:N (e.g. local:3) or phone serials (see `zl devices`).")
    if text == LOCAL or text.startswith(LOCAL + ":"):
        count = text[len(LOCAL) + 1:] if text != LOCAL else "1"
        if not count.isdigit() or int(count) < 1:
            raise ZLError(f"--devices {spec}: expected local:N with N >= 1 local devices, e.g. local:3.")
        if int(count) > MAX_LOCAL_DEVICES:
            raise ZLError(f"--devices {spec}: at most {MAX_LOCAL_DEVICES} local devices (each is a runner process "
                          "and a folder on this host; a pipeline needs one per stage plus --spares); pass local:N "
                          f"with N up to {MAX_LOCAL_DEVICES}, e.g. local:3.")
        return DevicesSpec(LOCAL, int(count))
    serials = [s.strip() for s in text.split(",")]
    if any(not s for s in serials):
        raise ZLError(f"--devices {spec}: an empty serial; write SERIAL1,SERIAL2 without spaces or trailing commas.")
    bad = [s for s in serials if not re.fullmatch(r"[\w.:\-]+", s)]
    if bad:
        raise ZLError(f"--devices {spec}: {bad[0]!r} does not look like an adb serial (see `zl devices`).")
    dupes = sorted({s for s in serials if serials.count(s) > 1})
    if dupes:
        raise ZLError(f"--devices {spec}: {', '.join(dupes)} listed more than once; each phone runs one stage.")
    return DevicesSpec("adb", len(serials), tuple(serials))


def check_devices(spec: str, flag: str = "--devices") -> None:
    """`--devices`' check (zl_base/settings.py): raises ZLError when `spec` does not parse (see `parse_devices`)."""
    parse_devices(spec)


def check_cpu_quota_fits(spec: DevicesSpec, quotas, flag: str = "--cpu-quota") -> list[float | None]:
    """The quota of each device of `spec`: local devices only, one value for all or one each.

    Raises:
        ZLError: quotas for phones, a value out of range, or another count than the devices'.
    """
    from zl_device.devices.cpu_quota import quotas_per_device

    if quotas is not None and spec.kind != LOCAL:
        raise ZLError(f"{flag}: phones run at their own speed; CPU quotas emulate unequal phones with local devices "
                      f"(--devices local:N). Drop {flag}.")
    return quotas_per_device(quotas, spec.count, flag)


def check_mode(spec: DevicesSpec, mode: str) -> None:
    """`mode` is one of MODES and fits the devices.

    Raises:
        ZLError: an unknown mode, or `app` with local devices.
    """
    if mode not in MODES:
        raise ZLError(f"--mode {mode!r}: expected one of {', '.join(MODES)} (binary: zl_runner over adb; app: the "
                      "com.zerolock.zl app).")
    if mode == "app" and spec.kind == LOCAL:
        raise ZLError(f"--mode app needs phones; local devices run the host binary (--devices local:{spec.count}). "
                      "Pass phone serials (see `zl devices`) or drop --mode app.")


def check_runner(spec: DevicesSpec, mode: str, runner_binary: Path | None, runner_prefix: str | None):
    """--runner and --runner-prefix against the devices: local devices take both (`local_runner_command`),
    phones in --mode binary an AArch64 --runner only.

    Returns:
        (the runner binary, resolved, or None for the default; the prefix's words).

    Raises:
        ZLError: a prefix for phones, a runner for the app, or a runner or prefix that cannot run.
    """
    if spec.kind == LOCAL:
        from zl_device.devices.local import local_runner_command

        return local_runner_command(runner_binary, runner_prefix)
    if runner_prefix is not None:
        raise ZLError(f"--runner-prefix {runner_prefix!r}: phones start their runner themselves; the prefix is for "
                      "local devices (--devices local:N). Drop it.")
    if runner_binary is None:
        return None, ()
    if mode == "app":
        raise ZLError(f"--runner {runner_binary}: phones in --mode app run the app's runtime; drop --runner or use "
                      "--mode binary.")
    from zl_device.devices.deploy import check_phone_runner

    binary = Path(runner_binary).expanduser().resolve()
    if not binary.is_file():
        raise ZLError(f"--runner {binary}: no such file; build the phone's with `tools/build_phone_runner.sh` or fix "
                      "the path.")
    return check_phone_runner(binary, "`tools/build_phone_runner.sh`"), ()


def local_cpu_sets(count: int, cpus: Sequence[int] | None = None) -> list[tuple[int, ...]]:
    """Split the CPUs this process may use into `count` contiguous groups (one per local device).

    With fewer CPUs than devices, devices share CPUs round robin rather than failing.
    """
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if len(cpus) < count:
        return [(cpus[i % len(cpus)],) for i in range(count)]
    per = len(cpus) // count
    return [tuple(cpus[i * per:(i + 1) * per]) for i in range(count)]


def open_devices(
    spec: str | DevicesSpec,
    run_dir: Path | None = None,
    *,
    runner: Sequence[str] | None = None,
    pin_cpus: bool = False,
    link_profile: str | None = None,
    check_abi: bool = True,
    client=None,
    mode: str = "binary",
    cpu_quota: Sequence[float] | None = None,
    runner_binary: Path | None = None,
    runner_prefix: str | None = None,
) -> list[Device]:
    """The devices of a --devices value, in stage order.

    Args:
        spec: `local:N` or `SERIAL1,SERIAL2,...` (or a parsed DevicesSpec).
        run_dir: local devices live in RUN_DIR/devices/local-<i> (required for local).
        runner: local only: the command to start instead of zl_runner (tests).
        pin_cpus: local only: give each device its own share of this host's CPUs.
        link_profile: the link emulation of what stages on these devices send (default local: none; phones
            already have a real link, a profile adds its delay on top).
        check_abi: phones: fail unless arm64-v8a.
        client: an adbutils client (default: connect to the adb server, starting it).
        mode: phones: "binary" (zl_runner over adb) or "app" (the com.zerolock.zl app); see MODES.
        cpu_quota: local only: CPUs per device (one value for all, or one each; zl_device/devices/cpu_quota.py).
        runner_binary: the zl_runner build deploy puts on the devices (`--runner`; `check_runner`).
        runner_prefix: local only: the command the runner is started under (`--runner-prefix`, e.g. qemu-aarch64).

    Raises:
        ZLError: a bad spec, mode, quota or runner, no run_dir for local devices, or a phone that is missing,
            unauthorized, offline or of the wrong ABI.
    """
    parsed = parse_devices(spec) if isinstance(spec, str) else spec
    check_mode(parsed, mode)
    quotas = check_cpu_quota_fits(parsed, cpu_quota)
    binary, prefix = check_runner(parsed, mode, runner_binary, runner_prefix)
    if link_profile is not None and link_profile not in LINK_PROFILES:
        raise ZLError(f"link profile {link_profile!r}: expected one of {', '.join(LINK_PROFILES)}.")
    if parsed.kind == LOCAL:
        from zl_device.devices.local import LocalDevice
        from zl_device.formats.run_layout import RunLayout

        if run_dir is None:
            raise ZLError("local devices need a run directory (their folders are RUN_DIR/devices/local-N); "
                          "pass --run-dir.")
        cpu_sets = local_cpu_sets(parsed.count) if pin_cpus else [None] * parsed.count
        layout = RunLayout(run_dir)
        return [LocalDevice(f"local-{i}", layout.device_dir(f"local-{i}"), runner=runner, cpus=cpu_sets[i],
                            link_profile=link_profile or "local", cpu_quota=quotas[i], runner_binary=binary,
                            runner_prefix=prefix) for i in range(parsed.count)]
    from zl_device.devices import adb

    client = client or adb.connect()
    phones = [open_phone(s, client, check_abi=check_abi, link_profile=link_profile or "local", mode=mode)
              for s in parsed.serials]
    for phone in phones:
        phone.runner_binary = binary
    return phones


def open_phone(serial: str, client=None, check_abi: bool = True, link_profile: str = "local", mode: str = "binary"):
    """The phone with this serial, checked to be online, authorized and (optionally) arm64-v8a.

    Args:
        client: an adbutils.AdbClient (default: connect to the adb server, starting it when needed).
        mode: "binary": stages run as zl_runner in /data/local/tmp/zerolock (`AdbDevice`); "app": in the app
            com.zerolock.zl (`AppDevice`).

    Returns:
        the `AdbDevice` or `AppDevice`.

    Raises:
        ZLError: the serial is not attached, unauthorized or offline, or the ABI is wrong.
    """
    from zl_device.devices import adb
    from zl_device.devices.app import AppDevice

    client = adb.attached(serial, client)
    phone = (AppDevice if mode == "app" else adb.AdbDevice)(serial, client, link_profile=link_profile)
    if check_abi:
        adb.check_abi(phone)
    return phone
