"""Score a model (and optionally a merged LoRA adapter) on a shard: `zl eval`.

Two figures per model, over the same rows:

- accuracy, for classification shards (their sidecar lists label words): the
  label word with the highest log-likelihood after the prompt is the
  prediction (zl_export.scoring.label_word_accuracy);
- NLL: mean negative log-likelihood per label token (completion and
  end-of-sequence), in nats — the task cross-entropy that training minimizes.

Rows are scored in batches so a progress callback can follow along; the
per-batch figures are combined with their row and token counts, so the result
does not depend on the batch size.
"""

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from zl.errors import ZLError
from zl_export.scoring import IGNORE_INDEX, RowScores, label_word_scores
from zl_export.shard import Shard


@dataclass
class EvalResult:
    """Figures of one model on one shard."""

    rows: int
    label_tokens: int
    accuracy: float | None  # None for shards without label words
    nll: float  # nats per label token
    seconds: float
    per_row: RowScores | None = field(default=None, repr=False)  # with evaluate(..., per_row=True), classification

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.per_row is None:
            del d["per_row"]
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


def evaluate(
    model: torch.nn.Module,
    shard: Shard,
    batch_size: int = 16,
    on_batch: Callable[[int], None] = lambda rows: None,
    per_row: bool = False,
) -> EvalResult:
    """Accuracy (classification shards) and mean NLL per label token of `model` on every row of `shard`.

    Args:
        model: a float32 Hugging Face causal LM, or a PEFT wrapper of one.
        shard: tokenized with the model's tokenizer.
        batch_size: rows per forward pass.
        on_batch: called with the number of rows after each batch (progress).
        per_row: also keep each row's figures (`EvalResult.per_row`; classification shards), for paired comparisons.

    Raises:
        ZLError: batch_size < 1, or a row without a completion.
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
        count = _label_tokens(batch, start)
        if classify:
            # One call per batch: label_word_scores scores every row it is given.
            scores = label_word_scores(model, batch, batch_size=batch_size)
            nll = scores.nll
            correct += sum(scores.correct)
            for mine, theirs in ((rows.correct, scores.correct), (rows.nll_sum, scores.nll_sum),
                                 (rows.tokens, scores.tokens)):
                mine.extend(theirs)
        else:
            nll = _completion_nll(model, batch)
        nll_sum += nll * count
        tokens += count
        on_batch(batch.rows)
    return EvalResult(
        rows=shard.rows,
        label_tokens=tokens,
        accuracy=correct / shard.rows if classify else None,
        nll=nll_sum / max(tokens, 1),
        seconds=time.perf_counter() - start_time,
        per_row=rows if per_row and classify else None,
    )


def evaluate_with_adapter(
    model: torch.nn.Module,
    shard: Shard,
    adapter_dir: Path | str | None = None,
    batch_size: int = 16,
    on_batch: Callable[[str, int], None] = lambda label, rows: None,
) -> dict[str, EvalResult]:
    """`model` ("base") and, with `adapter_dir`, `model` with that PEFT adapter ("adapter") on the same rows.

    The adapter is loaded into `model` after the base is scored. `on_batch(label, rows)` reports progress.
    """
    from zl_device.results.adapter import load_adapter

    results = {"base": evaluate(model, shard, batch_size, lambda rows: on_batch("base", rows))}
    if adapter_dir is not None:
        adapted = load_adapter(model, adapter_dir)
        results["adapter"] = evaluate(adapted, shard, batch_size, lambda rows: on_batch("adapter", rows))
    return results


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
def _completion_nll(model: torch.nn.Module, batch: Shard) -> float:
    """Mean NLL per label token of a batch of a shard without label words (prompt/completion data).

    The LM head runs only on the positions that predict a label: full
    (B, S, V) logits would take gigabytes for a 49k-token vocabulary.
    """
    was_training = model.training
    model.eval()
    try:
        decoder, head = model.get_decoder(), model.get_output_embeddings()
        length = int(batch.attention_mask.sum(1).max())
        ids, mask = batch.input_ids[:, :length], batch.attention_mask[:, :length]  # (B, L)
        hidden = decoder(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, L, d)
        # Position i predicts labels[i + 1] (Hugging Face convention, docs/design.md §3).
        targets = batch.labels[:, 1:length]  # (B, L-1)
        rows, cols = (targets != IGNORE_INDEX).nonzero(as_tuple=True)
        logp = torch.log_softmax(head(hidden[rows, cols]).float(), dim=-1)  # (K, V)
        return float(-logp.gather(1, targets[rows, cols][:, None]).mean())
    finally:
        model.train(was_training)
