"""What an inference program of `zl export-model` is, written beside it, and the check every user of one runs.

    model-int8.pte          the program (zl_export/inference_program.py)
    model-int8.pte.json     its record: {"format": "zl-inference-program", "version": 1, "model": ..., "quantize":
                            ..., "max_seq_len": ..., "kv_cache": ..., "methods": ["forward", "get_max_seq_len", ...],
                            "program": {"name", "sha256", "size_bytes"}, "tokenizer": [{"name", "sha256",
                            "size_bytes"}, ...], "data": {"name": "base.ptd", ...} (--shared-base only)}
    base.ptd                --shared-base: the base's frozen weights, shared by every adapter program of that base
    tokenizer.json, tokenizer_config.json   what the LLM runners read beside it

`zl generate --program` and `zl deploy --program` run `check_program` first: a program without its record (a
training stage's .pte, another tool's), with bytes other than those exported (truncated, flipped, replaced), or
whose tokenizer files are missing or changed is refused with one line, before anything loads or is pushed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated

from zl_base.errors import ZLError
from zl_base.json_reader import Bounds, read_json_file, typed
from zl_base.files import file_sha256

RECORD_FORMAT = "zl-inference-program"
RECORD_VERSION = 1
#: The methods `zl generate --program` calls (ExecuTorch's LLM runners read the same).
NEEDED_METHODS = ("forward", "get_max_seq_len", "get_eos_ids", "get_vocab_size")


@dataclass(frozen=True)
class FileRecord:
    """One file beside the record, by name (in the record's folder), hash and size."""

    name: str
    sha256: str
    size_bytes: Annotated[int, Bounds(0)]

    @classmethod
    def of(cls, path: Path) -> FileRecord:
        return cls(path.name, file_sha256(path), path.stat().st_size)


@dataclass(frozen=True)
class ProgramRecord:
    """An inference program's record (module docstring)."""

    format: str
    version: int
    model: str  # the base model, as `zl train --model` named it
    quantize: str
    max_seq_len: Annotated[int, Bounds(1)]
    kv_cache: str
    methods: tuple[str, ...]
    program: FileRecord
    tokenizer: tuple[FileRecord, ...]
    data: FileRecord | None = None  # --shared-base: the base's weights (base.ptd), loaded with the program

    @property
    def data_file(self) -> str | None:
        """The data file's name beside the program, or None (the weights are in the program)."""
        return None if self.data is None else self.data.name

    def to_json(self) -> dict:
        out = {**asdict(self), "methods": list(self.methods), "tokenizer": [asdict(t) for t in self.tokenizer]}
        if self.data is None:
            del out["data"]
        return out


def record_path(program: Path) -> Path:
    """FILE.pte -> FILE.pte.json."""
    return program.with_name(program.name + ".json")


def write_program_record(program: Path, model: str, quantize: str, max_seq_len: int, kv_cache: str,
                         methods: list[str], tokenizer_files: list[Path], data: Path | None = None) -> Path:
    """Write FILE.pte.json for the program at `program` (written), its tokenizer files and its data file (the
    shared base's weights, --shared-base); returns its path."""
    record = ProgramRecord(RECORD_FORMAT, RECORD_VERSION, model, quantize, max_seq_len, kv_cache, tuple(methods),
                           FileRecord.of(program), tuple(FileRecord.of(f) for f in tokenizer_files),
                           None if data is None else FileRecord.of(data))
    path = record_path(program)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record.to_json(), indent=2) + "\n")
    tmp.replace(path)
    return path


def check_program(program: Path, flag: str = "--program") -> ProgramRecord:
    """The record of the inference program at `program`, once the program and its tokenizer files are checked
    against it (sizes and sha256: the whole file is read, ~0.5 s per 100 MiB).

    Raises:
        ZLError: no such program; no record beside it (not a program of `zl export-model`); a record that does not
            read; a program, or a tokenizer file, missing or not the one exported; a program without the methods
            `zl generate` calls.
    """
    fix = "export one with `zl export-model RUN_DIR --out model.pte`"
    if not program.is_file():
        raise ZLError(f"{flag} {program}: no such file; pass the .pte `zl export-model` wrote.")
    record_file = record_path(program)
    if not record_file.is_file():
        raise ZLError(f"{flag} {program}: no {record_file.name} beside it, so it is no inference program of "
                      "`zl export-model` (a stage program of `zl export` trains, it does not generate); "
                      f"{fix}.")
    label = f"{flag} {program}: its record {record_file.name}"
    data = read_json_file(record_file, label, missing="", invalid=fix + ".")
    if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT or data.get("version") != RECORD_VERSION:
        raise ZLError(f"{label}: not a record of `zl export-model` version {RECORD_VERSION}; {fix}.")
    record = typed(ProgramRecord, data, label, fix)
    fix = f"export it again with `zl export-model RUN_DIR --out {program}`"  # it was one once
    missing = [m for m in NEEDED_METHODS if m not in record.methods]
    if missing:
        raise ZLError(f"{flag} {program}: the program has no method {', '.join(missing)}, so it does not generate "
                      f"text; {fix}.")
    _check_file(program, record.program, f"{flag} {program}", fix)
    if not record.tokenizer:
        raise ZLError(f"{label}: names no tokenizer file; {fix}.")
    for tokenizer in record.tokenizer:
        path = program.parent / tokenizer.name
        _check_file(path, tokenizer, f"{flag} {program}: its tokenizer file {path}",
                    f"put back the {tokenizer.name} it was exported with, or {fix}")
    if record.data is not None:  # the shared base: another base's weights would load without a word
        path = program.parent / record.data.name
        _check_file(path, record.data, f"{flag} {program}: its base weights {path}",
                    f"put back the {record.data.name} it was exported with, or {fix}")
    return record


def _check_file(path: Path, expected: FileRecord, label: str, fix: str) -> None:
    """Raise ZLError (naming `label`) unless `path` has the size and sha256 `expected` records."""
    if not path.is_file():
        raise ZLError(f"{label}: no such file; {fix}.")
    size = path.stat().st_size
    if size != expected.size_bytes:
        raise ZLError(f"{label}: {size} bytes, {expected.size_bytes} were exported (truncated or replaced); {fix}.")
    if file_sha256(path) != expected.sha256:
        raise ZLError(f"{label}: its sha256 is not the one exported (the file changed since); {fix}.")
