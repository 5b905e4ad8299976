"""The `zerolock::pipeline_marker` operator: AOT registration and runtime kernel loading."""

from custom_ops.pipeline_marker import pipeline_marker

__all__ = ["pipeline_marker"]
