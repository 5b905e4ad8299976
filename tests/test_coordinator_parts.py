"""The coordinator's parts on their own (zl_device/executorch/: health.py, pauses.py, recovery.py over stage_table.py;
docs/design#coordinator): each takes what the loop hands it and returns what it found or what the loop is to do next;
none acts for another. The runs that go through the whole loop are in test_train.py, test_device_policy.py and
test_runner_schedules.py."""

from __future__ import annotations

import signal
import time
from types import SimpleNamespace

from zl_device.executorch.device_policy import DevicePolicy
from zl_device.formats.windows import WindowPlan


class FakeDevice:
    """A device whose runner's exit status the test sets; records what is asked of it."""

    files_on_host, supports_standby = True, False

    def __init__(self, name: str, code: int | None = None):
        self.name, self.code, self.calls = name, code, []

    def exit_code(self):
        return self.code

    def kill_runner(self, timeout_s: float = 10.0):
        self.calls.append("kill")

    def signal_runner(self, sig: int) -> bool:
        self.calls.append(("signal", sig))
        return True

    def start_runner(self, config: str, resume: bool = False) -> None:
        self.calls.append(("start", config, resume))

    def stop_runner(self, timeout_s: float = 10.0) -> None:
        self.calls.append("stop")

    def has_standby(self) -> bool:
        return False

    def read_from(self, path: str, offset: int) -> bytes:
        return b""

    def read_text(self, path: str) -> str | None:
        return None

    def listdir(self, path: str = ".") -> list[str]:
        return []

    def exists(self, path: str) -> bool:
        return False


def _coordinator(devices, **kwargs):
    from zl_device.executorch.coordinator import Coordinator, StagePlan

    plans = [StagePlan(k, d, f"stage_{k}.json", "metrics.jsonl", "checkpoints", 1) for k, d in enumerate(devices)]
    c = Coordinator(plans, WindowPlan(32, 4), **kwargs)
    for s in c.status:
        s.state = "running"
    return c


def test_health_says_what_it_found_and_does_nothing_about_it():
    """Exit 0, exit 2, a kill (-9), a silent runner, a beating one: a verdict each (the silent one to be killed
    first), and no runner killed, no state changed by the checks."""
    devices = [FakeDevice("done", 0), FakeDevice("bad", 2), FakeDevice("killed", -9), FakeDevice("silent"),
               FakeDevice("fine")]
    c = _coordinator(devices, heartbeat_timeout_s=30.0)
    now = time.monotonic()
    for s in c.status:
        s.heartbeat_seen, s.last_sign_of_life = True, now
    c.status[3].last_sign_of_life = now - 31
    verdicts = [c.health.check_stage(k, now) for k in range(5)]
    assert [(v.kind, v.code, v.kill) for v in verdicts[:4]] == [("finished", 0, False), ("fatal", 2, False),
                                                                ("failed", -9, False), ("failed", None, True)]
    assert verdicts[1].why.startswith("stage 1 on bad stopped with exit status 2 (a bad configuration")
    assert [v.why for v in verdicts[2:4]] == ["exited with status -9", "heartbeat timeout"]
    assert verdicts[4] is None
    assert all(d.calls == [] for d in devices) and all(s.state == "running" for s in c.status)


def test_a_pause_is_a_state_machine_the_loop_feeds_and_its_restart_is_the_loops():
    """Stage 1's device runs hot: pausing, then stopped (SIGTERM) once it commits, paused when its runner exits 3;
    back in range, `step` hands it to the loop to start (the pauses start nothing themselves), and the pause's
    event says whether a standby took over."""
    from zl_device.devices.readings import DeviceReadings

    devices = [FakeDevice("local-0"), FakeDevice("local-1")]
    temperature = {"local-0": 35.0, "local-1": 50.0}
    real = DevicePolicy(max_temperature_c=45.0)
    policy = SimpleNamespace(active=True, read_every_s=1e-9, breach=real.breach, holds=real.holds,
                             read=lambda d: DeviceReadings(temperature_c=temperature[d.name]))
    c = _coordinator(devices, policy=policy)
    pauses, s = c.pauses, c.status[1]
    assert pauses.step(time.monotonic()) == [] and s.state == "pausing" and "50.0 °C" in s.pause_reason
    s.last_committed_window = 0  # it committed the window it was in
    assert pauses.step(time.monotonic()) == [] and devices[1].calls == [("signal", signal.SIGTERM)]
    assert pauses.stopping(1) and not pauses.stopping(0)
    pauses.stopped(1)  # its runner exited 3: the loop tells the pauses
    assert s.state == "paused" and s.paused_since is not None
    temperature["local-1"] = 40.0
    (resume,) = pauses.step(time.monotonic())
    assert resume.stage == 1 and s.state == "restarting" and not pauses.stopping(1)
    assert ("start", "stage_1.json", True) not in devices[1].calls  # the loop's to do, through the recovery
    pauses.resumed(resume, took_over=True)
    (event,) = c.events
    assert (event["type"], event["stage"], event["kind"], event["standby"]) == ("pause", 1, "temperature", True)


def test_the_loop_restarts_a_failed_stage_and_rearms_its_pause():
    """A stage asked to pause fails before it stops: the recovery restarts it and returns the window it resumes
    after; the loop rearms the pause there (it will pause after its next commit), so no part calls another."""
    from zl_device.executorch.pauses import Pause

    devices = [FakeDevice("local-0", -9), FakeDevice("local-1")]
    c = _coordinator(devices)
    c.status[0].last_committed_window = 2
    c.pauses.pauses[0] = Pause("temperature", "hot", 1, time.monotonic(), 0, stop_t=time.monotonic())
    c._check_health()
    assert ("start", "stage_0.json", True) in devices[0].calls and devices[1].calls == []
    assert c.status[0].state == "restarting" and c.status[0].restarts == 1
    pause = c.pauses.pauses[0]
    assert pause.stop_t is None and pause.after_window == 2
    assert [e["type"] for e in c.events] == ["failure", "restart"] and c.events[0]["reason"] == "exited with status -9"
