"""The `zerolock::pipeline_marker` and `zerolock::widen` operators: AOT registration and runtime kernel loading."""

from custom_ops.pipeline_marker import pipeline_marker
from custom_ops.runtime import load_library
from custom_ops.widen import widen

__all__ = ["load_library", "pipeline_marker", "widen"]
