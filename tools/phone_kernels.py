"""ExecuTorch's portable kernels for the static phone build, cut to what zl's programs call.

Used by tools/build_phone_runner.sh (issue 41):

    python tools/phone_kernels.py ops STAGE.pte ...       # the operators the programs call, one a line
    python tools/phone_kernels.py tree ET_SRC OUT OPS.txt # OUT: ET_SRC as symlinks, unused portable kernels left out

ExecuTorch's selective build (EXECUTORCH_SELECT_OPS_LIST) registers only the
listed operators, but its `portable_kernels` library still compiles every one
of the ~180 kernel files (kernels/portable/CMakeLists.txt globs cpu/*.cpp),
which takes most of an hour on two cores. `tree` makes a mirror of the
ExecuTorch checkout out of symlinks in which kernels/portable/cpu holds only
the files that define the listed operators' kernels, so the glob sees those
alone; the checkout itself is not touched. Operators that no portable kernel
implements (zl's own, ExecuTorch's prim ops, aten::linear.out which zl's fast
kernels supply) are named on stderr and left out of the list CMake gets.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys

import yaml

from zl_base.errors import ZLError


def program_operators(paths: list[str]) -> list[str]:
    """Sorted operator names ("aten::add.out") of every method of each .pte."""
    from executorch.exir._serialize._flatbuffer_program import _patch_generated_flatbuffer_aliases
    from executorch.exir._serialize.generated.executorch_flatbuffer.Program import Program

    _patch_generated_flatbuffer_aliases()
    ops: set[str] = set()
    for path in paths:
        data = pathlib.Path(path).read_bytes()
        if len(data) < 8 or data[4:6] != b"ET":
            raise ZLError(f"{path} is not an ExecuTorch program (identifier {data[4:8]!r}); pass exported .pte files.")
        program = Program.GetRootAs(data, 0)
        for i in range(program.ExecutionPlanLength()):
            plan = program.ExecutionPlan(i)
            for j in range(plan.OperatorsLength()):
                op = plan.Operators(j)
                overload = (op.Overload() or b"").decode()
                ops.add(op.Name().decode() + (f".{overload}" if overload else ""))
    return sorted(ops)


# ExecuTorch's third-party/CMakeLists.txt adds these submodules whatever the
# options; the phone build (no devtools, no executor_runner, no LLM extension)
# uses none of them, so an unchecked-out one gets an empty stand-in in the
# mirror. flatccrt must exist as a target (ExecuTorch sets properties on it).
_SUBMODULE_STUBS = {
    "backends/xnnpack/third-party/FXdiv": "# stand-in: FXdiv serves the threadpool (off)\nadd_library(fxdiv INTERFACE)\n",
    "third-party/json": "# stand-in: nlohmann/json is not used by the phone build\n",
    "third-party/gflags": "# stand-in: gflags is not used by the phone build\n",
    "third-party/flatcc": (
        "# stand-in: flatcc (devtools' etdump) is not used by the phone build\n"
        'file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/flatccrt_stub.c "")\n'
        "add_library(flatccrt STATIC ${CMAKE_CURRENT_BINARY_DIR}/flatccrt_stub.c)\n"
    ),
}


def _portable_kernels(et_src: pathlib.Path) -> dict[str, list[str]]:
    """Operator name ("aten::add.out") -> kernel function names, from functions.yaml."""
    entries = yaml.safe_load((et_src / "kernels/portable/functions.yaml").read_text())
    table: dict[str, list[str]] = {}
    for entry in entries:
        name = entry.get("op") or entry["func"].split("(")[0]
        name = name if "::" in name else f"aten::{name}"
        table[name] = [k["kernel_name"].split("::")[-1] for k in entry.get("kernels", [])]
    return table


def portable_tree(et_src: pathlib.Path, out: pathlib.Path, ops: list[str]) -> list[str]:
    """Mirror et_src into out as symlinks, keeping only the portable kernel files `ops` need.

    Returns the operators that have a portable kernel (the selective-build list).
    """
    table = _portable_kernels(et_src)
    selected = [op for op in ops if op in table]
    for op in ops:
        if op not in table:
            print(f"phone_kernels: {op} has no portable kernel (zl's kernels or a prim op provide it)", file=sys.stderr)
    cpu = et_src / "kernels/portable/cpu"
    sources = {p.name: p.read_text() for p in cpu.glob("*.cpp")}
    keep: set[str] = set()
    for op in selected:
        for fn in table[op]:
            # The definition: "Tensor& fn(", or a macro's first argument: "DEFINE_UNARY_UFUNC_...(fn, std::cos)".
            pattern = re.compile(rf"(^|[\s&*(]){re.escape(fn)}\s*[(,]", re.M)
            found = [name for name, text in sources.items() if pattern.search(text)]
            if not found:
                raise ZLError(f"no file in {cpu} defines {fn} (the kernel of {op}); is {et_src} an ExecuTorch checkout?")
            keep.update(found)
    for dirpath, dirnames, filenames in os.walk(et_src):
        rel = pathlib.Path(dirpath).relative_to(et_src)
        (out / rel).mkdir(parents=True, exist_ok=True)
        # A symlinked folder (shim_et/xplat/executorch -> ../..) stays a link; walk real folders only.
        for d in [d for d in dirnames if (pathlib.Path(dirpath) / d).is_symlink()]:
            (out / rel / d).symlink_to(os.readlink(pathlib.Path(dirpath) / d))
        dirnames[:] = [d for d in dirnames if d != ".git" and not (pathlib.Path(dirpath) / d).is_symlink()]
        for name in filenames:
            if rel == pathlib.Path("kernels/portable/cpu") and name.endswith(".cpp") and name not in keep:
                continue
            link = out / rel / name
            if not link.is_symlink():
                link.symlink_to(pathlib.Path(dirpath) / name)
    for name, text in _SUBMODULE_STUBS.items():
        if not (et_src / name / "CMakeLists.txt").exists():
            (out / name).mkdir(parents=True, exist_ok=True)
            (out / name / "CMakeLists.txt").write_text(text)
            print(f"phone_kernels: {name} is not checked out; the phone build does not use it (stub)",
                  file=sys.stderr)
    print(f"phone_kernels: {len(selected)} portable operators in {len(keep)} of {len(sources)} kernel files",
          file=sys.stderr)
    return selected


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "ops":
        print("\n".join(program_operators(argv[1:])))
        return 0
    if len(argv) == 4 and argv[0] == "tree":
        et_src, out, ops_file = pathlib.Path(argv[1]), pathlib.Path(argv[2]), pathlib.Path(argv[3])
        ops = [line.split("#")[0].strip() for line in ops_file.read_text().splitlines()]
        print(",".join(portable_tree(et_src, out, [op for op in ops if op])))
        return 0
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except ZLError as e:
        print(f"phone_kernels: {e}", file=sys.stderr)
        sys.exit(2)
