"""The run report (docs/design#run-outputs): `report.json`, `report.md` and `plots/` from a run's telemetry.

`build_report(run_dir)` returns the report as a dict; `write_report(run_dir)`
writes `report.json`, `report.md`, `plots/latency.png` and `plots/loss.png`
into the run directory. The telemetry layouts and every line kind, including
the coordinator's recovery events, are described in `zl_device.formats.metrics_log`.

What the numbers mean:

- `stages[i].{phase1,phase2,queue,send,total}_ms`: `{"median", "p95"}` over the
  stage's micro-batches, as `numpy.median` and `numpy.percentile(x, 95)`
  (linear interpolation) compute them; null values (unmeasured) are left out,
  and a statistic of no values is null.
- `stages[i].forward_only`: the stage was held still by lr 0 and ran phase 1
  only (docs/design#windows-and-adamw; `MetricsLog.forward_only`). Its lines' phase2_ms
  are 0, so are its phase-2 statistics (its busy time is phase 1 + send), and
  it has no losses; report.md says "held still (lr 0), forward only" instead
  of empty loss columns.
- A micro-batch that a restarted stage replays appears twice in its
  telemetry. Latency and loss use the **last** line per (stage, micro-batch),
  the run whose gradients went into the committed window; the earlier lines
  are counted in `replayed_micro_batches` and left out of the statistics.
  Window lines likewise keep the last line per (stage, window).
- `stages[i].busy_share`: the stage's phase 1 + phase 2 time (every micro-batch line, replays included) over
  its span: from each runner start's `ready_unix_ms` (program loaded, links up; else its first micro-batch's
  start) to that run's last line, summed over its runs. The rest of the span is waiting: for input, for a
  gradient, on a full link, and the window ends. Null without micro-batch lines (the torch runtime's
  window-stepping schedules).
- `peak_pss_mib` and `temperature_c` are the maxima over all of the stage's
  micro-batch and window lines (replays included: a peak is a peak);
  `temperature_median_c` is the median. A stage with no sensor has null —
  never a made-up value.
- `run.wall_s`: the coordinator's `run` line (end − start) when there is
  one; otherwise from the runners' lines: the first micro-batch's start
  (its `t_unix_ms − total_ms`) to the last micro-batch or window line, which
  leaves out process start-up (and is off by any clock skew between devices).
  `run.samples`: the `run` line's, or else the last stage's distinct
  micro-batches × the manifest's `micro_batch`. `records_per_s` = samples / wall_s.
- `recovery`: one entry per failure (a `failure` line, then the `restart`
  and `recovered` lines of the same stage that follow it). `recovery_ms` is
  the `recovered` line's, or its `t_unix_ms` minus the restart's (both on
  the coordinator's clock); `since_failure_ms` and `standby` are the
  `recovered` and `restart` lines' (null in runs before they existed). `replayed_in_telemetry` counts, for the n-th
  restart of a stage, the micro-batches in the runner's (n+1)-th run (after
  its n-th `start` line) that an earlier run had already done.

`pauses`: one entry per `pause` event (a device policy held the stage,
docs/design#device-policies): stage, device, kind, reason, the window it stopped
after, `to_pause_ms` (limit crossed → stopped: the rest of its window) and
`paused_ms` (stopped → restarted), what the readings were when it resumed.
`run.paused_s` is the time at least one stage was paused (the union of the
pauses; the wall time includes it). A stage's `restarts` leaves out the
starts that ended a pause.

Layers come from the export manifest (`RUN_DIR/manifest.json`, written by
`zl export`): `stages[i].layers = [first, last]`, null without a manifest.

`eval`: the figures of `RUN_DIR/eval.json` (written by `zl train` after the
merge, zl_device.results.evaluate), base model vs adapter on the dev rows, and
on prompt/completion data the sample generations side by side; null when the
run had no dev split.
"""

import json
import logging
from pathlib import Path

import numpy as np

from zl_base.errors import ZLError
from zl_device.formats.metrics_log import MetricsLog, read_metrics
from zl_device.formats.run_layout import PLOTS_DIR, REPORT_JSON, REPORT_MD, RunLayout
from zl_export.manifest import Manifest, read_manifest
from zl_export.stages import stages_phrase

log = logging.getLogger(__name__)

LATENCY_KEYS = ("phase1_ms", "phase2_ms", "queue_ms", "send_ms", "total_ms")
REPORT_VERSION = 1


def latency_stats(values: list[float | None]) -> dict:
    """`{"median", "p95"}` of the non-null values (numpy's definitions); nulls when there are none."""
    kept = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if kept.size == 0:
        return {"median": None, "p95": None}
    return {"median": float(np.median(kept)), "p95": float(np.percentile(kept, 95))}


def build_report(run_dir: Path, manifest_path: Path | None = None) -> dict:
    """The report of the run in `run_dir` as a JSON-ready dict (see module docstring).

    Args:
        run_dir: the run directory (metrics.jsonl and/or stages/stage_<k>/metrics.jsonl).
        manifest_path: the export manifest; default `run_dir/manifest.json` when it exists.

    Raises:
        ZLError: missing telemetry, a malformed line (named by file and line), a
            malformed manifest, or no micro-batch line at all.
    """
    return _analyze(Path(run_dir), manifest_path)[0]


def write_report(run_dir: Path, manifest_path: Path | None = None, plots: bool = True) -> dict:
    """Write report.json, report.md and (with `plots`) plots/latency.png and plots/loss.png into `run_dir`.

    Returns:
        The report (as in report.json); its "files" maps "json", "md" (and "latency", "loss" with plots)
        to the written paths, relative to `run_dir`.
    """
    layout = RunLayout(run_dir)
    report, curves = _analyze(layout.root, manifest_path)
    files = {"json": REPORT_JSON, "md": REPORT_MD}
    if plots:
        from zl_device.results import plots as zplots

        layout.plots.mkdir(exist_ok=True)
        files["latency"] = f"{PLOTS_DIR}/latency.png"
        files["loss"] = f"{PLOTS_DIR}/loss.png"
        zplots.plot_latency(report["stages"], layout.root / files["latency"])
        zplots.plot_loss(curves, layout.root / files["loss"])
    report["files"] = files
    _write_text(layout.report_json, json.dumps(report, indent=2) + "\n")
    _write_text(layout.report_md, render_markdown(report, with_plots=plots))
    return report


def _analyze(run_dir: Path, manifest_path: Path | None) -> tuple[dict, dict]:
    """(report, loss curves by stage) of a run."""
    metrics = read_metrics(run_dir)
    # The backprop schedules of the torch runtime (gpipe, 1f1b, pipedream) step whole windows: window lines only.
    if not any(metrics.of_type(s, "micro_batch") or metrics.of_type(s, "window") for s in metrics.runner):
        raise ZLError(f"{', '.join(map(str, metrics.sources))}: no micro_batch or window lines; did any stage run a "
                      "micro-batch? (the runner writes them to its log_path)")
    if manifest_path is None and RunLayout(run_dir).manifest.is_file():
        manifest_path = RunLayout(run_dir).manifest
    manifest = read_manifest(manifest_path) if manifest_path is not None else None
    layers = {s.index: list(s.layers) for s in manifest.stages} if manifest else {}
    unknown = sorted(set(metrics.runner) - set(layers)) if manifest else []
    if unknown:
        log.warning("stage(s) %s are not in %s; is it this run's manifest?", unknown, manifest_path)

    indices = sorted(set(metrics.runner) | set(layers))
    stages, curves, replays_by_run = [], {}, {}
    for index in indices:
        summary, curve, replays_by_run[index] = _stage(index, metrics, layers.get(index))
        stages.append(summary)
        curves[index] = curve
    pauses = _pauses(metrics.events)
    for summary in stages:  # the start that ended a pause is no restart
        summary["restarts"] = max(0, summary["restarts"] - sum(p["stage"] == summary["index"] for p in pauses))
    report = {
        "version": REPORT_VERSION,
        "run_dir": str(run_dir),
        "sources": [str(p) for p in metrics.sources],
        "model": _model(manifest),
        "run": _run(metrics, manifest, stages),
        "stages": stages,
        "recovery": _recovery(metrics.events, replays_by_run),
        "pauses": pauses,
        "eval": _eval(RunLayout(run_dir).eval),
    }
    report["run"]["paused_s"] = _held_s(pauses)
    return report, curves


_PAUSE_KEYS = ("stage", "device", "kind", "reason", "window", "requested_unix_ms", "paused_unix_ms",
               "resumed_unix_ms", "to_pause_ms", "paused_ms", "resumed_at")


def _pauses(events: list[dict]) -> list[dict]:
    """The `pause` events, in order, with the keys of _PAUSE_KEYS (null where an event lacks one)."""
    return [{key: e.get(key) for key in _PAUSE_KEYS} for e in events if e["type"] == "pause"]


def _held_s(pauses: list[dict]) -> float | None:
    """Seconds during which at least one stage was paused (the union of the pauses); None without pauses."""
    spans = sorted((p["paused_unix_ms"], p["resumed_unix_ms"]) for p in pauses
                   if p["paused_unix_ms"] is not None and p["resumed_unix_ms"] is not None)
    if not spans:
        return None
    total, (start, end) = 0.0, spans[0]
    for a, b in spans[1:]:
        if a > end:
            total, start = total + end - start, a
        end = max(end, b)
    return (total + end - start) / 1000.0


def _eval(path: Path) -> dict | None:
    """eval.json's figures as {"data", "rows", "results": {"base", "adapter"}, "generation", "samples"}; None
    without one (a run without dev data), or with one that is not readable (a warning says so)."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        results = data.get("results") or {k: data[k] for k in ("base", "adapter") if isinstance(data.get(k), dict)}
        if not results or not all(isinstance(r, dict) and "nll" in r for r in results.values()):
            raise ValueError("no base/adapter figures")
    except (OSError, ValueError, AttributeError) as e:
        log.warning("%s: not usable (%s); the report leaves the evaluation out", path, e)
        return None
    return {"data": data.get("data"), "rows": data.get("rows"), "results": results,
            "generation": data.get("generation"), "samples": data.get("samples") or []}


def _stage(index: int, metrics: MetricsLog, layers: list[int] | None) -> tuple[dict, dict, list[int]]:
    """One stage's summary, its loss curve, and per runner start the micro-batches it redid."""
    lines = metrics.runner.get(index, [])
    last_mb: dict[int, dict] = {}
    last_window: dict[int, dict] = {}
    replays_by_run = [0]  # replays_by_run[n]: repeats in the runner's n-th run (0 = first start)
    started = False
    for line in lines:
        if line["type"] == "start":
            if started:
                replays_by_run.append(0)
            started = True
        elif line["type"] == "micro_batch":
            if line["micro_batch"] in last_mb:
                replays_by_run[-1] += 1
            last_mb[line["micro_batch"]] = line
        elif line["type"] == "window":
            last_window[line["window"]] = line
    kept = [last_mb[k] for k in sorted(last_mb)]
    windows = [last_window[k] for k in sorted(last_window)]
    measured = [line for line in lines if line["type"] in ("micro_batch", "window")]
    pss = [line["pss_mib"] for line in measured if line.get("pss_mib") is not None]
    temps = [line["temperature_c"] for line in measured if line.get("temperature_c") is not None]
    summary = {
        "index": index,
        "layers": layers,
        "micro_batches": len(kept),
        "replayed_micro_batches": sum(replays_by_run),
        "restarts": max(len(replays_by_run) - 1, 0),
        "windows": len(windows),
        "forward_only": metrics.forward_only(index),
        "schedule": metrics.schedule(index),
        **{key: latency_stats([r.get(key) for r in kept]) for key in LATENCY_KEYS},
        "checkpoint_ms": latency_stats([w.get("checkpoint_ms") for w in windows]),
        "busy_share": _busy_share(lines),
        # The threads its kernels split work over (the runner's last start line; null before runners said so).
        "threads": next((line.get("threads") for line in reversed(lines) if line["type"] == "start"), None),
        "peak_pss_mib": max(pss) if pss else None,
        "temperature_c": max(temps) if temps else None,
        "temperature_median_c": float(np.median(temps)) if temps else None,
        "first_window_mean_loss": windows[0].get("mean_loss") if windows else None,
        "last_window_mean_loss": windows[-1].get("mean_loss") if windows else None,
    }
    # A window's mean is drawn at its last micro-batch.
    ends = {}
    for r in kept:
        ends[r["window"]] = max(ends.get(r["window"], -1), r["micro_batch"])
    curve = {
        "micro_batch": [r["micro_batch"] for r in kept if r.get("loss") is not None],
        "loss": [r["loss"] for r in kept if r.get("loss") is not None],
        "window_end": [ends[w["window"]] for w in windows if w["window"] in ends and w.get("mean_loss") is not None],
        "window_mean_loss": [w["mean_loss"] for w in windows if w["window"] in ends and w.get("mean_loss") is not None],
    }
    return summary, curve, replays_by_run


def _busy_share(lines: list[dict]) -> float | None:
    """Phase 1 + phase 2 over the stage's span, summed over its runs (report.py's docstring); None without any
    micro-batch line."""
    busy_ms = span_ms = 0.0
    begin = end = None
    if not any(line["type"] == "micro_batch" for line in lines):
        return None
    for line in [*lines, {"type": "start"}]:  # a final start closes the last run's span
        if line["type"] == "start":
            if begin is not None and end is not None:
                span_ms += max(end - begin, 0.0)
            begin, end = line.get("ready_unix_ms"), None
            continue
        t = line.get("t_unix_ms")
        if line["type"] == "micro_batch":
            busy_ms += (line.get("phase1_ms") or 0.0) + (line.get("phase2_ms") or 0.0)
            if begin is None and t is not None:
                begin = t - (line.get("total_ms") or 0.0)
        if t is not None and begin is not None:
            end = t
    return min(busy_ms / span_ms, 1.0) if span_ms > 0 else None


def _model(manifest: Manifest | None) -> dict | None:
    if manifest is None:
        return None
    opts = manifest.options  # exports before --frozen-dtype stored float32 weights: fp32
    return {"name": manifest.model.name, "num_layers": manifest.model.num_layers, "seq_len": opts.seq_len,
            "micro_batch": opts.micro_batch, "num_stages": manifest.num_stages, "frozen_dtype": opts.frozen_dtype,
            "embedding_dtype": opts.embedding_dtype or opts.frozen_dtype, "frozen_storage": opts.frozen_storage,
            "program_mib": ([st.size_bytes / 2**20 for st in manifest.stages]
                            if all(st.size_bytes is not None for st in manifest.stages) else None)}


def _run(metrics: MetricsLog, manifest: Manifest | None, stages: list[dict]) -> dict:
    runs = [e for e in metrics.events if e["type"] == "run"]
    run = runs[-1] if runs else {}
    wall_s, wall_source = None, None
    if run.get("start_unix_ms") is not None and run.get("end_unix_ms") is not None:
        wall_s, wall_source = (run["end_unix_ms"] - run["start_unix_ms"]) / 1000.0, "run"
    else:
        starts, ends = [], []
        for lines in metrics.runner.values():
            for line in lines:
                if line["type"] == "micro_batch" and line.get("t_unix_ms") is not None:
                    starts.append(line["t_unix_ms"] - (line.get("total_ms") or 0.0))
                if line["type"] in ("micro_batch", "window") and line.get("t_unix_ms") is not None:
                    ends.append(line["t_unix_ms"])
        if starts:
            wall_s, wall_source = (max(ends) - min(starts)) / 1000.0, "telemetry"
    samples, samples_source = run.get("samples"), "run" if run.get("samples") is not None else None
    micro_batch = manifest.options.micro_batch if manifest else None
    if samples is None and isinstance(micro_batch, int) and stages:
        samples, samples_source = stages[-1]["micro_batches"] * micro_batch, "telemetry"
    rate = samples / wall_s if samples is not None and wall_s else None
    return {"wall_s": wall_s, "wall_s_source": wall_source, "samples": samples, "samples_source": samples_source,
            "records_per_s": rate, "start_unix_ms": run.get("start_unix_ms"), "end_unix_ms": run.get("end_unix_ms")}


def _recovery(events: list[dict], replays_by_run: dict[int, list[int]]) -> list[dict]:
    entries: list[dict] = []
    open_entry: dict[int, dict] = {}
    restarts: dict[int, int] = {}

    def entry_for(stage: int, step: str) -> dict:
        # A restart or recovered line with no open failure (or one that already has it) starts its own entry.
        entry = open_entry.get(stage)
        if entry is None or entry[step] is not None:
            entry = _new_entry(stage)
            entries.append(entry)
            open_entry[stage] = entry
        return entry

    for event in events:
        kind = event["type"]
        if kind in ("run", "pause"):
            continue
        stage = event["stage"]
        if kind == "failure":
            entry = _new_entry(stage)
            entries.append(entry)
            open_entry[stage] = entry
            entry.update(failure_t_unix_ms=event.get("t_unix_ms"), detected_after_ms=event.get("detected_after_ms"),
                         window=event.get("window"), micro_batch=event.get("micro_batch"), reason=event.get("reason"))
        elif kind == "restart":
            entry = entry_for(stage, "restart_t_unix_ms")
            restarts[stage] = restarts.get(stage, 0) + 1
            runs = replays_by_run.get(stage, [])
            entry.update(restart_t_unix_ms=event.get("t_unix_ms"), replay_bytes=event.get("replay_bytes"),
                         standby=event.get("standby"),
                         replayed_micro_batches=event.get("replayed_micro_batches"),
                         replayed_in_telemetry=runs[restarts[stage]] if restarts[stage] < len(runs) else None)
        elif kind == "recovered":
            entry = entry_for(stage, "recovered_t_unix_ms")
            recovery_ms = event.get("recovery_ms")
            if recovery_ms is None and event.get("t_unix_ms") is not None and entry["restart_t_unix_ms"] is not None:
                recovery_ms = float(event["t_unix_ms"] - entry["restart_t_unix_ms"])
            entry.update(recovered_t_unix_ms=event.get("t_unix_ms"), recovery_ms=recovery_ms,
                         since_failure_ms=event.get("since_failure_ms"),
                         downstream_stage=event.get("downstream_stage"))
            if entry["window"] is None:
                entry["window"] = event.get("window")
    return entries


def _new_entry(stage: int) -> dict:
    keys = ("window", "micro_batch", "failure_t_unix_ms", "detected_after_ms", "restart_t_unix_ms",
            "replayed_micro_batches", "replayed_in_telemetry", "replay_bytes", "recovered_t_unix_ms",
            "downstream_stage", "recovery_ms", "since_failure_ms", "standby", "reason")
    return {"stage": stage, **dict.fromkeys(keys)}


def _num(value, digits: int = 1) -> str:
    """A number for the Markdown tables; `n/a` for a null."""
    if value is None:
        return "n/a"
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return f"{value:.{digits}f}"


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def _pair(stats: dict) -> str:
    return f"{_num(stats['median'])} / {_num(stats['p95'])}"


def render_markdown(report: dict, with_plots: bool = True) -> str:
    """`report.md`: the run, per-stage latency / memory / temperature, losses, recovery, plots."""
    run, stages = report["run"], report["stages"]
    out = ["# Run report", ""]
    model = report.get("model")
    if model:
        out += [f"Model {model['name']} ({model['num_layers']} layers) in {stages_phrase(model['num_stages'])}; "
                f"seq_len {model['seq_len']}, micro-batch {model['micro_batch']}.", ""]
        if model.get("program_mib"):
            sizes = " / ".join(f"{m:,.0f}" for m in model["program_mib"])
            out += [f"Frozen weights {model.get('frozen_storage', model['frozen_dtype'])}; stage programs {sizes} MiB "
                    "(docs/design#frozen-weights).", ""]
    out += ["## Run", "", "| wall time (s) | samples | records/s |", "|---|---|---|",
            f"| {_num(run['wall_s'])} | {_num(run['samples'])} | {_num(run['records_per_s'], 4)} |", ""]
    if run["wall_s_source"] == "telemetry":
        out += ["Wall time from the runners' lines (first micro-batch start to last line; no coordinator "
                "`run` line): it leaves out process start-up.", ""]
    out += ["## Stages", "",
            "Times in ms, median / p95 over each stage's micro-batches; a replayed micro-batch counts once "
            "(its last run).", "",
            "| stage | layers | micro-batches | phase 1 | phase 2 | queue | send | total | busy | peak PSS (MiB) | "
            "temperature (°C) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in stages:
        layers = f"{s['layers'][0]}–{s['layers'][1]}" if s["layers"] else "n/a"
        phase2 = "none (forward only)" if s.get("forward_only") else _pair(s["phase2_ms"])
        out.append(f"| {s['index']} | {layers} | {s['micro_batches']} | {_pair(s['phase1_ms'])} | "
                   f"{phase2} | {_pair(s['queue_ms'])} | {_pair(s['send_ms'])} | "
                   f"{_pair(s['total_ms'])} | {_share(s.get('busy_share'))} | {_num(s['peak_pss_mib'])} | "
                   f"{_num(s['temperature_c'])} |")
    out += ["", "Busy: phase 1 + phase 2 over the stage's time from ready to done; the rest it waited (for input, "
            "for a gradient, on a full link) or ended windows. The busiest stage sets the pipeline's pace and the "
            "others wait on it: `zl plan` (or `--stages`) moves layers from it to them.", ""]
    if any(s.get("threads") is not None for s in stages):
        out += ["Threads per stage (its kernels' pool): "
                + " / ".join("n/a" if s.get("threads") is None else str(s["threads"]) for s in stages) + ".", ""]
    out += ["Temperature: the highest reading (battery on Android, CPU thermal zone on Linux); n/a where the "
            "device has no sensor.", "", "## Loss", ""]
    # Under a backprop schedule a stage before the last differentiates <h, grad_hidden>, no loss of its own
    # (docs/design#backprop-program).
    linked = [s for s in stages[:-1] if s.get("schedule", "zerolock") != "zerolock"]
    trained = [s for s in stages if not s.get("forward_only") and s not in linked]
    if trained:
        out += ["| stage | windows | first window mean loss | last window mean loss |", "|---|---|---|---|"]
        for s in trained:
            out.append(f"| {s['index']} | {s['windows']} | {_num(s['first_window_mean_loss'], 4)} | "
                       f"{_num(s['last_window_mean_loss'], 4)} |")
        out.append("")
    for s in linked:
        out.append(f"- stage {s['index']}: trained on the final loss's gradient ({s['schedule']} schedule), "
                   "which has no loss of its own there; the last stage's loss is the pipeline's "
                   "(docs/design#backprop-schedules).")
    if linked:
        out.append("")
    held = [s for s in stages if s.get("forward_only")]
    for s in held:
        out.append(f"- stage {s['index']}: held still (lr 0), forward only: its weights did not move, so it ran "
                   "no readout, loss or backward (docs/design#windows-and-adamw).")
    if held:
        out.append("")
    if report.get("eval"):
        out += _eval_markdown(report["eval"])
    replayed = [s for s in stages if s["replayed_micro_batches"] or s["restarts"]]
    if report["recovery"] or replayed:
        out += _recovery_markdown(report["recovery"], replayed)
    if report.get("pauses"):
        out += _pauses_markdown(report["pauses"], run.get("paused_s"))
    if with_plots:
        out += ["## Plots", "", "![latency per stage](plots/latency.png)", "", "![loss per stage](plots/loss.png)", ""]
    return "\n".join(out)


_EVAL_ROWS = (("accuracy", "accuracy", 3), ("nll", "NLL / completion token (nats)", 4), ("perplexity", "perplexity", 3),
              ("exact_match", "exact match", 3), ("rouge_l", "ROUGE-L (F)", 3))


def _eval_markdown(ev: dict) -> list[str]:
    """The evaluation: base vs adapter figures, then the sample generations side by side."""
    results = ev["results"]
    names = list(results)
    out = ["## Evaluation", "", f"Base model vs adapter on {_num(ev['rows'])} dev rows (`{ev['data']}`).", "",
           "| metric | " + " | ".join(names) + (" | Δ |" if len(names) == 2 else " |"),
           "|---" * (len(names) + 1 + (len(names) == 2)) + "|"]
    for key, label, digits in _EVAL_ROWS:
        values = [results[n].get(key) for n in names]
        if all(v is None for v in values):
            continue
        cells = [_num(v, digits) for v in values]
        if len(names) == 2:
            cells.append("n/a" if None in values else f"{values[1] - values[0]:+.{digits}f}")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    out.append("")
    gen = ev.get("generation")
    if gen:
        budget = (f"at most {gen['max_new_tokens']} tokens" if gen.get("max_new_tokens")
                  else f"each up to its reference's length + {gen.get('margin_tokens')} tokens")
        out += [f"Generations: {gen.get('decoding', 'greedy')} from the prompts of the first {_num(gen.get('rows'))} "
                f"rows, {budget}; exact match ignores whitespace at either end, ROUGE-L is the F-measure "
                "(rouge-score).", ""]
    samples = ev.get("samples") or []
    if samples:
        models = [k for k in samples[0] if k not in ("row", "prompt", "reference")]
        out += ["### Sample generations", "", "| row | prompt | reference | " + " | ".join(models) + " |",
                "|---" * (3 + len(models)) + "|"]
        for sample in samples:
            out.append(f"| {sample.get('row')} | " + " | ".join(_cell(sample.get(k), keep_end=k == "prompt")
                                                            for k in ("prompt", "reference", *models)) + " |")
        out.append("")
    return out


def _cell(text, limit: int = 160, keep_end: bool = False) -> str:
    """Text for a Markdown table cell: control characters escaped, `|`, `<`, `>` and `&` made literal, newlines as
    <br>; past `limit` characters elided (a prompt keeps its end, which is what the model continues)."""
    from zl_device.results.generation import visible

    text = "" if text is None else str(text)
    if len(text) > limit:
        text = "…" + text[-limit:] if keep_end else text[:limit] + "…"
    text = visible(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")
    return text.replace("\n", "<br>") if text.strip() else "(empty)"


def _recovery_markdown(entries: list[dict], replayed: list[dict]) -> list[str]:
    out = ["## Recovery", ""]
    if entries:
        out += ["Recovery time: from the restart (since the failure: from the failure, i.e. an injected "
                "failure's SIGKILL or else its detection) until the downstream stage commits the window that was "
                "in flight at the failure. Standby: a hot standby took over instead of a new process.", "",
                "| stage | cause | window / micro-batch in flight | detected after (ms) | replayed micro-batches "
                "(coordinator / telemetry) | replay bytes | standby | recovery (ms) | since the failure (ms) |",
                "|---|---|---|---|---|---|---|---|---|"]
        for e in entries:
            cause = (e["reason"] or "n/a").replace("|", "/")
            standby = "n/a" if e["standby"] is None else ("yes" if e["standby"] else "no")
            out.append(f"| {e['stage']} | {cause} | {_num(e['window'])} / {_num(e['micro_batch'])} | "
                       f"{_num(e['detected_after_ms'])} | {_num(e['replayed_micro_batches'])} / "
                       f"{_num(e['replayed_in_telemetry'])} | {_num(e['replay_bytes'])} | {standby} | "
                       f"{_num(e['recovery_ms'])} | {_num(e['since_failure_ms'])} |")
        out.append("")
    for s in replayed:
        out.append(f"- stage {s['index']}: {s['restarts']} restart(s), {s['replayed_micro_batches']} micro-batch(es) "
                   "replayed (left out of the latency statistics).")
    if replayed:
        out.append("")
    return out


def _pauses_markdown(pauses: list[dict], paused_s: float | None) -> list[str]:
    out = ["## Pauses", "",
           "A device policy (`--max-temperature`, `--min-battery`, `--require-charging`) held these stages: each "
           "finished its window, stopped, and started again from its checkpoint once its device was back in range "
           "(docs/design#device-policies). Until paused: from the limit crossed to the stop; paused: from the stop to "
           "the restart." + (f" Some stage was paused for {paused_s:.1f} s in all, which the wall time includes."
                         if paused_s is not None else ""), "",
           "| stage | device | why | stopped after window | until paused (ms) | paused (s) | resumed at |",
           "|---|---|---|---|---|---|---|"]
    for p in pauses:
        paused = None if p["paused_ms"] is None else p["paused_ms"] / 1000.0
        out.append(f"| {p['stage']} | {p['device'] or 'n/a'} | {_cell(p['reason'])} | {_num(p['window'])} | "
                   f"{_num(p['to_pause_ms'])} | {_num(paused)} | {_cell(p['resumed_at'])} |")
    out.append("")
    return out


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
