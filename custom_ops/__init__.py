"""The `zerolock::pipeline_marker` operator: AOT registration and runtime kernel loading."""

from custom_ops.pipeline_marker import pipeline_marker
from custom_ops.runtime import load_library

__all__ = ["load_library", "pipeline_marker"]
