"""Frame fuzzing (issue 12): one deterministic corpus of >= 10,000 encrypted frames -- valid frames, bit flips,
truncations, huge lengths, wrong keys (another run, direction, channel or link), replays (of another connection's
frames, of a sequence number already used on the connection), old-version frames, garbage and malformed frames
sealed with the right key -- through the Python decoder, the C++ decoder (zl_frame_tool decode-batch) and a live
C++ Receiver (zl_frame_tool receive-batch, which does the session handshake first on every connection). Entry i
is the first frame(s) after the handshake of connection i, whose session is session_for(i).

Checked: no crash and no hang anywhere, the Python decoder raises nothing but FrameRejected, C++ and Python agree
on every frame (the same reason code, the same decoded fields), every frame built to be invalid is rejected by all
three, every accepted frame is exactly what a key holder's encoder writes, and the receiver acknowledges exactly
the DATA frames the decoders accept.
"""

import hashlib
import json
import os
import random
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from zl_device.formats import frames
from zl_device.formats.frames import FrameRejected, FrameType

RUN_KEY = bytes(range(32))
KEY = frames.derive_key(RUN_KEY, frames.KeyPurpose.DATA_DOWN, 0)  # DATA frames of the link 0 -> 1
# Keys a frame may be sealed under by mistake or by an attacker: another run's, the other direction's, another
# channel's, another link's.
OTHER_KEYS = [frames.derive_key(bytes(range(1, 33)), frames.KeyPurpose.DATA_DOWN, 0),
              frames.derive_key(RUN_KEY, frames.KeyPurpose.DATA_UP, 0),
              frames.derive_key(RUN_KEY, frames.KeyPurpose.CONTROL_UP, 0),
              frames.derive_key(RUN_KEY, frames.KeyPurpose.DATA_DOWN, 1),
              frames.derive_key(RUN_KEY, frames.KeyPurpose.INPUT_LOG, 1)]
RUN = bytes.fromhex("00112233445566778899aabbccddeeff")
CLIENT_HALF = bytes.fromhex("c1a7e5a1f00dfeed0123456789abcdef")
B, S, D = 1, 2, 4
STAGE = 0
REPO = Path(__file__).resolve().parent.parent
FRAME_TOOL = Path(os.environ.get("ZL_FRAME_TOOL", REPO / "build" / "runner" / "zl_frame_tool"))
EXPECT_ARGS = ["--expect-run", RUN.hex(), "--expect-stage", str(STAGE), "--expect-shape", f"{B},{S},{D}"]
N_FRAMES = 10_240

_HEADER = struct.Struct("<4sHHII16sIIQQII32sQ24s")
_RECORD = struct.Struct("<BBHIQ")
H = frames.HEADER_SIZE
TAG = frames.TAG_SIZE


def session_for(i: int) -> bytes:
    """Entry i goes over its own connection, whose session is this (zl_frame_tool's --expect-sessions scheme)."""
    return CLIENT_HALF + i.to_bytes(8, "little") + bytes(8)


def record(code: int, name: bytes, dims, payload: bytes, rank: int | None = None, nbytes: int | None = None,
           reserved: int = 0) -> bytes:
    dims = list(dims)
    return (_RECORD.pack(code, len(dims) if rank is None else rank, len(name), reserved,
                         len(payload) if nbytes is None else nbytes)
            + name + b"".join(struct.pack("<Q", d) for d in dims) + payload)


def plain(ftype: int = 1, json_bytes: bytes = b"", records: list[bytes] | None = None, *, session: bytes,
          seq: int = 1, nonce: bytes = bytes(24), run: bytes = RUN, stage: int = STAGE, window: int = 0, mb: int = 0,
          flags: int = 0, reserved: int = 0, version: int = 2, count: int | None = None, json_len: int | None = None,
          total: int | None = None, magic: bytes = b"ZLFR") -> bytes:
    """A frame's plaintext form (header, clear body, tag space) from raw parts: any field may lie."""
    records = records or []
    body = json_bytes + b"".join(records)
    header = _HEADER.pack(magic, version, ftype, H + len(body) + TAG if total is None else total, flags, run, stage,
                          len(records) if count is None else count, window, mb,
                          len(json_bytes) if json_len is None else json_len, reserved, session, seq, nonce)
    return header + body + bytes(TAG)


def seal(plain_form: bytes, key: bytes = KEY) -> bytes:
    return frames.seal(plain_form, key)


def data_records(rng: random.Random, b: int = B, s: int = S, d: int = D) -> list[bytes]:
    hidden = np.array([rng.uniform(-4, 4) for _ in range(b * s * d)], np.float32).tobytes()
    mask = np.ones(b * s, np.int64).tobytes()
    labels = np.array([rng.randrange(-100, 5000) for _ in range(b * s)], np.int64).tobytes()
    return [record(1, b"hidden", (b, s, d), hidden), record(2, b"attention_mask", (b, s), mask),
            record(2, b"labels", (b, s), labels)]


def grad_records(rng: random.Random, code: int = 5, b: int = B, s: int = S, d: int = D,
                 poison: float | None = None) -> list[bytes]:
    """A GRAD frame's one record: grad_hidden [B,S,D], bfloat16 (code 5, the default on the wire) or float32 (1);
    with `poison`, that value at a random element (NaN, inf, or a float32 past bfloat16's range)."""
    grad = np.array([rng.uniform(-1e-3, 1e-3) for _ in range(b * s * d)], np.float32)
    if poison is not None:
        grad[rng.randrange(grad.size)] = poison
    raw = frames.to_bfloat16(grad).tobytes() if code == 5 else grad.tobytes()
    return [record(code, b"grad_hidden", (b, s, d), raw)]


# JSON payloads that break the payload rule (each must be rejected as bad_payload) ...
BAD_JSON = [
    b"[1]", b"null", b"1", b'"x"', b"true", b"[]", b"{", b"}", b"{not json", b'{"a":NaN}', b'{"a":Infinity}',
    b'{"a":-Infinity}', b'{"a":1e999}', b'{"a":-1e999}', b'{"a":1E400}', b'{"a":"\\ud800"}', b'{"a":"\\udc00"}',
    b'{"a":"\\ud800\\u0041"}', b'{"\\udfff":1}', b'{"a":"\xed\xa0\x80"}', b'{"a":"\xc0\x80"}', b'{"a":"\xff"}',
    b'{"a":"\xe2\x82"}', b'{"a":"\xf4\x90\x80\x80"}', b'{"a":1}\x00', b'{"a":1} x', b'{"a":1}{}', b"\xef\xbb\xbf{}",
    b'{"a":1,"a":2}', b'{"a":1,"\\u0061":2}', b'{"a":18446744073709551616}', b'{"a":-9223372036854775809}',
    b'{"a":123456789012345678901234567890}', b'{"a":"x\x01"}', b'{"a":"\t"}', b'{"a":01}', b'{"a":1.}',
    b'{"a":.5}', b'{"a":+1}', b'{"a":1e}', b'{"a":0x10}', b'{"a":-}', b'{"a":tru}', b'{"a":\'x\'}',
    b'{a:1}', b'{"a":1,}', b'{"a":[1,]}', b'{"a" 1}', b'{"a":"\\x41"}', b'{"a":"\\u12"}', b'{"a":"\\u12G4"}',
    b'{"a":"unterminated}', b"\x00{}", b"{}\x00", b"\x0b{}", b'{"a":1}\xc2\xa0', b"\xc2\xa0{}", b'{"a":NaN,"b":1}',
    b'{"a":' + b"[" * 32 + b"]" * 32 + b"}", b'{"a":' * 33 + b"1" + b"}" * 33, b"[" * 1000 + b"]" * 1000,
    b'{"a":' + b"[" * 5000 + b"]" * 5000 + b"}", b'{"a":' * 100_000 + b"}" * 100_000,
    b'{"a":"' + b"x" * (frames.MAX_JSON_BYTES) + b'"}', b'{"a":1e309}', b'{"a":-1.8e308}',
    b'{"a":"\\u0000"\x00}', b'{"\xff":1}',
]
# ... and payloads that obey it (each must be accepted).
GOOD_JSON = [
    b"", b"{}", b" {} ", b'\t\r\n{"a":1}\n', b'{"a":-0}', b'{"a":1.5e-400}', b'{"a":1.7976931348623157e308}',
    b'{"a":18446744073709551615}', b'{"a":-9223372036854775808}', b'{"a":"\\ud83d\\ude00"}', b'{"a":"\xf0\x9f\x98\x80"}',
    b'{"a":"\\u0000"}', b'{"a":"\x7f"}', b'{"a":"\\/\\b\\f\\n\\r\\t\\"\\\\"}', b'{"a":[1,2.5,"x",true,false,null,{}]}',
    b'{"a":' * 32 + b"1" + b"}" * 32, b'{"a":' + b"[" * 31 + b"]" * 31 + b"}", b'{"micro_batches_done":"x"}',
    b'{"reason":"\xc3\xa9t\xc3\xa9"}', b'{"A":1,"a":2}', b'{"a":1E+2,"b":-3.25E-2}',
]
# Tensor records that break the tensor rule (bad_tensor, or length_mismatch / bad_header for lying sizes).
BAD_NAMES = [b"", b"\xff", b"hid\xc3", b"\xed\xa0\x80", b"a\x00b", b"\x1b[31m", b"x\x7f", b"\xc0\xae"]


def corpus() -> list[tuple[bytes, str]]:
    """(frame, label): label "bad" for a frame built to be invalid, "any" when it may be valid. Entry i is meant for
    the connection whose session is session_for(i)."""
    rng = random.Random(20261130)
    out: list[tuple[bytes, str]] = []
    mb = 0
    seq = 0

    def nonce() -> bytes:
        return bytes(rng.randrange(256) for _ in range(24))

    def build(*args, **kw) -> bytes:
        """The plaintext form of a frame for the next entry's session, with a fresh sequence number."""
        nonlocal seq
        seq += 1
        kw.setdefault("session", session_for(len(out)))
        kw.setdefault("seq", seq)
        return plain(*args, nonce=nonce(), **kw)

    def signed(*args, **kw) -> bytes:
        return seal(build(*args, **kw))

    def valid_data() -> bytes:
        nonlocal mb
        mb += 1
        return build(1, b"", data_records(rng), window=mb // 8, mb=mb)

    def valid_grad() -> bytes:
        return build(4, rng.choice([b"", b"{}"]), grad_records(rng, rng.choice([5, 1])), window=rng.randrange(10),
                     mb=rng.randrange(100))

    def valid_control() -> bytes:
        ftype = rng.choice([2, 3, 16, 17, 18, 19, 20, 21])
        payload = rng.choice(GOOD_JSON)
        return build(ftype, payload, window=rng.randrange(10), mb=rng.randrange(100))

    for payload in BAD_JSON:
        for ftype in (17, 1, 21):
            out.append((signed(ftype, payload, data_records(rng) if ftype == 1 else None), "bad"))
    for payload in GOOD_JSON:
        out.append((signed(17, payload), "any"))
    for name in BAD_NAMES:
        out.append((signed(1, b"", [record(1, name, (1,), b"\0" * 4)]), "bad"))
        out.append((signed(20, b"{}", [record(6, name, (2,), b"ab"), record(6, b"ok", (0,), b"")]), "bad"))
    bad_tensors = [
        [record(6, b"x", (1,), b"a"), record(6, b"x", (1,), b"b")],  # two tensors, one name
        [record(1, b"hidden", (1, 2, 4), b"\0" * 32), record(1, b"hidden", (1, 2, 4), b"\1" * 32)],
        [record(6, b"x", (1 << 62, 1 << 62, 0), b"")],  # a partial product overflows
        [record(6, b"x", (1 << 63, 0), b"")],  # a dim above 2^63-1
        [record(6, b"x", ((1 << 64) - 1,), b"")],
        [record(1, b"x", (1 << 62,), b"")],  # numel * 4 wraps to 0
        [record(2, b"x", (1 << 61,), b"")],
        [record(6, b"x", (2, 3), b"abcde")],
        [record(7, b"x", (1,), b"a")],
        [record(0, b"x", (1,), b"a")],
        [record(6, b"x", (1,) * 9, b"a")],
        [record(6, b"x", (1,), b"a", reserved=1)],
        [record(6, b"x", (1,), b"a", nbytes=2)],
        [record(6, b"x", (1,), b"a", nbytes=(1 << 64) - 1)],
        [record(6, b"x", (1,), b"a", rank=200)],
    ]
    for recs in bad_tensors:
        out.append((signed(1, b"", recs), "bad"))
        out.append((signed(17, b"{}", recs), "bad"))
    out.append((signed(1, b"", [record(5, b"x", (2,), b"abcd")]), "any"))  # bfloat16: valid, not a DATA shape
    out.append((signed(20, b"{}", [record(5, b"x", (2, 1), b"abcd"), record(4, b"y", (), b"ab")]), "any"))
    out.append((signed(20, b"{}", [record(6, b"x", (0, 1 << 40), b"")]), "any"))
    out.append((signed(20, b"{}", [record(3, "é€😀".encode(), (1,), b"abcd")]), "any"))
    out.append((signed(20, b"{}", [record(6, b"\"'\\", (1,), b"a")]), "any"))
    # Header lies, sealed with the right key.
    for kw in [dict(flags=1), dict(reserved=1), dict(version=1), dict(version=3), dict(ftype=4), dict(ftype=5), dict(ftype=0xFFFF),
               dict(count=1), dict(count=0xFFFFFFFF), dict(json_len=0xFFFFFFFF), dict(json_len=1), dict(total=0),
               dict(total=0xFFFFFFFF), dict(total=H + TAG - 1), dict(total=(64 << 20) + 1), dict(magic=b"ZLFS")]:
        out.append((signed(**{"ftype": 17, "json_bytes": b'{"a":1}', **kw}), "bad"))
    # Stage/run/shape expectations.
    out.append((signed(1, b"", data_records(rng), run=bytes(16)), "bad"))
    out.append((signed(1, b"", data_records(rng), stage=1), "bad"))
    out.append((signed(1, b"", data_records(rng, s=3)), "bad"))
    out.append((signed(1, b"", data_records(rng)[:2]), "bad"))
    out.append((signed(1, b"", data_records(rng) + [record(6, b"extra", (1,), b"a")]), "bad"))
    # GRAD (issue 39): anything but exactly grad_hidden bfloat16/float32 [B,S,D].
    out.append((signed(4, b"", grad_records(rng, 5)), "any"))
    out.append((signed(4, b"", grad_records(rng, 1)), "any"))
    for recs in ([record(2, b"grad_hidden", (B, S, D), bytes(8 * B * S * D))],  # int64
                 [record(4, b"grad_hidden", (B, S, D), bytes(2 * B * S * D))],  # float16
                 [record(5, b"grad_hidden", (B, S * D), bytes(2 * B * S * D))],  # rank 2
                 [record(5, b"grad_hidden", (B, S, D, 1), bytes(2 * B * S * D))],  # rank 4
                 grad_records(rng, 5, d=D + 1), grad_records(rng, 1, s=S + 1),
                 [record(5, b"hidden", (B, S, D), bytes(2 * B * S * D))],  # misnamed
                 grad_records(rng) + [record(6, b"extra", (1,), b"a")], [],
                 [record(5, b"grad_hidden", (B, S, D), bytes(2 * B * S * D), nbytes=4 * B * S * D)],  # f32 bytes, bf16
                 [record(1, b"grad_hidden", (B, S, D), bytes(2 * B * S * D))]):  # bf16 bytes, f32
        out.append((signed(4, b"", recs), "bad"))
    out.append((signed(4, b'{"a":NaN}', grad_records(rng)), "bad"))
    # GRAD values that are not finite (issue 56): valid frames, which a runner refuses on receipt (non_finite_grad),
    # both decoders naming the same element; 3.4e38 is finite in float32 and inf once narrowed to bfloat16.
    for poison in (float("nan"), float("inf"), float("-inf"), 3.4e38, -3.4e38) * 4:
        for code in (5, 1):
            out.append((signed(4, b"", grad_records(rng, code, poison=poison)), "any"))
    out.append((signed(4, b"", grad_records(rng), stage=1), "bad"))
    out.append((signed(4, b"", grad_records(rng), seq=0), "bad"))
    # Session and sequence: another connection's session, none, and a sequence number already used (0: the HELLO's).
    out.append((signed(1, b"", data_records(rng), session=session_for(len(out) + 1)), "bad"))
    out.append((signed(1, b"", data_records(rng), session=frames.NO_SESSION), "bad"))
    out.append((signed(1, b"", data_records(rng), seq=0), "bad"))
    out.append((signed(17, b"{}", seq=0), "bad"))

    while len(out) < N_FRAMES:
        kind = rng.randrange(17) % 16  # valid frames twice as often as each kind of damage
        pick = rng.random()
        base_plain = valid_data() if pick < 0.5 else valid_grad() if pick < 0.65 else valid_control()
        base = seal(base_plain)
        if kind == 0:
            out.append((base, "any"))
        elif kind == 1:  # bit flips, not re-sealed
            wire = bytearray(base)
            for _ in range(rng.randint(1, 4)):
                wire[rng.randrange(len(wire))] ^= 1 << rng.randrange(8)
            out.append((bytes(wire), "bad" if bytes(wire) != base else "any"))
        elif kind == 2:  # bit flips in the plaintext, re-sealed: the parser sees them
            wire = bytearray(base_plain)
            for _ in range(rng.randint(1, 4)):
                wire[rng.randrange(len(wire) - TAG)] ^= 1 << rng.randrange(8)
            out.append((seal(bytes(wire)), "any"))
        elif kind == 3:  # truncations
            out.append((base[:rng.randrange(len(base))], "bad"))
        elif kind == 4:  # trailing bytes
            out.append((base + bytes(rng.randrange(256) for _ in range(rng.randint(1, 80))), "bad"))
        elif kind == 5:  # huge or random lengths (header or first tensor record), re-sealed half the time
            wire = bytearray(base_plain)
            off = rng.choice([8, 36, 56] + ([H + 8, H + 2] if len(wire) > H + 200 else []))
            width = 8 if off == H + 8 else (2 if off == H + 2 else 4)
            wire[off:off + width] = rng.choice([(1 << (8 * width)) - 1, 1 << (8 * width - 1),
                                                rng.randrange(1 << (8 * width))]).to_bytes(width, "little")
            if rng.random() < 0.5:
                out.append((seal(bytes(wire)), "any"))
            else:  # the header is authenticated, the records encrypted: changing either breaks the tag
                sealed = bytearray(base)
                if off < H:
                    sealed[off:off + width] = wire[off:off + width]
                else:
                    sealed[off] ^= 0x80
                out.append((bytes(sealed), "bad" if bytes(sealed) != base else "any"))
        elif kind == 6:  # sealed under a wrong key: another run, direction, channel or link
            out.append((seal(base_plain, rng.choice(OTHER_KEYS)), "bad"))
        elif kind == 7:  # replay of an earlier entry on this (a later) connection
            out.append((rng.choice(out)[0], "bad"))
        elif kind == 8:  # malformed payloads, sealed
            out.append((signed(rng.choice([1, 17, 20, 21]), rng.choice(BAD_JSON)), "bad"))
        elif kind == 9:  # random garbage, with a real magic half the time
            junk = bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))
            out.append(((b"ZLFR" + junk) if rng.random() < 0.5 else junk, "bad"))
        elif kind == 10:  # random tensor records, sealed
            recs = [record(rng.randrange(8), rng.choice(BAD_NAMES + [b"hidden", b"labels", b"x"]),
                           [rng.choice([0, 1, 2, 3, 1 << 31, 1 << 62, (1 << 64) - 1]) for _ in range(rng.randint(0, 3))],
                           bytes(rng.randrange(9))) for _ in range(rng.randint(1, 3))]
            out.append((signed(rng.choice([1, 20]), b"", recs), "any"))
        elif kind == 11:  # spliced: a frame's header with another's body, re-sealed
            other = valid_data() if rng.random() < 0.5 else valid_control()
            cut = rng.randrange(H, min(len(base_plain), len(other)) - TAG + 1)
            out.append((seal(base_plain[:cut] + other[cut:]), "any"))
        elif kind == 12:  # a replay inside the connection: the same frame again, or an older one after a newer one
            again = base if rng.random() < 0.5 else seal(base_plain[:96] + struct.pack("<Q", 1) + base_plain[104:])
            out.append((base + again, "bad"))
        elif kind == 13:  # a stale sequence number, or another connection's session, sealed with the right key
            wire = bytearray(base_plain)
            if rng.random() < 0.5:
                wire[96:104] = bytes(8)
            else:
                wire[64:96] = session_for(rng.randrange(len(out) + 1, len(out) + 1000)) if rng.random() < 0.5 \
                    else bytes(rng.randrange(256) for _ in range(32))
            out.append((seal(bytes(wire)), "bad"))
        elif kind == 14:  # several valid frames in a row on one connection (in the decoders: one entry, too long)
            more = [seal(valid_data()) for _ in range(rng.randint(1, 3))]
            out.append((base + b"".join(more), "bad"))
        else:  # a version 1 frame (MAC only, before encryption) under the right key
            wire = bytearray(base_plain)
            wire[4:6] = (1).to_bytes(2, "little")
            out.append((seal(bytes(wire)), "bad"))
    return out


def py_decode(wire: bytes, i: int):
    """Entry i decoded as the first frame after its connection's handshake."""
    try:
        f = frames.decode(wire, KEY, run_id=RUN, stage=STAGE, expect_shape=(B, S, D), session=session_for(i), min_seq=1)
    except FrameRejected as e:
        return {"error": e.error}
    return f


def summary(f: frames.Frame) -> dict:
    return {"type": f.type.name, "run_id": f.run_id.hex(), "stage": f.stage, "window": f.window,
            "micro_batch": f.micro_batch, "payload": f.payload, "session": f.session.hex(), "seq": f.seq,
            "tensors": [{"name": n, "dtype": frames._DTYPE_NAMES[frames._DTYPE_CODES[t.dtype]], "shape": list(t.shape),
                         "nbytes": t.nbytes, "digest": hashlib.blake2b(t.tobytes(), digest_size=32, key=bytes(32)).hexdigest()}
                        for n, t in f.tensors.items()]}


def cpp_summary(spec: dict) -> dict:
    out = {k: spec[k] for k in ("type", "run_id", "stage", "window", "micro_batch", "session", "seq", "tensors")}
    out["payload"] = json.loads(spec["json"]) if spec["json"] else None
    return out


def non_finite_at(f: frames.Frame) -> int | None:
    """The first element of a GRAD's grad_hidden (widened to float32) that is not finite; None: all are, or no GRAD."""
    if f.type != FrameType.GRAD:
        return None
    bad = np.flatnonzero(~np.isfinite(frames.grad_hidden(f, (B, S, D)).reshape(-1)))
    return int(bad[0]) if bad.size else None


def refusal_names(refusal: str | None, f: frames.Frame) -> int | None:
    """The element the C++ receiver's refusal (`non_finite_grad`, zl_frame_tool's "grad_refusal") names, after
    checking that it blames the sender, the frame's stage; None: no refusal."""
    if refusal is None:
        return None
    assert f"the gradient stage {f.stage} sent for micro-batch {f.micro_batch} holds " in refusal, refusal
    return int(refusal.split(" at element ")[1].split(" ")[0])


def reencode(f: frames.Frame, wire: bytes) -> bytes:
    """What a key holder's encoder writes for `f` with the original JSON bytes and nonce."""
    json_len = struct.unpack_from("<I", wire, 56)[0]
    body = frames.unseal(wire, KEY)
    recs = [record(frames._DTYPE_CODES[t.dtype], n.encode(), t.shape, t.tobytes()) for n, t in f.tensors.items()]
    return seal(plain(int(f.type), body[H:H + json_len], recs, run=f.run_id, stage=f.stage, window=f.window,
                      mb=f.micro_batch, session=f.session, seq=f.seq, nonce=wire[H - 24:H]))


def stream_expectation(wire: bytes, i: int) -> dict:
    """What a live receiver counts for `wire` sent on connection i after the handshake: frames split as a stream
    reader does, each checked against the session and the sequence numbers accepted before it."""
    acked = rejected = ignored = 0
    last = 0
    rest = wire
    while len(rest) >= 4:
        try:
            total = frames.peek_length(rest)
        except FrameRejected as e:
            if e.error != "truncated":
                rejected += 1
            break
        if len(rest) < total:
            break
        try:
            r = frames.decode(rest[:total], KEY, run_id=RUN, stage=STAGE, expect_shape=(B, S, D), session=session_for(i),
                              min_seq=last + 1)
        except FrameRejected:
            rejected += 1
            break
        last = r.seq
        if r.type == FrameType.DATA:
            acked += 1
        else:
            ignored += 1
        rest = rest[total:]
    return {"acked": acked, "rejected": rejected, "ignored": ignored, "hang": False}


@pytest.fixture(scope="module")
def fuzz_corpus():
    return corpus()


def test_corpus_is_big_and_varied(fuzz_corpus):
    assert len(fuzz_corpus) >= 10_000
    results = [py_decode(w, i) for i, (w, _) in enumerate(fuzz_corpus)]
    errors = {r["error"] for r in results if isinstance(r, dict)}
    assert errors >= {"truncated", "bad_magic", "bad_version", "oversize", "length_mismatch", "bad_mac",
                      "unknown_type", "bad_header", "bad_payload", "bad_tensor", "unexpected_tensor", "wrong_run",
                      "wrong_stage", "wrong_session", "replay"}
    # Replays of earlier entries (their sessions) are there, and rejected.
    seen, replays = set(), 0
    for w, _ in fuzz_corpus:
        replays += w in seen
        seen.add(w)
    assert replays > 300
    assert sum(not isinstance(r, dict) for r in results) > 1000  # plenty of accepted frames too
    # GRAD frames (issue 39): accepted in both wire dtypes, and mutated ones rejected with a named reason.
    grads = [(r, w) for r, (w, _) in zip(results, fuzz_corpus) if len(w) >= H and w[6:8] == b"\x04\x00"]
    accepted = {frames._DTYPE_NAMES[frames._DTYPE_CODES[r.tensors["grad_hidden"].dtype]]
                for r, _ in grads if not isinstance(r, dict)}
    assert accepted == {"bfloat16", "float32"}
    poisoned = [r for r, _ in grads if not isinstance(r, dict) and non_finite_at(r) is not None]
    assert len(poisoned) >= 30  # NaN, inf, -inf in both dtypes, and the float32 max narrowed to bf16 inf
    grad_errors = {r["error"] for r, _ in grads if isinstance(r, dict)}
    assert {"bad_mac", "unexpected_tensor", "bad_tensor", "length_mismatch", "truncated", "replay"} <= grad_errors
    assert len(grads) > 1000


def test_python_decoder_never_raises_anything_else_and_accepts_only_valid_frames(fuzz_corpus):
    for i, (wire, label) in enumerate(fuzz_corpus):
        try:
            r = py_decode(wire, i)
        except Exception as e:  # noqa: BLE001 - the point of the test
            pytest.fail(f"frame {i}: {type(e).__name__}: {e}")
        if not isinstance(r, dict):
            assert label != "bad", f"frame {i} was built invalid but accepted: {wire[:200]!r}"
            assert reencode(r, wire) == wire, f"frame {i} accepted but not canonical"


def _write_corpus(path: Path, fuzz_corpus) -> None:
    path.write_bytes(b"".join(struct.pack("<I", len(w)) + w for w, _ in fuzz_corpus))


@pytest.mark.skipif(not FRAME_TOOL.is_file(), reason=f"{FRAME_TOOL} not built (bash setup.sh)")
def test_cpp_and_python_decoders_agree_on_every_frame(fuzz_corpus, tmp_path):
    _write_corpus(tmp_path / "corpus.bin", fuzz_corpus)
    out = subprocess.run([str(FRAME_TOOL), "decode-batch", "--key", KEY.hex(), "--in", str(tmp_path / "corpus.bin"),
                          "--expect-sessions", CLIENT_HALF.hex(), *EXPECT_ARGS], capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr.decode(errors="replace")[-2000:]
    lines = out.stdout.decode().splitlines()
    assert len(lines) == len(fuzz_corpus)
    disagreements = []
    for i, ((wire, label), line) in enumerate(zip(fuzz_corpus, lines)):
        cpp = json.loads(line)
        py = py_decode(wire, i)
        if "error" in cpp or isinstance(py, dict):
            if cpp.get("error") != (py.get("error") if isinstance(py, dict) else None):
                disagreements.append((i, cpp.get("error"), py.get("error") if isinstance(py, dict) else "ok",
                                      cpp.get("reason"), wire[:120]))
            continue
        assert label != "bad", f"frame {i} was built invalid but C++ accepted it"
        if cpp_summary(cpp) != summary(py):
            disagreements.append((i, cpp_summary(cpp), summary(py)))
        if refusal_names(cpp.get("grad_refusal"), py) != non_finite_at(py):
            disagreements.append((i, cpp.get("grad_refusal"), non_finite_at(py)))
    assert not disagreements, f"{len(disagreements)} disagreements, first: {disagreements[:5]}"


def _log_tmp(tmp_path: Path) -> str:
    """Where the receiver's input log goes: a tmpfs when there is one (it fsyncs every accepted entry)."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else str(tmp_path)


@pytest.mark.skipif(not FRAME_TOOL.is_file(), reason=f"{FRAME_TOOL} not built (bash setup.sh)")
def test_live_receiver_acknowledges_exactly_the_valid_data_frames(fuzz_corpus, tmp_path):
    _write_corpus(tmp_path / "corpus.bin", fuzz_corpus)
    out = subprocess.run([str(FRAME_TOOL), "receive-batch", "--run-key", RUN_KEY.hex(), "--in", str(tmp_path / "corpus.bin"),
                          "--client-half", CLIENT_HALF.hex(), *EXPECT_ARGS], capture_output=True, timeout=120,
                         env={**os.environ, "TMPDIR": _log_tmp(tmp_path)})
    assert out.returncode == 0, out.stderr.decode(errors="replace")[-2000:]
    lines = out.stdout.decode().splitlines()
    assert len(lines) == len(fuzz_corpus)
    bad = []
    for i, ((wire, _), line) in enumerate(zip(fuzz_corpus, lines)):
        got, want = json.loads(line), stream_expectation(wire, i)
        if got != want:
            bad.append((i, got, want, wire[:100]))
    assert not bad, f"{len(bad)} frames where the receiver differs, first: {bad[:5]}"
