"""The `zerolock::pipeline_marker`, `zerolock::widen` and `zerolock::widen_int4` operators: AOT registration and
runtime kernel loading."""

from custom_ops.pipeline_marker import pipeline_marker
from custom_ops.runtime import load_library
from custom_ops.widen import widen, widen_int4

__all__ = ["load_library", "pipeline_marker", "widen", "widen_int4"]
