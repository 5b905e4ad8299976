"""Text generation from a base model and its LoRA adapter: `zl generate`, and the generative half of `zl eval`.

- `generate_ids`: greedy (or seeded sampling) continuations of a batch of prompts, with Hugging Face's
  `generate`; prompts are left-padded so every row continues from its own last token.
- `score_generations`: greedy generations from the prompt part of a shard's rows, scored against the rows'
  completions by exact match and ROUGE-L (the `rouge-score` package).
- `token_printer`: a `transformers.TextStreamer` that hands each piece of decoded text to a callback, so a command
  can label and indent it.
- `adapter_base`, `choose_base`, `run_chat_record`: what an adapter was trained on (the model; whether its prompts were chat,
  rendered how), so `zl generate` loads that model and renders its prompts the same way.

Conventions: a prompt is tokenized exactly as `zl data` tokenizes one (`encode_prompt`, re-exported here: the
tokenizer's BOS first when it adds one by default, then the text without special tokens), so a model trained on a
shard sees at generation time the same ids it saw in training; `zl eval` takes its prompts from the shard's rows, BOS
included. A generation ends at the tokenizer's end-of-sequence token (left out of the text) or after its token budget.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from zl_base.errors import ZLError
from zl_export.tokenizer import encode_prompt, without_bos  # noqa: F401 (encode_prompt: `zl generate`'s prompt ids)

if TYPE_CHECKING:  # torch is imported where it is used: `zl --help` reads this module's constants
    import torch

    from zl_export.shard import Shard
    from zl_export.tokenizer import Tokenizer

# Tokens a generation may run past its reference (with end-of-sequence) in `zl eval`: enough to see that a
# model does not stop, few enough that a model that never stops costs little.
MARGIN_TOKENS = 8
SAMPLE_ROWS = 6  # rows shown side by side (prompt, reference, base, adapter) in eval.json and report.md
GENERATE_ROWS = 100  # rows `zl eval` generates for by default: greedy decoding costs a forward pass per token


@dataclass
class Decoding:
    """How tokens are chosen: greedy (the default), or sampling with a temperature, top-p and a seed."""

    sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0

    def validate(self) -> None:
        if self.temperature <= 0:
            raise ZLError(f"--temperature {self.temperature:g}: must be positive (1 keeps the model's "
                          "probabilities, lower is more deterministic), e.g. --temperature 0.7.")
        if not 0 < self.top_p <= 1:
            raise ZLError(f"--top-p {self.top_p:g}: must be in (0, 1] (1 keeps every token), e.g. --top-p 0.9.")

    def kwargs(self) -> dict:
        """The sampling arguments of `generate` (none for greedy, so no warning about unused ones)."""
        if not self.sample:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": 0}


def generate_ids(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
    max_new_tokens: int,
    decoding: Decoding | None = None,
    streamer=None,
) -> list[list[int]]:
    """Continue each prompt of a batch; returns the new ids of each, cut before the first end-of-sequence token.

    Args:
        model: a Hugging Face causal LM or a PEFT wrapper of one (put in eval mode for the call).
        tokenizer: gives the end-of-sequence and padding ids.
        prompts: token ids per prompt, each at least one token.
        max_new_tokens: the most tokens generated per prompt.
        decoding: greedy (None), or sampling seeded with `decoding.seed` (the global RNG is left as it was).
        streamer: a transformers streamer (batch of one prompt only).
    """
    import torch

    decoding = decoding or Decoding()
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.int64)  # (B, P) left-padded
    mask = torch.zeros((len(prompts), width), dtype=torch.int64)
    for b, prompt in enumerate(prompts):
        ids[b, width - len(prompt):] = torch.tensor(prompt)
        mask[b, width - len(prompt):] = 1
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng():
            torch.manual_seed(decoding.seed)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                 streamer=streamer, **decoding.kwargs())  # (B, P + T)
    finally:
        model.train(was_training)
    new = []
    for row in out[:, width:].tolist():
        new.append(row[: row.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in row else row)
    return new


def token_printer(tokenizer: Tokenizer, write: Callable[[str], None]):
    """A `transformers.TextStreamer` that passes the decoded text of the generated tokens, piece by piece, to
    `write` (words whole where it can: see TextStreamer); the end-of-sequence token is left out."""
    from transformers import TextStreamer

    class Decoder:
        # TextStreamer calls decode(list) and decode(int); zl's tokenizers take lists of ids.
        def decode(self, ids, **_):
            ids = [ids] if isinstance(ids, int) else ids
            return tokenizer.decode([i for i in ids if i != tokenizer.eos_token_id])

    class Printer(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            if text:
                write(text)

    return Printer(Decoder(), skip_prompt=True)


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def visible(text: str) -> str:
    """`text` safe to print on a terminal: control characters other than newline and tab (a model can generate
    any byte, ESC sequences too) are shown as escapes like \\x1b."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


# ---------------------------------------------------------------- scoring against references


class _WordTokenizer:
    """rouge-score's default tokenization (lowercase, words of letters and digits) without its ASCII-only rule,
    which would turn "café" into "caf" and text in other scripts into nothing; identical on ASCII text."""

    def tokenize(self, text: str) -> list[str]:
        return re.findall(r"[^\W_]+", text.lower())


_SCORER = None


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure of `prediction` against `reference` (rouge-score, no stemming), in [0, 1]."""
    global _SCORER
    if _SCORER is None:
        from rouge_score import rouge_scorer

        _SCORER = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False, tokenizer=_WordTokenizer())
    return float(_SCORER.score(reference, prediction)["rougeL"].fmeasure)


def exact_match(prediction: str, reference: str) -> bool:
    """The generation equals the reference, ignoring whitespace at either end."""
    return prediction.strip() == reference.strip()


def split_row(shard: Shard, row: int) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids without end-of-sequence) of a shard row; the completion starts at the first label.
    The prompt ids keep the row's leading BOS, if any: generation continues from what training saw.

    Raises:
        ZLError: a row without a completion after a prompt.
    """
    from zl_export.scoring import IGNORE_INDEX

    n = int(shard.attention_mask[row].sum())
    target = (shard.labels[row, :n] != IGNORE_INDEX).nonzero().flatten()
    if len(target) == 0 or target[0] == 0:
        raise ZLError(f"shard {shard.path} row {row}: no completion after a prompt; recreate the shard with `zl data`.")
    ids = shard.input_ids[row, :n].tolist()
    p = int(target[0])
    eos = int(shard.meta["tokenizer"]["eos_token_id"])
    completion = ids[p:]
    return ids[:p], completion[:-1] if completion and completion[-1] == eos else completion


@dataclass
class GenerationScores:
    """Greedy generations of one model from a shard's prompts, scored against the shard's completions."""

    rows: int  # rows generated for (the first ones of the shard)
    exact_match: float  # fraction of rows whose generation equals the reference
    rouge_l: float  # mean ROUGE-L F-measure
    max_new_tokens: int | None  # the fixed budget, or None: each row's completion length + MARGIN_TOKENS
    seconds: float
    texts: list[str] = field(default_factory=list, repr=False)  # each row's generation
    row_rouge_l: list[float] = field(default_factory=list, repr=False)  # each row's ROUGE-L, for paired comparisons
    row_exact: list[int] = field(default_factory=list, repr=False)  # 1 where the row's generation is exact


def score_generations(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    shard: Shard,
    rows: int = GENERATE_ROWS,
    max_new_tokens: int | None = None,
    batch_size: int = 16,
    on_batch: Callable[[int], None] = lambda rows: None,
) -> GenerationScores:
    """Greedy generations from the prompts of the first `rows` rows of `shard`, scored against their completions.

    Args:
        max_new_tokens: tokens per generation; None gives each row its completion's length (with
            end-of-sequence) plus MARGIN_TOKENS.
        on_batch: called with the number of rows after each batch (progress).
    """
    start_time = time.perf_counter()
    count = min(rows, shard.rows)
    texts, matches, rouges = [], [], []
    for start in range(0, count, batch_size):
        split = [split_row(shard, r) for r in range(start, min(start + batch_size, count))]
        budgets = [max_new_tokens or len(completion) + 1 + MARGIN_TOKENS for _, completion in split]
        # Greedy decoding is deterministic, so one batch at the largest budget, cut per row, is what each row
        # would get with its own budget.
        new = generate_ids(model, tokenizer, [p for p, _ in split], max(budgets))
        for (_, completion), ids, budget in zip(split, new, budgets):
            text, reference = tokenizer.decode(ids[:budget]), tokenizer.decode(completion)
            texts.append(text)
            matches.append(exact_match(text, reference))
            rouges.append(rouge_l(text, reference))
        on_batch(len(split))
    return GenerationScores(count, sum(matches) / max(count, 1), sum(rouges) / max(count, 1), max_new_tokens,
                            time.perf_counter() - start_time, texts, rouges, [int(m) for m in matches])


def side_by_side(shard: Shard, tokenizer: Tokenizer, texts: dict[str, list[str]], rows: int = SAMPLE_ROWS) -> list[dict]:
    """The first `rows` rows as {"row", "prompt", "reference", <model>: generation, ...} for eval.json and report.md
    (the prompt's text without the BOS the model reads first)."""
    count = min([rows, shard.rows, *(len(t) for t in texts.values())])
    samples = []
    for r in range(count):
        prompt, completion = split_row(shard, r)
        samples.append({"row": r, "prompt": tokenizer.decode(without_bos(tokenizer, prompt)),
                        "reference": tokenizer.decode(completion),
                        **{name: t[r] for name, t in texts.items()}})
    return samples


# ---------------------------------------------------------------- what an adapter was trained on


def adapter_base(adapter_dir: Path | str) -> tuple[str | None, int | None]:
    """(model name, seed of a random-weight model) an adapter was trained on: from the zl_merge.json `zl merge`
    writes, else the name in adapter_config.json (PEFT's base_model_name_or_path); Nones when neither says."""
    from zl_device.results.adapter import ADAPTER_CONFIG, MERGE_INFO

    try:
        model = json.loads((Path(adapter_dir) / MERGE_INFO).read_text())["model"]
        return str(model["name"]), _random_seed(model.get("source"))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        name = json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
        return (str(name) if name else None), None
    except (OSError, ValueError, AttributeError):
        return None, None


def choose_base(adapter_dir: Path | str, model: str | None, seed: int | None, default: str, *, force: bool = False,
                flag: str = "--adapter") -> tuple[str, int, str | None]:
    """The base model to load under the adapter in `adapter_dir`: (name, seed of a random-weight model, a note to
    show or None).

    The adapter's own base (`adapter_base`) unless `model` or `seed` names another. LoRA weights are deltas of the
    weights they were trained on, so on another base (another model, or a random-weight model under another seed)
    its scores and generations say nothing of it: that is refused unless `force` (`--force-base`), which gives a
    note instead. An adapter that does not say its base takes `model` (else `default`) and `seed` (else 0).

    Raises:
        ZLError: another base than the adapter's without `force`, naming both and the fix.
    """
    from zl_export.model_source import RANDOM_MODELS

    trained_on, trained_seed = adapter_base(adapter_dir)
    name = model or trained_on or default
    same_model = trained_on is None or _same_model(name, trained_on)
    if seed is None:
        seed = trained_seed if same_model and trained_seed is not None else 0
    if same_model and (trained_seed is None or seed == trained_seed):
        return name, seed, None

    def shown(model_name: str, model_seed: int | None) -> str:
        return f"{model_name} (seed {model_seed})" if model_name in RANDOM_MODELS and model_seed is not None else model_name

    trained, used = shown(str(trained_on), trained_seed), shown(name, seed)
    if force:
        return name, seed, f"the adapter was trained on {trained}; using {used} (--force-base)."
    given = f"--model {model}" if not same_model else f"--seed {seed}"
    raise ZLError(f"{flag} {adapter_dir}: trained on {trained}, not on {used} ({given}); its LoRA weights are deltas of "
                  f"that base's, so on another they say nothing of the adapter. Drop {given.split()[0]} to use the "
                  f"adapter's base, or pass --force-base to use {used} anyway.")


def _same_model(a: str, b: str) -> bool:
    """Two model specs name the same model: equal, or one directory written two ways."""
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.is_dir() and pb.is_dir() and pa.resolve() == pb.resolve()


def _random_seed(source) -> int | None:
    """The seed in a manifest's model source "random:seed=N" (the random-weight models), else None."""
    match = re.fullmatch(r"random:seed=(-?\d+)", str(source))
    return int(match.group(1)) if match else None


@dataclass
class ChatRecord:
    """How a run's training prompts were rendered, as its shard's sidecar says."""

    chat: bool  # the rows were chat conversations (`format` "chat")
    template: str | None  # chat only: "tokenizer" (the tokenizer's chat template) or "plain" (the fallback)
    sidecar: Path  # the sidecar that says so


def run_chat_record(run_dir: Path | str) -> ChatRecord | None:
    """What a `zl train` run's training data was: the sidecar of the shard it wrote (RUN_DIR/data/train.json), or
    of the shard it was given (`--data X.safetensors`, from RUN_DIR/train_settings.json); None when neither is
    there to read."""
    from zl_device.formats.run_layout import RunLayout
    from zl_export.shard import sidecar_path

    layout = RunLayout(Path(run_dir))
    candidates = [sidecar_path(layout.train_shard)]
    try:
        data = json.loads(layout.settings.read_text()).get("data")
        if isinstance(data, str) and data.endswith(".safetensors"):
            candidates.append(sidecar_path(Path(data).expanduser()))
    except (OSError, ValueError, AttributeError):
        pass
    for sidecar in candidates:
        try:
            meta = json.loads(sidecar.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict):
            chat = meta.get("format") == "chat"
            return ChatRecord(chat, (meta.get("chat_template") or None) if chat else None, sidecar)
    return None
