"""The frame codec in Python: the twin of runner/include/zl/frame.h.

The coordinator speaks the runners' wire format on the control channel
(HELLO, REGISTER, HEARTBEAT, START, STOP, WINDOW_COMMITTED, ERROR). A frame is

    [128-byte header][JSON payload][tensor records][16-byte tag]

little-endian. Everything after the header is encrypted with XChaCha20-Poly1305 (libsodium's
crypto_aead_xchacha20poly1305_ietf, here through PyNaCl) under a frame key derived from the run key
(derive_key: one per channel, link and direction), with the whole header as associated data and the
random 24-byte nonce in the header. Header offsets:

    0 magic "ZLFR" | 4 u16 version (2) | 6 u16 type | 8 u32 total_length (tag included)
    12 u32 flags (0) | 16 run id (16 bytes) | 32 u32 stage | 36 u32 tensor_count
    40 u64 window | 48 u64 micro_batch | 56 u32 json_length | 60 u32 reserved (0)
    64 session (32 bytes) | 96 u64 seq | 104 nonce (24 bytes)

A tensor record: u8 dtype | u8 rank | u16 name_length | u32 reserved (0) |
u64 payload_length | name | rank x u64 dims | payload.

Rejections raise FrameRejected with the same reason names as the C++
decoder (`frame_error_name`), so logs from both sides read alike; both apply
the one payload and tensor rule of runner/PROTOCOL.md §5, in the
same order, so they accept and reject exactly the same frames
(tests/test_frames.py checks that on a generated corpus).
"""

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np
from nacl import bindings as _sodium
from nacl.exceptions import CryptoError

from zl_base.json_nesting import nests_deeper_than

MAGIC = b"ZLFR"
VERSION = 2  # 1: MAC only, before frames were encrypted (rejected as bad_version)
HEADER_SIZE = 128
TAG_SIZE = 16  # Poly1305
NONCE_SIZE = 24  # XChaCha20, random per frame
KEY_SIZE = 32
RUN_ID_SIZE = 16
SESSION_SIZE = 32  # the client's 16 random bytes, then the server's (PROTOCOL.md §6)
SESSION_HALF = 16
NO_SESSION = bytes(SESSION_SIZE)  # input log entries
MAX_RANK = 8
DEFAULT_MAX_FRAME_BYTES = 64 << 20
MAX_JSON_BYTES = 1 << 20  # the payload rule: at most 1 MiB of JSON ...
MAX_JSON_DEPTH = 32  # ... nested at most 32 arrays/objects deep (the top-level object is 1)
COORDINATOR_STAGE = 0xFFFFFFFF  # the `stage` field of frames the coordinator sends

_HEADER = struct.Struct("<4sHHII16sIIQQII32sQ24s")
_RECORD = struct.Struct("<BBHIQ")
assert _HEADER.size == HEADER_SIZE and _RECORD.size == 16
assert TAG_SIZE == _sodium.crypto_aead_xchacha20poly1305_ietf_ABYTES
assert NONCE_SIZE == _sodium.crypto_aead_xchacha20poly1305_ietf_NPUBBYTES


class FrameType(IntEnum):
    DATA = 1
    ACK = 2
    HELLO = 3
    GRAD = 4  # stage k+1 -> k: grad_hidden [B,S,D] (bf16 or f32) of the DATA entry (window, micro_batch)
    REGISTER = 16
    HEARTBEAT = 17
    START = 18
    STOP = 19
    WINDOW_COMMITTED = 20
    ERROR = 21


# numpy has no bfloat16: its tensors are read as this structured dtype (the raw 16-bit patterns), which
# encode() maps back to dtype code 5.
BFLOAT16 = np.dtype([("bfloat16", "<u2")])
_DTYPES = {1: np.dtype("<f4"), 2: np.dtype("<i8"), 3: np.dtype("<i4"), 4: np.dtype("<f2"), 5: BFLOAT16,
           6: np.dtype("u1")}
_DTYPE_NAMES = {1: "float32", 2: "int64", 3: "int32", 4: "float16", 5: "bfloat16", 6: "uint8"}
_DTYPE_CODES = {v: k for k, v in _DTYPES.items()}


class FrameRejected(ValueError):
    """A frame that failed validation; `error` is the C++ decoder's reason name ("bad_mac", ...)."""

    def __init__(self, error: str, reason: str):
        super().__init__(f"{error}: {reason}")
        self.error = error
        self.reason = reason


@dataclass
class Frame:
    type: FrameType
    run_id: bytes
    stage: int = 0
    window: int = 0
    micro_batch: int = 0
    payload: dict | None = None  # the JSON object, or None for an empty payload
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    session: bytes = NO_SESSION  # the connection's session id (PROTOCOL.md §6)
    seq: int = 0  # the sender's sequence number on it (HELLO: 0)


class KeyPurpose(IntEnum):
    """What a frame key is for (the C++ KeyPurpose); `link` is the data link's upstream stage k, the stage of a
    control connection, or the stage whose input log it is."""

    DATA_DOWN = 1  # data link k -> k+1: DATA (and HELLO) from stage k
    DATA_UP = 2  # data link k -> k+1: ACK, GRAD, ERROR, HELLO from stage k+1
    CONTROL_UP = 3  # control channel of stage k: stage -> coordinator
    CONTROL_DOWN = 4  # control channel of stage k: coordinator -> stage
    INPUT_LOG = 5  # stage k's input log entries at rest


KDF_CONTEXT = b"zl-frame"


def derive_key(run_key: bytes, purpose: KeyPurpose, link: int) -> bytes:
    """libsodium's crypto_kdf_derive_from_key(32, purpose << 32 | link, "zl-frame", run_key) (the C++
    derive_frame_key): BLAKE2b-256 keyed with the run key, salt = the subkey id as 8 little-endian bytes + 8 zero
    bytes, personalization = the context + 8 zero bytes, empty message."""
    if len(run_key) != KEY_SIZE:
        raise ValueError(f"run key has {len(run_key)} bytes, expected {KEY_SIZE}")
    subkey_id = (int(purpose) << 32) | (link & 0xFFFFFFFF)
    return hashlib.blake2b(b"", digest_size=KEY_SIZE, key=run_key, salt=subkey_id.to_bytes(8, "little") + bytes(8),
                           person=KDF_CONTEXT + bytes(8)).digest()


def seal(plain: bytes, key: bytes) -> bytes:
    """[header with its nonce][plaintext body][tag space] -> the wire frame (the C++ seal_frame): the body
    encrypted under `key`, the header as associated data. For tests that alter a frame's plaintext."""
    header, body = bytes(plain[:HEADER_SIZE]), bytes(plain[HEADER_SIZE:len(plain) - TAG_SIZE])
    nonce = header[HEADER_SIZE - NONCE_SIZE:]
    return header + _sodium.crypto_aead_xchacha20poly1305_ietf_encrypt(body, header, nonce, key)


def unseal(wire: bytes, key: bytes) -> bytes | None:
    """The inverse of seal (the C++ open_frame): the plaintext form, or None when the tag does not verify."""
    header = bytes(wire[:HEADER_SIZE])
    try:
        body = _sodium.crypto_aead_xchacha20poly1305_ietf_decrypt(bytes(wire[HEADER_SIZE:]), header,
                                                                  header[HEADER_SIZE - NONCE_SIZE:], key)
    except CryptoError:
        return None
    return header + body + bytes(TAG_SIZE)


def escape_bytes(raw: bytes, max_bytes: int = 64) -> str:
    """Untrusted bytes made safe for reasons and logs (the C++ escape_bytes): printable ASCII is kept,
    every other byte (and backslash and quotes) becomes \\xNN; at most `max_bytes` are shown, then "..."."""
    text = "".join(chr(b) if 0x20 <= b < 0x7F and b not in b"\\'\"" else f"\\x{b:02x}" for b in raw[:max_bytes])
    return text + ("..." if len(raw) > max_bytes else "")


class _BadJson(ValueError):
    pass


def _parse_int(text: str) -> int:
    digits = text.lstrip("-")
    if len(digits) > 20:
        raise _BadJson("integer out of range")
    value = int(text)
    if not -(1 << 63) <= value <= (1 << 64) - 1:
        raise _BadJson("integer out of range")
    return value


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _BadJson("number out of range")
    return value


def _parse_constant(text: str):
    raise _BadJson(f"invalid literal {text}")


def _object(pairs: list) -> dict:
    out = {}
    for k, v in pairs:
        if k in out:
            raise _BadJson(f"duplicate object key '{escape_bytes(k.encode('utf-8', 'backslashreplace'))}'")
        out[k] = v
    return out


def _no_lone_surrogates(value) -> None:
    """Raises _BadJson for a string (key or value) holding a lone surrogate from a \\u escape."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise _BadJson("lone surrogate \\u escape") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _no_lone_surrogates(k)
            _no_lone_surrogates(v)
    elif isinstance(value, list):
        for v in value:
            _no_lone_surrogates(v)


def check_payload(raw: bytes) -> dict | None:
    """The payload rule (PROTOCOL.md §5, the C++ check_frame_json): empty (None), or at most MAX_JSON_BYTES of
    strict UTF-8 holding exactly one RFC 8259 JSON object (whitespace around it allowed) with no NaN/Infinity,
    integers in [-2^63, 2^64-1], other numbers finite as doubles, no lone surrogate escapes, no duplicate keys
    and at most MAX_JSON_DEPTH levels of nesting.

    Raises:
        FrameRejected: "bad_payload", naming the broken rule.
    """
    if not raw:
        return None
    raw = bytes(raw)
    where = f"JSON payload of {len(raw)} bytes"
    if len(raw) > MAX_JSON_BYTES:
        raise FrameRejected("bad_payload", f"{where} exceeds the maximum of {MAX_JSON_BYTES}")
    try:
        text = raw.decode("utf-8")  # strict: no overlong forms, no encoded surrogates
    except UnicodeDecodeError:
        raise FrameRejected("bad_payload", f"{where}: invalid UTF-8") from None
    if not text.lstrip(" \t\n\r").startswith("{"):
        raise FrameRejected("bad_payload", f"{where}: the payload is not a JSON object")
    if nests_deeper_than(raw, MAX_JSON_DEPTH):  # linear, before json.loads recurses
        raise FrameRejected("bad_payload", f"{where}: nesting deeper than {MAX_JSON_DEPTH}")
    try:
        value = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant,
                           object_pairs_hook=_object)
        _no_lone_surrogates(value)
    except _BadJson as e:
        raise FrameRejected("bad_payload", f"{where}: {e}") from None
    except (ValueError, RecursionError):
        raise FrameRejected("bad_payload", f"{where} does not parse") from None
    return value


def check_tensor_name(raw: bytes) -> str:
    """The tensor name rule (the C++ check_tensor_name): non-empty strict UTF-8 without C0 controls or DEL.

    Raises:
        ValueError: naming the broken rule (untrusted bytes escaped).
    """
    if not raw:
        raise ValueError("empty tensor name")
    try:
        name = bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"tensor name '{escape_bytes(raw)}' is not valid UTF-8") from None
    if any(ord(c) < 0x20 or c == "\x7f" for c in name):
        raise ValueError(f"tensor name '{escape_bytes(raw)}' has a control character")
    return name


_INT64_MAX = (1 << 63) - 1


def _numel(shape, itemsize: int) -> int:
    """The product of `shape`, or -1 when the item size times the non-zero dims exceeds 2^63-1 (which numpy,
    like the C++ decoder, cannot hold)."""
    n, nonzero = 1, itemsize
    for d in shape:
        n *= d
        nonzero *= d or 1
    return -1 if nonzero > _INT64_MAX else n


def encode(frame: Frame, key: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, nonce: bytes | None = None) -> bytes:
    """Serialize `frame` and seal it under the frame key `key` with `nonce` (default: 24 fresh random bytes;
    pass one only to reproduce a frame).

    Raises:
        ValueError: a bad key, run id, session or nonce length, a payload or tensor name the decoder would
            reject, an unsupported dtype, rank > 8, or an oversize frame.
    """
    if len(key) != KEY_SIZE:
        raise ValueError(f"frame key has {len(key)} bytes, expected {KEY_SIZE}")
    if len(frame.run_id) != RUN_ID_SIZE:
        raise ValueError(f"run id has {len(frame.run_id)} bytes, expected {RUN_ID_SIZE}")
    if len(frame.session) != SESSION_SIZE:
        raise ValueError(f"session has {len(frame.session)} bytes, expected {SESSION_SIZE}")
    nonce = os.urandom(NONCE_SIZE) if nonce is None else nonce
    if len(nonce) != NONCE_SIZE:
        raise ValueError(f"nonce has {len(nonce)} bytes, expected {NONCE_SIZE}")
    if frame.payload is not None and not isinstance(frame.payload, dict):
        raise ValueError(f"payload must be a dict or None, not {type(frame.payload).__name__}")
    body = json.dumps(frame.payload, separators=(",", ":"), allow_nan=False).encode() if frame.payload is not None else b""
    try:
        check_payload(body)
    except FrameRejected as e:
        raise ValueError(str(e)) from None
    records = []
    for name, array in frame.tensors.items():
        array = np.ascontiguousarray(array)
        code = _DTYPE_CODES.get(array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype)
        if code is None:
            raise ValueError(f"tensor {name!r}: dtype {array.dtype} cannot go on the wire")
        if array.ndim > MAX_RANK:
            raise ValueError(f"tensor {name!r}: rank {array.ndim}, the maximum is {MAX_RANK}")
        encoded_name = name.encode("utf-8", "surrogatepass")
        check_tensor_name(encoded_name)
        raw = array.astype(_DTYPES[code], copy=False).tobytes()
        records.append(_RECORD.pack(code, array.ndim, len(encoded_name), 0, len(raw)) + encoded_name
                       + b"".join(struct.pack("<Q", d) for d in array.shape) + raw)
    total = HEADER_SIZE + len(body) + sum(map(len, records)) + TAG_SIZE
    if total > max_frame_bytes:
        raise ValueError(f"frame of {total} bytes exceeds the maximum of {max_frame_bytes}")
    header = _HEADER.pack(MAGIC, VERSION, int(frame.type), total, 0, frame.run_id, frame.stage, len(records),
                          frame.window, frame.micro_batch, len(body), 0, frame.session, frame.seq, nonce)
    return header + _sodium.crypto_aead_xchacha20poly1305_ietf_encrypt(body + b"".join(records), header, nonce, key)


def peek_length(header: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> int:
    """The total length of the frame that starts with `header` (at least its first 64 bytes)."""
    if len(header) >= 4 and header[:4] != MAGIC:
        raise FrameRejected("bad_magic", f"first bytes are {header[:4].hex()}, expected 5a4c4652 (\"ZLFR\")")
    if len(header) < HEADER_SIZE:
        raise FrameRejected("truncated", f"only {len(header)} bytes, a frame header has {HEADER_SIZE}")
    version, total = struct.unpack_from("<H", header, 4)[0], struct.unpack_from("<I", header, 8)[0]
    if version != VERSION:
        old = " (version 1 frames are only MACed, not encrypted; update the sender)" if version == 1 else ""
        raise FrameRejected("bad_version", f"version {version}, this build speaks version {VERSION}{old}")
    if total > max_frame_bytes:
        raise FrameRejected("oversize", f"total_length {total} exceeds the maximum of {max_frame_bytes} bytes")
    if total < HEADER_SIZE + TAG_SIZE:
        raise FrameRejected("length_mismatch", f"total_length {total} is below the minimum of {HEADER_SIZE + TAG_SIZE}")
    return total


def decode(data: bytes, key: bytes, run_id: bytes | None = None,
           max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, stage: int | None = None,
           expect_shape: tuple[int, int, int] | None = None, session: bytes | None = None,
           min_seq: int = 0) -> Frame:
    """Validate, open (under the frame key `key`) and decode exactly one frame, with the checks and their order
    of the C++ decode_frame.

    `run_id`, `stage` (the sender's), `session` (the connection's), `min_seq` (the lowest sequence number still
    new on it) and `expect_shape` (B, S, D of a DATA frame: it must carry exactly hidden float32 [B,S,D],
    attention_mask int64 [B,S], labels int64 [B,S]; of a GRAD frame: exactly grad_hidden bfloat16 or float32
    [B,S,D]) are checked when given.

    Raises:
        FrameRejected: with the reason name of the C++ decoder; never another exception.
    """
    data = bytes(data)
    total = peek_length(data, max_frame_bytes)
    if len(data) != total:
        error = "truncated" if len(data) < total else "length_mismatch"
        raise FrameRejected(error, f"have {len(data)} bytes, total_length is {total}")
    plain = unseal(data, key)
    if plain is None:
        raise FrameRejected("bad_mac", "authentication tag does not verify (frame corrupted in transit, sent under "
                                       "another run key, or for another link or direction)")
    data = plain
    body_end = total - TAG_SIZE
    (_, _, type_, _, flags, rid, sender, count, window, micro_batch, json_len, reserved, sid, seq,
     _) = _HEADER.unpack_from(data)
    try:
        ftype = FrameType(type_)
    except ValueError:
        raise FrameRejected("unknown_type", f"type {type_} is not a known frame type") from None
    if flags or reserved:
        raise FrameRejected("bad_header", "flags/reserved header fields must be 0")
    pos = HEADER_SIZE
    if json_len > body_end - pos:
        raise FrameRejected("length_mismatch", f"json_length {json_len} runs past the end of the frame")
    payload = check_payload(data[pos:pos + json_len])
    pos += json_len
    if count > (body_end - pos) // _RECORD.size:
        raise FrameRejected("length_mismatch", f"tensor_count {count} does not fit in the frame")
    tensors = {}
    for i in range(count):
        where = f"tensor record {i}"
        if body_end - pos < _RECORD.size:
            raise FrameRejected("length_mismatch", f"{where} header runs past the end of the frame")
        code, rank, name_len, rec_reserved, nbytes = _RECORD.unpack_from(data, pos)
        pos += _RECORD.size
        if code not in _DTYPES:
            raise FrameRejected("bad_tensor", f"{where} has unknown dtype {code}")
        if rank > MAX_RANK:
            raise FrameRejected("bad_tensor", f"{where} has rank {rank} > 8")
        if rec_reserved:
            raise FrameRejected("bad_header", f"{where} reserved field must be 0")
        if name_len + 8 * rank > body_end - pos or nbytes > body_end - pos - name_len - 8 * rank:
            raise FrameRejected("length_mismatch", f"{where} runs past the end of the frame")
        raw_name = data[pos:pos + name_len]
        try:
            name = check_tensor_name(raw_name)
        except ValueError as e:
            raise FrameRejected("bad_tensor", f"{where}: {e}") from None
        if name in tensors:
            raise FrameRejected("bad_tensor", f"{where}: a second tensor named '{escape_bytes(raw_name)}'")
        pos += name_len
        shape = struct.unpack_from(f"<{rank}Q", data, pos)
        pos += 8 * rank
        dtype = _DTYPES[code]
        n = _numel(shape, dtype.itemsize)
        if n < 0 or n * dtype.itemsize != nbytes:
            raise FrameRejected("bad_tensor", f"tensor '{escape_bytes(raw_name)}' has shape [{','.join(map(str, shape))}] "
                                              f"and dtype {_DTYPE_NAMES[code]} but {nbytes} payload bytes")
        tensors[name] = np.frombuffer(data, dtype=dtype, count=n, offset=pos).reshape(shape)
        pos += nbytes
    if pos != body_end:
        raise FrameRejected("length_mismatch", f"{body_end - pos} unaccounted bytes before the tag")
    if run_id is not None and rid != run_id:
        raise FrameRejected("wrong_run", f"run id {rid.hex()}, expected {run_id.hex()}")
    if stage is not None and sender != stage:
        raise FrameRejected("wrong_stage", f"stage {sender}, expected {stage}")
    if session is not None and sid != session:
        raise FrameRejected("wrong_session", f"session {sid.hex()}, expected this connection's {session.hex()}")
    if seq < min_seq:
        raise FrameRejected("replay", f"sequence number {seq} was used already on this connection (the next new one "
                                      f"is at least {min_seq})")
    if ftype == FrameType.DATA and expect_shape is not None and all(v > 0 for v in expect_shape):
        b, s, d = expect_shape
        bad = ""
        for tname, tdtype, tshape in (("hidden", 1, (b, s, d)), ("attention_mask", 2, (b, s)), ("labels", 2, (b, s))):
            t = tensors.get(tname)
            if t is None:
                bad = f"DATA frame has no tensor '{tname}'"
            elif t.dtype != _DTYPES[tdtype]:
                bad = f"tensor '{tname}' has dtype {_DTYPE_NAMES[_DTYPE_CODES[t.dtype]]}, expected {_DTYPE_NAMES[tdtype]}"
            elif t.shape != tshape:
                bad = f"tensor '{tname}' has shape {list(t.shape)}, expected {list(tshape)}"
            if bad:
                break
        if not bad and len(tensors) != 3:
            bad = f"DATA frame has {len(tensors)} tensors, expected 3"
        if bad:
            raise FrameRejected("unexpected_tensor", bad)
    if ftype == FrameType.GRAD and expect_shape is not None and all(v > 0 for v in expect_shape):
        bad = _grad_tensor_problem(tensors, expect_shape)
        if bad:
            raise FrameRejected("unexpected_tensor", bad)
    return Frame(ftype, rid, sender, window, micro_batch, payload, tensors, sid, seq)


GRAD_TENSOR = "grad_hidden"  # a GRAD frame's one tensor
GRAD_WIRE_DTYPES = ("bfloat16", "float32")  # the first is the default


def _grad_tensor_problem(tensors: dict[str, np.ndarray], shape: tuple[int, int, int]) -> str:
    """Why a GRAD frame's tensors are not exactly grad_hidden bfloat16/float32 `shape` (the C++
    check_grad_tensor), or "" when they are."""
    t = tensors.get(GRAD_TENSOR)
    if t is None:
        return f"GRAD frame has no tensor '{GRAD_TENSOR}'"
    code = _DTYPE_CODES[t.dtype]
    if code not in (1, 5):
        return f"tensor '{GRAD_TENSOR}' has dtype {_DTYPE_NAMES[code]}, expected bfloat16 or float32"
    if t.shape != tuple(shape):
        return f"tensor '{GRAD_TENSOR}' has shape {list(t.shape)}, expected {list(shape)}"
    if len(tensors) != 1:
        return f"GRAD frame has {len(tensors)} tensors, expected 1"
    return ""


def to_bfloat16(values: np.ndarray) -> np.ndarray:
    """float32 -> BFLOAT16 (the C++ bf16_from_f32): round to nearest, ties to even; NaN stays a quiet NaN."""
    bits = np.ascontiguousarray(values, dtype="<f4").view("<u4")
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16  # no overflow: only NaN patterns lie above 0xFF800000
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    out = np.where(nan, (bits >> 16) | 0x40, rounded).astype("<u2")
    return out.view(BFLOAT16).reshape(np.shape(values))


def from_bfloat16(values: np.ndarray) -> np.ndarray:
    """BFLOAT16 -> float32 (the C++ f32_from_bf16): exact, bf16 being the top half of a float32."""
    bits = np.ascontiguousarray(values).view("<u2").astype("<u4") << 16
    return bits.view("<f4").reshape(values.shape)


def grad_frame(run_id: bytes, stage: int, window: int, micro_batch: int, grad_hidden: np.ndarray,
               wire_dtype: str = "bfloat16") -> Frame:
    """A GRAD frame (the C++ make_grad_frame): stage k+1 (`stage`) sends `grad_hidden` (B, S, D) float32, the
    gradient of the DATA entry (window, micro_batch) it received, upstream; narrowed to bfloat16 unless
    `wire_dtype` is "float32".

    Raises:
        ValueError: another wire dtype, or `grad_hidden` not a float32 (B, S, D) of positive dims.
    """
    if wire_dtype not in GRAD_WIRE_DTYPES:
        raise ValueError(f"GRAD wire dtype {wire_dtype!r} is not supported; use bfloat16 (default) or float32")
    grad = np.asarray(grad_hidden)
    if grad.dtype != np.float32 or grad.ndim != 3 or min(grad.shape) <= 0:
        raise ValueError(f"grad_hidden is {grad.dtype} {list(grad.shape)}, expected a float32 (B, S, D) of "
                         "positive dims")
    wire = to_bfloat16(grad) if wire_dtype == "bfloat16" else grad  # (B, S, D)
    return Frame(FrameType.GRAD, run_id, stage=stage, window=window, micro_batch=micro_batch,
                 tensors={GRAD_TENSOR: wire})


def grad_hidden(frame: Frame, shape: tuple[int, int, int]) -> np.ndarray:
    """A GRAD frame's grad_hidden as float32 (B, S, D), bf16 widened (the C++ grad_hidden_f32).

    Raises:
        FrameRejected: "unexpected_tensor" when the frame is not a GRAD of exactly grad_hidden
            bfloat16/float32 `shape`.
    """
    if frame.type != FrameType.GRAD:
        raise FrameRejected("unexpected_tensor", f"expected a GRAD frame, got {frame.type.name}")
    bad = _grad_tensor_problem(frame.tensors, shape)
    if bad:
        raise FrameRejected("unexpected_tensor", f"{bad} (window {frame.window}, micro-batch {frame.micro_batch})")
    t = frame.tensors[GRAD_TENSOR]
    return from_bfloat16(t) if t.dtype == BFLOAT16 else np.array(t, dtype=np.float32)


def parse_key(text: str) -> bytes:
    """The run key file's content: 64 hex characters (surrounding whitespace ignored)."""
    text = text.strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_SIZE:
        raise ValueError(f"run key must be {2 * KEY_SIZE} hex characters, got {len(text)} characters")
    return key
