"""zl_study/accuracy_study.py end to end on tiny-random with tiny budgets: files, tables, plot, cache, bad input.

    .venv/bin/python -m pytest tests/test_accuracy_study.py
"""

import json
from pathlib import Path

import pytest

from zl_base.errors import ZLError
from zl_study import accuracy_study as study_tool
from zl_study import arms

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")]


def _args(demo: Path, out: Path, *extra: str) -> list[str]:
    return ["--model", "tiny-random", "--train", str(demo / "train.safetensors"), "--dev", str(demo / "dev.safetensors"),
            "--samples", "4,8", "--seeds", "0,1", "--num-stages", "2", "--eval-limit", "8", "--threads", "1",
            "--out", str(out), *extra]


ARMS = ["--arms", "base,backprop,backprop-last,zl-paper",
        "--arm", "zl-t:alpha=0.5/1;translator_rank=2;gate=target_prob;stage_lr=1/2;frozen_dtype=int8"]


@pytest.fixture(scope="module")
def study(demo_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    return out, study_tool.run(_args(demo_data, out, *ARMS))


TRAINED = ("backprop", "backprop-last", "zl-paper", "zl-t")


def test_every_arm_budget_and_seed_lands_in_the_files(study):
    out, result = study
    for name in ("study.json", "study.md", "accuracy.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert json.loads((out / "study.json").read_text()) == result
    everything = {(r["arm"], r["samples"], r["seed"]): r for r in result["results"]}
    assert set(everything) == ({(a, s, seed) for a in TRAINED for s in (4, 8) for seed in (0, 1)}
                               | {("base", 4, None), ("base", 8, None)})
    table = (out / "study.md").read_text()
    for (arm, samples, seed), r in everything.items():
        assert 0.0 <= r["accuracy"] <= 1.0 and r["nll"] > 0
        shown = "—" if seed is None else seed
        assert f"| {samples} | {arm} | {shown} | {r['accuracy']:.1%} | {r['nll']:.3f} |" in table, (arm, samples, seed)
        # Every dev row's own result is kept, and adds up to the arm's figures.
        rows = r["rows"]
        assert len(rows["correct"]) == len(rows["nll_sum"]) == len(rows["tokens"]) == result["dev_rows"] == 8
        assert sum(rows["correct"]) / 8 == r["accuracy"]
        assert sum(rows["nll_sum"]) / sum(rows["tokens"]) == pytest.approx(r["nll"])
        if arm != "base":
            assert len(r["window_losses"]) == samples // 4  # window 4: one mean loss per AdamW step
            assert (out / "arms" / f"{samples}-{arm}-seed{seed}.json").is_file()
    assert (out / "arms" / "0-base.json").is_file()
    # The seed moves the LoRA initialisation: the same arm and budget trains differently at seed 0 and seed 1.
    assert everything[("backprop", 8, 0)]["window_losses"] != everything[("backprop", 8, 1)]["window_losses"]
    runs = {(r["arm"], r["samples"]): r for r in result["results"] if r["seed"] in (0, None)}
    for (arm, _), r in runs.items():
        if arm.startswith("zl-"):
            assert len(r["early_exit_accuracy"]) == 2 and r["early_exit_accuracy"][-1] == r["accuracy"]
            assert len(r["window_losses"][0]) == 2  # one loss per stage
    assert runs[("base", 4)]["nll"] == runs[("base", 8)]["nll"]  # the base model is scored once
    # Training moved every trained arm away from the base model.
    assert all(runs[(a, 8)]["nll"] != runs[("base", 8)]["nll"] for a in ("backprop", "backprop-last", "zl-paper", "zl-t"))
    trainable = {a: runs[(a, 8)]["trainable"] for a in ("backprop", "backprop-last", "zl-paper", "zl-t")}
    assert 0 < trainable["backprop-last"] < trainable["backprop"] == trainable["zl-paper"] < trainable["zl-t"]
    # The per-stage options reached the trainer: stage 1 of zl-t has α 1, so its loss is its CE.
    zl_t = runs[("zl-t", 8)]
    assert zl_t["window_losses"][-1][1] == pytest.approx(zl_t["window_task_losses"][-1][1])
    assert "early exit" in table.lower() and "| 8 | zl-t | " in table


def test_the_summary_pairs_every_arm_with_backprop_over_rows_and_seeds(study):
    """Each (budget, arm) has a mean over its seeds and, but for the reference itself, its paired difference to
    backprop; the figures in study.md are those of study.json."""
    out, result = study
    summary = {(r["arm"], r["samples"]): r for r in result["summary"]}
    assert set(summary) == {(a, s) for a in ("base", *TRAINED) for s in (4, 8)}
    table = (out / "study.md").read_text()
    for (arm, samples), row in summary.items():
        mine = [r for r in result["results"] if (r["arm"], r["samples"]) == (arm, samples)]
        assert row["accuracy"] == pytest.approx(sum(r["accuracy"] for r in mine) / len(mine))
        assert row["seeds"] == ([None] if arm == "base" else [0, 1])
        assert f"| {samples} | {arm} | {'—' if arm == 'base' else 2} | {row['accuracy']:.1%} ± " in table
        if arm == "backprop":
            assert "paired" not in row
            continue
        pair = row["paired"]
        ref = {r["seed"]: r for r in result["results"] if (r["arm"], r["samples"]) == ("backprop", samples)}
        if arm == "base":  # scored once, paired with both seeds of backprop
            expected = sum(mine[0]["accuracy"] - ref[s]["accuracy"] for s in (0, 1)) / 2
        else:
            expected = sum(r["accuracy"] - ref[r["seed"]]["accuracy"] for r in mine) / 2
        assert pair["seeds"] == 2 and pair["accuracy_diff"] == pytest.approx(expected)
        lo, hi = pair["accuracy_ci"]
        assert lo <= pair["accuracy_diff"] <= hi
        assert f"{100 * pair['accuracy_diff']:+.1f} pt [{100 * lo:+.1f}, {100 * hi:+.1f}]" in table


def test_a_finished_arm_is_not_trained_again_but_a_changed_setting_is(study, demo_data):
    out, first = study
    stamp = {p.name: p.stat().st_mtime_ns for p in (out / "arms").iterdir()}
    again = study_tool.run(_args(demo_data, out, *ARMS))
    assert again["results"] == first["results"]
    assert {p.name: p.stat().st_mtime_ns for p in (out / "arms").iterdir()} == stamp
    changed = study_tool.run(_args(demo_data, out, "--arms", "base,zl-paper", "--lr", "1e-2"))
    by = {(r["arm"], r["samples"], r["seed"]): r for r in changed["results"]}
    before = {(r["arm"], r["samples"], r["seed"]): r for r in first["results"]}
    assert by[("base", 8, None)] == before[("base", 8, None)]
    for seed in (0, 1):
        new, old = by[("zl-paper", 8, seed)], before[("zl-paper", 8, seed)]
        assert new["fingerprint"] != old["fingerprint"] and new["window_losses"] != old["window_losses"]
    report = study_tool.run(_args(demo_data, out, "--arms", "base,zl-ce,zl-paper", "--report-only"))
    assert {(r["arm"], r["samples"]) for r in report["results"]} == {("base", 4), ("base", 8)}, "nothing trained"


@pytest.mark.parametrize("extra, problem", [
    (["--arms", "zl-nope"], "--arms: unknown arm 'zl-nope'"),
    (["--arm", "zl-x:alpha=1.5"], "--alpha 1.5: α weighs CE against KL"),
    (["--arm", "zl-x:colour=red"], "unknown key 'colour'"),
    (["--arm", "zl-x:frozen_dtype=fp8"], "frozen_dtype 'fp8'; expected one of fp32, bf16, int8"),
    (["--arm", "zl-x:frozen_dtype=int4;embedding_dtype=int2"], "embedding_dtype 'int2'; expected one of fp32, bf16"),
    (["--arm", "zl-x:alpha=0.5/0.5/0.5"], "--alpha 0.5,0.5,0.5: 3 values for 2 stages"),
    (["--samples", "0"], "--samples 0: must be at least 1"),
    (["--seeds", "0,0"], "--seeds 0,0: give distinct seeds"),
    (["--arm", "zl-x:lora_targets=q_proj/w_proj"], "w_proj is not a projection of any supported model"),
    (["--arm", "bp:kind=sgd"], "kind 'sgd'; expected one of zerolock, backprop, backprop-last"),
    (["--arm", "bp:kind=backprop;stage_lr=0/1"], "stage_lr set for a backprop arm; they are ZeroLock settings"),
    (["--arm", "bp:kind=backprop;lr=0"], "lr 0 must be positive"),
    (["--arms", "zl-ce", "--reference", "backprop"], "--reference backprop: not among this study's arms"),
])
def test_bad_options_are_clear_errors(demo_data, tmp_path, extra, problem):
    with pytest.raises(ZLError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        study_tool.run(_args(demo_data, tmp_path, *extra))


def test_an_arm_at_its_own_lr_is_its_own_run_and_can_be_the_reference(demo_data, tmp_path):
    """`kind=backprop;lr=` trains backprop at that peak lr (not the study's --lr), cached apart from the plain arm,
    and `--reference` pairs every other arm with it. A stage held still has no early exit (its readout learnt
    nothing): None, "held still" in study.md."""
    args = _args(demo_data, tmp_path, "--samples", "8", "--seeds", "0", "--arms", "backprop,zl-ce",
                 "--arm", "bp-slow:kind=backprop;lr=1e-4", "--arm", "zl-held:alpha=1;stage_lr=0/1",
                 "--reference", "bp-slow")
    study = study_tool.run(args)
    runs = {r["arm"]: r for r in study["results"]}
    assert runs["bp-slow"]["kind"] == "backprop" and runs["bp-slow"]["fingerprint"] != runs["backprop"]["fingerprint"]
    # The same initialisation and rows: window 0 is the same, the later windows differ by the step size.
    assert runs["bp-slow"]["window_losses"][0] == runs["backprop"]["window_losses"][0]
    assert runs["bp-slow"]["window_losses"][-1] != runs["backprop"]["window_losses"][-1]
    assert study["reference"] == "bp-slow"
    summary = {row["arm"]: row for row in study["summary"]}
    diff = runs["zl-ce"]["accuracy"] - runs["bp-slow"]["accuracy"]
    assert summary["zl-ce"]["paired"]["accuracy_diff"] == pytest.approx(diff) and "paired" not in summary["bp-slow"]
    assert runs["zl-held"]["early_exit_nll"][0] is None and runs["zl-ce"]["early_exit_nll"][0] is not None
    assert summary["zl-held"]["early_exit_accuracy"] == [None, runs["zl-held"]["accuracy"]]
    assert f"| 8 | zl-held | — (held still) | {runs['zl-held']['accuracy']:.1%}" in (tmp_path / "study.md").read_text()


def test_held_out_rows_are_never_trained_on_and_get_their_own_paired_table(demo_data, tmp_path):
    """--held-out N: the last N of each seed's shuffled training rows leave training (the arms train on the rows
    before them, as without the flag) and every trained arm is scored on them too: a second, paired table."""
    from zl_export.shard import load_shard

    train = load_shard(demo_data / "train.safetensors")
    args = _args(demo_data, tmp_path, "--samples", "8", "--seeds", "0,1", "--arms", "base,backprop,zl-ce",
                 "--held-out", "6")
    study = study_tool.run(args)
    runs = {(r["arm"], r["seed"]): r for r in study["results"]}
    assert "held_out" not in runs[("base", None)]  # scored once: no seed, so no held-out rows of its own
    for (arm, seed), r in runs.items():
        if arm == "base":
            continue
        held = r["held_out"]
        assert len(held["rows"]["correct"]) == 6 and sum(held["rows"]["correct"]) / 6 == held["accuracy"]
        assert sum(held["rows"]["nll_sum"]) / sum(held["rows"]["tokens"]) == pytest.approx(held["nll"])
    table = {row["arm"]: row for row in study["held_out_summary"]}
    assert set(table) == {"backprop", "zl-ce"} and study["held_out_rows"] == 6
    assert table["zl-ce"]["paired"]["accuracy_diff"] == pytest.approx(
        sum(runs[("zl-ce", s)]["held_out"]["accuracy"] - runs[("backprop", s)]["held_out"]["accuracy"]
            for s in (0, 1)) / 2)
    assert "## Held-out rows: the last 6 of each seed's shuffled training rows" in (tmp_path / "study.md").read_text()
    # Training itself is what it is without the flag (the first 8 rows either way); only the fingerprint differs.
    plain = study_tool.run(_args(demo_data, tmp_path / "plain", "--samples", "8", "--seeds", "0", "--arms", "zl-ce"))
    assert plain["results"][0]["window_losses"] == runs[("zl-ce", 0)]["window_losses"]
    assert plain["results"][0]["fingerprint"] != runs[("zl-ce", 0)]["fingerprint"]
    with pytest.raises(ZLError, match=f"--held-out {train.rows - 4}: .* hold out at most {train.rows - 8} rows"):
        study_tool.run(_args(demo_data, tmp_path, "--samples", "8", "--seeds", "0", "--arms", "zl-ce",
                             "--held-out", str(train.rows - 4)))


def test_a_data_file_is_tokenized_once_like_zl_train(tmp_path):
    """A .jsonl (not a shard) becomes OUT/data/<split>.safetensors, shuffled with the seed, reused on the next run."""
    rows = [{"text": f"item {i} is here", "label": "odd" if i % 2 else "even"} for i in range(24)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "study"
    args = ["--model", "tiny-random", "--train", str(data), "--dev", str(data), "--samples", "4", "--seq-len", "48",
            "--num-stages", "2", "--threads", "1", "--arms", "base", "--out", str(out)]
    first = study_tool.run(args)
    shard = out / "data" / "train-seed0.safetensors"
    stamp = shard.stat().st_mtime_ns
    from zl_export.shard import load_shard

    loaded = load_shard(shard)
    assert loaded.rows == 24 and loaded.seq_len == 48 and loaded.meta["label_words"]
    assert study_tool.run(args)["results"] == first["results"] and shard.stat().st_mtime_ns == stamp


def test_an_arm_with_lora_settings_of_its_own_trains_more_adapters(demo_data, tmp_path):
    """`lora_targets=` in --arm reaches the ZeroLock trainer and the backprop one; the other arms keep the study's
    --lora-targets."""
    args = ["--model", "tiny-random", "--train", str(demo_data / "train.safetensors"), "--dev",
            str(demo_data / "dev.safetensors"), "--samples", "8", "--seeds", "0", "--num-stages", "2", "--eval-limit",
            "4", "--threads", "1", "--out", str(tmp_path), "--arms", "zl-ce,backprop", "--lora-targets", "q_proj,v_proj",
            "--arm", "zl-wide:alpha=1;translator_rank=0;lora_targets=q_proj/k_proj/v_proj/o_proj",
            "--arm", "bp-wide:kind=backprop;lora_targets=q_proj/k_proj/v_proj/o_proj"]
    runs = {r["arm"]: r for r in study_tool.run(args)["results"]}
    assert runs["zl-wide"]["trainable"] > runs["zl-ce"]["trainable"]
    assert runs["bp-wide"]["trainable"] == 2 * runs["backprop"]["trainable"]  # q,v -> q,k,v,o (k, v: as wide as q)
    # Window 0 runs at the LoRA initialisation (B = 0: the base model either way); window 1 after a step differs.
    assert runs["zl-wide"]["window_losses"][1] != runs["zl-ce"]["window_losses"][1]


def test_generative_data_is_scored_by_nll_and_generations_paired_per_row(tmp_path):
    """A prompt/completion CSV (columns named like AG News headline generation): every arm gets completion NLL,
    greedy generations scored by ROUGE-L and exact match per dev row, paired with backprop; ZeroLock arms get
    each stage's early-exit NLL, the target slots fitted to the longest completion."""
    import csv

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()
    data = tmp_path / "headlines.csv"
    with data.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["title", "description"])
        for i in range(12):
            writer.writerow([" ".join(words[(i + j) % len(words)] for j in range(3 + i * 2)), f"story {i} " * 3])
    out = tmp_path / "study"
    args = ["--model", "tiny-random", "--train", str(data), "--dev", str(data), "--format", "prompt_completion",
            "--prompt-template", "Article: {description}\\nHeadline:", "--completion-column", "title",
            "--samples", "4", "--seeds", "0,1", "--seq-len", "64", "--num-stages", "2", "--threads", "1",
            "--eval-limit", "6", "--arms", "base,backprop,zl-ce,zl-default", "--out", str(out)]
    result = study_tool.run(args)
    assert result["metric"] == "rouge_l"
    arms = {a["name"]: a for a in result["arms"]}
    assert arms["zl-default"]["stage_lr"] == [0.0, 1.0]  # zl train's default
    runs = {(r["arm"], r["seed"]): r for r in result["results"]}
    for r in runs.values():
        assert r["accuracy"] is None and 0 <= r["rouge_l"] <= 1 and r["nll"] > 0
        assert len(r["rows"]["rouge_l"]) == len(r["rows"]["exact"]) == len(r["rows"]["nll_sum"]) == 6
        assert r["rouge_l"] == pytest.approx(sum(r["rows"]["rouge_l"]) / 6)
        assert r["nll"] == pytest.approx(sum(r["rows"]["nll_sum"]) / sum(r["rows"]["tokens"]), rel=1e-5)
    zl = runs[("zl-ce", 0)]
    assert len(zl["early_exit_nll"]) == 2 and zl["early_exit_nll"][-1] == zl["nll"]
    summary = {r["arm"]: r for r in result["summary"]}
    assert "rouge_l_diff" in summary["zl-ce"]["paired"] and "nll_ratio" in summary["zl-ce"]["paired"]
    assert summary["zl-ce"]["rouge_l"] == pytest.approx((runs[("zl-ce", 0)]["rouge_l"] + runs[("zl-ce", 1)]["rouge_l"]) / 2)
    md = (out / "study.md").read_text()
    assert "| ROUGE-L (F × 100) |" in md and "## Generations" in md and "reference:" in md


def test_a_prompt_templates_newline_typed_or_escaped_is_one_study(tmp_path):
    """`--prompt-template "A\\nB"` and the same with a real newline render the same prompts (render_template expands
    the escape), so a seed run with either spelling joins the others' table; another template does not."""
    data = tmp_path / "rows.csv"
    data.write_text("title,description\nt,d\n")
    common = ["--train", str(data), "--dev", str(data), "--format", "prompt_completion", "--completion-column", "title"]

    def fingerprint(template: str) -> str:
        s, found = study_tool.build(study_tool.parse_args([*common, "--prompt-template", template, "--arms", "async"]))
        return s.fingerprint(found[0], 1024, 2)

    escaped = fingerprint("Article: {description}\\nHeadline:")
    assert fingerprint("Article: {description}\nHeadline:") == escaped
    assert fingerprint("Article: {description} Headline:") != escaped


def test_zl_default_is_zl_trains_default():
    """`zl train` holds the stages before the last still (--stage-lr 0,..,0,1), so the study's zl-default does too,
    on the study's split; zl-all-stages keeps every stage training with the same loss and frozen dtype."""
    default, every = arms.ARMS["zl-default"], arms.ARMS["zl-all-stages"]
    resolved = arms.default_arm_for(default, 3)
    assert resolved.stage_lr == (0.0, 0.0, 1.0) and resolved.loss == default.loss
    assert resolved.frozen_dtype == default.frozen_dtype and "stage lr 0/0/1" in resolved.note
    assert arms.default_arm_for(default, 2).stage_lr == (0.0, 1.0)
    assert arms.default_arm_for(every, 3) == every and every.loss == default.loss and every.stage_lr == (1.0,)


def test_the_async_arm_is_backprop_on_stashed_weight_versions(demo_data, tmp_path):
    """kind async trains backprop's LoRA on the asynchronous schedule: the first window (no step taken yet) is
    backprop's to the bit; after it, stage 0 runs a micro-batch per window on weights one step old, so the losses
    part (window 4, 2 stages: micro-batch 4 of window 1 on stage 0's version 0). With `frozen_dtype=int4` the same
    schedule trains over int4 frozen weights (the issue-53 study of a 4-bit base under async)."""
    args = ["--model", "tiny-random", "--train", str(demo_data / "train.safetensors"), "--dev",
            str(demo_data / "dev.safetensors"), "--samples", "12", "--seeds", "0", "--num-stages", "2",
            "--eval-limit", "4", "--threads", "1", "--out", str(tmp_path), "--arms", "backprop,async",
            "--arm", "async-int4:kind=async;frozen_dtype=int4",
            "--arm", "async-int4-emb:kind=async;frozen_dtype=int4;embedding_dtype=bf16"]
    runs = {r["arm"]: r for r in study_tool.run(args)["results"]}
    sync, stale = runs["backprop"]["window_losses"], runs["async"]["window_losses"]
    assert len(sync) == len(stale) == 3
    assert stale[0] == sync[0]
    assert stale[1:] != sync[1:]
    assert runs["async"]["trainable"] == runs["backprop"]["trainable"] == runs["async-int4"]["trainable"]
    int4 = runs["async-int4"]["window_losses"]
    assert len(int4) == 3 and int4[0] != stale[0]  # other frozen weights, the same LoRA init and rows
    assert int4[0][-1] == pytest.approx(stale[0][-1], rel=0.1)  # the last stage's first window: close, not equal
    # --embedding-dtype bf16: the same int4 layers, other tables, so other losses from the first window on
    mixed = runs["async-int4-emb"]
    assert mixed["window_losses"][0] != int4[0] and mixed["fingerprint"] != runs["async-int4"]["fingerprint"]
