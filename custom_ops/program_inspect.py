"""Read a method's instruction sequence out of an emitted ExecuTorch program.

The exporter uses this to check the stage contract (DESIGN.md §3): the
`zerolock::pipeline_marker.out` instruction comes before every readout, loss
and backward instruction of `forward`. Reads the program flatbuffer lazily
with ExecuTorch's generated schema classes, so constant data (hundreds of MB
for a real stage) is never unpacked.
"""

from __future__ import annotations

import os
import pathlib

from executorch.exir._serialize._flatbuffer_program import _patch_generated_flatbuffer_aliases
from executorch.exir._serialize.generated.executorch_flatbuffer.DelegateCall import DelegateCall
from executorch.exir._serialize.generated.executorch_flatbuffer.InstructionArguments import (
    InstructionArguments,
)
from executorch.exir._serialize.generated.executorch_flatbuffer.KernelCall import KernelCall
from executorch.exir._serialize.generated.executorch_flatbuffer.Program import Program

from zl.errors import ZLError

MARKER_OP = "zerolock::pipeline_marker.out"

# Entries for instructions that call no kernel; kept so that list indices are
# instruction indices (the runtime's own numbering, as in error messages).
_NON_KERNEL = {
    InstructionArguments.MoveCall: "<move>",
    InstructionArguments.JumpFalseCall: "<jump_false>",
    InstructionArguments.FreeCall: "<free>",
}

# Every .pte starts with a 4-byte root offset and this file identifier.
_FILE_IDENTIFIER = b"ET"


def _program_bytes(pte: bytes | str | os.PathLike[str]) -> bytes:
    if isinstance(pte, (bytes, bytearray, memoryview)):
        return bytes(pte)
    path = pathlib.Path(pte)
    if not path.is_file():
        raise ZLError(f"no ExecuTorch program at {path}; pass the path of an exported .pte file.")
    return path.read_bytes()


def kernel_instructions(
    pte_bytes: bytes | str | os.PathLike[str], method: str = "forward"
) -> list[str]:
    """Operator names of `method`'s instructions, in execution order.

    Args:
        pte_bytes: the emitted program (`ExecutorchProgramManager.buffer`, or
            the bytes of a `.pte` file), or the path of a `.pte` file.
        method: the execution plan to read.

    Returns:
        One entry per instruction of the method's chains, in order: a kernel
        call as `"namespace::op.overload"` (e.g. `"aten::mm.out"`,
        `"zerolock::pipeline_marker.out"`), a delegate call as
        `"<delegate:ID>"`, and `"<move>"`, `"<jump_false>"` or `"<free>"` for
        the rest. Index i of the list is instruction i.

    Raises:
        ZLError: the data is not an ExecuTorch program or has no such method.
    """
    data = _program_bytes(pte_bytes)
    if len(data) < 8 or data[4:6] != _FILE_IDENTIFIER:
        raise ZLError(
            f"not an ExecuTorch program: file identifier {data[4:8]!r}, expected b'ET..'; "
            "pass the bytes of a .pte emitted by to_executorch()."
        )
    # The generated modules import each other's *modules* where they mean the
    # classes of the same name; ExecuTorch's own reader rebinds them first.
    _patch_generated_flatbuffer_aliases()
    program = Program.GetRootAs(data, 0)
    plans = [program.ExecutionPlan(i) for i in range(program.ExecutionPlanLength())]
    names = [plan.Name().decode() for plan in plans]
    if method not in names:
        raise ZLError(f"the program has no method {method!r}; it has {sorted(names)}.")
    plan = plans[names.index(method)]

    operators = []
    for i in range(plan.OperatorsLength()):
        op = plan.Operators(i)
        name = op.Name().decode()
        overload = (op.Overload() or b"").decode()
        operators.append(f"{name}.{overload}" if overload else name)
    delegates = [plan.Delegates(i).Id().decode() for i in range(plan.DelegatesLength())]

    result: list[str] = []
    for c in range(plan.ChainsLength()):
        chain = plan.Chains(c)
        for j in range(chain.InstructionsLength()):
            instruction = chain.Instructions(j)
            kind = instruction.InstrArgsType()
            table = instruction.InstrArgs()
            if kind == InstructionArguments.KernelCall:
                call = KernelCall()
                call.Init(table.Bytes, table.Pos)
                result.append(operators[call.OpIndex()])
            elif kind == InstructionArguments.DelegateCall:
                call = DelegateCall()
                call.Init(table.Bytes, table.Pos)
                result.append(f"<delegate:{delegates[call.DelegateIndex()]}>")
            else:
                result.append(_NON_KERNEL.get(kind, f"<instruction type {kind}>"))
    return result


def marker_index(pte_bytes: bytes | str | os.PathLike[str], method: str = "forward") -> int:
    """Instruction index of the one pipeline marker call in `method`.

    Raises:
        ZLError: the method has no marker, or more than one.
    """
    instructions = kernel_instructions(pte_bytes, method)
    found = [i for i, name in enumerate(instructions) if name == MARKER_OP]
    if len(found) != 1:
        raise ZLError(
            f"method {method!r} has {len(found)} {MARKER_OP} instructions, expected exactly 1; "
            "export the stage with custom_ops.pipeline_marker applied once to the chunk output."
        )
    return found[0]
