"""The frame codec in Python: the twin of android_app/native/include/zl/frame.h.

The coordinator speaks the runners' wire format on the control channel
(REGISTER, HEARTBEAT, START, STOP, WINDOW_COMMITTED, ERROR). A frame is

    [64-byte header][JSON payload][tensor records][32-byte MAC]

little-endian, with the MAC a keyed BLAKE2b-256 (what libsodium's
crypto_generichash computes; here hashlib.blake2b with `key=`) under the
per-run 32-byte key over every byte before it. Header offsets:

    0 magic "ZLFR" | 4 u16 version | 6 u16 type | 8 u32 total_length (MAC included)
    12 u32 flags (0) | 16 run id (16 bytes) | 32 u32 stage | 36 u32 tensor_count
    40 u64 window | 48 u64 micro_batch | 56 u32 json_length | 60 u32 reserved (0)

A tensor record: u8 dtype | u8 rank | u16 name_length | u32 reserved (0) |
u64 payload_length | name | rank x u64 dims | payload.

Rejections raise FrameRejected with the same reason names as the C++
decoder (`frame_error_name`), so logs from both sides read alike.
"""

import hashlib
import hmac
import json
import struct
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

MAGIC = b"ZLFR"
VERSION = 1
HEADER_SIZE = 64
MAC_SIZE = 32
KEY_SIZE = 32
RUN_ID_SIZE = 16
MAX_RANK = 8
DEFAULT_MAX_FRAME_BYTES = 64 << 20
COORDINATOR_STAGE = 0xFFFFFFFF  # the `stage` field of frames the coordinator sends

_HEADER = struct.Struct("<4sHHII16sIIQQII")
_RECORD = struct.Struct("<BBHIQ")
assert _HEADER.size == HEADER_SIZE and _RECORD.size == 16


class FrameType(IntEnum):
    DATA = 1
    ACK = 2
    REGISTER = 16
    HEARTBEAT = 17
    START = 18
    STOP = 19
    WINDOW_COMMITTED = 20
    ERROR = 21


_DTYPES = {1: np.float32, 2: np.int64, 3: np.int32, 4: np.float16, 6: np.uint8}  # 5 (bfloat16) has no numpy type
_DTYPE_CODES = {np.dtype(v): k for k, v in _DTYPES.items()}


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


def frame_mac(data: bytes, key: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=MAC_SIZE, key=key).digest()


def encode(frame: Frame, key: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """Serialize `frame` and append its MAC.

    Raises:
        ValueError: a bad key or run id length, an unsupported dtype, rank > 8, or an oversize frame.
    """
    if len(key) != KEY_SIZE:
        raise ValueError(f"run key has {len(key)} bytes, expected {KEY_SIZE}")
    if len(frame.run_id) != RUN_ID_SIZE:
        raise ValueError(f"run id has {len(frame.run_id)} bytes, expected {RUN_ID_SIZE}")
    body = json.dumps(frame.payload, separators=(",", ":")).encode() if frame.payload is not None else b""
    records = []
    for name, array in frame.tensors.items():
        array = np.ascontiguousarray(array)
        code = _DTYPE_CODES.get(array.dtype)
        if code is None:
            raise ValueError(f"tensor {name!r}: dtype {array.dtype} cannot go on the wire")
        if array.ndim > MAX_RANK:
            raise ValueError(f"tensor {name!r}: rank {array.ndim}, the maximum is {MAX_RANK}")
        raw, encoded_name = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes(), name.encode()
        records.append(_RECORD.pack(code, array.ndim, len(encoded_name), 0, len(raw)) + encoded_name
                       + b"".join(struct.pack("<Q", d) for d in array.shape) + raw)
    total = HEADER_SIZE + len(body) + sum(map(len, records)) + MAC_SIZE
    if total > max_frame_bytes:
        raise ValueError(f"frame of {total} bytes exceeds the maximum of {max_frame_bytes}")
    header = _HEADER.pack(MAGIC, VERSION, int(frame.type), total, 0, frame.run_id, frame.stage, len(records),
                          frame.window, frame.micro_batch, len(body), 0)
    data = header + body + b"".join(records)
    return data + frame_mac(data, key)


def peek_length(header: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> int:
    """The total length of the frame that starts with `header` (at least its first 64 bytes)."""
    if len(header) >= 4 and header[:4] != MAGIC:
        raise FrameRejected("bad_magic", f"first bytes are {header[:4].hex()}, expected 5a4c4652 (\"ZLFR\")")
    if len(header) < HEADER_SIZE:
        raise FrameRejected("truncated", f"only {len(header)} bytes, a frame header has 64")
    version, total = struct.unpack_from("<H", header, 4)[0], struct.unpack_from("<I", header, 8)[0]
    if version != VERSION:
        raise FrameRejected("bad_version", f"version {version}, this build speaks version {VERSION}")
    if total > max_frame_bytes:
        raise FrameRejected("oversize", f"total_length {total} exceeds the maximum of {max_frame_bytes} bytes")
    if total < HEADER_SIZE + MAC_SIZE:
        raise FrameRejected("length_mismatch", f"total_length {total} is below the minimum of {HEADER_SIZE + MAC_SIZE}")
    return total


def decode(data: bytes, key: bytes, run_id: bytes | None = None,
           max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Frame:
    """Validate and decode exactly one frame.

    Raises:
        FrameRejected: with the reason name of the C++ decoder.
    """
    total = peek_length(data, max_frame_bytes)
    if len(data) != total:
        error = "truncated" if len(data) < total else "length_mismatch"
        raise FrameRejected(error, f"have {len(data)} bytes, total_length is {total}")
    body_end = total - MAC_SIZE
    if not hmac.compare_digest(frame_mac(data[:body_end], key), data[body_end:]):
        raise FrameRejected("bad_mac", "MAC does not verify (frame corrupted in transit or sent under another run key)")
    (_, _, type_, _, flags, rid, stage, count, window, micro_batch, json_len, reserved) = _HEADER.unpack_from(data)
    try:
        ftype = FrameType(type_)
    except ValueError:
        raise FrameRejected("unknown_type", f"type {type_} is not a known frame type") from None
    if flags or reserved:
        raise FrameRejected("bad_header", "flags/reserved header fields must be 0")
    if run_id is not None and rid != run_id:
        raise FrameRejected("wrong_run", f"run id {rid.hex()}, expected {run_id.hex()}")
    pos = HEADER_SIZE
    if json_len > body_end - pos:
        raise FrameRejected("length_mismatch", f"json_length {json_len} runs past the end of the frame")
    payload = None
    if json_len:
        try:
            payload = json.loads(data[pos:pos + json_len])
        except ValueError:
            raise FrameRejected("bad_payload", f"JSON payload of {json_len} bytes does not parse") from None
    pos += json_len
    tensors = {}
    for i in range(count):
        if body_end - pos < _RECORD.size:
            raise FrameRejected("length_mismatch", f"tensor record {i} header runs past the end of the frame")
        code, rank, name_len, rec_reserved, nbytes = _RECORD.unpack_from(data, pos)
        pos += _RECORD.size
        if code not in _DTYPES and code != 5:
            raise FrameRejected("bad_tensor", f"tensor record {i} has unknown dtype {code}")
        if rank > MAX_RANK:
            raise FrameRejected("bad_tensor", f"tensor record {i} has rank {rank} > 8")
        if rec_reserved:
            raise FrameRejected("bad_header", f"tensor record {i} reserved field must be 0")
        if name_len + 8 * rank + nbytes > body_end - pos:
            raise FrameRejected("length_mismatch", f"tensor record {i} runs past the end of the frame")
        name = data[pos:pos + name_len].decode(errors="replace")
        pos += name_len
        shape = struct.unpack_from(f"<{rank}Q", data, pos)
        pos += 8 * rank
        if code == 5:
            raise FrameRejected("bad_tensor", f"tensor {name!r} is bfloat16, which the coordinator does not read")
        dtype = np.dtype(_DTYPES[code]).newbyteorder("<")
        if int(np.prod(shape, dtype=np.uint64)) * dtype.itemsize != nbytes:
            raise FrameRejected("bad_tensor", f"tensor {name!r} has shape {list(shape)} and dtype {dtype.name} "
                                              f"but {nbytes} payload bytes")
        tensors[name] = np.frombuffer(data, dtype=dtype, count=nbytes // dtype.itemsize, offset=pos).reshape(shape)
        pos += nbytes
    if pos != body_end:
        raise FrameRejected("length_mismatch", f"{body_end - pos} unaccounted bytes before the MAC")
    return Frame(ftype, rid, stage, window, micro_batch, payload, tensors)


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
