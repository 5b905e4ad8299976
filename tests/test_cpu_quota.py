"""CPU quotas per local device (issue 27 item 2): `--cpu-quota 1.0,0.5,0.75` caps each local device's runner, by a
cgroup where this host allows one, else by a SIGSTOP/SIGCONT duty cycle; bad values are one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import fake_v1
from zl_base.errors import ZLError
from zl_device.devices import cpu_quota
from zl_device.devices.cpu_quota import CgroupCap, ThrottleCap, cap_process, check_cpu_quota, quotas_per_device
from zl_device.devices.local import LocalDevice
from zl_device.devices.registry import open_devices, parse_devices

BUSY = """
import time
t = time.time()
while time.time() - t < 1.5:
    pass
print(time.process_time() / (time.time() - t))
"""


def busy_share(cap_with) -> float:
    """CPU time over wall time of a 1.5 s busy loop capped by `cap_with(pid)`."""
    proc = subprocess.Popen([sys.executable, "-c", BUSY], stdout=subprocess.PIPE, text=True)
    cap = cap_with(proc.pid)
    out, _ = proc.communicate()
    cap.release()
    return float(out)


def cgroup_usable() -> bool:
    root = cpu_quota.cgroup_cpu_root()
    return os.geteuid() == 0 and cpu_quota.has_cpu_controller(root) and os.access(root, os.W_OK)


def test_the_throttle_holds_a_busy_process_to_its_share():
    """A quarter of the wall time running: at most a quarter of a CPU (uncapped it would take a whole one)."""
    share = busy_share(lambda pid: ThrottleCap(pid, 0.25))
    assert 0.0 < share < 0.35


def test_the_throttle_never_leaves_a_process_stopped():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    cap = ThrottleCap(proc.pid, 0.01, period_s=0.5)  # stopped 99% of the time
    time.sleep(0.1)
    cap.release()
    state = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    proc.kill()
    proc.wait()
    assert state != "T"


@pytest.mark.skipif(not cgroup_usable(), reason="needs root and a writable cgroup cpu controller")
def test_the_cgroup_caps_a_busy_process_and_is_removed_after():
    share = busy_share(lambda pid: cap_process(pid, 0.25, "test", mechanism="cgroup"))
    assert share < 0.35
    base = cpu_quota.cgroup_cpu_root() / cpu_quota.GROUP_BASE
    assert not [g for g in base.glob("test-*") if g.is_dir()]


def test_a_cgroup_group_per_runner_with_its_quota_and_stale_groups_removed(tmp_path):
    root = fake_v1(tmp_path)
    stale = root / cpu_quota.GROUP_BASE / f"local-9-{2**22 + 7}"  # a runner long gone (pid beyond pid_max)
    stale.mkdir(parents=True)
    live = root / cpu_quota.GROUP_BASE / f"local-8-{os.getpid()}"  # one whose runner lives
    live.mkdir()
    cap = cap_process(os.getpid(), 0.75, "local-1", root=root, mechanism="cgroup")
    assert isinstance(cap, CgroupCap) and cap.group.name == f"local-1-{os.getpid()}"
    assert (cap.group / "cpu.cfs_quota_us").read_text() == "7500"
    assert (cap.group / "cpu.cfs_period_us").read_text() == str(cpu_quota.PERIOD_US)
    assert (cap.group / "cgroup.procs").read_text() == str(os.getpid())
    assert not stale.exists() and live.exists()


def test_without_a_cgroup_the_quota_falls_back_to_the_throttle(tmp_path, caplog):
    root = tmp_path / "unified"
    root.mkdir()
    (root / "cgroup.controllers").write_text("memory pids\n")  # v2 without the cpu controller
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        cap = cap_process(proc.pid, 0.5, "local-0", root=root)
        assert cap.mechanism == "throttle"
        cap.release()
        with pytest.raises(ZLError, match=r"--cpu-quota: no cpu controller at .*; it needs root or a delegated"):
            cap_process(proc.pid, 0.5, "local-0", root=root, mechanism="cgroup")
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(ZLError, match=r"ZL_CPU_QUOTA=fast: expected one of auto, cgroup, throttle"):
        cap_process(os.getpid(), 0.5, "x", mechanism="fast")


@pytest.mark.parametrize("values, message", [
    ((0.0,), r"--cpu-quota 0: 0 is out of range"),
    ((0.5, float("nan")), r"--cpu-quota 0.5,nan: nan is out of range"),
    ((float(os.cpu_count() + 1),), r"at most this host's \d+"),
    ((), r"--cpu-quota is empty"),
    ((1.0, 0.0001), r"--cpu-quota 1,0.0001: 0.0001 CPU is below the floor of 0.1 CPU a device can work at .*"
                    r"e\.g\. --cpu-quota 0\.1\.$"),  # accepted once: the plan then took 85 s
])
def test_quotas_out_of_range_are_one_line_errors(values, message):
    with pytest.raises(ZLError, match=message):
        check_cpu_quota(values)


def test_quotas_are_one_for_all_or_one_each():
    assert quotas_per_device((0.5,), 3) == [0.5, 0.5, 0.5]
    assert quotas_per_device((1.0, 0.5, 0.75), 3) == [1.0, 0.5, 0.75]
    assert quotas_per_device(None, 2) == [None, None]
    with pytest.raises(ZLError, match=r"--cpu-quota 1,0.5: 2 values for 3 local devices"):
        quotas_per_device((1.0, 0.5), 3)


def test_local_devices_get_their_quota_and_phones_none(tmp_path):
    devices = open_devices("local:3", tmp_path, cpu_quota=(1.0, 0.5, 0.75))
    assert [d.cpu_quota for d in devices] == [1.0, 0.5, 0.75]
    assert "quota 0.5 CPU" in devices[1].info().note
    with pytest.raises(ZLError, match="phones run at their own speed"):
        open_devices("SERIAL1,SERIAL2", cpu_quota=(0.5,), client=object())
    from zl_device.devices.registry import check_cpu_quota_fits

    assert check_cpu_quota_fits(parse_devices("A1,B2"), None) == [None, None]


def test_a_local_runner_is_capped_from_its_start_and_released_at_its_end(tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_quota.MECHANISM_ENV, "throttle")  # the same on every host
    device = LocalDevice("local-0", tmp_path / "d", runner=[sys.executable, "-c", BUSY], cpu_quota=0.25)
    device.write_text("stage_0.json", "{}")
    device.start_runner("stage_0.json")
    assert device.cap_mechanism == "throttle"
    assert device.wait(30)
    assert device.exit_code() == 0 and not device._caps  # released once it ended
    share = float(device.runner_output().strip())
    assert share < 0.35


def test_train_settings_check_the_quota(tmp_path):
    from zl_device.run.train_settings import TrainSettings

    TrainSettings(cpu_quota=(1.0, 0.5, 0.75)).validate()
    with pytest.raises(ZLError, match=r"--cpu-quota 1,0.5: 2 values for 3 local devices"):
        TrainSettings(cpu_quota=(1.0, 0.5)).validate()
    with pytest.raises(ZLError, match="--cpu-quota caps local zl_runner devices; the torch runtime"):
        TrainSettings(cpu_quota=(0.5,), runtime="torch").validate()
    with pytest.raises(ZLError, match="phones run at their own speed"):
        TrainSettings(cpu_quota=(0.5,), devices="A1,B2,C3").validate()
