"""`zl report` on synthetic telemetry: statistics, nulls, replays, recovery, both layouts, plots and the CLI."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import typer
from matplotlib.image import imread
from typer.testing import CliRunner

from manifest_fixtures import fake_manifest

from zl.commands.report import report_command
from zl_base.errors import ZLError
from zl_device.results.report import LATENCY_KEYS, build_report, latency_stats, render_markdown, write_report

T0 = 1_700_000_000_000  # ms
WINDOW = 2
N = 6  # micro-batches per stage
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def mb_line(stage: int, mb: int, rng: np.random.Generator, t: int, **over) -> dict:
    line = {
        "type": "micro_batch", "t_unix_ms": t, "stage": stage, "window": mb // WINDOW, "micro_batch": mb,
        "phase1_ms": float(rng.uniform(10, 20)), "phase2_ms": float(rng.uniform(30, 60)),
        "queue_ms": float(rng.uniform(0, 5)), "send_ms": float(rng.uniform(0, 2)),
        "total_ms": float(rng.uniform(60, 90)), "loss": float(3 - 0.1 * mb), "task_loss": 2.5,
        "consistency_loss": 0.5, "pss_mib": float(rng.uniform(900, 1000)),
        "temperature_c": float(rng.uniform(30, 40)) if stage == 0 else None, "early_forwarding": True,
    }
    line.update(over)
    return line


def window_line(stage: int, window: int, t: int, mean_loss: float, pss: float | None = 950.0) -> dict:
    return {"type": "window", "t_unix_ms": t, "stage": stage, "window": window, "micro_batches": WINDOW,
            "mean_loss": mean_loss, "mean_task_loss": 2.5, "mean_consistency_loss": 0.5, "lr": 1e-4,
            "step": window + 1, "checkpoint_ms": 5.0 + window, "pss_mib": pss,
            "temperature_c": 35.0 if stage == 0 else None}


def start_line(stage: int, first: int = 0, resumed: int | None = None) -> dict:
    return {"type": "start", "stage": stage, "num_stages": 2, "pid": 100 + stage, "first_micro_batch": first,
            "resumed_from_window": resumed, "listen_port": None, "config": {"window_size": WINDOW}}


def make_run(seed: int = 0, failure: bool = True) -> dict[int, list[dict]]:
    """Two stages, N micro-batches, windows of 2.

    With `failure`, stage 1 dies after micro-batch 4 (window 2 in flight), resumes from window 1's checkpoint
    and redoes micro-batches 4 and 5; the first run of micro-batch 4 is slow (an outlier the statistics must
    not see). Stage 1 has no temperature sensor; stage 0's micro-batch 3 has no phase-2 time.
    """
    rng = np.random.default_rng(seed)
    lines: dict[int, list[dict]] = {0: [start_line(0)], 1: [start_line(1)]}
    t = T0
    for stage in (0, 1):
        for mb in range(N):
            t += 100
            if stage == 1 and failure and mb == 4:
                lines[1].append(mb_line(1, 4, rng, t, phase1_ms=9000.0, total_ms=9999.0, pss_mib=5000.0))
                lines[1].append(start_line(1, first=4, resumed=1))
                t += 100
            over = {"phase2_ms": None} if (stage, mb) == (0, 3) else {}
            lines[stage].append(mb_line(stage, mb, rng, t, **over))
            if (mb + 1) % WINDOW == 0:
                lines[stage].append(window_line(stage, mb // WINDOW, t + 1, mean_loss=3 - 0.1 * mb - 0.05))
        lines[stage].append({"type": "done", "stage": stage, "micro_batches": N, "wall_s": 1.0, "optimizer_step": 3})
    return lines


EVENTS = [
    {"type": "failure", "stage": 1, "t_unix_ms": T0 + 1000, "detected_after_ms": 1500, "window": 2, "micro_batch": 5,
     "reason": "exited with status -9"},
    {"type": "restart", "stage": 1, "t_unix_ms": T0 + 1200, "replayed_micro_batches": 2, "replay_bytes": 4096},
    {"type": "recovered", "stage": 1, "t_unix_ms": T0 + 3500, "recovery_ms": 2300.0, "downstream_stage": 1,
     "window": 2},
]
RUN = {"type": "run", "start_unix_ms": T0 - 500, "end_unix_ms": T0 + 15_500, "samples": 12, "run_id": "ab"}
MANIFEST = fake_manifest([(0, 1), (2, 3)], files=False, seq_len=16, micro_batch=2).to_json()


def write_jsonl(path: Path, lines: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def merged_run(tmp_path: Path, failure: bool = True, events: bool = True, manifest: bool = True) -> Path:
    lines = make_run(failure=failure)
    records = lines[0] + lines[1] + ((EVENTS if failure else []) + [RUN] if events else [])
    write_jsonl(tmp_path / "metrics.jsonl", records)
    if manifest:
        (tmp_path / "manifest.json").write_text(json.dumps(MANIFEST))
    return tmp_path


def expected_kept(lines: list[dict]) -> list[dict]:
    """The last micro_batch line per micro-batch, written independently of the report's code."""
    by_mb = {}
    for line in lines:
        if line["type"] == "micro_batch":
            by_mb[line["micro_batch"]] = line
    return [by_mb[k] for k in sorted(by_mb)]


def test_latency_stats_are_numpys():
    values = [5.0, None, 1.0, 2.5, 100.0, 3.0]
    kept = [5.0, 1.0, 2.5, 100.0, 3.0]
    assert latency_stats(values) == {"median": np.median(kept), "p95": np.percentile(kept, 95)}
    assert latency_stats([None, None]) == {"median": None, "p95": None}
    assert latency_stats([]) == {"median": None, "p95": None}


def test_stage_statistics_match_numpy_and_keep_the_last_replay(tmp_path):
    report = build_report(merged_run(tmp_path))
    lines = make_run()
    assert [s["index"] for s in report["stages"]] == [0, 1]
    for stage in report["stages"]:
        kept = expected_kept(lines[stage["index"]])
        assert stage["micro_batches"] == N
        for key in LATENCY_KEYS:
            values = [line[key] for line in kept if line[key] is not None]
            assert stage[key] == {"median": np.median(values), "p95": np.percentile(values, 95)}, (stage["index"], key)
        measured = [line for line in lines[stage["index"]] if line["type"] in ("micro_batch", "window")]
        assert stage["peak_pss_mib"] == max(line["pss_mib"] for line in measured)
    s0, s1 = report["stages"]
    # The slow first run of stage 1's micro-batch 4 is left out of the latency and counted as a replay.
    assert s1["phase1_ms"]["p95"] < 100 and s1["total_ms"]["p95"] < 100
    assert (s1["replayed_micro_batches"], s1["restarts"]) == (1, 1)
    assert (s0["replayed_micro_batches"], s0["restarts"]) == (0, 0)
    # ... but its memory peak is real.
    assert s1["peak_pss_mib"] == 5000.0
    assert s0["layers"] == [0, 1] and s1["layers"] == [2, 3]
    assert s0["windows"] == s1["windows"] == N // WINDOW
    assert s0["last_window_mean_loss"] == pytest.approx(3 - 0.1 * 5 - 0.05)


def test_missing_sensor_stays_null(tmp_path):
    report = build_report(merged_run(tmp_path))
    s0, s1 = report["stages"]
    temps = [line["temperature_c"] for line in make_run()[0] if line["type"] in ("micro_batch", "window")]
    assert s0["temperature_c"] == max(temps)
    assert s1["temperature_c"] is None and s1["temperature_median_c"] is None
    # Stage 0's micro-batch 3 had no phase-2 time: 5 values, not 6 with a made-up zero.
    kept = [line["phase2_ms"] for line in expected_kept(make_run()[0]) if line["phase2_ms"] is not None]
    assert len(kept) == N - 1 and s0["phase2_ms"]["median"] == np.median(kept)
    saved = json.loads(json.dumps(report))
    assert saved["stages"][1]["temperature_c"] is None


def test_run_wall_time_and_rate(tmp_path):
    run = build_report(merged_run(tmp_path))["run"]
    assert run["wall_s"] == 16.0 and run["wall_s_source"] == "run"
    assert run["samples"] == 12 and run["records_per_s"] == 12 / 16.0


def test_run_from_telemetry_without_a_run_line(tmp_path):
    run = build_report(merged_run(tmp_path, failure=False, events=False))["run"]
    lines = make_run(failure=False)
    mbs = [line for stage in lines.values() for line in stage if line["type"] == "micro_batch"]
    ends = [line["t_unix_ms"] for stage in lines.values() for line in stage
            if line["type"] in ("micro_batch", "window")]
    start = min(line["t_unix_ms"] - line["total_ms"] for line in mbs)
    assert run["wall_s_source"] == "telemetry"
    assert run["wall_s"] == pytest.approx((max(ends) - start) / 1000)
    assert run["samples"] == N * MANIFEST["micro_batch"]
    assert run["records_per_s"] == pytest.approx(run["samples"] / run["wall_s"])


def test_without_manifest_layers_and_samples_are_null(tmp_path):
    report = build_report(merged_run(tmp_path, failure=False, events=False, manifest=False))
    assert [s["layers"] for s in report["stages"]] == [None, None]
    assert report["run"]["samples"] is None and report["run"]["records_per_s"] is None
    assert "| 0 | n/a |" in render_markdown(report)


def test_recovery_entry(tmp_path):
    (entry,) = build_report(merged_run(tmp_path))["recovery"]
    assert entry["stage"] == 1 and entry["window"] == 2 and entry["micro_batch"] == 5
    assert entry["detected_after_ms"] == 1500
    assert entry["replayed_micro_batches"] == 2 and entry["replay_bytes"] == 4096
    assert entry["replayed_in_telemetry"] == 1  # micro-batch 4; 5 had not been done before the failure
    assert entry["recovery_ms"] == 2300.0


def test_recovery_ms_from_event_times_when_not_given(tmp_path):
    events = [dict(e) for e in EVENTS]
    events[2]["recovery_ms"] = None
    lines = make_run()
    write_jsonl(tmp_path / "metrics.jsonl", lines[0] + lines[1] + events)
    (entry,) = build_report(tmp_path)["recovery"]
    assert entry["recovery_ms"] == 2300.0  # 3500 - 1200, both on the coordinator's clock


def test_markdown_has_the_numbers(tmp_path):
    report = build_report(merged_run(tmp_path))
    md = render_markdown(report)
    for stage in report["stages"]:
        for key in ("phase1_ms", "phase2_ms", "queue_ms", "total_ms"):
            stats = stage[key]
            assert f"{stats['median']:.1f} / {stats['p95']:.1f}" in md, key
        assert f"{stage['peak_pss_mib']:.1f}" in md
    s0, s1 = report["stages"]
    assert f"| {s0['temperature_c']:.1f} |" in md
    (row,) = [line for line in md.splitlines() if line.startswith("| 1 | 2–3 | 6 |")]
    assert row.endswith(f"| {s1['peak_pss_mib']:.1f} | n/a |")
    assert f"| {s1['busy_share']:.0%} | {s1['peak_pss_mib']:.1f} |" in row  # stage 1 has no temperature sensor
    assert "| 16.0 | 12 | 0.7500 |" in md
    assert "## Recovery" in md
    assert "| 1 | exited with status -9 | 2 / 5 | 1500 | 2 / 1 | 4096 | n/a | 2300.0 | n/a |" in md  # older events


def test_markdown_names_the_frozen_dtype_and_program_sizes(tmp_path):
    run = merged_run(tmp_path)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["frozen_dtype"] = "int8"
    for st, size in zip(manifest["stages"], (3 * 2**20, 1536 * 2**20)):
        st["size_bytes"] = size
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert "Frozen weights int8; stage programs 3 / 1,536 MiB" in render_markdown(build_report(run))
    manifest["embedding_dtype"] = "bf16"  # --embedding-dtype
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert "Frozen weights int8, embedding and head bf16; stage programs" in render_markdown(build_report(run))
    del manifest["embedding_dtype"]
    del manifest["frozen_dtype"]  # an export from before --frozen-dtype: float32
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert "Frozen weights fp32;" in render_markdown(build_report(run))


def test_no_recovery_section_without_failures(tmp_path):
    md = render_markdown(build_report(merged_run(tmp_path, failure=False)))
    assert "## Recovery" not in md
    assert build_report(tmp_path)["recovery"] == []


def test_per_stage_files_give_the_same_report(tmp_path):
    merged = build_report(merged_run(tmp_path / "merged"))
    split = tmp_path / "split"
    lines = make_run()
    write_jsonl(split / "stages" / "stage_0" / "metrics.jsonl", lines[0])
    write_jsonl(split / "stages" / "stage_1" / "metrics.jsonl", lines[1])
    write_jsonl(split / "metrics.jsonl", EVENTS + [RUN])  # the coordinator's own lines
    (split / "manifest.json").write_text(json.dumps(MANIFEST))
    per_stage = build_report(split)
    for key in ("stages", "run", "recovery"):
        assert per_stage[key] == merged[key], key
    # The merged file next to the files it came from: nothing is counted twice.
    write_jsonl(split / "metrics.jsonl", lines[0] + lines[1] + EVENTS + [RUN])
    both = build_report(split)
    for key in ("stages", "run", "recovery"):
        assert both[key] == merged[key], key


def test_per_stage_file_with_another_stage_is_refused(tmp_path):
    write_jsonl(tmp_path / "stages" / "stage_0" / "metrics.jsonl", make_run()[1])
    with pytest.raises(ZLError, match=r"stage_0/metrics.jsonl: holds lines of stage\(s\) \[1\]"):
        build_report(tmp_path)


def test_malformed_line_is_named(tmp_path):
    lines = make_run()[0]
    text = "".join(json.dumps(line) + "\n" for line in lines[:2]) + '{"type": "micro_batch", "stage": 0,\n'
    (tmp_path / "metrics.jsonl").write_text(text + json.dumps(lines[2]) + "\n")
    with pytest.raises(ZLError, match=r"metrics.jsonl:3: not valid JSON"):
        build_report(tmp_path)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('[1, 2]', r":1: expected a JSON object with a string \"type\""),
        ('{"type": "micro_batch", "stage": "0", "window": 0, "micro_batch": 0}', r":1: micro_batch line has stage='0'"),
        ('{"type": "micro_batch", "stage": 0, "window": 0, "micro_batch": 0, "total_ms": "7"}', r"total_ms='7'"),
    ],
)
def test_wrongly_typed_lines_are_named(tmp_path, line, message):
    (tmp_path / "metrics.jsonl").write_text(line + "\n")
    with pytest.raises(ZLError, match=message):
        build_report(tmp_path)


def test_no_telemetry_or_no_micro_batches(tmp_path):
    with pytest.raises(ZLError, match="no metrics.jsonl"):
        build_report(tmp_path)
    write_jsonl(tmp_path / "metrics.jsonl", [start_line(0), RUN])
    with pytest.raises(ZLError, match="no micro_batch or window lines"):
        build_report(tmp_path)


def test_bad_manifest(tmp_path):
    merged_run(tmp_path, manifest=False)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ZLError, match="manifest.json: not valid JSON"):
        build_report(tmp_path)


def test_write_report_files_and_plots(tmp_path):
    run_dir = merged_run(tmp_path)
    report = write_report(run_dir)
    assert report["files"] == {"json": "report.json", "md": "report.md", "latency": "plots/latency.png",
                               "loss": "plots/loss.png"}
    saved = json.loads((run_dir / "report.json").read_text())
    assert saved["stages"] == report["stages"] and saved["recovery"] == report["recovery"]
    assert "plots/latency.png" in (run_dir / "report.md").read_text()
    for name in ("latency.png", "loss.png"):
        path = run_dir / "plots" / name
        assert path.read_bytes()[:8] == PNG_SIGNATURE
        image = imread(path)
        assert image.ndim == 3 and image.shape[0] >= 300 and image.shape[1] >= 400
        assert image.std() > 0.01, f"{name} is blank"


def held_still_run(tmp_path: Path) -> Path:
    """Stage 0 held still by lr 0 (forward only: phase2_ms 0, null losses, `forward_only` lines), stage 1 trains."""
    lines = make_run(failure=False)
    for line in lines[0]:
        if line["type"] in ("start", "micro_batch", "window"):
            line["forward_only"] = True
        if line["type"] == "micro_batch":
            line.update(phase2_ms=0.0, loss=None, task_loss=None, consistency_loss=None)
        if line["type"] == "window":
            line.update(mean_loss=None, mean_task_loss=None, mean_consistency_loss=None, lr=0.0)
    for line in lines[1]:
        if line["type"] in ("start", "micro_batch", "window"):
            line["forward_only"] = False
    write_jsonl(tmp_path / "metrics.jsonl", lines[0] + lines[1] + [RUN])
    (tmp_path / "manifest.json").write_text(json.dumps(MANIFEST))
    return tmp_path


def test_a_forward_only_stage_is_said_to_be_held_still_not_shown_with_empty_losses(tmp_path):
    report = write_report(held_still_run(tmp_path))
    held, trained = report["stages"]
    assert held["forward_only"] is True and trained["forward_only"] is False
    assert held["phase2_ms"] == {"median": 0.0, "p95": 0.0}  # no phase 2: its busy time is phase 1 + send
    assert held["phase1_ms"]["median"] is not None and trained["phase2_ms"]["median"] > 0
    assert held["first_window_mean_loss"] is None and trained["last_window_mean_loss"] is not None
    md = (tmp_path / "report.md").read_text()
    assert "- stage 0: held still (lr 0), forward only" in md
    loss_table = md.split("## Loss")[1].split("\n\n")[1]
    assert "| 1 | 3 |" in loss_table and "| 0 |" not in loss_table, loss_table
    assert "none (forward only)" in md
    for name in ("latency.png", "loss.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == PNG_SIGNATURE


def test_a_forward_only_flag_that_is_not_a_boolean_is_named(tmp_path):
    write_jsonl(tmp_path / "metrics.jsonl", [mb_line(0, 0, np.random.default_rng(0), T0, forward_only="yes")])
    with pytest.raises(ZLError, match=r"micro_batch line has forward_only='yes', expected true or false"):
        build_report(tmp_path)


def test_plots_survive_unmeasured_stages(tmp_path):
    lines = [mb_line(0, 0, np.random.default_rng(0), T0, phase1_ms=None, phase2_ms=None, queue_ms=None,
                     total_ms=None, loss=None)]
    write_jsonl(tmp_path / "metrics.jsonl", lines)
    report = write_report(tmp_path)
    assert report["stages"][0]["phase1_ms"] == {"median": None, "p95": None}
    assert (tmp_path / "plots" / "latency.png").read_bytes()[:8] == PNG_SIGNATURE


def _app() -> typer.Typer:
    app = typer.Typer(add_completion=False)
    app.command("report")(report_command)
    app.callback()(lambda: None)
    return app


def test_cli(tmp_path):
    run_dir = merged_run(tmp_path)
    result = CliRunner().invoke(_app(), ["report", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert "run: 16.0 s, 12 samples, 0.7500 records/s" in result.output
    assert "stage 1: 6 micro-batches" in result.output
    assert "recovery: 1 failure(s)" in result.output
    for name in ("report.json", "report.md", "plots/latency.png", "plots/loss.png"):
        assert (run_dir / name).is_file(), name
    result = CliRunner().invoke(_app(), ["report", str(tmp_path / "missing")])
    assert isinstance(result.exception, ZLError) and "not a directory" in str(result.exception)


# Telemetry written by the real runner (build/runner/zl_runner): tests/test_runner.py's
# SIGKILL test, 3 stages of tiny-random, 16 micro-batches in windows of 4; stage 1 was killed after
# micro-batch 9 and resumed from window 1, redoing 8 and 9. Start lines' configs are trimmed.
RUNNER_RUN = Path(__file__).resolve().parent / "data" / "runner_kill_run"


def test_report_of_real_runner_telemetry(tmp_path):
    run_dir = Path(shutil.copytree(RUNNER_RUN, tmp_path / "run"))
    report = write_report(run_dir)
    assert [s["layers"] for s in report["stages"]] == [[0, 1], [2, 2], [3, 3]]
    for stage in report["stages"]:
        path = run_dir / "stages" / f"stage_{stage['index']}" / "metrics.jsonl"
        lines = [json.loads(text) for text in path.read_text().splitlines()]
        kept = expected_kept(lines)
        assert [line["micro_batch"] for line in kept] == list(range(16))
        for key in LATENCY_KEYS:
            values = [line[key] for line in kept]
            assert stage[key] == {"median": np.median(values), "p95": np.percentile(values, 95)}, key
        assert stage["windows"] == 4 and stage["temperature_c"] is None
    assert [(s["restarts"], s["replayed_micro_batches"]) for s in report["stages"]] == [(0, 0), (1, 2), (0, 0)]
    assert report["run"]["wall_s_source"] == "telemetry" and report["run"]["samples"] == 16
    md = (run_dir / "report.md").read_text()
    assert "- stage 1: 1 restart(s), 2 micro-batch(es) replayed" in md
    shares = [s["busy_share"] for s in report["stages"]]
    assert all(0 < b <= 1 for b in shares), shares
    assert all(f"| {b:.0%} |" in md for b in shares) and "The busiest stage sets the pipeline's pace" in md


def test_busy_share_is_compute_over_each_runs_span_from_ready_to_its_last_line():
    """A stage's busy share: phase 1 + 2 of every micro-batch line (a replay is work done too) over the span of each
    of its runs, from the start line's ready_unix_ms to that run's last line; the time between a crash and the
    restart is no one's, so it is in neither."""
    from zl_device.results.report import _busy_share

    def mb(mb: int, t: int) -> dict:
        return {"type": "micro_batch", "micro_batch": mb, "t_unix_ms": t, "phase1_ms": 10.0, "phase2_ms": 30.0,
                "total_ms": 100.0}

    one_run = [{"type": "start", "ready_unix_ms": 0}, mb(0, 100), mb(1, 200), {"type": "done", "t_unix_ms": 400}]
    assert _busy_share(one_run) == pytest.approx(80 / 400)
    restarted = [*one_run[:3], {"type": "start", "ready_unix_ms": 10_000}, mb(1, 10_100), mb(2, 10_200)]
    assert _busy_share(restarted) == pytest.approx(160 / (200 + 200))
    no_ready = [{"type": "start"}, mb(0, 1_000), mb(1, 1_100)]  # the first micro-batch's start instead
    assert _busy_share(no_ready) == pytest.approx(80 / 200)
    assert _busy_share([{"type": "start", "ready_unix_ms": 0}, {"type": "window", "t_unix_ms": 5}]) is None

