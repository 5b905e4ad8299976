"""zl_device/formats: the run directory's layout, the telemetry tail and merge, and the package being a leaf."""

import ast
import json
from pathlib import Path

from conftest import REPO
from zl_device.formats.metrics_log import LineTail, merge_metrics, read_metrics
from zl_device.formats.run_layout import RunLayout, stage_config_index, stage_metrics


def test_run_layout_names_the_paths_the_readers_expect(tmp_path):
    layout = RunLayout(tmp_path)
    assert layout.stage_metrics(2) == tmp_path / "stages" / "stage_2" / "metrics.jsonl"
    assert stage_metrics(tmp_path / "elsewhere", 2) == tmp_path / "elsewhere" / "stage_2" / "metrics.jsonl"
    assert layout.stage_checkpoints(1) == tmp_path / "checkpoints" / "stage_1"
    assert layout.stage_config(3) == tmp_path / "stage_3.json" and stage_config_index("stage_3.json") == 3
    assert stage_config_index("stage_3.json.tmp") is None and stage_config_index("train_settings.json") is None
    assert layout.device_logs("local-0") == tmp_path / "logs" / "local-0"
    assert (layout.manifest.name, layout.metrics.name, layout.eval.name) == ("manifest.json", "metrics.jsonl",
                                                                           "eval.json")


def test_merge_keeps_each_stage_in_order_and_report_reads_it(tmp_path):
    """The merged file holds every stage's lines, then the run's events; read_metrics takes the stages from it and
    not again from the per-stage files next to it."""
    layout = RunLayout(tmp_path)
    for k in range(2):
        layout.stage_metrics(k).parent.mkdir(parents=True)
        layout.stage_metrics(k).write_text("".join(
            json.dumps({"type": "micro_batch", "stage": k, "window": 0, "micro_batch": i}) + "\n" for i in range(3)))
    merge_metrics(layout, 3, [{"type": "run", "start_unix_ms": 0, "end_unix_ms": 5, "samples": 3}])  # no stage 2
    read = read_metrics(tmp_path)
    assert read.sources == [layout.metrics]
    assert {k: [r["micro_batch"] for r in lines] for k, lines in read.runner.items()} == {0: [0, 1, 2], 1: [0, 1, 2]}
    assert [e["type"] for e in read.events] == ["run"]


def test_line_tail_waits_for_the_end_of_a_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = LineTail()
    assert tail.read(path) == []  # not there yet
    path.write_bytes(b'{"type": "start"}\n{"type": "micro_batch", "loss": 1.5, "name": "\xc3')  # cut mid-character
    assert tail.read(path) == [{"type": "start"}]
    with open(path, "ab") as f:
        f.write(b'\xa9"}\nnot json\n[1]\n')
    assert tail.read(path) == [{"type": "micro_batch", "loss": 1.5, "name": "é"}]
    assert tail.offset == path.stat().st_size


def test_formats_is_a_leaf():
    """zl_device/formats imports no other part of zl_device: devices/, run/, results/ and torch/ build on it."""
    for path in sorted((REPO / "zl_device" / "formats").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith("zl_device.") or name.startswith("zl_device.formats"), (
                    f"{Path(path).name} imports {name}")
