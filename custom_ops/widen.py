"""AOT registration of `zerolock::widen` (a compact frozen weight, bf16, fp16 or int8, to float32) and
`zerolock::widen_int4` (int4 weights packed two to a byte, with a scale and a minimum per group of input channels).

`w.to(torch.float32)` does the same, but ExecuTorch's portable
`_to_dim_order_copy` converts element by element through its generic
dtype switch (about 16 ns an element on x86; TinyLlama stage 0 widens 0.9 G
elements a step). The kernel in `widen.cpp` is one tight loop per dtype.
The int8 scale is applied by the caller, on the matmul's output
(zl_export/frozen_weights.py). An int4 group's parameters belong to a group
of input channels, so `widen_int4` applies them while widening: byte j of a
row holds columns 2j (low nibble) and 2j + 1 (high nibble), q in [0, 15],
and `params` holds float16 (scale, minimum) pairs, one per group:
column c of the row is q * scale_g + minimum_g, g = c // group, group =
columns / groups (llama.cpp's Q4_1 grid). The kernel also widens the
symmetric grid of programs exported before it (float32 scales, one per
group, q - 8 times the scale); the exporter no longer writes it.
"""

import torch
from torch.library import Library, impl, register_fake

NAMESPACE = "zerolock"
_lib = Library(NAMESPACE, "FRAGMENT")
_lib.define("widen(Tensor weight) -> Tensor")
_lib.define("widen.out(Tensor weight, *, Tensor(a!) out) -> Tensor(a!)")
_lib.define("widen_int4(Tensor packed, Tensor params) -> Tensor")
_lib.define("widen_int4.out(Tensor packed, Tensor params, *, Tensor(a!) out) -> Tensor(a!)")


@impl(_lib, "widen", "CompositeExplicitAutograd")
def _widen(weight: torch.Tensor) -> torch.Tensor:
    return weight.to(torch.float32)


@impl(_lib, "widen.out", "CompositeExplicitAutograd")
def _widen_out(weight: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    out.copy_(weight.to(torch.float32))
    return out


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(…, n) uint8 -> (…, 2n) uint8 in [0, 15]: the low nibble of byte j is column 2j, the high one 2j + 1."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def _int4_shape(packed: torch.Tensor, params: torch.Tensor) -> list[int]:
    columns = packed.shape[-1] * 2
    torch._check(packed.dtype == torch.uint8, lambda: f"widen_int4: packed must be uint8, got {packed.dtype}")
    torch._check(params.dtype == torch.float16, lambda: f"widen_int4: params must be float16, got {params.dtype}")
    torch._check(packed.shape[:-1] == params.shape[:-1] and params.shape[-1] > 0 and params.shape[-1] % 2 == 0
                 and columns % (params.shape[-1] // 2) == 0,
                 lambda: f"widen_int4: packed {tuple(packed.shape)} and params {tuple(params.shape)} do not match")
    return [*packed.shape[:-1], columns]


@impl(_lib, "widen_int4", "CompositeExplicitAutograd")
def _widen_int4(packed: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    shape = _int4_shape(packed, params)
    pairs = params.float().unflatten(-1, (-1, 2))  # (…, groups, 2): scale, minimum
    q = unpack_int4(packed).float().unflatten(-1, (pairs.shape[-2], -1))  # (…, groups, group)
    return (q * pairs[..., :1] + pairs[..., 1:]).reshape(shape)


@impl(_lib, "widen_int4.out", "CompositeExplicitAutograd")
def _widen_int4_out(packed: torch.Tensor, params: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    out.copy_(_widen_int4(packed, params))
    return out


@register_fake(f"{NAMESPACE}::widen_int4")
def _widen_int4_fake(packed: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    return torch.empty(_int4_shape(packed, params), dtype=torch.float32, device=packed.device)


@register_fake(f"{NAMESPACE}::widen_int4.out")
def _widen_int4_out_fake(packed: torch.Tensor, params: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
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


def widen_int4(packed: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Packed int4 rows (…, I/2) uint8 with their groups' (scale, minimum) pairs (…, 2I/G) float16 as float32
    (…, I), without gradient."""
    return torch.ops.zerolock.widen_int4(packed, params)
