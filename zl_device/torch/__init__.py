"""The torch runtime: a `zl train` job's stages as torch.distributed ranks in PyTorch eager (docs/design#torch-runtime).

    job.py            TorchJob (RUN_DIR/torch_job.json): what every rank reads
    launcher.py       one process per stage on this host, restarts after a failure; torchrun's command
    harness.py        a rank: process group, its stage built, the schedule run; torchrun's entry point (__main__.py)
    stage_io.py       Rank: what a schedule trains through; telemetry lines and window checkpoints, resume
    schedules/        every pipeline schedule behind one interface (base.py), in one table (__init__.py):
                      ZeroLock (zerolock.py); GPipe, 1F1B and PipeDream (backprop_ranks.py: the schedule
                      table's lists, as the runner runs them)
    link.py           ZeroLock's data-plane link (hidden states over p2p, early forwarding, back-pressure)
    checkpoint.py     window checkpoints in the runner's format
    backprop.py       what the backprop baselines share (the stage as a pipelining stage, the end-to-end loss)
    eager_training.py training with the runner's semantics in one process (StageStep; the eager references)

It builds on zl_device/formats (and zl_export, devices/ for /proc figures); the
`zl train` flow drives it through run/torch_runtime.py, and nothing here
imports run/.
"""
