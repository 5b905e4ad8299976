"""zl_study/emulated_devices.py: the CPU quota per rank and the shaped loopback link of the benchmarks.

The placement logic runs against fake cgroup trees (v1 and v2) with real processes; the quota's effect is checked
on the host's own cgroups where this runs as root; the shaped link (it slows the whole host's loopback) only in
the slow suite.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import fake_v1, load_tool
from zl_base.errors import ZLError
from zl_study import emulated_devices as emulated


@pytest.fixture
def rank_process():
    """A child whose command line names zl_runner, as a rank's would, below a shell (a grandchild of this one)."""
    proc = subprocess.Popen(["sh", "-c", '"$PY" -c "import time; time.sleep(60)" "$NAME"; :'],
                            env={**os.environ, "PY": sys.executable, "NAME": "zl_runner"})
    deadline = time.time() + 10
    while time.time() < deadline:
        ranks = [p for p in emulated.descendants(os.getpid()) if "zl_runner" in emulated.command_line(p)]
        if ranks:
            break
        time.sleep(0.02)
    assert ranks, "the child never showed up in /proc"
    yield proc, ranks[0]
    os.kill(ranks[0], signal.SIGKILL)
    proc.wait()


def test_descendants_include_grandchildren_and_the_command_lines_are_read(rank_process):
    shell, rank = rank_process
    below = emulated.descendants(os.getpid())
    assert shell.pid in below and rank in below
    assert os.getpid() not in below
    assert emulated.command_line(rank).endswith("zl_runner ")
    assert not emulated.RANK_COMMAND.search(emulated.command_line(shell.pid))
    assert emulated.command_line(2**22 + 1) == ""  # no such process


def test_each_rank_gets_a_group_of_its_own_with_the_quota_v1(tmp_path, rank_process):
    shell, rank = rank_process
    root = fake_v1(tmp_path)
    with emulated.CpuQuota(0.66, root=root) as quota:
        quota.place_new()
        quota.place_new()  # placed once only
        assert quota.placed == 1  # the rank, not the shell above it
        (group,) = (root / f"zl-bench-{os.getpid()}").iterdir()
        assert (group / "cgroup.procs").read_text() == str(rank)
        assert int((group / "cpu.cfs_quota_us").read_text()) == round(0.66 * emulated.PERIOD_US)
        assert int((group / "cpu.cfs_period_us").read_text()) == emulated.PERIOD_US
    assert (root / "cgroup.procs").read_text() == str(rank)  # back to the root group, still alive


def test_cgroup_v2_uses_cpu_max_and_hands_the_controller_down(tmp_path, rank_process):
    shell, rank = rank_process
    root = tmp_path / "unified"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory\n")
    with emulated.CpuQuota(0.5, root=root) as quota:
        quota.place_new()
        (group,) = (root / f"zl-bench-{os.getpid()}").glob("rank-*")
        assert (group / "cpu.max").read_text() == f"{emulated.PERIOD_US // 2} {emulated.PERIOD_US}"
        assert (root / "cgroup.subtree_control").read_text() == "+cpu"
        assert (group.parent / "cgroup.subtree_control").read_text() == "+cpu"


def test_a_host_without_the_cpu_controller_or_rights_gets_a_clear_error(tmp_path):
    root = tmp_path / "unified"
    root.mkdir()
    (root / "cgroup.controllers").write_text("memory pids\n")
    with pytest.raises(ZLError, match=r"no cpu controller at .*run without --cpus-per-rank"):
        emulated.CpuQuota(0.5, root=root).__enter__()
    with pytest.raises(ZLError, match=r"--cpus-per-rank 0: give a positive number"):
        emulated.CpuQuota(0)


def test_no_rights_to_the_cgroup_tree_is_a_clear_error(tmp_path):
    locked = fake_v1(tmp_path)
    os.chmod(locked, 0o500)
    try:
        if os.access(locked, os.W_OK):  # root writes anyway
            pytest.skip("root ignores the directory's mode")
        with pytest.raises(ZLError, match=r"cannot create the control group .*needs root"):
            emulated.CpuQuota(0.5, root=locked).__enter__()
    finally:
        os.chmod(locked, 0o700)


BUSY = """
import time, resource
t = time.time()
while time.time() - t < 1.5:
    pass
print(time.process_time() / (time.time() - t))
"""


def test_the_quota_caps_a_rank_on_this_host():
    """A busy loop under a quota of 0.25 CPUs gets about a quarter of a CPU (uncapped it takes a whole one)."""
    root = emulated.cgroup_cpu_root()
    if os.geteuid() != 0 or not ((root / "cpu.cfs_quota_us").is_file() or
                                 "cpu" in emulated._read(root / "cgroup.controllers").split()):
        pytest.skip("needs root and the cgroup cpu controller")
    with emulated.CpuQuota(0.25, poll_s=0.005) as quota:
        out = subprocess.run([sys.executable, "-c", BUSY, "zl_runner"], capture_output=True, text=True, check=True)
        assert quota.placed == 1
    assert float(out.stdout) < 0.4
    assert not any(root.glob(f"zl-bench-{os.getpid()}"))  # removed


class FakeTc:
    def __init__(self, shown="qdisc noqueue 0: root refcnt 2 \n", add_rc=0):
        self.calls, self.shown, self.add_rc = [], shown, add_rc

    def __call__(self, cmd, **kwargs):
        self.calls.append(cmd[1:])
        if cmd[1:3] == ["qdisc", "show"]:
            return subprocess.CompletedProcess(cmd, 0, self.shown, "")
        if cmd[1:3] == ["qdisc", "add"]:
            return subprocess.CompletedProcess(cmd, self.add_rc, "", "RTNETLINK answers: Operation not permitted")
        return subprocess.CompletedProcess(cmd, 0, "", "")


def test_the_link_is_shaped_while_the_block_runs_and_restored_after():
    tc = FakeTc()
    with emulated.ShapedLoopback(50, run=tc) as link:
        add = tc.calls[-1]
        assert add[:6] == ["qdisc", "add", "dev", "lo", "root", "tbf"]
        assert add[add.index("rate") + 1] == "50mbit"
        assert int(add[add.index("burst") + 1]) >= 2 * 1500  # at least two packets of the device
        assert link.added
    assert tc.calls[-1] == ["qdisc", "del", "dev", "lo", "root"]
    tc = FakeTc()
    with pytest.raises(RuntimeError):
        with emulated.ShapedLoopback(50, run=tc):
            raise RuntimeError("a pipeline failed")
    assert tc.calls[-1] == ["qdisc", "del", "dev", "lo", "root"]  # restored on failure too


def test_the_link_never_replaces_a_qdisc_it_did_not_add_and_names_what_is_missing():
    tc = FakeTc(shown="qdisc netem 8001: root refcnt 2 limit 1000 delay 100ms\n")
    with pytest.raises(ZLError, match=r"lo already has a root qdisc \(qdisc netem 8001.*tc qdisc del dev lo root"):
        emulated.ShapedLoopback(50, run=tc).__enter__()
    assert not any(call[:2] == ["qdisc", "add"] for call in tc.calls)
    tc = FakeTc(add_rc=2)
    with pytest.raises(ZLError, match=r"failed: RTNETLINK answers: Operation not permitted; it needs root"):
        emulated.ShapedLoopback(50, run=tc).__enter__()
    assert not any(call[:2] == ["qdisc", "del"] for call in tc.calls)
    with pytest.raises(ZLError, match=r"--link-mbit -1: give the shared link's bandwidth"):
        emulated.ShapedLoopback(-1)


def loopback_mbit(nbytes: int) -> float:
    """Mbit/s of one TCP transfer of `nbytes` over 127.0.0.1."""
    server = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def sink():
        conn, _ = server.accept()
        got = 0
        while got < nbytes:
            got += len(conn.recv(1 << 20))
        conn.sendall(b"k")
        done.set()

    threading.Thread(target=sink, daemon=True).start()
    client = socket.create_connection(server.getsockname())
    start = time.time()
    client.sendall(b"x" * nbytes)
    client.recv(1)
    return nbytes * 8 / 1e6 / (time.time() - start)


@pytest.mark.slow
def test_the_shaped_loopback_carries_about_its_rate():
    if os.geteuid() != 0 or subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True).returncode:
        pytest.skip("needs root and tc")
    with emulated.ShapedLoopback(40) as link:
        shaped = loopback_mbit(5_000_000)
        assert link.sent_bytes() >= 5_000_000
    assert 25 < shaped < 48
    assert loopback_mbit(5_000_000) > 200  # and back to loopback's speed


def test_the_bench_refuses_a_quota_or_link_that_is_not_positive_before_any_work(capsys):
    bench = load_tool("bench_pipelines")
    for flag in ("--cpus-per-rank", "--link-mbit"):
        with pytest.raises(SystemExit):
            bench.main([flag, "0", "--out", "/nonexistent/never-made"])
        assert f"{flag} 0: give a positive number" in capsys.readouterr().err
