"""`zl plan` and `zl train --stages auto`: calibrate the devices, then choose the split.

    make_plan(settings, PlanSettings())   -> Plan (zl_device/plan/plan_file.py)

1. Calibrate (calibrate.py): each device's time per micro-batch and PSS as fixed + per-layer costs at its stage
   position, measured on the device or read from the cache.
2. Budget each device's memory: --memory-limit, else MEMORY_SHARE of what it has available now (/proc/meminfo
   MemAvailable; local devices share this host's, split evenly between them). When no split fits, calibrate again
   with --recompute (each layer recomputed in the backward, docs/design#recomputation) and choose among those; the plan
   records it and `zl train --stages plan.json` trains with it.
3. Choose the split (zl_device/run/split.py): the slowest stage as fast as it can be, every stage within its budget. The link
   between stages carries one hidden state per micro-batch (B x S x D float32 and the mask and labels); with
   --link-mbps it is a pace of its own (a stage's sender works beside its compute, so the link limits only when it
   is slower than every stage). Without it the link is taken as free: local devices talk over loopback, and a
   phone's sealing of each entry is in its measured time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from zl_base.errors import ZLError
from zl_base.settings import check_fields, setting
from zl_device.devices.registry import LOCAL, DevicesSpec, check_cpu_quota_fits, check_mode
from zl_device.formats.schedules import schedule_name
from zl_device.plan.calibrate import calibrate, check_stage_count, device_names, forward_only_stages
from zl_device.plan.costs import StageCost
from zl_device.plan.plan_file import AUTO, Plan, StagePrediction, check_plan_matches, is_plan_file, read_plan
from zl_device.run.split import Split, best_split, evaluate
from zl_device.run.train_data import resolve_schedule
from zl_device.run.train_settings import TrainSettings

#: The share of a device's available memory a stage may plan to use: the rest is the OS's, other apps' and the
#: estimate's margin (PSS is fitted from two rounds; a long run's page cache and input log add a little).
MEMORY_SHARE = 0.8


def check_memory_limit(limits: tuple[float, ...] | None, flag: str = "--memory-limit") -> None:
    if limits is not None and (not limits or not all(math.isfinite(m) and m > 0 for m in limits)):
        shown = ",".join(f"{m:g}" for m in limits)
        raise ZLError(f"{flag} {shown}: give each device's memory budget in MiB, positive, one value for all or one "
                      f"per stage, e.g. {flag} 1500 or {flag} 1500,800,1200.")


def check_link_mbps(mbps: float | None, flag: str = "--link-mbps") -> None:
    if mbps is not None and not (math.isfinite(mbps) and mbps > 0):
        raise ZLError(f"{flag} {mbps:g}: the link between stages in Mbit/s must be positive, e.g. {flag} 200 "
                      "(leave it out for local devices: loopback).")


@dataclass(frozen=True)
class PlanSettings:
    """What `zl plan` takes besides the run's own settings."""

    out: Path = setting(Path("runs/plan.json"), "Where the plan goes (JSON); `zl train --stages FILE` and "
                                                "`zl export --stages FILE` take it.", flag="--out")
    memory_limit: tuple[float, ...] | None = setting(None, "Memory budget per device in MiB (one value for all, or "
                                                           f"one per stage); default {MEMORY_SHARE:.0%} of what the "
                                                           "device has available (local devices share this host's).",
                                                     check=check_memory_limit)
    link_mbps: float | None = setting(None, "Bandwidth of the link between stages (Mbit/s), e.g. 200 for phones on "
                                            "one Wi-Fi; default: not a limit (local devices: loopback).",
                                      check=check_link_mbps)
    recalibrate: bool = setting(False, "Measure the devices again even when their calibration is cached.",
                                flag="--recalibrate")

    def validate(self) -> None:
        check_fields(self)


def check_settings(s: TrainSettings, p: PlanSettings, flag: str = "--stages") -> DevicesSpec:
    """The checks that need no model or device, before anything runs. Returns the parsed --devices."""
    from zl_export.options import check_num_stages

    p.validate()
    check_fields(s)  # --devices, --cpu-quota's range, the choices
    s.rows.validate()
    check_num_stages(s.split.num_stages)
    s.export.validate()
    s.export.loss.validate(s.split.num_stages)
    s.check_stage_lr(s.split.num_stages)
    if s.runtime != "executorch":
        raise ZLError(f"{flag} auto plans for the ExecuTorch runners on the devices; with --runtime {s.runtime} give "
                      "--stages or --num-stages.")
    spec = s.devices_spec
    check_mode(spec, s.mode)
    if spec.count < s.split.num_stages:
        raise ZLError(f"--devices {s.devices} gives {spec.count} device(s); a plan for {s.split.num_stages} stages "
                      f"needs {s.split.num_stages} (--num-stages).")
    check_cpu_quota_fits(spec, s.cpu_quota)
    if p.memory_limit is not None and len(p.memory_limit) not in (1, s.split.num_stages):
        raise ZLError(f"--memory-limit: {len(p.memory_limit)} values for {s.split.num_stages} stages; give one value "
                      f"for every device or exactly {s.split.num_stages}.")
    return spec


def make_plan(s: TrainSettings, p: PlanSettings, say=print, export_progress=None) -> Plan:
    """Calibrate (or read the cache), budget, and choose the split of `s.split.num_stages` stages over the first
    devices of `s.devices`.

    Raises:
        ZLError: bad settings, more stages than layers, a device that fails calibration, or memory budgets no
            split can meet (naming the device and by how much).
    """
    if s.split.stages is not None and s.split.stages.strip() != AUTO:
        raise ZLError(f"zl plan chooses the stages itself; drop --stages {s.split.stages} (give --num-stages).")
    spec = check_settings(s, p)
    s = resolve_schedule(s, say)  # calibrate the schedule the run will train with
    num_stages = s.split.num_stages
    quotas = check_cpu_quota_fits(spec, s.cpu_quota)[:num_stages]
    names = device_names(spec)[:num_stages]
    cal = calibrate(s, spec, quotas, recalibrate=p.recalibrate, say=say, export_progress=export_progress)
    check_stage_count(num_stages, cal.num_layers, s.split.model)
    budgets = memory_budgets(spec, names, p.memory_limit, s.mode)
    forward_only = forward_only_stages(s, num_stages)
    try:
        best = choose_split(cal.costs, cal.num_layers, budgets, names, forward_only)
    except ZLError as short:
        if s.export.recompute or all(forward_only):
            raise
        # Recomputing each layer in the backward keeps its input instead of its activations (docs/design#recomputation):
        # far less memory for a slower step, so only when no split fits without it.
        say(f"plan: {short} Calibrating again with --recompute (each layer recomputed in the backward: less memory, "
            "a slower step).")
        s = replace(s, export=replace(s.export, recompute=True))
        cal = calibrate(s, spec, quotas, recalibrate=p.recalibrate, say=say, export_progress=export_progress)
        try:
            best = choose_split(cal.costs, cal.num_layers, budgets, names, forward_only)
        except ZLError as e:
            raise ZLError(f"{e} (That is with --recompute, which zl plan tried when nothing fit without it.)") from None
    link_ms = cal.entry_bytes(s.export.micro_batch) * 8 / (p.link_mbps * 1e3) if p.link_mbps else 0.0
    from zl_export.stages import balanced_split

    even = evaluate(tuple((r.first, r.last) for r in balanced_split(cal.num_layers, num_stages)),
                    cost_fn(cal.costs, forward_only))
    per_stage = [StagePrediction(k, names[k], (a, b), c.phase1.at(b - a + 1), c.phase2.at(b - a + 1),
                                 c.other.at(b - a + 1), c.pss_mib(b - a + 1), budgets[k], forward_only[k])
                 for k, ((a, b), c) in enumerate(zip(best.ranges, cal.costs))]
    calibration = [{"device": names[k], "cache": str(cal.cache_files[k]), "measured_now": cal.measured_now,
                    "rounds": [m.to_json() for m in cal.rounds[k]], "fit": cal.costs[k].to_json()}
                   for k in range(num_stages)]
    return Plan(stages=best.spec, model=s.split.model, num_layers=cal.num_layers, seq_len=cal.seq_len,
                micro_batch=s.export.micro_batch, frozen_dtype=s.export.frozen_dtype,
                embedding_dtype=s.export.embedding_dtype, max_targets=cal.max_targets,
                devices=s.devices, device_names=names, mode=s.mode, cpu_quota=quotas if s.cpu_quota else None,
                per_stage=per_stage, link_mbps=p.link_mbps, entry_bytes=cal.entry_bytes(s.export.micro_batch),
                link_ms=link_ms, even_stages=even.spec, even_slowest_ms=max(even.slowest_ms, link_ms),
                calibration=calibration, schedule=schedule_name(s.schedule), keep_activations=s.keep_activations,
                recompute=s.export.recompute)


def check_plan_holds(plan: Plan, s: TrainSettings, where: str) -> None:
    """Raise ZLError when the plan was timed under another schedule than the run's (a backprop stage runs another
    program, and without --keep-activations a second forward), or with other stages held still (forward only): its
    split balances the stages' costs for that, so it would pace this run wrongly (an old plan, made before
    `--stage-lr`'s default held the stages before the last still, held none; one from before plans kept their
    schedule is checked for its held stages only)."""
    fix = f"or pass the plan's stages yourself (--stages {plan.stages})"
    if plan.schedule is not None:
        planned, run = timed_under(plan.schedule, plan.keep_activations), timed_under(s.schedule, s.keep_activations)
        if planned != run:
            raise ZLError(f"{where}: the plan was timed under {planned}, this run trains with {run}, so the split would "
                          f"pace it wrongly. Run `zl plan {run}` with this run's other options, {fix}.")
    planned = [p.forward_only for p in plan.per_stage]
    held = forward_only_stages(s, len(planned))
    if planned == held:
        return

    def shown(flags: list[bool]) -> str:
        return ", ".join(str(k) for k, f in enumerate(flags) if f) or "none"

    run = "--stage-lr's default" if s.stage_lr is None else "--stage-lr " + ",".join(f"{m:g}" for m in s.stage_lr)
    raise ZLError(f"{where}: the plan was made with stages held still (forward only): {shown(planned)}; this run "
                  f"({run}) holds {shown(held)}, so the split would pace it wrongly. Run `zl plan` with this run's "
                  f"--stage-lr, {fix}.")


def timed_under(schedule: str, keep_activations: bool) -> str:
    """A schedule as a plan's timing depends on it, in flags: its name, and whether a backprop stage keeps its
    activations."""
    return f"--schedule {schedule_name(schedule)}" + (" --keep-activations" if keep_activations else "")


def cost_fn(costs: list[StageCost], forward_only: list[bool] | None = None):
    held = forward_only or [False] * len(costs)
    return lambda k, a, b: costs[k].ms(b - a + 1, forward_only=held[k])


def choose_split(costs: list[StageCost], num_layers: int, budgets: list[float | None], names: list[str],
                 forward_only: list[bool] | None = None) -> Split:
    """The best split within the budgets (run/split.py); a `forward_only` stage costs no phase 2.

    Raises:
        ZLError: no split fits: the device that cannot hold even one layer, or the one that needs the least extra
            memory to make a split fit, and by how much.
    """
    num_stages = len(costs)

    def fits(k: int, a: int, b: int) -> bool:
        need = costs[k].pss_mib(b - a + 1)
        return budgets[k] is None or need is None or need <= budgets[k]

    best = best_split(num_layers, num_stages, cost_fn(costs, forward_only), fits)
    if best is not None:
        return best
    most = num_layers - (num_stages - 1)  # a stage holds at most this many: every other stage needs one
    caps = [max([n for n in range(1, most + 1) if fits(k, 0, n - 1)], default=0) for k in range(num_stages)]
    for k, cap in enumerate(caps):
        if cap == 0:
            need = costs[k].pss_mib(1)
            raise ZLError(f"no split fits the memory budgets: {names[k]} (stage {k}) needs {need:.0f} MiB for a "
                          f"single layer and has a budget of {budgets[k]:.0f} MiB ({need - budgets[k]:.0f} MiB short); "
                          "raise its --memory-limit, free memory on it, or use a smaller --seq-len or --frozen-dtype.")
    missing = num_layers - sum(caps)

    def extra(k: int) -> float:  # MiB device k would need on top of its budget to hold `missing` more layers
        return costs[k].pss_mib(min(caps[k] + missing, most)) - budgets[k] if caps[k] + missing <= most else math.inf

    k = min(range(num_stages), key=extra)
    held = ", ".join(f"{names[i]} {caps[i]}" for i in range(num_stages))
    raise ZLError(f"no split of {num_layers} layers fits the memory budgets: the devices hold at most {sum(caps)} "
                  f"({held}); {missing} more layer(s) fit on {names[k]} with {extra(k):.0f} MiB more "
                  f"(--memory-limit {budgets[k] + extra(k):.0f} for it), or add a device.")


def memory_budgets(spec: DevicesSpec, names: list[str], limits: tuple[float, ...] | None,
                   mode: str = "binary") -> list[float | None]:
    """Each stage device's budget in MiB: --memory-limit, else MEMORY_SHARE of its MemAvailable (None: unknown)."""
    if limits is not None:
        return [float(limits[0] if len(limits) == 1 else limits[k]) for k in range(len(names))]
    if spec.kind == LOCAL:
        available = mem_available_mib(Path("/proc/meminfo").read_text())
        return [None if available is None else MEMORY_SHARE * available / len(names)] * len(names)
    from zl_device.devices.registry import open_phone

    budgets = []
    for serial in names:
        phone = open_phone(serial, check_abi=False, mode=mode)
        available = mem_available_mib(phone.shell("cat /proc/meminfo", "read /proc/meminfo"))
        budgets.append(None if available is None else MEMORY_SHARE * available)
    return budgets


def mem_available_mib(meminfo: str) -> float | None:
    """MemAvailable of a /proc/meminfo text in MiB (None when it has none)."""
    for line in meminfo.splitlines():
        key, _, rest = line.partition(":")
        if key.strip() == "MemAvailable" and rest.split():
            return int(rest.split()[0]) / 1024.0
    return None


def resolve_stages(s: TrainSettings, say=print, export_progress=None) -> tuple[TrainSettings, Plan | None]:
    """`zl train --stages auto` (plan now) or `--stages plan.json` (a plan made before): the settings with the
    plan's layer ranges, and the plan; other settings come back as they are.

    Raises:
        ZLError: as `make_plan`, or a plan made for another model, shape, devices or quotas.
    """
    stages = s.split.stages
    if s.resume or stages is None or (stages.strip() != AUTO and not is_plan_file(stages)):
        return s, None
    s = resolve_schedule(s, say)  # the plan is for the schedule the run trains with
    if stages.strip() == AUTO:
        plan = make_plan(s, PlanSettings(), say, export_progress)
    else:
        plan = read_plan(stages)
        spec = s.devices_spec
        quotas = check_cpu_quota_fits(spec, s.cpu_quota)[:len(plan.per_stage)]
        check_plan_matches(plan, f"--stages {stages}", model=s.split.model, seq_len=s.rows.seq_len,
                           micro_batch=s.export.micro_batch, frozen_dtype=s.export.frozen_dtype,
                           embedding_dtype=s.export.embedding_dtype, devices=s.devices,
                           mode=s.mode, cpu_quota=quotas if s.cpu_quota else None, checked_devices=True)
        check_plan_holds(plan, s, f"--stages {stages}")
    say(f"plan: --stages {plan.stages} (slowest stage {plan.slowest_ms:.0f} ms per micro-batch predicted"
        + (f", even split {plan.even_stages}: {plan.even_slowest_ms:.0f} ms" if plan.even_stages else "") + ")"
        + (" with --recompute: the split fits the devices' memory only with it" if plan.recompute else ""))
    rows = replace(s.rows, seq_len=plan.seq_len)  # the plan's: equal to the run's default, now explicit
    export = replace(s.export, recompute=s.export.recompute or plan.recompute)
    return replace(s, split=replace(s.split, stages=plan.stages), rows=rows, export=export), plan
