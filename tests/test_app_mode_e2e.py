"""`zl train --mode app` end to end on three emulated phones (tests/emulated_phone.py).

Each phone is a folder on this host with Android's commands stubbed and the app's real native side
(libzl_jni.so, driven by AppStageDriver in a JVM) started by `am` intents, so the run goes through
`AppDevice` exactly as on phones: install, PREPARE, push, START, pidof/runner.exit polling, force-stop,
START with resume, pull. The adapter must be bit-identical to the same run on `--devices local:3`
(zl_runner, mode binary), with and without a stage killed mid-window.

    .venv/bin/python -m pytest -q tests/test_app_mode_e2e.py
"""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from emulated_phone import AppRuntime, EmulatedPhone, emulated_client
from test_runner import jni_host_classes
from test_train import adapter_tensors, clean_run, data_file, export_cache, train  # noqa: F401 (fixtures)
from zl_device.devices import adb as zadb
from zl_device.devices import network
from zl_device.devices.network import free_port_base

SERIALS = ("zlemu-0", "zlemu-1", "zlemu-2")


@pytest.fixture()
def phones(tmp_path, monkeypatch) -> list[EmulatedPhone]:
    """Three emulated phones with nothing installed, the ones the adb server lists; an APK to install."""
    java = shutil.which("java")
    if java is None:
        pytest.skip("no `java` on PATH: the app's native side runs in a JVM here (apt install openjdk-17-jdk)")
    library, classes = jni_host_classes()
    app = AppRuntime(java, library, classes)
    phones = [EmulatedPhone(s, tmp_path / "phones" / s, f"127.0.0.{2 + i}", app) for i, s in enumerate(SERIALS)]
    monkeypatch.setattr(zadb, "connect", lambda start=True: emulated_client(phones))
    apk = tmp_path / "app-debug.apk"
    with zipfile.ZipFile(apk, "w") as z:
        z.writestr("AndroidManifest.xml", "<manifest package='com.zerolock.zl'/>")
    monkeypatch.setenv("ZL_ANDROID_APK", str(apk))
    # A zl_runner must not be needed: deploy would fail on this path if app mode fell back to the binary.
    monkeypatch.setenv("ZL_ANDROID_RUNNER", str(tmp_path / "not-built" / "zl_runner"))
    # Phones listen on fixed ports (7100 + k); all emulated phones share this host, where those may be taken.
    plan = network.plan_addresses
    monkeypatch.setattr(network, "plan_addresses",
                        lambda devices, **kw: plan(devices, stage_port=free_port_base(len(devices)), **kw))
    yield phones
    for phone in phones:
        phone.close()


def events_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_adapter(run_dir: Path, reference: Path) -> None:
    want, got = adapter_tensors(reference), adapter_tensors(run_dir)
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def assert_ran_in_the_app(phone: EmulatedPhone, stage: int, starts: int) -> None:
    """The stage ran `starts` times in the app's JVM, ended with runner.exit 0, and no zl_runner was involved."""
    launched = phone.app_starts()
    assert len(launched) == starts, launched
    assert [s.resume for s in launched] == [False] + [True] * (starts - 1)
    assert {s.config for s in launched} == {f"/sdcard/Android/data/com.zerolock.zl/files/stage_{stage}.json"}
    files = phone.files_dir
    assert (files / "runner.pid").read_text() == f"{launched[-1].pid}\n"  # written by the JVM itself (getpid)
    assert (files / "runner.exit").read_text() == "0\n"
    assert json.loads((files / "runner.out").read_text().splitlines()[-1])["event"] == "done"
    assert f"app: stage {stage} of 3" in (files / "runner.err").read_text()
    assert json.loads((files / f"stage_{stage}.json").read_text())["program"] == f"stage_{stage}.pte"
    assert json.loads((files / "app.json").read_text())["package"] == "com.zerolock.zl"
    assert not any(p.name == "zl_runner" for p in phone.root.rglob("*"))
    assert not any("zl_runner" in c for c in phone.commands), [c for c in phone.commands if "zl_runner" in c]
    assert sum(c.startswith("pm install") for c in phone.commands) == 1
    assert not [p for p in phone.pushed if p.startswith("/data/local/tmp/zerolock")]
    # The run key went with START into the app's private storage, never into the shared files folder, and
    # left with the run (as did the data shard and input logs).
    assert any(" --es run_key " in c for c in phone.commands if "action.START" in c)
    assert not [p for p in phone.pushed if p.endswith("run.key")]
    assert not (files / "run.key").exists() and not (phone.state / "private" / "run.key").exists()
    assert not (files / "train.safetensors").exists() and not list(files.rglob("input_log"))


def test_app_mode_on_emulated_phones_trains_like_local_devices(clean_run, export_cache, data_file, phones, tmp_path):
    result = train(tmp_path / "run", export_cache, data=str(data_file), devices=",".join(SERIALS), mode="app")
    assert_same_adapter(result.run_dir, clean_run.run_dir)
    for k, phone in enumerate(phones):
        assert_ran_in_the_app(phone, k, starts=1)
        assert (result.run_dir / "logs" / phone.serial / "runner.exit").read_text() == "0\n"
        # The app's service holds a wake lock: the phone's sleep settings are not touched (binary mode's are).
        assert not [c for c in phone.commands if "settings " in c or "keyevent" in c], phone.commands
    run = next(e for e in events_of(result.run_dir) if e["type"] == "run")
    assert run["devices"] == list(SERIALS) and run["control_heartbeats"] == [True, True, True]
    assert not [e for e in events_of(result.run_dir) if e["type"] in ("failure", "restart")]
    # The stages talked over "Wi-Fi": stage k sends to phone k+1's own address.
    configs = [json.loads((result.run_dir / f"stage_{k}.json").read_text()) for k in range(3)]
    assert [c.get("downstream", "").split(":")[0] for c in configs] == ["127.0.0.3", "127.0.0.4", ""]


def test_app_mode_force_stop_and_resume_ends_identical(clean_run, export_cache, data_file, phones, tmp_path):
    result = train(tmp_path / "run", export_cache, data=str(data_file), devices=",".join(SERIALS), mode="app",
                   inject_failure="1@2")
    events = events_of(result.run_dir)
    kinds = [e["type"] for e in events if e["type"] in ("failure", "restart", "recovered")]
    assert kinds == ["failure", "restart", "recovered"], kinds
    failure = next(e for e in events if e["type"] == "failure")
    # AppDevice tells a crash by the app's process being gone without a runner.exit: -9.
    assert failure["stage"] == 1 and failure["window"] == 2 and failure["reason"] == "exited with status -9"
    restart = next(e for e in events if e["type"] == "restart")
    # Continued from its accumulator snapshot (read from the phone over adb): nothing done is replayed.
    assert restart["stage"] == 1 and restart["device"] == "zlemu-1" and restart["replayed_micro_batches"] == 0
    assert_same_adapter(result.run_dir, clean_run.run_dir)

    assert phones[1].commands.count("am force-stop com.zerolock.zl") == 1
    assert_ran_in_the_app(phones[1], 1, starts=2)  # START, then START --ez resume true
    # ... and restored its checkpoint of window 1 (the default for a config without "resume"; --resume forces it).
    err = (phones[1].files_dir / "runner.err").read_text()
    assert "resumed from checkpoint window 1 " in err
    assert "accumulator snapshot: window 2 continues at micro-batch 9 " in err
    for k in (0, 2):  # stage-local recovery: the neighbours kept running
        assert_ran_in_the_app(phones[k], k, starts=1)
        assert not any(c.startswith("am force-stop") for c in phones[k].commands)
    # The restarted stage continued window 2 at micro-batch 9, the one it was killed in, from its input log.
    stage1 = [e["micro_batch"] for e in events if e["type"] == "micro_batch" and e["stage"] == 1]
    assert stage1 == list(range(24)), stage1
