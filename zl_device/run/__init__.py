"""The `zl train` flow: train_job.py (data, prepare, run, collect, merge, eval, report), its settings tree
(train_settings.py) and data (train_data.py), and the `Runtime` interface (runtime.py) with its two
implementations, each the flow's side of a runtime package: executorch_runtime.py (zl_device/executorch/) and
torch_runtime.py (zl_device/torch/)."""
