"""`zl train`: export, deploy and run a pipeline end to end, then merge, evaluate and report."""

import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from zl_base.entry import Stopped, stopped_by_signals
from zl_base.errors import ZLError
from zl.options import settings_command
from zl_device.run.train_settings import TrainSettings

EXAMPLE = """

Examples:

  zl train        # SmolLM2-135M, demo task, 3 local devices

  zl train --model tiny-random --samples 64 --window 4 --out runs/tiny

  zl train --inject-failure 1@2 --recovery local --out runs/fail-local

  zl train --num-stages 1 --out runs/one     # the whole model on one device: the baseline K devices are measured against

  zl train --model tinyllama-random --stages 0-6,7-13,14-21 --seq-len 128 --samples 16 --window 4 --data demo

  zl train --devices R58M123,R58M456,R58M789 --mode app --out runs/phones

  zl train --devices R58M123,R58M456,R58M789 --max-temperature 42 --min-battery 30   # pause hot or flat phones

  zl train --runtime torch --model tiny-random --samples 64 --out runs/torch     # stages as torch.distributed ranks

  zl train --devices local:3 --cpu-quota 1.0,0.5,0.75 --stages auto   # unequal devices, split planned (zl plan)
"""

console = Console()
# Without a terminal (a log file, CI, nohup) the live table draws nothing until the end: plain lines instead, one
# per stage at most every PLAIN_PROGRESS_S seconds, and whenever a stage changes state.
PLAIN_PROGRESS_S = 10.0


class PlainProgress:
    """`on_update` for a stdout that is not a terminal: one plain, flushed line per stage at a steady pace."""

    def __init__(self, total: int, print_line=None, interval_s: float | None = None, clock=time.monotonic):
        self.total = total
        self.print_line = print_line or (lambda line: print(line, flush=True))
        self.interval_s = PLAIN_PROGRESS_S if interval_s is None else interval_s
        self.clock = clock
        self._last_t: float | None = None
        self._last_states: list[str] = []

    def __call__(self, status) -> None:
        now, states = self.clock(), [s.state for s in status]
        if self._last_t is not None and now - self._last_t < self.interval_s and states == self._last_states:
            return
        self._last_t, self._last_states = now, states
        for s in status:
            loss = loss_text(s)
            pss = f"{s.pss_mib:.0f} MiB" if s.pss_mib is not None else "-"
            self.print_line(f"stage {s.index} ({s.device}): {stage_state(s)}, micro-batch "
                            f"{s.micro_batches_done}/{self.total}, {s.last_committed_window + 1} windows, loss {loss}, "
                            f"PSS {pss}, restarts {s.restarts}")


def run_train(settings: TrainSettings) -> None:
    """`zl train`. Stopped by Ctrl-C or SIGTERM, it stops its stages (their runners or ranks, which keep their
    checkpoints), keeps the run for `--resume` and exits with 130 or 143 (`stopped_line`)."""
    try:
        with stopped_by_signals():
            _train(settings)
    except Stopped as e:
        print(stopped_line(Path(settings.out), e.name), file=sys.stderr, flush=True)
        raise typer.Exit(e.exit_code) from None


def stopped_line(out: Path, signal_name: str) -> str:
    """The line `zl train` ends with when a signal stopped it (its stages are stopped by then): how to continue the
    run, or that there is nothing to continue (it was stopped before its stages started)."""
    from zl_device.run.train_job import is_unfinished

    run_dir = out.expanduser().resolve()
    if is_unfinished(run_dir):
        return (f"stopped ({signal_name}): the stages are stopped and keep their checkpoints; continue the run with "
                f"`zl train --resume --out {run_dir}`")
    return f"stopped ({signal_name}) before the stages started: nothing to resume; start the run again."


def _train(settings: TrainSettings) -> None:
    from zl.commands.export import RichExportProgress
    from zl_device.plan.plan_file import PLAN_FILE, write_plan
    from zl_device.plan.planner import resolve_stages
    from zl_device.run.train_job import run_training

    total = settings.windows().num_micro_batches
    live = Live(_table([], total), console=console, refresh_per_second=4, transient=False)
    started = False
    plain = None if console.is_terminal else PlainProgress(total, lambda line: console.print(line, soft_wrap=True))

    def on_update(status) -> None:
        nonlocal started
        if plain is not None:
            plain(status)
            return
        if not started:
            live.start()
            started = True
        live.update(_table(status, total))

    try:
        with RichExportProgress() as export_progress:
            settings, plan = resolve_stages(settings, lambda line: console.print(line), export_progress)
            result = run_training(settings, say=lambda line: console.print(line), on_update=on_update,
                                  export_progress=export_progress)
    finally:
        if started:
            live.stop()
    if settings.runtime == "torch" and settings.launcher == "torchrun":
        return  # prepared: the user starts the ranks with the torchrun command printed above
    if not result.report:
        raise ZLError("the run produced no report")
    if plan is not None:  # what the split was chosen on, beside the run's measured stage times
        write_plan(plan, result.run_dir / PLAN_FILE)
    console.print(f"[bold]done[/] in {result.wall_s:.0f} s: {result.samples} samples; results in {result.run_dir}")


def loss_text(s) -> str:
    """A stage's last loss for the display; a stage held still by lr 0 has none to show (it runs forward only)."""
    if s.last_loss is not None:
        return f"{s.last_loss:.4f}"
    return "lr 0: forward only" if getattr(s, "forward_only", False) else "-"


def stage_state(s, now: float | None = None) -> str:
    """A stage's state for the display; a device policy's pause says why and for how long ("paused 12 s: 61.0 °C ≥
    45 °C (--max-temperature)")."""
    reason = getattr(s, "pause_reason", None)  # any status-like row; StageStatus has it
    since = getattr(s, "paused_since", None)
    state = s.state if since is None else f"{s.state} {(now or time.monotonic()) - since:.0f} s"
    return f"{state}: {reason}" if reason else state


def _table(status, total: int) -> Table:
    table = Table(title="pipeline", expand=False)
    for col in ("stage", "device", "state", "micro-batches", "windows", "last loss", "PSS MiB", "restarts"):
        table.add_column(col, justify="right")
    for s in status:
        loss = loss_text(s)
        pss = f"{s.pss_mib:.0f}" if s.pss_mib is not None else "-"
        table.add_row(str(s.index), s.device, stage_state(s), f"{s.micro_batches_done}/{total}",
                      str(s.last_committed_window + 1), loss, pss, str(s.restarts))
    return table


train_command = settings_command(
    TrainSettings, run_train,
    "Fine-tune with LoRA on a pipeline of devices: data, export, deploy, run, pull, merge, eval, report." + EXAMPLE)
COMMANDS = {"train": train_command}
