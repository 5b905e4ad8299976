"""Read a method's instruction sequence out of an emitted ExecuTorch program.

The exporter uses this to check the stage contract (docs/design#stage-program): the
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

from zl_base.errors import ZLError

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


# Bytes per element by ExecuTorch ScalarType (the c10 numbering).
_ELEMENT_SIZE = {0: 1, 1: 1, 2: 2, 3: 4, 4: 8, 5: 2, 6: 4, 7: 8, 11: 1, 15: 2}


def instructions_not_feeding_marker(
    pte_bytes: bytes | str | os.PathLike[str], method: str = "forward"
) -> list[tuple[int, str]]:
    """Kernel instructions placed before the marker that the marker's input does not depend on.

    The stage contract wants the marker right after the chunk forward: every
    instruction before it must be one the hidden state needs (embedding,
    masks, rotary tables, the layers). A readout, loss or backward instruction
    never feeds the chunk output, so any of them placed before the marker
    shows up here. An empty list means the placement is right.

    Dependencies are traced through the memory plan, not through value ids:
    ExecuTorch turns static views into aliases of planned memory (no
    instruction), so the writer of a value read at instruction i is the last
    instruction before i that wrote any of its bytes.

    Raises:
        ZLError: not a program, no such method, or not exactly one marker.
    """
    import torch

    from executorch.exir._serialize.generated.executorch_flatbuffer.KernelTypes import KernelTypes
    from executorch.exir._serialize.generated.executorch_flatbuffer.OptionalTensorList import OptionalTensorList
    from executorch.exir._serialize.generated.executorch_flatbuffer.Tensor import Tensor
    from executorch.exir._serialize.generated.executorch_flatbuffer.TensorList import TensorList

    import custom_ops.pipeline_marker  # noqa: F401  (registers the zerolock schemas)

    data = _program_bytes(pte_bytes)
    names = kernel_instructions(data, method)  # validates the program and the method
    marker = marker_index(data, method)
    program = Program.GetRootAs(data, 0)
    plan = next(
        program.ExecutionPlan(i)
        for i in range(program.ExecutionPlanLength())
        if program.ExecutionPlan(i).Name().decode() == method
    )

    def storage(idx: int) -> list[tuple]:
        """Storage keys of value `idx`: (mem_id, start, end) byte ranges, or ("value", idx) when unplanned."""
        value = plan.Values(idx)
        kind = value.ValType()
        table = value.Val()
        if kind in (KernelTypes.TensorList, KernelTypes.OptionalTensorList):
            lst = TensorList() if kind == KernelTypes.TensorList else OptionalTensorList()
            lst.Init(table.Bytes, table.Pos)
            return [key for i in range(lst.ItemsLength()) if lst.Items(i) >= 0 for key in storage(lst.Items(i))]
        if kind != KernelTypes.Tensor:
            return []
        tensor = Tensor()
        tensor.Init(table.Bytes, table.Pos)
        alloc = tensor.AllocationInfo()
        if alloc is None:
            return [("value", idx)]
        nbytes = _ELEMENT_SIZE.get(tensor.ScalarType(), 8)
        for i in range(tensor.SizesLength()):
            nbytes *= tensor.Sizes(i)
        start = alloc.MemoryOffsetLow() | (alloc.MemoryOffsetHigh() << 32)
        return [(alloc.MemoryId(), start, start + max(nbytes, 1))]

    def reads_writes(position: int) -> tuple[list[tuple], list[tuple]]:
        instruction = _instruction(plan, position)
        call = KernelCall()
        table = instruction.InstrArgs()
        call.Init(table.Bytes, table.Pos)
        args = [call.Args(i) for i in range(call.ArgsLength())]
        ns, _, rest = names[position].partition("::")
        op, _, overload = rest.partition(".")
        try:
            schema = getattr(getattr(getattr(torch.ops, ns), op), overload or "default")._schema
            n = len(schema.arguments)
            written = {i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write}
            written |= set(range(n, len(args)))  # the returned values follow the arguments
        except (AttributeError, RuntimeError):
            written = {len(args) - 1}  # ExecuTorch's convention: the out value comes last
        reads = [k for i, a in enumerate(args) if i not in written for k in storage(a)]
        writes = [k for i, a in enumerate(args) if i in written for k in storage(a)]
        return reads, writes

    needed: set[tuple] = set(reads_writes(marker)[0])
    outside = []
    for position in range(marker - 1, -1, -1):
        if names[position].startswith("<"):
            continue
        reads, writes = reads_writes(position)
        hit = [n for n in needed if any(_overlaps(n, w) for w in writes)]
        if not hit:
            outside.append((position, names[position]))
            continue
        needed.difference_update(n for n in hit if any(_covers(w, n) for w in writes))
        needed.update(reads)
    return sorted(outside)


def _instruction(plan, position: int):
    """Instruction `position` of the plan, counting across chains as `kernel_instructions` does."""
    for c in range(plan.ChainsLength()):
        chain = plan.Chains(c)
        if position < chain.InstructionsLength():
            return chain.Instructions(position)
        position -= chain.InstructionsLength()
    raise IndexError(position)


def _overlaps(a: tuple, b: tuple) -> bool:
    if a[0] == "value" or b[0] == "value":
        return a == b
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def _covers(writer: tuple, needed: tuple) -> bool:
    if writer[0] == "value" or needed[0] == "value":
        return writer == needed
    return writer[0] == needed[0] and writer[1] <= needed[1] and needed[2] <= writer[2]
