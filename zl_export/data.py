"""Training data: read CSV/JSONL rows, tokenize them into fixed-length samples, write and load shards.

A shard is what stage 0 of a pipeline (and `zl eval`) reads:

- `NAME.safetensors`: `input_ids`, `attention_mask`, `labels`, each int64 [N, S]
  in the stage program's convention (docs/design.md §3): right padding with the
  tokenizer's pad id, mask 1 on tokens, labels aligned with the ids (position i
  predicts labels[i+1]) and -100 on prompt tokens and padding, so the loss
  covers the completion and its end-of-sequence token only.
- `NAME.json`: the sidecar (see `write_shard`): counts, seq_len, tokenizer,
  source file and its sha256, format, prompt template and, for classification,
  the label words that `zl eval` scores.

Input formats (`--format`, detected from the columns by default):

- `prompt_completion`: columns `prompt`, `completion`; both taken verbatim.
- `text_label`: columns `text`, `label`; the prompt is TEXT_LABEL_TEMPLATE, the
  completion the label word.
- `agnews`: AG-News CSV (`label,title,description`, labels 1-4); the prompt
  is AGNEWS_TEMPLATE, the completion one of AGNEWS_LABELS' words.
"""

import csv
import html
import json
import logging
import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zl.errors import ZLError
from zl_export.shard import Shard, file_sha256, load_shard, sidecar_path, target_counts, write_shard  # noqa: F401 (re-exported)
from zl_export.tokenizer import Tokenizer

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
FORMATS = ("auto", "prompt_completion", "text_label", "agnews")
REQUIRED_COLUMNS = {
    "prompt_completion": ("prompt", "completion"),
    "text_label": ("text", "label"),
    "agnews": ("label", "title", "description"),
}

# The question comes last, so `--truncate` (which cuts the prompt from the
# left) drops the start of the text, never the question. The label word is the
# completion: " world" after the colon, a single SmolLM2 token.
TEXT_LABEL_TEMPLATE = "{text}\nLabel ({choices}):"
TEXT_LABEL_TEMPLATE_MANY = "{text}\nLabel:"  # more than MAX_LISTED_CHOICES labels
MAX_LISTED_CHOICES = 8
AGNEWS_TEMPLATE = "{title}\n{description}\nTopic ({choices}):"
# AG News class ids -> label words. Distinct first letters, so the words differ
# at their first token for the byte tokenizer too ("sci/tech" -> "tech", since
# "science" would share its first letter with "sports").
AGNEWS_LABELS = {"1": "world", "2": "sports", "3": "business", "4": "tech"}
_AGNEWS_NAMES = {"world": "1", "sports": "2", "business": "3", "sci/tech": "4", "tech": "4"}


@dataclass
class Example:
    """One row turned into text: the model reads `prompt` and learns `completion`."""

    line: int  # where the row starts in its file, 1-based (the CSV header is line 1)
    prompt: str
    completion: str
    label: str | None = None  # the label word (without separator), for classification


@dataclass
class Task:
    """Examples plus what a later scorer needs to know about them."""

    examples: list[Example]
    format: str
    prompt_template: str | None
    label_words: list[str] | None = None  # completions as tokenized, e.g. [" world", " sports"]
    label_map: dict[str, str] | None = None  # value in the file -> label word


# ---------------------------------------------------------------- reading


def read_records(path: Path) -> tuple[list[str], list[tuple[int, dict[str, str]]]]:
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


def _read_csv(path: Path) -> tuple[list[str], list[tuple[int, dict[str, str]]]]:
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


def _read_jsonl(path: Path) -> tuple[list[str], list[tuple[int, dict[str, str]]]]:
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
            row = {str(k).strip().lower(): "" if v is None else str(v) for k, v in obj.items()}
            _check_cells(path, line_no, list(row) + list(row.values()))
            columns.update(dict.fromkeys(row))
            records.append((line_no, row))
    return list(columns), records


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


def detect_format(columns: list[str], path: Path | str) -> str:
    """The format whose required columns are all present (prompt_completion, then text_label, then agnews)."""
    for name, required in REQUIRED_COLUMNS.items():
        if all(c in columns for c in required):
            return name
    expected = "; ".join(f"{n}: {', '.join(cols)}" for n, cols in REQUIRED_COLUMNS.items())
    raise ZLError(
        f"--input {path}: columns {', '.join(columns) or '(none)'} match no format. Expected the columns of one of "
        f"{expected}. Rename the columns, or pass --format."
    )


def load_task(path: Path, fmt: str = "auto", labels: list[str] | None = None) -> Task:
    """Read `path` and turn every row into an Example.

    Args:
        path: a .csv or .jsonl file.
        fmt: one of FORMATS.
        labels: text_label only: the label values in the order to list them;
            default: the sorted distinct labels of the file.

    Raises:
        ZLError: bad format name, missing columns, empty fields, unknown labels.
    """
    if fmt not in FORMATS:
        raise ZLError(f"--format {fmt!r} is not a known format; expected one of {', '.join(FORMATS)}.")
    columns, records = read_records(path)
    if fmt == "agnews" and "label" not in columns and len(columns) == 3 and columns[0].strip() in AGNEWS_LABELS:
        # The original AG News CSVs have no header: class id, title, description.
        columns, records = _agnews_headerless(path)
    if fmt == "agnews" and "class index" in columns:  # the Kaggle copy's header
        columns = ["label" if c == "class index" else c for c in columns]
        records = [(n, {("label" if k == "class index" else k): v for k, v in r.items()}) for n, r in records]
    if fmt == "auto":
        fmt = detect_format(columns, path)
    missing = [c for c in REQUIRED_COLUMNS[fmt] if c not in columns]
    if missing:
        raise ZLError(
            f"--input {path}: --format {fmt} needs the columns {', '.join(REQUIRED_COLUMNS[fmt])}, but the file has "
            f"{', '.join(columns) or '(none)'} (missing: {', '.join(missing)}). Rename the columns or pick another --format."
        )
    for line, row in records:
        for col in REQUIRED_COLUMNS[fmt]:
            if not row.get(col, "").strip():
                raise ZLError(
                    f"{path} line {line}: column {col!r} is empty; every row needs a non-empty "
                    f"{', '.join(REQUIRED_COLUMNS[fmt])}. Fill in or delete the row."
                )
    if fmt == "prompt_completion":
        examples = [Example(line, r["prompt"], r["completion"]) for line, r in records]
        return Task(examples, fmt, None)
    if fmt == "text_label":
        return _text_label_task(path, records, labels)
    return _agnews_task(path, records)


def _agnews_headerless(path: Path) -> tuple[list[str], list[tuple[int, dict[str, str]]]]:
    columns = list(REQUIRED_COLUMNS["agnews"])
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        records, start = [], 1
        for cells in reader:
            if cells:
                if len(cells) != 3:
                    raise ZLError(f"{path} line {start}: {len(cells)} fields; AG News rows have 3 (label, title, description).")
                records.append((start, dict(zip(columns, cells))))
            start = reader.line_num + 1
    return columns, records


def choices_text(words: list[str]) -> str:
    """"a, b, c or d": how the prompt lists the label words."""
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _text_label_task(path: Path | str, records, labels: list[str] | None, template: str | None = None) -> Task:
    found = sorted({r["label"].strip() for _, r in records})
    words = [w.strip() for w in labels] if labels else found
    if len(set(words)) != len(words) or any(not w for w in words):
        raise ZLError(f"--labels {','.join(words)}: labels must be distinct and non-empty.")
    unknown = [w for w in found if w not in words]
    if unknown:
        line = next(n for n, r in records if r["label"].strip() == unknown[0])
        raise ZLError(f"{path} line {line}: label {unknown[0]!r} is not in --labels {','.join(words)}; add it to --labels.")
    if template is None:
        template = TEXT_LABEL_TEMPLATE if len(words) <= MAX_LISTED_CHOICES else TEXT_LABEL_TEMPLATE_MANY
    prompt_of = lambda r: template.format(text=r["text"].strip(), choices=choices_text(words))  # noqa: E731
    examples = [Example(n, prompt_of(r), r["label"].strip(), r["label"].strip()) for n, r in records]
    return Task(examples, "text_label", template, words, {w: w for w in words})


def demo_task(rows: list[dict[str, str]]) -> Task:
    """The built-in demo rows (`zl_export.demo_task.demo_rows`) as a Task; "lines" are 1-based row numbers."""
    from zl_export.demo_task import DEMO_TEMPLATE, TOPIC_COLORS

    task = _text_label_task("demo", list(enumerate(rows, 1)), list(TOPIC_COLORS.values()), DEMO_TEMPLATE)
    task.format = "demo"
    return task


def clean_agnews_text(text: str) -> str:
    """Undo AG News' escapes: ` #39;` for an apostrophe, `#36;` for `$`, `&lt;b&gt;` markup, `\\` for a line break."""
    text = re.sub(r" ?#39;", "'", text)
    text = re.sub(r"#(\d+);", lambda m: html.unescape(f"&#{m.group(1)};"), text)
    text = re.sub(r"<[^>]*>", " ", html.unescape(text))
    text = text.replace("\\$", "$").replace("\\", " ")
    return re.sub(r"\s+", " ", text).strip()


def _agnews_task(path: Path, records) -> Task:
    words = list(AGNEWS_LABELS.values())
    examples = []
    for line, r in records:
        value = r["label"].strip()
        key = value if value in AGNEWS_LABELS else _AGNEWS_NAMES.get(value.lower())
        if key is None:
            raise ZLError(
                f"{path} line {line}: AG News label {value!r} is not one of 1-4 (World, Sports, Business, Sci/Tech). "
                "Check the file, or use --format text_label for other labels."
            )
        prompt = AGNEWS_TEMPLATE.format(
            title=clean_agnews_text(r["title"]), description=clean_agnews_text(r["description"]), choices=choices_text(words)
        )
        examples.append(Example(line, prompt, AGNEWS_LABELS[key], AGNEWS_LABELS[key]))
    return Task(examples, "agnews", AGNEWS_TEMPLATE, words, dict(AGNEWS_LABELS))


# ---------------------------------------------------------------- tokenizing


def label_separator(tokenizer: Tokenizer, words: list[str]) -> str:
    """Where the space between the prompt and the label word goes.

    Word-piece tokenizers read " world" as one token, so the space starts the
    completion and every label word differs at its first token. The byte
    tokenizer would start every completion with the same space byte; there the
    space ends the prompt instead, so the first completion token still tells
    the labels apart. Returns the separator that ends the prompt ("" or " ").
    """
    firsts = [tuple(tokenizer.encode(" " + w)[:1]) for w in words]
    if len(set(firsts)) == len(words):
        return ""
    bare = [tuple(tokenizer.encode(w)[:1]) for w in words]
    if len(set(bare)) == len(words):
        return " "
    log.warning("label words %s share their first token with tokenizer %s", words, tokenizer.name)
    return ""


@dataclass
class Tokenized:
    """Samples as [N, S] int64 tensors plus counts for the sidecar."""

    input_ids: torch.Tensor  # (N, S)
    attention_mask: torch.Tensor  # (N, S)
    labels: torch.Tensor  # (N, S)
    stats: dict = field(default_factory=dict)


def tokenize(
    task: Task,
    tokenizer: Tokenizer,
    seq_len: int,
    truncate: bool = False,
    source: str = "input",
    on_progress: Callable[[int], None] | None = None,
) -> tuple[Tokenized, Task]:
    """Tokenize `task.examples` to right-padded samples of `seq_len` tokens.

    ids = encode(prompt) + encode(completion) + [eos]; labels are the ids on
    the completion and eos, -100 elsewhere. Classification tasks get their
    separator placed by `label_separator`; the returned Task carries the
    label words and template exactly as tokenized.

    Raises:
        ZLError: a sample longer than seq_len (without `truncate`), or a
            completion that does not fit even with `truncate`.
    """
    if seq_len < 2:
        raise ZLError(f"--seq-len {seq_len}: too small; a sample needs at least one prompt and one completion token.")
    sep = label_separator(tokenizer, task.label_words) if task.label_words else ""
    if task.label_words:
        task = Task(
            [Example(e.line, e.prompt + sep, ("" if sep else " ") + e.completion, e.label) for e in task.examples],
            task.format,
            task.prompt_template + sep,
            [("" if sep else " ") + w for w in task.label_words],
            {k: ("" if sep else " ") + w for k, w in task.label_map.items()},
        )
    n = len(task.examples)
    input_ids = torch.full((n, seq_len), tokenizer.pad_token_id, dtype=torch.int64)
    labels = torch.full((n, seq_len), IGNORE_INDEX, dtype=torch.int64)
    attention_mask = torch.zeros((n, seq_len), dtype=torch.int64)
    too_long: list[tuple[Example, int, int]] = []
    truncated = max_len = 0
    for i, ex in enumerate(task.examples):
        if on_progress is not None:
            on_progress(1)
        prompt = tokenizer.encode(ex.prompt)
        completion = tokenizer.encode(ex.completion) + [tokenizer.eos_token_id]
        length = len(prompt) + len(completion)
        if length > seq_len:
            if not truncate:
                too_long.append((ex, len(prompt), len(completion)))
                continue
            keep = seq_len - len(completion)
            if keep < 1:
                raise ZLError(
                    f"{source} line {ex.line}: the completion alone is {len(completion)} tokens (with end-of-sequence), "
                    f"which leaves no room for the prompt in --seq-len {seq_len}. Raise --seq-len to at least "
                    f"{len(completion) + 1} or shorten the completion."
                )
            prompt = prompt[-keep:]
            truncated += 1
        ids = prompt + completion
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, len(prompt) : len(ids)] = torch.tensor(completion)
        attention_mask[i, : len(ids)] = 1
        max_len = max(max_len, len(ids))
    if too_long:
        ex, p, c = too_long[0]
        more = f" ({len(too_long) - 1} more rows are too long)" if len(too_long) > 1 else ""
        longest = max(p + c for _, p, c in too_long)
        raise ZLError(
            f"{source} line {ex.line}: {p + c} tokens (prompt {p}, completion {c - 1}, end-of-sequence 1) do not fit "
            f"--seq-len {seq_len}{more}. Raise --seq-len to at least {longest}, or pass --truncate to cut prompts "
            "from the left and keep the completions."
        )
    stats = {
        "rows": n,
        "tokens": int(attention_mask.sum()),
        "label_tokens": int((labels != IGNORE_INDEX).sum()),
        "max_target_tokens": int(target_counts(labels).max()) if n else 0,  # per row; what --max-targets must cover
        "max_length": max_len,
        "truncated_rows": truncated,
    }
    return Tokenized(input_ids, attention_mask, labels, stats), task


def select(task: Task, limit: int | None, shuffle: bool, seed: int) -> Task:
    """Shuffle (seeded) then keep the first `limit` examples, so a limit keeps a random sample of all classes."""
    if limit is not None and limit < 1:
        raise ZLError(f"--limit {limit}: expected a positive number of rows.")
    examples = list(task.examples)
    if shuffle:
        random.Random(seed).shuffle(examples)
    if limit is not None:
        examples = examples[:limit]
    return Task(examples, task.format, task.prompt_template, task.label_words, task.label_map)


def save(path: Path | str, data: Tokenized, task: Task, tokenizer: Tokenizer, model: str, source: dict,
         extra: dict | None = None) -> dict:
    """Write `data` as a shard at `path`; returns the sidecar.

    The sidecar holds the counts of `data.stats`, the tokenizer (name, the
    `--model` it came from, eos and pad ids), `source` (path or "demo",
    sha256, ...), the format and prompt template, and for classification the
    label words with their token ids (what `zl eval` scores), the file's label
    values mapped to words, and the count of each label.
    """
    meta = {
        **data.stats,
        "tokenizer": {
            "name": tokenizer.name,
            "model": model,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        "source": source,
        "format": task.format,
        "prompt_template": task.prompt_template,
        "label_words": task.label_words,
        "label_token_ids": [tokenizer.encode(w) for w in task.label_words] if task.label_words else None,
        "label_map": task.label_map,
        "label_counts": dict(Counter(e.completion for e in task.examples)) if task.label_words else None,
        **(extra or {}),
    }
    tensors = {"input_ids": data.input_ids, "attention_mask": data.attention_mask, "labels": data.labels}
    write_shard(path, tensors, meta)
    return load_shard(path).meta
