"""Score a model (and optionally a merged LoRA adapter) on a shard: `zl eval`, and the end of `zl train`.

Figures per model, over the same rows:

- accuracy, for classification shards (their sidecar lists label words): the
  label word with the highest log-likelihood after the prompt is the
  prediction (zl_export.scoring.label_word_accuracy);
- NLL: mean negative log-likelihood per label token (completion and
  end-of-sequence), in nats — the task cross-entropy that training minimizes;
- for shards without label words (prompt/completion data), given a tokenizer
  (`GenerationEval`): perplexity = exp(NLL), and greedy generations from the
  prompt part of the first rows, scored against the rows' completions by exact
  match and ROUGE-L (zl_device.results.generation); `eval_record` adds a few
  of them side by side (prompt, reference, base, adapter).

Rows are scored in batches so a progress callback can follow along; the
per-batch figures are combined with their row and token counts, so the result
does not depend on the batch size.
"""

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from zl_base.errors import ZLError
from zl_device.results.generation import GENERATE_ROWS, MARGIN_TOKENS, SAMPLE_ROWS, score_generations, side_by_side
from zl_export.scoring import IGNORE_INDEX, RowScores, decoder_and_head, label_word_scores
from zl_export.shard import Shard
from zl_export.tokenizer import Tokenizer


@dataclass
class GenerationEval:
    """Generations on shards without label words: the tokenizer that decodes them, how many rows (0: none) and
    tokens per row (None: the row's completion length with end-of-sequence + MARGIN_TOKENS)."""

    tokenizer: Tokenizer
    rows: int = GENERATE_ROWS
    max_new_tokens: int | None = None
    on_batch: Callable[[int], None] = lambda rows: None  # called with the rows of each generated batch

    def validate(self) -> None:
        if self.rows < 0:
            raise ZLError(f"--generate-rows {self.rows}: must be 0 (no generations) or more, e.g. {GENERATE_ROWS}.")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ZLError(f"--max-new-tokens {self.max_new_tokens}: must be at least 1 (or leave it out: each row's "
                          f"completion length + {MARGIN_TOKENS}).")


@dataclass
class EvalResult:
    """Figures of one model on one shard."""

    rows: int
    label_tokens: int
    accuracy: float | None  # None for shards without label words
    nll: float  # nats per label token
    seconds: float  # scoring and generating
    perplexity: float | None = None  # exp(nll); shards without label words
    generated_rows: int = 0  # rows with a greedy generation (GenerationEval)
    exact_match: float | None = None  # fraction of generated rows equal to their reference
    rouge_l: float | None = None  # mean ROUGE-L F-measure of the generated rows
    # With evaluate(..., per_row=True), for paired comparisons: each row's NLL sum and label tokens (and, on
    # classification shards, whether it was right; `correct` is empty otherwise), and each generated row's
    # ROUGE-L and exact match.
    per_row: RowScores | None = field(default=None, repr=False)
    generations: list[str] | None = field(default=None, repr=False)  # each generated row's text
    row_rouge_l: list[float] | None = field(default=None, repr=False)
    row_exact: list[int] | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        del d["generations"]  # eval_record puts a sample of them side by side
        for name in ("per_row", "row_rouge_l", "row_exact"):
            if d[name] is None:
                del d[name]
        return d


def limit_rows(shard: Shard, limit: int | None) -> Shard:
    """The first `limit` rows of `shard` (all of them for None).

    Raises:
        ZLError: limit < 1.
    """
    if limit is None or limit >= shard.rows:
        return shard
    if limit < 1:
        raise ZLError(f"--limit {limit}: must be at least 1 (or leave it out to score all {shard.rows} rows).")
    return _rows(shard, 0, limit)


def tail_rows(shard: Shard, count: int) -> Shard:
    """The last `count` rows of `shard` (e.g. rows held out of training, scored as a test set nobody tuned to)."""
    return _rows(shard, shard.rows - count, shard.rows)


def evaluate(
    model: torch.nn.Module,
    shard: Shard,
    batch_size: int = 16,
    on_batch: Callable[[int], None] = lambda rows: None,
    per_row: bool = False,
    generation: GenerationEval | None = None,
) -> EvalResult:
    """Accuracy (classification shards) and mean NLL per label token of `model` on every row of `shard`; on shards
    without label words also perplexity and, with `generation`, greedy generations scored against the completions.

    Args:
        model: a float32 Hugging Face causal LM, or a PEFT wrapper of one.
        shard: tokenized with the model's tokenizer.
        batch_size: rows per forward pass.
        on_batch: called with the number of rows after each batch (progress).
        per_row: also keep each row's figures (`EvalResult.per_row`; classification shards), for paired comparisons.
        generation: generate for the first `generation.rows` rows (shards without label words).

    Raises:
        ZLError: batch_size < 1, bad generation settings, or a row without a completion.
    """
    if batch_size < 1:
        raise ZLError(f"--batch-size {batch_size}: must be at least 1.")
    classify = bool(shard.meta.get("label_token_ids"))
    start_time = time.perf_counter()
    correct = 0
    nll_sum, tokens = 0.0, 0
    rows = RowScores([], [], [])
    for start in range(0, shard.rows, batch_size):
        batch = _rows(shard, start, min(start + batch_size, shard.rows))
        if classify:
            # One call per batch: label_word_scores scores every row it is given.
            count = _label_tokens(batch, start)
            scores = label_word_scores(model, batch, batch_size=batch_size)
            nll_sum += scores.nll * count
            correct += sum(scores.correct)
            for mine, theirs in ((rows.correct, scores.correct), (rows.nll_sum, scores.nll_sum),
                                 (rows.tokens, scores.tokens)):
                mine.extend(theirs)
        else:
            sums, counts = _completion_nll_rows(model, batch)
            if 0 in counts:
                raise ZLError(f"shard {batch.path} row {start + counts.index(0)}: no completion after a prompt; "
                              "recreate the shard with `zl data`.")
            nll_sum += sum(sums)
            count = sum(counts)
            rows.nll_sum.extend(sums)
            rows.tokens.extend(counts)
        tokens += count
        on_batch(batch.rows)
    nll = nll_sum / max(tokens, 1)
    generated = None
    if generation is not None and not classify and generation.rows > 0:
        generated = score_generations(model, generation.tokenizer, shard, generation.rows, generation.max_new_tokens,
                                      batch_size, generation.on_batch)
    return EvalResult(
        rows=shard.rows,
        label_tokens=tokens,
        accuracy=correct / shard.rows if classify else None,
        nll=nll,
        seconds=time.perf_counter() - start_time,
        perplexity=None if classify else math.exp(min(nll, 700.0)),  # exp(710) overflows a float
        generated_rows=generated.rows if generated else 0,
        exact_match=generated.exact_match if generated else None,
        rouge_l=generated.rouge_l if generated else None,
        per_row=rows if per_row else None,
        generations=generated.texts if generated else None,
        row_rouge_l=generated.row_rouge_l if generated and per_row else None,
        row_exact=generated.row_exact if generated and per_row else None,
    )


def evaluate_with_adapter(
    model: torch.nn.Module,
    shard: Shard,
    adapter_dir: Path | str | None = None,
    batch_size: int = 16,
    on_batch: Callable[[str, int], None] = lambda label, rows: None,
    generation: GenerationEval | None = None,
) -> dict[str, EvalResult]:
    """`model` ("base") and, with `adapter_dir`, `model` with that PEFT adapter ("adapter") on the same rows.

    The adapter is loaded into `model` after the base is scored. `on_batch(label, rows)` reports progress, with
    labels "base", "adapter", and "base generations", "adapter generations" while generating (`generation`).
    """
    from zl_device.results.adapter import load_adapter

    if generation is not None:
        generation.validate()

    def run(name: str, scored: torch.nn.Module) -> EvalResult:
        generating = None if generation is None else replace(
            generation, on_batch=lambda rows: on_batch(f"{name} generations", rows))
        return evaluate(scored, shard, batch_size, lambda rows: on_batch(name, rows), generation=generating)

    results = {"base": run("base", model)}
    if adapter_dir is not None:
        results["adapter"] = run("adapter", load_adapter(model, adapter_dir))
    return results


def eval_record(results: dict[str, EvalResult], shard: Shard, generation: GenerationEval | None = None,
                samples: int = SAMPLE_ROWS) -> dict:
    """eval.json's figures: {"base": ..., "adapter": ...} (EvalResult.to_dict), and when there were generations
    "generation" (how they were made) and "samples": the first `samples` rows side by side (prompt, reference, base,
    adapter)."""
    record = {name: r.to_dict() for name, r in results.items()}
    texts = {name: r.generations for name, r in results.items() if r.generations is not None}
    if texts and generation is not None:
        record["generation"] = {"decoding": "greedy", "rows": min(generation.rows, shard.rows),
                                "max_new_tokens": generation.max_new_tokens, "margin_tokens": MARGIN_TOKENS}
        record["samples"] = side_by_side(shard, generation.tokenizer, texts, samples)
    return record


def describe(results: dict[str, EvalResult]) -> str:
    """One line of the figures, base -> adapter: `accuracy 25.0% -> 75.0%, NLL 1.234 -> 0.567 nats/token`, with
    perplexity, ROUGE-L and exact match on generative shards."""
    runs = list(results.values())

    def pair(value: Callable[[EvalResult], float | None], fmt: str) -> str | None:
        values = [value(r) for r in runs]
        return None if any(v is None for v in values) else " -> ".join(format(v, fmt) for v in values)

    parts = [("accuracy", pair(lambda r: r.accuracy, ".1%"), ""), ("NLL", pair(lambda r: r.nll, ".3f"), " nats/token"),
             ("perplexity", pair(lambda r: r.perplexity, ".2f"), ""), ("ROUGE-L", pair(lambda r: r.rouge_l, ".3f"), ""),
             ("exact match", pair(lambda r: r.exact_match, ".1%"), "")]
    return ", ".join(f"{name} {text}{unit}" for name, text, unit in parts if text is not None)


def _rows(shard: Shard, start: int, end: int) -> Shard:
    return Shard(shard.path, shard.input_ids[start:end], shard.attention_mask[start:end], shard.labels[start:end], shard.meta)


def _label_tokens(batch: Shard, offset: int) -> int:
    """Tokens the NLL averages over: from the first label position to the end of each row (as scoring counts them)."""
    count = 0
    for b in range(batch.rows):
        n = int(batch.attention_mask[b].sum())
        target = (batch.labels[b, :n] != IGNORE_INDEX).nonzero().flatten()
        if len(target) == 0 or target[0] == 0:
            raise ZLError(f"shard {batch.path} row {offset + b}: no completion after a prompt; recreate the shard with `zl data`.")
        count += n - int(target[0])
    return count


@torch.no_grad()
def _completion_nll_rows(model: torch.nn.Module, batch: Shard) -> tuple[list[float], list[int]]:
    """Each row's summed NLL over its label tokens, and their count, for a batch of a shard without label words
    (prompt/completion data).

    The LM head runs only on the positions that predict a label: full
    (B, S, V) logits would take gigabytes for a 49k-token vocabulary.
    """
    was_training = model.training
    model.eval()
    try:
        decoder, head = decoder_and_head(model)  # the LM head, soft-capped as the model's forward does
        length = int(batch.attention_mask.sum(1).max())
        ids, mask = batch.input_ids[:, :length], batch.attention_mask[:, :length]  # (B, L)
        hidden = decoder(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, L, d)
        # Position i predicts labels[i + 1] (Hugging Face convention, docs/design#stage-program).
        targets = batch.labels[:, 1:length]  # (B, L-1)
        rows, cols = (targets != IGNORE_INDEX).nonzero(as_tuple=True)
        logp = torch.log_softmax(head(hidden[rows, cols]).float(), dim=-1)  # (K, V)
        nll = -logp.gather(1, targets[rows, cols][:, None])[:, 0]  # (K,)
        sums = torch.zeros(batch.rows, dtype=torch.float64).index_add_(0, rows, nll.double())
        counts = torch.bincount(rows, minlength=batch.rows)
        return sums.tolist(), counts.tolist()
    finally:
        model.train(was_training)
