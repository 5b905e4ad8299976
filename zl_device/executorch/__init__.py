"""The ExecuTorch runtime: a `zl train` job's stages as exported programs on the devices' `zl_runner`s
(docs/design#runner, #coordinator).

    launch.py         the launch step: run key, control server, address plan, stage configs, deploy, the coordinator
    coordinator.py    runs the deployed pipeline to its end: a loop over events (start, progress, failure
                      injection) that feeds its parts, which share the stage table and never call each other:
    health.py           when a stage has failed: exit statuses, heartbeats, stalls, the host's own gaps (verdicts)
    recovery.py         restarting failed stages (local or global), hot standbys, `--resume`
    pauses.py           device policies' pauses: the state machine from a limit crossed to the restart
    device_files.py     the checkpoints, accumulator snapshot and input log a stage keeps on its device
    stage_table.py      the stages' plans and statuses, their telemetry, the coordinator's events
    control.py        the control server: authenticated control frames from the runners
    device_policy.py  --max-temperature, --min-battery, --require-charging (docs/design#device-policies)
    export_cache.py   the export step: the stage programs for a run's options, exported once and cached

It builds on zl_device/devices and zl_device/formats (and zl_export); the
`zl train` flow drives it through run/executorch_runtime.py, and nothing here
imports run/ (launch and the export step read the run's settings through a
Protocol of the fields they use).
"""
