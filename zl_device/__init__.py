"""Host orchestrator: device backends, deploy, the coordinator, telemetry, pull, report, merge and eval."""
