"""The coordinator's control server: events from runner frames, commands back, bad frames rejected."""

import queue
import socket

import pytest

from zl_device.run import frames
from zl_device.run.control import ControlServer
from zl_device.run.frames import Frame, FrameType

KEY = bytes(range(32))
RUN = bytes(range(16))


def _connect(server: ControlServer) -> socket.socket:
    s = socket.create_connection(server.address, timeout=5)
    return s


def _send(s: socket.socket, type_: FrameType, stage: int, key: bytes = KEY, **kw) -> None:
    s.sendall(frames.encode(Frame(type_, RUN, stage=stage, **kw), key))


def _next(server: ControlServer):
    return server.events.get(timeout=5)


def test_register_heartbeat_commit_and_stop():
    with ControlServer(KEY, RUN) as server:
        s = _connect(server)
        _send(s, FrameType.REGISTER, 2, payload={"pid": 42})
        _send(s, FrameType.HEARTBEAT, 2, payload={"micro_batches_done": 5, "pss_mib": 100.5})
        _send(s, FrameType.WINDOW_COMMITTED, 2, window=1, payload={"mean_loss": 2.5})
        events = [_next(server) for _ in range(3)]
        assert [(e.stage, e.type) for e in events] == [(2, FrameType.REGISTER), (2, FrameType.HEARTBEAT),
                                                       (2, FrameType.WINDOW_COMMITTED)]
        assert events[1].payload["micro_batches_done"] == 5 and events[2].window == 1
        assert server.send(2, FrameType.STOP)
        data = s.recv(1 << 16)
        stop = frames.decode(data, KEY, run_id=RUN)
        assert stop.type is FrameType.STOP and stop.stage == frames.COORDINATOR_STAGE
        assert not server.send(7, FrameType.STOP)  # no such stage connected
        s.close()


def test_bad_frame_is_rejected_and_the_server_keeps_serving():
    with ControlServer(KEY, RUN) as server:
        bad = _connect(server)
        _send(bad, FrameType.REGISTER, 0, key=bytes(32))  # another run's key
        assert bad.recv(16) == b""  # the server closed that connection
        with pytest.raises(queue.Empty):
            server.events.get(timeout=0.3)
        assert server.rejected == ["bad_mac"]
        good = _connect(server)
        _send(good, FrameType.REGISTER, 1)
        assert _next(server).stage == 1
        good.close()


def test_reconnect_replaces_the_stage_connection():
    with ControlServer(KEY, RUN) as server:
        first = _connect(server)
        _send(first, FrameType.REGISTER, 0)
        _next(server)
        second = _connect(server)
        _send(second, FrameType.REGISTER, 0, payload={"resume": True})
        assert _next(server).payload == {"resume": True}
        assert server.send(0, FrameType.STOP)
        assert frames.decode(second.recv(1 << 16), KEY).type is FrameType.STOP
        first.close()
        second.close()


# --- issue 12 item 10: signed but malformed control payloads ------------------------------------------------------

def _signed_raw(type_: FrameType, stage: int, json_bytes: bytes) -> bytes:
    """A control frame whose payload bytes are exactly `json_bytes`, signed with the run key."""
    import struct
    total = frames.HEADER_SIZE + len(json_bytes) + frames.MAC_SIZE
    header = struct.pack("<4sHHII16sIIQQII", b"ZLFR", 1, int(type_), total, 0, RUN, stage, 0, 0, 0,
                         len(json_bytes), 0)
    body = header + json_bytes
    return body + frames.frame_mac(body, KEY)


@pytest.mark.parametrize("payload", [b"[1]", b"null", b'"x"', b'{"micro_batches_done":NaN}'])
def test_signed_payload_that_is_not_an_object_is_rejected_and_the_server_keeps_serving(payload):
    with ControlServer(KEY, RUN) as server:
        bad = _connect(server)
        bad.sendall(_signed_raw(FrameType.HEARTBEAT, 0, payload))
        assert bad.recv(16) == b""
        assert server.rejected == ["bad_payload"]
        good = _connect(server)
        _send(good, FrameType.HEARTBEAT, 0, payload={"micro_batches_done": 3})
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
        s = _connect(server)
        _send(s, FrameType.REGISTER, 0, payload={"pid": 1})
        assert _next(server).type is FrameType.REGISTER
        _send(s, type_, 0, payload=payload)
        _send(s, FrameType.HEARTBEAT, 0, payload={"micro_batches_done": 4, "pss_mib": None})
        e = _next(server)
        assert (e.type, e.payload["micro_batches_done"]) == (FrameType.HEARTBEAT, 4)
        assert server.rejected == ["bad_payload"]
        s.close()


def test_coordinator_survives_events_with_unusable_payloads():
    from types import SimpleNamespace

    from zl_device.run.control import ControlEvent
    from zl_device.run.coordinator import Coordinator, StagePlan
    from zl_device.run.windows import WindowPlan

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
    import struct
    with ControlServer(KEY, RUN) as server:
        s = _connect(server)
        # A header announcing 60 MiB: the old server buffered all of it before checking the MAC.
        s.sendall(struct.pack("<4sHHII16sIIQQII", b"ZLFR", 1, 16, 60 << 20, 0, RUN, 0, 0, 0, 0, 0, 0))
        assert _closed_within(s, 3)
        assert server.rejected == ["oversize"]


def test_a_connection_that_never_authenticates_is_closed():
    with ControlServer(KEY, RUN, auth_timeout_s=0.3) as server:
        silent = _connect(server)
        partial = _connect(server)
        partial.sendall(b"ZLFR\x01\x00")  # the start of a header, then nothing
        assert _closed_within(silent, 3) and _closed_within(partial, 3)
        good = _connect(server)
        _send(good, FrameType.REGISTER, 0)
        assert _next(server).type is FrameType.REGISTER


def test_connections_are_capped():
    with ControlServer(KEY, RUN, max_connections=2) as server:
        a, b = _connect(server), _connect(server)
        _send(a, FrameType.REGISTER, 0)
        assert _next(server).stage == 0
        c = _connect(server)
        assert _closed_within(c, 3), "a third connection over the cap of 2 was served"
        _send(b, FrameType.REGISTER, 1)
        assert _next(server).stage == 1


def test_control_server_binds_loopback_for_usb_phones_and_local_devices():
    from types import SimpleNamespace

    from zl_device.run.launch import control_bind_host

    usb = [SimpleNamespace(name=f"P{i}", kind="adb", address=lambda: None) for i in range(2)]
    wifi = [SimpleNamespace(name=f"W{i}", kind="adb", address=lambda i=i: f"192.168.1.{10 + i}") for i in range(2)]
    assert control_bind_host([], local=True) == "127.0.0.1"
    assert control_bind_host(usb, local=False) == "127.0.0.1"
    assert control_bind_host(wifi, local=False) == "0.0.0.0"


def test_coordinator_logs_a_stage_error_without_raw_control_characters(caplog):
    from types import SimpleNamespace

    from zl_device.run.control import ControlEvent
    from zl_device.run.coordinator import Coordinator, StagePlan
    from zl_device.run.windows import WindowPlan

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
    from zl_device.run.coordinator import stalled_stage

    assert stalled_stage(done, live, seen_at) == blamed
