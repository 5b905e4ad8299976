"""The coordinator's end of the control channel: a TCP server for runner frames.

Each stage runner connects to the coordinator's address (its config's
`coordinator` field) and, on every (re)connect, first does the session
handshake (its HELLO, answered with the coordinator's HELLO carrying a fresh
random half of the session id), then sends REGISTER, HEARTBEAT periodically,
WINDOW_COMMITTED after each checkpointed window and ERROR on failure; the
coordinator can send START and STOP. Frames are those of the data plane
(zl_device/run/frames.py), encrypted under the stage's control keys (derived
from the run key, one per direction) and bound to the connection's session
with increasing sequence numbers, so a recorded REGISTER or HEARTBEAT cannot
be replayed (android_app/native/PROTOCOL.md §6). A frame that fails
validation is logged with its reason and the connection is dropped, the
server keeps serving.

Received frames become ControlEvent objects on a queue that the coordinator's
loop drains; the server never calls back into coordinator state from its
threads.
"""

import logging
import os
import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

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
# frame is at most the header, 1 MiB of JSON and the tag; before a connection's first frame verifies, much less.
MAX_CONTROL_FRAME_BYTES = frames.HEADER_SIZE + frames.MAX_JSON_BYTES + frames.TAG_SIZE
PRE_AUTH_MAX_FRAME_BYTES = 64 << 10  # a REGISTER is a few hundred bytes


@dataclass
class _Session:
    """One runner connection after the handshake: where and how the coordinator's frames to it go."""

    conn: socket.socket
    session: bytes
    send_key: bytes
    sent: int = 0  # the last sequence number stamped on a frame to it (HELLO: 0)
    lock: threading.Lock = field(default_factory=threading.Lock)


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
        self._conns: dict[int, _Session] = {}  # stage -> its latest connection
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
        """Send a command to a stage's current connection (in its session, with the next sequence number); False
        when it has none."""
        with self._lock:
            target = self._conns.get(stage)
        if target is None:
            return False
        with target.lock:
            target.sent += 1
            wire = frames.encode(Frame(type_, self.run_id, stage=frames.COORDINATOR_STAGE, payload=payload,
                                       session=target.session, seq=target.sent), target.send_key)
            try:
                target.conn.sendall(wire)
                return True
            except OSError:
                return False

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
        with self._lock:
            for target in self._conns.values():
                _close_quietly(target.conn)
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

    def _read_frame(self, conn: socket.socket, authenticated: bool) -> bytes | None:
        """One frame's bytes (None: closed, timed out or shutting down); the size limit and the time allowed depend
        on whether a frame of this connection verified already."""
        deadline = time.monotonic() + (self.idle_timeout_s if authenticated else self.auth_timeout_s)
        header = _read_exact(conn, frames.HEADER_SIZE, self._closed, deadline)
        if header is None:
            return None
        total = frames.peek_length(header, MAX_CONTROL_FRAME_BYTES if authenticated else PRE_AUTH_MAX_FRAME_BYTES)
        rest = _read_exact(conn, total - frames.HEADER_SIZE, self._closed, deadline)
        return None if rest is None else header + rest

    def _handshake(self, conn: socket.socket) -> tuple[int, bytes, _Session] | None:
        """The server side of the session handshake (PROTOCOL.md §6): the runner's HELLO, sealed with the control
        key of the stage its header names, answered with a HELLO whose session is the runner's random half and a
        fresh random half of ours. Returns (stage, its receive key, the session), or None when the peer went away.

        Raises:
            FrameRejected: the HELLO does not verify, or the first frame is not a HELLO ("bad_handshake").
        """
        wire = self._read_frame(conn, authenticated=False)
        if wire is None:
            return None
        claimed = struct.unpack_from("<I", wire, 32)[0]  # authenticated below: the key depends on it
        receive_key = frames.derive_key(self.key, frames.KeyPurpose.CONTROL_UP, claimed)
        hello = frames.decode(wire, receive_key, run_id=self.run_id, max_frame_bytes=PRE_AUTH_MAX_FRAME_BYTES,
                              stage=claimed)
        if hello.type != FrameType.HELLO or hello.seq != 0:
            raise FrameRejected("bad_handshake", f"the first frame of a connection must be HELLO with sequence number "
                                                 f"0, not {hello.type.name} with {hello.seq}")
        target = _Session(conn, hello.session[:frames.SESSION_HALF] + os.urandom(frames.SESSION_HALF),
                          frames.derive_key(self.key, frames.KeyPurpose.CONTROL_DOWN, claimed))
        conn.sendall(frames.encode(Frame(FrameType.HELLO, self.run_id, stage=frames.COORDINATOR_STAGE,
                                         session=target.session), target.send_key))
        return claimed, receive_key, target

    def _serve(self, conn: socket.socket, peer) -> None:
        stage = None  # set once a frame after the handshake verified: the connection then serves that stage
        try:
            shaken = self._handshake(conn)
            if shaken is None:
                return
            claimed, receive_key, target = shaken
            last_seq = 0
            while not self._closed.is_set():
                wire = self._read_frame(conn, authenticated=stage is not None)
                if wire is None:
                    return
                # Only this connection's session, and each sequence number once: a recorded frame (REGISTER,
                # HEARTBEAT, ...) replayed here or on a new connection is rejected.
                frame = frames.decode(wire, receive_key, run_id=self.run_id, stage=claimed, session=target.session,
                                      min_seq=last_seq + 1,
                                      max_frame_bytes=MAX_CONTROL_FRAME_BYTES if stage is not None
                                      else PRE_AUTH_MAX_FRAME_BYTES)
                last_seq = frame.seq
                if stage is None:
                    stage = claimed
                    with self._lock:
                        old = self._conns.get(stage)
                        self._conns[stage] = target
                    if old is not None and old.conn is not conn:
                        _close_quietly(old.conn)
                problem = payload_problem(frame.type, frame.payload)
                if problem is not None:
                    # Signed but unusable: drop this frame, keep the (still framed) connection.
                    self.rejected.append("bad_payload")
                    log.warning("control frame from %s:%s rejected (bad_payload: %s)", peer[0], peer[1], problem)
                    continue
                self.events.put(ControlEvent(frame.stage, frame.type, frame.window, frame.micro_batch,
                                             frame.payload or {}, time.monotonic()))
        except FrameRejected as e:
            self.rejected.append(e.error)
            log.warning("control frame from %s:%s rejected (%s); closing that connection", peer[0], peer[1], e)
        except OSError:
            pass
        finally:
            with self._lock:
                if stage is not None and self._conns.get(stage) is not None and self._conns[stage].conn is conn:
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
