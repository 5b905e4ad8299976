"""The formats every part of a run shares: the leaf that devices/, run/, results/, torch/ and executorch/ import, importing none.

- `run_layout.py`: `RunLayout`, every path of a run directory (docs/design#run-outputs);
- `frames.py`: the frame codec, the twin of runner/include/zl/frame.h;
- `metrics_log.py`: the telemetry lines of metrics.jsonl, their reader, the merge and the tail of a growing file;
- `stage_status.py`: `StageStatus`, a stage as the live display and the coordinator see it, folded from its telemetry;
- `injection.py`: `Injection`, `--inject-failure STAGE@WINDOW`;
- `checkpoints.py`: `CheckpointLayout`, where a stage's checkpoints live (the runner's layout);
- `windows.py`: `WindowPlan`, the run's micro-batches in update windows;
- `schedules.py`: the pipeline schedules' names;
- `schedule_table.py`: each schedule as data, every stage's list of forwards, backwards and steps (the runner's twin);
- `stage_spec.py`: `StageSpec`, a stage's role, learning rate and schedule, which both runtimes' configs derive from;
- `runner_config.py`: `RunnerConfig`, a stage's runner config, the twin of the C++ runner's field table;
- `lr_schedule.py`: `OptimizerSettings`, AdamW and its learning-rate schedule, as `zl train` and the runner apply them.
"""
