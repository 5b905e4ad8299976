"""zl's fast kernels (custom_ops/fast_kernels.cpp, layout_kernels.cpp, elementwise_kernels.cpp; docs/design#kernels)
inside real ExecuTorch programs: each operator they serve, at the shapes and argument forms the stage programs use and a
few they do not, against PyTorch eager, and the choice between them and ExecuTorch's own kernels (`ZL_KERNELS`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SERVED = ("aten::linear.out", "aten::mm.out", "aten::bmm.out", "aten::permute_copy.out", "aten::expand_copy.out",
          "aten::pow.Tensor_Scalar_out", "aten::_softmax.out", "aten::sigmoid.out", "aten::mul.out", "aten::add.out",
          "aten::sub.out", "aten::sum.IntList_out", "aten::mean.out", "aten::_log_softmax.out", "aten::exp.out")
# Instructions of served operators in _Ops whose arguments the kernels hand to ExecuTorch's own.
DECLINED = 4


class _Ops(torch.nn.Module):
    """Every operator the kernels serve, in the forms the stage programs produce and some others."""

    def forward(self, a, b, w, bias, x4, v):
        return (
            a @ b,                                                # mm
            torch.nn.functional.linear(a, w),                     # linear, 2-D, no bias
            torch.nn.functional.linear(x4[0], w[:, :40]),          # linear, 3-D, no bias
            torch.nn.functional.linear(x4, w[:, :40], bias),      # linear, 4-D, bias
            torch.nn.functional.linear(a[None], w, bias),         # linear, 3-D, bias
            torch.bmm(x4[0], x4[0].transpose(1, 2)),              # bmm (+ a permute)
            x4.permute(0, 2, 1, 3) * 1.0,                         # attention's head transpose
            x4.permute(3, 1, 0, 2) * 1.0,                         # a general permutation
            a.t() * 1.0,                                          # a 2-D transpose
            v[:, None, :].expand(v.shape[0], 5, v.shape[1]) * 1.0,  # broadcast in the middle
            v.expand(3, *v.shape) * 1.0,                          # new leading dimension
            v[:, :1].expand(v.shape[0], 7) * 1.0,                 # broadcast of the last dimension
            a.pow(2), a.abs().pow(0.5), (a.abs() + 1).pow(-0.5), a.pow(3), a.pow(1), (a.abs() + 1).pow(-1),
            a.abs().pow(2.5),                                     # an exponent the kernel leaves to ExecuTorch's
            torch.softmax(x4 * 3.0, dim=-1),                      # attention's softmax (last dimension)
            torch.sigmoid(x4 * 2.0),                              # SiLU's sigmoid
            torch.log_softmax(x4 * 3.0, dim=-1),                  # the readout's log-probabilities
            torch.exp(x4.clamp(max=5.0)),                         # the KL term's probabilities
            x4 * x4,                                              # same shape
            x4 * w[0, :40],                                       # RMSNorm's weight: repeats over rows
            x4 * x4[..., :1],                                     # 1/rms: one value per row
            x4 + x4[:1],                                          # RoPE's cos/sin: repeats over heads
            x4[:1] - x4,                                          # the broadcast operand first
            x4 - x4.sum(-1, keepdim=True),                        # per row; a last-dimension sum
            x4.sum(dim=1),                                        # a middle dimension, dropped
            x4.mean(-1, keepdim=True),                            # RMSNorm's mean of squares
            torch.add(x4, x4, alpha=2.0),                         # alpha != 1: ExecuTorch's
            a[:, None, :] * a[None, :, :],                        # both operands broadcast: ExecuTorch's
            x4.sum(dim=(1, 2)),                                   # two dimensions: ExecuTorch's
        )


def _inputs() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(37, 48, generator=gen), torch.randn(48, 70, generator=gen), torch.randn(66, 48, generator=gen),
            torch.randn(66, generator=gen), torch.randn(2, 33, 4, 40, generator=gen), torch.randn(9, 13, generator=gen))


@pytest.fixture(scope="module")
def ops_program(tmp_path_factory) -> Path:
    from executorch.exir import to_edge

    program = to_edge(torch.export.export(_Ops(), _inputs())).to_executorch()
    path = tmp_path_factory.mktemp("fast-kernels") / "ops.pte"
    path.write_bytes(program.buffer)
    return path


# Runs in a fresh process: which kernels a program binds is fixed for the process by the first registration.
_RUN = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import custom_ops.runtime as rt
from custom_ops.program_inspect import kernel_instructions
from executorch.extension.pybindings.portable_lib import _load_for_executorch
sys.path.insert(0, sys.argv[3])
from test_fast_kernels import _Ops, _inputs, SERVED
rt.load_library()
module = _load_for_executorch(sys.argv[2])
inputs = _inputs()
outs = module.forward(list(inputs))
want = _Ops()(*inputs)
errors = [float((o - r).abs().max() / r.abs().max().clamp_min(1e-12)) for o, r in zip(outs, want)]
shapes_ok = all(tuple(o.shape) == tuple(r.shape) for o, r in zip(outs, want))
served = sum(1 for name in kernel_instructions(sys.argv[2]) if name in SERVED)
print(json.dumps({"errors": errors, "shapes_ok": shapes_ok, "calls": rt.fast_kernel_call_count(), "served": served}))
"""


def _run(program: Path, kernels: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ZL_KERNELS"}
    if kernels is not None:
        env["ZL_KERNELS"] = kernels
    return subprocess.run([sys.executable, "-c", _RUN, str(ROOT), str(program), str(Path(__file__).parent)],
                          capture_output=True, text=True, env=env, timeout=300)


def test_programs_run_on_zl_kernels_and_match_eager(ops_program: Path) -> None:
    result = _run(ops_program, None)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["shapes_ok"]
    assert max(report["errors"]) < 1e-5, report["errors"]
    # Every instruction of a served operator ran on zl's kernel, except those _Ops gives arguments they hand back
    # to ExecuTorch's (an exponent of 2.5, alpha 2, two broadcast operands, a two-dimension sum).
    assert report["calls"] == report["served"] - DECLINED, report


def test_executorch_choice_leaves_zl_kernels_out(ops_program: Path) -> None:
    result = _run(ops_program, "executorch")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["calls"] == 0
    assert max(report["errors"]) < 1e-5, report["errors"]


def test_an_unknown_kernel_choice_is_refused_with_the_fix(ops_program: Path) -> None:
    result = _run(ops_program, "fastest")
    assert result.returncode != 0
    assert "ZL_KERNELS='fastest' is not one of zl, executorch" in result.stderr
    assert "unset it" in result.stderr
