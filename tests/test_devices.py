"""Device backends, part 1: local processes end to end (a dummy runner, and the real zl_runner when built),
--devices parsing, deploy and pull, and the `zl deploy` / `zl pull` commands. Part 2 (adb, the address plan):
tests/test_devices_adb.py.

    .venv/bin/python -m pytest tests/test_devices.py tests/test_devices_adb.py
    .venv/bin/python -m pytest tests/test_devices.py -m slow     # the real zl_runner on two local devices
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from zl.commands import devices as devices_cli
from zl_base.errors import ZLError
from zl_device.devices import deploy as zdeploy
from zl_device.devices.backend import signal_exit_code, sum_pss_kib
from zl_device.devices.registry import local_cpu_sets, open_devices, parse_devices
from zl_device.devices.local import LocalDevice, thermal_zone_celsius
from zl_device.devices.network import plan_addresses
from zl_export.manifest import write_manifest
from manifest_fixtures import fake_manifest

# A stand-in for zl_runner: reads --config, prints the "listening" event, writes telemetry and checkpoint
# folders like the real one, then behaves as the config's "dummy" field (or $ZL_DUMMY_RUNNER, for configs that go
# through deploy, which refuses a field the runner does not know) says. SIGTERM exits 3 (as zl_runner).
DUMMY_RUNNER = r'''
import json, os, signal, sys, time
args = sys.argv[1:]
config = json.load(open(args[args.index("--config") + 1]))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
if "--standby" in args:  # as zl_runner --standby: SIGUSR1 blocked, then the standby line, then wait for it
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    print(json.dumps({"event": "standby", "stage": config.get("stage_index", 0), "pid": os.getpid()}), flush=True)
    signal.sigwait({signal.SIGUSR1})
    print(json.dumps({"event": "took_over"}), flush=True)
print(json.dumps({"event": "listening", "stage": config.get("stage_index", 0), "port": 7101,
                  "resume": "--resume" in args}), flush=True)
print("dummy runner diagnostics", file=sys.stderr, flush=True)
with open(config.get("log_path", "metrics.jsonl"), "a") as f:
    f.write(json.dumps({"stage": config.get("stage_index", 0), "micro_batch": 0, "loss": 1.5}) + "\n")
ckpt = config.get("checkpoint_dir")
if ckpt:
    for sub in ("window_1", ".tmp-window_2", "input_log"):
        os.makedirs(os.path.join(ckpt, sub), exist_ok=True)
        open(os.path.join(ckpt, sub, "adapter.safetensors"), "w").write(sub)
mode = config.get("dummy", os.environ.get("ZL_DUMMY_RUNNER", "sleep"))  # deploy checks configs: env then
if mode.startswith("exit:"):
    sys.exit(int(mode[5:]))
time.sleep(120)
'''

WAIT_S = 20.0


@pytest.fixture()
def dummy(tmp_path) -> list[str]:
    script = tmp_path / "dummy_runner.py"
    script.write_text(DUMMY_RUNNER)
    return [sys.executable, str(script)]


def started(device: LocalDevice, config: dict, name: str = "stage_0.json", resume: bool = False) -> LocalDevice:
    device.write_text(name, json.dumps(config))
    device.start_runner(name, resume=resume)
    deadline = time.monotonic() + WAIT_S
    while '"listening"' not in device.runner_output() and device.is_running():
        assert time.monotonic() < deadline, "dummy runner never printed its listening event"
        time.sleep(0.02)
    return device


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def cli_app() -> typer.Typer:
    app = typer.Typer()
    for name, command in devices_cli.COMMANDS.items():
        app.command(name)(command)
    return app



# --- local backend ----------------------------------------------------------------------------------


def test_local_runner_stop_kill_and_exit_codes(tmp_path, dummy):
    dev = LocalDevice("local-0", tmp_path / "d0", runner=dummy)
    assert dev.exit_code() is None and not dev.is_running()
    started(dev, {"stage_index": 0}, resume=True)
    assert dev.is_running()
    event = json.loads(dev.runner_output().splitlines()[-1])
    assert event == {"event": "listening", "stage": 0, "port": 7101, "resume": True}
    pss = dev.pss_mib()
    assert pss is not None and pss > 1.0  # a Python interpreter is several MiB
    with pytest.raises(ZLError, match="already running"):
        dev.start_runner("stage_0.json")
    assert dev.stop_runner(timeout_s=WAIT_S) == 3  # SIGTERM handled: the runner's "stopped" status
    assert not dev.is_running() and dev.pss_mib() is None
    assert (tmp_path / "d0" / "runner.exit").read_text().strip() == "3"

    started(dev, {"stage_index": 0})
    assert dev.kill_runner(timeout_s=WAIT_S) == -9  # SIGKILL: no handler runs
    assert dev.exit_code() == -9

    started(dev, {"stage_index": 0, "dummy": "exit:1"})
    assert dev.wait(WAIT_S) and dev.exit_code() == 1
    # Output accumulates across starts; runner_output() shows only the last one.
    assert (tmp_path / "d0" / "runner.out").read_text().count('"listening"') == 3
    assert dev.runner_output().count('"listening"') == 1
    assert "dummy runner diagnostics" in (tmp_path / "d0" / "runner.err").read_text()
    assert dev.stop_runner() == 1  # nothing running: stop is a no-op that reports the last status


def test_local_standby_takes_over_only_once_the_runner_is_gone(tmp_path, dummy):
    dev = LocalDevice("local-0", tmp_path / "d0", runner=dummy)
    dev.write_text("stage_0.json", json.dumps({"stage_index": 0}))
    assert not dev.has_standby() and not dev.take_over()  # none: the caller starts a runner instead
    started(dev, {"stage_index": 0})
    dev.start_standby("stage_0.json")
    standby_pid = int((tmp_path / "d0" / "standby.pid").read_text())
    with pytest.raises(ZLError, match="already waiting"):
        dev.start_standby("stage_0.json")
    with pytest.raises(ZLError, match="still running"):
        dev.take_over()
    assert dev.kill_runner(timeout_s=WAIT_S) == -9
    assert dev.take_over(timeout_s=WAIT_S)
    assert dev.is_running() and not dev.has_standby() and not (tmp_path / "d0" / "standby.pid").exists()
    assert int((tmp_path / "d0" / "runner.pid").read_text()) == standby_pid
    deadline = time.monotonic() + WAIT_S
    while '"listening"' not in dev.runner_output():
        assert time.monotonic() < deadline, "the standby never took over"
        time.sleep(0.02)
    assert '"took_over"' in dev.runner_output()
    assert dev.stop_runner(timeout_s=WAIT_S) == 3  # it is the device's runner now

    dev.start_standby("stage_0.json")  # one that died is no standby
    os.kill(int((tmp_path / "d0" / "standby.pid").read_text()), signal.SIGKILL)
    assert not dev.take_over(timeout_s=WAIT_S) and not (tmp_path / "d0" / "standby.pid").exists()

    dev.start_standby("stage_0.json")  # one a previous zl train left: found by its pid file
    pid = int((tmp_path / "d0" / "standby.pid").read_text())
    LocalDevice("local-0", tmp_path / "d0", runner=dummy).stop_standby()
    assert dev._standby.wait(timeout=WAIT_S) == -9 and not (tmp_path / "d0" / "standby.pid").exists(), pid


def test_local_runner_seen_from_another_process_object(tmp_path, dummy):
    """`zl` commands in another process find a running runner through runner.pid and the process's cwd."""
    dev = started(LocalDevice("local-0", tmp_path / "d0", runner=dummy), {"stage_index": 0})
    other = LocalDevice("local-0", tmp_path / "d0")
    assert other.is_running() and other.pss_mib() is not None
    unrelated = LocalDevice("local-1", tmp_path / "d1")
    (tmp_path / "d1" / "runner.pid").write_text(f"{dev._proc.pid}\n")  # same pid, other workdir: not ours
    assert not unrelated.is_running()
    assert other.signal_runner(15)
    assert dev.wait(WAIT_S) and dev.exit_code() == 3
    assert not other.is_running() and other.exit_code() == 3


def test_local_runner_cpu_pinning(tmp_path, dummy):
    cpu = sorted(os.sched_getaffinity(0))[-1]
    dev = started(LocalDevice("local-0", tmp_path / "d0", runner=dummy, cpus=[cpu]), {"stage_index": 0})
    try:
        allowed = re.search(r"Cpus_allowed_list:\s*(\S+)", Path(f"/proc/{dev._proc.pid}/status").read_text())
        assert allowed.group(1) == str(cpu)
    finally:
        dev.kill_runner()


def test_local_missing_config_and_binary(tmp_path, monkeypatch):
    dev = LocalDevice("local-0", tmp_path / "d0")
    with pytest.raises(ZLError, match="does not exist; deploy it first"):
        dev.start_runner("stage_0.json")
    dev.write_text("stage_0.json", "{}")
    monkeypatch.setenv("ZL_RUNNER_BIN", str(tmp_path / "nope" / "zl_runner"))
    with pytest.raises(ZLError, match=r"host zl_runner is not built; run `bash setup.sh`"):
        dev.start_runner("stage_0.json")


def test_local_files_push_pull_modes_and_hashes(tmp_path):
    dev = LocalDevice("local-0", tmp_path / "d0")
    src = tmp_path / "prog.bin"
    src.write_bytes(os.urandom(3 << 20))
    seen = []
    assert dev.push(src, "sub/prog.bin", mode=0o750, on_bytes=seen.append) == 3 << 20
    assert sum(seen) == 3 << 20 and len(seen) == 3
    pushed = tmp_path / "d0" / "sub" / "prog.bin"
    assert stat.S_IMODE(pushed.stat().st_mode) == 0o750 and pushed.read_bytes() == src.read_bytes()
    assert dev.file_sha256("sub/prog.bin") == zdeploy.file_sha256(src) and dev.file_sha256("none") is None
    assert dev.listdir(".") == ["sub"] and dev.listdir("nothing") == []
    (tmp_path / "d0" / "sub" / "input_log").mkdir()
    (tmp_path / "d0" / "sub" / "input_log" / "e1").write_text("x")
    (tmp_path / "d0" / "sub" / ".tmp-3").write_text("x")
    assert dev.pull("sub", tmp_path / "back", exclude=("input_log", ".tmp-*")) == 3 << 20
    assert sorted(p.name for p in (tmp_path / "back").iterdir()) == ["prog.bin"]
    with pytest.raises(ZLError, match="nothing to pull"):
        dev.pull("missing", tmp_path / "x")
    with pytest.raises(ZLError, match="no such file to push"):
        dev.push(tmp_path / "missing", "x")
    assert dev.free_bytes() > 0


def test_thermal_zone_reading(tmp_path):
    assert thermal_zone_celsius(tmp_path / "absent") is None
    for i, (kind, milli) in enumerate([("battery", "30000"), ("x86_pkg_temp", "200000"), ("acpitz", "45500")]):
        zone = tmp_path / f"thermal_zone{i}"
        zone.mkdir()
        (zone / "type").write_text(kind + "\n")
        (zone / "temp").write_text(milli + "\n")
    # battery is not a CPU zone; 200 °C is implausible; acpitz is the first believable one.
    assert thermal_zone_celsius(tmp_path) == 45.5
    (tmp_path / "thermal_zone2" / "temp").write_text("garbage")
    assert thermal_zone_celsius(tmp_path) is None


def test_pss_and_exit_code_helpers():
    rollup = "55d0-7ff [rollup]\nRss:   20480 kB\nPss:   10240 kB\nPss_Anon:  9000 kB\nPss_File: 1240 kB\n"
    assert sum_pss_kib(rollup) == 10240
    assert sum_pss_kib("Rss: 1 kB\n") is None
    assert [signal_exit_code(c) for c in (0, 3, 137, 143)] == [0, 3, -9, -15]


# --- --devices ----------------------------------------------------------------------------------------


def test_parse_devices_spec():
    assert parse_devices("local:3").count == 3 and parse_devices("local").count == 1
    spec = parse_devices("R58M123,192.168.1.5:5555")
    assert spec.kind == "adb" and spec.serials == ("R58M123", "192.168.1.5:5555")
    for bad, message in [("", "empty"), ("local:0", "N >= 1"), ("local:x", "local:N"), ("A,,B", "empty serial"),
                         ("A,A", "more than once"), ("A B", "does not look like")]:
        with pytest.raises(ZLError, match=message):
            parse_devices(bad)


def test_open_local_devices(tmp_path):
    devs = open_devices("local:3", tmp_path, pin_cpus=True, link_profile="wifi")
    assert [d.name for d in devs] == ["local-0", "local-1", "local-2"]
    assert all(Path(d.workdir) == tmp_path / "devices" / d.name and Path(d.workdir).is_dir() for d in devs)
    assert all(d.cpus and d.link_profile == "wifi" for d in devs)
    with pytest.raises(ZLError, match="--run-dir"):
        open_devices("local:2")
    with pytest.raises(ZLError, match="link profile 'lte'"):
        open_devices("local:2", tmp_path, link_profile="lte")
    assert local_cpu_sets(2, [0, 1, 2, 3, 4]) == [(0, 1), (2, 3)]
    assert local_cpu_sets(3, [0, 1]) == [(0,), (1,), (0,)]


# --- deploy and pull ------------------------------------------------------------------------------------


def make_export(root: Path, stages: int = 2) -> Path:
    export = root / "export"
    export.mkdir(parents=True)
    for k in range(stages):
        (export / f"stage_{k}.pte").write_bytes(bytes([k]) * ((1 << 20) + 10 * k))  # big enough to be hashed
    write_manifest(fake_manifest([(k, k) for k in range(stages)]), export)
    return export


def stage_config(k: int, stages: int = 3) -> dict:
    """The fields a runner config needs but the one `deploy` fills (the program); the run key is a device path, which
    deploy leaves as it is."""
    return {"stage_index": k, "num_stages": stages, "run_key_file": "/data/local/tmp/run.key", "run_id": "ab" * 16,
            "window_size": 2, "num_micro_batches": 4, "checkpoint_dir": "ckpt"}


def make_configs(root: Path, stages: int = 2, **extra) -> Path:
    folder = root / "configs"
    folder.mkdir()
    (folder / "run.key").write_text("5a" * 32 + "\n")
    (folder / "train.safetensors").write_bytes(b"shard")
    for k in range(stages):
        cfg = {**stage_config(k, stages), "run_key_file": "run.key", "checkpoint_dir": "ckpt",
               "log_path": "metrics.jsonl", **extra}
        if k == 0:
            cfg["data_shard"] = "train.safetensors"
        (folder / f"stage_{k}.json").write_text(json.dumps(cfg))
    return folder


def test_deploy_and_pull_local_devices(tmp_path, dummy, monkeypatch):
    monkeypatch.setenv("ZL_DUMMY_RUNNER", "exit:0")
    export, configs = make_export(tmp_path), make_configs(tmp_path)
    runner = tmp_path / "fake_runner"
    runner.write_bytes(b"#!/bin/sh\n")
    devs = open_devices("local:3", tmp_path / "run", runner=dummy)
    files = []
    results = zdeploy.deploy(devs, export, configs, runner=runner, on_file=lambda *a: files.append(a))
    assert [(r.device, r.stage) for r in results] == [("local-0", 0), ("local-1", 1), ("local-2", None)]
    d0 = Path(devs[0].workdir)
    assert sorted(os.listdir(d0)) == ["manifest.json", "run.key", "stage_0.json", "stage_0.pte", "train.safetensors",
                                      "zl_runner"]
    assert sorted(os.listdir(devs[2].workdir)) == ["manifest.json", "zl_runner"]  # a spare
    assert os.access(d0 / "zl_runner", os.X_OK)
    cfg = json.loads((d0 / "stage_0.json").read_text())
    assert (cfg["program"], cfg["run_key_file"], cfg["data_shard"]) == ("stage_0.pte", "run.key", "train.safetensors")
    assert ("local-1", "stage_1.pte", (1 << 20) + 10, False) in files

    again = zdeploy.deploy(devs, export, configs, runner=runner)
    assert again[0].unchanged == ["stage_0.pte"] and "stage_0.pte" not in again[0].pushed
    assert "stage_0.pte" in zdeploy.deploy(devs, export, configs, runner=runner, force=True)[0].pushed

    for dev in devs[:2]:
        dev.start_runner(f"stage_{devs.index(dev)}.json")
    assert all(dev.wait(WAIT_S) and dev.exit_code() == 0 for dev in devs[:2])
    pulled = zdeploy.pull(devs, tmp_path / "run")
    assert [(p.device, p.stages) for p in pulled] == [("local-0", [0]), ("local-1", [1]), ("local-2", [])]
    logs = tmp_path / "run" / "logs" / "local-1"
    assert sorted(os.listdir(logs)) == ["metrics.jsonl", "runner.err", "runner.exit", "runner.out", "stage_1.json"]
    assert json.loads((logs / "metrics.jsonl").read_text())["stage"] == 1
    ckpt = tmp_path / "run" / "checkpoints" / "stage_1"
    assert sorted(os.listdir(ckpt)) == ["window_1"]  # no .tmp-* half checkpoints, no input log
    assert "input_log" in os.listdir(zdeploy.pull(devs[:1], tmp_path / "run", input_logs=True)[0].checkpoint_dirs[0])


def test_run_key_is_owner_only_from_creation_and_run_files_leave_the_devices(tmp_path, dummy, monkeypatch):
    """Keys are created 0600 (not chmod-ed after, so umask 0 and a chmod that never happens change nothing);
    remove_run_files deletes key, shard and input log but leaves checkpoints, telemetry and programs."""
    from zl_device.devices import local as zlocal
    from zl_device.executorch.launch import write_run_key

    old_umask = os.umask(0)
    try:
        monkeypatch.setattr(Path, "chmod", lambda self, mode: None)
        monkeypatch.setattr(zlocal.os, "chmod", lambda path, mode: None)
        key_file, _ = write_run_key(tmp_path)
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        with pytest.raises(ZLError, match="exists already"):
            write_run_key(tmp_path)
        export, configs = make_export(tmp_path), make_configs(tmp_path)
        devs = open_devices("local:2", tmp_path / "run", runner=dummy)
        runner = tmp_path / "fake_runner"
        runner.write_bytes(b"#!/bin/sh\n")
        zdeploy.deploy(devs, export, configs, runner=runner)
    finally:
        os.umask(old_umask)
    d0 = Path(devs[0].workdir)
    assert stat.S_IMODE((d0 / "run.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((d0 / "train.safetensors").stat().st_mode) == 0o644
    (d0 / "ckpt" / "input_log").mkdir(parents=True)
    (d0 / "ckpt" / "input_log" / "entry-1.zlf").write_bytes(b"x")
    (d0 / "ckpt" / "window_000000").mkdir()
    removed = zdeploy.remove_run_files(devs)
    assert sorted(removed) == ["local-0:ckpt/input_log", "local-0:run.key", "local-0:train.safetensors",
                               "local-1:run.key"]
    assert sorted(os.listdir(d0)) == ["ckpt", "manifest.json", "stage_0.json", "stage_0.pte", "zl_runner"]
    assert os.listdir(d0 / "ckpt") == ["window_000000"]


def test_deploy_errors(tmp_path, monkeypatch):
    export = make_export(tmp_path, stages=3)
    runner = tmp_path / "fake_runner"
    runner.write_bytes(b"x")
    devs = open_devices("local:2", tmp_path / "run")
    with pytest.raises(ZLError, match="has 3 stages but --devices gives 2 device"):
        zdeploy.deploy(devs, export, runner=runner)
    with pytest.raises(ZLError, match="is for stage 1, but local-0 gets stage 0"):
        zdeploy.deploy_stage(devs[0], export, 0, stage_config(1), runner=runner)
    with pytest.raises(ZLError, match=r'stage config: "window_size" is 0, expected at least 1; fix the stage config'):
        zdeploy.deploy_stage(devs[0], export, 0, {**stage_config(0), "window_size": 0}, runner=runner)
    with pytest.raises(ZLError, match="data_shard=missing.bin: no such file"):
        zdeploy.deploy_stage(devs[0], export, 0, {**stage_config(0), "data_shard": "missing.bin"}, runner=runner)
    from zl_export import data as zdata
    from zl_export.tokenizer import ByteTokenizer

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "p", "completion": " abc"}) + "\n")  # 4 bytes + EOS: 5 targets
    tokenized, task = zdata.tokenize(zdata.load_task(rows, "auto"), ByteTokenizer(), 16)
    zdata.save(tmp_path / "five.safetensors", tokenized, task, ByteTokenizer(), "tiny-random", {"path": str(rows)})
    manifest = json.loads((export / "manifest.json").read_text())
    (export / "manifest.json").write_text(json.dumps({**manifest, "max_targets": 4}))
    shard_cfg = {**stage_config(0), "data_shard": str(tmp_path / "five.safetensors")}
    other = open_devices("local:1", tmp_path / "other")[0]
    with pytest.raises(ZLError, match=r"five\.safetensors row 0: 5 target tokens, more than the programs' 4 target "
                                      r"slots; pass --max-targets 5 or more"):
        zdeploy.deploy_stage(other, export, 0, shard_cfg, runner=runner)
    (export / "manifest.json").write_text(json.dumps({**manifest, "max_targets": 8}))
    assert "five.safetensors" in zdeploy.deploy_stage(other, export, 0, shard_cfg, runner=runner).pushed  # fits
    (export / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ZLError, match="no stage config"):
        zdeploy.deploy(devs + open_devices("local:3", tmp_path / "run")[2:], export, tmp_path / "none", runner=runner)
    monkeypatch.setattr(LocalDevice, "free_bytes", lambda self: 10 << 20)
    with pytest.raises(ZLError, match=r"local-0: 10 MiB free under .*deploy needs 65 MiB.*free space on the device"):
        zdeploy.deploy_stage(devs[0], export, 0, runner=runner)


def test_android_runner_must_be_built_for_arm64(tmp_path, monkeypatch):
    """Phones get $ZL_ANDROID_RUNNER, else the static build of tools/build_phone_runner.sh, else the NDK build; an
    x86 file is refused."""
    monkeypatch.setenv("ZL_ANDROID_BUILD_DIR", str(tmp_path / "build-android"))
    monkeypatch.setattr(zdeploy, "PHONE_RUNNER", tmp_path / "build-phone" / "zl_runner")
    monkeypatch.delenv("ZL_ANDROID_RUNNER", raising=False)
    with pytest.raises(ZLError, match=r"build-android/zl_runner: the Android .*tools/build_phone_runner.sh.*"
                                      r"`tools/build_android.sh --native-only`"):
        zdeploy.android_runner_binary()
    (tmp_path / "build-android").mkdir()
    host_elf = (tmp_path / "build-android" / "zl_runner")
    host_elf.write_bytes(b"\x7fELF" + bytes(14) + (62).to_bytes(2, "little") + bytes(40))  # EM_X86_64
    with pytest.raises(ZLError, match=r"not an AArch64 ELF executable \(x86_64\)"):
        zdeploy.android_runner_binary()
    host_elf.write_bytes(b"\x7fELF" + bytes(14) + (183).to_bytes(2, "little") + bytes(40))  # EM_AARCH64
    assert zdeploy.android_runner_binary() == host_elf
    static = tmp_path / "build-phone" / "zl_runner"
    static.parent.mkdir()
    static.write_bytes(host_elf.read_bytes())
    assert zdeploy.android_runner_binary() == static  # the static build first: the one tested under qemu


# --- CLI ------------------------------------------------------------------------------------------------


def test_cli_deploy_and_pull_local(tmp_path):
    export, configs = make_export(tmp_path), make_configs(tmp_path)
    runner = tmp_path / "fake_runner"
    runner.write_bytes(b"#!/bin/sh\n")
    run = tmp_path / "run"
    result = CliRunner().invoke(cli_app(), ["deploy", "--devices", "local:2", "--export", str(export), "--configs",
                                            str(configs), "--run-dir", str(run), "--runner", str(runner)])
    assert result.exit_code == 0, result.output
    assert "local-0: stage 0: pushed 6 files" in result.stdout and "config stage_0.json" in result.stdout
    (run / "devices" / "local-1" / "metrics.jsonl").write_text('{"stage": 1}\n')
    result = CliRunner().invoke(cli_app(), ["pull", "--devices", "local:2", "--out", str(run)])
    assert result.exit_code == 0, result.output
    assert (run / "logs" / "local-1" / "metrics.jsonl").read_text() == '{"stage": 1}\n'
    result = CliRunner().invoke(cli_app(), ["deploy", "--devices", "local:2", "--export", str(export)])
    assert isinstance(result.exception, ZLError) and "--run-dir" in str(result.exception)
    result = CliRunner().invoke(cli_app(), ["pull", "--devices", "local:3", "--out", str(run)])
    assert isinstance(result.exception, ZLError) and "local-2 does not exist" in str(result.exception)


def test_cli_deploy_refuses_a_host_runner_for_phones(tmp_path):
    """`zl deploy --runner` checks a phone's runner before any adb call, as `zl train --runner` does."""
    result = CliRunner().invoke(cli_app(), ["deploy", "--devices", "R58M123", "--export", str(make_export(tmp_path)),
                                            "--runner", sys.executable])
    assert isinstance(result.exception, ZLError), result.output
    assert "is not an AArch64 ELF executable" in str(result.exception)


# --- the real zl_runner through the local backend -----------------------------------------------------------


@pytest.mark.slow
def test_real_runner_pipeline_on_local_devices(tmp_path):
    """deploy -> address plan -> start (last stage first) -> wait -> pull, with tiny-random stage programs."""
    from conftest import REPO, native_library_or_skip
    from test_runner import OPTIMIZER, RUN_ID, RUN_KEY, SEQ_LEN, export_programs

    runner = Path(os.environ.get("ZL_RUNNER_BIN", REPO / "build" / "runner" / "zl_runner"))
    if not runner.is_file():
        pytest.skip(f"{runner} not built (cmake --build build -j2 --target zl_runner, or set ZL_RUNNER_BIN)")
    native_library_or_skip()
    (tmp_path / "export").mkdir()
    export = export_programs(tmp_path / "export", 2)
    proc = subprocess.run([sys.executable, "-m", "zl.cli", "data", "--demo", "--model", "tiny-random", "--out",
                           str(tmp_path / "data"), "--seq-len", str(SEQ_LEN), "--truncate", "--split", "train"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (tmp_path / "run.key").write_text(RUN_KEY + "\n")

    devs = open_devices("local:2", tmp_path / "run")
    plan = plan_addresses(devs, stage_port=free_port() - 1, coordinator_port=None)
    configs = {}
    for k, addresses in enumerate(plan.stages):
        configs[k] = {"stage_index": k, "num_stages": 2, "run_key_file": str(tmp_path / "run.key"), "run_id": RUN_ID,
                      "window_size": 2, "num_micro_batches": 4, "checkpoint_dir": "ckpt", "input_timeout_s": 60,
                      "threads": 1, "optimizer": OPTIMIZER, "link_profile": devs[k].link_profile,
                      **addresses.config_fields()}
    configs[0]["data_shard"] = str(tmp_path / "data" / "train.safetensors")
    zdeploy.deploy(devs, export, configs, runner=runner)
    devs[1].start_runner("stage_1.json")
    deadline = time.monotonic() + 60
    while '"listening"' not in devs[1].runner_output():
        assert devs[1].is_running() and time.monotonic() < deadline, devs[1].read_text("runner.err")
        time.sleep(0.05)
    devs[0].start_runner("stage_0.json")
    try:
        for dev in devs:
            assert dev.wait(120), f"{dev.name} still running"
            assert dev.exit_code() == 0, dev.read_text("runner.err")
    finally:
        for dev in devs:
            dev.kill_runner()
    pulled = zdeploy.pull(devs, tmp_path / "run")
    for k in range(2):
        windows = sorted(p.name for p in pulled[k].checkpoint_dirs[k].iterdir())
        assert windows and all(w.startswith("window_") for w in windows), windows
        lines = (tmp_path / "run" / "logs" / f"local-{k}" / "metrics.jsonl").read_text().splitlines()
        assert lines and all(json.loads(line) for line in lines)
        assert '"done"' in (tmp_path / "run" / "logs" / f"local-{k}" / "runner.out").read_text()


def test_local_ports_stay_out_of_the_kernels_ephemeral_range(tmp_path, monkeypatch):
    """A port the kernel may give any outgoing connection is no place for a runner to listen: free when checked,
    some client's when bound."""
    from zl_device.devices import network

    low, high = network._ephemeral_ports()
    assert low < high
    bases = [network.free_port_base(3) for _ in range(200)]
    assert all(b + 2 < low or b > high for b in bases)
    assert min(bases) >= 20000 and max(bases) + 3 <= 60000
    (tmp_path / "range").write_text("not numbers\n")
    assert network._ephemeral_ports(str(tmp_path / "range")) == (32768, 60999)
