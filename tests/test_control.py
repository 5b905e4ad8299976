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
