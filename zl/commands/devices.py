"""`zl devices`, `zl deploy`, `zl pull`: see the phones, put an export on devices, copy a run's results back."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import typer

from zl_base.errors import ZLError
from zl_device.formats.run_layout import RunLayout
from zl.options import settings_command
from zl_base.settings import REQUIRED, setting
from zl_device.devices.registry import MODE_HELP

DEVICES_HELP = "local:N (N local processes) or phone serials SERIAL1,SERIAL2,... in stage order (see `zl devices`)."


@dataclass(frozen=True)
class DevicesArgs:
    """`zl devices`' options."""

    as_json: bool = setting(False, "Print one JSON object per device instead of a table.", flag="--json")


DEVICES_DOC = """List attached phones (serial, state, model, ABI, Android version, installed app version, the
zl_runner it holds) and the always-available `local` backend.

A phone must be `ready`: authorized, online and arm64-v8a. The `app` column shows the version of the
com.zerolock.zl app (`--mode app`), `-` when it is not installed. The `runner` column shows what the
zl_runner that `zl deploy` left in /data/local/tmp/zerolock (`--mode binary`) says of itself: its zl and
ExecuTorch versions, architecture, static or dynamic; `-` when there is none. For `local` it is this
host's build. The adb server is started when it is not running.

Examples:

  zl devices

  zl devices --json
"""


def run_devices(args: DevicesArgs) -> None:
    import os
    import platform

    from zl_device.devices.adb import connect, list_phones
    from zl_device.devices.backend import DeviceInfo

    rows = [DeviceInfo("local", "local", "ready", model=platform.node() or "this host", abi=platform.machine(),
                       note=f"{os.cpu_count()} CPUs; --devices local:N", runner=_host_runner_version())]
    adb_problem = ""
    try:
        client = connect()
        rows += [_with_versions(client, r) for r in list_phones(client)]
    except ZLError as e:
        adb_problem = str(e)
    if args.as_json:
        for row in rows:
            typer.echo(json.dumps(dataclasses.asdict(row)))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table("device", "kind", "state", "model", "ABI", "Android", "app", "runner", "note", box=None)
        for r in rows:
            state = r.state if r.state == "ready" else f"[red]{r.state}[/red]"
            app = r.app or ("-" if r.kind == "adb" and r.state == "ready" else "")
            runner = r.runner.removeprefix("zl_runner ") or ("-" if r.state == "ready" else "")
            table.add_row(r.name, r.kind, state, r.model, r.abi, r.android, app, runner, r.note)
        Console().print(table)
        if len(rows) == 1 and not adb_problem:
            typer.echo("no phones attached (enable USB debugging and plug one in, or `adb connect IP:5555`).", err=True)
    if adb_problem:
        typer.echo(f"phones: unavailable: {adb_problem}", err=True)


def _with_versions(client, row):
    """`row` with the installed app's version and the deployed zl_runner's, for a ready phone (a failed lookup
    leaves them empty)."""
    from zl_device.devices.adb import runner_version
    from zl_device.devices.app import app_version

    if row.state != "ready":
        return row
    try:
        dev = client.device(row.name)
        return dataclasses.replace(row, app=app_version(dev, row.name) or "",
                                   runner=runner_version(dev, row.name) or "")
    except ZLError:
        return row


def _host_runner_version() -> str:
    """`zl_runner --version` of this host's build; "" when it is not built or does not answer."""
    import subprocess

    from zl_device.devices.local import host_runner_binary

    try:
        done = subprocess.run([str(host_runner_binary()), "--version"], capture_output=True, text=True, timeout=30)
    except (ZLError, OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def _progress():
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    return Progress(*columns, console=Console(stderr=True), transient=True)


@dataclass(frozen=True)
class DeployArgs:
    """`zl deploy`'s options."""

    devices: str = setting(REQUIRED, DEVICES_HELP, flag="--devices -d")
    export: Path | None = setting(None, "Output directory of `zl export` (manifest.json, stage_<k>.pte).",
                                  flag="--export -e")
    program: Path | None = setting(None, "An inference program of `zl export-model` (.pte): pushed with the "
                                         "tokenizer files beside it to every device, next to the training files.")
    configs: Path | None = setting(None, "Folder with stage_<k>.json runner configs; the files they name (data "
                                         "shard, run key) are pushed too.")
    run_dir: Path | None = setting(None, "Local devices only: their folders are RUN_DIR/devices/local-N.")
    runner: Path | None = setting(None, "The zl_runner binary to push (default: build/runner/zl_runner "
                                        "for local devices; for phones the static build of "
                                        "tools/build_phone_runner.sh, else build-android/zl_runner).")
    force: bool = setting(False, "Push every file, even those whose sha256 already matches (and reinstall the app).",
                          flag="--force")
    mode: str = setting("binary", MODE_HELP)


DEPLOY_DOC = """Push the runner, the manifest and stage k's program (and config) to the k-th device.

Phones get /data/local/tmp/zerolock/; devices beyond the number of stages are spares (runner and manifest only).
Unchanged files are skipped by sha256. Each device's line ends with what its zl_runner says of itself
(`zl_runner --version`: zl and ExecuTorch versions, architecture, static or dynamic) and the sha256 the
device computes of it. Phones get --runner, else the static build of tools/build_phone_runner.sh
(build-phone/zl/runner/zl_runner), else build-android/zl_runner.

With --mode app, phones get the app com.zerolock.zl instead of zl_runner (reinstalled only when the APK changed).
Their files go to the app's folder /sdcard/Android/data/com.zerolock.zl/files/, except the run key: that folder
is shared storage, so the key goes with the START intent (`--es run_key`) into the app's private storage.

With --program FILE.pte (from `zl export-model`), every device also gets that inference program and the
tokenizer.json beside it, and ExecuTorch's LLM runner llama_main where tools/build_llm_runner.sh built it (phones
in binary mode: build-llm/aarch64/llama_main or $ZL_LLAMA_MAIN; local devices: build-llm/x86_64/llama_main or
$ZL_HOST_LLAMA_MAIN); the last line says how to run it there.

Examples:

  zl deploy --devices local:3 --export runs/export --run-dir runs/demo

  zl deploy --devices R58M123,R58M456 --program runs/r1/model-int8.pte

  zl deploy --devices R58M123,R58M456,R58M789 --export runs/export --configs runs/demo/configs

  zl deploy --devices R58M123,R58M456,R58M789 --mode app --export runs/export --configs runs/demo/configs
"""


def run_deploy(args: DeployArgs) -> None:
    from zl_device.devices.deploy import deploy, deploy_program
    from zl_device.devices.registry import open_devices

    configs = args.configs
    if args.export is None and args.program is None:
        raise ZLError("zl deploy: nothing to push; pass --export DIR (a `zl export` of stage programs) and/or "
                      "--program FILE.pte (a `zl export-model` program), e.g. zl deploy -d local:2 -e runs/export.")
    if args.export is None and configs is not None:
        raise ZLError(f"--configs {configs}: stage configs go with the stage programs of --export; pass --export.")
    if args.runner is not None:
        from zl_device.devices.registry import LOCAL, check_runner, parse_devices

        spec = parse_devices(args.devices)
        if spec.kind != LOCAL:  # phones: an AArch64 build, and none in app mode (local devices run what they get)
            check_runner(spec, args.mode, args.runner, None)
    opened = open_devices(args.devices, args.run_dir, mode=args.mode)
    with _progress() as progress:
        task = progress.add_task("deploy", total=None)

        def on_file(device: str, name: str, size: int, unchanged: bool) -> None:
            if not unchanged:
                progress.reset(task, total=size, description=f"{device}: {name}")

        def advance(n: int) -> None:
            progress.advance(task, n)

        results = (deploy(opened, args.export, configs, args.runner, args.force, on_file, advance)
                   if args.export is not None else [])
        programs = (deploy_program(opened, args.program, args.force, on_file, advance)
                    if args.program is not None else [])
    for r in results:
        what = f"stage {r.stage}" if r.stage is not None else "spare"
        unchanged = f", {len(r.unchanged)} unchanged" if r.unchanged else ""
        app = (f", {r.runtime.name} {'installed' if r.runtime.installed else 'unchanged'}" if r.runtime else "")
        typer.echo(f"{r.device}: {what}: pushed {len(r.pushed)} files ({r.bytes_pushed / 2**20:.1f} MiB){unchanged}"
                   + (f", config {r.config}" if r.config else "") + app + _runner_note(r))
    for r in programs:
        unchanged = f", {len(r.unchanged)} unchanged" if r.unchanged else ""
        typer.echo(f"{r.device}: program: pushed {len(r.pushed)} files ({r.bytes_pushed / 2**20:.1f} MiB){unchanged}"
                   f" ({', '.join(r.pushed + r.unchanged)})")
    note = _llm_runner_note(opened, programs, args.program) if programs else ""
    if note:
        typer.echo(note)
    if configs is not None and any(not d.workdir_is_private for d in opened):
        typer.echo("run key: not pushed (the app's folder is shared storage); START a stage with "
                   "`--es run_key <the key file's 64 hex characters>` (android_app/README.md).")


def _llm_runner_note(devices, results, program: Path) -> str:
    """How to run the pushed program with ExecuTorch's llama_main on the first device that got it, or how to build
    llama_main when none did; "" when no device runs binaries of its own (the app)."""
    from zl_device.devices.deploy import LLAMA_MAIN, LLM_RUNNER_HINT

    for device, result in zip(devices, results):
        if result.llm_runner is None:
            continue
        data = result.program_data
        run = (f"cd {device.workdir} && ./{LLAMA_MAIN} --model_path={program.name} --tokenizer_path=tokenizer.json"
               + (f" --data_paths={data}" if data else "") + " --temperature=0 --prompt='Hello'")
        where = f"adb -s {device.name} shell \"{run}\"" if device.kind == "adb" else run
        return f"{LLAMA_MAIN} (ExecuTorch's LLM runner) is there too; run the program on {device.name}: {where}"
    if not any(d.runs_runner_binary for d in devices):
        return ""
    return (f"{LLAMA_MAIN} (ExecuTorch's LLM runner) is not built, so none was pushed; build it with "
            f"{LLM_RUNNER_HINT} and deploy again.")


def _runner_note(result) -> str:
    """", runner <its --version line> (sha256 <first 12>)" for a device that got (or kept) zl_runner."""
    if result.runner is None and result.runner_sha256 is None:
        return ""
    said = result.runner.removeprefix("zl_runner ") if result.runner else "did not answer --version"
    return f", runner {said}" + (f" (sha256 {result.runner_sha256[:12]})" if result.runner_sha256 else "")


@dataclass(frozen=True)
class PullArgs:
    """`zl pull`'s options."""

    devices: str = setting(REQUIRED, DEVICES_HELP, flag="--devices -d")
    out: Path = setting(REQUIRED, "Run directory to copy into: logs/<device>/ and checkpoints/stage_<k>/.",
                        flag="--out -o")
    run_dir: Path | None = setting(None, "Local devices only: where their folders are (default: --out).")
    checkpoints: bool = setting(True, "Pull complete checkpoints.")
    input_logs: bool = setting(False, "Pull the stages' durable input logs too.", flag="--input-logs")
    mode: str = setting("binary", "The --mode the phones were deployed with (it decides the folder pulled from): "
                                  "binary or app.")


PULL_DOC = """Copy runner logs, telemetry and checkpoints from the devices into a run directory.

Examples:

  zl pull --devices local:3 --out runs/demo

  zl pull --devices R58M123,R58M456,R58M789 --out runs/phones --no-checkpoints

  zl pull --devices R58M123,R58M456,R58M789 --mode app --out runs/phones
"""


def run_pull(args: PullArgs) -> None:
    from zl_device.devices.deploy import pull
    from zl_device.devices.registry import LOCAL, check_mode, open_devices, parse_devices

    out, run_dir = args.out, args.run_dir
    spec = parse_devices(args.devices)
    check_mode(spec, args.mode)
    if spec.kind == LOCAL:
        layout = RunLayout(run_dir or out)
        missing = [p for i in range(spec.count) if not (p := layout.device_dir(f"local-{i}")).is_dir()]
        if missing:
            raise ZLError(f"{missing[0]} does not exist: no local device was deployed there; pass the run "
                          "directory of `zl deploy --run-dir` as --run-dir (or --out).")
    opened = open_devices(spec, run_dir or out, check_abi=False, mode=args.mode)
    for r in pull(opened, out, args.checkpoints, args.input_logs):
        if not r.bytes_pulled:
            typer.echo(f"{r.device}: nothing to pull (no runner output, stage config or telemetry yet)")
            continue
        stages = ", ".join(map(str, r.stages)) or "none"
        typer.echo(f"{r.device}: stages {stages}: {r.bytes_pulled / 2**20:.1f} MiB -> {r.logs_dir}"
                   + "".join(f", {p}" for p in r.checkpoint_dirs.values()))


devices_command = settings_command(DevicesArgs, run_devices, DEVICES_DOC)
deploy_command = settings_command(DeployArgs, run_deploy, DEPLOY_DOC)
pull_command = settings_command(PullArgs, run_pull, PULL_DOC)
COMMANDS = {"devices": devices_command, "deploy": deploy_command, "pull": pull_command}
