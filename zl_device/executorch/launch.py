"""`zl train`'s launch step: control server, address plan, stage configs, deploy, tunnels and the coordinator.

    RUN_DIR/run.key, stage_<k>.json  the run key (until the run finishes) and the stage configs as generated
    RUN_DIR/devices/local-<i>/       local devices' working folders

`launch` is a context manager: the control server listens and the tunnels
stay up while the caller runs the coordinator; both go when it leaves.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from zl_base.errors import ZLError
from zl_device.devices.backend import Device
from zl_device.executorch.device_policy import DevicePolicy
from zl_device.formats.lr_schedule import OptimizerSettings
from zl_device.formats.schedules import is_backprop
from zl_device.formats.run_layout import CHECKPOINTS_DIR, MANIFEST, METRICS, RunLayout
from zl_device.formats.runner_config import RunnerConfig, read_runner_config
from zl_device.formats.stage_spec import StageSpec
from zl_device.formats.windows import WindowPlan
from zl_export.manifest import Manifest
from zl_export.stages import stages_phrase

log = logging.getLogger(__name__)


class LaunchSettings(Protocol):
    """What the launch reads of a run's settings: `zl train`'s `TrainSettings` (zl_device/run/train_settings.py)
    has them; this package sits below the flow and does not import it."""

    samples: int
    spares: int
    resume: bool
    mode: str  # binary | app
    recovery: str  # local | global
    standby: bool
    max_restarts: int
    heartbeat_timeout_s: float
    stall_timeout_s: float
    timeout_s: float
    in_flight: int
    threads: int | None  # None: each device's own (device_threads)
    load_mode: str
    accumulator_snapshots: bool
    grad_dtype: str  # bf16 | f32
    keep_activations: bool
    policy: DevicePolicy


class RunPlan(Protocol):
    """What the launch reads of a run resolved from its settings and data: zl_device/run/resolved_run.py's
    `ResolvedRun` has it (each stage's role and learning rate, the windows, the windowed optimizer)."""

    schedule: str  # zerolock | gpipe | 1f1b | async (the schedule's own name)
    stages: tuple[StageSpec, ...]
    windows: WindowPlan
    optimizer: OptimizerSettings


@dataclass
class Launched:
    """A deployed pipeline, ready to run."""

    coordinator: object  # zl_device.executorch.coordinator.Coordinator
    run_id: str
    windows: WindowPlan

    @property
    def devices(self) -> list[Device]:
        """The stages' devices (a spare that took over a stage included, once the run is over)."""
        return [p.device for p in self.coordinator.plans]


@contextmanager
def launch(s: LaunchSettings, run_plan: RunPlan, devices: Sequence[Device], local: bool, run_dir: Path,
           export_dir: Path, manifest: Manifest, shard: Path, injection, say) -> Iterator[Launched]:
    """Deploy the stages of `manifest` to `devices` (stages first, then spares) and yield the pipeline to run.

    Args:
        local: the devices are local processes (they listen on 127.0.0.1 ports of this host).
        injection: a zl_device.run.runtime.Injection, or None.
    """
    from zl_device.executorch.control import ControlServer

    num_stages = len(manifest.stages)
    stage_devices, spares = list(devices[:num_stages]), list(devices[num_stages:num_stages + s.spares])
    key_file, run_id = saved_run_key(run_dir) if s.resume else write_run_key(run_dir)
    with ControlServer(bytes.fromhex(key_file.read_text().strip()), bytes.fromhex(run_id),
                       host=control_bind_host(stage_devices, local),
                       max_connections=4 * (len(stage_devices) + len(spares)) + 4,
                       num_stages=num_stages) as control:
        plan = address_plan(stage_devices, control.address[1], local)
        try:
            launched = _deploy_and_coordinate(s, run_plan, stage_devices, spares, run_dir, export_dir, manifest,
                                              shard, plan, key_file, run_id, control, injection, say)
            with kept_awake(stage_devices + spares, say):
                yield launched
        finally:
            if plan.tunnels:
                for device in devices:
                    device.remove_tunnels()


@contextmanager
def kept_awake(devices: Sequence[Device], say) -> Iterator[None]:
    """Keep every device awake while the run is on it (`Device.keep_awake`: phones in --mode binary, whose runner
    holds no wake lock), and put each one's own settings back when the run ends, fails or is stopped; says so."""
    done: list[Device] = []
    awake: dict[str, str] = {}  # device name -> what was done
    try:
        for device in devices:
            phrase = device.keep_awake()
            done.append(device)
            if phrase is not None:
                awake[device.name] = phrase
        if awake:
            say(f"phones: {', '.join(awake)} {next(iter(awake.values()))} for the run; their own settings come "
                "back when it ends")
        yield
    finally:
        for device in done:
            try:
                device.restore_sleep()
            except ZLError as e:  # a phone gone: the settings stay saved on it, the next run restores them
                log.warning("%s: could not restore its sleep settings (%s); the next run on it will", device.name, e)


def control_bind_host(stage_devices: Sequence[Device], local: bool) -> str:
    """Where the control server listens: 127.0.0.1 for local devices and for phones on USB (`adb reverse` brings
    their connections to this host's loopback); every interface only for phones on Wi-Fi."""
    if local:
        return "127.0.0.1"
    from zl_device.devices.network import plan_addresses

    return "127.0.0.1" if plan_addresses(stage_devices, coordinator_port=None).mode == "usb" else "0.0.0.0"


def write_run_key(run_dir: Path) -> tuple[Path, str]:
    """RUN_DIR/run.key (the per-run MAC key, owner-only) and a fresh run id."""
    key_file = RunLayout(run_dir).run_key
    write_secret(key_file, secrets.token_hex(32) + "\n")
    return key_file, secrets.token_hex(16)


def saved_run_key(run_dir: Path) -> tuple[Path, str]:
    """The key and run id of the run in RUN_DIR (`zl train --resume`): its runners' checkpoints and input logs are
    bound to both.

    Raises:
        ZLError: RUN_DIR lacks run.key or stage_0.json (the run never got to its launch).
    """
    layout = RunLayout(run_dir)
    key_file, config = layout.run_key, layout.stage_config(0)
    if not key_file.is_file() or not config.is_file():
        raise ZLError(f"--resume --out {run_dir}: no run.key or stage_0.json there, so the run never started its "
                      "stages; start it again without --resume.")
    fix = "restore it (each device holds a copy), or start the run again without --resume"
    return key_file, read_runner_config(config, fix).run_id


def write_secret(path: Path, text: str) -> None:
    """Create `path` owner-only (0600) from its first byte: no moment in which it is readable by others.

    Raises:
        ZLError: `path` exists already (a key is never overwritten in place).
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ZLError(f"{path} exists already; a run key is created once per run. Use a new --out folder.") from None
    with os.fdopen(fd, "w") as f:
        f.write(text)


def address_plan(stage_devices: Sequence[Device], coordinator_port: int, local: bool):
    """Where each stage listens and connects; phones only on USB get their adb tunnels here."""
    from zl_device.devices.network import apply_tunnels, free_port_base, plan_addresses

    base = free_port_base(len(stage_devices)) if local else None
    plan = plan_addresses(stage_devices, coordinator_port=coordinator_port, **({"stage_port": base} if base else {}))
    if plan.tunnels:  # phones only on USB: stage links and the control channel go through this host
        apply_tunnels(plan, stage_devices)
    return plan


def _deploy_and_coordinate(s: LaunchSettings, run_plan: RunPlan, stage_devices, spares, run_dir: Path, export_dir: Path,
                           manifest: Manifest, shard: Path, plan, key_file: Path, run_id: str, control, injection,
                           say) -> Launched:
    from zl_device.devices.deploy import deploy, deploy_stage
    from zl_device.executorch.coordinator import Coordinator, StagePlan

    num_stages, windows = len(manifest.stages), run_plan.windows
    s.policy.check_devices(stage_devices)  # a device the policy cannot read fails before any config is written
    configs = stage_configs(s, run_plan, manifest, export_dir, shard, plan, key_file, run_id, stage_devices)
    deployed = dict(configs)
    if injection:
        deployed[injection.stage] = replace(configs[injection.stage],
                                            hold_at_micro_batch=injection.hold_micro_batch(windows))
    for k, cfg in deployed.items():
        RunLayout(run_dir).stage_config(k).write_text(json.dumps(cfg.to_json(), indent=2) + "\n")
    say(f"deploy: {stages_phrase(num_stages)} to {', '.join(d.name for d in stage_devices)}"
        + (f" (spares: {', '.join(d.name for d in spares)})" if spares else "")
        + (" in the app" if s.mode == "app" else ""))
    say(threads_line([configs[k].threads for k in sorted(configs)], s.threads))
    results = deploy(stage_devices, export_dir, deployed)
    # On a device the runner's files sit in its working folder under RUN_DIR's names (`log_path`, `checkpoint_dir`).
    plans = [StagePlan(k, d, r.config, METRICS, CHECKPOINTS_DIR, entry_bytes(manifest, k))
             for k, (d, r) in enumerate(zip(stage_devices, results))]

    def redeploy(device: Device, k: int) -> None:
        deploy_stage(device, export_dir, k, configs[k], manifest=manifest)

    coordinator = Coordinator(plans, windows, control, s.recovery, injection, spares, s.heartbeat_timeout_s,
                              s.timeout_s, redeploy, resume=s.resume, stall_timeout_s=s.stall_timeout_s,
                              standby=s.standby, max_restarts=s.max_restarts, policy=s.policy,
                              backprop=is_backprop(run_plan.schedule))
    for spec in run_plan.stages:  # the display's "held still" before any telemetry (phones report none)
        coordinator.status[spec.index].forward_only = spec.forward_only
    say(f"run: {s.samples} samples, {windows.num_micro_batches} micro-batches in {windows.num_windows} windows of "
        f"{windows.window_size}, "
        f"recovery {s.recovery}" + (", hot standbys" if s.standby else "") + (f", failure injected at stage {injection.stage} window {injection.window}"
                                   if injection else ""))
    return Launched(coordinator, run_id, windows)


def device_threads(device: Device, threads: int | None, num_stages: int) -> int:
    """The runner config's "threads" on `device`: --threads when given; else a local device's --cpu-quota rounded up
    (more threads than its CPUs would only wait on each other), or, uncapped, this host's CPUs shared among the
    stages; a phone gets 0, its performance cores, which the runner counts itself (zl/cpu_cores.h)."""
    if threads is not None:
        return threads
    if device.kind != "local":
        return 0
    quota = getattr(device, "cpu_quota", None)
    if quota is not None:
        return max(1, math.ceil(quota))
    return max(1, (os.cpu_count() or 1) // num_stages)


def threads_line(threads: Sequence[int], given: int | None) -> str:
    """The live view's line on the threads each stage's kernels get."""
    shown = " / ".join("the device's performance cores" if t == 0 else str(t) for t in threads)
    why = "--threads" if given is not None else "each device's own: a local device's CPU quota or its share of " \
                                               "this host, a phone's performance cores"
    return f"threads per stage: {shown} ({why})"


def stage_configs(s: LaunchSettings, run_plan: RunPlan, manifest: Manifest, export_dir: Path, shard: Path, plan,
                  key_file: Path, run_id: str, stage_devices: Sequence[Device]) -> dict[int, RunnerConfig]:
    """The runner config of every stage (host paths; deploy pushes the files and rewrites them), from its
    `StageSpec`: the one place a setting gets its runner-config name where that differs
    (runner_config.SETTING_NAMES)."""
    num_stages, windows, optimizer = len(manifest.stages), run_plan.windows, run_plan.optimizer
    threads = [device_threads(d, s.threads, num_stages) for d in stage_devices]
    configs = {}
    for addresses in plan.stages:
        k = addresses.stage
        spec = run_plan.stages[k]
        # Only where they differ from the runner's defaults (RunnerConfig's): ZeroLock configs stay as they were.
        differs: dict = {"data_shard": str(shard)} if k == 0 else {}
        if is_backprop(spec.schedule):
            differs.update(grad_wire_dtype=s.grad_dtype, keep_activations=s.keep_activations)
        if s.policy.active:
            # A neighbour of a paused stage waits as long as the pause lasts, which may be longer than the runner's
            # 600 s input timeout; the coordinator, which knows a pause from a failure, watches it instead
            # (docs/design#device-policies).
            differs["input_timeout_s"] = 0
        configs[k] = RunnerConfig(
            program=str(export_dir / manifest.stages[k].file),
            manifest=str(export_dir / MANIFEST),
            stage_index=k,
            num_stages=num_stages,
            run_key_file=str(key_file),
            run_id=run_id,
            window_size=windows.window_size,
            num_micro_batches=windows.num_micro_batches,
            in_flight_depth=s.in_flight,
            checkpoint_dir=CHECKPOINTS_DIR,
            # Global recovery rolls every stage back to the last window all committed: keep them all.
            keep_last=windows.num_windows + 1 if s.recovery == "global" else 2,
            log_path=METRICS,
            threads=threads[k],
            load_mode=s.load_mode,
            accumulator_snapshots=s.accumulator_snapshots,
            optimizer=optimizer.config(spec.lr),
            role=spec.role,  # train | forward (held still: phase 1 only); the runner never infers it from the lr
            schedule=spec.schedule,
            **differs,
            **addresses.config_fields(),
        )
    return configs


def entry_bytes(manifest: Manifest, k: int) -> int:
    """Bytes of one input entry of stage k: a DATA frame's tensors (stage 0: a shard row)."""
    b, sl, d = manifest.options.micro_batch, manifest.options.seq_len, manifest.model.hidden_size
    return 3 * b * sl * 8 if k == 0 else b * sl * d * 4 + 2 * b * sl * 8
