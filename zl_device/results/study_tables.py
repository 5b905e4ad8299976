"""The tables and the plot of tools/accuracy_study.py: per budget and arm, the mean ± standard error over seeds,
the paired difference to the reference arm (zl_device/results/comparison.py), times, and early-exit figures.

`results` are the study's arm records: arm, samples, seed (None for the base model), accuracy, nll, train_s,
eval_s, wall_s, rows (each dev row's correct / nll_sum / tokens) and, for ZeroLock, early_exit_accuracy/_nll.
"""

from __future__ import annotations

from pathlib import Path

from zl_device.results.comparison import Scored, paired, summarize


def _scored(r: dict) -> Scored:
    rows = r["rows"]
    return Scored(r.get("seed"), tuple(rows["correct"]), tuple(rows["nll_sum"]), tuple(rows["tokens"]))


def summary_table(results: list[dict], reference: str) -> list[dict]:
    """Per (budget, arm): mean ± SE over the seeds, the paired difference to `reference`, mean times, and the
    early-exit figures averaged over the seeds."""
    rows = []
    for samples in sorted({r["samples"] for r in results}):
        at = [r for r in results if r["samples"] == samples]
        ref = [_scored(r) for r in at if r["arm"] == reference]
        for arm in dict.fromkeys(r["arm"] for r in at):
            mine = [r for r in at if r["arm"] == arm]
            scored = [_scored(r) for r in mine]
            row = {"arm": arm, "samples": samples, **summarize(scored).to_dict(),
                   "seeds": [r.get("seed") for r in mine],  # the seeds themselves, not only their count
                   "train_s": _mean_of(mine, "train_s"), "eval_s": _mean_of(mine, "eval_s"),
                   "wall_s": _mean_of(mine, "wall_s"),
                   "per_seed_accuracy": [r["accuracy"] for r in mine]}
            if ref and arm != reference:
                pair = paired(scored, ref)
                row["paired"] = pair.to_dict() if pair else None
            exits = [r["early_exit_accuracy"] for r in mine if r.get("early_exit_accuracy")]
            if exits:
                row["early_exit_accuracy"] = [sum(x) / len(x) for x in zip(*exits)]
                row["early_exit_nll"] = [sum(x) / len(x) for x in zip(*(r["early_exit_nll"] for r in mine))]
            rows.append(row)
    return rows


def _mean_of(results: list[dict], key: str) -> float | None:
    values = [r[key] for r in results if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def _seconds(x: float | None) -> str:
    return "—" if x is None else f"{x:,.0f}"


def markdown(study: dict) -> str:
    """The summary per budget and arm (mean ± SE, paired difference to the reference, times), then the
    early-exit figures per stage, then every seed's accuracy."""
    s = study["settings"]
    ref = study["reference"]
    lines = [f"# Accuracy study: {s['model']}, stages {study['stages']}", "",
             f"{study['train_rows']} train rows ({s['train']}), {study['dev_rows']} dev rows ({s['dev']}); "
             f"seq {s['seq_len']}, window {s['window']}, micro-batch {s['micro_batch']}, lr {s['lr']}, "
             f"LoRA r={s['lora']['rank']} on {','.join(s['lora']['targets'])}, seeds "
             f"{', '.join(map(str, s['seeds']))}.", "",
             f"## Dev accuracy and NLL per label token (mean ± SE over seeds), paired difference to `{ref}`", "",
             f"Δ: the arm minus `{ref}` on the same rows and seeds, with a 95% interval over rows and seeds; "
             "NLL ratio: the arm's NLL / the reference's. Times: seconds per seed.", "",
             "| samples | arm | seeds | accuracy | Δ accuracy [95% CI] | NLL | Δ NLL [95% CI] | NLL ratio "
             "| train s | scoring s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in study["summary"]:
        pair = r.get("paired")
        if pair:
            lo, hi = pair["accuracy_ci"]
            nlo, nhi = pair["nll_ci"]
            delta = f"{100 * pair['accuracy_diff']:+.1f} pt [{100 * lo:+.1f}, {100 * hi:+.1f}]"
            nll_delta = f"{pair['nll_diff']:+.3f} [{nlo:+.3f}, {nhi:+.3f}]"
            ratio = f"{pair['nll_ratio']:.3f}"
        else:
            delta = nll_delta = ratio = "—"
        seeds = "—" if r["seeds"] == [None] else str(len(r["seeds"]))
        lines.append(f"| {r['samples']} | {r['arm']} | {seeds} | {r['accuracy']:.1%} ± {100 * r['accuracy_se']:.1f} "
                     f"| {delta} | {r['nll']:.3f} ± {r['nll_se']:.3f} | {nll_delta} | {ratio} "
                     f"| {_seconds(r['train_s'])} | {_seconds(r['eval_s'])} |")
    exits = [r for r in study["summary"] if r.get("early_exit_accuracy")]
    if exits:
        width = len(exits[0]["early_exit_accuracy"])
        lines += ["", "## Early exit: each stage's readout as the classifier (ZeroLock arms, mean over seeds)", "",
                  "| samples | arm | " + " | ".join(f"stage {k}" for k in range(width)) + " |",
                  "|---|---|" + "---|" * width]
        for r in exits:
            cells = [f"{a:.1%} ({n:.3f})" for a, n in zip(r["early_exit_accuracy"], r["early_exit_nll"])]
            lines.append(f"| {r['samples']} | {r['arm']} | " + " | ".join(cells) + " |")
    lines += ["", "## Accuracy of every seed", "", "| samples | arm | seed | accuracy | NLL | train s |",
              "|---|---|---|---|---|---|"]
    for r in study["results"]:
        seed = "—" if r.get("seed") is None else r["seed"]
        lines.append(f"| {r['samples']} | {r['arm']} | {seed} | {r['accuracy']:.1%} | {r['nll']:.3f} "
                     f"| {_seconds(r.get('train_s'))} |")
    notes = {a["name"]: a["note"] for a in study["arms"]}
    lines += ["", "## Arms", ""] + [f"- `{n}`: {notes.get(n, '')}"
                                    for n in dict.fromkeys(r["arm"] for r in study["results"])]
    return "\n".join(lines) + "\n"


def plot(study: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm in dict.fromkeys(r["arm"] for r in study["summary"]):
        points = sorted((r["samples"], r["accuracy"], r["accuracy_se"]) for r in study["summary"] if r["arm"] == arm)
        ax.errorbar([p[0] for p in points], [p[1] for p in points], yerr=[p[2] for p in points], marker="o",
                    capsize=3, label=arm, linestyle="--" if arm.startswith(("base", "backprop")) else "-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("training samples")
    ax.set_ylabel("dev accuracy (mean ± SE over seeds)")
    ax.set_title(f"{study['settings']['model']}: dev accuracy per arm")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
