"""The tables and the plot of the accuracy study (zl_study/accuracy_study.py): per budget and arm, the mean ±
standard error over seeds, the paired difference to the reference arm (zl_study/comparison.py), times, and
early-exit figures.

`results` are the study's arm records: arm, samples, seed (None for the base model), accuracy, nll, train_s,
eval_s, wall_s, rows (each dev row's correct / nll_sum / tokens) and, for ZeroLock, early_exit_accuracy/_nll
(None for a stage held still: not scored); with the study's --held-out, `held_out` holds the same scores on each
seed's held-out training rows (tabulated as a second table).

The per-row score is the study's metric: label-word accuracy (`correct`, 0 or 1) on classification data, ROUGE-L
F-measure of the greedy generation (`rouge_l`, in [0, 1]) on generative data, where records also carry each
row's exact match (`exact`). The summary keys are named after the metric (`accuracy`, `accuracy_se`,
`accuracy_diff`... or `rouge_l`, `rouge_l_se`, `rouge_l_diff`...); the paired arithmetic is the same.
"""

from __future__ import annotations

from pathlib import Path

from zl_study.comparison import Scored, paired, summarize


METRICS = {"accuracy": "accuracy", "rouge_l": "ROUGE-L"}  # the per-row score's key in `rows` -> its name
_ROW_KEY = {"accuracy": "correct", "rouge_l": "rouge_l"}


def _scored(r: dict, metric: str = "accuracy") -> Scored:
    rows = r["rows"]
    return Scored(r.get("seed"), tuple(rows[_ROW_KEY[metric]]), tuple(rows["nll_sum"]), tuple(rows["tokens"]))


def _named(d: dict, metric: str) -> dict:
    """`accuracy*` keys of comparison.py's records renamed after `metric`."""
    return {k.replace("accuracy", metric, 1) if k.startswith("accuracy") else k: v for k, v in d.items()}


def _fmt(metric: str, x: float) -> str:
    """Accuracy as a percentage, ROUGE-L in points (F-measure × 100)."""
    return f"{x:.1%}" if metric == "accuracy" else f"{100 * x:.1f}"


def summary_table(results: list[dict], reference: str, metric: str = "accuracy") -> list[dict]:
    """Per (budget, arm): mean ± SE over the seeds of `metric` and NLL, the paired difference to `reference`,
    mean times, and the early-exit figures averaged over the seeds."""
    rows = []
    for samples in sorted({r["samples"] for r in results}):
        at = [r for r in results if r["samples"] == samples]
        ref = [_scored(r, metric) for r in at if r["arm"] == reference]
        for arm in dict.fromkeys(r["arm"] for r in at):
            mine = [r for r in at if r["arm"] == arm]
            scored = [_scored(r, metric) for r in mine]
            row = {"arm": arm, "samples": samples, **_named(summarize(scored).to_dict(), metric),
                   "seeds": [r.get("seed") for r in mine],  # the seeds themselves, not only their count
                   "train_s": _mean_of(mine, "train_s"), "eval_s": _mean_of(mine, "eval_s"),
                   "wall_s": _mean_of(mine, "wall_s"),
                   f"per_seed_{metric}": [r[metric] for r in mine]}
            if metric != "accuracy":
                row["exact_match"] = _mean_of(mine, "exact_match")
            if ref and arm != reference:
                pair = paired(scored, ref)
                row["paired"] = _named(pair.to_dict(), metric) if pair else None
            if any(r.get("early_exit_nll") for r in mine):
                with_exits = [r for r in mine if r.get("early_exit_nll")]
                row["early_exit_nll"] = [_mean(x) for x in zip(*(r["early_exit_nll"] for r in with_exits))]
                if metric == "accuracy":
                    row["early_exit_accuracy"] = [_mean(x) for x in zip(*(r["early_exit_accuracy"] for r in with_exits))]
            rows.append(row)
    return rows


def _mean(values) -> float | None:
    """The mean of the values that are there (an early exit of a stage held still is None: not scored)."""
    there = [v for v in values if v is not None]
    return sum(there) / len(there) if there else None


def _mean_of(results: list[dict], key: str) -> float | None:
    values = [r[key] for r in results if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def _seconds(x: float | None) -> str:
    return "—" if x is None else f"{x:,.0f}"


def markdown(study: dict) -> str:
    """The summary per budget and arm (mean ± SE, paired difference to the reference, times), then the
    early-exit figures per stage, then every seed's figures (and, for generative data, generations)."""
    s = study["settings"]
    ref = study["reference"]
    metric = study.get("metric", "accuracy")
    name = METRICS[metric]
    what = "Dev accuracy and NLL per label token" if metric == "accuracy" else \
        "Dev ROUGE-L of greedy generations and completion NLL per token"
    lines = [f"# Accuracy study: {s['model']}, stages {study['stages']}", "",
             f"{study['train_rows']} train rows ({s['train']}), {study['dev_rows']} dev rows ({s['dev']}); "
             f"seq {s['seq_len']}, window {s['window']}, micro-batch {s['micro_batch']}, lr {s['lr']}, "
             f"LoRA r={s['lora']['rank']} on {','.join(s['lora']['targets'])}, seeds "
             f"{', '.join(map(str, s['seeds']))}.", "",
             f"## {what} (mean ± SE over seeds), paired difference to `{ref}`", "",
             f"Δ: the arm minus `{ref}` on the same rows and seeds, with a 95% interval over rows and seeds; "
             "NLL ratio: the arm's NLL / the reference's. Times: seconds per seed.", ""]
    lines += _summary_lines(study["summary"], metric)
    if study.get("held_out_summary"):
        lines += ["", f"## Held-out rows: the last {study['held_out_rows']} of each seed's shuffled training rows", "",
                  "Rows no arm trained on and no choice was made on (each seed holds out its own rows; the arms of "
                  f"one seed are paired on the same ones). Δ: the arm minus `{ref}`. Scoring s: on these rows.", ""]
        lines += _summary_lines(study["held_out_summary"], metric)
    exits = [r for r in study["summary"] if r.get("early_exit_nll")]
    if exits:
        width = len(exits[0]["early_exit_nll"])
        title = ("each stage's readout as the classifier: accuracy (NLL)" if metric == "accuracy"
                 else "completion NLL per token of each stage's readout")
        lines += ["", f"## Early exit: {title} (ZeroLock arms, mean over seeds)", "",
                  "| samples | arm | " + " | ".join(f"stage {k}" for k in range(width)) + " |",
                  "|---|---|" + "---|" * width]
        for r in exits:
            if metric == "accuracy":
                cells = ["— (held still)" if n is None else f"{a:.1%} ({n:.3f})"
                         for a, n in zip(r["early_exit_accuracy"], r["early_exit_nll"])]
            else:
                cells = ["— (held still)" if n is None else f"{n:.3f}" for n in r["early_exit_nll"]]
            lines.append(f"| {r['samples']} | {r['arm']} | " + " | ".join(cells) + " |")
    lines += ["", f"## {name[0].upper() + name[1:]} of every seed", "", f"| samples | arm | seed | {name} | NLL | train s |",
              "|---|---|---|---|---|---|"]
    for r in study["results"]:
        seed = "—" if r.get("seed") is None else r["seed"]
        lines.append(f"| {r['samples']} | {r['arm']} | {seed} | {_fmt(metric, r[metric])} | {r['nll']:.3f} "
                     f"| {_seconds(r.get('train_s'))} |")
    for sample in study.get("generations", []):
        if sample is study["generations"][0]:
            lines += ["", "## Generations (first dev rows, first seed)", ""]
        lines += [f"**Row {sample['row']}.** Prompt: {_quote(sample['prompt'])}", "",
                  f"- reference: {_quote(sample['reference'])}"]
        lines += [f"- `{k}`: {_quote(v)}" for k, v in sample.items() if k not in ("row", "prompt", "reference")]
        lines.append("")
    notes = {a["name"]: a["note"] for a in study["arms"]}
    lines += ["", "## Arms", ""] + [f"- `{n}`: {notes.get(n, '')}"
                                    for n in dict.fromkeys(r["arm"] for r in study["results"])]
    return "\n".join(lines) + "\n"


def _summary_lines(summary: list[dict], metric: str) -> list[str]:
    """The markdown table of summary_table's rows: mean ± SE, the paired difference to the reference, times."""
    name = METRICS[metric]
    unit = "" if metric == "accuracy" else " (F × 100)"
    lines = [f"| samples | arm | seeds | {name}{unit} | Δ {name} [95% CI] | NLL | Δ NLL [95% CI] | NLL ratio "
             + ("| exact match " if metric != "accuracy" else "") + "| train s | scoring s |",
             "|---|---|---|---|---|---|---|---|" + ("---|" if metric != "accuracy" else "") + "---|---|"]
    points = "pt" if metric == "accuracy" else ""
    for r in summary:
        pair = r.get("paired")
        if pair:
            lo, hi = pair[f"{metric}_ci"]
            nlo, nhi = pair["nll_ci"]
            delta = f"{100 * pair[f'{metric}_diff']:+.1f} {points} [{100 * lo:+.1f}, {100 * hi:+.1f}]".replace("  ", " ")
            nll_delta = f"{pair['nll_diff']:+.3f} [{nlo:+.3f}, {nhi:+.3f}]"
            ratio = f"{pair['nll_ratio']:.3f}"
        else:
            delta = nll_delta = ratio = "—"
        seeds = "—" if r["seeds"] == [None] else str(len(r["seeds"]))
        exact = f"| {r['exact_match']:.1%} " if metric != "accuracy" else ""
        lines.append(f"| {r['samples']} | {r['arm']} | {seeds} | {_fmt(metric, r[metric])} ± "
                     f"{100 * r[f'{metric}_se']:.1f} | {delta} | {r['nll']:.3f} ± {r['nll_se']:.3f} | {nll_delta} "
                     f"| {ratio} {exact}| {_seconds(r['train_s'])} | {_seconds(r['eval_s'])} |")
    return lines


def _quote(text: str) -> str:
    """One line of model text for a markdown list: line breaks shown as ⏎, at most 300 characters."""
    flat = text.replace("\n", " ⏎ ").strip()
    return (flat[:300] + "…") if len(flat) > 300 else flat


def plot(study: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = study.get("metric", "accuracy")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm in dict.fromkeys(r["arm"] for r in study["summary"]):
        points = sorted((r["samples"], r[metric], r[f"{metric}_se"]) for r in study["summary"] if r["arm"] == arm)
        ax.errorbar([p[0] for p in points], [p[1] for p in points], yerr=[p[2] for p in points], marker="o",
                    capsize=3, label=arm, linestyle="--" if arm.startswith(("base", "backprop")) else "-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("training samples")
    ax.set_ylabel(f"dev {METRICS[metric]} (mean ± SE over seeds)")
    ax.set_title(f"{study['settings']['model']}: dev {METRICS[metric]} per arm")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def ratio_line(label: str, subject: dict, other: dict, rate: str, memory: str, memory_name: str) -> str:
    """One line of a benchmark's side-by-side ratios: `subject`'s `rate` over `other`'s, and its per-stage `memory`
    list over the other's element by element ("-" where either is missing)."""
    mem = " / ".join(f"{x / y:.2f}" if x and y else "-" for x, y in zip(subject[memory], other[memory]))
    return f"{label}: records/s {subject[rate] / other[rate]:.2f}x, {memory_name} {mem}x"
