"""`zl train --mode binary --standby` end to end on three emulated phones (tests/emulated_phone.py).

Each phone is a folder on this host whose `adb shell` is a real `sh` with device paths rewritten; the host
build of zl_runner stands in for the arm64 one, so the run goes through `AdbDevice` exactly as on phones:
push to /data/local/tmp/zerolock, the `nohup` wrapper shells, runner.pid / runner.exit, a hot standby per
stage (standby.pid), SIGKILL of a stage, the standby's take-over over `adb shell`, pull. The adapter must be
bit-identical to the same run on `--devices local:3`.

    .venv/bin/python -m pytest -q tests/test_binary_mode_e2e.py
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from emulated_phone import AppRuntime, EmulatedPhone, emulated_client
from test_train import RUNNER, adapter_tensors, clean_run, data_file, export_cache, train  # noqa: F401 (fixtures)
from zl_device.devices import adb as zadb
from zl_device.devices import deploy as zdeploy
from zl_device.devices import network
from zl_device.devices.network import free_port_base

SERIALS = ("zlemu-0", "zlemu-1", "zlemu-2")
WORKDIR = zadb.REMOTE_ROOT


@pytest.fixture()
def phones(tmp_path, monkeypatch) -> list[EmulatedPhone]:
    """Three emulated phones the adb server lists; deploy pushes the host zl_runner as theirs."""
    no_app = AppRuntime("java", tmp_path / "no-app" / "libzl_jni.so", tmp_path / "no-app")  # binary mode: unused
    phones = [EmulatedPhone(s, tmp_path / "phones" / s, f"127.0.0.{2 + i}", no_app) for i, s in enumerate(SERIALS)]
    monkeypatch.setattr(zadb, "connect", lambda start=True: emulated_client(phones))
    monkeypatch.setattr(zdeploy, "android_runner_binary", lambda: RUNNER)
    # Phones listen on fixed ports (7100 + k); all emulated phones share this host, where those may be taken.
    plan = network.plan_addresses
    monkeypatch.setattr(network, "plan_addresses",
                        lambda devices, **kw: plan(devices, stage_port=free_port_base(len(devices)), **kw))
    yield phones
    for phone in phones:  # a test that failed half-way: no runner or standby outlives it
        for name in ("runner.pid", "standby.pid"):
            pid_file = phone.local(f"{WORKDIR}/{name}")
            text = pid_file.read_text().strip() if pid_file.is_file() else ""
            if text.isdigit() and Path(f"/proc/{text}/cwd").exists():
                try:
                    if os.readlink(f"/proc/{text}/cwd") == str(phone.local(WORKDIR)):
                        os.kill(int(text), signal.SIGKILL)
                except OSError:
                    pass


@pytest.mark.parametrize("recovery", ["local", "global"])
def test_binary_mode_standby_takes_over_a_killed_stage_on_a_phone(clean_run, export_cache, data_file, phones,
                                                                  tmp_path, recovery):
    """As tests/test_train.py's hot standby test, on phones: the replacement of the killed stage (every stage,
    under global recovery) is the standby that loaded its program before the failure, told over `adb shell` to
    take over; it is the phone's runner from then on (runner.pid, runner.exit); the adapter is the clean run's."""
    phones[0].put_setting("system", "screen_off_timeout", "30000")  # its owner's: 30 s
    result = train(tmp_path / "run", export_cache, data=str(data_file), devices=",".join(SERIALS), mode="binary",
                   inject_failure="1@2", recovery=recovery, standby=True)
    for phone in phones:  # kept awake for the run (issue 56 item 6), and given its own settings back at the end
        awake = [c for c in phone.commands if "settings put global stay_on_while_plugged_in 7" in c]
        assert len(awake) == 1 and "settings put system screen_off_timeout 2147483647" in awake[0], phone.commands
        assert (phone.state / "keyevents").read_text() == "KEYCODE_WAKEUP\n"
        assert phone.setting("global", "stay_on_while_plugged_in") is None  # it had none
        assert phone.setting("system", "screen_off_timeout") == ("30000" if phone is phones[0] else None)
        assert not phone.local(f"{WORKDIR}/{zadb.AWAKE_FILE}").exists()
    events = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    failure = next(e for e in events if e["type"] == "failure")
    assert failure["stage"] == 1 and failure["reason"] == "exited with status -9", failure
    restarts = [e for e in events if e["type"] == "restart"]  # global: one event, standby = every stage's took over
    assert [e["stage"] for e in restarts] == [1] and restarts[0]["standby"] is True, restarts
    restarted = [1] if recovery == "local" else [0, 1, 2]
    assert [e["type"] for e in events].count("recovered") == 1
    for k, phone in enumerate(phones):
        starts = [e for e in events if e["type"] == "start" and e["stage"] == k]
        workdir = phone.local(WORKDIR)
        took_over = [c for c in phone.commands if "kill -USR1" in c]
        assert len(took_over) == (k in restarted), (k, took_over)
        assert any(" --standby " in c for c in phone.commands), k  # every stage had a standby
        assert not (workdir / "standby.pid").exists(), f"stage {k}'s standby outlived the run"
        # The stage's last runner (the standby that took over, where one did) ended well: its status in runner.exit.
        assert (workdir / "runner.exit").read_text() == "0\n", k
        assert not (workdir / "standby.exit").exists(), k  # no standby ended on its own
        out = (workdir / "runner.out").read_text()
        # One "done": the killed runner printed none (a new standby may print its line after the "done").
        assert [json.loads(line)["event"] for line in out.splitlines()].count("done") == 1, (k, out)
        assert 1 <= out.count('"event": "standby"') <= 1 + (k in restarted), (k, out)
        if k not in restarted:
            assert len(starts) == 1, (k, starts)
            continue
        assert len(starts) == 2, (k, starts)
        first, replacement = starts
        # Loaded while the stage it replaced still ran; told to take over (SIGUSR1 over adb shell) after the kill.
        assert not first["standby"] and replacement["standby"] and replacement["resumed_from_window"] is not None
        assert replacement["program_loaded_unix_ms"] < failure["t_unix_ms"] <= replacement["took_over_unix_ms"] + 1
        assert (workdir / "runner.pid").read_text() == f"{replacement['pid']}\n"  # the phone's runner now
    clean, got = adapter_tensors(clean_run.run_dir), adapter_tensors(result.run_dir)
    assert got.keys() == clean.keys()
    for name, t in clean.items():
        assert torch.equal(got[name], t), name


def test_a_phone_kept_awake_gets_its_settings_back_when_the_run_fails_or_zl_was_killed(phones, tmp_path):
    """`kept_awake` puts each phone's own values back when the run inside fails; a zl killed before it could
    leaves them saved on the phone, and the next run restores from those, not from the values zl had set."""
    from zl_device.devices.adb import AWAKE_FILE, AdbDevice
    from zl_device.executorch.launch import kept_awake

    client = emulated_client(phones)
    devices = [AdbDevice(s, client) for s in SERIALS[:2]]
    phones[0].put_setting("global", "stay_on_while_plugged_in", "3")
    phones[0].put_setting("system", "screen_off_timeout", "60000")
    said = []
    with pytest.raises(RuntimeError, match="the run failed"), kept_awake(devices, said.append):
        assert phones[0].setting("system", "screen_off_timeout") == "2147483647"
        assert phones[1].setting("global", "stay_on_while_plugged_in") == "7"
        raise RuntimeError("the run failed")
    assert said == ["phones: zlemu-0, zlemu-1 kept awake (stays on while powered, no screen timeout) for the run; "
                    "their own settings come back when it ends"]
    assert (phones[0].setting("global", "stay_on_while_plugged_in"), phones[0].setting("system", "screen_off_timeout"),
            phones[1].setting("system", "screen_off_timeout")) == ("3", "60000", None)

    devices[0].keep_awake()  # ... and zl was killed here: no restore
    assert phones[0].local(f"{WORKDIR}/{AWAKE_FILE}").is_file()
    with kept_awake(devices[:1], said.append):  # the next run
        pass
    assert phones[0].setting("system", "screen_off_timeout") == "60000"  # the owner's, not 2147483647
    assert phones[0].setting("global", "stay_on_while_plugged_in") == "3"
    assert not phones[0].local(f"{WORKDIR}/{AWAKE_FILE}").exists()
