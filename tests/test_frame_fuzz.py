"""Frame fuzzing (issue 12): one deterministic corpus of >= 10,000 frames -- valid frames, bit flips, truncations,
huge lengths, wrong keys, replays, garbage and malformed frames re-signed with the right key -- through the Python
decoder, the C++ decoder (zl_frame_tool decode-batch) and a live C++ Receiver (zl_frame_tool receive-batch).

Checked: no crash and no hang anywhere, the Python decoder raises nothing but FrameRejected, C++ and Python agree
on every frame (the same reason code, the same decoded fields), every frame built to be invalid is rejected by all
three, every accepted frame is exactly what a key holder's encoder writes, and the receiver acknowledges exactly
the DATA frames the decoders accept.
"""

import json
import os
import random
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from zl_device.run import frames
from zl_device.run.frames import FrameRejected, FrameType

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
RUN = bytes.fromhex("00112233445566778899aabbccddeeff")
B, S, D = 1, 2, 4
STAGE = 0
REPO = Path(__file__).resolve().parent.parent
FRAME_TOOL = Path(os.environ.get("ZL_FRAME_TOOL", REPO / "build" / "android_app" / "native" / "zl_frame_tool"))
EXPECT_ARGS = ["--expect-run", RUN.hex(), "--expect-stage", str(STAGE), "--expect-shape", f"{B},{S},{D}"]
N_FRAMES = 10_240

_HEADER = struct.Struct("<4sHHII16sIIQQII")
_RECORD = struct.Struct("<BBHIQ")


def record(code: int, name: bytes, dims, payload: bytes, rank: int | None = None, nbytes: int | None = None,
           reserved: int = 0) -> bytes:
    dims = list(dims)
    return (_RECORD.pack(code, len(dims) if rank is None else rank, len(name), reserved,
                         len(payload) if nbytes is None else nbytes)
            + name + b"".join(struct.pack("<Q", d) for d in dims) + payload)


def build(ftype: int = 1, json_bytes: bytes = b"", records: list[bytes] | None = None, *, run: bytes = RUN,
          stage: int = STAGE, window: int = 0, mb: int = 0, flags: int = 0, reserved: int = 0, version: int = 1,
          count: int | None = None, json_len: int | None = None, total: int | None = None, key: bytes = KEY,
          magic: bytes = b"ZLFR") -> bytes:
    """A frame from raw parts, signed with `key`: any field may lie."""
    records = records or []
    body_len = frames.HEADER_SIZE + len(json_bytes) + sum(map(len, records))
    header = _HEADER.pack(magic, version, ftype, body_len + frames.MAC_SIZE if total is None else total, flags, run,
                          stage, len(records) if count is None else count, window, mb,
                          len(json_bytes) if json_len is None else json_len, reserved)
    body = header + json_bytes + b"".join(records)
    return body + frames.frame_mac(body, key)


def resign(wire: bytes, key: bytes = KEY) -> bytes:
    body = wire[:-frames.MAC_SIZE]
    return body + frames.frame_mac(body, key)


def data_records(rng: random.Random, b: int = B, s: int = S, d: int = D) -> list[bytes]:
    hidden = np.array([rng.uniform(-4, 4) for _ in range(b * s * d)], np.float32).tobytes()
    mask = np.ones(b * s, np.int64).tobytes()
    labels = np.array([rng.randrange(-100, 5000) for _ in range(b * s)], np.int64).tobytes()
    return [record(1, b"hidden", (b, s, d), hidden), record(2, b"attention_mask", (b, s), mask),
            record(2, b"labels", (b, s), labels)]


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
    """(frame, label): label "bad" for a frame built to be invalid, "any" when it may be valid."""
    rng = random.Random(20261130)
    out: list[tuple[bytes, str]] = []
    mb = 0

    def valid_data() -> bytes:
        nonlocal mb
        mb += 1
        return build(1, b"", data_records(rng), window=mb // 8, mb=mb)

    def valid_control() -> bytes:
        ftype = rng.choice([2, 16, 17, 18, 19, 20, 21])
        payload = rng.choice(GOOD_JSON)
        return build(ftype, payload, window=rng.randrange(10), mb=rng.randrange(100))

    for payload in BAD_JSON:
        for ftype in (17, 1, 21):
            out.append((build(ftype, payload, data_records(rng) if ftype == 1 else None), "bad"))
    for payload in GOOD_JSON:
        out.append((build(17, payload), "any"))
    for name in BAD_NAMES:
        out.append((build(1, b"", [record(1, name, (1,), b"\0" * 4)]), "bad"))
        out.append((build(20, b"{}", [record(6, name, (2,), b"ab"), record(6, b"ok", (0,), b"")]), "bad"))
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
        out.append((build(1, b"", recs), "bad"))
        out.append((build(17, b"{}", recs), "bad"))
    out.append((build(1, b"", [record(5, b"x", (2,), b"abcd")]), "any"))  # bfloat16: valid, not a DATA shape
    out.append((build(20, b"{}", [record(5, b"x", (2, 1), b"abcd"), record(4, b"y", (), b"ab")]), "any"))
    out.append((build(20, b"{}", [record(6, b"x", (0, 1 << 40), b"")]), "any"))
    out.append((build(20, b"{}", [record(3, "é€😀".encode(), (1,), b"abcd")]), "any"))
    out.append((build(20, b"{}", [record(6, b"\"'\\", (1,), b"a")]), "any"))
    # Header lies, re-signed.
    for kw in [dict(flags=1), dict(reserved=1), dict(version=2), dict(ftype=3), dict(ftype=0xFFFF), dict(count=1),
               dict(count=0xFFFFFFFF), dict(json_len=0xFFFFFFFF), dict(json_len=1), dict(total=0),
               dict(total=0xFFFFFFFF), dict(total=95), dict(total=(64 << 20) + 1), dict(magic=b"ZLFS")]:
        out.append((build(**{"ftype": 17, "json_bytes": b'{"a":1}', **kw}), "bad"))
    # Stage/run/shape expectations.
    out.append((build(1, b"", data_records(rng), run=bytes(16)), "bad"))
    out.append((build(1, b"", data_records(rng), stage=1), "bad"))
    out.append((build(1, b"", data_records(rng, s=3)), "bad"))
    out.append((build(1, b"", data_records(rng)[:2]), "bad"))
    out.append((build(1, b"", data_records(rng) + [record(6, b"extra", (1,), b"a")]), "bad"))

    while len(out) < N_FRAMES:
        kind = rng.randrange(12)
        base = valid_data() if rng.random() < 0.6 else valid_control()
        if kind == 0:
            out.append((base, "any"))
        elif kind == 1:  # bit flips, not re-signed
            wire = bytearray(base)
            for _ in range(rng.randint(1, 4)):
                wire[rng.randrange(len(wire))] ^= 1 << rng.randrange(8)
            out.append((bytes(wire), "bad" if bytes(wire) != base else "any"))
        elif kind == 2:  # bit flips after the header, re-signed: the parser sees them
            wire = bytearray(base)
            for _ in range(rng.randint(1, 4)):
                wire[rng.randrange(len(wire) - frames.MAC_SIZE)] ^= 1 << rng.randrange(8)
            out.append((resign(bytes(wire)), "any"))
        elif kind == 3:  # truncations
            out.append((base[:rng.randrange(len(base))], "bad"))
        elif kind == 4:  # trailing bytes
            out.append((base + bytes(rng.randrange(256) for _ in range(rng.randint(1, 80))), "bad"))
        elif kind == 5:  # huge or random lengths, re-signed half the time
            wire = bytearray(base)
            off = rng.choice([8, 36, 56] + ([64 + 8, 64 + 2] if len(wire) > 200 else []))
            width = 8 if off == 72 else (2 if off == 66 else 4)
            wire[off:off + width] = rng.choice([(1 << (8 * width)) - 1, 1 << (8 * width - 1),
                                                rng.randrange(1 << (8 * width))]).to_bytes(width, "little")
            out.append((resign(bytes(wire)) if rng.random() < 0.5 else bytes(wire), "any"))
        elif kind == 6:  # wrong key
            out.append((resign(base, OTHER_KEY), "bad"))
        elif kind == 7:  # replay of an earlier frame
            out.append(rng.choice(out))
        elif kind == 8:  # malformed payloads, signed
            out.append((build(rng.choice([1, 17, 20, 21]), rng.choice(BAD_JSON)), "bad"))
        elif kind == 9:  # random garbage, with a real magic half the time
            junk = bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))
            out.append(((b"ZLFR" + junk) if rng.random() < 0.5 else junk, "bad"))
        elif kind == 10:  # random tensor records, signed
            recs = [record(rng.randrange(8), rng.choice(BAD_NAMES + [b"hidden", b"labels", b"x"]),
                           [rng.choice([0, 1, 2, 3, 1 << 31, 1 << 62, (1 << 64) - 1]) for _ in range(rng.randint(0, 3))],
                           bytes(rng.randrange(9))) for _ in range(rng.randint(1, 3))]
            out.append((build(rng.choice([1, 20]), b"", recs), "any"))
        else:  # spliced: a frame's header with another's body, re-signed
            other = valid_data() if rng.random() < 0.5 else valid_control()
            cut = rng.randrange(64, min(len(base), len(other)) - 31)
            out.append((resign(base[:cut] + other[cut:]), "any"))
    return out


def py_decode(wire: bytes):
    try:
        f = frames.decode(wire, KEY, run_id=RUN, stage=STAGE, expect_shape=(B, S, D))
    except FrameRejected as e:
        return {"error": e.error}
    return f


def summary(f: frames.Frame) -> dict:
    return {"type": f.type.name, "run_id": f.run_id.hex(), "stage": f.stage, "window": f.window,
            "micro_batch": f.micro_batch, "payload": f.payload,
            "tensors": [{"name": n, "dtype": frames._DTYPE_NAMES[frames._DTYPE_CODES[t.dtype]], "shape": list(t.shape),
                         "nbytes": t.nbytes, "digest": frames.frame_mac(t.tobytes(), bytes(32)).hex()}
                        for n, t in f.tensors.items()]}


def cpp_summary(spec: dict) -> dict:
    out = {k: spec[k] for k in ("type", "run_id", "stage", "window", "micro_batch", "tensors")}
    out["payload"] = json.loads(spec["json"]) if spec["json"] else None
    return out


def reencode(f: frames.Frame, wire: bytes) -> bytes:
    """What a key holder's encoder writes for `f` with the original JSON bytes."""
    json_len = struct.unpack_from("<I", wire, 56)[0]
    recs = [record(frames._DTYPE_CODES[t.dtype], n.encode(), t.shape, t.tobytes()) for n, t in f.tensors.items()]
    return build(int(f.type), wire[64:64 + json_len], recs, run=f.run_id, stage=f.stage, window=f.window,
                 mb=f.micro_batch)


def stream_expectation(wire: bytes) -> dict:
    """What a live receiver counts for `wire` sent on its own connection: frames split as a stream reader does."""
    acked = rejected = ignored = 0
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
        r = py_decode(rest[:total])
        if isinstance(r, dict):
            rejected += 1
            break
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
    results = [py_decode(w) for w, _ in fuzz_corpus]
    errors = {r["error"] for r in results if isinstance(r, dict)}
    assert errors >= {"truncated", "bad_magic", "bad_version", "oversize", "length_mismatch", "bad_mac",
                      "unknown_type", "bad_header", "bad_payload", "bad_tensor", "unexpected_tensor", "wrong_run",
                      "wrong_stage"}
    assert sum(not isinstance(r, dict) for r in results) > 1000  # plenty of accepted frames too


def test_python_decoder_never_raises_anything_else_and_accepts_only_valid_frames(fuzz_corpus):
    for i, (wire, label) in enumerate(fuzz_corpus):
        try:
            r = py_decode(wire)
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
                          *EXPECT_ARGS], capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr.decode(errors="replace")[-2000:]
    lines = out.stdout.decode().splitlines()
    assert len(lines) == len(fuzz_corpus)
    disagreements = []
    for i, ((wire, label), line) in enumerate(zip(fuzz_corpus, lines)):
        cpp = json.loads(line)
        py = py_decode(wire)
        if "error" in cpp or isinstance(py, dict):
            if cpp.get("error") != (py.get("error") if isinstance(py, dict) else None):
                disagreements.append((i, cpp.get("error"), py.get("error") if isinstance(py, dict) else "ok",
                                      cpp.get("reason"), wire[:120]))
            continue
        assert label != "bad", f"frame {i} was built invalid but C++ accepted it"
        if cpp_summary(cpp) != summary(py):
            disagreements.append((i, cpp_summary(cpp), summary(py)))
    assert not disagreements, f"{len(disagreements)} disagreements, first: {disagreements[:5]}"


def _log_tmp(tmp_path: Path) -> str:
    """Where the receiver's input log goes: a tmpfs when there is one (it fsyncs every accepted entry)."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else str(tmp_path)


@pytest.mark.skipif(not FRAME_TOOL.is_file(), reason=f"{FRAME_TOOL} not built (bash setup.sh)")
def test_live_receiver_acknowledges_exactly_the_valid_data_frames(fuzz_corpus, tmp_path):
    _write_corpus(tmp_path / "corpus.bin", fuzz_corpus)
    out = subprocess.run([str(FRAME_TOOL), "receive-batch", "--key", KEY.hex(), "--in", str(tmp_path / "corpus.bin"),
                          *EXPECT_ARGS], capture_output=True, timeout=120, env={**os.environ, "TMPDIR": _log_tmp(tmp_path)})
    assert out.returncode == 0, out.stderr.decode(errors="replace")[-2000:]
    lines = out.stdout.decode().splitlines()
    assert len(lines) == len(fuzz_corpus)
    bad = []
    for i, ((wire, _), line) in enumerate(zip(fuzz_corpus, lines)):
        got, want = json.loads(line), stream_expectation(wire)
        if got != want:
            bad.append((i, got, want, wire[:100]))
    assert not bad, f"{len(bad)} frames where the receiver differs, first: {bad[:5]}"
