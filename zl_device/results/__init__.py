"""A run's results: the merged PEFT adapter, evaluation, the report and its plots."""
