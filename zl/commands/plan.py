"""`zl plan`: calibrate the devices, choose the split of layers that paces the pipeline fastest, write it."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from zl.options import settings_command
from zl.paths import check_out_file
from zl_base.settings import nested
from zl_device.plan.planner import PlanSettings, timed_under
from zl_device.run.train_settings import TrainSettings
from zl_export.options import frozen_storage

EXAMPLE = """

Examples:

  zl plan --devices local:3 --cpu-quota 1.0,0.5,0.75 --seq-len 128 --out runs/plan.json

  zl train --devices local:3 --cpu-quota 1.0,0.5,0.75 --seq-len 128 --stages runs/plan.json

  zl train --devices local:3 --cpu-quota 1.0,0.5,0.75 --seq-len 128 --stages auto     # plan, then train

  zl plan --devices R58M123,R58M456,R58M789 --link-mbps 200 --memory-limit 1500 --out runs/phones-plan.json

  zl plan --schedule async --devices local:3 --cpu-quota 0.5 --out runs/async-plan.json     # timed under async
"""

#: TrainSettings fields that say how a run trains or recovers, not what a stage computes: not `zl plan`'s.
NOT_PLANNED = ("eval_data", "samples", "window", "runtime", "launcher", "out", "recovery", "max_restarts",
               "inject_failure", "spares", "standby", "keep_device_files", "seed", "optimizer",
               "eval_limit", "timeout_s", "resume", "link_timeout_s", "stall_timeout_s", "policy")

console = Console()


@dataclass
class PlanArgs:
    """`zl plan`'s options: the run's (model, data, shapes, export options, devices, quotas) and the plan's own."""

    run: TrainSettings = nested(TrainSettings, skip=NOT_PLANNED)
    plan: PlanSettings = nested(PlanSettings)


def run_plan(args: PlanArgs) -> None:
    from zl.commands.export import RichExportProgress
    from zl_device.plan.plan_file import write_plan
    from zl_device.plan.planner import make_plan

    check_out_file(args.plan.out, "--out", "plan.json")  # before minutes of calibration
    with RichExportProgress() as export_progress:
        plan = make_plan(args.run, args.plan, say=lambda line: console.print(line, soft_wrap=True),
                         export_progress=export_progress)
    console.print(plan_table(plan))
    path = write_plan(plan, args.plan.out)
    console.print(f"[bold]plan[/] {plan.stages} -> {path}\n  zl train --stages {path} ...   or   "
                  f"zl export --stages {path} ...   (or --stages {plan.stages})")


def plan_table(plan) -> Table:
    """The plan per stage: device (and its CPU quota), layers, predicted ms per micro-batch (phase 1, phase 2, and in
    all: with sealing the hidden state and accumulating, which the plan file lists as "other_ms") and PSS against
    the device's budget (MiB). A stage held still (forward only) shows "held" for its phase 2."""
    quota = plan.cpu_quota or [None] * len(plan.per_stage)
    schedule = "" if plan.schedule is None else ", " + timed_under(plan.schedule, plan.keep_activations)
    schedule += ", --recompute" if plan.recompute else ""
    frozen = frozen_storage(plan.frozen_dtype, plan.embedding_dtype)
    table = Table(title=f"plan: {plan.model} ({plan.num_layers} layers), seq {plan.seq_len}, micro-batch "
                        f"{plan.micro_batch}, {frozen}{schedule}; ms per micro-batch, MiB")
    for col in ("stage", "device", "layers", "phase 1", "phase 2", "total", "PSS", "budget"):
        table.add_column(col, justify="right", no_wrap=True)
    for p, q in zip(plan.per_stage, quota):
        table.add_row(str(p.stage), p.device + ("" if q is None else f" @{q:g}"), f"{p.layers[0]}-{p.layers[1]}",
                      _ms(p.phase1_ms), "held" if p.forward_only else _ms(p.phase2_ms), _ms(p.total_ms),
                      "-" if p.pss_mib is None else f"{p.pss_mib:.0f}",
                      "-" if p.budget_mib is None else f"{p.budget_mib:.0f}")
    caption = f"slowest stage {_ms(plan.slowest_ms)} ms per micro-batch"
    if plan.link_mbps:
        caption += f"; link {_ms(plan.link_ms)} ms per entry at {plan.link_mbps:g} Mbit/s"
    if plan.even_stages and plan.even_slowest_ms:
        caption += (f"; even split {plan.even_stages}: {_ms(plan.even_slowest_ms)} ms "
                    f"({plan.even_slowest_ms / plan.slowest_ms:.2f}x)")
    table.caption = caption
    return table


def _ms(value: float) -> str:
    return f"{value:.1f}" if value < 10 else f"{value:.0f}"


plan_command = settings_command(
    PlanArgs, run_plan,
    "Plan the split of layers over unequal devices: a short calibration on each device (cached), then the split "
    "whose slowest stage is fastest within every device's memory." + EXAMPLE)
COMMANDS = {"plan": plan_command}
