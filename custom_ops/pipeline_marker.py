"""AOT registration of `zerolock::pipeline_marker`.

The marker is an identity copy of the detached hidden state of a stage. In the
exported training program it sits between the chunk forward and everything
else (readout, local loss, backward); at run time the C++ kernel
(`pipeline_marker.cpp`) hands the hidden state to the runner at that point so
it can be sent downstream while the rest of the step runs.

Two schemas, as ExecuTorch expects of a custom op: the functional one that
`torch.export` traces, and the `.out` variant that `to_executorch` swaps in
and the runtime kernel implements.
"""

import torch
from torch.library import Library, impl, register_fake

NAMESPACE = "zerolock"
_lib = Library(NAMESPACE, "DEF")
_lib.define("pipeline_marker(Tensor hidden) -> Tensor")
_lib.define("pipeline_marker.out(Tensor hidden, *, Tensor(a!) out) -> Tensor(a!)")


@impl(_lib, "pipeline_marker", "CompositeExplicitAutograd")
def _pipeline_marker(hidden: torch.Tensor) -> torch.Tensor:
    return hidden.clone()


@impl(_lib, "pipeline_marker.out", "CompositeExplicitAutograd")
def _pipeline_marker_out(hidden: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    out.copy_(hidden)
    return out


@register_fake(f"{NAMESPACE}::pipeline_marker")
def _pipeline_marker_fake(hidden: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(hidden)


@register_fake(f"{NAMESPACE}::pipeline_marker.out")
def _pipeline_marker_out_fake(hidden: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    return out


def pipeline_marker(hidden: torch.Tensor) -> torch.Tensor:
    """Mark `hidden` (B, S, D), already detached, as the stage's outbound state."""
    return torch.ops.zerolock.pipeline_marker(hidden)
