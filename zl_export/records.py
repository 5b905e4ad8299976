"""Reading training data files: the rows of a CSV (with header), JSONL, Parquet or Arrow file (or a Hugging Face
`datasets.save_to_disk` directory), with their line numbers (row numbers, from 1, in Parquet and Arrow: `at_row`).

Parquet and Arrow are read with pyarrow, not by hand, and their rows are checked as JSONL rows are (a value is any
JSON-like value: text, a number, a list of turns, ...), column names matched as CSV headers are.

Every problem is a one-line ZLError naming the file and line: a missing file, an unknown extension, text that is
not UTF-8, a NUL byte, a ragged CSV row, a malformed or too deeply nested JSON line (the nesting is measured in
linear time before parsing), a lone surrogate escape, a key twice in one JSON object, and two keys of one line that
name the same column (keys that differ only in case or surrounding spaces: keys are matched as CSV headers are,
stripped and lower-cased). JSONL values are kept as parsed (strings, numbers, true/false, null, lists, dicts), so a
reader that needs text names what it found (`json_kind`) instead of training on "True" or "inf".
"""

import csv
import json
from pathlib import Path

from zl_base.errors import ZLError
from zl_base.json_nesting import nests_deeper_than

#: One row: {column: value}; a value is text, or for JSONL any JSON value as parsed (check it is text: json_kind).
Record = dict[str, object]


#: What --input / --data take: text files, and the columnar files Hugging Face datasets are stored and shared in.
SUFFIXES = (".csv", ".jsonl", ".ndjson", ".parquet", ".arrow")
_TABULAR = (".parquet", ".arrow")


def is_tabular(path: Path | str) -> bool:
    """A Parquet or Arrow file, or a `datasets.save_to_disk` directory: rows, not lines."""
    path = Path(path)
    return path.suffix.lower() in _TABULAR or path.is_dir()


def at_row(path: Path | str, line: int) -> str:
    """Where a row is, as errors name it: "data.jsonl line 7", "train.parquet row 7"."""
    return f"{path} {'row' if is_tabular(path) else 'line'} {line}"


def read_records(path: Path) -> tuple[list[str], list[tuple[int, Record]]]:
    """Rows of a CSV (with header), JSONL, Parquet or Arrow file, or of a `datasets.save_to_disk` directory, as
    (line or row number, {column: value}).

    Raises:
        ZLError: missing or empty file, unknown extension, malformed JSON lines, an unreadable Parquet/Arrow file.
    """
    path = Path(path)
    if not path.exists():
        raise ZLError(f"--input {path}: no such file. Pass a .csv, .jsonl, .parquet or .arrow file, a directory "
                      "of `datasets.save_to_disk`, or `demo` for the built-in task.")
    suffix = path.suffix.lower()
    if path.is_file() and suffix not in SUFFIXES:
        raise ZLError(f"--input {path}: unknown file type {suffix or '(none)'!r}; expected .csv, .jsonl, .parquet "
                      "or .arrow.")
    try:
        if is_tabular(path):
            columns, records = _read_tabular(path)
        else:
            columns, records = _read_csv(path) if suffix == ".csv" else _read_jsonl(path)
    except UnicodeDecodeError as e:
        raise ZLError(f"--input {path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start} of a "
                      "block); save it as UTF-8 CSV/JSONL.") from None
    except csv.Error as e:
        raise ZLError(f"--input {path}: not a readable CSV ({e}); fields are at most {_CSV_FIELD_LIMIT // 1024} KiB.") from None
    if not records:
        raise ZLError(f"--input {path}: the file has no data rows; expected a header and at least one row.")
    return columns, records


_CSV_FIELD_LIMIT = 128 * 1024  # the csv module's default field_size_limit, stated
_JSONL_MAX_DEPTH = 32


def _check_cells(path: Path, line: int, cells: list[str], where: str | None = None) -> None:
    if any("\0" in c for c in cells):
        raise ZLError(f"{where or at_row(path, line)}: a NUL byte; the file looks binary. Save it as UTF-8 text.")


def _read_csv(path: Path) -> tuple[list[str], list[tuple[int, Record]]]:
    csv.field_size_limit(_CSV_FIELD_LIMIT)
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            return [], []
        _check_cells(path, 1, header)
        columns = [c.strip().lower() for c in header]
        records = []
        start = reader.line_num + 1
        for cells in reader:
            _check_cells(path, start, cells)
            if cells:  # blank lines
                if len(cells) != len(columns):
                    raise ZLError(
                        f"{path} line {start}: {len(cells)} fields, but the header has {len(columns)} "
                        f"({', '.join(columns)}). Quote fields that contain commas."
                    )
                records.append((start, dict(zip(columns, cells))))
            start = reader.line_num + 1
    return columns, records


def _arrow_files(path: Path) -> list[Path]:
    """The Arrow files of a `datasets.save_to_disk` directory, in order (its state.json lists them), or `path`."""
    if not path.is_dir():
        return [path]
    state = path / "state.json"
    named = []
    if state.is_file():
        try:
            named = [path / f["filename"] for f in json.loads(state.read_text()).get("_data_files", [])]
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ZLError(f"--input {path}: {state.name} is not a `datasets` state file ({e}); save the dataset "
                          "again with save_to_disk, or pass one of its .arrow files.") from None
    files = named or sorted(path.glob("*.arrow"))
    if not files:
        raise ZLError(f"--input {path}: a directory without .arrow files; pass a directory written by "
                      "`datasets.Dataset.save_to_disk` (the split's own, e.g. DIR/train), or a data file.")
    return files


def _read_table(path: Path):
    """The pyarrow Table of a Parquet or Arrow (IPC stream, as `datasets` writes, or file) file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if path.suffix.lower() == ".parquet":
            return pq.read_table(path)
        with pa.memory_map(str(path)) as source:
            try:
                return pa.ipc.open_stream(source).read_all()
            except pa.ArrowInvalid:
                source.seek(0)
                return pa.ipc.open_file(source).read_all()
    except (pa.ArrowException, OSError) as e:
        kind = "Parquet" if path.suffix.lower() == ".parquet" else "Arrow"
        raise ZLError(f"--input {path}: not a readable {kind} file ({str(e).splitlines()[0][:200]}); write it "
                      "again (pandas `to_parquet`, `datasets` `to_parquet` or `save_to_disk`).") from None


def _read_tabular(path: Path) -> tuple[list[str], list[tuple[int, Record]]]:
    """Rows of a Parquet or Arrow file or `datasets` directory, numbered from 1 across its files, checked as JSONL
    rows are."""
    columns: dict[str, None] = {}
    records: list[tuple[int, Record]] = []
    for file in _arrow_files(path):
        for obj in _read_table(file).to_pylist():
            number = len(records) + 1
            where = at_row(path, number)
            row = _row(obj, where)
            _check_cells(path, number, list(row) + [v for v in row.values() if isinstance(v, str)], where)
            check_text(list(row) + list(row.values()), where)
            columns.update(dict.fromkeys(row))
            records.append((number, row))
    return list(columns), records


def _read_jsonl(path: Path) -> tuple[list[str], list[tuple[int, Record]]]:
    columns: dict[str, None] = {}
    records = []
    with open(path, encoding="utf-8-sig") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {line_no}"
            obj = json_line(line, where)
            if not isinstance(obj, dict):
                raise ZLError(f"{where}: a JSON {json_kind(obj)}, expected an object like "
                              '{"prompt": ..., "completion": ...}.')
            row = _row(obj, where)
            _check_cells(path, line_no, list(row) + [v for v in row.values() if isinstance(v, str)])
            check_text(list(row) + list(row.values()), where)
            columns.update(dict.fromkeys(row))
            records.append((line_no, row))
    return list(columns), records


class _DuplicateKey(Exception):
    """A key twice in one JSON object (json.loads would keep the last value silently)."""


def _unique(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def json_line(line: str, where: str) -> object:
    """One line of a JSONL file (data rows, `zl generate --file` prompts) parsed: nesting measured first, in linear
    time (json.loads recurses once per level), and a key twice in any object refused.

    Raises:
        ZLError: naming `where` (e.g. "data.jsonl line 7"): nested deeper than 32, a duplicated key, not JSON.
    """
    if nests_deeper_than(line, _JSONL_MAX_DEPTH):
        raise ZLError(f"{where}: JSON nested deeper than {_JSONL_MAX_DEPTH} levels; expected one flat object per "
                      'line like {"prompt": ..., "completion": ...}.')
    try:
        return json.loads(line, object_pairs_hook=_unique)
    except _DuplicateKey as e:
        raise ZLError(f"{where}: key {e.args[0]!r} twice; zl would silently keep one value. Keep one of them, or "
                      "rename the other.") from None
    except json.JSONDecodeError as e:
        raise ZLError(f"{where}: not valid JSON ({e.msg}); expected one JSON object per line.") from e
    except (ValueError, RecursionError) as e:  # e.g. an integer of more than 4300 digits
        raise ZLError(f"{where}: not usable JSON ({e}); expected one JSON object per line.") from None


def _row(obj: dict, where: str) -> Record:
    """The row of a JSONL line's object: keys stripped and lower-cased, as CSV headers are.

    Raises:
        ZLError: two keys naming the same column, e.g. "prompt" and "Prompt".
    """
    row: Record = {}
    written: dict[str, str] = {}  # column -> the key as the file wrote it
    for key, value in obj.items():
        column = key.strip().lower()
        if column in written:
            raise ZLError(f"{where}: keys {written[column]!r} and {key!r} name the same column (keys are matched "
                          "ignoring case and surrounding spaces), so zl would silently keep one value. Keep one of "
                          "them, or rename the other.")
        written[column] = key
        row[column] = value
    return row


def json_kind(value: object) -> str:
    """How a row cell that is not text reads in an error: "boolean (true)", "number (inf)", "null", "list", ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"number ({value!r})"
    return {dict: "object", list: "list", str: "string"}.get(type(value), type(value).__name__)


def check_text(value: object, where: str) -> None:
    """Raise ZLError when a string in `value` (a string, or a list/dict of them, keys too) holds a lone surrogate:
    a JSON \\ud800 escape without its pair, or a command-line argument of bytes that are not UTF-8. Such text
    cannot be encoded, and would fail later in the tokenizer with a traceback."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ZLError(f"{where}: a lone surrogate U+{ord(value[e.start]):04X} at character {e.start + 1}, which is "
                          "not text (a \\u escape without its pair, or bytes that are not UTF-8); write the character "
                          "itself (saved as UTF-8) or a full pair such as \\ud83d\\ude00.") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_text(k, where)
            check_text(v, where)
    elif isinstance(value, list):
        for v in value:
            check_text(v, where)
