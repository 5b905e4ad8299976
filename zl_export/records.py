"""Reading training data files: the rows of a CSV (with header) or JSONL file, with their line numbers.

Every problem is a one-line ZLError naming the file and line: a missing file, an unknown extension, text that is
not UTF-8, a NUL byte, a ragged CSV row, a malformed or too deeply nested JSON line. JSONL values are kept as text
(numbers as their digits, null as ""), except arrays and objects, which stay JSON (a chat row's `messages`).
"""

import csv
import json
import re
from pathlib import Path

from zl_base.errors import ZLError

#: One row: {column: value}; a value is text, or for JSONL a list/dict as parsed.
Record = dict[str, "str | list | dict"]


def read_records(path: Path) -> tuple[list[str], list[tuple[int, Record]]]:
    """Rows of a CSV (with header) or JSONL file as (line, {column: value}).

    Raises:
        ZLError: missing or empty file, unknown extension, malformed JSON lines.
    """
    path = Path(path)
    if not path.is_file():
        raise ZLError(f"--input {path}: no such file. Pass a .csv or .jsonl file, or `demo` for the built-in task.")
    suffix = path.suffix.lower()
    if suffix not in (".csv", ".jsonl", ".ndjson"):
        raise ZLError(f"--input {path}: unknown file type {suffix or '(none)'!r}; expected .csv or .jsonl.")
    try:
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
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


def _check_cells(path: Path, line: int, cells: list[str]) -> None:
    if any("\0" in c for c in cells):
        raise ZLError(f"{path} line {line}: a NUL byte; the file looks binary. Save it as UTF-8 text.")


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


def _read_jsonl(path: Path) -> tuple[list[str], list[tuple[int, Record]]]:
    columns: dict[str, None] = {}
    records = []
    with open(path, encoding="utf-8-sig") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            if _json_depth(line) > _JSONL_MAX_DEPTH:
                raise ZLError(f"{path} line {line_no}: JSON nested deeper than {_JSONL_MAX_DEPTH} levels; expected "
                              'one flat object per line like {"prompt": ..., "completion": ...}.')
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ZLError(f"{path} line {line_no}: not valid JSON ({e.msg}); expected one JSON object per line.") from e
            except (ValueError, RecursionError) as e:  # e.g. an integer of more than 4300 digits
                raise ZLError(f"{path} line {line_no}: not usable JSON ({e}); expected one JSON object per line.") from None
            if not isinstance(obj, dict):
                raise ZLError(f"{path} line {line_no}: a JSON {type(obj).__name__}, expected an object like "
                              '{"prompt": ..., "completion": ...}.')
            row = {str(k).strip().lower(): _cell(v) for k, v in obj.items()}
            _check_cells(path, line_no, list(row) + [v for v in row.values() if isinstance(v, str)])
            columns.update(dict.fromkeys(row))
            records.append((line_no, row))
    return list(columns), records


def _cell(value: object) -> "str | list | dict":
    """A JSON value as a row cell: "" for null, str() of strings, numbers and booleans; arrays and objects as parsed."""
    if value is None:
        return ""
    return value if isinstance(value, (str, list, dict)) else str(value)


def _json_depth(line: str) -> int:
    """How deep the arrays/objects of a JSON line nest (brackets inside strings ignored); an upper bound for
    malformed lines, which json.loads rejects anyway."""
    if line.count("[") + line.count("{") <= _JSONL_MAX_DEPTH:
        return 0
    depth = deepest = 0
    for c in _JSON_STRING.sub("", line):
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest
