"""Deploy an export to devices and pull a run's results back (`zl deploy`, `zl pull`, the orchestrator).

A deployed device's workdir holds, flat:

    zl_runner          the runner (`zl train --runner`, else the host build for local devices and for phones
                       the static arm64 build of tools/build_phone_runner.sh, else build-android/zl_runner;
                       not in `--mode app`, where the app is installed instead: `Device.install_runtime`)
    manifest.json      the export's manifest
    stage_<k>.pte      this device's stage program
    stage_<k>.json     the stage config, its host paths rewritten to the names above (when given)
    run.key, *.safetensors ...   the other files the config names (run key, data shard)
    FILE.pte, tokenizer.json, tokenizer_config.json   an inference program of `zl export-model` and its
                       tokenizer (`deploy_program`, `zl deploy --program`)

Stage k goes to devices[k]; devices past the last stage are spares and get
the runner (or the app) and manifest only (`deploy_stage` puts a stage on one when the
orchestrator moves a failed stage there). Files whose sha256 already matches
are not pushed again: a stage program is ~250 MB.

`pull` copies back, per device, into OUT/logs/<device>/ (runner.out,
runner.err, runner.exit, stage configs, telemetry) and complete checkpoints
into OUT/checkpoints/stage_<k>/.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from zl_base.errors import ZLError
from zl_base.files import file_sha256
from zl_base.json_reader import read_json_file
from zl_device.formats.checkpoints import DEFAULT_LAYOUT
from zl_device.formats.run_layout import MANIFEST, METRICS, RunLayout, stage_config_index, stage_config_name
from zl_device.formats.runner_config import INPUT, RunnerConfig, path_fields
from zl_device.devices.backend import (
    RUNNER_EXIT,
    RUNNER_NAME,
    RUNNER_STDERR,
    RUNNER_STDOUT,
    ByteCallback,
    Device,
    FileCallback,
    RuntimeInstall,
    elf_machine,
)

if TYPE_CHECKING:
    from zl_export.manifest import Manifest

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
#: Room left free for checkpoints, input logs and telemetry beyond the pushed files, bytes.
DISK_MARGIN = 64 << 20
#: Files at least this big are hashed on both sides before pushing (smaller ones are just pushed).
_HASH_MIN_BYTES = 1 << 20
ANDROID_RUNNER_ENV = "ZL_ANDROID_RUNNER"


#: tools/build_phone_runner.sh's static aarch64 zl_runner: needs nothing of the phone but its kernel, and is the
#: build that ran the C++ suite and `zl train` under qemu-aarch64 (issue 41).
PHONE_RUNNER = REPO / "build-phone" / "zl" / "runner" / RUNNER_NAME


#: ExecuTorch's LLM runner, built by tools/build_llm_runner.sh: for this host, and static for phones (aarch64).
LLAMA_MAIN = "llama_main"
HOST_LLAMA_MAIN = REPO / "build-llm" / "x86_64" / LLAMA_MAIN
PHONE_LLAMA_MAIN = REPO / "build-llm" / "aarch64" / LLAMA_MAIN
LLAMA_MAIN_ENV, HOST_LLAMA_MAIN_ENV = "ZL_LLAMA_MAIN", "ZL_HOST_LLAMA_MAIN"
LLM_RUNNER_HINT = "`ZL_EXECUTORCH_SRC=<ExecuTorch checkout> tools/build_llm_runner.sh`"


def llm_runner_binary(phone: bool) -> Path | None:
    """The llama_main build for a phone (aarch64, `phone`) or for this host: $ZL_LLAMA_MAIN / $ZL_HOST_LLAMA_MAIN
    when set, else tools/build_llm_runner.sh's build when it is there, else None (not built: nothing to push).

    Raises:
        ZLError: the variable names no file.
    """
    env = LLAMA_MAIN_ENV if phone else HOST_LLAMA_MAIN_ENV
    if env in os.environ:
        path = Path(os.environ[env])
        if not path.is_file():
            raise ZLError(f"{env}={path}: no such file; build llama_main with {LLM_RUNNER_HINT} or unset {env}.")
        return path
    path = PHONE_LLAMA_MAIN if phone else HOST_LLAMA_MAIN
    return path if path.is_file() else None


def android_runner_binary() -> Path:
    """The arm64-v8a runner phones get in `--mode binary`: $ZL_ANDROID_RUNNER, else the static build of
    tools/build_phone_runner.sh (PHONE_RUNNER), else the NDK build $ZL_ANDROID_BUILD_DIR/zl_runner (default
    build-android/).

    Raises:
        ZLError: none is built, with the commands that build one, or the file is not an AArch64 executable.
    """
    build_dir = Path(os.environ.get("ZL_ANDROID_BUILD_DIR", REPO / "build-android"))
    if ANDROID_RUNNER_ENV in os.environ:
        path = Path(os.environ[ANDROID_RUNNER_ENV])
    else:
        path = PHONE_RUNNER if PHONE_RUNNER.is_file() else build_dir / RUNNER_NAME
    if not path.is_file():
        raise ZLError(
            f"{path}: the Android (arm64-v8a) zl_runner is not built; build the static one with "
            f"`ZL_EXECUTORCH_SRC=<ExecuTorch checkout> tools/build_phone_runner.sh` (into {PHONE_RUNNER}), or set "
            f"ANDROID_NDK, EXECUTORCH_ANDROID_PREFIX and ZL_SODIUM_ANDROID_PREFIX and run "
            f"`tools/build_android.sh --native-only` (`--check` lists what is missing), or set {ANDROID_RUNNER_ENV} "
            f"to a built binary."
        )
    return check_phone_runner(path, "`tools/build_phone_runner.sh` or `tools/build_android.sh --native-only`")


def check_phone_runner(path: Path, how: str) -> Path:
    """`path`, checked to be an AArch64 ELF executable: a host build pushed to a phone fails with a cryptic "not
    executable: 64-bit ELF file" only when it starts.

    Raises:
        ZLError: it is not; `how` says how to build the right one.
    """
    arch = elf_machine(path)
    if arch != "aarch64":
        raise ZLError(f"{path} is not an AArch64 ELF executable ({arch or 'not ELF'}); phones run arm64 builds: "
                      f"build one with {how}.")
    return path


def runner_binary_for(device: Device) -> Path:
    """The runner build that runs on `device`: its own (`--runner`), else its backend's default."""
    if device.runner_binary is not None:
        return device.runner_binary
    if device.kind == "local":
        from zl_device.devices.local import host_runner_binary

        return host_runner_binary()
    return android_runner_binary()


@dataclass
class DeployResult:
    device: str
    stage: int | None  # None for a spare
    pushed: list[str] = field(default_factory=list)  # remote names
    unchanged: list[str] = field(default_factory=list)
    bytes_pushed: int = 0
    config: str | None = None  # remote name of the stage config
    runtime: RuntimeInstall | None = None  # the app, where the device runs one (`--mode app`)
    runner: str | None = None  # `zl_runner --version` of the runner now on the device (zl, ExecuTorch, arch)
    runner_sha256: str | None = None  # sha256 of zl_runner as the device holds it (None: none, or unreadable)
    llm_runner: Path | None = None  # the llama_main build `deploy_program` put beside the program (None: none built)
    program_data: str | None = None  # the program's data file beside it (`--shared-base`), for running it


def _load_config(config: Path | Mapping | RunnerConfig, base: Path, program: str) -> tuple[RunnerConfig, Path]:
    """A stage config and the folder its relative paths resolve against; one without "program" gets `program`."""
    if isinstance(config, RunnerConfig):
        return config, base
    fix = "fix the stage config (`zl_runner --help` lists its fields)"
    if isinstance(config, Mapping):
        label = "stage config"
    else:
        path = Path(config)
        label, base = f"stage config {path}", path.parent
        config = read_json_file(path, label, missing="no such file; pass the stage_<k>.json that `zl train` wrote",
                                invalid=fix)
    if isinstance(config, dict):
        config = {"program": program, **config}
    return RunnerConfig.from_json(config, label, fix), base


def deploy_stage(
    device: Device,
    export_dir: Path,
    stage: int | None,
    config: Path | Mapping | RunnerConfig | None = None,
    runner: Path | None = None,
    manifest: Manifest | dict | None = None,
    force: bool = False,
    on_file: FileCallback | None = None,
    on_bytes: ByteCallback | None = None,
) -> DeployResult:
    """Put the runner (or the app), the manifest and (unless `stage` is None) stage `stage`'s program and config
    on `device`.

    Args:
        config: the stage's runner config, a JSON file, its JSON object or a `RunnerConfig`, checked before
            anything is pushed; relative paths in it resolve against the file's folder (else `export_dir`). Host
            files it names are pushed next to it and the fields rewritten to their names; paths that do not exist
            on the host are kept (device paths).
        runner: the runner binary (default: the build for this device's kind); devices that do not run the
            binary (`--mode app`) take none.
        manifest: the export's manifest, when the caller has read it already (launch.py passes its JSON object).
        force: push even files whose sha256 already matches (and reinstall the app).

    Raises:
        ZLError: a missing export file, runner build or APK, a config for another stage, or too little free space.
    """
    from zl_export.manifest import as_manifest, load_export

    export_dir = Path(export_dir)
    manifest = as_manifest(manifest, export_dir / MANIFEST) if manifest else load_export(export_dir)
    files: dict[str, tuple[Path, int]] = {}
    if device.runs_runner_binary:
        files[RUNNER_NAME] = (Path(runner) if runner else runner_binary_for(device), 0o755)
    elif runner is not None:
        raise ZLError(f"--runner {runner}: {device.name} runs its stage in the app (--mode app), which carries its "
                      "own runtime; drop --runner (set ZL_ANDROID_APK to install another APK).")
    files[MANIFEST] = (export_dir / MANIFEST, 0o644)
    config_text = None
    if stage is not None:
        entries = {s.index: s for s in manifest.stages}
        if stage not in entries:
            raise ZLError(f"stage {stage}: {export_dir} has stages {sorted(entries)}.")
        program = entries[stage].file
        files[program] = (export_dir / program, 0o644)
        if config is not None:
            cfg, base = _load_config(config, export_dir, program)
            if cfg.stage_index != stage:
                raise ZLError(f"config {config if not isinstance(config, (Mapping, RunnerConfig)) else ''} is for "
                              f"stage {cfg.stage_index}, but {device.name} gets stage {stage}; pass stage {stage}'s.")
            on_device = {}
            for key in path_fields(INPUT):
                value = getattr(cfg, key)
                if not value:
                    continue
                host = (base / value) if not os.path.isabs(value) else Path(value)
                if host.is_file():
                    if key == "data_shard":
                        _check_shard_fits(host, manifest)
                    if key == "run_key_file" and not device.workdir_is_private:
                        device.hold_run_key(host)  # passed with each START, into the app's private storage
                        on_device[key] = os.path.basename(value)
                        continue
                    name = os.path.basename(value)
                    if name in files and files[name][0].resolve() != host.resolve():
                        raise ZLError(f"config field {key}={value}: another file named {name} is deployed too; "
                                      "rename one of them.")
                    # The run key is owner-only on the device too (created so by push, not chmod-ed after).
                    files[name] = (host, 0o600 if key == "run_key_file" else 0o644)
                    on_device[key] = name
                elif not os.path.isabs(value) and value not in files:
                    raise ZLError(f"config field {key}={value}: no such file under {base}; fix the stage config.")
            config_text = json.dumps(replace(cfg, **on_device).to_json(), indent=2) + "\n"

    for name, (host, _) in files.items():
        if not host.is_file():
            raise ZLError(f"{host}: missing; cannot deploy {name} to {device.name}.")
    # First, as the app creates the workdir it runs in.
    runtime = device.install_runtime(force, on_file, on_bytes)
    result = DeployResult(device.name, stage, runtime=runtime, bytes_pushed=runtime.bytes_pushed if runtime else 0)
    _push_files(device, files, result, force, on_file, on_bytes)
    if RUNNER_NAME in files:  # what the device now holds, hashed there and asked itself (zl_runner --version)
        result.runner, result.runner_sha256 = device.runner_version(), device.file_sha256(RUNNER_NAME)
    if config_text is not None:
        result.config = stage_config_name(stage)
        device.write_text(result.config, config_text)
        result.pushed.append(result.config)
    log.info("%s: stage %s, pushed %s, unchanged %s", device.name, stage, result.pushed, result.unchanged)
    return result


def llm_runner_for(device: Device) -> Path | None:
    """ExecuTorch's llama_main for `device`, when tools/build_llm_runner.sh built it: the static aarch64 build for
    a phone that runs binaries from its workdir, the host build for a local device; None otherwise (the app runs
    no binaries of its own workdir).

    Raises:
        ZLError: the build (or $ZL_LLAMA_MAIN) for a phone is not an AArch64 executable.
    """
    if not device.runs_runner_binary:
        return None
    phone = device.kind != "local"
    path = llm_runner_binary(phone)
    return check_phone_runner(path, LLM_RUNNER_HINT) if phone and path is not None else path


def deploy_program(devices: Sequence[Device], program: Path, force: bool = False,
                   on_file: FileCallback | None = None, on_bytes: ByteCallback | None = None) -> list[DeployResult]:
    """Put an inference program of `zl export-model` and the tokenizer files beside it (tokenizer.json,
    tokenizer_config.json) into every device's workdir, next to the training files, so the phone that trained
    a model can run it (ExecuTorch's LLM runner reads the pair). Unchanged files are skipped as for stages.

    Raises:
        ZLError: a program that is not the one `zl export-model` wrote, or without its tokenizer files
            (`check_program`), or too little free space on a device.
    """
    from zl_export.program_record import check_program, record_path

    program = Path(program)
    record = check_program(program)
    files = {program.name: (program, 0o644), record_path(program).name: (record_path(program), 0o644)}
    files.update({t.name: (program.parent / t.name, 0o644) for t in record.tokenizer})
    if record.data_file is not None:  # --shared-base: pushed once per base, skipped by sha256 after
        files[record.data_file] = (program.parent / record.data_file, 0o644)
    results = []
    for device in devices:
        result = DeployResult(device.name, None)
        runner = llm_runner_for(device)
        _push_files(device, {**files, **({LLAMA_MAIN: (runner, 0o755)} if runner else {})}, result, force, on_file,
                    on_bytes)
        result.llm_runner, result.program_data = runner, record.data_file
        log.info("%s: program, pushed %s, unchanged %s", device.name, result.pushed, result.unchanged)
        results.append(result)
    return results


def _push_files(device: Device, files: dict[str, tuple[Path, int]], result: DeployResult, force: bool,
                on_file: FileCallback | None, on_bytes: ByteCallback | None) -> None:
    """Push {remote name: (host file, mode)} to `device`, skipping big files whose sha256 matches (unless
    `force`); recorded in `result`.

    Raises:
        ZLError: too little free space for the files to push and the margin for checkpoints and logs.
    """
    todo = []
    for name, (host, mode) in files.items():
        size = host.stat().st_size
        unchanged = (not force and size >= _HASH_MIN_BYTES and device.file_sha256(name) == file_sha256(host))
        if unchanged:
            result.unchanged.append(name)
            if on_file:
                on_file(device.name, name, size, True)
        else:
            todo.append((name, host, mode, size))
    needed = sum(t[3] for t in todo)
    if todo:
        free = device.free_bytes()
        if free < needed + DISK_MARGIN:
            raise ZLError(f"{device.name}: {free >> 20} MiB free under {posixpath.dirname(device.workdir)}, deploy "
                          f"needs {(needed + DISK_MARGIN) >> 20} MiB ({needed >> 20} MiB of files + "
                          f"{DISK_MARGIN >> 20} MiB for checkpoints and logs); free space on the device.")
    for name, host, mode, size in todo:
        if on_file:
            on_file(device.name, name, size, False)
        result.bytes_pushed += device.push(host, name, mode=mode, on_bytes=on_bytes)
        result.pushed.append(name)


def _check_shard_fits(shard: Path, manifest: Manifest) -> None:
    """Raise ZLError for a shard row with more targets than the programs' slots (docs/design#omega-readout).

    The programs cannot tell that a sample had more targets than they read out, so this is checked before
    the shard reaches a device (exports without `max_targets` read out every position: nothing to check).
    """
    slots = manifest.options.target_slots
    if slots:
        from zl_export.shard import load_shard

        load_shard(shard).check_target_slots(slots)


def deploy(
    devices: Sequence[Device],
    export_dir: Path,
    configs: Mapping[int, Path | Mapping | RunnerConfig] | Path | None = None,
    runner: Path | None = None,
    force: bool = False,
    on_file: FileCallback | None = None,
    on_bytes: ByteCallback | None = None,
) -> list[DeployResult]:
    """Stage k of `export_dir` to devices[k]; extra devices become spares (runner or app, and manifest only).

    Args:
        configs: {stage: config file or dict}, or a folder with stage_<k>.json files, or None (programs only).

    Raises:
        ZLError: fewer devices than stages, a missing config, or any `deploy_stage` error.
    """
    from zl_export.manifest import load_export

    manifest = load_export(Path(export_dir))
    num_stages = manifest.num_stages
    if len(devices) < num_stages:
        raise ZLError(f"{export_dir} has {num_stages} stages but --devices gives {len(devices)} device(s) "
                      f"({', '.join(d.name for d in devices)}); pass at least {num_stages}.")
    if isinstance(configs, (str, Path)):
        folder = Path(configs)
        configs = {k: folder / stage_config_name(k) for k in range(num_stages)}
        missing = [str(p) for p in configs.values() if not p.is_file()]
        if missing:
            raise ZLError(f"no stage config {', '.join(missing)}; --configs needs {stage_config_name(0)} .. "
                          f"{stage_config_name(num_stages - 1)}.")
    configs = configs or {}
    results = []
    for i, device in enumerate(devices):
        stage = i if i < num_stages else None
        results.append(deploy_stage(device, export_dir, stage, configs.get(stage) if stage is not None else None,
                                    runner, manifest, force, on_file, on_bytes))
    return results


@dataclass
class PullResult:
    device: str
    stages: list[int] = field(default_factory=list)
    logs_dir: Path | None = None
    checkpoint_dirs: dict[int, Path] = field(default_factory=dict)
    bytes_pulled: int = 0


def pull(devices: Sequence[Device], out_dir: Path, checkpoints: bool = True, input_logs: bool = False) -> list[PullResult]:
    """Copy each device's logs, telemetry and checkpoints into `out_dir` (see the module docstring).

    Incomplete checkpoints (`.tmp-*`) are skipped; input logs only with `input_logs`.
    """
    layout = RunLayout(out_dir)
    results = []
    for device in devices:
        result = PullResult(device.name, logs_dir=layout.device_logs(device.name))
        names = device.listdir(".")
        for name in (RUNNER_STDOUT, RUNNER_STDERR, RUNNER_EXIT):
            if name in names:
                result.bytes_pulled += device.pull(name, result.logs_dir / name)
        for name in names:
            stage = stage_config_index(name)
            if stage is None:
                continue
            result.stages.append(stage)
            result.bytes_pulled += device.pull(name, result.logs_dir / name)
            try:
                cfg = json.loads(device.read_text(name) or "{}")
            except json.JSONDecodeError:
                log.warning("%s: %s is not valid JSON; pulled it without its telemetry", device.name, name)
                continue
            telemetry = cfg.get("log_path") or METRICS
            if device.exists(telemetry):
                result.bytes_pulled += device.pull(telemetry, result.logs_dir / posixpath.basename(telemetry))
            ckpt = cfg.get("checkpoint_dir")
            if checkpoints and ckpt and device.exists(ckpt):
                target = layout.stage_checkpoints(stage)
                # The accumulator snapshot (a window in progress, docs/design#recovery-in-detail) goes with the input
                # logs.
                exclude = (".tmp-*",) + (() if input_logs else (DEFAULT_LAYOUT.input_log_dir,
                                                                  f"{DEFAULT_LAYOUT.accumulator_file}*"))
                result.bytes_pulled += device.pull(ckpt, target, exclude=exclude)
                result.checkpoint_dirs[stage] = target
        results.append(result)
    return results


def remove_run_files(devices: Sequence[Device]) -> list[str]:
    """Delete what a run leaves on devices that others should not keep: the run key, the data shard, input logs
    and the accumulator snapshot (gradients of training data, like the input logs' hidden states).

    Only the files each device's stage configs (stage_<k>.json) name by a relative path, i.e. the ones deploy
    pushed into the workdir or the runner made there; checkpoints, telemetry and the programs stay (they are
    pulled, or cached for the next run). In app mode the app deletes its private copy of the key itself.

    Returns:
        "<device>:<path>" of everything removed.
    """
    removed = []
    for device in devices:
        for name in device.listdir("."):
            if stage_config_index(name) is None:
                continue
            try:
                cfg = json.loads(device.read_text(name) or "{}")
            except json.JSONDecodeError:
                log.warning("%s: %s is not valid JSON; its files are left on the device", device.name, name)
                continue
            ckpt = cfg.get("checkpoint_dir")
            paths = [cfg.get("run_key_file"), cfg.get("data_shard"),
                     cfg.get("input_log_dir") or (DEFAULT_LAYOUT.device_input_log(ckpt) if ckpt else None),
                     DEFAULT_LAYOUT.device_accumulator(ckpt) if ckpt else None]
            for path in paths:
                if path and not posixpath.isabs(path) and ".." not in path.split("/") and device.exists(path):
                    device.remove(path)
                    removed.append(f"{device.name}:{path}")
    log.info("removed from the devices: %s", removed)
    return removed
