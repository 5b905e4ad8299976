"""tools/bench_scaling.py, the K-devices-against-one benchmark, in seconds on tiny-random (its figures on SmolLM2 are
in docs/benchmarks.md, "K devices against one")."""

from __future__ import annotations

import json

import pytest

from conftest import load_tool


def test_the_scaling_benchmark_runs_one_device_and_a_pipeline_side_by_side(tmp_path, capsys):
    """One device (added when --ks leaves it out) and two under async: the one device has no links and sends nothing,
    the pipeline sends DATA down and GRADs up; both start from the same weights, so the same first-window loss; one
    ratio row divides the pipeline by the one device."""
    bench = load_tool("bench_scaling")
    results = bench.main(["--ks", "2", "--samples", "8", "--window", "4", "--schedules", "async", "--profiles", "local",
                          "--frozen-dtype", "int8", "--out", str(tmp_path / "bench"),
                          "--json", str(tmp_path / "bench.json")])
    one, two = results
    assert (one["k"], two["k"]) == (1, 2) and one["samples"] == two["samples"] == 8
    assert len(one["peak_pss_mib"]) == 1 and len(two["peak_pss_mib"]) == 2
    assert one["bytes_down_per_record"] == one["bytes_up_per_record"] == 0
    assert two["bytes_down_per_record"] > 0 and two["bytes_up_per_record"] > 0
    assert two["last_stage_first_loss"] == pytest.approx(one["last_stage_first_loss"], rel=1e-4)
    manifest = json.loads((tmp_path / "bench" / "round1-k2-local-async" / "manifest.json").read_text())
    assert manifest["frozen_dtype"] == "int8"  # --frozen-dtype reaches the export
    saved = json.loads((tmp_path / "bench.json").read_text())
    (row,) = saved["ratios"]
    assert row["k"] == 2 and row["speedup"] == pytest.approx(two["records_per_s"] / one["records_per_s"])
    assert row["pss_ratio"] == pytest.approx(max(two["peak_pss_mib"]) / one["peak_pss_mib"][0])
    printed = capsys.readouterr().out
    assert sum(line.startswith("| ") for line in printed.splitlines()) == 3  # header and the two runs
    assert "K=2 async on local links, split 0-1,2-3: records/s" in printed and "the one-device peak" in printed


@pytest.mark.parametrize("value", ["3=0-9,10-29", "x=0-29", "3", "3=uneven"])
def test_a_split_that_does_not_match_its_device_count_is_refused(value):
    bench = load_tool("bench_scaling")
    with pytest.raises(SystemExit, match="--split"):
        bench.parse_splits([value])
    assert bench.parse_splits(["2=0-1,2-3", "2=even", "2=default"]) == {2: ["0-1,2-3", "even", None]}
    assert bench.even_spec("tiny-random", 3) == "0-1,2-2,3-3"
