"""The schedule table (zl_device/formats/schedule_table.py): every schedule's lists, and the C++ runner's lists
(`zl_schedule_ops`, from zl/pipeline_schedule.h and where backprop_loop.cpp steps) identical to them for every
backprop schedule, stage count, window size, run length and restart point."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest

from zl_device.formats.schedule_table import (BACKWARD, FORWARD, SCHEDULE_TABLE, STEP, max_in_flight, shown,
                                              stage_actions)
from zl_device.formats.schedules import SCHEDULES
from zl_device.formats.windows import WindowPlan

REPO = Path(__file__).resolve().parents[1]


def test_every_schedule_has_its_row():
    assert SCHEDULES == ("zerolock", "gpipe", "1f1b", "async")  # the names both runtimes and `zl train` take
    assert [name for name, rule in SCHEDULE_TABLE.items() if not rule.backprop] == ["zerolock"]
    assert [name for name, rule in SCHEDULE_TABLE.items() if not rule.flush] == ["async"]


def test_the_lists_as_the_papers_draw_them():
    """PipeDream's 1F1B without a flush; GPipe's forwards then backwards per window; 1F1B's warm-up per window;
    ZeroLock's forward and local backward back to back. The last stage never runs ahead."""
    plan = WindowPlan(6, 2)
    assert shown(stage_actions("async", 0, 3, plan)) == (
        "F0@0 F1@0 F2@0 B0@0 F3@0 B1@0 S1@0 F4@1 B2@0 F5@1 B3@0 S3@1 B4@1 B5@1 S5@2")
    assert shown(stage_actions("gpipe", 0, 3, plan)) == (
        "F0@0 F1@0 B0@0 B1@0 S1@0 F2@1 F3@1 B2@1 B3@1 S3@1 F4@2 F5@2 B4@2 B5@2 S5@2")
    assert shown(stage_actions("1f1b", 1, 3, WindowPlan(4, 4))) == "F0@0 F1@0 B0@0 F2@0 B1@0 F3@0 B2@0 B3@0 S3@0"
    for schedule in SCHEDULES:
        assert shown(stage_actions(schedule, 2, 3, WindowPlan(3, 2))) == "F0@0 B0@0 F1@0 B1@0 S1@0 F2@1 B2@1 S2@1"
    assert shown(stage_actions("zerolock", 0, 3, WindowPlan(3, 2), forward_only=True)) == "F0@0 F1@0 S1@0 F2@1 S2@1"
    assert shown(stage_actions("async", 0, 3, plan, first_micro_batch=2)) == (  # a restart at window 1's checkpoint
        "F2@0 F3@0 F4@1 B2@0 F5@1 B3@0 S3@1 B4@1 B5@1 S5@2")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_micro_batch_once_forward_then_backward_and_one_step_per_window(schedule):
    for num_stages in range(1, 5):
        for stage in range(num_stages):
            for n, m in ((9, 2), (9, 4), (5, 8)):
                plan = WindowPlan(n, m)
                actions = stage_actions(schedule, stage, num_stages, plan)
                kinds = [(a.kind, a.micro_batch) for a in actions if a.kind != STEP]
                assert sorted(kinds) == sorted([(FORWARD, i) for i in range(n)] + [(BACKWARD, i) for i in range(n)])
                live = []
                for a in actions:
                    if a.kind == FORWARD:
                        live.append(a.micro_batch)
                    elif a.kind == BACKWARD:
                        assert live and live.pop(0) == a.micro_batch  # backwards in forward order
                    else:
                        assert a.micro_batch in plan.micro_batches(a.version)  # S: the window it ends
                steps = [a.version for a in actions if a.kind == STEP]
                assert steps == list(range(plan.num_windows))
                ahead = max_in_flight(actions)
                if stage == num_stages - 1 or schedule == "zerolock":
                    assert ahead == 1
                elif schedule == "gpipe":
                    assert ahead == min(m, n)
                else:
                    assert ahead == min(num_stages - stage, m if schedule == "1f1b" else n, n)


@pytest.fixture(scope="module")
def schedule_ops_bin() -> Path:
    path = Path(os.environ.get("ZL_SCHEDULE_OPS_BIN", REPO / "build" / "runner" / "zl_schedule_ops"))
    if not path.is_file():
        pytest.skip(f"{path} not built; run `cmake --build build -j2 --target zl_schedule_ops`")
    return path


def test_the_runner_holds_the_same_table(schedule_ops_bin):
    """The C++ rows (runner/src/pipeline_schedule.cpp `pipeline_schedules`) are the Python rows, field for field, in
    order: a schedule added on one side only fails here."""
    out = subprocess.run([str(schedule_ops_bin), "--table"], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    assert json.loads(out) == [dataclasses.asdict(rule) for rule in SCHEDULE_TABLE.values()]


def test_the_runner_runs_the_same_lists(schedule_ops_bin):
    """Every schedule, K 1..5, every stage, runs of 1..11 micro-batches in windows of 1..5, from the start and from
    every window's checkpoint: the C++ lists equal the table's, action for action and version for version."""
    cases = [{"schedule": schedule, "stage": stage, "num_stages": num_stages, "num_micro_batches": n,
              "window_size": m, "first_micro_batch": first}
             for schedule in SCHEDULES
             for num_stages in range(1, 6) for stage in range(num_stages)
             for n in range(1, 12) for m in range(1, 6) for first in range(0, n, m)]
    out = subprocess.run([str(schedule_ops_bin)], input=json.dumps(cases), capture_output=True, text=True,
                         timeout=120, check=True).stdout
    runner = json.loads(out)
    assert len(runner) == len(cases) > 7000
    for case, line in zip(cases, runner):
        table = shown(stage_actions(case["schedule"], case["stage"], case["num_stages"],
                                    WindowPlan(case["num_micro_batches"], case["window_size"]),
                                    case["first_micro_batch"]))
        assert line == table, case
