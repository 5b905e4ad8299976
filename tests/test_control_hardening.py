"""The control server against hostile peers (issue 28): a frame crafted to freeze the payload check, strangers
flooding the connection slots, and authenticated payloads with values out of range. Loopback only; every loop is
bounded in count and time."""

import json
import os
import queue
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.test_control import KEY, RUN, Runner, _closed_within, _connect, _next, _signed_raw, _up
from tests.test_frames import _crafted
from zl_device.formats import frames
from zl_device.executorch.control import ControlEvent, ControlServer
from zl_device.formats.frames import Frame, FrameType

REPO = Path(__file__).resolve().parent.parent


# --- item 1: one connection's payload must not freeze the coordinator ----------------------------------------------

def crafted_heartbeat_scenario() -> dict:
    """Stages 0 and 1 register; stage 0 (a key holder gone bad) sends the crafted 1 MiB HEARTBEAT while stage 1
    keeps sending heartbeats. Returns how long the rejection took and how late stage 1's heartbeats arrived."""
    with ControlServer(KEY, RUN) as server:
        hostile, other = Runner(server, 0), Runner(server, 1)
        hostile.send(FrameType.REGISTER)
        other.send(FrameType.REGISTER)
        assert {server.events.get(timeout=10).stage for _ in range(2)} == {0, 1}
        wire = _signed_raw(FrameType.HEARTBEAT, 0, _crafted(frames.MAX_JSON_BYTES), hostile.session, 1)
        rejected_after = []

        def attack() -> None:
            start = time.monotonic()
            hostile.write(wire)
            if _closed_within(hostile.sock, 30):  # the server closes the connection once the frame is rejected
                rejected_after.append(time.monotonic() - start)

        attacker = threading.Thread(target=attack, daemon=True)
        attacker.start()
        delays = []
        for i in range(10):  # 10 heartbeats 0.1 s apart: the parse of the crafted frame falls among them
            sent = time.monotonic()
            other.send(FrameType.HEARTBEAT, payload={"micro_batches_done": i})
            e = server.events.get(timeout=30)
            delays.append(time.monotonic() - sent)
            assert (e.stage, e.payload["micro_batches_done"]) == (1, i)
            time.sleep(0.1)
        attacker.join(timeout=30)
        return {"rejected_after_s": rejected_after[0] if rejected_after else None, "rejected": server.rejected,
                "max_heartbeat_delay_s": max(delays), "frame_bytes": len(wire)}


def test_a_crafted_1mib_heartbeat_is_rejected_quickly_and_other_stages_keep_being_heard():
    # On the old code the payload check held the interpreter lock for about an hour on this frame: nothing else in
    # the process ran. Run in a child process, so that such a freeze fails this test in 60 s instead of hanging it.
    code = ("import json; from tests.test_control_hardening import crafted_heartbeat_scenario as s; "
            "print(json.dumps(s()))")
    try:
        run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the coordinator's control server froze: no result within 60 s")
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    r = json.loads(run.stdout.decode().splitlines()[-1])
    assert r["rejected"] == ["bad_payload"] and r["frame_bytes"] > 1 << 20, r
    assert r["rejected_after_s"] is not None and r["rejected_after_s"] < 5.0, r  # measured: ~0.03 s
    assert r["max_heartbeat_delay_s"] < 2.0, r  # measured: ~0.02 s


# --- item 3: strangers cannot keep a stage from registering ------------------------------------------------------

class _Flood:
    """`threads` strangers on loopback, each keeping `per_thread` connections open that never send a byte and
    re-opening each one the server closes; at most `max_connections` per thread, until stop() or `max_s`."""

    def __init__(self, address, threads: int = 40, per_thread: int = 3, max_s: float = 15.0,
                 max_connections: int = 5000, source: str | None = None):
        self.address, self.per_thread, self.max_connections, self.source = address, per_thread, max_connections, source
        self.deadline = time.monotonic() + max_s
        self.opened = [0] * threads
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._one, args=(i,), daemon=True) for i in range(threads)]

    def __enter__(self) -> "_Flood":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)

    def wait_for(self, connections: int, timeout_s: float = 10.0) -> None:
        end = time.monotonic() + timeout_s
        while sum(self.opened) < connections and time.monotonic() < end:
            time.sleep(0.02)

    def _one(self, i: int) -> None:
        socks: list[socket.socket] = []
        try:
            while not self._stop.is_set() and time.monotonic() < self.deadline:
                while len(socks) < self.per_thread and self.opened[i] < self.max_connections:
                    try:
                        socks.append(socket.create_connection(
                            self.address, timeout=1, source_address=(self.source, 0) if self.source else None))
                        self.opened[i] += 1
                    except OSError:
                        time.sleep(0.01)
                        break
                if not socks:
                    if self.opened[i] >= self.max_connections:
                        return
                    continue
                readable, _, _ = select.select(socks, [], [], 0.05)
                for s in readable:  # the server closed it (it is sent nothing)
                    try:
                        s.recv(16)
                    except OSError:
                        pass
                    socks.remove(s)
                    s.close()
        finally:
            for s in socks:
                s.close()


def _register_with_retries(server: ControlServer, stage: int, within_s: float) -> float | None:
    """A restarted runner: connect, handshake, REGISTER, retrying with the runner's back-off (50 ms doubling to 2 s)
    until a REGISTER of `stage` is among the events. Returns the seconds it took, None when not within `within_s`."""
    start, backoff = time.monotonic(), 0.05
    while time.monotonic() - start < within_s:
        try:
            r = Runner(server, stage)  # its socket times out after 5 s
            r.send(FrameType.REGISTER, payload={"resume": True})
            end = time.monotonic() + 2
            while time.monotonic() < end:
                try:
                    e = server.events.get(timeout=0.1)
                except queue.Empty:
                    continue
                if (e.stage, e.type) == (stage, FrameType.REGISTER):
                    return time.monotonic() - start
        except (OSError, AssertionError, frames.FrameRejected):
            pass
        time.sleep(backoff)
        backoff = min(2.0, backoff * 2)
    return None


def test_a_restarted_stage_registers_within_seconds_while_strangers_flood_the_server():
    # The old server counted unauthenticated connections against its slots (launch.py: 16 for 3 stages) and held
    # each for 10 s: under this flood a restarted stage could not register for 60 s. Now strangers share a budget of
    # pending connections that newcomers push the oldest out of, and a runner's HELLO is read the moment it arrives.
    with ControlServer(KEY, RUN, max_connections=16) as server:
        steady = Runner(server, 1)  # a registered stage: its connection and heartbeats are untouched
        steady.send(FrameType.REGISTER)
        assert _next(server).stage == 1
        with _Flood(server.address) as flood:
            flood.wait_for(300)  # the slots are full and turning over
            took = _register_with_retries(server, 0, within_s=10.0)
            steady.send(FrameType.HEARTBEAT, payload={"micro_batches_done": 1})
            heard = [e for e in _drain(server, 5.0) if e.stage == 1]
            opened = sum(flood.opened)
    assert took is not None, f"stage 0 did not register within 10 s of flooding ({opened} connections opened)"
    assert [e.type for e in heard] == [FrameType.HEARTBEAT]
    assert server.pending_dropped["budget"] > 0, "the flood never filled the pending budget: nothing was tested"


def _drain(server: ControlServer, timeout_s: float, until_stage: int = 1) -> list[ControlEvent]:
    """Events until one of `until_stage` arrives or `timeout_s` passes."""
    out, end = [], time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            out.append(server.events.get(timeout=0.1))
        except queue.Empty:
            continue
        if out[-1].stage == until_stage:
            break
    return out


def test_a_flood_from_one_address_does_not_push_out_a_slow_hello_from_another():
    # Phones on Wi-Fi have addresses of their own: a newcomer over the budget pushes out the oldest connection of
    # the address with the most pending ones, so a stranger's flood pushes out its own, not a phone whose HELLO
    # takes a while (Wi-Fi latency; here 1 s). 127.0.0.2 is loopback too (Linux routes 127/8 to lo).
    with ControlServer(KEY, RUN) as server:
        with _Flood(server.address, max_s=10.0, source="127.0.0.2") as flood:
            flood.wait_for(300)  # the stranger has more connections open than the server lets wait
            phone = _connect(server)  # from 127.0.0.1
            time.sleep(1.0)
            hello = Frame(FrameType.HELLO, RUN, stage=0, session=os.urandom(16) + bytes(16))
            try:
                phone.sendall(frames.encode(hello, _up(0)))
                header = phone.recv(frames.HEADER_SIZE, socket.MSG_WAITALL)
            except OSError:
                header = b""
    assert len(header) == frames.HEADER_SIZE, "the phone's connection was closed before its HELLO was read"
    assert server.pending_dropped["budget"] > 0


def _late_hello(server: ControlServer, stage: int, late_s: float) -> bool:
    """A key holder whose HELLO leaves `late_s` after its connect (`adb reverse`, a slow phone link); True when the
    server's HELLO comes back, whole and verified."""
    sock = _connect(server)
    try:
        time.sleep(late_s)
        sock.sendall(frames.encode(Frame(FrameType.HELLO, RUN, stage=stage, session=os.urandom(16) + bytes(16)),
                                   _up(stage)))
        header = sock.recv(frames.HEADER_SIZE, socket.MSG_WAITALL)
        rest = sock.recv(frames.peek_length(header) - frames.HEADER_SIZE, socket.MSG_WAITALL)
        reply = frames.decode(header + rest, frames.derive_key(KEY, frames.KeyPurpose.CONTROL_DOWN, stage),
                              run_id=RUN, stage=frames.COORDINATOR_STAGE)
        return reply.type == FrameType.HELLO
    except (OSError, ValueError, frames.FrameRejected):
        return False
    finally:
        sock.close()


@pytest.mark.parametrize("late_s", [0.05, 0.5])
def test_a_late_hello_gets_in_while_strangers_flood_from_the_same_address(late_s):
    # Issue 43 item 5: under this flood from the key holder's own address, a HELLO 5 ms after its connect got in 19
    # times in 24 and one 30 ms after it never: newcomers pushed the oldest pending connection out, and the flood
    # turned all 64 over within milliseconds. Now the kernel hands a connection over with its first bytes
    # (TCP_DEFER_ACCEPT) and a whole HELLO starts its session on accept, without waiting among the strangers.
    if not hasattr(socket, "TCP_DEFER_ACCEPT"):
        pytest.skip("no TCP_DEFER_ACCEPT here (Linux has it): a late HELLO may be pushed out by a flood")
    with ControlServer(KEY, RUN) as server:
        with _Flood(server.address, max_s=15.0) as flood:  # 127.0.0.1, as the key holder
            flood.wait_for(300)  # more connections open than may wait, turning over
            got_in = [_late_hello(server, k % 3, late_s) for k in range(6)]
            opened = sum(flood.opened)
    assert all(got_in), f"{got_in.count(False)} of 6 HELLOs {late_s * 1e3:.0f} ms after the connect were pushed " \
                        f"out ({opened} strangers' connections opened)"
    assert server.pending_dropped["budget"] > 0, "the flood never filled the pending budget: nothing was tested"


def test_a_connection_without_a_hello_is_closed_after_the_hello_deadline():
    with ControlServer(KEY, RUN) as server:  # hello_timeout_s 3 s; auth_timeout_s, for the first frame after, 10 s
        silent = _connect(server)
        start = time.monotonic()
        assert _closed_within(silent, 8)
        assert time.monotonic() - start < 6
    assert server.pending_dropped["deadline"] == 1


def test_replayed_hellos_hold_at_most_two_connections_per_stage():
    # A recorded HELLO verifies (it is sealed with the key) and gets a thread until its first frame in the session
    # fails to come; replays of one beyond UNVERIFIED_PER_STAGE push out the oldest instead of adding threads.
    with ControlServer(KEY, RUN) as server:
        real = Runner(server, 0)
        recorded = real.sent  # its HELLO
        replays = []
        for _ in range(6):
            s = _connect(server)
            s.sendall(recorded)
            header = s.recv(frames.HEADER_SIZE, socket.MSG_WAITALL)  # the server's HELLO, whole
            assert len(s.recv(frames.peek_length(header) - frames.HEADER_SIZE, socket.MSG_WAITALL)) == frames.TAG_SIZE
            replays.append(s)
        still_open = [s for s in replays if not _closed_within(s, 0.5)]
        assert len(still_open) <= 2
        fresh = Runner(server, 0)  # the real runner reconnects and registers
        fresh.send(FrameType.REGISTER)
        assert _next(server).stage == 0


def test_a_hello_from_a_stage_the_run_does_not_have_is_refused():
    with ControlServer(KEY, RUN, num_stages=2) as server:
        s = _connect(server)
        s.sendall(frames.encode(Frame(FrameType.HELLO, RUN, stage=2, session=os.urandom(16) + bytes(16)), _up(2)))
        assert _closed_within(s, 3)
        assert server.rejected == ["wrong_stage"]


# --- item 4: values out of range in authenticated frames ---------------------------------------------------------

OUT_OF_RANGE = [
    # counts: micro-batches, windows, stages, pids, reconnects in [0, 2^31)
    (FrameType.HEARTBEAT, {"payload": {"micro_batches_done": (1 << 64) - 1}}),
    (FrameType.HEARTBEAT, {"payload": {"window": -1}}),
    (FrameType.REGISTER, {"payload": {"reconnects": 1 << 31}}),
    (FrameType.REGISTER, {"payload": {"pid": -7}}),
    (FrameType.WINDOW_COMMITTED, {"payload": {"micro_batches_done": 1 << 40}}),
    # times
    (FrameType.HEARTBEAT, {"payload": {"t_unix_ms": -1}}),
    (FrameType.HEARTBEAT, {"payload": {"t_unix_ms": 1 << 63}}),
    # amounts (MiB, ms): non-negative, below 2^31
    (FrameType.HEARTBEAT, {"payload": {"pss_mib": -1.5}}),
    (FrameType.WINDOW_COMMITTED, {"payload": {"checkpoint_ms": 1e300}}),
    # temperatures: what a runner can read
    (FrameType.HEARTBEAT, {"payload": {"temperature_c": 1e6}}),
    (FrameType.HEARTBEAT, {"payload": {"temperature_c": -300}}),
    # losses: finite float32 values
    (FrameType.WINDOW_COMMITTED, {"payload": {"mean_loss": 1e300}}),
    (FrameType.WINDOW_COMMITTED, {"payload": {"mean_consistency_loss": -1e39}}),
    # strings: bounded length
    (FrameType.ERROR, {"payload": {"reason": "x" * 100_000}}),
    (FrameType.REGISTER, {"payload": {"device": "d" * 10_000}}),
    # header fields the coordinator reads
    (FrameType.WINDOW_COMMITTED, {"window": (1 << 64) - 1}),
    (FrameType.HEARTBEAT, {"micro_batch": 1 << 32}),
    # a REGISTER naming another stage than its header
    (FrameType.REGISTER, {"payload": {"stage": 5}}),
]


@pytest.mark.parametrize("type_, fields", OUT_OF_RANGE, ids=lambda v: v.name if isinstance(v, FrameType) else
                         next(iter(v.get("payload", v))))
def test_signed_values_out_of_range_are_dropped_and_the_link_stays(type_, fields):
    with ControlServer(KEY, RUN) as server:
        s = Runner(server, 0)
        s.send(FrameType.REGISTER, payload={"pid": 1})
        assert _next(server).type is FrameType.REGISTER
        s.send(type_, **fields)
        s.send(FrameType.HEARTBEAT, payload={"micro_batches_done": 4})
        e = _next(server)
        assert (e.type, e.payload) == (FrameType.HEARTBEAT, {"micro_batches_done": 4}), "the bad frame got through"
        assert server.rejected == ["bad_payload"]


def test_values_at_the_edges_of_their_ranges_are_accepted():
    edge = {"micro_batches_done": (1 << 31) - 1, "window": 0, "pss_mib": 0, "temperature_c": -39.5,
            "t_unix_ms": int(time.time() * 1000), "phase": "forward"}
    with ControlServer(KEY, RUN) as server:
        s = Runner(server, 0)
        s.send(FrameType.REGISTER, payload={"stage": 0, "pid": 0, "listen": None})
        s.send(FrameType.HEARTBEAT, window=(1 << 31) - 1, payload=edge)
        s.send(FrameType.WINDOW_COMMITTED, window=3, payload={"mean_consistency_loss": -1e-9, "mean_loss": 0.0,
                                                              "checkpoint_ms": None})
        assert [_next(server).type for _ in range(3)] == [FrameType.REGISTER, FrameType.HEARTBEAT,
                                                          FrameType.WINDOW_COMMITTED]
        assert server.rejected == []


def test_the_coordinator_drops_events_beyond_the_runs_windows():
    # The server cannot know the run's size; the coordinator can: a commit of a window the run does not have, or
    # more micro-batches done than the run has, is dropped instead of shown (or taken as recovery).
    from types import SimpleNamespace

    from zl_device.executorch.coordinator import Coordinator, StagePlan
    from zl_device.formats.windows import WindowPlan

    control = SimpleNamespace(events=queue.Queue())
    plan = StagePlan(0, SimpleNamespace(name="fake"), "stage_0.json", "metrics.jsonl", "ckpt", 0)
    c = Coordinator([plan], WindowPlan(8, 4), control=control)  # 8 micro-batches, windows 0 and 1
    control.events.put(ControlEvent(0, FrameType.WINDOW_COMMITTED, 2, 8, {"mean_loss": 1.0}, 1.0))
    control.events.put(ControlEvent(0, FrameType.HEARTBEAT, 0, 0, {"micro_batches_done": 9}, 1.0))
    c._drain_control()
    assert c.status[0].last_committed_window == -1 and c.status[0].micro_batches_done == 0
    control.events.put(ControlEvent(0, FrameType.WINDOW_COMMITTED, 1, 8, {"mean_loss": 1.0}, 2.0))
    control.events.put(ControlEvent(0, FrameType.HEARTBEAT, 0, 0, {"micro_batches_done": 8}, 2.0))
    c._drain_control()
    assert c.status[0].last_committed_window == 1 and c.status[0].micro_batches_done == 8
