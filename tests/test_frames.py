"""The Python frame codec (zl_device/formats/frames.py): round trips, every rejection reason, and the C++ twin."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from zl_device.formats import frames
from zl_device.formats.frames import Frame, FrameRejected, FrameType, decode, encode

RUN_KEY = bytes(range(32))
KEY = frames.derive_key(RUN_KEY, frames.KeyPurpose.DATA_DOWN, 1)  # a frame key: DATA from stage 1
RUN = bytes.fromhex("00112233445566778899aabbccddeeff")
REPO = Path(__file__).resolve().parent.parent
FRAME_TOOL = Path(os.environ.get("ZL_FRAME_TOOL", REPO / "build" / "runner" / "zl_frame_tool"))


def data_frame() -> Frame:
    rng = np.random.default_rng(0)
    return Frame(FrameType.DATA, RUN, stage=1, window=3, micro_batch=14, payload={"note": "x"},
                 tensors={"hidden": rng.standard_normal((1, 4, 8)).astype(np.float32),
                          "attention_mask": np.ones((1, 4), np.int64), "labels": np.arange(4, dtype=np.int64)[None]})


def test_round_trip_keeps_every_field():
    f = data_frame()
    wire = encode(f, KEY)
    assert wire[:4] == b"ZLFR" and int.from_bytes(wire[8:12], "little") == len(wire)
    g = decode(wire, KEY, run_id=RUN)
    assert (g.type, g.run_id, g.stage, g.window, g.micro_batch, g.payload) == (f.type, RUN, 1, 3, 14, {"note": "x"})
    for name, t in f.tensors.items():
        assert g.tensors[name].dtype == t.dtype and np.array_equal(g.tensors[name], t)


def test_control_frame_without_payload_or_tensors():
    wire = encode(Frame(FrameType.STOP, RUN, stage=frames.COORDINATOR_STAGE), KEY)
    assert len(wire) == frames.HEADER_SIZE + frames.TAG_SIZE
    g = decode(wire, KEY)
    assert g.type is FrameType.STOP and g.payload is None and g.tensors == {} and g.stage == 0xFFFFFFFF


def _reject(wire: bytes, error: str, **kw) -> None:
    with pytest.raises(FrameRejected) as e:
        decode(wire, kw.pop("key", KEY), **kw)
    assert e.value.error == error, str(e.value)


def test_rejections_name_the_reason():
    wire = encode(data_frame(), KEY)
    _reject(wire[:-1], "truncated")
    _reject(wire[:40], "truncated")
    _reject(wire + b"\0", "length_mismatch")
    _reject(b"XXXX" + wire[4:], "bad_magic")
    _reject(wire[:4] + (1).to_bytes(2, "little") + wire[6:], "bad_version")
    _reject(wire[:4] + (3).to_bytes(2, "little") + wire[6:], "bad_version")
    for offset in (20, 70, 100, 200, len(wire) - 1):  # header (associated data), nonce, ciphertext, tag
        flipped = bytearray(wire)
        flipped[offset] ^= 1
        _reject(bytes(flipped), "bad_mac")
    _reject(wire, "bad_mac", key=bytes(32))
    _reject(wire, "wrong_run", run_id=bytes(16))
    _reject(wire, "oversize", max_frame_bytes=len(wire) - 1)


def _resigned(plain: bytes) -> bytes:
    """A frame whose plaintext was altered by a holder of the key: the tag verifies, the content is bad."""
    return frames.seal(plain, KEY)


def test_authenticated_but_malformed_frames():
    wire = encode(Frame(FrameType.HEARTBEAT, RUN, payload={"a": 1}), KEY)
    body = bytearray(frames.unseal(wire, KEY))
    body[6:8] = (99).to_bytes(2, "little")
    _reject(_resigned(bytes(body)), "unknown_type")
    body = bytearray(frames.unseal(wire, KEY))
    body[128:135] = b"{not js"
    _reject(_resigned(bytes(body)), "bad_payload")
    body = bytearray(frames.unseal(wire, KEY))
    body[60:64] = (1).to_bytes(4, "little")
    _reject(_resigned(bytes(body)), "bad_header")


# --- issue 12 item 1: frames are encrypted, under one key per channel, link and direction ---------------------------

def test_payload_and_tensors_are_not_on_the_wire_in_clear():
    # Fails on a MAC-only format: the labels (the completion's token ids), the hidden state and the JSON payload
    # would be readable bytes of the frame.
    f = data_frame()
    f.payload = {"secret": "the prompt"}
    labels = np.array([[31337, 27182, 16180, 14142]], np.int64)
    f.tensors["labels"] = labels
    wire = encode(f, KEY)
    for clear in (labels.tobytes(), labels[0, :2].tobytes(), f.tensors["hidden"].tobytes()[:16], b"the prompt",
                  b"hidden", b"labels"):
        assert clear not in wire
    assert np.array_equal(decode(wire, KEY).tensors["labels"], labels)
    # A fresh random nonce per frame: the same frame never encrypts the same way twice.
    again = encode(f, KEY)
    assert again[:frames.HEADER_SIZE - frames.NONCE_SIZE] == wire[:frames.HEADER_SIZE - frames.NONCE_SIZE]
    assert again[frames.HEADER_SIZE - frames.NONCE_SIZE:frames.HEADER_SIZE] != wire[frames.HEADER_SIZE - frames.NONCE_SIZE:frames.HEADER_SIZE]
    assert again[frames.HEADER_SIZE:frames.HEADER_SIZE + 32] != wire[frames.HEADER_SIZE:frames.HEADER_SIZE + 32]


def test_every_channel_link_and_direction_has_its_own_key():
    keys = {(p, link): frames.derive_key(RUN_KEY, p, link) for p in frames.KeyPurpose for link in (0, 1, 2)}
    assert len(set(keys.values())) == len(keys)
    wire = encode(data_frame(), keys[(frames.KeyPurpose.DATA_DOWN, 1)])
    for (p, link), key in keys.items():
        if (p, link) != (frames.KeyPurpose.DATA_DOWN, 1):
            _reject(wire, "bad_mac", key=key)
    _reject(wire, "bad_mac", key=frames.derive_key(bytes(32), frames.KeyPurpose.DATA_DOWN, 1))  # another run


def test_key_derivation_is_libsodium_crypto_kdf():
    # Vector from libsodium 1.0.18's crypto_kdf_derive_from_key(32, 3 << 32 | 7, "zl-frame", bytes(range(32)));
    # frame_test.cpp checks the same value in C++.
    assert frames.derive_key(RUN_KEY, frames.KeyPurpose.CONTROL_UP, 7).hex() == (
        "5376c0db9442a4e9d170008194efb27793ca068d71379deced2c16d1dcf6667d")


def test_session_and_sequence_are_checked():
    session = bytes(range(32))
    wire = encode(Frame(FrameType.HEARTBEAT, RUN, payload={"a": 1}, session=session, seq=5), KEY)
    assert decode(wire, KEY, session=session, min_seq=5).seq == 5
    _reject(wire, "wrong_session", session=bytes(32))
    _reject(wire, "replay", session=session, min_seq=6)
    # Both are authenticated: rewriting them in the header breaks the tag.
    forged = bytearray(wire)
    forged[96:104] = (6).to_bytes(8, "little")
    _reject(bytes(forged), "bad_mac")


def test_encode_refuses_what_the_wire_cannot_carry():
    with pytest.raises(ValueError, match="frame key has 3 bytes"):
        encode(data_frame(), b"abc")
    with pytest.raises(ValueError, match="dtype float64"):
        encode(Frame(FrameType.DATA, RUN, tensors={"x": np.zeros(2)}), KEY)


def test_parse_key():
    assert frames.parse_key(KEY.hex() + "\n") == KEY
    with pytest.raises(ValueError, match="64 hex characters"):
        frames.parse_key("abcd")


def _tool(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(FRAME_TOOL), *args], capture_output=True, timeout=30, input=stdin)


@pytest.mark.skipif(not FRAME_TOOL.is_file(), reason=f"{FRAME_TOOL} not built (bash setup.sh)")
def test_cpp_decodes_python_frames_and_python_decodes_cpp_frames(tmp_path):
    f = data_frame()
    (tmp_path / "py.bin").write_bytes(encode(f, KEY))
    out = _tool("decode", "--key", KEY.hex(), "--in", str(tmp_path / "py.bin"))
    assert out.returncode == 0, out.stderr.decode()
    spec = json.loads(out.stdout)
    assert (spec["type"], spec["run_id"], spec["stage"], spec["window"], spec["micro_batch"]) == ("DATA", RUN.hex(), 1, 3, 14)
    by_name = {t["name"]: t for t in spec["tensors"]}
    assert bytes.fromhex(by_name["hidden"]["data_hex"]) == f.tensors["hidden"].tobytes()
    # And back: the C++ encoder's bytes are what Python writes for the same spec (and nonce).
    spec["nonce"] = (tmp_path / "py.bin").read_bytes()[frames.HEADER_SIZE - frames.NONCE_SIZE:frames.HEADER_SIZE].hex()
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    back = _tool("encode", "--key", KEY.hex(), "--in", str(tmp_path / "spec.json"), "--out", str(tmp_path / "cpp.bin"))
    assert back.returncode == 0, back.stderr.decode()
    assert (tmp_path / "cpp.bin").read_bytes() == (tmp_path / "py.bin").read_bytes()
    del spec["nonce"]
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    back = _tool("encode", "--key", KEY.hex(), "--in", str(tmp_path / "spec.json"), "--out", str(tmp_path / "cpp.bin"))
    g = decode((tmp_path / "cpp.bin").read_bytes(), KEY, run_id=RUN)
    assert g.payload == f.payload and np.array_equal(g.tensors["hidden"], f.tensors["hidden"])
    # The key derivation agrees too.
    derived = _tool("derive-key", "--run-key", RUN_KEY.hex(), "--purpose", "1", "--link", "1")
    assert derived.stdout.decode().strip() == KEY.hex()
    # A frame under another key is rejected by C++ with the same reason name.
    (tmp_path / "bad.bin").write_bytes(encode(f, bytes(32)))
    bad = _tool("decode", "--key", KEY.hex(), "--in", str(tmp_path / "bad.bin"))
    assert bad.returncode == 2 and json.loads(bad.stdout)["error"] == "bad_mac"


# --- issue 12 item 9: one precise payload and tensor rule (PROTOCOL.md §5) ----------------------------------------

def _raw(json_bytes: bytes = b"", records: bytes = b"", count: int = 0, type_: int = 17) -> bytes:
    import struct
    total = frames.HEADER_SIZE + len(json_bytes) + len(records) + frames.TAG_SIZE
    header = struct.pack("<4sHHII16sIIQQII32sQ24s", b"ZLFR", 2, type_, total, 0, RUN, 0, count, 0, 0, len(json_bytes),
                         0, bytes(32), 0, os.urandom(24))
    return frames.seal(header + json_bytes + records + bytes(frames.TAG_SIZE), KEY)


def _rec(code: int, name: bytes, dims, payload: bytes) -> bytes:
    import struct
    return (struct.pack("<BBHIQ", code, len(dims), len(name), 0, len(payload)) + name
            + b"".join(struct.pack("<Q", d) for d in dims) + payload)


@pytest.mark.parametrize("payload", [b"[1]", b"null", b"1", b'{"a":NaN}', b'{"a":Infinity}', b'{"a":1e999}',
                                     b'{"a":"\\ud800"}', b'{"a":"\xed\xa0\x80"}', b'{"a":1}\x00', b'{"a":1,"a":2}',
                                     b'{"a":' * 40 + b"1" + b"}" * 40, b"[" * 5000 + b"]" * 5000,
                                     b'{"a":18446744073709551616}', b"\xef\xbb\xbf{}"])
def test_payloads_outside_the_rule_are_bad_payload(payload):
    _reject(_raw(payload), "bad_payload")


def test_payloads_inside_the_rule_decode():
    assert decode(_raw(b' {"a":-0,"b":"\\ud83d\\ude00","c":[1.5e-400,null]} '), KEY).payload == {
        "a": 0, "b": "\U0001F600", "c": [0.0, None]}
    assert decode(_raw(b'{"a":' * 32 + b"1" + b"}" * 32), KEY).payload is not None


def test_tensor_rule():
    # np.prod used to wrap: [2^62, 2^62, 0] has numel 0 but cannot be held.
    _reject(_raw(records=_rec(6, b"x", (1 << 62, 1 << 62, 0), b""), count=1, type_=1), "bad_tensor")
    _reject(_raw(records=_rec(1, b"x", (1 << 62,), b""), count=1, type_=1), "bad_tensor")
    _reject(_raw(records=_rec(6, b"x", (1,), b"a") * 2, count=2, type_=1), "bad_tensor")  # one name, two tensors
    _reject(_raw(records=_rec(6, b"\xff", (1,), b"a"), count=1, type_=1), "bad_tensor")
    _reject(_raw(records=_rec(6, b"", (1,), b"a"), count=1, type_=1), "bad_tensor")
    f = decode(_raw(records=_rec(5, b"b", (2,), b"abcd") + _rec(6, b"z", (0, 1 << 40), b""), count=2, type_=20), KEY)
    assert f.tensors["b"].dtype == frames.BFLOAT16 and f.tensors["z"].shape == (0, 1 << 40)
    with pytest.raises(FrameRejected) as e:
        decode(_raw(records=_rec(6, b"bad\xc3", (2,), b"a"), count=1, type_=1), KEY)
    assert "\\xc3" in str(e.value) and all(32 <= ord(c) < 127 for c in str(e.value))


# --- issue 28 item 1: the payload check is linear time -----------------------------------------------------------

def _crafted(size: int) -> bytes:
    """The payload that froze the coordinator: an object opened, 33 '[', then an unclosed string of escaped quotes."""
    head = b'{"' + b"[" * 33
    return head + b'\\"' * ((size - len(head)) // 2)


def test_the_payload_check_is_linear_time_on_unclosed_strings_of_escaped_quotes():
    # The regex that stripped strings before the depth count backtracked over the whole rest of the payload from
    # every quote: 12-62 s for 64 KiB, about an hour for 1 MiB, holding the interpreter lock all along. Measured in
    # a child process, so that the old code fails this test in a minute instead of hanging the suite.
    code = ("import json, time; from zl_device.formats import frames; from tests.test_frames import _crafted\n"
            "out = {}\n"
            "for size in (64 << 10, frames.MAX_JSON_BYTES):\n"
            "    t = time.perf_counter()\n"
            "    try:\n"
            "        frames.check_payload(_crafted(size))\n"
            "    except frames.FrameRejected as e:\n"
            "        out[size] = [e.error, time.perf_counter() - t]\n"
            "print(json.dumps(out))\n")
    try:
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60, cwd=REPO)
    except subprocess.TimeoutExpired:
        pytest.fail("check_payload did not reject the crafted payloads of 64 KiB and 1 MiB within 60 s")
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    for size, (error, seconds) in json.loads(run.stdout).items():
        assert error == "bad_payload"
        assert seconds < 2.0, f"{size} bytes took {seconds:.1f} s"  # linear: ~10 ms for 1 MiB


def _deep(levels: int, inner: bytes = b"1") -> bytes:
    """An object whose value nests `levels` levels in all (the object is level 1) around `inner`."""
    return b'{"a":' + b"[" * (levels - 1) + inner + b"]" * (levels - 1) + b"}"


DEPTH_AND_STRING_PAYLOADS = [
    _deep(32), _deep(33), _deep(31, b"{}"), _deep(32, b"{}"),  # {} is a level of its own
    _deep(32, b'"]]]]\\"[[[[{{{{"'), _deep(32, b'"\\\\"'), _deep(33, b'"\\\\"'),  # brackets in strings do not count
    b'{"a":"' + b"[" * 40 + b'"}', b'{"\\"' + b"[" * 40 + b'":1}', b'{"a":"' + b"{" * 40 + b'\\\\"}',
    b'{"a":"' + b"[" * 40 + b'\\"}', b'{"a":"\\\\\\"' + b"[" * 40 + b'"}',  # the quote after \\\" is escaped
    b'{"a":[' + b"[]," * 40 + b"1]}", b'{"a":' + b"[" * 40 + b'"' + b"]" * 40 + b"}",
    b'{"a":"x\\' + b"[" * 40, b'{"a":"' + b"]" * 40 + b"[" * 40 + b'"}', b"{" + b"]" * 40,
    _crafted(4096), _crafted(64 << 10),
]


@pytest.mark.skipif(not FRAME_TOOL.is_file(), reason=f"{FRAME_TOOL} not built (bash setup.sh)")
def test_cpp_and_python_agree_on_nesting_around_strings(tmp_path):
    wires = [_raw(p) for p in DEPTH_AND_STRING_PAYLOADS]
    (tmp_path / "corpus.bin").write_bytes(b"".join(len(w).to_bytes(4, "little") + w for w in wires))
    out = _tool("decode-batch", "--key", KEY.hex(), "--in", str(tmp_path / "corpus.bin"))
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    cpp = [json.loads(line).get("error") for line in out.stdout.decode().splitlines()]
    py = []
    for w in wires:
        try:
            decode(w, KEY)
            py.append(None)
        except FrameRejected as e:
            py.append(e.error)
    assert py == cpp
    assert py[:4] == [None, "bad_payload", None, "bad_payload"] and py[4:7] == [None, None, "bad_payload"]


# --- issue 39 item 2: GRAD, the hidden state's gradient going upstream (PROTOCOL.md §4) -------------------------------

UP_KEY = frames.derive_key(RUN_KEY, frames.KeyPurpose.DATA_UP, 1)  # GRAD from stage 2 to stage 1 (link 1)
GRAD_SHAPE = (2, 3, 5)  # (B, S, D)


def _grad_values() -> np.ndarray:
    """(B, S, D) float32 with the cases bf16 rounding has to get right: ties both ways, inf, subnormals."""
    g = np.random.default_rng(1).standard_normal(GRAD_SHAPE).astype(np.float32)
    g.flat[:6] = [1.00390625, 1.01171875, -1.00390625, np.inf, 1e-40, 3.4e38]  # tie to even (down, up), -tie, ...
    return g


def test_bfloat16_rounds_to_nearest_even_and_widens_exactly():
    above_tie = np.nextafter(np.float32(1.00390625), np.float32(2))
    bits = frames.to_bfloat16(np.array([1.0, 1.00390625, 1.01171875, above_tie, np.nan], np.float32)).view("<u2")
    assert list(bits[:4]) == [0x3F80, 0x3F80, 0x3F82, 0x3F81]  # tie down to even, tie up to even, above the tie
    assert (bits[4] & 0x7FC0) == 0x7FC0  # NaN stays a quiet NaN
    g = _grad_values()
    widened = frames.from_bfloat16(frames.to_bfloat16(g))
    normal = np.isfinite(g) & (np.abs(g) > 1e-37) & (np.abs(g) < 3e38)
    assert np.all(np.abs(widened[normal] - g[normal]) <= np.abs(g[normal]) * 2.0**-8)  # half a bf16 ulp
    assert widened.flat[3] == np.inf and widened.flat[5] == np.inf  # 3.4e38 rounds past bf16's largest
    assert np.array_equal(frames.from_bfloat16(frames.to_bfloat16(widened)), widened)  # exact on bf16 values


@pytest.mark.parametrize("wire_dtype, itemsize", [("bfloat16", 2), ("float32", 4)])
def test_grad_round_trip(wire_dtype, itemsize):
    g = _grad_values()
    wire = encode(frames.grad_frame(RUN, 2, window=3, micro_batch=14, grad_hidden=g, wire_dtype=wire_dtype), UP_KEY)
    assert len(wire) == frames.HEADER_SIZE + 16 + len("grad_hidden") + 24 + g.size * itemsize + frames.TAG_SIZE
    f = decode(wire, UP_KEY, run_id=RUN, stage=2, expect_shape=GRAD_SHAPE)
    assert (f.type, f.window, f.micro_batch, list(f.tensors)) == (FrameType.GRAD, 3, 14, ["grad_hidden"])
    got = frames.grad_hidden(f, GRAD_SHAPE)
    assert got.dtype == np.float32 and got.shape == GRAD_SHAPE
    expected = frames.from_bfloat16(frames.to_bfloat16(g)) if wire_dtype == "bfloat16" else g
    assert np.array_equal(got, expected)
    _reject(wire, "bad_mac", key=frames.derive_key(RUN_KEY, frames.KeyPurpose.DATA_DOWN, 1))  # the down key


def test_grad_of_the_wrong_tensor_is_unexpected_tensor():
    good = frames.to_bfloat16(_grad_values())
    cases = {
        "dtype int64, expected bfloat16 or float32": {"grad_hidden": np.zeros(GRAD_SHAPE, np.int64)},
        "dtype float16": {"grad_hidden": np.zeros(GRAD_SHAPE, np.float16)},
        "shape [2, 3, 4], expected [2, 3, 5]": {"grad_hidden": np.zeros((2, 3, 4), np.float32)},
        "shape [6, 5]": {"grad_hidden": np.zeros((6, 5), np.float32)},
        "no tensor 'grad_hidden'": {"hidden": good},
        "2 tensors, expected 1": {"grad_hidden": good, "labels": np.zeros((2, 3), np.int64)},
    }
    for words, tensors in cases.items():
        wire = encode(Frame(FrameType.GRAD, RUN, stage=2, tensors=tensors), UP_KEY)
        with pytest.raises(FrameRejected, match=re.escape(words)) as e:
            decode(wire, UP_KEY, expect_shape=GRAD_SHAPE)
        assert e.value.error == "unexpected_tensor"
        with pytest.raises(FrameRejected, match=re.escape(words)):
            frames.grad_hidden(decode(wire, UP_KEY), GRAD_SHAPE)
    with pytest.raises(ValueError, match="wire dtype 'float16'"):
        frames.grad_frame(RUN, 2, 0, 0, _grad_values(), wire_dtype="float16")
    with pytest.raises(ValueError, match=r"float64 \[2, 3\], expected a float32 \(B, S, D\)"):
        frames.grad_frame(RUN, 2, 0, 0, np.zeros((2, 3)))


@pytest.mark.skipif(not FRAME_TOOL.is_file(), reason=f"{FRAME_TOOL} not built (bash setup.sh)")
@pytest.mark.parametrize("wire_dtype", ["bfloat16", "float32"])
def test_cpp_and_python_agree_on_grad_frames(tmp_path, wire_dtype):
    g = _grad_values()
    shape_arg = ",".join(map(str, GRAD_SHAPE))
    # Python -> C++: C++ decodes and widens what Python narrowed.
    (tmp_path / "py.bin").write_bytes(encode(frames.grad_frame(RUN, 2, 3, 14, g, wire_dtype), UP_KEY))
    out = _tool("decode", "--key", UP_KEY.hex(), "--in", str(tmp_path / "py.bin"), "--expect-shape", shape_arg)
    assert out.returncode == 0, out.stderr.decode()
    spec = json.loads(out.stdout)
    assert (spec["type"], spec["window"], spec["micro_batch"], spec["tensors"][0]["dtype"]) == ("GRAD", 3, 14, wire_dtype)
    expected = frames.grad_hidden(decode((tmp_path / "py.bin").read_bytes(), UP_KEY), GRAD_SHAPE)
    assert bytes.fromhex(spec["grad_f32_hex"]) == expected.tobytes()
    # C++ -> Python: C++ narrows (make_grad_frame) exactly as Python does, and Python decodes it.
    nonce = (tmp_path / "py.bin").read_bytes()[frames.HEADER_SIZE - frames.NONCE_SIZE:frames.HEADER_SIZE]
    cpp_spec = {"type": "GRAD", "run_id": RUN.hex(), "stage": 2, "window": 3, "micro_batch": 14, "nonce": nonce.hex(),
                "grad": {"shape": list(GRAD_SHAPE), "wire_dtype": wire_dtype, "f32_hex": g.tobytes().hex()}}
    (tmp_path / "spec.json").write_text(json.dumps(cpp_spec))
    back = _tool("encode", "--key", UP_KEY.hex(), "--in", str(tmp_path / "spec.json"), "--out", str(tmp_path / "cpp.bin"))
    assert back.returncode == 0, back.stderr.decode()
    assert (tmp_path / "cpp.bin").read_bytes() == (tmp_path / "py.bin").read_bytes()  # byte for byte
    f = decode((tmp_path / "cpp.bin").read_bytes(), UP_KEY, run_id=RUN, stage=2, expect_shape=GRAD_SHAPE)
    assert np.array_equal(frames.grad_hidden(f, GRAD_SHAPE), expected)
    # A GRAD of the wrong shape: the same reason name on both sides.
    bad = _tool("decode", "--key", UP_KEY.hex(), "--in", str(tmp_path / "py.bin"), "--expect-shape", "2,3,4")
    assert bad.returncode == 2 and json.loads(bad.stdout)["error"] == "unexpected_tensor"
