"""What a GGUF file holds, read from its header before anything is dequantized (docs/design#model-families).

transformers converts a GGUF to float32 by reading the whole file, and fails late and at length on one it cannot
convert: an architecture zl does not split comes out as a model zl refuses after the conversion, a quantization the
installed `gguf` package cannot dequantize as a stack trace from inside the loader. `check` reads the header (the
key-value section and the tensor table, not the tensor data) and turns these into one-line errors up front.

The header is parsed here rather than with `gguf.GGUFReader`, which decodes every metadata array into Python
objects: Gemma 3's 262,144-entry vocabulary (tokens, scores and types) takes it 16 s; this reader steps over
arrays it does not need in well under a second. It bounds every count by the bytes left in the file and checks
the tensor table against the file (quantization blocks per row, data within the file), so a crafted, damaged or
cut file is refused in time linear in its header's size instead of failing in the loader after seconds. Format:
github.com/ggml-org/ggml docs/gguf.md, versions 2 and 3 (little-endian; version 1 used 32-bit counts and predates
every model zl supports).
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


# Arrays of arrays: the gguf package's reader (what transformers loads with) recurses once per level, and
# llama.cpp's reader takes none; real models have none. A few levels are allowed, no more.
_MAX_ARRAY_NESTING = 4
_MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp's limit on a tensor's dimensions
_DEFAULT_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT: where the tensor data starts, unless general.alignment says


@dataclass(frozen=True)
class GGUFTensor:
    """One entry of the tensor table."""

    name: str
    dims: tuple[int, ...]  # GGUF order: dims[0] is the row length (the fastest-varying dimension)
    ggml_type: int  # GGMLQuantizationType id
    offset: int  # bytes from the start of the tensor data


@dataclass(frozen=True)
class GGUFHeader:
    """The parts of a GGUF header zl checks."""

    version: int
    architecture: str  # general.architecture, e.g. "gemma3"
    tensor_types: dict[str, int]  # tensor name -> ggml type id (GGMLQuantizationType)
    tensors: tuple[GGUFTensor, ...] = ()
    data_start: int = 0  # byte offset of the tensor data (after the header, aligned)
    file_size: int = 0


def read_header(path: Path) -> GGUFHeader:
    """Parse the header of the GGUF file `path` (metadata and tensor table; the tensor data is not touched).

    Every count and length is bounded by the bytes left in the file before it is used, so a crafted header costs
    time linear in the file's size (never a 2**60-element array, nor a recursion per nested array).

    Raises:
        ValueError: not a GGUF file, an unsupported version, or a header cut short or corrupt.
    """
    with open(path, "rb") as f:
        if f.read(4) != _MAGIC:
            f.seek(0)
            raise ValueError(f"starts with {f.read(4)!r}, not the GGUF magic {_MAGIC!r}")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return _parse(buf)
            except (struct.error, IndexError, UnicodeDecodeError) as e:
                raise ValueError(f"the header is cut short or corrupt ({e})") from None


def _parse(buf) -> GGUFHeader:
    (version,) = struct.unpack_from("<I", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}; zl reads versions 2 and 3 (little-endian)")
    tensor_count, kv_count = struct.unpack_from("<QQ", buf, 8)
    pos, architecture, alignment = 24, None, _DEFAULT_ALIGNMENT

    def fits(at: int, count: int, size: int, what: str) -> None:
        """`count` items of at least `size` bytes each, from `at`, must fit in the file."""
        if count * size > len(buf) - at:
            raise IndexError(f"{what} of {count:,} items at byte {at:,} runs past the file's end at {len(buf):,}")

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, at)
        fits(at + 8, n, 1, "a string")
        return bytes(buf[at + 8 : at + 8 + n]).decode("utf-8"), at + 8 + n

    def skip(kind: int, at: int, level: int = 0) -> int:
        if kind in _SCALARS:
            return at + struct.calcsize(_SCALARS[kind])
        if kind == _STRING:
            (n,) = struct.unpack_from("<Q", buf, at)
            fits(at + 8, n, 1, "a string")
            return at + 8 + n
        if kind == _ARRAY:
            if level >= _MAX_ARRAY_NESTING:
                raise IndexError(f"metadata arrays nested more than {_MAX_ARRAY_NESTING} deep at byte {at:,}")
            item, count = struct.unpack_from("<IQ", buf, at)
            at += 12
            if item in _SCALARS:
                fits(at, count, struct.calcsize(_SCALARS[item]), "an array")
                return at + count * struct.calcsize(_SCALARS[item])
            fits(at, count, 8 if item == _STRING else 12, "an array")  # a string: its length; an array: type, count
            for _ in range(count):  # strings (a vocabulary) or nested arrays: step over each
                at = skip(item, at, level + 1)
            return at
        raise ValueError(f"unknown metadata value type {kind}")

    fits(pos, kv_count, 8 + 4, "the metadata")  # each: a key's length and a value type, at least
    for _ in range(kv_count):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if key == "general.architecture" and kind == _STRING:
            architecture, pos = string(pos)
        elif key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", buf, pos) if kind == 4 else (0,)  # u32, as the gguf reader wants
            if alignment <= 0 or alignment & (alignment - 1):
                raise ValueError("general.alignment is not a u32 power of two")
            pos = skip(kind, pos)
        else:
            pos = skip(kind, pos)
    fits(pos, tensor_count, 8 + 4 + 4 + 8, "the tensor table")  # name length, dims, type, offset
    tensors = []
    for _ in range(tensor_count):
        name, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        if n_dims > _MAX_DIMS:
            raise ValueError(f"tensor {name} has {n_dims} dimensions; GGUF tensors have at most {_MAX_DIMS}")
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        pos += 4 + 8 * n_dims
        ggml_type, offset = struct.unpack_from("<IQ", buf, pos)
        pos += 4 + 8
        tensors.append(GGUFTensor(name, tuple(dims), ggml_type, offset))
    if architecture is None:
        raise ValueError("no general.architecture in its metadata")
    data_start = -(-pos // alignment) * alignment
    return GGUFHeader(version, architecture, {t.name: t.ggml_type for t in tensors}, tuple(tensors), data_start,
                      len(buf))


def tensor_problem(header: GGUFHeader) -> str | None:
    """What the loader would trip on in the tensor table, after reading the metadata, or None: a name used twice,
    a row length that is not a whole number of its quantization's blocks, data that runs past the end of the file
    (a file cut short, or absurd dimensions). Tensors of a type the `gguf` package does not know are left to
    `check`, which names them. Each answer is a reason and its fix."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    seen: set[str] = set()
    data_bytes = header.file_size - header.data_start
    for t in header.tensors:
        if t.name in seen:
            return f"tensor {t.name} appears twice in the tensor table; the file is damaged, convert it again"
        seen.add(t.name)
        try:
            qtype = GGMLQuantizationType(t.ggml_type)
            block, block_bytes = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            continue
        shape = " x ".join(map(str, t.dims)) or "a scalar"
        if t.dims and t.dims[0] % block:
            return (f"tensor {t.name} ({shape}) is {qtype.name}, whose blocks hold {block} values, but its rows hold "
                    f"{t.dims[0]}; no loader can read it. Use a GGUF quantized as {_SUGGESTED}")
        values = 1
        for d in t.dims:
            values *= d
        end = t.offset + values // block * block_bytes
        if end > data_bytes:
            return (f"tensor {t.name} ({shape}, {qtype.name}) needs bytes {t.offset:,} to {end:,} of the tensor data, "
                    f"but the file holds {max(data_bytes, 0):,} ({header.file_size:,} bytes in all): the file is cut "
                    "short (an interrupted download or copy?) or damaged; download or convert it again")
    return None


def type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"unknown type {ggml_type}"


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
        ZLError: not a GGUF file (or a header cut short, corrupt or crafted), an architecture zl does not split,
            tensors in a quantization the installed `gguf` package cannot dequantize (`spec`: the --model value,
            for the message), or a tensor table the loader would trip on (`tensor_problem`).
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
    problem = tensor_problem(header)
    if problem is not None:
        raise ZLError(f"--model {spec}: {problem}.")
    return family
