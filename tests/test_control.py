"""The coordinator's control server: events from runner frames, commands back, bad frames rejected."""

import os
import queue
import socket
import struct

import pytest

from zl_base.errors import ZLError
from zl_device.formats import frames
from zl_device.executorch.control import ControlServer
from zl_device.formats.frames import Frame, FrameRejected, FrameType, KeyPurpose

KEY = bytes(range(32))
RUN = bytes(range(16))


def _up(stage: int, run_key: bytes = KEY) -> bytes:
    return frames.derive_key(run_key, KeyPurpose.CONTROL_UP, stage)


def _down(stage: int) -> bytes:
    return frames.derive_key(KEY, KeyPurpose.CONTROL_DOWN, stage)


class Runner:
    """A runner's end of the control channel, as the C++ ControlClient speaks it: the handshake, then frames in the
    session with increasing sequence numbers. `sent` keeps every byte written, for replay tests."""

    def __init__(self, server: ControlServer, stage: int, run_key: bytes = KEY, handshake: bool = True):
        self.sock = socket.create_connection(server.address, timeout=5)
        self.stage, self.run_key, self.seq, self.last_in = stage, run_key, 0, 0
        self.sent = b""
        self.session = None
        if handshake:
            hello = Frame(FrameType.HELLO, RUN, stage=stage, session=os.urandom(16) + bytes(16))
            self.write(frames.encode(hello, _up(stage, run_key)))
            reply = frames.decode(self.read_frame(), _down(stage), run_id=RUN, stage=frames.COORDINATOR_STAGE)
            assert reply.type is FrameType.HELLO and reply.session[:16] == hello.session[:16]
            self.session = reply.session

    def write(self, wire: bytes) -> None:
        self.sent += wire
        self.sock.sendall(wire)

    def send(self, type_: FrameType, **kw) -> None:
        self.seq += 1
        self.write(frames.encode(Frame(type_, RUN, stage=self.stage, session=self.session, seq=self.seq, **kw),
                                 _up(self.stage, self.run_key)))

    def read_frame(self) -> bytes:
        header = _recv_exact(self.sock, frames.HEADER_SIZE)
        return header + _recv_exact(self.sock, frames.peek_length(header) - frames.HEADER_SIZE)

    def recv(self) -> Frame:
        f = frames.decode(self.read_frame(), _down(self.stage), run_id=RUN, session=self.session,
                          min_seq=self.last_in + 1)
        self.last_in = f.seq
        return f

    def recv_raw(self, n: int) -> bytes:
        return self.sock.recv(n)

    def close(self) -> None:
        self.sock.close()


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, "connection closed"
        buf += chunk
    return buf


def _connect(server: ControlServer) -> socket.socket:
    return socket.create_connection(server.address, timeout=5)


def _next(server: ControlServer):
    return server.events.get(timeout=5)


def test_register_heartbeat_commit_and_stop():
    with ControlServer(KEY, RUN) as server:
        s = Runner(server, 2)
        s.send(FrameType.REGISTER, payload={"pid": 42})
        s.send(FrameType.HEARTBEAT, payload={"micro_batches_done": 5, "pss_mib": 100.5})
        s.send(FrameType.WINDOW_COMMITTED, window=1, payload={"mean_loss": 2.5})
        events = [_next(server) for _ in range(3)]
        assert [(e.stage, e.type) for e in events] == [(2, FrameType.REGISTER), (2, FrameType.HEARTBEAT),
                                                       (2, FrameType.WINDOW_COMMITTED)]
        assert events[1].payload["micro_batches_done"] == 5 and events[2].window == 1
        assert server.send(2, FrameType.STOP) and server.send(2, FrameType.START, {"go": 1})
        stop, start = s.recv(), s.recv()  # in the session, sequence numbers 1 and 2
        assert stop.type is FrameType.STOP and stop.stage == frames.COORDINATOR_STAGE and stop.seq == 1
        assert start.type is FrameType.START and start.seq == 2
        assert not server.send(7, FrameType.STOP)  # no such stage connected
        s.close()


def test_bad_frame_is_rejected_and_the_server_keeps_serving():
    with ControlServer(KEY, RUN) as server:
        bad = _connect(server)
        bad.sendall(frames.encode(Frame(FrameType.HELLO, RUN, stage=0), _up(0, bytes(32))))  # another run's key
        assert bad.recv(16) == b""  # the server closed that connection
        with pytest.raises(queue.Empty):
            server.events.get(timeout=0.3)
        assert server.rejected == ["bad_mac"]
        good = Runner(server, 1)
        good.send(FrameType.REGISTER)
        assert _next(server).stage == 1
        good.close()


def test_reconnect_replaces_the_stage_connection():
    with ControlServer(KEY, RUN) as server:
        first = Runner(server, 0)
        first.send(FrameType.REGISTER)
        _next(server)
        second = Runner(server, 0)
        second.send(FrameType.REGISTER, payload={"resume": True})
        assert _next(server).payload == {"resume": True}
        assert server.send(0, FrameType.STOP)
        assert second.recv().type is FrameType.STOP
        first.close()
        second.close()


# --- issue 12 item 3: control frames cannot be replayed ------------------------------------------------------------

def test_a_recorded_connection_replayed_on_a_new_socket_takes_nothing_over():
    # Everything a runner sent (HELLO, REGISTER, HEARTBEATs), replayed byte for byte on a new connection: the server
    # answers the HELLO with a fresh session, so the REGISTER is of another session and rejected. On main (no
    # session) the replayed REGISTER took the stage's mapping over and the HEARTBEATs kept a frozen stage alive.
    with ControlServer(KEY, RUN) as server:
        real = Runner(server, 0)
        real.send(FrameType.REGISTER, payload={"pid": 1})
        real.send(FrameType.HEARTBEAT, payload={"micro_batches_done": 3})
        assert [_next(server).type for _ in range(2)] == [FrameType.REGISTER, FrameType.HEARTBEAT]
        replay = _connect(server)
        replay.sendall(real.sent)
        assert _recv_exact(replay, frames.HEADER_SIZE)  # the server's HELLO: a new session
        replay.settimeout(3)
        try:
            while replay.recv(1 << 16):
                pass
        except ConnectionResetError:
            pass
        with pytest.raises(queue.Empty):
            server.events.get(timeout=0.3)
        assert server.rejected == ["wrong_session"]
        assert server.send(0, FrameType.STOP)  # still the real runner's connection
        assert real.recv().type is FrameType.STOP


def test_heartbeats_replayed_inside_the_connection_are_rejected():
    with ControlServer(KEY, RUN) as server:
        s = Runner(server, 0)
        s.send(FrameType.REGISTER)
        s.send(FrameType.HEARTBEAT, payload={"micro_batches_done": 3})
        assert [_next(server).type for _ in range(2)] == [FrameType.REGISTER, FrameType.HEARTBEAT]
        heartbeat = s.sent[-(len(s.sent) - s.sent.rfind(b"ZLFR")):]
        s.sock.sendall(heartbeat)  # the same frame again: its sequence number was used
        assert s.recv_raw(16) == b""
        with pytest.raises(queue.Empty):
            server.events.get(timeout=0.3)
        assert server.rejected == ["replay"]


def test_the_first_frame_must_be_a_hello():
    with ControlServer(KEY, RUN) as server:
        s = Runner(server, 0, handshake=False)
        s.write(frames.encode(Frame(FrameType.REGISTER, RUN, stage=0), _up(0)))
        assert s.recv_raw(16) == b""
        assert server.rejected == ["bad_handshake"]


def test_frames_of_one_stage_or_direction_do_not_open_as_another():
    with ControlServer(KEY, RUN) as server:
        # A HELLO sealed with stage 1's key but naming stage 0 in its header.
        s = _connect(server)
        s.sendall(frames.encode(Frame(FrameType.HELLO, RUN, stage=0), _up(1)))
        assert _closed_within(s, 3)
        # And the coordinator's own direction's key.
        s = _connect(server)
        s.sendall(frames.encode(Frame(FrameType.HELLO, RUN, stage=0), _down(0)))
        assert _closed_within(s, 3)
        assert server.rejected == ["bad_mac", "bad_mac"]


def test_old_version_frames_are_refused_with_a_clear_reason():
    with ControlServer(KEY, RUN) as server:
        s = _connect(server)
        s.sendall(struct.pack("<4sHHII16sIIQQII", b"ZLFR", 1, 16, 96, 0, RUN, 0, 0, 0, 0, 0, 0) + bytes(96))
        assert _closed_within(s, 3)
        assert server.rejected == ["bad_version"]
        with pytest.raises(FrameRejected, match="only MACed, not encrypted"):
            frames.peek_length(struct.pack("<4sHHII16sIIQQII", b"ZLFR", 1, 16, 96, 0, RUN, 0, 0, 0, 0, 0, 0) + bytes(64))


# --- issue 12 item 10: signed but malformed control payloads ------------------------------------------------------

def _signed_raw(type_: FrameType, stage: int, json_bytes: bytes, session: bytes, seq: int) -> bytes:
    """A control frame whose payload bytes are exactly `json_bytes`, sealed with the stage's key."""
    total = frames.HEADER_SIZE + len(json_bytes) + frames.TAG_SIZE
    header = struct.pack("<4sHHII16sIIQQII32sQ24s", b"ZLFR", 2, int(type_), total, 0, RUN, stage, 0, 0, 0,
                         len(json_bytes), 0, session, seq, os.urandom(24))
    return frames.seal(header + json_bytes + bytes(frames.TAG_SIZE), _up(stage))


@pytest.mark.parametrize("payload", [b"[1]", b"null", b'"x"', b'{"micro_batches_done":NaN}'])
def test_signed_payload_that_is_not_an_object_is_rejected_and_the_server_keeps_serving(payload):
    with ControlServer(KEY, RUN) as server:
        bad = Runner(server, 0)
        bad.write(_signed_raw(FrameType.HEARTBEAT, 0, payload, bad.session, 1))
        assert bad.recv_raw(16) == b""
        assert server.rejected == ["bad_payload"]
        good = Runner(server, 0)
        good.send(FrameType.HEARTBEAT, payload={"micro_batches_done": 3})
        assert _next(server).payload == {"micro_batches_done": 3}
        good.close()


@pytest.mark.parametrize("type_, payload", [
    (FrameType.HEARTBEAT, {"micro_batches_done": "x"}),
    (FrameType.HEARTBEAT, {"micro_batches_done": -1}),
    (FrameType.HEARTBEAT, {"micro_batches_done": True}),
    (FrameType.HEARTBEAT, {"pss_mib": "lots"}),
    (FrameType.WINDOW_COMMITTED, {"mean_loss": [1]}),
    (FrameType.ERROR, {"reason": {"nested": 1}}),
    (FrameType.REGISTER, {"pid": "42"}),
])
def test_signed_payload_of_the_wrong_shape_is_dropped_and_the_link_stays(type_, payload):
    with ControlServer(KEY, RUN) as server:
        s = Runner(server, 0)
        s.send(FrameType.REGISTER, payload={"pid": 1})
        assert _next(server).type is FrameType.REGISTER
        s.send(type_, payload=payload)
        s.send(FrameType.HEARTBEAT, payload={"micro_batches_done": 4, "pss_mib": None})
        e = _next(server)
        assert (e.type, e.payload["micro_batches_done"]) == (FrameType.HEARTBEAT, 4)
        assert server.rejected == ["bad_payload"]
        s.close()


def test_coordinator_survives_events_with_unusable_payloads():
    from types import SimpleNamespace

    from zl_device.executorch.control import ControlEvent
    from zl_device.executorch.coordinator import Coordinator, StagePlan
    from zl_device.formats.windows import WindowPlan

    control = SimpleNamespace(events=queue.Queue())
    plan = StagePlan(0, SimpleNamespace(name="fake"), "stage_0.json", "metrics.jsonl", "ckpt", 0)
    c = Coordinator([plan], WindowPlan(8, 4), control=control)
    for payload in ([1], None, {"micro_batches_done": "x"}, {"mean_loss": "nan?"}):
        for type_ in (FrameType.HEARTBEAT, FrameType.WINDOW_COMMITTED, FrameType.ERROR):
            control.events.put(ControlEvent(0, type_, 1, 0, payload, 0.0))
    control.events.put(ControlEvent(0, FrameType.HEARTBEAT, 1, 0, {"micro_batches_done": 6}, 1.0))
    c._drain_control()
    assert c.status[0].micro_batches_done == 6


# --- issue 12 item 11: connections that never authenticate ---------------------------------------------------------

def _closed_within(s: socket.socket, seconds: float) -> bool:
    s.settimeout(seconds)
    try:
        return s.recv(16) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_a_huge_announced_frame_is_refused_before_it_is_buffered():
    with ControlServer(KEY, RUN) as server:
        s = _connect(server)
        # A header announcing 60 MiB: the old server buffered all of it before checking the MAC.
        s.sendall(struct.pack("<4sHHII16sIIQQII32sQ24s", b"ZLFR", 2, 16, 60 << 20, 0, RUN, 0, 0, 0, 0, 0, 0,
                              bytes(32), 0, bytes(24)))
        assert _closed_within(s, 3)
        assert server.rejected == ["oversize"]


def test_a_connection_that_never_authenticates_is_closed():
    with ControlServer(KEY, RUN, auth_timeout_s=0.3) as server:
        silent = _connect(server)
        partial = _connect(server)
        partial.sendall(b"ZLFR\x02\x00")  # the start of a header, then nothing
        shaken = Runner(server, 0)  # a handshake, then nothing: no frame in the session
        assert _closed_within(silent, 3) and _closed_within(partial, 3) and _closed_within(shaken.sock, 3)
        good = Runner(server, 0)
        good.send(FrameType.REGISTER)
        assert _next(server).type is FrameType.REGISTER


def test_connections_past_the_hello_are_capped_but_a_registered_stage_always_gets_back_in():
    with ControlServer(KEY, RUN, max_connections=2) as server:
        a, b = Runner(server, 0), Runner(server, 1)
        a.send(FrameType.REGISTER)
        assert _next(server).stage == 0
        c = _connect(server)
        c.sendall(frames.encode(Frame(FrameType.HELLO, RUN, stage=2, session=os.urandom(16) + bytes(16)), _up(2)))
        assert _closed_within(c, 3), "a third connection over the cap of 2 was served"
        b.send(FrameType.REGISTER)
        assert _next(server).stage == 1
        restarted = Runner(server, 0)  # stage 0 registered before: its new connection gets a thread over the cap
        restarted.send(FrameType.REGISTER, payload={"resume": True})
        assert _next(server).payload == {"resume": True}


def test_control_server_binds_loopback_for_usb_phones_and_local_devices():
    from types import SimpleNamespace

    from zl_device.executorch.launch import control_bind_host

    usb = [SimpleNamespace(name=f"P{i}", kind="adb", address=lambda: None) for i in range(2)]
    wifi = [SimpleNamespace(name=f"W{i}", kind="adb", address=lambda i=i: f"192.168.1.{10 + i}") for i in range(2)]
    assert control_bind_host([], local=True) == "127.0.0.1"
    assert control_bind_host(usb, local=False) == "127.0.0.1"
    assert control_bind_host(wifi, local=False) == "0.0.0.0"


def test_coordinator_logs_a_stage_error_without_raw_control_characters(caplog):
    from types import SimpleNamespace

    from zl_device.executorch.control import ControlEvent
    from zl_device.executorch.coordinator import Coordinator, StagePlan
    from zl_device.formats.windows import WindowPlan

    control = SimpleNamespace(events=queue.Queue())
    plan = StagePlan(0, SimpleNamespace(name="fake"), "stage_0.json", "metrics.jsonl", "ckpt", 0)
    c = Coordinator([plan], WindowPlan(8, 4), control=control)
    control.events.put(ControlEvent(0, FrameType.ERROR, 0, 0, {"reason": "bad \x1b[2J\x07 thing"}, 0.0))
    with caplog.at_level("WARNING"):
        c._drain_control()
    text = caplog.text
    assert "\x1b" not in text and "\\x1b[2J\\x07 thing" in text


# --- issue 12 item 4: a stalled but living stage ------------------------------------------------------------------

@pytest.mark.parametrize("done, live, seen_at, blamed", [
    ([14, 9, 10], [True] * 3, 2, 1),  # stage 1 parked after sending 9: 2 starved, 0 held back
    ([14, 9, 10], [True] * 3, 0, 1),
    ([14, 9, 9], [True] * 3, 2, 1),  # parked before sending 9
    ([16, 15, 9], [True] * 3, 0, 2),  # the last stage stopped: everyone upstream is held back
    ([5, 6, 6], [True] * 3, 2, 0),  # stage 0 stopped: the others starve
    ([12, 12, 12, 12], [True] * 4, 3, 0),
    ([32, 20, 19], [False, True, True], 2, 2),  # stage 0 is done: stage 1 has input; 2 has input from 1
])
def test_a_stall_is_blamed_on_the_stage_that_stopped_not_its_neighbours(done, live, seen_at, blamed):
    from zl_device.executorch.health import stalled_stage

    assert stalled_stage(done, live, seen_at) == blamed


def test_time_the_coordinator_did_not_run_is_no_stage_silence():
    """Heartbeats queue while the host is starved: after a 37 s gap in the coordinator's own loop (seen once with
    three stages and other jobs on 2 cores: every stage blamed at once) no stage fails; a stage silent as long while
    the coordinator ran does."""
    import time
    from types import SimpleNamespace

    from zl_device.formats.windows import WindowPlan
    from zl_device.executorch.coordinator import Coordinator, StagePlan
    from zl_device.executorch.health import HOST_GAP_S

    killed = []
    device = SimpleNamespace(name="fake", exit_code=lambda: None, kill_runner=lambda: killed.append("kill"),
                             stop_runner=lambda timeout_s: None, read_text=lambda path: "")
    c = Coordinator([StagePlan(0, device, "stage_0.json", "metrics.jsonl", "ckpt", 0)], WindowPlan(8, 4),
                    control=SimpleNamespace(events=queue.Queue()), heartbeat_timeout_s=30.0, max_restarts=0)
    c.table.read_telemetry = lambda k, remote=False: None
    s = c.status[0]
    s.state, s.heartbeat_seen = "running", True
    s.last_sign_of_life = time.monotonic() - 37.0  # its last heartbeat came just before the host stopped
    c.health.forgive_host_gap(37.0)
    c._check_health()
    assert killed == [] and s.state == "running"
    s.last_sign_of_life = time.monotonic() - 37.0
    c.health.forgive_host_gap(HOST_GAP_S / 2)  # the loop's ordinary lateness forgives nothing
    with pytest.raises(ZLError, match="stage 0 failed 1 times \\(heartbeat timeout\\)"):
        c._check_health()
    assert killed == ["kill"]
