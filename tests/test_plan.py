"""`zl plan` (issue 27 item 1): the split optimiser against brute force, the cost fits, the plan file, the cache,
and every bad input as one line. Fast: no device runs here (tests/test_plan_e2e.py calibrates real runners)."""

from __future__ import annotations

import itertools
import json
import math
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from zl_base.errors import ZLError
from zl_device.plan import calibrate as cal
from zl_device.plan.costs import Linear, Measured, StageCost, measure
from zl_device.plan.plan_file import Plan, StagePrediction, check_plan_matches, read_plan, write_plan
from zl_device.plan.planner import PlanSettings, choose_split, make_plan, mem_available_mib, resolve_stages
from zl_device.run.split import best_split
from zl_device.run.train_settings import TrainSettings
from zl_export.data_settings import DataSettings
from zl_export.options import ModelSplit

REPO = Path(__file__).resolve().parent.parent

# --- the optimiser against brute force -------------------------------------------------------------------------


def compositions(total: int, parts: int):
    """Every way to write `total` as `parts` positive counts, in order."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(parts))


def brute_force(num_layers, num_stages, cost, fits):
    """(slowest, sum) of the best feasible split by trying them all; None when none fits."""
    best = None
    for counts in compositions(num_layers, num_stages):
        ranges, first = [], 0
        for n in counts:
            ranges.append((first, first + n - 1))
            first += n
        if not all(fits(k, a, b) for k, (a, b) in enumerate(ranges)):
            continue
        costs = [cost(k, a, b) for k, (a, b) in enumerate(ranges)]
        value = (max(costs), sum(costs))
        if best is None or value[0] < best[0] - 1e-9 or (abs(value[0] - best[0]) <= 1e-9 and value[1] < best[1]):
            best = value
    return best


def random_case(rng: random.Random, num_layers: int, num_stages: int, linear: bool):
    """Per-stage costs (linear in the layer count as the planner's, or arbitrary per layer with a fixed part) and
    memory limits that sometimes leave no split."""
    fixed = [rng.uniform(0, 50) for _ in range(num_stages)]
    if linear:
        slope = [rng.uniform(1, 20) for _ in range(num_stages)]
        per_layer = [[slope[k]] * num_layers for k in range(num_stages)]
    else:
        per_layer = [[rng.choice([1, 2, 3, 5, 8]) for _ in range(num_layers)] for _ in range(num_stages)]
    mem_fixed = [rng.uniform(0, 5) for _ in range(num_stages)]
    mem_slope = [rng.uniform(1, 3) for _ in range(num_stages)]
    budget = [rng.choice([math.inf, rng.uniform(2, 3 + 2 * num_layers)]) for _ in range(num_stages)]

    def cost(k, a, b):
        return fixed[k] + sum(per_layer[k][a:b + 1])

    def fits(k, a, b):
        return mem_fixed[k] + mem_slope[k] * (b - a + 1) <= budget[k]

    return cost, fits


@pytest.mark.parametrize("linear", [True, False], ids=["linear", "per-layer"])
def test_best_split_equals_brute_force_on_every_small_case(linear):
    rng = random.Random(27)
    checked = infeasible = 0
    for num_layers in range(1, 9):
        for num_stages in range(1, min(num_layers, 4) + 1):
            for _ in range(40):
                cost, fits = random_case(rng, num_layers, num_stages, linear)
                expected = brute_force(num_layers, num_stages, cost, fits)
                got = best_split(num_layers, num_stages, cost, fits)
                checked += 1
                if expected is None:
                    assert got is None
                    infeasible += 1
                    continue
                assert got is not None
                assert got.slowest_ms == pytest.approx(expected[0]) and got.total_ms == pytest.approx(expected[1])
                # The split it returns is a real one: consecutive, covering, feasible, with the figures it claims.
                assert got.ranges[0][0] == 0 and got.ranges[-1][1] == num_layers - 1
                assert all(b2 == a1 - 1 for (_, b2), (a1, _) in zip(got.ranges, got.ranges[1:]))
                assert all(fits(k, a, b) for k, (a, b) in enumerate(got.ranges))
                assert got.slowest_ms == pytest.approx(max(cost(k, a, b) for k, (a, b) in enumerate(got.ranges)))
    assert checked > 500 and 0 < infeasible < checked  # both kinds of case were seen


def test_the_split_gives_the_slow_device_fewer_layers():
    # Device 1 at half speed: 30 layers of 10 ms (20 ms there) and 5 ms fixed -> 12, 6, 12 layers.
    speed = [10.0, 20.0, 10.0]
    best = best_split(30, 3, lambda k, a, b: 5 + speed[k] * (b - a + 1))
    assert best.counts == (12, 6, 12) and best.spec == "0-11,12-17,18-29"
    assert best.slowest_ms == pytest.approx(125.0)


def test_more_stages_than_layers_is_refused_by_the_optimiser():
    with pytest.raises(ValueError):
        best_split(2, 3, lambda k, a, b: 1.0)


# --- fits and measurements ---------------------------------------------------------------------------------------


def test_linear_fit_recovers_fixed_and_per_layer_cost_and_clamps_noise():
    line = Linear.fit([(1, 15.0), (3, 35.0)])
    assert line.fixed == pytest.approx(5.0) and line.per_layer == pytest.approx(10.0)
    assert Linear.fit([(1, 20.0), (3, 18.0)]) == Linear(19.0, 0.0)  # faster with more layers: noise, flat
    assert Linear.fit([(1, 7.0), (1, 9.0)]) == Linear(8.0, 0.0)  # one layer count: nothing to fit a slope on


def mb(i, p1, p2, send=0.0, queue=0.0, extra=1.0, pss=100.0):
    return {"type": "micro_batch", "micro_batch": i, "phase1_ms": p1, "phase2_ms": p2, "send_ms": send,
            "queue_ms": queue, "total_ms": p1 + p2 + send + queue + extra, "pss_mib": pss}


def test_measure_skips_the_warm_up_and_takes_the_send_without_back_pressure():
    lines = [mb(0, 900, 900, pss=50), mb(1, 500, 500)]  # warm-up: slow, left out
    lines += [mb(2, 10, 20, send=2, queue=40), mb(3, 12, 22, send=30), mb(4, 11, 21, send=3, pss=120)]
    lines += [{"type": "window", "window": 0, "pss_mib": 130.0}]
    m = measure(3, lines)
    assert (m.phase1_ms, m.phase2_ms) == (11, 21)
    assert m.other_ms == pytest.approx(2 + 1)  # the smallest send (the others waited) + accumulate
    assert m.pss_mib == 130.0 and m.micro_batches == 3 and m.layers == 3
    assert measure(1, lines[:2]) is None  # nothing past the warm-up


def test_a_backprop_stages_wait_for_its_gradient_is_not_its_cost():
    """Under a backprop schedule a micro-batch's total_ms holds the wait for its gradient (grad_wait_ms): the
    downstream stages' time. It is not the stage's own: measured, it would hand the stage fewer layers the longer
    the others take."""
    lines = [mb(i, 10, 20, send=2) for i in range(2)]
    lines += [{**mb(i, 10, 20, send=2, extra=1.0 + 300.0), "grad_wait_ms": 300.0} for i in range(2, 5)]
    m = measure(3, lines)
    assert m.other_ms == pytest.approx(2 + 1)


def test_the_schedule_is_in_the_calibration_key():
    """A backprop stage runs another program than a ZeroLock one (and with --keep-activations one forward less):
    a plan for one does not take the other's figures."""
    from zl_device.devices.registry import parse_devices

    spec_ = parse_devices("local:3")
    runs = [settings(stage_lr=(1.0,)), settings(schedule="async"), settings(schedule="async", keep_activations=True)]
    for k in range(3):
        keys = [json.dumps(cal.cache_key(s, spec_, k, None), sort_keys=True) for s in runs]
        assert len(set(keys)) == 3, k


def cost(fixed_ms, per_layer_ms, pss_fixed=100.0, pss_per_layer=10.0) -> StageCost:
    half = Linear(fixed_ms / 2, per_layer_ms / 2)
    return StageCost(half, half, Linear(0.0, 0.0), Linear(pss_fixed, pss_per_layer))


def test_stage_cost_fits_two_rounds_and_round_trips():
    rounds = [Measured(1, 10, 20, 2, 110, 6), Measured(3, 30, 40, 2, 130, 6)]
    c = StageCost.fit(rounds)
    assert c.ms(1) == pytest.approx(32) and c.ms(3) == pytest.approx(72) and c.ms(10) == pytest.approx(212)
    assert c.pss_mib(10) == pytest.approx(200)
    assert StageCost.from_json(json.loads(json.dumps(c.to_json()))) == c


def test_a_forward_only_stage_costs_its_phase_1_and_send_and_gets_more_layers():
    """A stage held still by lr 0 runs no phase 2 (docs/design#windows-and-adamw): its time per micro-batch is phase 1 +
    other, so the split hands it more layers; a forward-only run's own lines (phase2_ms 0, null losses) measure."""
    c = StageCost(Linear(1.0, 2.0), Linear(3.0, 4.0), Linear(0.5, 0.0), None)
    assert c.ms(5, forward_only=True) == pytest.approx(1 + 10 + 0.5)
    assert c.ms(5) == pytest.approx(1 + 10 + 3 + 20 + 0.5)
    costs = [c, c, c]
    names = ["local-0", "local-1", "local-2"]
    even = choose_split(costs, 30, [None] * 3, names)
    held = choose_split(costs, 30, [None] * 3, names, forward_only=[True, True, False])
    assert even.counts == (10, 10, 10)
    assert held.counts[0] > 10 and held.counts[1] > 10 and held.counts[2] < 10
    lines = [{**mb(i, 10, 0, send=1), "loss": None, "forward_only": True} for i in range(5)]
    m = measure(2, lines)
    assert (m.phase1_ms, m.phase2_ms) == (10, 0)


def test_a_forward_only_stage_prediction_leaves_its_phase_2_out_and_old_plans_read(tmp_path):
    held = StagePrediction(0, "local-0", (0, 1), 5.0, 10.0, 1.0, 120.0, 1000.0, forward_only=True)
    assert held.total_ms == 6.0
    plan = a_plan(per_stage=[held] + a_plan().per_stage[1:])
    back = read_plan(write_plan(plan, tmp_path / "plan.json"))
    assert back.per_stage[0].forward_only and back.to_json() == plan.to_json()
    assert back.to_json()["per_stage"][0]["total_ms"] == 6.0
    old = plan.to_json()
    for p in old["per_stage"]:
        del p["forward_only"]  # a plan written before the field
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert not any(p.forward_only for p in read_plan(tmp_path / "old.json").per_stage)


def test_the_plan_counts_the_stages_the_default_holds_still():
    """Without --stage-lr the planner takes `zl train`'s default (default_stage_lr): the stages before the last
    run forward only, so their phase 2 must not be counted; a given --stage-lr wins."""
    from zl_device.plan.planner import forward_only_stages

    auto = replace(TrainSettings(schedule="zerolock"), split=ModelSplit(stages="auto", num_stages=3))
    assert forward_only_stages(auto, 3) == [True, True, False]
    assert forward_only_stages(auto, 4) == [True, True, True, False]
    assert forward_only_stages(replace(auto, stage_lr=(1.0,)), 3) == [False, False, False]
    assert forward_only_stages(replace(auto, stage_lr=(0.0, 1.0, 1.0)), 3) == [True, False, False]


def test_a_calibration_round_runs_each_stage_in_its_role_and_caches_it_so(cache):
    """A stage the run holds still is calibrated forward only (lr 0), as it will run: its PSS is a held stage's
    (no readout pages, no optimizer state), not a trained one's. The role is in the cache key: a plan that trains
    every stage does not take the held stages' figures."""
    from zl_device.devices.registry import parse_devices

    held, trained = settings(stage_lr=None), settings(stage_lr=(1.0,))
    assert cal.round_settings(held, 1, Path("r")).stage_lr == (0.0, 0.0, 1.0)
    assert cal.round_settings(trained, 1, Path("r")).stage_lr == (1.0, 1.0, 1.0)
    assert cal.round_settings(settings(stage_lr=(0.0, 1.0, 0.5)), 1, Path("r")).stage_lr == (0.0, 1.0, 1.0)
    spec_ = parse_devices("local:3")
    keys = {k: (cal.cache_key(held, spec_, k, None), cal.cache_key(trained, spec_, k, None)) for k in range(3)}
    assert [keys[k][0]["forward_only"] for k in range(3)] == [True, True, False]
    assert keys[0][0] != keys[0][1] and keys[2][0] == keys[2][1]  # the last stage trains in both


# --- memory budgets -------------------------------------------------------------------------------------------


def test_a_device_that_cannot_hold_one_layer_is_named_with_the_shortfall():
    costs = [cost(10, 10), cost(10, 10, pss_fixed=500), cost(10, 10)]
    with pytest.raises(ZLError, match=r"^no split fits the memory budgets: local-1 \(stage 1\) needs 510 MiB for a "
                                      r"single layer and has a budget of 300 MiB \(210 MiB short\)"):
        choose_split(costs, 30, [300.0, 300.0, 300.0], ["local-0", "local-1", "local-2"])


def test_budgets_that_hold_too_few_layers_name_the_cheapest_fix():
    # Each device holds 100 + 10 n <= 200 MiB: 10 layers, 30 in all; 32 layers leave 2 over.
    costs = [cost(10, 10), cost(10, 10, pss_per_layer=5), cost(10, 10)]
    budgets = [200.0, 150.0, 200.0]  # local-1: 100 + 5 n <= 150 -> 10 layers
    with pytest.raises(ZLError, match=r"hold at most 30 \(local-0 10, local-1 10, local-2 10\); 2 more layer\(s\) fit "
                                      r"on local-1 with 10 MiB more \(--memory-limit 160 for it\)"):
        choose_split(costs, 32, budgets, ["local-0", "local-1", "local-2"])
    best = choose_split(costs, 30, budgets, ["local-0", "local-1", "local-2"])
    assert best.counts == (10, 10, 10)  # the only split that fits, though not the fastest


def test_budgets_come_from_each_phone_or_from_this_host_shared(monkeypatch):
    from zl_device.devices import registry
    from zl_device.plan.planner import MEMORY_SHARE, memory_budgets

    class Phone:
        def __init__(self, serial):
            self.serial = serial

        def shell(self, command, action=""):
            assert command == "cat /proc/meminfo"
            return f"MemTotal: 8000000 kB\nMemAvailable: {1024 * (1000 if self.serial == 'A1' else 3000)} kB\n"

    monkeypatch.setattr(registry, "open_phone", lambda serial, **kw: Phone(serial))
    phones = registry.parse_devices("A1,B2")
    assert memory_budgets(phones, ["A1", "B2"], None) == [MEMORY_SHARE * 1000, MEMORY_SHARE * 3000]
    assert memory_budgets(phones, ["A1", "B2"], (500.0, 700.0)) == [500.0, 700.0]
    local = memory_budgets(registry.parse_devices("local:3"), ["local-0", "local-1", "local-2"], None)
    host = mem_available_mib(Path("/proc/meminfo").read_text())
    assert local[0] == local[2] and local[0] == pytest.approx(MEMORY_SHARE * host / 3, rel=0.2)


def test_mem_available_is_read_from_meminfo():
    assert mem_available_mib("MemTotal: 4096 kB\nMemAvailable:    2048 kB\n") == 2.0
    assert mem_available_mib("MemTotal: 4096 kB\n") is None


# --- the plan file ------------------------------------------------------------------------------------------------


def a_plan(**kw) -> Plan:
    per_stage = [StagePrediction(0, "local-0", (0, 1), 5.0, 10.0, 1.0, 120.0, 1000.0),
                 StagePrediction(1, "local-1", (2, 2), 4.0, 9.0, 1.0, 110.0, 1000.0),
                 StagePrediction(2, "local-2", (3, 3), 0.0, 14.0, 0.0, 100.0, 1000.0)]
    fields = dict(stages="0-1,2-2,3-3", model="tiny-random", num_layers=4, seq_len=32, micro_batch=1,
                  frozen_dtype="bf16", max_targets=4, devices="local:3", device_names=["local-0", "local-1", "local-2"],
                  mode="binary", cpu_quota=[1.0, 0.5, 0.75], per_stage=per_stage, even_stages="0-1,2-2,3-3",
                  even_slowest_ms=16.0)
    return Plan(**{**fields, **kw})


def test_the_plan_file_round_trips_and_reports_the_slowest_stage(tmp_path):
    plan = a_plan(link_mbps=100.0, link_ms=20.0, embedding_dtype="int8")
    path = write_plan(plan, tmp_path / "p" / "plan.json")
    back = read_plan(path)
    assert back.to_json() == plan.to_json()
    assert back.slowest_ms == 20.0  # the link is slower than every stage
    assert a_plan().slowest_ms == 16.0


def test_a_bad_plan_file_is_one_line(tmp_path):
    with pytest.raises(ZLError, match=r"--stages .*missing.json: no such file; make the plan with `zl plan"):
        read_plan(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ZLError, match="not valid JSON"):
        read_plan(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text('{"stages": "0-1,2-3"}')
    with pytest.raises(ZLError, match="not a plan written by `zl plan`"):
        read_plan(tmp_path / "other.json")


def test_a_plan_for_other_settings_is_refused_with_its_stages_as_the_fix():
    plan = a_plan()
    check_plan_matches(plan, "--stages p.json", model="tiny-random", seq_len=32, devices="local:3",
                       cpu_quota=[1.0, 0.5, 0.75], checked_devices=True)
    with pytest.raises(ZLError, match=r"made for --seq-len 32, this command has --seq-len 64; .*--stages 0-1,2-2,3-3"):
        check_plan_matches(plan, "--stages p.json", model="tiny-random", seq_len=64)
    with pytest.raises(ZLError, match=r"made for --cpu-quota 1,0.5,0.75, this command has --cpu-quota none"):
        check_plan_matches(plan, "--stages p.json", model="tiny-random", devices="local:3", cpu_quota=None,
                           checked_devices=True)
    # --embedding-dtype: unset is as --frozen-dtype, on either side
    check_plan_matches(plan, "--stages p.json", model="tiny-random", frozen_dtype="bf16", embedding_dtype="bf16")
    with pytest.raises(ZLError, match=r"made for --embedding-dtype bf16, this command has --embedding-dtype int8"):
        check_plan_matches(plan, "--stages p.json", model="tiny-random", frozen_dtype="bf16", embedding_dtype="int8")
    mixed = a_plan(frozen_dtype="int4", embedding_dtype="bf16")
    check_plan_matches(mixed, "--stages p.json", model="tiny-random", frozen_dtype="int4", embedding_dtype="bf16")
    with pytest.raises(ZLError, match=r"made for --embedding-dtype bf16, this command has --embedding-dtype int4"):
        check_plan_matches(mixed, "--stages p.json", model="tiny-random", frozen_dtype="int4")


def test_train_takes_a_plan_file(tmp_path):
    path = write_plan(a_plan(), tmp_path / "plan.json")  # every stage trains in it
    s = TrainSettings(split=ModelSplit("tiny-random", stages=str(path)), cpu_quota=(1.0, 0.5, 0.75), stage_lr=(1.0,))
    resolved, plan = resolve_stages(s, say=lambda line: None)
    assert resolved.split.stages == "0-1,2-2,3-3" and resolved.rows.seq_len == 32 and plan.stages == resolved.split.stages
    resolved.validate()
    with pytest.raises(ZLError, match="made for --devices local:3, this command has --devices local:4"):
        resolve_stages(replace(s, devices="local:4", cpu_quota=(1.0, 0.5, 0.75, 1.0)), say=lambda line: None)
    plain = replace(s, split=ModelSplit("tiny-random", stages="0-1,2-3"))
    assert resolve_stages(plain)[0] is plain  # layer ranges stay as they are


def test_a_plan_made_with_other_stages_held_still_is_refused(tmp_path):
    """A plan balances the stages' costs for the stages it holds still (forward only); a run that holds others still
    (--stage-lr's default holds all but the last) would be paced wrongly by it, so it is named, with the fix."""
    every = write_plan(a_plan(), tmp_path / "every.json")
    s = TrainSettings(split=ModelSplit("tiny-random", stages=str(every)), cpu_quota=(1.0, 0.5, 0.75))
    with pytest.raises(ZLError, match=r"^--stages .*every.json: the plan was made with stages held still \(forward "
                                      r"only\): none; this run \(--stage-lr's default\) holds 0, 1, so the split "
                                      r"would pace it wrongly\. Run `zl plan` with this run's --stage-lr, or pass "
                                      r"the plan's stages yourself \(--stages 0-1,2-2,3-3\)\.$"):
        resolve_stages(s, say=lambda line: None)
    held = write_plan(a_plan(per_stage=[replace(p, forward_only=p.stage < 2) for p in a_plan().per_stage]),
                      tmp_path / "held.json")
    on_held = replace(s, split=ModelSplit("tiny-random", stages=str(held)))
    assert resolve_stages(on_held, say=lambda line: None)[0].split.stages == "0-1,2-2,3-3"
    with pytest.raises(ZLError, match=r"held still \(forward only\): 0, 1; this run \(--stage-lr 0,1,1\) holds 0,"):
        resolve_stages(replace(on_held, stage_lr=(0.0, 1.0, 1.0)), say=lambda line: None)


def test_a_plan_timed_under_another_schedule_is_refused(tmp_path):
    """A backprop stage runs another program than a ZeroLock one (and without --keep-activations a second forward),
    so a plan keeps the schedule its stages were timed under, and a run under another is named, with the fix."""
    path = write_plan(a_plan(schedule="async"), tmp_path / "async.json")  # every stage trains, as async's do
    assert read_plan(path).schedule == "async" and not read_plan(path).keep_activations
    from zl.commands.plan import plan_table
    assert plan_table(read_plan(path)).title.endswith("bf16, --schedule async; ms per micro-batch, MiB")
    assert plan_table(a_plan()).title.endswith("bf16; ms per micro-batch, MiB")  # a plan from before the field
    assert "int4, embedding and head bf16;" in plan_table(a_plan(frozen_dtype="int4", embedding_dtype="bf16")).title
    s = TrainSettings(split=ModelSplit("tiny-random", stages=str(path)), cpu_quota=(1.0, 0.5, 0.75), schedule="async")
    assert resolve_stages(s, say=lambda line: None)[0].split.stages == "0-1,2-2,3-3"
    assert resolve_stages(replace(s, schedule="pipedream"), say=lambda line: None)[0].split.stages == "0-1,2-2,3-3"
    with pytest.raises(ZLError, match=r"^--stages .*async.json: the plan was timed under --schedule async, this run "
                                      r"trains with --schedule async --keep-activations, so the split would pace it "
                                      r"wrongly\. Run `zl plan --schedule async --keep-activations` with this run's "
                                      r"other options, or pass the plan's stages yourself \(--stages 0-1,2-2,3-3\)\.$"):
        resolve_stages(replace(s, keep_activations=True), say=lambda line: None)
    held = [replace(p, forward_only=p.stage < 2) for p in a_plan().per_stage]  # zerolock's default: 0, 1 held
    zerolock = write_plan(a_plan(per_stage=held, schedule="zerolock"), tmp_path / "zerolock.json")
    with pytest.raises(ZLError, match=r"timed under --schedule zerolock, this run trains with --schedule 1f1b, .*"
                                      r"Run `zl plan --schedule 1f1b` with"):
        resolve_stages(replace(s, schedule="1f1b", split=ModelSplit("tiny-random", stages=str(zerolock))),
                       say=lambda line: None)


def test_export_takes_a_plan_file(tmp_path):
    from zl_device.plan.plan_file import split_of_plan
    from zl_export.options import ExportOptions

    path = write_plan(a_plan(), tmp_path / "plan.json")
    split = split_of_plan(ModelSplit("tiny-random", stages=str(path)), ExportOptions(seq_len=32))
    assert split.stages == "0-1,2-2,3-3" and split.count == 3
    with pytest.raises(ZLError, match="made for --model tiny-random, this command has --model tinyllama-random"):
        split_of_plan(ModelSplit("tinyllama-random", stages=str(path)), ExportOptions(seq_len=32))
    with pytest.raises(ZLError, match="--stages auto plans on the devices, and zl export has none"):
        split_of_plan(ModelSplit("tiny-random", stages="auto"), ExportOptions())


# --- planning from the cache, and the settings checked before anything runs -------------------------------------


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A calibration cache of its own and a stand-in runner build (its identity is part of a local device's)."""
    runner = tmp_path / "zl_runner"
    runner.write_text("#!/bin/sh\nexit 0\n")
    monkeypatch.setenv("ZL_RUNNER_BIN", str(runner))
    monkeypatch.setenv("ZL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def settings(**kw) -> TrainSettings:
    kw.setdefault("split", ModelSplit("tiny-random"))
    kw.setdefault("devices", "local:3")
    kw.setdefault("stage_lr", (1.0,))  # every stage trains: the costs below count both phases
    return TrainSettings(rows=DataSettings(seq_len=32), **{"schedule": "zerolock", **kw})


def seed_cache(s: TrainSettings, speeds: list[float], pss: tuple[float, float] = (50.0, 5.0)) -> None:
    """Cache entries as a calibration would write them: stage k costs 2 + speeds[k] ms per layer, and holds
    pss[0] + pss[1] x layers MiB."""
    from zl_device.devices.registry import check_cpu_quota_fits, parse_devices

    spec_ = parse_devices(s.devices)
    quotas = check_cpu_quota_fits(spec_, s.cpu_quota)
    for k, speed in enumerate(speeds):
        key = cal.cache_key(s, spec_, k, quotas[k])
        rounds = [Measured(n, speed * n / 2, 2 + speed * n / 2, 0.0, pss[0] + pss[1] * n, 6) for n in (1, 3)]
        path = cal.cache_file(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "num_layers": 4, "hidden_size": 64, "seq_len": 32, "max_targets": 4,
                                    "rounds": [m.to_json() for m in rounds],
                                    "fit": StageCost.fit(rounds).to_json()}))


def test_a_second_plan_reads_the_cache_and_runs_nothing(cache, monkeypatch):
    s = settings(cpu_quota=(0.5, 1.0, 1.0))
    seed_cache(s, [20.0, 10.0, 12.0])  # ms per layer; 2 ms fixed
    monkeypatch.setattr(cal, "_measure", lambda *a, **k: pytest.fail("calibrated although every stage is cached"))
    said = []
    plan = make_plan(s, PlanSettings(), say=said.append)
    assert plan.stages == "0-0,1-2,3-3"  # the half-speed first device gets one layer: 22, 22, 14 ms
    assert [p.total_ms for p in plan.per_stage] == pytest.approx([22.0, 22.0, 14.0])
    assert plan.slowest_ms == pytest.approx(22.0)
    assert plan.even_stages == "0-1,2-2,3-3" and plan.even_slowest_ms == pytest.approx(42.0)
    assert plan.per_stage[1].pss_mib == pytest.approx(60.0) and plan.per_stage[1].budget_mib > 0
    assert plan.entry_bytes == 32 * 64 * 4 + 2 * 32 * 8
    assert any("calibration: cached" in line for line in said)
    # Another quota is another device: its calibration is not in the cache.
    with pytest.raises(pytest.fail.Exception, match="calibrated although"):
        make_plan(replace(s, cpu_quota=(0.25, 1.0, 1.0)), PlanSettings(), say=said.append)


def test_a_memory_limit_moves_layers_off_a_device(cache, monkeypatch):
    s = settings()
    s = replace(s, export=replace(s.export, recompute=True))  # already recomputing: nothing more to try
    seed_cache(s, [10.0, 10.0, 10.0])  # PSS 50 + 5 n MiB
    monkeypatch.setattr(cal, "_measure", lambda *a, **k: pytest.fail("calibrated"))
    assert make_plan(s, PlanSettings()).stages == "0-0,1-1,2-3"  # equal devices: ties go to the later stages
    plan = make_plan(s, PlanSettings(memory_limit=(100.0, 100.0, 58.0)))  # local-2 holds one layer only
    assert plan.stages == "0-0,1-2,3-3" and plan.per_stage[2].budget_mib == 58.0
    with pytest.raises(ZLError, match=r"local-0 \(stage 0\) needs 55 MiB for a single layer .* \(5 MiB short\)"):
        make_plan(s, PlanSettings(memory_limit=(50.0,)))


def test_a_plan_turns_recompute_on_only_when_nothing_fits_without_it(cache, monkeypatch, tmp_path):
    """Without --recompute every device needs 55 MiB for one layer; with it 32 MiB + 2 per layer, 1.3x slower.
    A budget of 52 MiB fits only recomputing: the plan calibrates again with it, records it, and `zl train
    --stages plan.json` trains with it (`zl export` asks for it); a budget that fits without it keeps it off."""
    from zl_device.plan.plan_file import split_of_plan
    from zl_export.options import ExportOptions

    s = settings()
    recomputing = replace(s, export=replace(s.export, recompute=True))
    seed_cache(s, [10.0, 10.0, 10.0])
    seed_cache(recomputing, [13.0, 13.0, 13.0], pss=(30.0, 2.0))
    monkeypatch.setattr(cal, "_measure", lambda *a, **k: pytest.fail("calibrated"))
    assert not make_plan(s, PlanSettings(memory_limit=(100.0,))).recompute
    said = []
    plan = make_plan(s, PlanSettings(memory_limit=(52.0,)), say=said.append)
    assert plan.recompute and plan.stages == "0-0,1-1,2-3" and max(p.pss_mib for p in plan.per_stage) <= 52
    assert plan.per_stage[0].total_ms == pytest.approx(15.0)  # the recomputing calibration's costs
    assert any("needs 55 MiB for a single layer" in line and "Calibrating again with --recompute" in line
               for line in said)
    path = write_plan(plan, tmp_path / "plan.json")
    assert read_plan(path).recompute
    resolved, _ = resolve_stages(replace(s, split=ModelSplit("tiny-random", stages=str(path))), say=said.append)
    assert resolved.export.recompute and resolved.split.stages == plan.stages
    assert "with --recompute" in said[-1]
    split = ModelSplit("tiny-random", stages=str(path))
    with pytest.raises(ZLError, match=r"fits its devices' memory only with --recompute .*; add --recompute"):
        split_of_plan(split, ExportOptions(seq_len=32))
    assert split_of_plan(split, ExportOptions(seq_len=32, recompute=True)).stages == plan.stages
    with pytest.raises(ZLError, match=r"needs 32 MiB for a single layer .* \(That is with --recompute"):
        make_plan(s, PlanSettings(memory_limit=(31.0,)), say=said.append)


def test_more_stages_than_layers_fails_before_any_export(cache):
    s = settings(devices="local:5", split=ModelSplit("tiny-random", num_stages=5))
    with pytest.raises(ZLError, match=r"^--num-stages 5: tiny-random has only 4 layers, so at most 4 stages"):
        make_plan(s, PlanSettings(), say=lambda line: None)
    assert not any((cache / "exports").glob("*"))  # no export was started


@pytest.mark.parametrize("kw, message", [
    (dict(cpu_quota=(0.0,)), r"--cpu-quota 0: 0 is out of range; each value is the CPUs one local device may use"),
    (dict(cpu_quota=(1.0, -0.5, 1.0)), r"--cpu-quota 1,-0.5,1: -0.5 is out of range"),
    (dict(cpu_quota=(1e6,)), r"--cpu-quota 1e\+06: 1e\+06 is out of range; .*at most this host's"),
    (dict(cpu_quota=(1.0, 0.5)), r"--cpu-quota 1,0.5: 2 values for 3 local devices; give one value for every"),
    (dict(devices="A123,B456,C789", cpu_quota=(0.5,)), r"--cpu-quota: phones run at their own speed"),
    (dict(devices="local:2"), r"--devices local:2 gives 2 device\(s\); a plan for 3 stages needs 3"),
    (dict(runtime="torch"), r"--stages auto plans for the ExecuTorch runners"),
    (dict(split=ModelSplit("tiny-random", stages="0-1,2-3")), r"zl plan chooses the stages itself; drop --stages"),
    (dict(stage_lr=(1.0, 2.0)), r"^--stage-lr 1,2: 2 values for 3 stages; give one value for every stage or exactly 3"),
    (dict(stage_lr=(0.0,)), r"^--stage-lr 0: learning-rate multipliers must be 0 \(the stage does not train\) or"),
])
def test_bad_plan_settings_are_one_line_errors(cache, kw, message):
    with pytest.raises(ZLError, match=message):
        make_plan(settings(**kw), PlanSettings(), say=lambda line: None)


@pytest.mark.parametrize("plan_kw, message", [
    (dict(memory_limit=(0.0,)), r"--memory-limit 0: give each device's memory budget in MiB"),
    (dict(memory_limit=(100.0, 200.0)), r"--memory-limit: 2 values for 3 stages"),
    (dict(link_mbps=-1.0), r"--link-mbps -1: the link between stages in Mbit/s must be positive"),
])
def test_bad_plan_options_are_one_line_errors(cache, plan_kw, message):
    with pytest.raises(ZLError, match=message):
        make_plan(settings(), PlanSettings(**plan_kw), say=lambda line: None)


def test_the_cli_says_a_bad_quota_in_one_line_with_exit_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "zl.cli", "plan", "--model", "tiny-random", "--cpu-quota", "1,0,1",
                          "--out", str(tmp_path / "plan.json")], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "--cpu-quota 1,0,1: 0 is out of range" in out.stderr
    train = subprocess.run([sys.executable, "-m", "zl.cli", "train", "--model", "tiny-random", "--cpu-quota", "2,1",
                            "--out", str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True)
    assert train.returncode == 2 and "--cpu-quota 2,1: 2 values for 3 local devices" in train.stderr


# --- the default split without --stages (zl_device/plan/default_split.py) -------------------------------------


SMOLLM2 = dict(num_layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, vocab=49152)


def test_the_default_split_balances_a_backprop_schedule_as_zl_plan_measured_it():
    """SmolLM2, seq 128, 4 target slots, 3 stages under async: the stages before the last run 3.3 forwards' worth per
    layer, the last 2.3 plus its readout, so 0-8,9-17,18-29, the split `zl plan --schedule async` chose from measured
    rounds (docs/benchmarks.md); with --keep-activations (the same per layer everywhere) the last stage's readout
    gives it a layer less; one stage has nothing to balance."""
    from zl_device.formats.stage_spec import stage_specs
    from zl_device.run.default_split import BACKPROP_UPSTREAM, TRAINED, ModelShape, default_split

    shape = ModelShape(**SMOLLM2)
    best, even = default_split(shape, stage_specs([2e-3] * 3, "async"), 128, 4)
    assert best.spec == "0-8,9-17,18-29" and even.spec == "0-9,10-19,20-29"
    head = 2 * shape.head_macs(4) / shape.layer_macs(128)  # the last stage's readout, in layer forwards
    assert best.slowest_ms / shape.layer_macs(128) == pytest.approx(12 * TRAINED + head)
    assert even.slowest_ms / shape.layer_macs(128) == pytest.approx(10 * BACKPROP_UPSTREAM)
    kept, _ = default_split(shape, stage_specs([2e-3] * 3, "async"), 128, 4, keep_activations=True)
    assert kept.counts == (10, 11, 9)  # the head's passes make the last stage the heavy one
    assert default_split(shape, stage_specs([2e-3], "async"), 128, 4) is None


def test_the_default_split_stays_even_where_stages_are_held_still():
    """ZeroLock's default holds the stages before the last still: balancing would take layers off the one stage
    that trains (13/13/4 of 30), so the default stays even and only the hint names that split."""
    from zl_device.formats.stage_spec import stage_specs
    from zl_device.run.default_split import ModelShape, balanced_and_even, default_split

    shape, held = ModelShape(**SMOLLM2), stage_specs([0.0, 0.0, 2e-3], "zerolock")
    assert default_split(shape, held, 128, 4) is None
    best, even = balanced_and_even(shape, held, 128, 4)
    assert best.counts == (13, 13, 4) and even.counts == (10, 10, 10)


def test_model_shape_reads_every_family_config():
    """The cost model's view of a config: head_dim where the family sets it (Qwen3), else hidden / heads."""
    from zl_device.run.default_split import ModelShape
    from zl_export.model_source import load_config

    for name in ("tiny-random", "tiny-random-qwen2", "tiny-random-qwen3", "tiny-random-phi3", "tiny-random-gemma3"):
        config = load_config(name)
        shape = ModelShape.of(config)
        assert shape.num_layers == config.num_hidden_layers and shape.vocab == config.vocab_size, name
        assert shape.layer_macs(64) > shape.layer_macs(32) > 0 and shape.head_macs(4) > 0, name
    assert ModelShape.of(load_config("tiny-random-qwen3")).head_dim == load_config("tiny-random-qwen3").head_dim


def test_zl_train_says_which_split_it_takes_and_what_balancing_a_held_still_run_would_cost():
    """`with_default_split` (ExecuTorch runtime, no --stages): under async TinyLlama's 22 layers get a balanced split,
    said in one line and given to the export; under the held-still default the split stays even, and the line names
    the balanced one and the trained layers it would give up; --stages is taken as given."""
    from types import SimpleNamespace

    from zl_device.formats.stage_spec import stage_specs
    from zl_device.run.executorch_runtime import with_default_split

    def run(schedule, lrs, stages=None):
        said: list[str] = []
        s = TrainSettings(split=ModelSplit("tinyllama-random", stages))
        resolved = SimpleNamespace(stages=stage_specs(lrs, schedule), seq_len=128, max_targets=4, schedule=schedule)
        return with_default_split(SimpleNamespace(settings=s, resolved=resolved, say=said.append)), said

    balanced, (line,) = run("async", [2e-3] * 3)
    assert balanced.split.stages and balanced.split.stages != "0-7,8-14,15-21"
    assert line.startswith(f"split: {balanced.split.stages}, the stages' predicted costs balanced under --schedule "
                           "async") and "than the even 0-7,8-14,15-21" in line
    held, (line,) = run("zerolock", [0.0, 0.0, 2e-3])
    assert held.split.stages is None
    assert line.startswith("split: even (0-7,8-14,15-21); the stages held still wait on the trained one. --stages ")
    assert "layers instead of 7; or train every stage: --schedule async" in line
    given, said = run("async", [2e-3] * 3, stages="0-6,7-13,14-21")
    assert given.split.stages == "0-6,7-13,14-21" and not said


def test_a_calibration_rounds_split_is_never_replaced_by_the_default_one():
    """A calibration round's programs run layers 0..n-1 on every stage (CalibrationSplit): zl train's default split
    leaves them alone, also under a backprop schedule, where it balances a training split."""
    from types import SimpleNamespace

    from zl_device.formats.stage_spec import stage_specs
    from zl_device.run.executorch_runtime import with_default_split

    said: list[str] = []
    s = TrainSettings(split=cal.CalibrationSplit(model="tinyllama-random", num_stages=3, layers=2))
    resolved = SimpleNamespace(stages=stage_specs([2e-3] * 3, "async"), seq_len=128, max_targets=4, schedule="async")
    assert with_default_split(SimpleNamespace(settings=s, resolved=resolved, say=said.append)) is s and not said
    assert ModelSplit("tiny-random").chosen_by_default and not ModelSplit("tiny-random", "0-1,2-3").chosen_by_default
