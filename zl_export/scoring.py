"""Score a causal LM on a classification shard: label-word accuracy and completion NLL.

The prediction for a row is the label word (from the shard's sidecar) with the
highest log-likelihood after the row's prompt — the sum of the log-probs of
its tokens, without the end-of-sequence token. The NLL is the mean negative
log-likelihood per label token (completion and end-of-sequence), i.e. the
task cross-entropy training minimizes, averaged over the same positions.
"""

from dataclasses import dataclass

import torch

from zl_base.errors import ZLError
from zl_export.shard import Shard

IGNORE_INDEX = -100


def decoder_and_head(model: torch.nn.Module):
    """The transformer body (returns final-normed hidden states) and the readout of a HF causal LM (or PEFT wrapper):
    its LM head, soft-capped where the config says so (Gemma's final_logit_softcapping: c·tanh(logits / c), which
    the Hugging Face forward applies after the head, so scores here equal the model's own logits).

    A model without a config (`EarlyExitModel`) is taken as it is: its head is a stage's readout, capped already.
    """
    try:
        decoder, head = model.get_decoder(), model.get_output_embeddings()
    except AttributeError as e:
        raise ZLError(f"cannot score {type(model).__name__}: expected a Hugging Face causal LM with get_decoder().") from e
    config = getattr(model, "config", None)
    cap = getattr(config, "final_logit_softcapping", None) if config is not None else None
    return decoder, head if cap is None else _SoftCapped(head, float(cap))


class _SoftCapped(torch.nn.Module):
    """`head` followed by c·tanh(logits / c)."""

    def __init__(self, head: torch.nn.Module, cap: float):
        super().__init__()
        self.head, self.cap = head, cap

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (…, D) -> (…, V)
        return torch.tanh(self.head(x) / self.cap) * self.cap


def _log_probs_at(decoder, head, ids: torch.Tensor, mask: torch.Tensor, positions: list[list[int]]) -> list[torch.Tensor]:
    """Log-softmax of the next-token logits at `positions[b]` of each row b; returns one (len, V) tensor per row.

    The LM head runs only on the requested positions: a full (B, S, V) logits
    tensor for a 49k-token vocabulary would take gigabytes.
    """
    length = int(mask.sum(1).max())
    hidden = decoder(input_ids=ids[:, :length], attention_mask=mask[:, :length]).last_hidden_state  # (B, L, d)
    rows = torch.cat([torch.full((len(p),), b) for b, p in enumerate(positions)])
    cols = torch.tensor([i for p in positions for i in p], dtype=torch.long)
    logp = torch.log_softmax(head(hidden[rows, cols]).float(), dim=-1)  # (K, V)
    return list(torch.split(logp, [len(p) for p in positions]))


@dataclass
class RowScores:
    """Per-row figures of a classification shard, in row order: what paired comparisons of two models need."""

    correct: list[int]  # 1 where the most likely label word is the row's own
    nll_sum: list[float]  # summed NLL of the row's label tokens (completion and end-of-sequence), nats
    tokens: list[int]  # the row's label tokens

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / max(len(self.correct), 1)

    @property
    def nll(self) -> float:
        """Mean NLL per label token over all rows."""
        return sum(self.nll_sum) / max(sum(self.tokens), 1)


def label_word_accuracy(model: torch.nn.Module, shard: Shard, batch_size: int = 16) -> tuple[float, float]:
    """Accuracy of picking the right label word, and the mean NLL per label token, over all rows of `shard`.

    See label_word_scores for the arguments and errors.
    """
    scores = label_word_scores(model, shard, batch_size)
    return scores.accuracy, scores.nll


@torch.no_grad()
def label_word_scores(model: torch.nn.Module, shard: Shard, batch_size: int = 16) -> RowScores:
    """Whether each row's label word is the model's pick, and each row's NLL, for every row of `shard`.

    Args:
        model: a float32 Hugging Face causal LM (LoRA/PEFT wrappers work too);
            put in eval mode for the call.
        shard: a classification shard (its sidecar lists `label_token_ids`),
            tokenized with the model's tokenizer.
        batch_size: rows per forward pass.

    Returns:
        RowScores, one entry per row of `shard`.

    Raises:
        ZLError: the shard has no label words, or a row's completion is not one of them.
    """
    candidates = shard.meta.get("label_token_ids")
    if not candidates:
        raise ZLError(
            f"shard {shard.path} has no label words (format {shard.meta.get('format')!r}); label-word accuracy needs a "
            "classification shard (--format text_label, agnews or the demo)."
        )
    candidates = [list(map(int, c)) for c in candidates]
    eos = int(shard.meta["tokenizer"]["eos_token_id"])
    pad = int(shard.meta["tokenizer"]["pad_token_id"])
    decoder, head = decoder_and_head(model)
    was_training = model.training
    model.eval()
    try:
        nll_sums: list[float] = []
        nll_counts: list[int] = []
        # scores[r][c]: summed log-prob of candidate c after row r's prompt; filled in two passes.
        scores: list[list[float | None]] = []
        truth: list[int] = []
        extra: dict[tuple[int, ...], list[tuple[int, int, int]]] = {}  # context -> [(row, candidate, prompt_len)]
        for start in range(0, shard.rows, batch_size):
            ids = shard.input_ids[start : start + batch_size]  # (b, S)
            mask = shard.attention_mask[start : start + batch_size]
            labels = shard.labels[start : start + batch_size]
            tokens, prompt_lens, positions = [], [], []
            for b in range(ids.shape[0]):
                n = int(mask[b].sum())
                target = (labels[b, :n] != IGNORE_INDEX).nonzero().flatten()
                if len(target) == 0 or target[0] == 0:
                    raise ZLError(f"shard {shard.path} row {start + b}: no completion after a prompt; recreate the shard.")
                p = int(target[0])
                tokens.append(ids[b, :n].tolist())
                prompt_lens.append(p)
                positions.append(list(range(p - 1, n - 1)))  # position i predicts token i + 1
            logps = _log_probs_at(decoder, head, ids, mask, positions)
            for b, logp in enumerate(logps):
                row, p = tokens[b], prompt_lens[b]
                completion = row[p:]
                targets = torch.tensor(completion)
                nll_sums.append(-float(logp.gather(1, targets[:, None]).sum()))
                nll_counts.append(len(completion))
                word = completion[:-1] if completion[-1] == eos else completion
                if word not in candidates:
                    raise ZLError(
                        f"shard {shard.path} row {start + b}: completion {word} is not one of the label words "
                        f"{shard.label_words} ({candidates}); the shard is inconsistent, recreate it with `zl data`."
                    )
                truth.append(candidates.index(word))
                row_scores: list[float | None] = []
                for c, cand in enumerate(candidates):
                    if completion[: len(cand) - 1] == cand[:-1]:
                        # The row itself already holds this candidate's context.
                        row_scores.append(sum(float(logp[j, t]) for j, t in enumerate(cand)))
                    else:
                        extra.setdefault(tuple(row[:p] + cand[:-1]), []).append((len(scores), c, p))
                        row_scores.append(None)
                scores.append(row_scores)
        _score_extra(decoder, head, candidates, extra, scores, pad, batch_size)
        correct = [int(max(range(len(candidates)), key=lambda c: row_scores[c]) == truth[r])
                   for r, row_scores in enumerate(scores)]
        return RowScores(correct, nll_sums, nll_counts)
    finally:
        model.train(was_training)


def _score_extra(decoder, head, candidates, extra, scores, pad: int, batch_size: int) -> None:
    """Fill the scores of multi-token candidates whose context differs from the row's own completion."""
    contexts = list(extra)
    for start in range(0, len(contexts), batch_size):
        chunk = contexts[start : start + batch_size]
        width = max(len(c) for c in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.int64)
        mask = torch.zeros((len(chunk), width), dtype=torch.int64)
        positions = []
        for b, ctx in enumerate(chunk):
            ids[b, : len(ctx)] = torch.tensor(ctx)
            mask[b, : len(ctx)] = 1
            p = extra[ctx][0][2]
            positions.append(list(range(p - 1, len(ctx))))
        for ctx, logp in zip(chunk, _log_probs_at(decoder, head, ids, mask, positions)):
            for row, c, _ in extra[ctx]:
                scores[row][c] = sum(float(logp[j, t]) for j, t in enumerate(candidates[c]))
