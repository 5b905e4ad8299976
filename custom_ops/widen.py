"""AOT registration of `zerolock::widen`: a compact frozen weight (bf16, fp16 or int8) to float32.

`w.to(torch.float32)` does the same, but ExecuTorch's portable
`_to_dim_order_copy` converts element by element through its generic
dtype switch (about 16 ns an element on x86; TinyLlama stage 0 widens 0.9 G
elements a step). The kernel in `widen.cpp` is one tight loop per dtype.
The int8 scale is applied by the caller, on the matmul's output
(zl_export/frozen_weights.py).
"""

import torch
from torch.library import Library, impl, register_fake

NAMESPACE = "zerolock"
_lib = Library(NAMESPACE, "FRAGMENT")
_lib.define("widen(Tensor weight) -> Tensor")
_lib.define("widen.out(Tensor weight, *, Tensor(a!) out) -> Tensor(a!)")


@impl(_lib, "widen", "CompositeExplicitAutograd")
def _widen(weight: torch.Tensor) -> torch.Tensor:
    return weight.to(torch.float32)


@impl(_lib, "widen.out", "CompositeExplicitAutograd")
def _widen_out(weight: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    out.copy_(weight.to(torch.float32))
    return out


@register_fake(f"{NAMESPACE}::widen")
def _widen_fake(weight: torch.Tensor) -> torch.Tensor:
    return torch.empty(weight.shape, dtype=torch.float32, device=weight.device)


@register_fake(f"{NAMESPACE}::widen.out")
def _widen_out_fake(weight: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    return out


def widen(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (any shape; bf16, fp16, int8 or float32) as float32, without gradient (frozen weights only)."""
    return torch.ops.zerolock.widen(weight)
