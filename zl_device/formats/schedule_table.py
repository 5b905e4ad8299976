"""Pipeline schedules as data: per stage, the list of actions it runs, and the weight version each runs on.

    stage_actions("async", stage=0, num_stages=3, plan=WindowPlan(6, 2))
    F0@0 F1@0 F2@0 B0@0 F3@0 B1@0 S1@0 F4@1 B2@0 F5@1 B3@0 S3@1 B4@1 B5@1 S5@2      (`shown`)

A schedule is one row of `SCHEDULE_TABLE`: whether the final loss's gradient crosses the links (`backprop`),
whether a window drains before its step (`flush`: exact backprop) and how many forwards a stage runs ahead of its
first backward (`warm_up`). Every list is made by `stage_actions` from its row, so a schedule that only reorders
forwards and backwards is one row (and the C++ twin's case, below) plus its test.

Actions: F, the forward of a micro-batch (take its input, send its hidden state down); B, its backward (take the
gradient, send grad_input up; on the last stage F and B are one execution of its program, and under zerolock B is
the local loss's phase 2); S, the optimizer step that ends a window, after the backward of the window's last
micro-batch. Each F and B carries the weight version (optimizer steps taken) its forward ran on: under async a
forward may run one step behind the step its backward lands in, and its backward recomputes on that version
(weight stashing, LoRA only); S carries the version it ends.

The C++ runner generates the same lists from the same rules (runner/src/pipeline_schedule.cpp
`schedule_ops`, steps included, and `forward_version`) and runs them as they are (backprop_loop.cpp; runner.cpp
for zerolock, where a held stage's B is the stop at the marker), and tests/test_schedule_table.py checks through
`zl_schedule_ops` that both give identical lists for every schedule, stage count, window size, run length and
restart point. The torch runtime's ranks run these lists too (torch/schedules/backprop_ranks.py for gpipe, 1f1b and
async; torch/schedules/zerolock.py), as does the one-process simulation of async (torch/stale_backprop.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from zl_device.formats.windows import WindowPlan

FORWARD, BACKWARD, STEP = "F", "B", "S"

#: How far a stage's forwards run ahead of its first backward: NONE, a forward and its backward back to back;
#: PIPELINE, the K-1-k forwards the stages below need to fill the pipeline; WINDOW, every forward of the window.
#: The last stage never runs ahead: its forward and backward are one execution.
NONE, PIPELINE, WINDOW = "none", "pipeline", "window"


@dataclass(frozen=True)
class ScheduleRule:
    """One schedule: what `stage_actions` makes every stage's list from."""

    name: str
    backprop: bool  # the final loss's gradient crosses the links (else each stage steps on its local loss)
    flush: bool  # each window's forwards and backwards all finish before its step (exact backprop)
    warm_up: str  # NONE | PIPELINE | WINDOW


SCHEDULE_TABLE: dict[str, ScheduleRule] = {rule.name: rule for rule in (
    ScheduleRule("zerolock", backprop=False, flush=True, warm_up=NONE),
    ScheduleRule("gpipe", backprop=True, flush=True, warm_up=WINDOW),
    ScheduleRule("1f1b", backprop=True, flush=True, warm_up=PIPELINE),
    ScheduleRule("async", backprop=True, flush=False, warm_up=PIPELINE),
)}


@dataclass(frozen=True)
class Action:
    kind: str  # FORWARD | BACKWARD | STEP
    micro_batch: int  # STEP: the window's last micro-batch
    version: int  # FORWARD, BACKWARD: the weight version the forward ran on; STEP: the version it ends

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}@{self.version}"


def _warm_up(rule: ScheduleRule, stage: int, num_stages: int, window_len: int) -> int:
    if stage == num_stages - 1 or rule.warm_up == NONE:
        return 0
    return window_len if rule.warm_up == WINDOW else num_stages - 1 - stage


def forward_version(schedule: str, stage: int, num_stages: int, plan: WindowPlan, micro_batch: int) -> int:
    """The weight version (optimizer steps taken) stage `stage`'s forward of `micro_batch` runs on, in an
    uninterrupted run: the steps before it in its list. Without a flush, the window of the micro-batch its warm-up
    puts `micro_batch` beside (0 during the first warm-up); with one, `micro_batch`'s own window."""
    rule = SCHEDULE_TABLE[schedule]
    warm = 0 if rule.flush else _warm_up(rule, stage, num_stages, plan.num_micro_batches)
    return plan.window_of(micro_batch - warm) if micro_batch >= warm else 0


def stage_actions(schedule: str, stage: int, num_stages: int, plan: WindowPlan, first_micro_batch: int = 0,
                  forward_only: bool = False) -> list[Action]:
    """Stage `stage` of `num_stages`'s actions for micro-batches [first_micro_batch, n) of `plan` in order
    (`first_micro_batch`: a window's first, where a restart from its checkpoint begins). `forward_only`: a stage
    held still (zerolock at lr 0, not the last) runs no backward (its method stops at the marker), and still ends
    each window (its step moves nothing; it commits the window).

    Raises:
        KeyError: a schedule not in the table.
    """
    rule = SCHEDULE_TABLE[schedule]
    n = plan.num_micro_batches
    order: list[tuple[str, int]] = []

    def one_f_one_b(first: int, end: int, warm: int) -> None:
        warm = min(warm, end - first)
        order.extend((FORWARD, mb) for mb in range(first, first + warm))
        for mb in range(first + warm, end):
            order.extend(((FORWARD, mb), (BACKWARD, mb - warm)))
        order.extend((BACKWARD, mb) for mb in range(end - warm, end))

    if first_micro_batch < n:
        if rule.flush:
            for w in range(plan.window_of(first_micro_batch), plan.num_windows):
                window = plan.micro_batches(w)
                first = max(window.start, first_micro_batch)
                one_f_one_b(first, window.stop, _warm_up(rule, stage, num_stages, window.stop - first))
        else:
            one_f_one_b(first_micro_batch, n, _warm_up(rule, stage, num_stages, n))
    actions = []
    for kind, mb in order:
        if not (forward_only and kind == BACKWARD):
            actions.append(Action(kind, mb, forward_version(schedule, stage, num_stages, plan, mb)))
        last_of_window = mb == n - 1 or plan.window_of(mb + 1) != plan.window_of(mb)
        if kind == BACKWARD and last_of_window:
            actions.append(Action(STEP, mb, plan.window_of(mb)))
    return actions


def max_in_flight(actions: list[Action]) -> int:
    """The most micro-batches forwarded and not yet backwarded at once: the inputs a stage holds, and the
    gradients it may be owed."""
    now = most = 0
    for a in actions:
        now += {FORWARD: 1, BACKWARD: -1}.get(a.kind, 0)
        most = max(most, now)
    return most


def shown(actions: list[Action]) -> str:
    """The list in one line, as the module docstring writes it."""
    return " ".join(str(a) for a in actions)
