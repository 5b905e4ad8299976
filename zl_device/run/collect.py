"""`zl train`'s collect step: pull what the devices wrote, merge the telemetry, merge the checkpoints.

    RUN_DIR/logs/<device>/           runner output, configs, telemetry as pulled
    RUN_DIR/stages/stage_<k>/metrics.jsonl, RUN_DIR/metrics.jsonl (merged, with coordinator events)
    RUN_DIR/checkpoints/stage_<k>/window_*/
    RUN_DIR/adapter/                 the PEFT adapter of the whole model
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from zl_device.devices.backend import Device


def collect_metrics(run_dir: Path, devices, num_stages: int, events: list[dict]) -> Path:
    """Per-stage telemetry into RUN_DIR/stages/stage_<k>/, then the merged RUN_DIR/metrics.jsonl."""
    from zl_device.run.metrics_log import METRICS, STAGES_DIR

    lines: list[str] = []
    for k in range(num_stages):
        pulled = run_dir / "logs" / devices[k].name / METRICS
        target = run_dir / STAGES_DIR / f"stage_{k}" / METRICS
        if pulled.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(pulled, target)
            lines += [ln for ln in pulled.read_text().splitlines() if ln.strip()]
    lines += [json.dumps(e) for e in events]
    merged = run_dir / METRICS
    merged.write_text("\n".join(lines) + "\n")
    return merged


def collect(run_dir: Path, devices: list[Device], num_stages: int, events: list[dict], say):
    """Pull from `devices` (the stages', in stage order), write the metrics, merge the adapter.

    Returns:
        the zl_device.results.adapter.MergeResult.
    """
    from zl_device.devices.deploy import pull
    from zl_device.results.adapter import merge_checkpoints

    pull(devices, run_dir)
    collect_metrics(run_dir, devices, num_stages, events)
    merged = merge_checkpoints(run_dir / "checkpoints", run_dir / "manifest.json", run_dir / "adapter")
    say(f"merge: {merged.numel:,} LoRA parameters of window {merged.window} -> {run_dir / 'adapter'}")
    return merged
