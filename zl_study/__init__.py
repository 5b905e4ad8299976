"""The studies: research code that measures zl against its baselines, on top of the product's layers.

`accuracy_study` (ZeroLock's arms, `arms`, against backprop LoRA, per budget and seed) with `comparison` (paired
differences and their intervals), `study_tables` (its tables and plot) and `early_exit` (a stage's readout as the
classifier); `backprop_baseline` (one process, end-to-end backprop on a `zl train` run's data and settings);
`grad_alignment` (how each stage's local gradient agrees with the end-to-end one); `emulated_devices` (a CPU quota
per rank and a shaped link, for the benchmarks). `zl` never imports them; their command lines are the thin
scripts in tools/ (`tools/accuracy_study.py`, `tools/train_backprop_baseline.py`, `tools/grad_alignment.py`).
"""
