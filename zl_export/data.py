"""Training data: read CSV/JSONL rows, tokenize them into fixed-length samples, write and load shards.

A shard is what stage 0 of a pipeline (and `zl eval`) reads:

- `NAME.safetensors`: `input_ids`, `attention_mask`, `labels`, each int64 [N, S]
  in the stage program's convention (docs/design#stage-program): right padding with the
  tokenizer's pad id, mask 1 on tokens, labels aligned with the ids (position i
  predicts labels[i+1]) and -100 on prompt tokens and padding, so the loss
  covers the completion and its end-of-sequence token only. A row is
  [BOS] + prompt + completion + [eos], the BOS exactly when the tokenizer adds
  one by default (Gemma, Llama 2; not SmolLM2 or the byte tokenizer):
  `zl_export.tokenizer.encode_prompt`.
- `NAME.json`: the sidecar (see `write_shard`): counts, seq_len, tokenizer
  (with the BOS id the rows start with, or null), source file and its sha256,
  format, prompt template and, for classification, the label words that
  `zl eval` scores.

Input formats (`--format`, detected from the columns by default), in CSV, JSONL, Parquet or Arrow files (reading:
zl_export/records.py):

- `prompt_completion`: columns `prompt`, `completion`; both taken verbatim.
  `--prompt-column`, `--completion-column` and `--prompt-template` (several
  columns into one prompt) pick other columns: zl_export/data_columns.py.
- `chat`: JSONL `{"messages": [{"role": ..., "content": ...}, ...]}`; the last
  (assistant) turn is the completion, the turns before it the prompt, rendered
  with the tokenizer's chat template or a plain fallback: zl_export/chat.py.
- `sharegpt`: `{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}, ...]}`; the turns become
  `messages` (human: user, gpt: assistant) and are read as `chat` rows.
- `alpaca`: columns `instruction`, `output` and an optional `input`; the prompt is ALPACA_PROMPT (without an
  input: ALPACA_PROMPT_NO_INPUT), the completion the output; recorded as prompt/completion rows.
- `text_label`: columns `text`, `label`; the prompt is TEXT_LABEL_TEMPLATE, the
  completion the label word.
- `agnews`: AG-News CSV (`label,title,description`, labels 1-4); the prompt
  is AGNEWS_TEMPLATE, the completion one of AGNEWS_LABELS' words.

A completion is never cut: a row longer than the sequence length fails, naming
its line (the default, `--no-truncate`), or with `--truncate` loses prompt
tokens from the left, after the BOS (which stays first); a row whose completion
alone leaves no room for a prompt token is then dropped, and both counts are
reported (`truncation_summary`).
"""

import csv
import html
import logging
import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zl_base.errors import ZLError
from zl_export import chat
from zl_export.data_columns import DataColumns, column_rows
from zl_export.data_settings import FORMATS
from zl_export.records import Record, at_row, json_kind, read_records  # noqa: F401 (Record re-exported)
from zl_export.shard import Shard, file_sha256, load_shard, sidecar_path, target_counts, write_shard  # noqa: F401 (re-exported)
from zl_export.tokenizer import Tokenizer, bos_ids, encode_prompt

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
REQUIRED_COLUMNS = {
    "prompt_completion": ("prompt", "completion"),
    "chat": ("messages",),
    "sharegpt": ("conversations",),
    "alpaca": ("instruction", "output"),  # and "input", optional
    "text_label": ("text", "label"),
    "agnews": ("label", "title", "description"),
}

# Alpaca's prompts (tatsu-lab/stanford_alpaca, as torchtune's AlpacaToMessages and TRL render them): with the row's
# `input`, and without one (an empty or absent input). `--prompt-template` instead: any template over the columns.
ALPACA_PROMPT = ("Below is an instruction that describes a task, paired with an input that provides further "
                 "context. Write a response that appropriately completes the request.\n\n"
                 "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_PROMPT_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately "
                          "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")

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
    messages: list[dict[str, str]] | None = None  # chat rows: the checked turns; `tokenize` renders the prompt


@dataclass
class Task:
    """Examples plus what a later scorer needs to know about them."""

    examples: list[Example]
    format: str
    prompt_template: str | None
    label_words: list[str] | None = None  # completions as tokenized, e.g. [" world", " sports"]
    label_map: dict[str, str] | None = None  # value in the file -> label word
    chat_template: str | None = None  # chat rows, once tokenized: "tokenizer" (its own template) or "plain"


def detect_format(columns: list[str], path: Path | str) -> str:
    """The format whose required columns are all present (prompt_completion, chat, text_label, then agnews)."""
    for name, required in REQUIRED_COLUMNS.items():
        if all(c in columns for c in required):
            return name
    expected = "; ".join(f"{n}: {', '.join(cols)}" for n, cols in REQUIRED_COLUMNS.items())
    raise ZLError(
        f"--input {path}: columns {', '.join(columns) or '(none)'} match no format. Expected the columns of one of "
        f"{expected}. Rename the columns, or pass --format."
    )


def load_task(path: Path, fmt: str = "auto", labels: list[str] | None = None, cols: DataColumns | None = None) -> Task:
    """Read `path` and turn every row into an Example.

    Args:
        path: a .csv or .jsonl file.
        fmt: one of FORMATS.
        labels: text_label only: the label values in the order to list them;
            default: the sorted distinct labels of the file.
        cols: prompt/completion from other columns or a template (implies prompt_completion).

    Raises:
        ZLError: bad format name, missing columns, empty fields, unknown labels,
            a bad chat row (unknown role, no assistant turn).
    """
    if fmt not in FORMATS:
        raise ZLError(f"--format {fmt!r} is not a known format; expected one of {', '.join(FORMATS)}.")
    cols = cols if cols is not None and cols.given() else None
    if cols is not None and fmt not in ("auto", "prompt_completion"):
        raise ZLError(f"--prompt-column, --completion-column and --prompt-template pick a prompt/completion from "
                      f"columns; they do not apply to --format {fmt}. Drop them or pass --format prompt_completion.")
    if cols is not None:
        cols.validate()  # before reading: a bad template fails fast
    columns, records = read_records(path)
    if cols is not None:
        rows = column_rows(path, columns, records, cols)
        return Task([Example(line, p, c) for line, p, c in rows], "prompt_completion", cols.prompt_template)
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
    if fmt in ("chat", "sharegpt"):  # a ShareGPT row is a chat row in other words: rendered, and recorded, as one
        parse = chat.parse_messages if fmt == "chat" else chat.sharegpt_messages
        examples = []
        for line, row in records:
            messages = parse(row.get(REQUIRED_COLUMNS[fmt][0]), at_row(path, line))
            examples.append(Example(line, chat.plain_prompt(messages), messages[-1]["content"], messages=messages))
        return Task(examples, "chat", None)
    for line, row in records:
        for col in REQUIRED_COLUMNS[fmt]:
            value = row.get(col, "")
            if col == "label" and isinstance(value, int) and not isinstance(value, bool):
                row[col] = value = str(value)  # a class id written as a number (AG News 1-4): its digits are exact
            if not isinstance(value, str):
                raise ZLError(f"{at_row(path, line)}: column {col!r} is a JSON {json_kind(value)}; expected text. Put "
                              f"the text in a string (\"...\"), or pick another --format.")
            if not row.get(col, "").strip():
                raise ZLError(
                    f"{at_row(path, line)}: column {col!r} is empty; every row needs a non-empty "
                    f"{', '.join(REQUIRED_COLUMNS[fmt])}. Fill in or delete the row."
                )
    if fmt == "prompt_completion":
        examples = [Example(line, r["prompt"], r["completion"]) for line, r in records]
        return Task(examples, fmt, None)
    if fmt == "alpaca":
        return _alpaca_task(path, records)
    if fmt == "text_label":
        return _text_label_task(path, records, labels)
    return _agnews_task(path, records)


def _alpaca_task(path: Path, records) -> Task:
    """Alpaca rows (their instruction and output checked already): the prompt ALPACA_PROMPT with the row's input,
    ALPACA_PROMPT_NO_INPUT without one, the output the completion. Recorded as prompt/completion rows."""
    examples = []
    for line, row in records:
        given = row.get("input")
        if given is not None and not isinstance(given, str):
            raise ZLError(f"{at_row(path, line)}: column 'input' is a JSON {json_kind(given)}; expected text (or "
                          "empty, or absent). Put the text in a string.")
        values = {"instruction": row["instruction"], "input": given or ""}
        template = ALPACA_PROMPT if values["input"].strip() else ALPACA_PROMPT_NO_INPUT
        examples.append(Example(line, template.format(**values), row["output"]))
    return Task(examples, "prompt_completion", None)


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
        raise ZLError(f"{at_row(path, line)}: label {unknown[0]!r} is not in --labels {','.join(words)}; add it to "
                      "--labels.")
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
    text = re.sub(r"<[^<>]*>", " ", html.unescape(text))  # [^<>]: linear on unclosed "<<<..." ([^>] was quadratic)
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
                f"{at_row(path, line)}: AG News label {value!r} is not one of 1-4 (World, Sports, Business, Sci/Tech). "
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

    ids = encode_prompt(prompt) + encode(completion) + [eos], where
    `encode_prompt` puts the tokenizer's BOS first when it adds one by default
    (once, also after a chat template that writes it); labels are the ids on
    the completion and eos, -100 elsewhere. Chat rows get their prompt
    rendered here (`zl_export.chat.render_prompt`: the tokenizer's chat
    template, else the plain fallback). Classification tasks get their
    separator placed by `label_separator`. The returned Task holds the rows
    kept, exactly as tokenized (row i of the tensors is its example i).

    A completion is never cut. A row longer than `seq_len` fails (naming its
    line) unless `truncate`; then its prompt loses tokens from the left after
    the BOS, which stays first (a model reads nothing right without it), and a
    row whose BOS + completion + eos leaves no room for one prompt token is
    dropped. `stats` counts both (`truncated_rows`, `dropped_rows`, `dropped_lines`).

    Raises:
        ZLError: a row longer than seq_len (without `truncate`), every row
            dropped (with it), or a chat row the tokenizer's template rejects.
    """
    head = len(bos_ids(tokenizer))  # the BOS every row starts with (0 or 1 tokens), never truncated
    if seq_len < 2 + head:
        raise ZLError(f"--seq-len {seq_len}: too small; a sample needs at least one prompt and one completion token"
                      f"{_after_bos(head)}.")
    sep = label_separator(tokenizer, task.label_words) if task.label_words else ""
    if task.label_words:
        task = Task(
            [Example(e.line, e.prompt + sep, ("" if sep else " ") + e.completion, e.label) for e in task.examples],
            task.format,
            task.prompt_template + sep,
            [("" if sep else " ") + w for w in task.label_words],
            {k: ("" if sep else " ") + w for k, w in task.label_map.items()},
        )
    rows: list[tuple[list[int], list[int]]] = []  # (prompt ids, completion ids + eos) of the kept rows
    kept: list[Example] = []
    too_long: list[tuple[Example, int, int]] = []
    dropped: list[tuple[Example, int]] = []
    truncated = 0
    rendered: set[str] = set()
    for ex in task.examples:
        if on_progress is not None:
            on_progress(1)
        if ex.messages is not None:
            text, how = chat.render_prompt(tokenizer, ex.messages, at_row(source, ex.line))
            ex = Example(ex.line, text, ex.completion, ex.label, ex.messages)
            rendered.add(how)
        prompt = encode_prompt(tokenizer, ex.prompt)  # (BOS +) prompt text
        completion = tokenizer.encode(ex.completion) + [tokenizer.eos_token_id]
        if len(prompt) + len(completion) > seq_len:
            if not truncate:
                too_long.append((ex, len(prompt) - head, len(completion)))
                continue
            keep = seq_len - head - len(completion)  # prompt tokens after the BOS
            if keep < 1:
                dropped.append((ex, len(completion)))
                continue
            prompt = prompt[:head] + prompt[-keep:]
            truncated += 1
        rows.append((prompt, completion))
        kept.append(ex)
    if too_long:
        raise _too_long_error(too_long, seq_len, source, head)
    if not rows and dropped:
        longest = max(c for _, c in dropped)
        raise ZLError(f"{source}: no row left: the completion of every row ({len(dropped)}) is longer than "
                      f"--seq-len {seq_len} allows (with end-of-sequence{', beginning-of-sequence' * head} and one "
                      f"prompt token), so --truncate dropped them all. Raise --seq-len to at least "
                      f"{longest + 1 + head}.")
    n = len(rows)
    input_ids = torch.full((n, seq_len), tokenizer.pad_token_id, dtype=torch.int64)  # (N, S)
    labels = torch.full((n, seq_len), IGNORE_INDEX, dtype=torch.int64)  # (N, S)
    attention_mask = torch.zeros((n, seq_len), dtype=torch.int64)  # (N, S)
    for i, (prompt, completion) in enumerate(rows):
        ids = prompt + completion
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, len(prompt) : len(ids)] = torch.tensor(completion)
        attention_mask[i, : len(ids)] = 1
    stats = {
        "rows": n,
        "tokens": int(attention_mask.sum()),
        "label_tokens": int((labels != IGNORE_INDEX).sum()),
        "max_target_tokens": int(target_counts(labels).max()) if n else 0,  # per row; what --max-targets must cover
        "max_length": int(attention_mask.sum(dim=1).max()) if n else 0,
        "truncated_rows": truncated,
        "dropped_rows": len(dropped),
        "dropped_lines": [ex.line for ex, _ in dropped[:MAX_LISTED_LINES]],
    }
    out = Task(kept, task.format, task.prompt_template, task.label_words, task.label_map,
               "tokenizer" if "tokenizer" in rendered else (chat.PLAIN if rendered else None))
    return Tokenized(input_ids, attention_mask, labels, stats), out


MAX_LISTED_LINES = 10  # dropped rows' lines kept in the sidecar and named in the summary


def _after_bos(head: int) -> str:
    return " after the beginning-of-sequence token" if head else ""


def _too_long_error(too_long: list[tuple[Example, int, int]], seq_len: int, source: str, head: int = 0) -> ZLError:
    """The strict mode's error: the first row that does not fit, the count of the others and the fix.
    `too_long` holds (example, prompt tokens without the BOS, completion tokens with eos); `head`: BOS tokens (0, 1)."""
    ex, p, c = too_long[0]
    more = f" ({len(too_long) - 1} more rows are too long)" if len(too_long) > 1 else ""
    longest = max(head + p + c for _, p, c in too_long)
    if head + c >= seq_len:  # --truncate would drop this row: say so
        return ZLError(
            f"{at_row(source, ex.line)}: the completion alone is {c} tokens (with end-of-sequence){_after_bos(head)}, "
            f"which leaves no room for the prompt in --seq-len {seq_len}{more}. Raise --seq-len to at least "
            f"{longest}, shorten the completion, or pass --truncate to drop such rows (and cut long prompts from the "
            "left)."
        )
    return ZLError(
        f"{at_row(source, ex.line)}: {head + p + c} tokens ({'beginning-of-sequence 1, ' * head}prompt {p}, completion "
        f"{c - 1}, end-of-sequence 1) do not fit --seq-len {seq_len}{more}. Raise --seq-len to at least {longest}, or "
        "pass --truncate to cut prompts from the left and keep the completions."
    )


def truncation_summary(stats: dict, seq_len: int) -> str | None:
    """What `--truncate` did to a shard's rows, as one line (None when it did nothing), e.g. "3 rows had their
    prompt cut from the left, 1 row dropped: completion longer than --seq-len 64 allows (line 7)"."""
    cut, dropped = stats.get("truncated_rows", 0), stats.get("dropped_rows", 0)
    if not cut and not dropped:
        return None
    lines = stats.get("dropped_lines") or []
    shown = ", ".join(map(str, lines)) + (", ..." if dropped > len(lines) else "")
    return (f"{cut} row{'s' * (cut != 1)} had their prompt cut from the left, {dropped} row{'s' * (dropped != 1)} "
            f"dropped: completion longer than --seq-len {seq_len} allows" + (f" (line{'s' * (dropped > 1)} {shown})" if dropped else ""))


def select(task: Task, limit: int | None, shuffle: bool, seed: int) -> Task:
    """Shuffle (seeded) then keep the first `limit` examples, so a limit keeps a random sample of all classes."""
    if limit is not None and limit < 1:
        raise ZLError(f"--limit {limit}: expected a positive number of rows.")
    examples = list(task.examples)
    if shuffle:
        random.Random(seed).shuffle(examples)
    if limit is not None:
        examples = examples[:limit]
    return Task(examples, task.format, task.prompt_template, task.label_words, task.label_map, task.chat_template)


def save(path: Path | str, data: Tokenized, task: Task, tokenizer: Tokenizer, model: str, source: dict,
         extra: dict | None = None) -> dict:
    """Write `data` as a shard at `path`; returns the sidecar.

    The sidecar holds the counts of `data.stats`, the tokenizer (name, the
    `--model` it came from, eos and pad ids, and `bos_token_id`: the BOS every
    row starts with, null for none; a sidecar without it predates zl adding
    BOS, so its rows have none: `Shard.check_matches`), `source` (path or "demo",
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
            "bos_token_id": (bos_ids(tokenizer) or [None])[0],  # null: no BOS (and what an older sidecar lacks)
        },
        "source": source,
        "format": task.format,
        "prompt_template": task.prompt_template,
        "label_words": task.label_words,
        "label_token_ids": [tokenizer.encode(w) for w in task.label_words] if task.label_words else None,
        "label_map": task.label_map,
        "label_counts": dict(Counter(e.completion for e in task.examples)) if task.label_words else None,
        "chat_template": task.chat_template,
        **(extra or {}),
    }
    tensors = {"input_ids": data.input_ids, "attention_mask": data.attention_mask, "labels": data.labels}
    write_shard(path, tensors, meta)
    return load_shard(path).meta
