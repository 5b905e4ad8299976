"""The run report's figures: latency breakdown and loss per stage (PNG, matplotlib's Agg canvas).

Figures are drawn on `matplotlib.figure.Figure` with an explicit Agg canvas,
not through pyplot: no global backend is switched and no display is needed.
"""

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

# The parts of a micro-batch's time that the runner measures separately (send overlaps phase 2 with early forwarding).
PHASES = (("phase1_ms", "phase 1 (to the marker)"), ("phase2_ms", "phase 2 (readout, loss, backward)"),
          ("queue_ms", "queue (waiting for input)"))


def plot_latency(stages: list[dict], path: Path) -> Path:
    """Grouped bars: median phase-1 / phase-2 / queue time per stage, whiskers up to the p95. A forward-only stage
    (held still by lr 0) has a phase 2 of 0 ms and says so under its name. Beside them, where the report has it,
    each stage's share of its time busy and waiting (`busy_share`): the pipeline's balance at a glance.

    Args:
        stages: `report["stages"]` (each with `index`, `{median, p95}` per key of PHASES, optional `busy_share`).
        path: the PNG to write.
    """
    shares = [s.get("busy_share") for s in stages]
    with_shares = any(x is not None for x in shares)
    fig = Figure(figsize=(max(5.0, 1.6 * len(stages) + 2.5) + (4.0 if with_shares else 0.0), 4.0), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2, 1) if with_shares else fig.add_subplot()
    if with_shares:
        _plot_busy(fig.add_subplot(1, 2, 2), stages, shares)
    width = 0.8 / len(PHASES)
    for j, (key, label) in enumerate(PHASES):
        xs, medians, above = [], [], []
        for i, stage in enumerate(stages):
            stats = stage[key]
            if stats["median"] is None:
                continue  # not measured: no bar rather than a zero
            xs.append(i + (j - (len(PHASES) - 1) / 2) * width)
            medians.append(stats["median"])
            above.append(max(stats["p95"] - stats["median"], 0.0))
        ax.bar(xs, medians, width, label=label, yerr=[[0.0] * len(above), above], capsize=3)
    ax.set_xticks(range(len(stages)), [_stage_label(s) for s in stages])
    ax.set_ylabel("ms per micro-batch (bar: median, whisker: p95)")
    ax.set_title("Micro-batch time per stage")
    ax.legend(fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return Path(path)


def _plot_busy(ax, stages: list[dict], shares: list[float | None]) -> None:
    """Stacked horizontal bars per stage: busy (phase 1 + phase 2) and waiting, as shares of its span."""
    ys = range(len(stages))
    busy = [x or 0.0 for x in shares]
    ax.barh(ys, busy, color="tab:purple", label="busy (phase 1 + 2)")
    ax.barh(ys, [1.0 - b if x is not None else 0.0 for b, x in zip(busy, shares)], left=busy, color="tab:gray",
            alpha=0.5, label="waiting (input, gradient, link), window ends")
    for y, x in zip(ys, shares):
        ax.text(0.02, y, "n/a" if x is None else f"{x:.0%}", va="center", fontsize="small")
    ax.set_yticks(ys, [f"stage {s['index']}" for s in stages])
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of the stage's time, ready to done")
    ax.set_title("Busy and waiting per stage")
    ax.legend(fontsize="small", loc="lower right")


def plot_loss(curves: dict[int, dict], path: Path) -> Path:
    """Local loss per micro-batch (thin line) and per update window (markers, at the window's last micro-batch).
    A stage without a loss (a forward-only stage, held still by lr 0) has no line.

    Args:
        curves: by stage index, `{"micro_batch", "loss", "window_end", "window_mean_loss"}` lists.
        path: the PNG to write.
    """
    fig = Figure(figsize=(7.0, 4.0), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    drawn = {index: curve for index, curve in sorted(curves.items()) if curve["loss"] or curve["window_end"]}
    for index, curve in drawn.items():
        (line,) = ax.plot(curve["micro_batch"], curve["loss"], linewidth=0.8, alpha=0.5, label=f"stage {index}")
        if curve["window_end"]:
            ax.plot(curve["window_end"], curve["window_mean_loss"], marker="o", markersize=3.5, linewidth=1.5,
                    color=line.get_color(), label=f"stage {index}, window mean")
    ax.set_xlabel("micro-batch")
    ax.set_ylabel("local loss  α·CE + (1−α)·KL")
    ax.set_title("Loss per stage")
    if drawn:
        ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return Path(path)


def _stage_label(stage: dict) -> str:
    layers = stage.get("layers")
    return (f"stage {stage['index']}" + (f"\nlayers {layers[0]}–{layers[1]}" if layers else "")
            + ("\nforward only" if stage.get("forward_only") else ""))
