"""Device policies (docs/design#device-policies): the readers, the pause/resume decisions, the coordinator's pause, the
report, the options; end to end, a stage paused for heat ends with the adapter of a run without pauses."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from zl_base.errors import ZLError
from zl_device.devices.readings import (
    APP_READINGS_FILE,
    DeviceReadings,
    adb_readings,
    app_readings,
    linux_readings,
    parse_dumpsys_battery,
    parse_thermal_status,
    read_device,
    read_override,
)
from zl_device.executorch.device_policy import DevicePolicy

REPO = Path(__file__).resolve().parents[1]

DUMPSYS_BATTERY = """Current Battery Service state:
  AC powered: false
  USB powered: true
  Wireless powered: false
  Dock powered: false
  Max charging current: 500000
  status: 2
  health: 2
  present: true
  level: 170
  scale: 200
  voltage: 4200
  temperature: 412
  technology: Li-ion
Thermal Status: 3"""


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_sysfs(root: Path, zone_c: float | None = 61.0, battery: int | None = 14, status: str = "Discharging",
               mains_online: str | None = "0") -> Path:
    if zone_c is not None:
        write(root / "sys/class/thermal/thermal_zone0/type", "battery\n")  # not the CPU: skipped
        write(root / "sys/class/thermal/thermal_zone0/temp", "20000\n")
        write(root / "sys/class/thermal/thermal_zone1/type", "x86_pkg_temp\n")
        write(root / "sys/class/thermal/thermal_zone1/temp", f"{int(zone_c * 1000)}\n")
    ps = root / "sys/class/power_supply"
    write(ps / "hid-mouse-battery/type", "Battery\n")  # a peripheral's battery: not the machine's
    write(ps / "hid-mouse-battery/scope", "Device\n")
    write(ps / "hid-mouse-battery/capacity", "90\n")
    if battery is not None:
        write(ps / "BAT0/type", "Battery\n")
        write(ps / "BAT0/capacity", f"{battery}\n")
        write(ps / "BAT0/status", f"{status}\n")
    if mains_online is not None:
        write(ps / "AC/type", "Mains\n")
        write(ps / "AC/online", f"{mains_online}\n")
    return root


# --- readers -------------------------------------------------------------------------------------------------------


def test_linux_readings_from_thermal_zones_and_power_supplies(tmp_path):
    r = linux_readings(fake_sysfs(tmp_path / "a"))
    assert (r.temperature_c, r.battery_pct, r.charging, r.thermal_status) == (61.0, 14.0, False, None)
    assert linux_readings(fake_sysfs(tmp_path / "b", mains_online="1")).charging is True
    assert linux_readings(fake_sysfs(tmp_path / "c", status="Charging", mains_online=None)).charging is True
    # A machine that lists no thermal zone and no power supply (a container, most desktops) tells nothing.
    empty = linux_readings(tmp_path / "none")
    assert (empty.temperature_c, empty.battery_pct, empty.charging) == (None, None, None)


def test_dumpsys_battery_and_thermal_status_are_parsed():
    r = parse_dumpsys_battery(DUMPSYS_BATTERY)
    assert (r.temperature_c, r.battery_pct, r.charging) == (41.2, 85.0, True)  # level 170 of scale 200; on USB
    assert parse_dumpsys_battery(DUMPSYS_BATTERY.replace("USB powered: true", "USB powered: false")).charging is False
    assert parse_dumpsys_battery("nothing here") == DeviceReadings(source="dumpsys")
    assert parse_thermal_status(DUMPSYS_BATTERY) == 3 and parse_thermal_status("Thermal Status: 9") is None


class FakePhone:
    """What the readers use of an AdbDevice / AppDevice: `shell`, `path`, `name`, `kind`."""

    kind, name = "adb", "P1"

    def __init__(self, app_state: dict | None = None, uptime_s: float = 1000.0, runs_runner_binary: bool = True):
        self.app_state, self.uptime_s, self.runs_runner_binary = app_state, uptime_s, runs_runner_binary
        self.commands: list[str] = []

    def path(self, remote: str) -> str:
        return f"/sdcard/Android/data/com.zerolock.zl/files/{remote}"

    def shell(self, command: str, action: str = "") -> str:
        self.commands.append(command)
        if command.startswith("cat /proc/uptime"):
            state = json.dumps(self.app_state) if self.app_state is not None else ""
            return f"{self.uptime_s:.2f} 1234.56\n---\n{state}"
        assert command.startswith("dumpsys battery"), command
        return DUMPSYS_BATTERY


def test_binary_mode_reads_dumpsys_in_one_round_trip():
    phone = FakePhone()
    r = adb_readings(phone)
    assert (r.temperature_c, r.battery_pct, r.charging, r.thermal_status, r.source) == (41.2, 85.0, True, 3, "dumpsys")
    assert len(phone.commands) == 1


def test_app_mode_reads_the_apps_file_while_fresh_and_dumpsys_once_it_is_stale():
    state = {"temperature_c": 38.5, "battery_pct": 55.0, "charging": False, "thermal_status": 1,
             "elapsed_realtime_ms": 998_000, "t_unix_ms": 1_700_000_000_000}
    fresh = FakePhone(state, uptime_s=1000.0, runs_runner_binary=False)  # written 2 s ago on the phone's clock
    r = app_readings(fresh)
    assert (r.temperature_c, r.battery_pct, r.charging, r.thermal_status, r.source) == (38.5, 55.0, False, 1, "app")
    assert APP_READINGS_FILE in fresh.commands[0] and len(fresh.commands) == 1
    stale = FakePhone(state, uptime_s=1030.0, runs_runner_binary=False)  # 32 s old: the service is gone
    assert app_readings(stale).source == "dumpsys" and len(stale.commands) == 2
    assert app_readings(FakePhone(None, runs_runner_binary=False)).source == "dumpsys"
    assert read_device(FakePhone(state, uptime_s=1000.0, runs_runner_binary=False)).source == "app"
    assert read_device(FakePhone(state, uptime_s=1000.0)).source == "dumpsys"  # binary mode never asks the app


def test_an_override_file_replaces_what_it_names(tmp_path):
    override = tmp_path / "local-1.json"
    r = linux_readings(fake_sysfs(tmp_path / "sys"), override=override)
    assert r.source == "sysfs" and r.temperature_c == 61.0  # no file: the sensors
    override.write_text("")  # a writer that truncated and has not written yet
    assert linux_readings(tmp_path / "sys", override=override).source == "sysfs"
    override.write_text('{"temperature_c": 30.5, "charging": true}')
    r = linux_readings(tmp_path / "sys", override=override)
    assert (r.temperature_c, r.battery_pct, r.charging, r.source) == (30.5, 14.0, True, "sysfs+override")
    assert adb_readings(FakePhone(), override=override).temperature_c == 30.5
    for bad, match in (('[1]', "expected a JSON object"), ('{"temp": 3}', "unknown key"),
                       ('{"battery_pct": 130}', r"battery_pct 130: expected a number in \[0.0, 100.0\]"),
                       ('{"charging": 1}', "charging 1: expected true or false"), ("{", "not JSON")):
        override.write_text(bad)
        with pytest.raises(ZLError, match=match):
            read_override(override)


# --- the policy ------------------------------------------------------------------------------------------------------


def test_pause_and_resume_thresholds_have_hysteresis():
    p = DevicePolicy(max_temperature_c=45, min_battery_pct=20, require_charging=True)
    ok = DeviceReadings(temperature_c=40.0, battery_pct=50.0, charging=True, thermal_status=0)

    def at(**kw) -> DeviceReadings:
        return DeviceReadings(**{**ok.to_json(), **kw})

    assert p.breach(ok) is None and p.holds(ok) is None
    assert p.breach(at(temperature_c=45.0)) == ("temperature", "45.0 °C ≥ 45 °C (--max-temperature)")
    assert p.breach(at(temperature_c=44.9)) is None
    assert p.holds(at(temperature_c=44.9)) == "44.9 °C, resumes at 42 °C"  # in range, but not by the margin
    assert p.holds(at(temperature_c=42.0)) is None
    assert p.breach(at(thermal_status=3)) == ("thermal_status", "thermal status SEVERE (--max-temperature)")
    assert p.holds(at(thermal_status=2)) == "thermal status MODERATE, resumes at LIGHT"
    assert p.breach(at(battery_pct=19.0))[0] == "battery" and p.breach(at(battery_pct=20.0)) is None
    assert p.holds(at(battery_pct=24.0)) == "battery 24%, resumes at 25%" and p.holds(at(battery_pct=25.0)) is None
    assert p.breach(at(charging=False)) == ("charging", "off external power (--require-charging)")
    # What was not measured neither pauses a device nor lets a paused one go.
    blind = DeviceReadings()
    assert p.breach(blind) is None and p.holds(blind) == "no temperature reading"


def test_a_device_without_the_needed_sensor_is_refused_before_the_deploy():
    class Local:
        name, kind = "local-0", "local"

    p = DevicePolicy(min_battery_pct=20)
    p.check_devices([Local()], read=lambda d: DeviceReadings(battery_pct=10.0))  # flat, but it can be watched
    with pytest.raises(ZLError, match=r"^--min-battery: local-0 reports no battery level, so the policy could never "
                                      r"pause or resume it; drop --min-battery, or use devices that report it\.$"):
        p.check_devices([Local()], read=lambda d: DeviceReadings(temperature_c=50.0, battery_pct=None))
    DevicePolicy().check_devices([Local()], read=lambda d: 1 / 0)  # no policy: nothing is read


@pytest.mark.parametrize("args, message", [
    (["--max-temperature", "200"], "error: --max-temperature 200: expected a temperature between 30 and 110 °C"),
    (["--max-temperature", "20"], "error: --max-temperature 20: expected a temperature between 30 and 110 °C"),
    (["--min-battery", "0"], "error: --min-battery 0: expected a battery level between 1 and 95 %"),
    (["--min-battery", "99"], "error: --min-battery 99: expected a battery level between 1 and 95 %"),
    (["--require-charging", "--runtime", "torch"], "error: --max-temperature, --min-battery and "
                                                    "--require-charging pause stages on their devices"),
])
def test_policy_values_out_of_range_are_one_line_errors(tmp_path, args, message):
    out = subprocess.run([sys.executable, "-m", "zl.cli", "train", "--out", str(tmp_path / "run"), *args],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), out.stderr
    assert not (tmp_path / "run").exists()


# --- the coordinator ---------------------------------------------------------------------------------------------


def test_the_stall_walk_never_blames_a_paused_stage_or_the_ones_waiting_for_it():
    """Stage 1 paused, stage 2 starved by it, stage 0 held back by it, all without progress for longer than the
    stall timeout: nobody is blamed. The same counts with stage 1 running: stage 1 is."""
    from zl_device.formats.windows import WindowPlan
    from zl_device.executorch.coordinator import Coordinator, StagePlan

    class Idle:
        name, kind, files_on_host, supports_standby = "idle", "local", True, False

    plans = [StagePlan(k, Idle(), f"stage_{k}.json", "metrics.jsonl", "checkpoints", 1) for k in range(3)]

    def run(state: str) -> list[int]:
        c = Coordinator(plans, WindowPlan(32, 4), stall_timeout_s=5.0)
        long_ago = time.monotonic() - 60
        for s, done in zip(c.status, (12, 8, 8)):
            s.state, s.micro_batches_done, s.last_progress = "running", done, long_ago
        c.status[1].state = state
        verdict = c.health.check_stalls(time.monotonic())
        return [] if verdict is None else [verdict.stage]

    assert run("paused") == []
    assert run("running") == [1]


def test_the_live_view_says_why_and_for_how_long_a_stage_is_paused():
    from zl.commands.train import stage_state
    from zl_device.formats.stage_status import StageStatus

    s = StageStatus(1, "local-1", state="pausing", pause_reason="61.0 °C ≥ 45 °C (--max-temperature)")
    assert stage_state(s) == "pausing: 61.0 °C ≥ 45 °C (--max-temperature)"
    s.state, s.paused_since = "paused", 100.0
    assert stage_state(s, now=112.4) == "paused 12 s: 61.0 °C ≥ 45 °C (--max-temperature)"
    assert stage_state(StageStatus(0, "local-0", state="running")) == "running"


# --- the report ---------------------------------------------------------------------------------------------------


def test_the_report_shows_each_pause_and_does_not_count_it_as_a_restart(tmp_path):
    from zl_device.results.report import write_report

    lines = []
    for stage in (0, 1):
        starts = 2 if stage == 1 else 1  # stage 1 started again after its pause
        for n in range(starts):
            lines.append({"type": "start", "stage": stage, "num_stages": 2, "pid": 10 + n,
                          "first_micro_batch": 4 * n, "resumed_from_window": 0 if n else None})
            for mb in range(4 * n, 4 * n + 4):
                lines.append({"type": "micro_batch", "t_unix_ms": 1000 + mb, "stage": stage, "window": mb // 4,
                              "micro_batch": mb, "total_ms": 5.0, "loss": 1.0})
            lines.append({"type": "window", "t_unix_ms": 1010, "stage": stage, "window": n, "micro_batches": 4,
                          "mean_loss": 1.0})
        if stage == 0:
            for mb in range(4, 8):
                lines.append({"type": "micro_batch", "t_unix_ms": 1000 + mb, "stage": 0, "window": 1,
                              "micro_batch": mb, "total_ms": 5.0, "loss": 1.0})
    pause = {"type": "pause", "stage": 1, "device": "local-1", "kind": "temperature",
             "reason": "61.0 °C ≥ 45 °C (--max-temperature)", "window": 0, "requested_unix_ms": 1_000,
             "paused_unix_ms": 2_000, "resumed_unix_ms": 9_500, "to_pause_ms": 1000.0, "paused_ms": 7500.0,
             "resumed_at": "41.0 °C", "standby": False}
    lines += [pause, {**pause, "stage": 0, "device": "local-0", "paused_unix_ms": 9_000, "resumed_unix_ms": 12_000,
                      "paused_ms": 3000.0},
              {"type": "run", "start_unix_ms": 0, "end_unix_ms": 20_000, "samples": 8}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    report = write_report(tmp_path, plots=False)
    assert [(p["stage"], p["paused_ms"]) for p in report["pauses"]] == [(1, 7500.0), (0, 3000.0)]
    assert report["run"]["paused_s"] == pytest.approx(10.0)  # 2.0-9.5 s and 9.0-12.0 s overlap
    assert [s["restarts"] for s in report["stages"]] == [0, 0] and report["recovery"] == []
    md = (tmp_path / "report.md").read_text()
    assert "## Pauses" in md and "## Recovery" not in md
    assert "| 1 | local-1 | 61.0 °C ≥ 45 °C (--max-temperature) | 0 | 1000.0 | 7.5 | 41.0 °C |" in md
    assert "paused for 10.0 s in all" in md


# --- end to end ------------------------------------------------------------------------------------------------------

RUNNER = Path(os.environ.get("ZL_RUNNER_BIN", REPO / "build" / "runner" / "zl_runner"))


def set_readings(path: Path, **values) -> None:
    """An override file written whole (tmp + rename): the coordinator never reads half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(values))
    tmp.replace(path)


def test_a_stage_paused_for_heat_ends_with_the_adapter_of_a_run_without_pauses(tmp_path):
    """tiny-random on 3 local devices; local-1 reads 61 °C against --max-temperature 45 from the start. Stage 1
    finishes its window, stops and is held; at 43 °C (in range, not by the 3 °C margin) it stays paused; at 41 °C
    it resumes from its checkpoint. The pause outlasts the stall timeout twice over: neither it nor the
    stages waiting for it may be blamed. The adapter equals the one of the same run without a policy, bit for
    bit, and the live view and the report show the pause."""
    from conftest import native_library_or_skip
    from safetensors.torch import load_file

    from zl_device.run.train_job import run_training
    from zl_device.run.train_settings import TrainSettings
    from zl_export.data_settings import DataSettings
    from zl_export.options import ModelSplit

    native_library_or_skip()
    if not RUNNER.is_file():
        pytest.skip(f"{RUNNER} not built; run `bash setup.sh`")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"item {i} is", "completion": " odd" if i % 2 else " even"}) + "\n"
                            for i in range(40)))

    # 12 windows over links shaped `constrained` (30 ms a send): on the tiny model an unshaped stage once ran all
    # its windows between two polls of a coordinator starved by a loaded host, so it ended before it could be
    # stopped (seen as starting, then done: correct for a run that ended, but no pause to test).
    def train(out: Path, on_update=None, **kw):
        settings = TrainSettings(split=ModelSplit("tiny-random"), window=4, samples=48, out=out,
                                 link_profile="constrained",
                                 export_cache=tmp_path / "cache", data=str(data), rows=DataSettings(seq_len=32),
                                 eval_limit=4, timeout_s=300, schedule="zerolock", **kw)
        return run_training(settings, say=lambda line: None, on_update=on_update)

    clean = train(tmp_path / "clean")

    readings = tmp_path / "readings"
    readings.mkdir()
    for k in (0, 2):  # the host's own sensor may be missing or hot: the other devices read a cool override
        set_readings(readings / f"local-{k}.json", temperature_c=35.0)
    hot = readings / "local-1.json"
    set_readings(hot, temperature_c=61.0)
    seen: dict[str, object] = {"states": set()}

    def on_update(status) -> None:
        s1, now = status[1], time.monotonic()
        seen["states"].add((s1.state, s1.pause_reason))
        if s1.state == "paused" and "paused" not in seen:
            seen["paused"] = now
            set_readings(hot, temperature_c=43.0)
        elif "paused" in seen and "cooled" not in seen and now - seen["paused"] > 9.0:
            seen["cooled"] = now
            set_readings(hot, temperature_c=41.0)

    from zl_device.executorch.device_policy import DevicePolicy

    paused = train(tmp_path / "paused", on_update, stall_timeout_s=4.0,
                   policy=DevicePolicy(max_temperature_c=45.0, readings_override=readings, read_every_s=0.2))

    reason = "61.0 °C ≥ 45 °C (--max-temperature)"
    assert ("pausing", reason) in seen["states"] and ("paused", reason) in seen["states"], seen["states"]
    events = [json.loads(ln) for ln in (paused.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["type"] in ("failure", "restart", "recovered")], "a pause is no failure"
    pauses = [e for e in events if e["type"] == "pause"]
    assert len(pauses) == 1, pauses
    pause = pauses[0]
    assert (pause["stage"], pause["device"], pause["kind"], pause["reason"]) == (1, "local-1", "temperature", reason)
    assert pause["paused_ms"] >= 9000 and pause["resumed_at"].startswith("41.0 °C"), pause
    assert 0 <= pause["window"] < 11  # it stopped after a window before the last (12 windows)
    starts = {k: [e for e in events if e["type"] == "start" and e["stage"] == k] for k in range(3)}
    assert [len(starts[k]) for k in range(3)] == [1, 2, 1]  # only the paused stage started again
    assert starts[1][1]["resumed_from_window"] == pause["window"]
    # Stopped after committing its window: the restart redid nothing of it.
    assert starts[1][1]["first_micro_batch"] >= 4 * (pause["window"] + 1)

    clean_adapter = load_file(str(clean.run_dir / "adapter" / "adapter_model.safetensors"))
    paused_adapter = load_file(str(paused.run_dir / "adapter" / "adapter_model.safetensors"))
    assert clean_adapter.keys() == paused_adapter.keys()
    for name, t in clean_adapter.items():
        assert torch.equal(paused_adapter[name], t), name

    report = json.loads((paused.run_dir / "report.json").read_text())
    assert [p["stage"] for p in report["pauses"]] == [1] and report["run"]["paused_s"] >= 9.0
    assert [s["restarts"] for s in report["stages"]] == [0, 0, 0]
    assert f"| 1 | local-1 | {reason} | {pause['window']} |" in (paused.run_dir / "report.md").read_text()
