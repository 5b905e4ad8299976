"""The `zerolock::pipeline_marker` operator: eager, fake/export, ExecuTorch runtime, program inspection.

Runtime tests need the built kernel library; point ZL_CUSTOM_OPS_LIB at it
(e.g. build-ops/custom_ops/libzl_custom_ops.so) or build `build/` first.
"""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import custom_ops
from custom_ops import pipeline_marker, runtime
from custom_ops.program_inspect import MARKER_OP, kernel_instructions, marker_index
from zl_base.errors import ZLError


def _library_path() -> pathlib.Path:
    env = os.environ.get(runtime.ENV_VAR)
    return pathlib.Path(env) if env else runtime.DEFAULT_PATH


needs_library = pytest.mark.skipif(
    not _library_path().is_file(),
    reason=f"kernel library not built at {_library_path()}: run `cmake --build build` "
    f"or set {runtime.ENV_VAR} to a built libzl_custom_ops.so",
)


class _TinyStage(nn.Module):
    """Chunk forward, marker on the detached output, then a 'loss' after it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def chunk(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x))  # (B, S, D)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.chunk(x)
        hidden = pipeline_marker(h.detach())
        loss = (h * h).mean()
        return hidden, loss


@pytest.fixture(scope="module")
def stage() -> _TinyStage:
    torch.manual_seed(0)
    return _TinyStage().eval()


@pytest.fixture(scope="module")
def example() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(2, 3, 8)  # (B, S, D)


@pytest.fixture(scope="module")
def program(stage: _TinyStage, example: torch.Tensor):
    """The tiny stage lowered to an ExecuTorch program (ExecutorchProgramManager)."""
    from executorch.exir import EdgeCompileConfig, to_edge

    ep = torch.export.export(stage, (example,), strict=False)
    edge = to_edge(ep, compile_config=EdgeCompileConfig(_check_ir_validity=False))
    return edge.to_executorch()


# --- eager and fake ---------------------------------------------------------


def test_eager_marker_is_a_copy_not_an_alias() -> None:
    hidden = torch.randn(2, 3, 8)
    out = pipeline_marker(hidden)
    assert torch.equal(out, hidden)
    assert out.data_ptr() != hidden.data_ptr()
    out.add_(1.0)
    assert not torch.equal(out, hidden)


def test_eager_out_variant_writes_into_out() -> None:
    hidden = torch.randn(2, 3, 8)
    buffer = torch.zeros(2, 3, 8)
    result = torch.ops.zerolock.pipeline_marker.out(hidden, out=buffer)
    assert result is buffer
    assert torch.equal(buffer, hidden)


def test_fake_kernel_gives_shape_and_dtype_without_data() -> None:
    with FakeTensorMode() as mode:
        hidden = mode.from_tensor(torch.empty(2, 5, 16))
        out = pipeline_marker(hidden)
    assert isinstance(out, FakeTensor)
    assert out.shape == (2, 5, 16)
    assert out.dtype == torch.float32


def test_export_keeps_the_marker_with_its_shape(stage: _TinyStage, example: torch.Tensor) -> None:
    ep = torch.export.export(stage, (example,), strict=False)
    markers = [
        n for n in ep.graph.nodes if n.op == "call_function" and n.target == torch.ops.zerolock.pipeline_marker.default
    ]
    assert len(markers) == 1
    assert tuple(markers[0].meta["val"].shape) == tuple(example.shape)
    # The marker's result is the program's first output (the outbound hidden state).
    output_node = next(n for n in ep.graph.nodes if n.op == "output")
    assert output_node.args[0][0] is markers[0]


# --- program inspection -------------------------------------------------------


def test_kernel_instructions_match_the_emitted_program(program) -> None:
    plan = next(p for p in program.executorch_program.execution_plan if p.name == "forward")
    expected = []
    for instruction in plan.chains[0].instructions:
        args = instruction.instr_args
        if hasattr(args, "op_index"):
            op = plan.operators[args.op_index]
            expected.append(f"{op.name}.{op.overload}" if op.overload else op.name)
        else:
            expected.append(None)
    names = kernel_instructions(program.buffer)
    assert len(names) == len(expected)
    for got, want in zip(names, expected):
        assert got == want if want is not None else got.startswith("<")


def test_marker_precedes_the_loss_and_follows_the_chunk(program) -> None:
    names = kernel_instructions(program.buffer)
    index = marker_index(program.buffer)
    assert names[index] == MARKER_OP
    assert "aten::tanh.out" in names[:index]
    assert "aten::mean.dtype_out" in names[index + 1 :]


def test_kernel_instructions_reads_a_pte_file(program, tmp_path: pathlib.Path) -> None:
    path = tmp_path / "stage.pte"
    path.write_bytes(program.buffer)
    assert kernel_instructions(path) == kernel_instructions(program.buffer)


def test_kernel_instructions_rejects_bad_input(program, tmp_path: pathlib.Path) -> None:
    with pytest.raises(ZLError, match="not an ExecuTorch program"):
        kernel_instructions(b"PK\x03\x04 this is a zip file")
    with pytest.raises(ZLError, match="no method 'backward'"):
        kernel_instructions(program.buffer, method="backward")
    with pytest.raises(ZLError, match="no ExecuTorch program at"):
        kernel_instructions(tmp_path / "missing.pte")


def test_marker_index_requires_exactly_one_marker() -> None:
    from executorch.exir import to_edge

    class NoMarker(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    ep = torch.export.export(NoMarker(), (torch.randn(2, 2),))
    buffer = to_edge(ep).to_executorch().buffer
    with pytest.raises(ZLError, match="has 0 zerolock::pipeline_marker.out instructions"):
        marker_index(buffer)


# --- library loading ----------------------------------------------------------


def test_load_library_names_the_missing_path_and_the_fix(monkeypatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setattr(runtime, "_loaded", None)
    missing = tmp_path / "nowhere" / "libzl_custom_ops.so"
    with pytest.raises(ZLError) as info:
        custom_ops.load_library(missing)
    message = str(info.value)
    assert str(missing) in message
    assert "cmake --build build" in message and "bash setup.sh" in message


def test_load_library_prefers_the_environment_over_the_default(monkeypatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setattr(runtime, "_loaded", None)
    missing = tmp_path / "env" / "libzl_custom_ops.so"
    monkeypatch.setenv(runtime.ENV_VAR, str(missing))
    with pytest.raises(ZLError, match=runtime.ENV_VAR) as info:
        custom_ops.load_library()
    assert str(missing) in str(info.value)


@needs_library
def test_load_library_is_idempotent(tmp_path: pathlib.Path) -> None:
    first = custom_ops.load_library(_library_path())
    assert first == _library_path().resolve()
    # Already loaded: no second load, not even an attempt at a bad path.
    assert custom_ops.load_library() == first
    assert custom_ops.load_library(tmp_path / "missing.so") == first


# --- ExecuTorch runtime ---------------------------------------------------------


@needs_library
def test_runtime_marker_output_equals_the_hidden_state(program, stage: _TinyStage, example: torch.Tensor) -> None:
    custom_ops.load_library(_library_path())
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer

    module = _load_for_executorch_from_buffer(program.buffer)
    calls_before = runtime.marker_call_count()
    hidden, loss = module.forward((example,))

    with torch.no_grad():
        expected = stage.chunk(example)
    assert hidden.shape == expected.shape
    torch.testing.assert_close(hidden, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss, (expected * expected).mean(), rtol=1e-6, atol=1e-6)
    # Our kernel ran, once, for this one execution.
    assert runtime.marker_call_count() == calls_before + 1


@needs_library
def test_native_hook_fires_inside_module_execute(program, tmp_path: pathlib.Path) -> None:
    """Run the gtests that drive Module::execute on this test's program: the hook fires with the first output, and
    a hook that stops the method leaves it fit to run again."""
    binary = _library_path().parent / "zl_custom_ops_tests"
    if not binary.is_file():
        pytest.skip(f"gtest binary not built at {binary}: build target zl_custom_ops_tests")
    pte = tmp_path / "stage.pte"
    pte.write_bytes(program.buffer)
    result = subprocess.run(
        [str(binary), "--gtest_filter=*ModuleExecute*"],
        env={**os.environ, "ZL_MARKER_TEST_PTE": str(pte)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[  PASSED  ] 2 tests" in result.stdout
    assert "SKIPPED" not in result.stdout
