"""`zl train`: export, deploy and run a pipeline end to end, then merge, evaluate and report."""


from rich.console import Console
from rich.live import Live
from rich.table import Table

from zl.errors import ZLError
from zl.options import settings_command
from zl_device.run.train_settings import TrainSettings

EXAMPLE = """

Examples:

  zl train        # SmolLM2-135M, demo task, 3 local devices

  zl train --model tiny-random --samples 64 --window 4 --out runs/tiny

  zl train --inject-failure 1@2 --recovery local --out runs/fail-local

  zl train --model tinyllama-random --stages 0-6,7-13,14-21 --seq-len 128 --samples 16 --window 4 --data demo

  zl train --devices R58M123,R58M456,R58M789 --mode app --out runs/phones

  zl train --runtime torch --model tiny-random --samples 64 --out runs/torch     # stages as torch.distributed ranks
"""

console = Console()


def run_train(settings: TrainSettings) -> None:
    from zl.commands.export import RichExportProgress
    from zl_device.run.train_job import run_training

    total = settings.windows().num_micro_batches
    live = Live(_table([], total), console=console, refresh_per_second=4, transient=False)
    started = False

    def on_update(status) -> None:
        nonlocal started
        if not started:
            live.start()
            started = True
        live.update(_table(status, total))

    try:
        with RichExportProgress() as export_progress:
            result = run_training(settings, say=lambda line: console.print(line), on_update=on_update,
                                  export_progress=export_progress)
    finally:
        if started:
            live.stop()
    if settings.runtime == "torch" and settings.launcher == "torchrun":
        return  # prepared: the user starts the ranks with the torchrun command printed above
    if not result.report:
        raise ZLError("the run produced no report")
    console.print(f"[bold]done[/] in {result.wall_s:.0f} s: {result.samples} samples; results in {result.run_dir}")


def _table(status, total: int) -> Table:
    table = Table(title="pipeline", expand=False)
    for col in ("stage", "device", "state", "micro-batches", "windows", "last loss", "PSS MiB", "restarts"):
        table.add_column(col, justify="right")
    for s in status:
        loss = f"{s.last_loss:.4f}" if s.last_loss is not None else "-"
        pss = f"{s.pss_mib:.0f}" if s.pss_mib is not None else "-"
        table.add_row(str(s.index), s.device, s.state, f"{s.micro_batches_done}/{total}",
                      str(s.last_committed_window + 1), loss, pss, str(s.restarts))
    return table


train_command = settings_command(
    TrainSettings, run_train,
    "Fine-tune with LoRA on a pipeline of devices: data, export, deploy, run, pull, merge, eval, report." + EXAMPLE)
COMMANDS = {"train": train_command}
