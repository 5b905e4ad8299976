"""The coordinator's end of the control channel: a TCP server for runner frames.

Each stage runner connects to the coordinator's address (its config's
`coordinator` field) and, on every (re)connect, first does the session
handshake (its HELLO, answered with the coordinator's HELLO carrying a fresh
random half of the session id), then sends REGISTER, HEARTBEAT periodically,
WINDOW_COMMITTED after each checkpointed window and ERROR on failure; the
coordinator can send START and STOP. Frames are those of the data plane
(zl_device/formats/frames.py), encrypted under the stage's control keys (derived
from the run key, one per direction) and bound to the connection's session
with increasing sequence numbers, so a recorded REGISTER or HEARTBEAT cannot
be replayed (runner/PROTOCOL.md §6). A frame that fails
validation is logged with its reason and the connection is dropped, the
server keeps serving; a verified frame with values out of range
(frame_problem) is logged and dropped, the connection stays. Strangers
cannot take the slots that stages need: see ControlServer.

Received frames become ControlEvent objects on a queue that the coordinator's
loop drains; the server never calls back into coordinator state from its
threads.
"""

import logging
import os
import queue
import selectors
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from zl_device.formats import frames
from zl_device.formats.frames import Frame, FrameRejected, FrameType

log = logging.getLogger(__name__)


_NUMBER = (int, float)
MAX_COUNT = (1 << 31) - 1  # micro-batches, windows, stages, pids, reconnects: what an int32 holds
_FLOAT32_MAX = 3.4028234663852886e38  # losses are float32 means: any finite float32 fits


@dataclass(frozen=True)
class _Rule:
    """What one payload field may hold: JSON types (a bool is never a number), then a range or a length."""

    types: tuple
    low: float | None = None
    high: float | None = None
    max_chars: int | None = None

    def or_null(self) -> "_Rule":
        return _Rule((*self.types, type(None)), self.low, self.high, self.max_chars)


_COUNT = _Rule((int,), 0, MAX_COUNT)
_UNIX_MS = _Rule((int,), 0, (1 << 53) - 1)  # milliseconds since 1970, exact as a double
_AMOUNT = _Rule(_NUMBER, 0, 1 << 31)  # MiB, ms: non-negative, below 2^31
_CELSIUS = _Rule(_NUMBER, -40, 150)  # the runner sends only readings in this range (plausible_celsius, telemetry.cpp)
_LOSS = _Rule(_NUMBER, -_FLOAT32_MAX, _FLOAT32_MAX)  # a KL term may be a hair below 0 in float32: no sign rule
_FLAG = _Rule((bool,))
_NAME = _Rule((str,), max_chars=256)  # a device name, a "host:port", a phase
_REASON = _Rule((str,), max_chars=8192)  # the runner cuts its ERROR reasons at 4000 bytes

# The fields the coordinator reads from each control payload (PROTOCOL.md §4) and what each may hold; a field may
# be missing, others are ignored. A signed payload that breaks this is logged and dropped (the connection stays).
_PAYLOAD_FIELDS: dict[FrameType, dict[str, _Rule]] = {
    FrameType.REGISTER: {"stage": _COUNT, "pid": _COUNT, "device": _NAME, "listen": _NAME.or_null(),
                         "resume": _FLAG, "micro_batches_done": _COUNT, "reconnects": _COUNT},
    FrameType.HEARTBEAT: {"micro_batches_done": _COUNT, "window": _COUNT.or_null(), "phase": _NAME,
                          "pss_mib": _AMOUNT.or_null(), "temperature_c": _CELSIUS.or_null(), "t_unix_ms": _UNIX_MS},
    FrameType.WINDOW_COMMITTED: {"mean_loss": _LOSS.or_null(), "mean_task_loss": _LOSS.or_null(),
                                 "mean_consistency_loss": _LOSS.or_null(), "micro_batches_done": _COUNT,
                                 "checkpoint_ms": _AMOUNT.or_null(), "checkpointed": _FLAG},
    FrameType.ERROR: {"reason": _REASON},
}


def payload_problem(type_: FrameType, payload: dict | None) -> str | None:
    """Why a control frame's payload is unusable (None when it is fine): a field of the wrong JSON type (a bool
    is not a number), a number out of its field's range, or a string too long."""
    if payload is None:
        return None
    if not isinstance(payload, dict):
        return f"payload is a {type(payload).__name__}, not a JSON object"
    for name, rule in _PAYLOAD_FIELDS.get(type_, {}).items():
        if name not in payload:
            continue
        value = payload[name]
        where = f"field {name!r} of {type_.name}"
        if not isinstance(value, rule.types) or (isinstance(value, bool) and bool not in rule.types):
            return f"{where} is {json_type(value)}"
        if isinstance(value, str) and rule.max_chars is not None and len(value) > rule.max_chars:
            return f"{where} has {len(value)} characters, at most {rule.max_chars} are allowed"
        if isinstance(value, _NUMBER) and not isinstance(value, bool) and rule.low is not None \
                and not rule.low <= value <= rule.high:
            return f"{where} is {value}, outside [{rule.low}, {rule.high}]"
    return None


def frame_problem(frame: Frame) -> str | None:
    """Why a verified control frame from a stage is unusable (None when it is fine): its header's window or
    micro-batch beyond MAX_COUNT (the runner writes its current window and micro-batches done there), a REGISTER
    that names another stage than its header, or its payload (payload_problem)."""
    for name, value in (("window", frame.window), ("micro_batch", frame.micro_batch)):
        if value > MAX_COUNT:
            return f"header field {name} of {frame.type.name} is {value}, above {MAX_COUNT}"
    problem = payload_problem(frame.type, frame.payload)
    if problem is None and frame.type == FrameType.REGISTER and isinstance(frame.payload, dict) \
            and frame.payload.get("stage", frame.stage) != frame.stage:
        problem = f"REGISTER names stage {frame.payload['stage']} but comes from stage {frame.stage}"
    return problem


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


# Limits against strangers (issue 12 item 11, issue 28 item 3). A connection is *pending* until its HELLO verifies,
# *unverified* until its first frame in the session verifies (its HELLO may be a recording), then *verified*.
# Control frames carry no tensors: at most the header, 1 MiB of JSON and the tag; before that first frame, much less.
MAX_CONTROL_FRAME_BYTES = frames.HEADER_SIZE + frames.MAX_JSON_BYTES + frames.TAG_SIZE
HELLO_MAX_FRAME_BYTES = 4 << 10  # a HELLO has no payload: 144 bytes
PRE_AUTH_MAX_FRAME_BYTES = 64 << 10  # the first frame after the HELLO: a REGISTER is a few hundred bytes
UNVERIFIED_PER_STAGE = 2  # a third HELLO for a stage pushes out its oldest unverified connection
#: Seconds a connection may stay silent in the kernel before it is handed over (TCP_DEFER_ACCEPT, Linux): a HELLO
#: sent up to this long after the connect arrives with its connection, whole, and never waits among strangers.
DEFER_ACCEPT_S = 1
#: Connections the kernel may hold for the accept thread (it caps this at net.core.somaxconn): deferred ones count,
#: and past the limit the kernel answers with SYN cookies, which hand a connection over without waiting for bytes.
LISTEN_BACKLOG = 4096


@dataclass
class _Session:
    """One runner connection after the handshake: where and how the coordinator's frames to it go."""

    conn: socket.socket
    session: bytes
    send_key: bytes
    sent: int = 0  # the last sequence number stamped on a frame to it (HELLO: 0)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class _Pending:
    """A connection whose HELLO has not verified yet: its bytes so far, read by the accept thread."""

    conn: socket.socket
    peer: tuple
    deadline: float  # time.monotonic() by which its HELLO must have verified
    buf: bytearray = field(default_factory=bytearray)
    need: int = frames.HEADER_SIZE  # the bytes to have: the header, then the whole frame


class ControlServer:
    """Accepts runner connections; `events` is the queue of ControlEvent.

    Pending connections cost no thread: the accept thread reads their HELLOs. Where the system has TCP_DEFER_ACCEPT
    (Linux), the kernel hands a connection over once its first bytes arrive (or after DEFER_ACCEPT_S without any):
    a runner's HELLO, however late after its connect (`adb reverse`, a slow phone link), arrives whole with its
    connection, and a connection whose HELLO is all there on accept starts its session at once, taking no pending
    slot and pushing nobody out. Only a connection still short of its HELLO waits: a newcomer over `max_pending`
    pushes out the oldest pending connection of the address with the most of them, so a flood from an address of
    its own (phones on Wi-Fi have theirs) pushes out its own connections; on loopback, where every peer is
    127.0.0.1, the oldest ones (without TCP_DEFER_ACCEPT, macOS: a HELLO that comes later than the flood turns the
    pending connections over may be pushed out; the runner reconnects). A verified HELLO gets the connection a
    thread; UNVERIFIED_PER_STAGE of them per stage may wait for their first frame in the session. Frame sizes: HELLO_MAX_FRAME_BYTES for the HELLO, PRE_AUTH_MAX_FRAME_BYTES
    until a frame in the session verifies, MAX_CONTROL_FRAME_BYTES after (PROTOCOL.md §6).

    Args:
        max_connections: connections with a thread (past their HELLO) at once; a stage that registered before
            always gets one over it (a restarted runner reconnects).
        auth_timeout_s: from the HELLO to the first frame in the session that verifies.
        idle_timeout_s: the most time between frames of a verified connection (runners send a heartbeat a second).
        num_stages: the run's stage count, when known: a HELLO from another stage is refused ("wrong_stage").
        max_pending: connections waiting for their HELLO at once.
        hello_timeout_s: from accept to a HELLO that verifies (at most auth_timeout_s); a connection the kernel
            deferred waited up to DEFER_ACCEPT_S before that.
    """

    def __init__(self, key: bytes, run_id: bytes, host: str = "127.0.0.1", port: int = 0,
                 max_connections: int = 32, auth_timeout_s: float = 10.0, idle_timeout_s: float = 60.0,
                 num_stages: int | None = None, max_pending: int = 64, hello_timeout_s: float = 3.0):
        self.key, self.run_id = key, run_id
        self.max_connections, self.num_stages, self.max_pending = max_connections, num_stages, max_pending
        self.auth_timeout_s, self.idle_timeout_s = auth_timeout_s, idle_timeout_s
        self.hello_timeout_s = min(hello_timeout_s, auth_timeout_s)
        self.events: queue.Queue[ControlEvent] = queue.Queue()
        self.rejected: list[str] = []  # reasons of rejected frames, for the report and tests
        self.pending_dropped: Counter[str] = Counter()  # pending connections closed by us: "budget", "deadline"
        self._sock = socket.create_server((host, port), backlog=LISTEN_BACKLOG)
        if hasattr(socket, "TCP_DEFER_ACCEPT"):
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, DEFER_ACCEPT_S)
        self._sock.setblocking(False)
        self._pending: dict[socket.socket, _Pending] = {}  # oldest first; the accept thread's own
        self._conns: dict[int, _Session] = {}  # stage -> its latest verified connection
        self._unverified: dict[int, list[socket.socket]] = {}  # stage -> connections past the HELLO, oldest first
        self._registered: set[int] = set()  # stages that had a verified connection
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._last_drop_log = 0.0
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
        if not self._accept.is_alive():
            self._sock.close()  # else the accept thread closes it, with the pending connections
        with self._lock:
            for target in self._conns.values():
                _shut(target.conn)
            for waiting in self._unverified.values():
                for conn in waiting:
                    _shut(conn)
        for t in [self._accept, *self._threads]:
            if t.is_alive() and t is not threading.current_thread():
                t.join(timeout=2)
        with self._lock:
            self._conns.clear()

    def __enter__(self) -> "ControlServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # --- pending connections: the accept thread ----------------------------------------------------------------

    def _accept_loop(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._sock, selectors.EVENT_READ)
            try:
                while not self._closed.is_set():
                    ready = sel.select(timeout=0.2)
                    # HELLOs that are here first, then newcomers (which may push out the oldest pending ones).
                    for key, _ in ready:
                        if key.data is not None and key.data.conn in self._pending:
                            self._read_hello(sel, key.data)
                    if any(key.data is None for key, _ in ready):
                        self._accept_some(sel)
                    now = time.monotonic()
                    for p in [p for p in self._pending.values() if now > p.deadline]:
                        self._drop_pending(sel, p, "deadline")
            finally:
                for p in list(self._pending.values()):
                    self._drop_pending(sel, p, None)
                self._sock.close()

    def _accept_some(self, sel: selectors.BaseSelector) -> None:
        for _ in range(max(1, self.max_pending // 4)):  # a bounded batch: the HELLOs of the ones before come first
            try:
                conn, peer = self._sock.accept()
            except OSError as e:  # none waiting; closed; or out of descriptors (EMFILE): wait a little then
                if not isinstance(e, (BlockingIOError, InterruptedError)) and not self._closed.is_set():
                    time.sleep(0.05)
                return
            conn.setblocking(False)
            # A local runner's HELLO, and with TCP_DEFER_ACCEPT any runner's, is here already: read before anyone is
            # pushed out, so a whole HELLO never waits among strangers.
            self._read_hello(sel, _Pending(conn, peer, time.monotonic() + self.hello_timeout_s))

    def _eviction_victim(self) -> _Pending:
        """The oldest pending connection of the address with the most pending connections."""
        counts = Counter(p.peer[0] for p in self._pending.values())
        busiest = max(counts, key=counts.get)
        return next(p for p in self._pending.values() if p.peer[0] == busiest)

    def _read_hello(self, sel: selectors.BaseSelector, p: _Pending) -> None:
        """Read what `p` sent of its HELLO: start its session once it is all here; a newcomer still short of it
        waits among the pending connections (over `max_pending`, pushing one out)."""
        try:
            complete = self._hello_bytes(p)
            if complete is False:
                if p.conn not in self._pending:
                    if len(self._pending) >= self.max_pending:
                        self._drop_pending(sel, self._eviction_victim(), "budget")
                    self._pending[p.conn] = p
                    sel.register(p.conn, selectors.EVENT_READ, p)
                return
            if p.conn in self._pending:
                sel.unregister(p.conn)
                del self._pending[p.conn]
            if complete is None:  # the peer went away
                _close_quietly(p.conn)
                return
            self._start_session(p.conn, p.peer, bytes(p.buf))
        except FrameRejected as e:
            self._rejected(p.peer, e)
            if p.conn in self._pending:
                self._drop_pending(sel, p, None)
            else:
                _close_quietly(p.conn)

    @staticmethod
    def _hello_bytes(p: _Pending) -> bool | None:
        """Read what has arrived of `p`'s HELLO into `p.buf`. True: all of it is there; False: more is to come;
        None: the peer closed or failed.

        Raises:
            FrameRejected: its header announces a frame larger than a HELLO can be.
        """
        while len(p.buf) < p.need:
            try:
                chunk = p.conn.recv(p.need - len(p.buf))
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:
                return None
            if not chunk:
                return None
            p.buf += chunk
            if p.need == frames.HEADER_SIZE and len(p.buf) == frames.HEADER_SIZE:
                p.need = frames.peek_length(p.buf, HELLO_MAX_FRAME_BYTES)
        return True

    def _drop_pending(self, sel: selectors.BaseSelector, p: _Pending, why: str | None) -> None:
        """Close a pending connection; `why` ("budget", "deadline") is counted and logged at most every 5 s (a flood
        would log thousands of lines), None when the peer went away or was rejected (logged already)."""
        sel.unregister(p.conn)
        del self._pending[p.conn]
        _close_quietly(p.conn)
        if why is None:
            return
        self.pending_dropped[why] += 1
        now = time.monotonic()
        if now - self._last_drop_log > 5.0:
            self._last_drop_log = now
            log.warning("control: connections without a HELLO closed so far: %d pushed out by newer ones (at most %d "
                        "wait), %d without a HELLO within %.1f s", self.pending_dropped["budget"], self.max_pending,
                        self.pending_dropped["deadline"], self.hello_timeout_s)

    def _start_session(self, conn: socket.socket, peer, wire: bytes) -> None:
        """The HELLO is all here: open it and give the connection a thread of its own, within the limits.

        Raises:
            FrameRejected: the HELLO does not verify, is not a HELLO, or names a stage the run does not have.
        """
        claimed, receive_key, hello = self._open_hello(wire)
        self._threads = [t for t in self._threads if t.is_alive()]
        with self._lock:
            if len(self._threads) >= self.max_connections and claimed not in self._registered:
                log.warning("control: %d connections served already; refusing one from %s:%s for stage %d",
                            len(self._threads), peer[0], peer[1], claimed)
                _close_quietly(conn)
                return
            waiting = self._unverified.setdefault(claimed, [])
            if len(waiting) >= UNVERIFIED_PER_STAGE:
                _shut(waiting.pop(0))  # its thread sees the end and closes it
            waiting.append(conn)
        t = threading.Thread(target=self._serve, args=(conn, peer, claimed, receive_key, hello),
                             name=f"zl-control-{peer[1]}", daemon=True)
        try:
            t.start()
        except RuntimeError as e:  # no thread to be had: this connection goes, the server stays
            log.warning("control: cannot serve a connection from %s:%s (%s); closing it", peer[0], peer[1], e)
            with self._lock:
                self._forget_unverified(claimed, conn)
            _close_quietly(conn)
            return
        self._threads.append(t)

    def _open_hello(self, wire: bytes) -> tuple[int, bytes, Frame]:
        """The runner's HELLO (PROTOCOL.md §6), sealed with the control key of the stage its header names.

        Raises:
            FrameRejected: it does not verify, the first frame is not a HELLO ("bad_handshake"), or its stage is
                not one of the run's ("wrong_stage").
        """
        claimed = struct.unpack_from("<I", wire, 32)[0]  # authenticated below: the key depends on it
        receive_key = frames.derive_key(self.key, frames.KeyPurpose.CONTROL_UP, claimed)
        hello = frames.decode(wire, receive_key, run_id=self.run_id, max_frame_bytes=HELLO_MAX_FRAME_BYTES,
                              stage=claimed)
        if hello.type != FrameType.HELLO or hello.seq != 0:
            raise FrameRejected("bad_handshake", f"the first frame of a connection must be HELLO with sequence number "
                                                 f"0, not {hello.type.name} with {hello.seq}")
        if self.num_stages is not None and claimed >= self.num_stages:
            raise FrameRejected("wrong_stage", f"HELLO from stage {claimed}; this run has stages 0-"
                                               f"{self.num_stages - 1}")
        return claimed, receive_key, hello

    def _rejected(self, peer, e: FrameRejected) -> None:
        self.rejected.append(e.error)
        log.warning("control frame from %s:%s rejected (%s); closing that connection", peer[0], peer[1], e)

    # --- connections past the HELLO: a thread each -------------------------------------------------------------

    def _read_frame(self, conn: socket.socket, authenticated: bool, deadline: float | None = None) -> bytes | None:
        """One frame's bytes (None: closed, timed out or shutting down); the size limit and the time allowed depend
        on whether a frame of this connection verified already."""
        if deadline is None:
            deadline = time.monotonic() + self.idle_timeout_s
        header = _read_exact(conn, frames.HEADER_SIZE, self._closed, deadline)
        if header is None:
            return None
        total = frames.peek_length(header, MAX_CONTROL_FRAME_BYTES if authenticated else PRE_AUTH_MAX_FRAME_BYTES)
        rest = _read_exact(conn, total - frames.HEADER_SIZE, self._closed, deadline)
        return None if rest is None else header + rest

    def _serve(self, conn: socket.socket, peer, claimed: int, receive_key: bytes, hello: Frame) -> None:
        stage = None  # set once a frame after the handshake verified: the connection then serves that stage
        try:
            conn.setblocking(True)
            conn.settimeout(0.2)
            # Our HELLO: the runner's random half of the session and a fresh one of ours.
            target = _Session(conn, hello.session[:frames.SESSION_HALF] + os.urandom(frames.SESSION_HALF),
                              frames.derive_key(self.key, frames.KeyPurpose.CONTROL_DOWN, claimed))
            conn.sendall(frames.encode(Frame(FrameType.HELLO, self.run_id, stage=frames.COORDINATOR_STAGE,
                                             session=target.session), target.send_key))
            auth_deadline = time.monotonic() + self.auth_timeout_s
            last_seq = 0
            while not self._closed.is_set():
                wire = self._read_frame(conn, authenticated=stage is not None,
                                        deadline=None if stage is not None else auth_deadline)
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
                        self._forget_unverified(claimed, conn)
                        old = self._conns.get(stage)
                        self._conns[stage] = target
                        self._registered.add(stage)
                    if old is not None and old.conn is not conn:
                        _shut(old.conn)
                problem = frame_problem(frame)
                if problem is not None:
                    # Signed but unusable: drop this frame, keep the (still framed) connection.
                    self.rejected.append("bad_payload")
                    log.warning("control frame from %s:%s rejected (bad_payload: %s)", peer[0], peer[1], problem)
                    continue
                self.events.put(ControlEvent(frame.stage, frame.type, frame.window, frame.micro_batch,
                                             frame.payload or {}, time.monotonic()))
        except FrameRejected as e:
            self._rejected(peer, e)
        except OSError:
            pass
        finally:
            with self._lock:
                self._forget_unverified(claimed, conn)
                if stage is not None and self._conns.get(stage) is not None and self._conns[stage].conn is conn:
                    del self._conns[stage]
            _close_quietly(conn)

    def _forget_unverified(self, stage: int, conn: socket.socket) -> None:
        """Under self._lock."""
        waiting = self._unverified.get(stage, [])
        if conn in waiting:
            waiting.remove(conn)


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


def _shut(conn: socket.socket) -> None:
    """End a connection that another thread serves: its reads see the end and that thread closes it (closing it
    here could let the descriptor be reused under that thread)."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
