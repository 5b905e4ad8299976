"""A run's telemetry: the JSON lines of `metrics.jsonl`, where they live and what each kind holds.

Where the lines are (both layouts are read, docs/design#run-outputs):

- `RUN_DIR/metrics.jsonl` — the merged log: every runner's lines plus the
  coordinator's events, as the orchestrator writes it at the end of a run;
- `RUN_DIR/stages/stage_<k>/metrics.jsonl` — one runner's own log, as
  pulled from a device (the runner's `log_path`).

A stage's runner lines are taken from the merged file when it holds any line
of that stage (runner kinds: `start`, `micro_batch`, `window`, `done`), and
from its per-stage file otherwise, so a merged file next to the per-stage
files it was merged from is never counted twice. Coordinator events
(`run`, `failure`, `restart`, `recovered`, `pause`) are read from the merged file
only: the coordinator writes them there, and a per-stage file holds one
runner's lines. Within one stage, line order is time order: the
runner appends, so a merge must keep each stage's lines in their order.

Runner lines (runner/include/zl/telemetry.h, src/runner.cpp);
times in ms, memory in MiB, temperature in °C; an unmeasured value is null:

    {"type": "start", "stage", "num_stages", "pid", "first_micro_batch",
     "resumed_from_window" (null on a fresh start), "listen_port", "forward_only", "config"}
    {"type": "micro_batch", "t_unix_ms", "stage", "window", "micro_batch",
     "phase1_ms", "phase2_ms", "queue_ms", "send_ms", "total_ms",
     "loss", "task_loss", "consistency_loss", "pss_mib", "temperature_c", "early_forwarding", "forward_only"}
    {"type": "window", "t_unix_ms", "stage", "window", "micro_batches",
     "mean_loss", "mean_task_loss", "mean_consistency_loss", "lr", "step",
     "checkpoint_ms" (null when no checkpoint was due), "pss_mib", "temperature_c", "forward_only"}

`forward_only: true` marks a stage held still by lr 0 (docs/design#windows-and-adamw):
it runs phase 1 and the send only, so its micro-batch lines have phase2_ms 0
and null losses, and its window lines null mean losses (the step still
counts). Lines written before the field existed lack it: read it as false
(`MetricsLog.forward_only`).
    {"type": "done", "stage", "micro_batches", "wall_s", "optimizer_step", "sender": {...}, "receiver": {...}}

Coordinator events (written by the coordinator into the merged file;
`t_unix_ms` on the host's clock):

    {"type": "run", "start_unix_ms", "end_unix_ms", "samples", ...}
        one per run, written at its end; `samples` = records trained through
        every stage. Extra keys (run_id, num_stages, window_size, ...) are kept.
    {"type": "failure", "stage", "t_unix_ms", "detected_after_ms", "window", "micro_batch", "reason"}
        reason: "exited with status N", "heartbeat timeout", or "stalled: no progress for S s at micro-batch
        I (alive; input available)" (docs/design#failure-detection)
        the stage was declared failed at t_unix_ms, detected_after_ms after its
        last sign of life (heartbeat or exit); window / micro_batch: the
        micro-batch the stage had in flight and its window.
    {"type": "restart", "stage", "t_unix_ms", "replayed_micro_batches", "replay_bytes", "device", "standby"}
        the replacement runner was started; it replays replayed_micro_batches
        micro-batches (replay_bytes bytes of input log or shard) after its
        latest checkpoint. standby: a hot standby took over
        (docs/design#hot-standbys) instead of a new process (global: every stage's did).
    {"type": "recovered", "stage", "t_unix_ms", "recovery_ms", "since_failure_ms", "downstream_stage", "window"}
        the downstream stage (the stage itself when it is the last) committed
        `window`, the window in flight at the failure; recovery_ms = from the
        restart event to that commit; since_failure_ms = from the failure (an
        injected failure's SIGKILL, else its detection) to that commit.
    {"type": "pause", "stage", "device", "kind", "reason", "window", "requested_unix_ms", "paused_unix_ms",
     "resumed_unix_ms", "to_pause_ms", "paused_ms", "resumed_at", "standby"}
        a device policy held the stage (docs/design#device-policies), written when it resumed: kind is temperature,
        thermal_status, battery or charging, reason the limit crossed ("61.0 °C ≥ 45 °C (--max-temperature)");
        the stage stopped after committing `window`; to_pause_ms = from the limit crossed (requested) to the
        stop (the rest of its window), paused_ms = from the stop to the restart; resumed_at: the readings
        that let it go on.

Every other `type` (e.g. a future "error" or "heartbeat" line) is read and
ignored by the report.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from zl_base.errors import ZLError
from zl_device.formats.run_layout import METRICS, STAGES_DIR, RunLayout

log = logging.getLogger(__name__)

RUNNER_TYPES = ("start", "micro_batch", "window", "done")
EVENT_TYPES = ("run", "failure", "restart", "recovered", "pause")

# Keys that must be integers, and keys that must be numbers or null, per kind.
_INT_KEYS = {
    "start": ("stage",),
    "micro_batch": ("stage", "window", "micro_batch"),
    "window": ("stage", "window"),
    "done": ("stage",),
    "failure": ("stage",),
    "restart": ("stage",),
    "recovered": ("stage",),
    "pause": ("stage",),
}
_NUMBER_KEYS = {
    "micro_batch": ("t_unix_ms", "phase1_ms", "phase2_ms", "queue_ms", "send_ms", "total_ms", "loss", "task_loss",
                    "consistency_loss", "pss_mib", "temperature_c"),
    "window": ("t_unix_ms", "micro_batches", "mean_loss", "mean_task_loss", "mean_consistency_loss", "lr", "step",
               "checkpoint_ms", "pss_mib", "temperature_c"),
    "run": ("start_unix_ms", "end_unix_ms", "samples"),
    "failure": ("t_unix_ms", "detected_after_ms", "window", "micro_batch"),
    "restart": ("t_unix_ms", "replayed_micro_batches", "replay_bytes"),
    "recovered": ("t_unix_ms", "recovery_ms", "since_failure_ms", "downstream_stage", "window"),
    "pause": ("window", "requested_unix_ms", "paused_unix_ms", "resumed_unix_ms", "to_pause_ms", "paused_ms"),
    "start": ("first_micro_batch", "resumed_from_window"),
}
# Keys that must be true or false where present.
_BOOL_KEYS = {"start": ("forward_only",), "micro_batch": ("forward_only",), "window": ("forward_only",)}


@dataclass
class MetricsLog:
    """The lines of one run, each kind in file order (see module docstring)."""

    runner: dict[int, list[dict]] = field(default_factory=dict)  # stage -> its runner lines, in order
    events: list[dict] = field(default_factory=list)  # coordinator events, in order
    sources: list[Path] = field(default_factory=list)  # the files read

    def of_type(self, stage: int, kind: str) -> list[dict]:
        return [r for r in self.runner.get(stage, []) if r["type"] == kind]

    def forward_only(self, stage: int) -> bool:
        """Whether `stage` ran phase 1 only (held still by lr 0, docs/design#windows-and-adamw): every one of its
        micro-batch lines says so; without any, its last start line. A line without the field counts as false."""
        mbs = self.of_type(stage, "micro_batch")
        if mbs:
            return all(r.get("forward_only") is True for r in mbs)
        starts = self.of_type(stage, "start")
        return bool(starts) and starts[-1].get("forward_only") is True

    def schedule(self, stage: int) -> str:
        """The schedule `stage` ran (its last start line's config; `zerolock` for runs from before schedules)."""
        starts = self.of_type(stage, "start")
        return (starts[-1].get("config") or {}).get("schedule", "zerolock") if starts else "zerolock"


def stage_files(run_dir: Path) -> dict[int, Path]:
    """`RUN_DIR/stages/stage_<k>/metrics.jsonl` by k."""
    found = {}
    for path in (Path(run_dir) / STAGES_DIR).glob(f"stage_*/{METRICS}"):
        match = re.fullmatch(r"stage_(\d+)", path.parent.name)
        if match and path.is_file():
            found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def read_lines(path: Path) -> list[dict]:
    """Parse and check one metrics file.

    Raises:
        ZLError: a line that is not a JSON object, has no `type`, or has a
            field of the wrong type; the message names the file and line.
    """
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, text in enumerate(f, start=1):
            if not text.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:
                raise ZLError(f"{where}: not valid JSON ({e.msg} at column {e.colno}): {_clip(text)}; "
                              "fix or delete that line and run `zl report` again.") from e
            if not isinstance(record, dict) or not isinstance(record.get("type"), str):
                raise ZLError(f"{where}: expected a JSON object with a string \"type\", got {_clip(text)}.")
            _check_fields(record, where)
            records.append(record)
    return records


def read_metrics(run_dir: Path) -> MetricsLog:
    """Read a run's telemetry from the merged file and/or the per-stage files.

    Raises:
        ZLError: neither layout exists, or a malformed line (see `read_lines`).
    """
    run_dir = Path(run_dir)
    merged = run_dir / METRICS
    per_stage = stage_files(run_dir)
    if not merged.is_file() and not per_stage:
        raise ZLError(f"{run_dir}: no {METRICS} and no {STAGES_DIR}/stage_<k>/{METRICS}; is {run_dir} the "
                      "directory of a run (the one `zl train` wrote)?")
    result = MetricsLog()
    if merged.is_file():
        result.sources.append(merged)
        _add(result, read_lines(merged))
    covered = set(result.runner)
    for stage, path in per_stage.items():
        if stage in covered:
            log.info("%s: stage %d is already in %s; its per-stage file is not read", path, stage, merged)
            continue
        lines = [r for r in read_lines(path) if r["type"] in RUNNER_TYPES]
        others = sorted({r["stage"] for r in lines} - {stage})
        if others:
            raise ZLError(f"{path}: holds lines of stage(s) {others}, expected only stage {stage}; per-stage files "
                          f"are {STAGES_DIR}/stage_<k>/{METRICS} with stage k's lines.")
        result.sources.append(path)
        _add(result, lines)
    return result


def stage_lines(layout: RunLayout, num_stages: int) -> list[list[dict]]:
    """Every stage's own telemetry lines (RUN_DIR/stages/stage_<k>/metrics.jsonl), stage by stage.

    Raises:
        ZLError: a stage's file is missing or holds a malformed line (`read_lines`).
    """
    return [read_lines(layout.stage_metrics(k)) for k in range(num_stages)]


def merge_metrics(layout: RunLayout, num_stages: int, events: list[dict]) -> Path:
    """RUN_DIR/metrics.jsonl: every stage's lines (each stage's in its order; a stage without a file adds none),
    then `events`, the run's own (coordinator events, the `run` event). Both runtimes end a run with it."""
    lines: list[str] = []
    for k in range(num_stages):
        path = layout.stage_metrics(k)
        if path.is_file():
            lines += [ln for ln in path.read_text().splitlines() if ln.strip()]
    lines += [json.dumps(e) for e in events]
    layout.metrics.write_text("\n".join(lines) + "\n")
    return layout.metrics


class LineTail:
    """The complete lines of a telemetry file that grows while it is read (a runner's or a rank's metrics.jsonl),
    fed chunk by chunk: a line still being written waits for the chunk that ends it."""

    def __init__(self) -> None:
        self.offset = 0  # bytes of the file fed so far: where the next read starts
        self._partial = b""

    def feed(self, chunk: bytes) -> list[dict]:
        """The records of the lines `chunk` completes; a line that is not a JSON object is skipped."""
        self.offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        records = []
        for line in lines:
            try:
                record = json.loads(line.decode(errors="replace"))
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
        return records

    def read(self, path: Path) -> list[dict]:
        """`feed` with what `path` (a file on this host) holds past `offset`; nothing while it does not exist."""
        if not path.is_file():
            return []
        with open(path, "rb") as f:
            f.seek(self.offset)
            return self.feed(f.read())


def _add(result: MetricsLog, lines: list[dict]) -> None:
    for record in lines:
        if record["type"] in RUNNER_TYPES:
            result.runner.setdefault(record["stage"], []).append(record)
        elif record["type"] in EVENT_TYPES:
            result.events.append(record)


def _check_fields(record: dict, where: str) -> None:
    kind = record["type"]
    for key in _BOOL_KEYS.get(kind, ()):
        if key in record and not isinstance(record[key], bool):
            raise ZLError(f"{where}: {kind} line has {key}={record[key]!r}, expected true or false.")
    for key in _INT_KEYS.get(kind, ()):
        value = record.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ZLError(f"{where}: {kind} line has {key}={value!r}, expected a non-negative integer.")
    for key in _NUMBER_KEYS.get(kind, ()):
        value = record.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ZLError(f"{where}: {kind} line has {key}={value!r}, expected a number or null.")
        if isinstance(value, float) and not math.isfinite(value):
            # Python's json reads NaN/Infinity; the runner writes null instead, so treat them alike.
            record[key] = None


def _clip(text: str, limit: int = 80) -> str:
    text = text.strip()
    return repr(text if len(text) <= limit else text[:limit] + "…")
