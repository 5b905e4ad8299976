"""`compare_with_model` (zl_device/results/program_runner.py), the check behind `zl export-model`, on a stand-in for
the program: a runner that gives the model's own logits, shifted by a known amount on the answer tokens."""

from __future__ import annotations

import pytest
import torch


class _Runner:
    """A program stand-in: the model's logits, with `shift` added to the true next token's logit at the answer
    positions (so the answer NLL moves and the prompt's does not), and the model's own greedy continuation."""

    def __init__(self, model, prompt_len: int, shift: float):
        self.model, self.prompt_len, self.shift = model, prompt_len, shift

    def logits(self, ids: list[int]) -> torch.Tensor:
        out = self.model(torch.tensor([ids])).logits[0].clone()
        for pos in range(self.prompt_len - 1, len(ids) - 1):
            out[pos, ids[pos + 1]] += self.shift
        return out

    def generate(self, prompt: list[int], max_new_tokens: int, eos_id: int) -> list[int]:
        from zl_device.results.generation import generate_ids

        class _Ids:
            eos_token_id = pad_token_id = eos_id

        return generate_ids(self.model, _Ids, [prompt], max_new_tokens)[0]


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


def _nll(model, ids: list[int], start: int) -> float:
    logits = model(torch.tensor([ids])).logits[0]
    return float(torch.nn.functional.cross_entropy(logits[start - 1:-1], torch.tensor(ids[start:]), reduction="sum"))


@torch.no_grad()
def test_the_answer_nll_is_over_the_tokens_after_the_prompt_only(model):
    from zl_device.results.program_runner import compare_with_model

    rows = [[1, 5, 9, 12, 3, 7, 30, 2], [1, 8, 8, 40, 41, 42, 43, 44]]
    prompts = [row[:4] for row in rows]
    got = compare_with_model(_Runner(model, 4, shift=1.0), model, rows, 3, eos_id=63, prompts=prompts)
    assert got.answer_tokens == 8
    want = sum(_nll(model, row, 4) for row in rows) / 8
    assert got.answer_nll_model == pytest.approx(want, rel=1e-6)
    # The stand-in raised the true token's logit on every answer position: the program's answer NLL is lower.
    assert got.answer_nll_change < -0.1
    # Over every token the same drop is diluted by the 3 prompt tokens a row predicts unchanged.
    assert got.answer_nll_change < got.nll_change < 0
    assert got.greedy_agree == 2


@torch.no_grad()
def test_rows_without_an_answer_have_no_answer_nll(model):
    from zl_device.results.program_runner import compare_with_model

    rows = [[1, 5, 9, 12]]
    got = compare_with_model(_Runner(model, 4, shift=0.0), model, rows, 2, eos_id=63)  # the prompt is the row
    assert got.answer_tokens == 0 and got.answer_nll_model is None and got.answer_nll_change is None
    assert got.nll_change == pytest.approx(0.0, abs=1e-6)


def test_check_rows_below_one_is_refused_before_any_work(tmp_path):
    from zl.commands.export_model import ExportModelArgs
    from zl_base.errors import ZLError

    args = ExportModelArgs(run=tmp_path, out=tmp_path / "m.pte", check_rows=0)
    with pytest.raises(ZLError, match="--check-rows 0: must be at least 1, e.g. --check-rows 8; --no-check skips"):
        args.validate()
