"""`zl train`'s settings tree: the model split and export options (zl_export/options.py) plus the run's own.

`zl train`'s options are generated from `TrainSettings` (zl/options.py); to add
one, add a field with `setting(default, "help")` (see zl_base/settings.py). How rows
become samples (`DataSettings`) is shared with `zl data`; the optimizer
(`OptimizerSettings`, zl_device/formats/lr_schedule.py) with every eager reference.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from zl_base.errors import ZLError
from zl_base.settings import check_fields, nested, setting
from zl_device.devices.cpu_quota import check_cpu_quota
from zl_device.devices.registry import (
    MAX_LOCAL_DEVICES,
    MODE_HELP,
    MODES,
    RUNNER_HELP,
    RUNNER_PREFIX_HELP,
    DevicesSpec,
    check_cpu_quota_fits,
    check_devices,
    check_runner,
    parse_devices,
)
from zl_device.executorch.device_policy import DevicePolicy
from zl_device.executorch.recovery import MAX_RESTARTS, RECOVERY_MODES
from zl_device.formats.lr_schedule import OptimizerSettings
from zl_device.formats.windows import WindowPlan
from zl_device.formats.schedules import SCHEDULE_NAMES, is_backprop
from zl_export.data_settings import DataSettings
from zl_export.options import ExportOptions, ModelSplit

DEMO = "demo"
RUNTIMES = ("executorch", "torch")
LAUNCHERS = ("spawn", "torchrun")
#: The runner's default `input_timeout_s` (runner_config.cpp), which zl train leaves: a stage waiting this long
#: for input or acknowledgements fails.
RUNNER_INPUT_TIMEOUT_S = 600.0
#: Default --stall-timeout: well above a phone's slowest micro-batch or checkpoint, well below the input timeout.
STALL_TIMEOUT_S = 300.0
LOAD_MODES = ("mmap", "file")
#: --samples may go over the training rows at most this many times (checked against the data before the run
#: starts, zl_device/run/train_data.py): more passes only fit the same rows again, and a stray 10**12 would train
#: until killed.
MAX_EPOCHS = 100


def check_threads(threads: int | None, flag: str = "--threads") -> None:
    """--threads, when given, is at least 1 (leave it out for each device's own count)."""
    if threads is not None and threads < 1:
        raise ZLError(f"{flag} {threads}: at least 1 thread per runner; leave {flag} out and each device uses its "
                      "own count (a phone's performance cores, a local device's --cpu-quota).")


@dataclass
class TrainSettings:
    """Everything `zl train` takes."""

    split: ModelSplit = nested(ModelSplit)
    data: str = setting(DEMO, "`demo` (the built-in task), a .csv/.jsonl/.parquet/.arrow file, a "
                              "`datasets.save_to_disk` directory, or a shard (.safetensors).")
    eval_data: str | None = setting(None, "Dev data for the evaluation (the demo task brings its own).")
    rows: DataSettings = nested(DataSettings)  # --format, the column options, --truncate, --seq-len: as `zl data`
    samples: int = setting(256, f"Training samples (the shard repeats when it has fewer rows, at most "
                                f"{MAX_EPOCHS} times).")
    window: int = setting(4, "Update window m: micro-batches per AdamW step.")
    devices: str | None = setting(None, f"local:N (N up to {MAX_LOCAL_DEVICES}), or phone serials "
                                        "SERIAL1,SERIAL2,... (see `zl devices`). Default: one local device per stage "
                                        "and per --spares (local:3 for the default 3 stages).", check=check_devices)
    mode: str = setting("binary", MODE_HELP, choices=MODES)
    cpu_quota: tuple[float, ...] | None = setting(None, "CPUs each local device may use, one value for all or one per "
                                                  "device, e.g. 1.0,0.5,0.75: unequal phones on one host (a cgroup "
                                                  "cap where this host allows one, else a SIGSTOP/SIGCONT duty "
                                                  "cycle; docs/design#planning).", check=check_cpu_quota)
    runner: Path | None = setting(None, RUNNER_HELP)
    runner_prefix: str | None = setting(None, RUNNER_PREFIX_HELP)
    runtime: str = setting("executorch", "executorch: the stage programs on the devices (zl_runner); torch: one "
                                         "torch.distributed rank per stage on this host, in PyTorch eager, no export "
                                         "(docs/design#torch-runtime).", choices=RUNTIMES)
    schedule: str | None = setting(None, "How the stages train (docs/design#backprop-schedules): zerolock (each "
                                         "stage on its own local loss, no gradient crosses a link; with --stage-lr's "
                                         "default only the last stage trains), or end-to-end backprop, every stage on "
                                         "the final loss's gradient sent upstream: gpipe (a flush per window: exact "
                                         "backprop), 1f1b (the same numbers, fewer inputs held), async (PipeDream: "
                                         "no flush, a stage's first micro-batches of a window on weights one step "
                                         "old; `pipedream` is its other name). Default: by the data, async on "
                                         "generative rows (prompt/completion, chat), zerolock on label words (the "
                                         "demo task, AG News labels). Both runtimes.", choices=tuple(SCHEDULE_NAMES))
    grad_dtype: str = setting("bf16", "Backprop schedules: how grad_hidden travels upstream, bf16 (half the bytes) "
                                      "or f32 (exact).", choices=("bf16", "f32"))
    keep_activations: bool = setting(False, "Backprop schedules on the ExecuTorch runtime: a stage before the last "
                                            "keeps each micro-batch's forward until its gradient comes instead of "
                                            "running the forward again (one program instance per micro-batch in "
                                            "flight: less compute, more memory; docs/design#backprop-schedules). The "
                                            "torch runtime always keeps them.", flag="--keep-activations")
    launcher: str = setting("spawn", "--runtime torch: spawn runs one process per stage on this host; torchrun only "
                                     "prepares --out and prints the torchrun command that starts the ranks (multi-GPU, "
                                     "multi-node), then `zl merge` and `zl report`.", choices=LAUNCHERS)
    out: Path = setting(Path("runs/train"), "Run directory (must be new or empty).")
    recovery: str | None = setting(None, "local: restart only the failed stage (zerolock's default); global: roll every "
                                         "stage back and restart them all (the default of gpipe, 1f1b and async, "
                                         "which need it, and of --runtime torch, the only one there).",
                                  choices=RECOVERY_MODES)
    max_restarts: int = setting(MAX_RESTARTS, "Restarts of a failing stage (--runtime torch: of every rank) before "
                                              "the run gives up (then `--resume` continues it).")
    inject_failure: str | None = setting(None, "STAGE@WINDOW: SIGKILL that stage in the middle of that window.")
    spares: int = setting(0, "Devices after the stages' that take over a failed stage.")
    standby: bool = setting(False, "Keep a hot standby runner per stage (local devices, phones in --mode binary): "
                                   "its program mapped and its method loaded, it takes over a failed stage from its "
                                   "checkpoint without a cold start; costs a second process (method memory) per stage.",
                            flag="--standby")
    #: --max-temperature, --min-battery, --require-charging (docs/design#device-policies)
    policy: DevicePolicy = nested(DevicePolicy)
    keep_device_files: bool = setting(False, "Leave the run key, data shard and input logs on the devices when the "
                                             "run ends (by default they are deleted once a finished run's results "
                                             "are pulled; a failed run keeps them for --resume).")
    accumulator_snapshots: bool = setting(True, "Runners save the window's gradient sum after every micro-batch "
                                                "(in the background), so a restarted stage continues its window "
                                                "instead of recomputing it (docs/design#recovery-in-detail).")
    seed: int = setting(0, "Seeds LoRA init, data order and the demo task.")
    export: ExportOptions = nested(ExportOptions, skip=("seq_len", "seed"))  # the run's: --seq-len, --seed above
    optimizer: OptimizerSettings = nested(OptimizerSettings)  # --lr; the rest are not on the command line
    stage_lr: tuple[float, ...] | None = setting(None, "Learning-rate multiplier per stage (one value for every "
                                                       "stage, or one per stage, e.g. 1,1,2; 0: the stage runs "
                                                       "forward only and does not train). Default: 0 before the "
                                                       "last stage and 1 on it (e.g. 0,0,1), which in every "
                                                       "study matched or beat every stage training on its local "
                                                       "loss (--stage-lr 1; docs/studies/README.md).")
    threads: int | None = setting(None, "ExecuTorch threads per runner. Default: each device's own: on a phone its "
                                        "performance cores (those outside its slowest cluster), on a local device "
                                        "its --cpu-quota rounded up, else this host's CPUs shared among the "
                                        "stages; the torch runtime: 1 per rank.", check=check_threads)
    load_mode: str = setting("mmap", "How runners hold the frozen weights: mmap (mapped from the program file: "
                                     "file-backed pages the OS can reclaim) or file (read into heap memory).",
                             choices=LOAD_MODES)
    eval_limit: int | None = setting(None, "Evaluate on the first N dev rows only.")
    timeout_s: float = setting(3600.0, "Give up when the run takes longer (seconds; time a device policy holds a "
                                       "stage paused does not count).", flag="--timeout")
    resume: bool = setting(False, "Continue the unfinished run in --out (after the host died, a failure or Ctrl-C) "
                                  "from its stages' checkpoints; the run's own settings are kept.")
    link_timeout_s: float = setting(600.0, "--runtime torch: a stage that waits this long (seconds) for a neighbour's "
                                           "hidden state fails the run.", flag="--link-timeout")
    # Not on the command line: tests and experiments set them.
    in_flight: int = setting(4, "Un-acknowledged entries per link (the runner's in_flight_depth).", cli=False)
    link_profile: str | None = setting(None, "Shape local links like local, wifi, mobile or constrained.", cli=False)
    heartbeat_timeout_s: float = setting(30.0, "A stage without a heartbeat for this long has failed.", cli=False)
    stall_timeout_s: float = setting(STALL_TIMEOUT_S, "A stage whose progress stopped this long while its input was "
                                     "there is restarted (seconds, below the runners' 600 s input timeout; 0: off).",
                                     flag="--stall-timeout")
    export_cache: Path | None = setting(None, "Export cache folder (default: $ZL_CACHE_DIR/exports).", cli=False)

    def __post_init__(self) -> None:
        # Each runtime's own default; a backprop schedule's stages restart together. Under --schedule's default it
        # waits for the schedule the data chooses (train_data.resolve_schedule).
        if self.recovery is None and (self.schedule is not None or self.runtime == "torch"):
            self.recovery = "global" if self.runtime == "torch" or is_backprop(self.schedule) else "local"
        if self.devices is None:  # one local device per stage and per spare: --stages 0-5,6-11,12-16,17-21 gets 4
            stages = self.split.stages
            ranges = stages is not None and re.fullmatch(r"[\d\s,-]+", stages) is not None  # not auto, not a plan
            count = self.split.count if ranges else self.split.num_stages
            self.devices = f"local:{max(count, 1) + max(self.spares, 0)}"  # a bad count is --num-stages' to refuse
        if self.runner is not None:  # absolute in RUN_DIR's settings: `--resume` may run from another folder
            self.runner = Path(self.runner).expanduser().resolve()

    @property
    def devices_spec(self) -> DevicesSpec:
        """--devices, parsed: the one place it is (the kind, the count, the serials).

        Raises:
            ZLError: a spec that does not parse.
        """
        return parse_devices(self.devices)

    def validate(self) -> None:
        """The checks that need no model or device; run before anything slow."""
        if not 0 <= self.stall_timeout_s < RUNNER_INPUT_TIMEOUT_S:
            raise ZLError(f"--stall-timeout {self.stall_timeout_s:g}: expected 0 (off) or a time below the runners' "
                          f"input timeout of {RUNNER_INPUT_TIMEOUT_S:g} s (after it the stages waiting on a stalled "
                          f"one give up first and are blamed), e.g. --stall-timeout {STALL_TIMEOUT_S:g}.")
        if self.max_restarts < 0:
            raise ZLError(f"--max-restarts {self.max_restarts}: must be 0 (fail at the first failure) or more, e.g. "
                          f"--max-restarts {MAX_RESTARTS}.")
        if self.samples < 1 or self.window < 1:
            raise ZLError(f"--samples {self.samples} --window {self.window}: both must be at least 1.")
        check_fields(self)  # the choices, --devices, --cpu-quota's range
        spec = self.devices_spec
        if self.cpu_quota is not None:
            if self.runtime == "torch":
                raise ZLError("--cpu-quota caps local zl_runner devices; the torch runtime's ranks are not capped "
                              "(tools/bench_pipelines.py --cpus-per-rank is). Drop --cpu-quota or --runtime torch.")
            check_cpu_quota_fits(spec, self.cpu_quota)
        if self.runner is not None or self.runner_prefix is not None:
            if self.runtime == "torch":
                raise ZLError("--runner and --runner-prefix choose the zl_runner the devices run; --runtime torch runs "
                              "PyTorch ranks on this host. Drop them, or use --runtime executorch.")
            check_runner(spec, self.mode, self.runner, self.runner_prefix)
        self.rows.validate()  # --seq-len's range, the column options
        self.optimizer.validate()
        self.policy.validate()  # --max-temperature's and --min-battery's ranges
        if self.policy.active and self.runtime == "torch":
            raise ZLError("--max-temperature, --min-battery and --require-charging pause stages on their devices; "
                          "--runtime torch runs its ranks on this host without them. Drop them, or use --runtime "
                          "executorch.")
        if self.schedule is not None and self.backprop and self.runtime == "executorch":  # else once resolved
            if self.recovery == "local":
                raise ZLError(f"--schedule {self.schedule} --recovery local: a stage restarted alone would need the "
                              "gradients its downstream already sent; backprop schedules restart every stage from "
                              "their last common window (--recovery global, their default). Drop --recovery local.")
            if self.standby:
                raise ZLError(f"--schedule {self.schedule} --standby: hot standbys take over ZeroLock stages only; "
                              "drop --standby (a failed stage restarts with every stage, --recovery global).")
        if self.keep_activations and self.schedule is not None and not self.backprop:
            raise ZLError(f"--keep-activations --schedule {self.schedule}: a ZeroLock stage finishes each micro-batch "
                          "in one go and has no forward waiting for a gradient; add --schedule async (or gpipe, "
                          "1f1b), or drop --keep-activations.")
        if self.launcher != "spawn" and self.runtime != "torch":
            raise ZLError(f"--launcher {self.launcher}: launchers start torch.distributed ranks; add --runtime torch.")
        if self.link_timeout_s <= 0:
            raise ZLError(f"--link-timeout {self.link_timeout_s:g}: must be a positive number of seconds, e.g. 600.")
        self.split.validate()
        self.export.validate()
        stages = self.split.count
        self.export.loss.validate(stages)
        self.check_stage_lr(stages)

    def check_stage_lr(self, stages: int) -> None:
        """--stage-lr's values against `stages` stages (no --stage-lr: its default, resolved once the split is)."""
        if self.stage_lr is None:
            return
        shown = ",".join(f"{m:g}" for m in self.stage_lr)
        if not self.stage_lr or not all(m >= 0 for m in self.stage_lr) or not any(m > 0 for m in self.stage_lr):
            raise ZLError(f"--stage-lr {shown}: learning-rate multipliers must be 0 (the stage does not train) or "
                          "positive, and at least one positive, e.g. --stage-lr 1,1,2 or 0,0,1.")
        if len(self.stage_lr) not in (1, stages):
            raise ZLError(f"--stage-lr {shown}: {len(self.stage_lr)} values for {stages} stages; give one value for "
                          f"every stage or exactly {stages}.")

    @property
    def chosen_schedule(self) -> str:
        """--schedule, given or chosen for the data.

        Raises:
            RuntimeError: its default not chosen yet (train_data.resolve_schedule comes before anything asks).
        """
        if self.schedule is None:
            raise RuntimeError("--schedule's default asked for before it was chosen for the data "
                               "(zl_device.run.train_data.resolve_schedule)")
        return self.schedule

    @property
    def backprop(self) -> bool:
        """An end-to-end backprop schedule (gpipe, 1f1b, async): every stage trains on the final loss's gradient
        (raises as `chosen_schedule` before --schedule's default is chosen)."""
        return is_backprop(self.chosen_schedule)

    def with_schedule_for(self, generative: bool) -> TrainSettings:
        """These settings with --schedule's default chosen for data that is generative or not (SCHEDULE_BY_DATA),
        and the recovery mode that schedule defaults to (unless --recovery was given): the rule, which
        train_data.resolve_schedule applies to the run's data."""
        if self.schedule is not None:
            return self
        return replace(self, schedule=SCHEDULE_BY_DATA[generative])

    def windows(self) -> WindowPlan:
        """The run's micro-batches (--samples in micro-batches of --micro-batch) in windows of --window."""
        return WindowPlan.for_samples(self.samples, self.export.micro_batch, self.window)

    def export_options(self, seq_len: int, max_targets: int | None = None) -> ExportOptions:
        """The export's options with the run's sequence length and target slots (resolved by the job) and seed."""
        return replace(self.export, seq_len=seq_len, seed=self.seed,
                       max_targets=self.export.max_targets if max_targets is None else max_targets)


# --schedule's default, by the data (docs/studies/README.md). Generative rows: async, level with whole-model backprop
# on AG News headlines over 3 seeds (NLL 3.066 both, ROUGE-L 21.3 vs 21.4), where holding the upstream stages still
# stays 3.3% behind in NLL (study headlines-smollm2-135m-1024-async). Label words: zerolock with the upstream stages
# held still, as accurate as async and backprop there (a point better on Gemma 3 270M) at 1.3-1.4x async's records/s.
SCHEDULE_BY_DATA = {True: "async", False: "zerolock"}


def default_stage_lr(stages: int) -> tuple[float, ...]:
    """--stage-lr's default, on every kind of data: 0 for the stages before the last (they run forward only and
    hand on their hidden state) and 1 for the last, which trains on the true output. In the studies
    (docs/studies/README.md), training the upstream stages on their own readouts never beat holding them still and
    once lost badly: a tie on AG News label words with SmolLM2-135M (agnews-smollm2-135m-1024-local-losses), a clear
    loss with Gemma 3 270M (agnews-gemma3-270m-1024), and worse than the base model on AG News headlines
    (headlines-smollm2-135m-1024-local-losses). Holding them still is also faster per step (docs/benchmarks.md).
    `--stage-lr 1` trains every stage on its local loss (docs/design#windows-and-adamw)."""
    if stages < 2:
        return (1.0,)
    return (0.0,) * (stages - 1) + (1.0,)
