"""`zl train --runtime executorch` (the default): the stages as exported programs on the devices' `zl_runner`s.

    prepare   the stage programs for the run's options, exported once and reused from the cache
              (executorch/export_cache.py); RUN_DIR/manifest.json
    run       the devices opened, the control server, address plan, stage configs and deploy (executorch/launch.py),
              the coordinator to the end, recovering failed stages (executorch/coordinator.py)
    collect   what the devices wrote pulled into RUN_DIR/logs/<device>/ and RUN_DIR/checkpoints/stage_<k>/, each
              stage's telemetry into RUN_DIR/stages/stage_<k>/, the run key, shard and input logs off the devices
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from zl_base.errors import ZLError
from zl_device.formats.injection import Injection
from zl_device.formats.run_layout import MANIFEST, METRICS, RUN_KEY, SETTINGS_FILE, stage_config_name
from zl_device.run.runtime import Run, RunRecord, Runtime
from zl_export.manifest import Manifest
from zl_export.options import ProgramSettings


class ExecuTorchRuntime(Runtime):
    """The stage programs on the devices, run by the coordinator (docs/design#runner, #coordinator)."""

    name = "executorch"
    uses_devices = True
    resume_needs = (RUN_KEY, stage_config_name(0))
    resumes_from = f"with its own settings ({SETTINGS_FILE}), every stage from its checkpoints"

    def prepare(self, run: Run, shard: Path) -> Manifest:
        from zl_device.executorch.export_cache import export_cached

        s = run.settings
        self.shard = shard
        # A backprop schedule runs programs that take grad_hidden and give grad_input (docs/design#backprop-program).
        program = ProgramSettings(kind="backprop") if s.backprop else None
        exported = with_default_split(run)
        self.export_dir, self.manifest = export_cached(exported, run.resolved.export_options(s), run.model.loaded,
                                                       run.say, run.export_progress, calibration=shard, program=program)
        shutil.copyfile(self.export_dir / MANIFEST, run.layout.manifest)
        return self.manifest

    def run(self, run: Run, injection: Injection | None, on_update) -> bool:
        from zl_device.devices.registry import open_devices
        from zl_device.executorch.launch import launch

        s, root = run.settings, run.layout.root
        self.devices = open_devices(run.devices, root, link_profile=s.link_profile, mode=s.mode,
                                    cpu_quota=s.cpu_quota, runner_binary=s.runner, runner_prefix=s.runner_prefix)
        try:
            with launch(s, run.resolved, self.devices, run.devices.kind == "local", root, self.export_dir,
                        self.manifest, self.shard, injection, run.say) as self.launched:
                self.events, self.span = supervise(self.launched, root, on_update)
        except BaseException:
            # The devices keep what `zl train --resume` needs (key, shard, input logs); a finished resume removes them.
            run.say(f"devices: the run key, data shard and input logs stay on the devices for `zl train --resume "
                    f"--out {root}`")
            raise
        return True

    def collect(self, run: Run) -> RunRecord:
        from zl_device.devices.deploy import pull

        stage_devices = self.launched.devices  # a spare that took over a stage included
        pull(stage_devices, run.layout.root)
        for k, device in enumerate(stage_devices):
            pulled, target = run.layout.device_logs(device.name) / METRICS, run.layout.stage_metrics(k)
            if pulled.is_file():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(pulled, target)
        forget_device_files(run.settings, self.devices, run.say)  # every device: a failed stage's first one, spares
        start, end = self.span
        return RunRecord(self.events, int(start * 1000), int(end * 1000), self.launched.run_id,
                         [d.name for d in stage_devices],
                         {"control_heartbeats": [st.heartbeat_seen for st in self.launched.coordinator.status]})


def supervise(launched, run_dir: Path, on_update) -> tuple[list[dict], tuple[float, float]]:
    """Run the pipeline to its end; returns the coordinator's events and the run's (start, end) Unix times.

    On a failure the stages are stopped and what they wrote is pulled before the error goes on.
    """
    from zl_device.devices.deploy import pull

    run_start = time.time()
    try:
        events = launched.coordinator.run(on_update)
    except BaseException:
        launched.coordinator.stop_all()
        pull(launched.devices, run_dir)
        raise
    return events, (run_start, time.time())


def forget_device_files(s, devices, say) -> None:
    """The run key, shard and input logs leave the devices once a finished run is pulled, unless
    --keep-device-files (a run that fails keeps them for --resume)."""
    from zl_device.devices.deploy import remove_run_files

    if s.keep_device_files:
        say("devices: run key, data shard and input logs kept (--keep-device-files)")
        return
    try:
        removed = remove_run_files(devices)
    except ZLError as e:  # a phone gone by now: say so, the run's result stands
        say(f"devices: could not remove the run key, data shard and input logs: {e}")
        return
    if removed:
        say(f"devices: removed the run key, data shard and input logs ({len(removed)} paths)")


def with_default_split(run: Run):
    """The run's settings with the split its stages get: --stages as given; without it the stages' predicted costs
    balanced where every stage trains (zl_device/run/default_split.py, docs/design#default-split), said in one line;
    else the even split, with a line on what balancing it would cost where stages are held still."""
    from dataclasses import replace

    from zl_device.formats.stage_spec import FORWARD
    from zl_device.run.default_split import ModelShape, balanced_and_even, default_split
    from zl_export.model_source import load_config

    s, resolved = run.settings, run.resolved
    if not s.split.chosen_by_default:
        return s
    shape = ModelShape.of(load_config(s.split.model))
    args = (shape, resolved.stages, resolved.seq_len, resolved.max_targets, s.keep_activations)
    found = default_split(*args)
    if found is not None:
        best, even = found
        run.say(f"split: {best.spec}, the stages' predicted costs balanced under --schedule {resolved.schedule} "
                f"(slowest stage {even.slowest_ms / best.slowest_ms:.2f}x faster than the even {even.spec}); "
                "--stages sets another, `zl plan` measures the devices")
        return replace(s, split=replace(s.split, stages=best.spec))
    held = balanced_and_even(*args)
    if held is not None:
        best, even = held
        trained = sum(b - a + 1 for (a, b), spec in zip(best.ranges, resolved.stages) if spec.role != FORWARD)
        run.say(f"split: even ({even.spec}); the stages held still wait on the trained one. --stages {best.spec} "
                f"would pace them evenly (predicted {even.slowest_ms / best.slowest_ms:.2f}x faster) but train "
                f"{trained} layers instead of {even.counts[-1]}; or train every stage: --schedule async")
    return s
