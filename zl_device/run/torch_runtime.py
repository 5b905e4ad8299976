"""`zl train --runtime torch`: the same run as the ExecuTorch runtime, with the stages as torch.distributed ranks.

    prepare   RUN_DIR/manifest.json built without an export (no programs) and the ranks' job, RUN_DIR/torch_job.json
              (`--resume`: the run's own job, to resume)
    run       one rank per stage on this host (zl_device/torch/launcher.py), restarted after a failure, watched
              through their telemetry; `--launcher torchrun`: prepared only, with the command that starts them
    collect   the ranks wrote their telemetry and checkpoints into RUN_DIR themselves; their run span and the
              recovery events come from the telemetry

The run directory has what a runner run leaves for `zl merge`, `zl eval` and
`zl report` (docs/design#run-outputs, #torch-runtime): manifest.json (stages, parameters,
shapes; `"runtime": "torch"`, no `file` per stage), data/, torch_job.json,
stages/stage_<k>/metrics.jsonl, metrics.jsonl (with the `run` event),
checkpoints/stage_<k>/window_NNNNNN/, adapter/, eval.json, report.*.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

from zl_base.errors import ZLError
from zl_device.formats.injection import Injection
from zl_device.formats.metrics_log import LineTail
from zl_device.formats.run_layout import TORCH_JOB, RunLayout, stage_metrics
from zl_device.formats.stage_status import StageStatus, fold_telemetry
from zl_device.run.resolved_run import ResolvedRun
from zl_device.run.runtime import Run, RunRecord, Runtime
from zl_device.run.train_settings import TrainSettings
from zl_device.torch.job import TorchJob
from zl_device.torch.launcher import launch_ranks, recovery_events, torchrun_instructions, training_span
from zl_export.manifest import Manifest, read_manifest
from zl_export.stages import stages_phrase


class TorchRuntime(Runtime):
    """The stages as torch.distributed ranks in PyTorch eager (zl_device/torch/, docs/design#torch-runtime)."""

    name = "torch"
    uses_devices = False  # one rank per stage on this host, whatever --devices says
    resume_needs = (TORCH_JOB,)
    resumes_from = "from the latest window every stage checkpointed"

    def check(self, s: TrainSettings) -> None:
        check_torch_settings(s)

    def prepare(self, run: Run, shard: Path) -> Manifest:
        s, layout = run.settings, run.layout
        if s.resume:  # the run's own job and manifest: the ranks resume from their checkpoints
            self.job = TorchJob.load(layout.torch_job)
            self.job.resume, self.job.fail_at = True, None  # an injected failure happens once
            return read_manifest(layout.manifest)
        manifest = write_manifest(s, run.resolved.export_options(s), run.model.loaded(), shard, layout.root)
        self.job = torch_job(s, run.resolved, layout, shard)
        return manifest

    def run(self, run: Run, injection: Injection | None, on_update) -> bool:
        s, layout, job, say = run.settings, run.layout, self.job, run.say
        if injection is not None:
            job.fail_at = [injection.stage, injection.hold_micro_batch(run.windows)]
        job.save(layout.torch_job)
        if s.launcher == "torchrun":  # the user starts the ranks: the run ends here, prepared
            for line in torchrun_instructions(layout.root, layout.torch_job, job.num_stages, s.max_restarts):
                say(line)
            return False
        windows = run.windows
        say(f"run: {stages_phrase(job.num_stages)} as torch.distributed ranks on this host, "
            f"{job.num_micro_batches * job.micro_batch} samples, {windows.num_micro_batches} micro-batches in "
            f"{windows.num_windows} windows of {windows.window_size}")
        watch = RankWatch(layout.stages, job.num_stages)
        self.launched, _, self.failures = launch_ranks(
            layout.torch_job, job.num_stages, s.timeout_s, s.max_restarts,
            on_poll=(lambda: on_update(watch.poll())) if on_update else None,
            on_restart=lambda f: say(f"stage {f.stage} {f.reason}: restarting every rank from the latest window all "
                                     "stages checkpointed"))
        return True

    def collect(self, run: Run) -> RunRecord:
        job, root = self.job, run.layout.root
        # process start-up and model load are not training
        begin_ms, end_ms = training_span(root, job.num_stages, since_ms=int(self.launched * 1000))
        events = recovery_events(root, job.num_stages, run.windows, self.failures)
        return RunRecord(events, begin_ms, end_ms, job.run_id, [f"rank-{k}" for k in range(job.num_stages)],
                         {"launch_s": round(begin_ms / 1000 - self.launched, 3), "runtime": self.name,
                          "resumed": run.settings.resume})


def check_torch_settings(s: TrainSettings) -> None:
    """Options of the ExecuTorch runtime that `--runtime torch` does not have fail here, before anything runs."""
    unsupported = [(s.spares, "--spares"), (s.standby, "--standby"), (s.mode != "binary", "--mode"),
                   (s.recovery == "local", "--recovery local")]
    for value, name in unsupported:
        if value:
            raise ZLError(f"{name} is not supported with --runtime torch (a failed rank restarts every rank from the "
                          "latest window all stages checkpointed, as torch elastic does); drop it or use --runtime "
                          "executorch.")
    if s.devices_spec.kind != "local":
        raise ZLError(f"--devices {s.devices}: --runtime torch runs its stages as processes on this host (or under "
                      "torchrun, docs/design#torch-runtime), not on phones; drop --devices or use --runtime "
                      "executorch.")


def write_manifest(s: TrainSettings, opts, loaded, shard: Path, run_dir: Path) -> Manifest:
    """RUN_DIR/manifest.json as an export writes it, less the programs: stages, their parameters (manifest names,
    shapes), LoRA, loss, shapes, seed; `"runtime": "torch"`. The base model keeps no LoRA layers afterwards."""
    from zl_export.exporter import build_stage_modules, manifest_names
    from zl_export.frozen_weights import restore_frozen_weights
    from zl_export.manifest import build_manifest, stage_entry, write_manifest as write
    from zl_export.pipeline import calibration_rows

    opts.validate(loaded.config.max_position_embeddings)
    stages = s.split.ranges(loaded.config.num_hidden_layers)
    lens_rows, lens_source = calibration_rows(opts, loaded, shard)
    peft_model, modules = build_stage_modules(loaded.model, stages, opts, lens_rows)
    try:
        entries = [stage_entry(module, manifest_names(module, peft_model), opts) for module in modules]
    finally:
        restore_frozen_weights(peft_model)  # float32 frozen weights again (--frozen-dtype bf16/int8), for the eval
        peft_model.unload()  # eval loads the adapter onto the base model
    manifest = build_manifest(loaded, opts, entries, calibration=lens_source, runtime=TorchRuntime.name)
    write(manifest, run_dir)
    return manifest


def torch_job(s: TrainSettings, resolved: ResolvedRun, layout: RunLayout, shard: Path) -> TorchJob:
    """The ranks' job from the resolved run's stages, windows and optimizer, as the runner configs have them
    (executorch/launch.py `stage_configs`)."""
    windows, optimizer = resolved.windows, resolved.optimizer
    return TorchJob(model=s.split.model, manifest=str(layout.manifest), shard=str(Path(shard).resolve()),
                    run_id=secrets.token_hex(16), window_size=windows.window_size,
                    num_micro_batches=windows.num_micro_batches,
                    lr=[st.lr for st in resolved.stages], roles=[st.role for st in resolved.stages],
                    weight_decay=optimizer.weight_decay, schedule=optimizer.config().schedule,
                    checkpoint_dir=str(layout.checkpoints), metrics_dir=str(layout.stages),
                    threads=s.threads or 1, in_flight=s.in_flight, link_timeout_s=s.link_timeout_s,
                    micro_batch=s.export.micro_batch, pipeline=resolved.schedule,
                    # Neighbours commit at most a window apart, so K+1 windows hold one every stage has (resume).
                    keep_last=resolved.num_stages + 1)


class RankWatch:
    """The ranks' progress for the live display, folded from the new lines of their metrics.jsonl files."""

    def __init__(self, stages_dir: Path, num_stages: int):
        self.paths = [stage_metrics(stages_dir, k) for k in range(num_stages)]
        self.tails = [LineTail() for _ in range(num_stages)]
        self.status = [StageStatus(k, f"rank-{k}") for k in range(num_stages)]

    def poll(self) -> list[StageStatus]:
        now = time.monotonic()
        for path, tail, st in zip(self.paths, self.tails, self.status):
            for record in tail.read(path):
                fold_telemetry(st, record, now, lifecycle=True)
        return self.status
