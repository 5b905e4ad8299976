"""The host side of a run, in layers (docs/design#parts):

- `formats`: what every part shares (run-directory layout, frames, telemetry log, stage status, checkpoint layout,
  window plan, optimizer and LR schedule), importing no other part;
- `devices`: device backends (local, adb, app), `--devices`, CPU quotas, deploy/pull, the network plan;
- `torch`: the torch runtime (ranks, launcher, pipeline schedules, eager training); `results`: merge to a PEFT
  adapter, eval, generation, report, plots;
- `executorch`: the ExecuTorch runtime (launch, coordinator, recovery, control server, device policy, export cache);
- `run`: the `zl train` flow and each runtime's side of it; `plan` on top (`zl plan`: calibration, cost fits, the
  split).

The studies built on these live in `zl_study`, a layer above.
"""
