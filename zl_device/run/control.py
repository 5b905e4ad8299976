"""The coordinator's end of the control channel: a TCP server for runner frames.

Each stage runner connects to the coordinator's address (its config's
`coordinator` field) and sends REGISTER after every (re)connect, HEARTBEAT
periodically, WINDOW_COMMITTED after each checkpointed window and ERROR on
failure; the coordinator can send START and STOP. Frames are those of the
data plane (zl_device/run/frames.py) under the same per-run key; a frame that
fails validation is logged with its reason and the connection is dropped,
the server keeps serving.

Received frames become ControlEvent objects on a queue that the coordinator's
loop drains; the server never calls back into coordinator state from its
threads.
"""

import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass

from zl_device.run import frames
from zl_device.run.frames import Frame, FrameRejected, FrameType

log = logging.getLogger(__name__)


_NUMBER = (int, float)
# The fields the coordinator reads from each control payload (PROTOCOL.md §4), with the JSON types allowed; a
# field may be missing, others are ignored. A signed payload that breaks this is logged and dropped.
_PAYLOAD_FIELDS: dict[FrameType, dict[str, tuple]] = {
    FrameType.REGISTER: {"stage": (int,), "pid": (int,), "device": (str,), "listen": (str, type(None)),
                         "resume": (bool,), "micro_batches_done": (int,), "reconnects": (int,)},
    FrameType.HEARTBEAT: {"micro_batches_done": (int,), "window": (int, type(None)), "phase": (str,),
                          "pss_mib": (*_NUMBER, type(None)), "temperature_c": (*_NUMBER, type(None)),
                          "t_unix_ms": (int,)},
    FrameType.WINDOW_COMMITTED: {"mean_loss": (*_NUMBER, type(None)), "mean_task_loss": (*_NUMBER, type(None)),
                                 "mean_consistency_loss": (*_NUMBER, type(None)), "micro_batches_done": (int,),
                                 "checkpoint_ms": (*_NUMBER, type(None)), "checkpointed": (bool,)},
    FrameType.ERROR: {"reason": (str,)},
}


def payload_problem(type_: FrameType, payload: dict | None) -> str | None:
    """Why a control frame's payload is unusable (None when it is fine): a field of the wrong JSON type (a bool
    is not a number), or a negative micro_batches_done."""
    if payload is None:
        return None
    if not isinstance(payload, dict):
        return f"payload is a {type(payload).__name__}, not a JSON object"
    for name, allowed in _PAYLOAD_FIELDS.get(type_, {}).items():
        if name not in payload:
            continue
        value = payload[name]
        is_bool = isinstance(value, bool)
        if not isinstance(value, allowed) or (is_bool and bool not in allowed):
            return f"field {name!r} of {type_.name} is {json_type(value)}"
        if name == "micro_batches_done" and value < 0:
            return f"field 'micro_batches_done' of {type_.name} is negative"
    return None


def json_type(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


@dataclass
class ControlEvent:
    """One frame from a stage, as the coordinator sees it."""

    stage: int
    type: FrameType
    window: int
    micro_batch: int
    payload: dict
    t: float  # time.monotonic() at receipt


# Limits against connections that never authenticate (issue 12 item 11): control frames carry no tensors, so a
# frame is at most the header, 1 MiB of JSON and the MAC; before a connection's first frame verifies, much less.
MAX_CONTROL_FRAME_BYTES = frames.HEADER_SIZE + frames.MAX_JSON_BYTES + frames.MAC_SIZE
PRE_AUTH_MAX_FRAME_BYTES = 64 << 10  # a REGISTER is a few hundred bytes


class ControlServer:
    """Accepts runner connections; `events` is the queue of ControlEvent.

    At most `max_connections` are served at once (more are closed at once); a connection whose first frame does not
    verify within `auth_timeout_s`, or that then sends no frame for `idle_timeout_s` (runners send a heartbeat every
    second), is closed; before its first frame verifies, a connection may announce at most
    PRE_AUTH_MAX_FRAME_BYTES, and MAX_CONTROL_FRAME_BYTES after.
    """

    def __init__(self, key: bytes, run_id: bytes, host: str = "127.0.0.1", port: int = 0,
                 max_connections: int = 32, auth_timeout_s: float = 10.0, idle_timeout_s: float = 60.0):
        self.key, self.run_id = key, run_id
        self.max_connections = max_connections
        self.auth_timeout_s, self.idle_timeout_s = auth_timeout_s, idle_timeout_s
        self.events: queue.Queue[ControlEvent] = queue.Queue()
        self.rejected: list[str] = []  # reasons of rejected frames, for the report and tests
        self._sock = socket.create_server((host, port))
        self._sock.settimeout(0.2)
        self._conns: dict[int, socket.socket] = {}  # stage -> its latest connection
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._accept_loop, name="zl-control-accept", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        return self._sock.getsockname()[:2]

    def start(self) -> "ControlServer":
        self._accept.start()
        return self

    def send(self, stage: int, type_: FrameType, payload: dict | None = None) -> bool:
        """Send a command to a stage's current connection; False when it has none."""
        wire = frames.encode(Frame(type_, self.run_id, stage=frames.COORDINATOR_STAGE, payload=payload), self.key)
        with self._lock:
            conn = self._conns.get(stage)
        if conn is None:
            return False
        try:
            conn.sendall(wire)
            return True
        except OSError:
            return False

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
        with self._lock:
            for conn in self._conns.values():
                _close_quietly(conn)
            self._conns.clear()
        for t in [self._accept, *self._threads]:
            if t.is_alive() and t is not threading.current_thread():
                t.join(timeout=2)

    def __enter__(self) -> "ControlServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._threads = [t for t in self._threads if t.is_alive()]
            if len(self._threads) >= self.max_connections:
                log.warning("control: %d connections already; refusing one from %s:%s", len(self._threads), peer[0],
                            peer[1])
                _close_quietly(conn)
                continue
            conn.settimeout(0.2)
            t = threading.Thread(target=self._serve, args=(conn, peer), name=f"zl-control-{peer[1]}", daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket, peer) -> None:
        stage = None
        authenticated = False
        try:
            while not self._closed.is_set():
                deadline = time.monotonic() + (self.idle_timeout_s if authenticated else self.auth_timeout_s)
                header = _read_exact(conn, frames.HEADER_SIZE, self._closed, deadline)
                if header is None:
                    return
                total = frames.peek_length(header, MAX_CONTROL_FRAME_BYTES if authenticated
                                           else PRE_AUTH_MAX_FRAME_BYTES)
                rest = _read_exact(conn, total - frames.HEADER_SIZE, self._closed, deadline)
                if rest is None:
                    return
                frame = frames.decode(header + rest, self.key, run_id=self.run_id)
                authenticated = True
                problem = payload_problem(frame.type, frame.payload)
                if problem is not None:
                    # Signed but unusable: drop this frame, keep the (still framed) connection.
                    self.rejected.append("bad_payload")
                    log.warning("control frame from %s:%s rejected (bad_payload: %s)", peer[0], peer[1], problem)
                    continue
                if frame.type == FrameType.REGISTER or stage is None:
                    stage = frame.stage
                    with self._lock:
                        old = self._conns.get(stage)
                        self._conns[stage] = conn
                    if old is not None and old is not conn:
                        _close_quietly(old)
                self.events.put(ControlEvent(frame.stage, frame.type, frame.window, frame.micro_batch,
                                             frame.payload or {}, time.monotonic()))
        except FrameRejected as e:
            self.rejected.append(e.error)
            log.warning("control frame from %s:%s rejected (%s); closing that connection", peer[0], peer[1], e)
        except OSError:
            pass
        finally:
            with self._lock:
                if stage is not None and self._conns.get(stage) is conn:
                    del self._conns[stage]
            _close_quietly(conn)


def _read_exact(conn: socket.socket, n: int, closed: threading.Event, deadline: float | None = None) -> bytes | None:
    """n bytes, or None when the peer closed, `deadline` (time.monotonic()) passed or the server is shutting down."""
    buf = bytearray()
    while len(buf) < n:
        if closed.is_set():
            return None
        if deadline is not None and time.monotonic() > deadline:
            log.warning("control: a connection sent no complete frame in time; closing it")
            return None
        try:
            chunk = conn.recv(n - len(buf))
        except TimeoutError:
            continue
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _close_quietly(conn: socket.socket) -> None:
    try:
        conn.close()
    except OSError:
        pass
