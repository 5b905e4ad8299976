"""`zl train`: export, deploy and run a pipeline end to end, then merge, evaluate and report."""

from pathlib import Path

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from zl.commands.devices import MODE_HELP
from zl.errors import ZLError

EXAMPLE = """

Examples:

  zl train        # SmolLM2-135M, demo task, 3 local devices

  zl train --model tiny-random --samples 64 --window 4 --out runs/tiny

  zl train --inject-failure 1@2 --recovery local --out runs/fail-local

  zl train --model tinyllama-random --stages 0-6,7-13,14-21 --seq-len 128 --samples 16 --window 4 --data demo

  zl train --devices R58M123,R58M456,R58M789 --mode app --out runs/phones
"""

console = Console()


def train_command(
    model: str = typer.Option("smollm2-135m", "--model", help="Built-in name, hub id, model directory or .gguf (see `zl export`)."),
    stages: str = typer.Option(None, "--stages", help="Layer ranges per stage, e.g. 0-6,7-13,14-21."),
    num_stages: int = typer.Option(3, "--num-stages", help="Balanced split into this many stages (without --stages)."),
    data: str = typer.Option("demo", "--data", help="`demo` (the built-in task), a .csv/.jsonl file or a shard (.safetensors)."),
    eval_data: str = typer.Option(None, "--eval-data", help="Dev data for the evaluation (the demo task brings its own)."),
    data_format: str = typer.Option("auto", "--format", help="Format of a .csv/.jsonl --data (see `zl data`)."),
    truncate: bool = typer.Option(False, "--truncate", help="Cut over-long prompts from the left instead of failing (see `zl data`)."),
    samples: int = typer.Option(256, "--samples", help="Training samples (the shard repeats when it has fewer rows)."),
    window: int = typer.Option(4, "--window", help="Update window m: micro-batches per AdamW step."),
    devices: str = typer.Option("local:3", "--devices", help="local:N, or phone serials SERIAL1,SERIAL2,... (see `zl devices`)."),
    mode: str = typer.Option("binary", "--mode", help=MODE_HELP),
    out: Path = typer.Option(Path("runs/train"), "--out", help="Run directory (must be new or empty)."),
    recovery: str = typer.Option("local", "--recovery", help="local: restart only the failed stage; global: roll every stage back."),
    inject_failure: str = typer.Option(None, "--inject-failure", help="STAGE@WINDOW: SIGKILL that stage in the middle of that window."),
    spares: int = typer.Option(0, "--spares", help="Devices after the stages' that take over a failed stage."),
    seed: int = typer.Option(0, "--seed", help="Seeds LoRA init, data order and the demo task."),
    seq_len: int = typer.Option(None, "--seq-len", help="Tokens per sample (default: 128; the demo task: its longest sample, rounded up to 16)."),
    micro_batch: int = typer.Option(1, "--micro-batch", help="Samples per micro-batch."),
    lora_rank: int = typer.Option(8, "--lora-rank", help="LoRA rank r."),
    lora_alpha: float = typer.Option(16.0, "--lora-alpha", help="LoRA scaling α."),
    lora_targets: str = typer.Option("q_proj,v_proj", "--lora-targets", help="Projections with adapters."),
    alpha: float = typer.Option(0.5, "--alpha", help="CE weight of the local loss, in (0, 1]."),
    consistency: str = typer.Option("kl_rev", "--consistency", help="KL direction: kl_rev or kl_fwd."),
    lr: float = typer.Option(5e-3, "--lr", help="AdamW learning rate (warm-up, then cosine to 10%)."),
    threads: int = typer.Option(1, "--threads", help="ExecuTorch threads per runner."),
    eval_limit: int = typer.Option(None, "--eval-limit", help="Evaluate on the first N dev rows only."),
    timeout: float = typer.Option(3600, "--timeout", help="Give up when the run takes longer (seconds)."),
) -> None:
    """Fine-tune with LoRA on a pipeline of devices: export, data, deploy, run, pull, merge, eval, report."""
    from zl_device.run.train_job import TrainSettings, run_training

    settings = TrainSettings(
        model=model, stages=stages, num_stages=num_stages, data=data, eval_data=eval_data, data_format=data_format,
        truncate=truncate, samples=samples, window=window, devices=devices, mode=mode, out=out, recovery=recovery, inject_failure=inject_failure,
        spares=spares, seed=seed, seq_len=seq_len, micro_batch=micro_batch, lora_rank=lora_rank,
        lora_alpha=lora_alpha, lora_targets=lora_targets, alpha=alpha, consistency=consistency, lr=lr,
        threads=threads, eval_limit=eval_limit, timeout_s=timeout,
    )
    total = -(-samples // micro_batch)
    live = Live(_table([], total), console=console, refresh_per_second=4, transient=False)
    started = False

    def on_update(status) -> None:
        nonlocal started
        if not started:
            live.start()
            started = True
        live.update(_table(status, total))

    try:
        result = run_training(settings, say=lambda line: console.print(line), on_update=on_update)
    finally:
        if started:
            live.stop()
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


train_command.__doc__ = (train_command.__doc__ or "") + EXAMPLE
COMMANDS = {"train": train_command}
