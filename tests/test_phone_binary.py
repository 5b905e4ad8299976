"""The phone binary (issue 41): tools/build_phone_runner.sh's static aarch64 zl_runner, and its kernel selection.

The selection tests run everywhere (a made-up ExecuTorch tree). The binary tests need the build
(`ZL_EXECUTORCH_SRC=<ExecuTorch checkout> tools/build_phone_runner.sh`, into build-phone/) and
qemu-aarch64, and skip without them. The end-to-end proof (every C++ suite under qemu, one step equal
to the x86 build's) is the script's --test, run here with ZL_EXECUTORCH_SRC set and `-m slow`.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import phone_kernels  # noqa: E402

from zl_base.errors import ZLError  # noqa: E402

RUNNER = REPO / "build-phone" / "zl" / "android_app" / "native" / "zl_runner"
QEMU = shutil.which("qemu-aarch64")
needs_binary = pytest.mark.skipif(not RUNNER.is_file() or QEMU is None,
                                  reason="no build-phone/ static binary (tools/build_phone_runner.sh) or no qemu-aarch64")

_FUNCTIONS_YAML = """\
- op: add.out
  kernels:
    - arg_meta: null
      kernel_name: torch::executor::add_out
- op: cos.out
  kernels:
    - arg_meta: null
      kernel_name: torch::executor::cos_out
- op: mm.out
  kernels:
    - arg_meta: null
      kernel_name: torch::executor::mm_out
- func: dim_order_ops::_clone_dim_order.out(Tensor self, *, Tensor(a!) out) -> Tensor(a!)
  kernels:
    - arg_meta: null
      kernel_name: torch::executor::_clone_dim_order_out
"""


def _fake_executorch(root: Path) -> Path:
    """A tree shaped like an ExecuTorch checkout's portable kernels, no submodules."""
    cpu = root / "kernels" / "portable" / "cpu"
    (cpu / "util").mkdir(parents=True)
    (root / "kernels" / "portable" / "functions.yaml").write_text(_FUNCTIONS_YAML)
    (cpu / "op_add.cpp").write_text("Tensor& add_out(KernelRuntimeContext& ctx, const Tensor& a, Tensor& out) {}\n")
    (cpu / "op_cos.cpp").write_text("DEFINE_UNARY_UFUNC_REALHBBF16_TO_FLOATHBF16(cos_out, std::cos)\n")
    (cpu / "op_mm.cpp").write_text("Tensor&\nmm_out(KernelRuntimeContext& ctx, const Tensor& a, Tensor& out) {}\n")
    (cpu / "op__clone_dim_order.cpp").write_text("Tensor& _clone_dim_order_out(const Tensor& a, Tensor& out) {}\n")
    (cpu / "util" / "broadcast_util.cpp").write_text("// util\n")
    (root / "CMakeLists.txt").write_text("# root\n")
    (root / "shim_et" / "xplat").mkdir(parents=True)
    (root / "shim_et" / "xplat" / "executorch").symlink_to("../..")
    return root


def test_tree_keeps_only_the_kernels_of_the_listed_operators(tmp_path):
    src = _fake_executorch(tmp_path / "src")
    out = tmp_path / "mirror" / "executorch"
    ops = ["aten::cos.out", "aten::add.out", "dim_order_ops::_clone_dim_order.out",
           "aten::linear.out", "zerolock::widen.out"]
    selected = phone_kernels.portable_tree(src, out, ops)
    # linear.out (zl's fast kernels) and zerolock ops have no portable kernel: left out of the CMake list.
    assert selected == ["aten::cos.out", "aten::add.out", "dim_order_ops::_clone_dim_order.out"]
    kept = sorted(p.name for p in (out / "kernels" / "portable" / "cpu").glob("*.cpp"))
    assert kept == ["op__clone_dim_order.cpp", "op_add.cpp", "op_cos.cpp"]  # op_mm.cpp is not compiled
    assert (out / "kernels" / "portable" / "cpu" / "util" / "broadcast_util.cpp").is_symlink()
    assert os.readlink(out / "shim_et" / "xplat" / "executorch") == "../.."  # a folder link stays a link
    # The checkout is never written to: stand-ins for absent submodules go into the mirror only.
    assert "add_library(flatccrt" in (out / "third-party" / "flatcc" / "CMakeLists.txt").read_text()
    assert not (src / "third-party").exists()
    assert (src / "kernels" / "portable" / "cpu" / "op_mm.cpp").is_file()


def test_tree_refuses_an_operator_whose_kernel_is_nowhere(tmp_path):
    src = _fake_executorch(tmp_path / "src")
    (src / "kernels" / "portable" / "cpu" / "op_cos.cpp").unlink()
    with pytest.raises(ZLError, match=r"defines cos_out \(the kernel of aten::cos.out\)"):
        phone_kernels.portable_tree(src, tmp_path / "mirror", ["aten::cos.out"])


def test_committed_operator_list_names_the_stage_operators():
    """tools/phone_ops.txt lists what the stage programs call; the marker and widen kernels are zl's."""
    ops = [line.strip() for line in (REPO / "tools" / "phone_ops.txt").read_text().splitlines()
           if line.strip() and not line.startswith("#")]
    assert {"zerolock::pipeline_marker.out", "zerolock::widen.out", "aten::mm.out", "aten::_softmax.out"} <= set(ops)
    assert ops == sorted(set(ops))


def _elf_program_header_types(path: Path) -> tuple[int, list[int]]:
    """(e_machine, [p_type of each program header]) of a 64-bit little-endian ELF file."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, f"{path} is not a 64-bit LE ELF"
    machine = struct.unpack_from("<H", data, 18)[0]
    phoff, = struct.unpack_from("<Q", data, 32)
    phentsize, phnum = struct.unpack_from("<HH", data, 54)
    return machine, [struct.unpack_from("<I", data, phoff + i * phentsize)[0] for i in range(phnum)]


@needs_binary
def test_runner_is_a_static_aarch64_executable():
    machine, types = _elf_program_header_types(RUNNER)
    assert machine == 183  # EM_AARCH64
    assert 3 not in types  # no PT_INTERP: no loader, no shared library, nothing from the phone's userland
    assert 2 not in types  # no PT_DYNAMIC


@needs_binary
def test_runner_runs_under_qemu_with_nothing_from_the_host():
    # An empty environment and no -L: qemu has no sysroot to give the binary.
    proc = subprocess.run([QEMU, str(RUNNER), "--version"], env={}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("zl_runner ") and proc.stdout.rstrip().endswith("aarch64 static"), proc.stdout
    assert " executorch 1." in proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("ZL_EXECUTORCH_SRC") or QEMU is None,
                    reason="set ZL_EXECUTORCH_SRC to an ExecuTorch checkout (and install qemu-user)")
def test_build_phone_runner_passes_its_proofs():
    proc = subprocess.run(["bash", str(REPO / "tools" / "build_phone_runner.sh"), "--test"], cwd=REPO,
                          capture_output=True, text=True, timeout=7200)
    assert proc.returncode == 0, f"build_phone_runner.sh --test failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert " tests failed out of " in proc.stdout and "0 tests failed" in proc.stdout, proc.stdout[-2000:]
    losses = [line for line in proc.stdout.splitlines() if ".loss: x86 " in line]
    assert len(losses) == 3, proc.stdout[-2000:]
