"""Run an inference program of `zl export-model` on the host with ExecuTorch's Python runtime, and check it.

- `ProgramRunner`: prefill a prompt in one call, then decode token by token from the program's KV cache (the
  calls an ExecuTorch LLM runner makes on the phone); greedy or seeded sampling.
- `compare_with_model`: the program's next-token logits against a PyTorch model's on the same prompts, the NLL of
  each prompt's tokens under both, and whether their greedy continuations agree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zl_base.errors import ZLError
from zl_export.program_record import NEEDED_METHODS


class ProgramRunner:
    """One loaded program (`forward(input_ids (1, S), cache_position (S,)) -> logits (1, S, V)`); with `data_path`,
    the data file holding its base's weights (`zl export-model --shared-base`)."""

    def __init__(self, path: Path | str, data_path: Path | str | None = None):
        import executorch.kernels.quantized  # noqa: F401 (registers quantized_decomposed::embedding_* kernels)
        from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401 (llama::update_cache, custom_sdpa)
        from executorch.runtime import Runtime

        path = Path(path)
        if not path.is_file():
            raise ZLError(f"--program {path}: no such file; pass a .pte written by `zl export-model`.")
        start = time.perf_counter()
        try:
            program = Runtime.get().load_program(str(path), data_path=None if data_path is None else str(data_path))
            missing = [m for m in NEEDED_METHODS if m not in program.method_names]
            if missing:
                raise ZLError(f"--program {path}: the program has no method {', '.join(missing)}, so it is no "
                              "inference program of `zl export-model` (a stage program of `zl export` trains); "
                              "export one with `zl export-model`.")
            self.max_seq_len = int(program.load_method("get_max_seq_len").execute([])[0])
            self.eos_ids = [int(i) for i in program.load_method("get_eos_ids").execute([])]
            self.vocab_size = int(program.load_method("get_vocab_size").execute([])[0])
            self._forward = program.load_method("forward")
        except (RuntimeError, ValueError, KeyError) as e:
            raise ZLError(f"--program {path}: not an inference program of `zl export-model` ({e}); export it "
                          "again.") from e
        self.load_seconds = time.perf_counter() - start
        self.path = path

    def logits(self, ids: list[int], start: int = 0) -> torch.Tensor:
        """Write `ids` into the cache from position `start`; returns their logits (S, V), row i predicting the token
        after ids[i]."""
        if start + len(ids) > self.max_seq_len:
            raise ZLError(f"{self.path}: {start + len(ids)} tokens exceed the program's KV cache of "
                          f"{self.max_seq_len}; export with a larger --max-seq-len or shorten the prompt.")
        out = self._forward.execute([torch.tensor([ids], dtype=torch.int64),
                                     torch.arange(start, start + len(ids), dtype=torch.int64)])[0]
        return out[0]  # (S, V)

    def generate(self, ids: list[int], max_new_tokens: int, eos_id: int | None = None, sample: bool = False,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, on_token=None) -> list[int]:
        """New token ids after the prompt `ids`, cut before the end-of-sequence token; `on_token(id)` per token."""
        eos = {eos_id} if eos_id is not None else set(self.eos_ids)
        budget = min(max_new_tokens, self.max_seq_len - len(ids))
        generator = torch.Generator().manual_seed(seed)
        logits = self.logits(ids)[-1]  # prefill: one call for the whole prompt
        new: list[int] = []
        while len(new) < budget:
            token = _choose(logits, sample, temperature, top_p, generator)
            if token in eos:
                break
            new.append(token)
            if on_token is not None:
                on_token(token)
            if len(new) < budget:
                logits = self.logits([token], len(ids) + len(new) - 1)[-1]
        return new


def _choose(logits: torch.Tensor, sample: bool, temperature: float, top_p: float, generator) -> int:
    """Greedy, or a draw from the top-p nucleus of softmax(logits / temperature) as transformers' sampling."""
    if not sample:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (V,)
    ordered, order = probs.sort(descending=True)
    keep = ordered.cumsum(0) - ordered < top_p  # the smallest prefix whose mass reaches top_p
    ordered[~keep] = 0
    return int(order[torch.multinomial(ordered / ordered.sum(), 1, generator=generator)])


@dataclass
class Comparison:
    """The program against a PyTorch model on some prompts."""

    prompts: int
    max_relative_error: float  # max |program - model| / max |model| over every position's logits
    nll_model: float  # mean NLL (nats per token) of the prompts' own tokens
    nll_program: float
    greedy_agree: int  # prompts whose greedy continuations are identical
    continuations: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (model, program) per prompt
    # The same over the answer tokens only (a row's tokens after its prompt, what training scored); None where no
    # row has a prompt shorter than itself (built-in prompts, plain text).
    answer_nll_model: float | None = None
    answer_nll_program: float | None = None
    answer_tokens: int = 0

    @property
    def nll_change(self) -> float:
        return self.nll_program - self.nll_model

    @property
    def answer_nll_change(self) -> float | None:
        return None if self.answer_tokens == 0 else self.answer_nll_program - self.answer_nll_model


@torch.no_grad()
def compare_with_model(runner: ProgramRunner, model: torch.nn.Module, rows: list[list[int]], max_new_tokens: int,
                       eos_id: int, prompts: list[list[int]] | None = None) -> Comparison:
    """Prefill each row in the program and in `model` (eager, no cache) and compare every position's logits and the
    rows' NLL (over every token, and over the answer tokens: those after a row's prompt); then compare greedy
    continuations of `max_new_tokens` from each prompt (the model's with transformers' `generate`).

    Args:
        rows: token ids, each at least two tokens (the first is not predicted, so the NLL needs a second).
        prompts: where generation starts, one per row (e.g. a row's prompt part, a prefix of the row); default: the
            rows.
    """
    from zl_device.results.generation import generate_ids

    class _Ids:  # what generate_ids needs of a tokenizer
        eos_token_id = pad_token_id = eos_id

    def nll(logits: torch.Tensor, ids: list[int], start: int) -> float:  # of ids[start:], start >= 1
        return float(torch.nn.functional.cross_entropy(logits[start - 1:-1], torch.tensor(ids[start:]),
                                                       reduction="sum"))

    worst, nll_model, nll_program, tokens, agree, pairs = 0.0, 0.0, 0.0, 0, 0, []
    answer_model, answer_program, answer_tokens = 0.0, 0.0, 0
    for ids, prompt in zip(rows, prompts or rows):
        expected = model(torch.tensor([ids])).logits[0]  # (S, V)
        got = runner.logits(ids)
        worst = max(worst, float((got - expected).abs().max() / expected.abs().max()))
        nll_model += nll(expected, ids, 1)
        nll_program += nll(got, ids, 1)
        tokens += len(ids) - 1
        if 1 <= len(prompt) < len(ids) and ids[:len(prompt)] == prompt:
            answer_model += nll(expected, ids, len(prompt))
            answer_program += nll(got, ids, len(prompt))
            answer_tokens += len(ids) - len(prompt)
        (reference,) = generate_ids(model, _Ids, [prompt], max_new_tokens)
        mine = runner.generate(prompt, max_new_tokens, eos_id)
        agree += reference == mine
        pairs.append((reference, mine))
    answers = (answer_model / answer_tokens, answer_program / answer_tokens) if answer_tokens else (None, None)
    return Comparison(len(rows), worst, nll_model / tokens, nll_program / tokens, agree, pairs, *answers,
                      answer_tokens)
