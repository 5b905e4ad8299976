"""`zl eval` on prompt/completion data (issue 26 item 3): completion NLL and perplexity, greedy generations scored
by exact match and ROUGE-L, a sample side by side in eval.json and report.md, and the same at the end of `zl train`."""

import json
import math
import re
from types import SimpleNamespace

import pytest
import torch
import typer
from typer.testing import CliRunner

from zl.commands.eval import eval_command
from zl_base.errors import ZLError
from zl_device.results.evaluate import GenerationEval, eval_record, evaluate, evaluate_with_adapter
from zl_device.results.generation import MARGIN_TOKENS, exact_match, rouge_l, split_row
from zl_export.model_source import load_model

from generative_fixtures import ROWS, memorized_adapter, prompt_completion_shard

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning"),  # PEFT calls a deprecated transformers API
    pytest.mark.usefixtures("one_torch_thread"),
]


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    return prompt_completion_shard(tmp_path_factory.mktemp("pc"))


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, shard):
    return memorized_adapter(tmp_path_factory.mktemp("memorized") / "adapter", shard)


def greedy_reference(model, prompt: list[int], budget: int, eos: int) -> list[int]:
    """Greedy decoding written out: full forward pass, argmax of the last position, until eos or the budget."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(budget):
            token = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            if token == eos:
                break
            ids.append(token)
    return ids[len(prompt):]


def test_generative_figures_nll_perplexity_and_generations(shard):
    loaded = load_model("tiny-random")
    seen = []
    result = evaluate(loaded.model, shard, batch_size=3, generation=GenerationEval(loaded.tokenizer, on_batch=seen.append))
    with torch.no_grad():
        ref = float(loaded.model(input_ids=shard.input_ids, attention_mask=shard.attention_mask, labels=shard.labels).loss)
    assert result.accuracy is None and result.nll == pytest.approx(ref, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(result.nll), rel=1e-9)
    assert result.generated_rows == shard.rows == len(result.generations) and seen == [3, 1]
    assert 0.0 <= result.exact_match <= 1.0 and 0.0 <= result.rouge_l <= 1.0
    # Each row's text is greedy decoding from its prompt, batched with left padding, cut at its own budget.
    for r in range(shard.rows):
        prompt, completion = split_row(shard, r)
        expected = greedy_reference(loaded.model, prompt, len(completion) + 1 + MARGIN_TOKENS, loaded.tokenizer.eos_token_id)
        assert result.generations[r] == loaded.tokenizer.decode(expected), r
    fixed = evaluate(loaded.model, shard, batch_size=4, generation=GenerationEval(loaded.tokenizer, rows=2, max_new_tokens=3))
    assert fixed.generated_rows == 2
    for r, text in enumerate(fixed.generations):  # --max-new-tokens: the same budget for every row
        expected = greedy_reference(loaded.model, split_row(shard, r)[0], 3, loaded.tokenizer.eos_token_id)
        assert text == loaded.tokenizer.decode(expected) != result.generations[r]
    assert evaluate(loaded.model, shard, generation=GenerationEval(loaded.tokenizer, rows=0)).exact_match is None


def test_a_row_without_a_completion_is_named(shard):
    from zl_export.scoring import IGNORE_INDEX
    from zl_export.shard import Shard

    labels = shard.labels.clone()
    labels[2] = IGNORE_INDEX
    broken = Shard(shard.path, shard.input_ids, shard.attention_mask, labels, shard.meta)
    with pytest.raises(ZLError, match=r"row 2: no completion after a prompt"):
        evaluate(load_model("tiny-random").model, broken, batch_size=2)


def test_a_memorizing_adapter_changes_the_generations_and_scores_them(shard, adapter):
    loaded = load_model("tiny-random")
    generation = GenerationEval(loaded.tokenizer)
    results = evaluate_with_adapter(loaded.model, shard, adapter, batch_size=4, generation=generation)
    base, tuned = results["base"], results["adapter"]
    references = [r["completion"] for r in ROWS]
    assert tuned.generations == references and (tuned.exact_match, tuned.rouge_l) == (1.0, 1.0)
    assert base.generations != tuned.generations and base.exact_match == 0.0 and base.rouge_l < 0.5
    assert tuned.nll < base.nll and tuned.perplexity < base.perplexity

    record = eval_record(results, shard, generation, samples=3)
    assert record["generation"] == {"decoding": "greedy", "rows": 4, "max_new_tokens": None, "margin_tokens": MARGIN_TOKENS}
    assert [s["row"] for s in record["samples"]] == [0, 1, 2]
    for s, row, base_text in zip(record["samples"], ROWS, base.generations):
        assert s == {"row": s["row"], "prompt": row["prompt"], "reference": row["completion"], "base": base_text,
                     "adapter": row["completion"]}
    assert record["adapter"]["perplexity"] == pytest.approx(math.exp(record["adapter"]["nll"]))
    assert "generations" not in record["base"]
    json.dumps(record)  # eval.json-ready


def test_rouge_l_and_exact_match():
    assert rouge_l("the cat sat", "the cat sat down") == pytest.approx(2 * 0.75 / 1.75)  # LCS 3: P 1, R 0.75
    assert rouge_l("The Cat, sat!", "the cat sat") == 1.0  # case and punctuation do not count
    assert rouge_l("café crème", "café noir") == pytest.approx(0.5)  # non-ASCII words are words
    assert rouge_l("", "blue") == 0.0 and rouge_l("red", "blue") == 0.0
    assert exact_match(" blue\n", "blue") and not exact_match("Blue", "blue")


def _app() -> typer.Typer:
    app = typer.Typer(add_completion=False)
    app.command("eval")(eval_command)
    app.command("unused")(lambda: None)  # two commands, so `eval` is a subcommand as in `zl`
    return app


def test_cli_eval_prints_and_writes_the_generative_figures(shard, adapter, tmp_path):
    out = tmp_path / "eval.json"
    args = ["eval", "--adapter", str(adapter), "--data", str(shard.path), "--samples", "2", "--json-out", str(out)]
    result = CliRunner().invoke(_app(), args)  # the model comes from the adapter's adapter_config.json
    assert result.exit_code == 0, result.output
    assert re.search(r"perplexity\s+│\s+[\d.]+\s+│\s+[\d.]+\s+│\s+-[\d.]+", result.stdout)
    assert re.search(r"exact match\s+│\s+0\.000\s+│\s+1\.000\s+│\s+\+1\.000", result.stdout)
    assert re.search(r"ROUGE-L\s+│\s+[\d.]+\s+│\s+1\.000", result.stdout)
    assert "generations of the first 2 rows" in result.stdout and "colour of the sky?" in result.stdout
    report = json.loads(out.read_text())
    assert report["model"] == "tiny-random" and report["results"]["adapter"]["exact_match"] == 1.0
    assert [s["adapter"] for s in report["samples"]] == [" blue", " apple"]
    base = report["results"]["base"]
    assert base["perplexity"] == pytest.approx(math.exp(base["nll"])) and base["generated_rows"] == 4

    for bad, message in ((["--generate-rows", "-1"], "--generate-rows -1: must be 0"),
                         (["--max-new-tokens", "0"], "--max-new-tokens 0: must be at least 1"),
                         (["--samples", "-2"], "--samples -2: must be 0")):
        result = CliRunner().invoke(_app(), ["eval", "--model", "tiny-random", "--data", str(shard.path), *bad])
        assert isinstance(result.exception, ZLError) and message in str(result.exception)


def test_train_runs_the_generative_eval_and_the_report_shows_it(shard, adapter, tmp_path):
    from test_report import merged_run
    from zl_device.results.report import write_report
    from zl_device.run.train_job import RunModel, evaluate_run

    run_dir = merged_run(tmp_path)
    (run_dir / "adapter").symlink_to(adapter, target_is_directory=True)
    said = []
    result = evaluate_run(SimpleNamespace(eval_limit=None), RunModel("tiny-random", 0), run_dir, shard.path, said.append)
    assert re.fullmatch(r"eval on 4 dev rows: NLL [\d.]+ -> [\d.]+ nats/token, perplexity [\d.]+ -> [\d.]+, "
                        r"ROUGE-L [\d.]+ -> 1\.000, exact match 0\.0% -> 100\.0%", said[0]), said
    saved = json.loads((run_dir / "eval.json").read_text())
    assert saved == json.loads(json.dumps(result)) and saved["adapter"]["exact_match"] == 1.0
    assert len(saved["samples"]) == 4 and saved["samples"][3]["adapter"] == " cold"

    report = write_report(run_dir, plots=False)
    assert report["eval"]["results"]["adapter"]["rouge_l"] == 1.0 and len(report["eval"]["samples"]) == 4
    md = (run_dir / "report.md").read_text()
    assert "## Evaluation" in md and "| exact match | 0.000 | 1.000 | +1.000 |" in md
    assert "| 0 | Q: colour of the sky?<br>A: |  blue | " in md and md.count(" |  blue |") == 2  # reference, adapter
    assert "### Sample generations" in md and "rouge-score" in md
