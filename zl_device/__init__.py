"""Host orchestrator, in three parts: `devices` (backends, deploy, network), `run` (the train job, coordinator,
control channel, telemetry) and `results` (merge to a PEFT adapter, eval, report, plots)."""
