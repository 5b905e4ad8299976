"""The run: the `zl train` job, the coordinator, the control channel and its frames, telemetry, windows, checkpoints."""
