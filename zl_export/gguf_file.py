"""What a GGUF file holds, read from its header before anything is dequantized (docs/design.md §3.7).

transformers converts a GGUF to float32 by reading the whole file, and fails late and at length on one it cannot
convert: an architecture zl does not split comes out as a model zl refuses after the conversion, a quantization the
installed `gguf` package cannot dequantize as a stack trace from inside the loader. `check` reads the header (the
key-value section and the tensor table, not the tensor data) and turns both into one-line errors up front.

The header is parsed here rather than with `gguf.GGUFReader`, which decodes every metadata array into Python
objects: Gemma 3's 262,144-entry vocabulary (tokens, scores and types) takes it 16 s; this reader steps over
arrays it does not need in well under a second. Format: github.com/ggml-org/ggml docs/gguf.md, versions 2 and 3
(little-endian; version 1 used 32-bit counts and predates every model zl supports).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from zl_base.errors import ZLError
from zl_export.model_family import ModelFamily, family_of_gguf

_MAGIC = b"GGUF"
# GGUF metadata value types: id -> struct format of a scalar (8: string, 9: array are handled apart).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# Quantizations to name in the fix: what llama.cpp's converters and quantizer write and gguf dequantizes.
_SUGGESTED = "Q4_K_M, Q5_K_M, Q8_0, F16 or BF16"


@dataclass(frozen=True)
class GGUFHeader:
    """The parts of a GGUF header zl checks."""

    version: int
    architecture: str  # general.architecture, e.g. "gemma3"
    tensor_types: dict[str, int]  # tensor name -> ggml type id (GGMLQuantizationType)


def read_header(path: Path) -> GGUFHeader:
    """Parse the header of the GGUF file `path` (metadata and tensor table; the tensor data is not touched).

    Raises:
        ValueError: not a GGUF file, an unsupported version, or a header cut short.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != _MAGIC:
            raise ValueError(f"starts with {bytes(buf[:4])!r}, not the GGUF magic {_MAGIC!r}")
        try:
            return _parse(buf)
        except (struct.error, IndexError, UnicodeDecodeError) as e:
            raise ValueError(f"the header is cut short or corrupt ({e})") from None


def _parse(buf) -> GGUFHeader:
    (version,) = struct.unpack_from("<I", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}; zl reads versions 2 and 3 (little-endian)")
    tensor_count, kv_count = struct.unpack_from("<QQ", buf, 8)
    pos, architecture = 24, None

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, at)
        if at + 8 + n > len(buf):
            raise IndexError("a string runs past the end of the file")
        return bytes(buf[at + 8 : at + 8 + n]).decode("utf-8"), at + 8 + n

    def skip(kind: int, at: int) -> int:
        if kind in _SCALARS:
            return at + struct.calcsize(_SCALARS[kind])
        if kind == _STRING:
            (n,) = struct.unpack_from("<Q", buf, at)
            return at + 8 + n
        if kind == _ARRAY:
            item, count = struct.unpack_from("<IQ", buf, at)
            at += 12
            if item in _SCALARS:
                return at + count * struct.calcsize(_SCALARS[item])
            for _ in range(count):  # strings (a vocabulary) or nested arrays: step over each
                at = skip(item, at)
            return at
        raise ValueError(f"unknown metadata value type {kind}")

    for _ in range(kv_count):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if key == "general.architecture" and kind == _STRING:
            architecture, pos = string(pos)
        else:
            pos = skip(kind, pos)
    types = {}
    for _ in range(tensor_count):
        name, pos = string(pos)
        (dims,) = struct.unpack_from("<I", buf, pos)
        pos += 4 + 8 * dims
        (ggml_type,) = struct.unpack_from("<I", buf, pos)
        pos += 4 + 8  # the type, then the data offset
        types[name] = ggml_type
    if architecture is None:
        raise ValueError("no general.architecture in its metadata")
    return GGUFHeader(version, architecture, types)


def type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def dequantizable(ggml_type: int) -> bool:
    """Whether the installed `gguf` package (what transformers' loader calls) dequantizes this ggml type: one
    block of zeros is asked for, so the answer follows the package's version rather than a list kept here."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        qtype = GGMLQuantizationType(ggml_type)
        dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8), qtype)
    except (ValueError, KeyError, NotImplementedError):
        return False
    return True


def check(path: Path, spec: str) -> ModelFamily:
    """The family of the GGUF file `path`, once its header shows zl can convert and split it.

    Raises:
        ZLError: not a GGUF file, an architecture zl does not split, or tensors in a quantization the installed
            `gguf` package cannot dequantize (`spec`: the --model value, for the message).
    """
    try:
        header = read_header(path)
    except (OSError, ValueError) as e:
        raise ZLError(f"--model {spec}: not a readable GGUF file ({e}); pass a .gguf written by llama.cpp "
                      "(convert_hf_to_gguf.py), or the model's Hugging Face directory.") from None
    family = family_of_gguf(header.architecture, spec)
    first_of: dict[int, str] = {}  # each ggml type -> its first tensor
    for name, ggml_type in header.tensor_types.items():
        first_of.setdefault(ggml_type, name)
    bad = {t: name for t, name in first_of.items() if not dequantizable(t)}
    if bad:
        kinds = ", ".join(type_name(t) for t in bad)
        first = next(iter(bad.values()))
        raise ZLError(f"--model {spec}: tensors quantized as {kinds} (e.g. {first}), which the installed gguf "
                      f"package cannot dequantize; use a GGUF of the model quantized as {_SUGGESTED}, or its "
                      "Hugging Face directory.")
    return family
