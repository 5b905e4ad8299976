"""The phone binary (issue 41): tools/build_phone_runner.sh's static aarch64 zl_runner, and its kernel selection.

The selection tests and the checks of `--runner` / `--runner-prefix` run everywhere (a made-up ExecuTorch
tree, made-up ELF files). The binary tests need the build (`ZL_EXECUTORCH_SRC=<ExecuTorch checkout>
tools/build_phone_runner.sh`, into build-phone/) and qemu-aarch64, and skip without them: `zl train` on
tiny-random with three local devices running it under qemu-aarch64 trains the x86 run's adapter; `--mode
binary` pushes exactly that file to (emulated, arm64) phones, which train with it; `zl deploy` and `zl
devices` say which runner and ExecuTorch each device holds. The end-to-end proof of the build (every C++
suite under qemu, one step equal to the x86 build's) is the script's --test, run here with
ZL_EXECUTORCH_SRC set and `-m slow`; SmolLM2-135M through the binary is tests/test_phone_binary_train.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
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
from zl_device.devices import deploy as zdeploy  # noqa: E402

RUNNER = zdeploy.PHONE_RUNNER  # build-phone/zl/runner/zl_runner
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
    assert proc.stdout.startswith("zl_runner ") and " aarch64 static kernels=" in proc.stdout, proc.stdout
    assert " executorch 1." in proc.stdout


@needs_binary
@pytest.mark.parametrize("cpu, path, features", [
    ("cortex-a53", "baseline", "none"),              # armv8.0: Cortex-A53/A73-class phones
    ("cortex-a76", "baseline", "fp16,dotprod"),      # armv8.2 with dotprod, no bf16
    ("max", "bf16", "fp16,dotprod,bf16,i8mm"),       # FEAT_BF16: Cortex-A510/A710/X2 and later
])
def test_runner_picks_its_kernel_path_from_the_cpu(cpu: str, path: str, features: str):
    """One binary, two kernel paths (docs/design#runner-process): --version names the one the CPU's hwcaps select."""
    proc = subprocess.run([QEMU, "-cpu", cpu, str(RUNNER), "--version"], env={}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert re.search(f" aarch64 static kernels={path} cpu={features} threads=([0-9]+|1\\(no-pool\\))$",
                     proc.stdout.rstrip()), proc.stdout  # threads: what "threads": 0 gives on this (emulated) CPU


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


# --- zl train --runner / --runner-prefix, and what --mode binary pushes (issue 41 items 4, 5) -------------------


def _fake_elf(path: Path, machine: int) -> Path:
    """An executable file whose ELF header names `machine` (62 x86-64, 183 AArch64)."""
    path.write_bytes(b"\x7fELF" + bytes(14) + machine.to_bytes(2, "little") + bytes(40))
    path.chmod(0o755)
    return path


def test_runner_and_prefix_are_checked_before_anything_runs(tmp_path):
    from zl_device.devices.registry import check_runner, parse_devices
    from zl_device.run.train_settings import TrainSettings

    local, phones = parse_devices("local:3"), parse_devices("P1,P2")
    other = _fake_elf(tmp_path / "zl_runner", 62 if platform.machine() == "aarch64" else 183)
    arch = "x86_64" if platform.machine() == "aarch64" else "aarch64"
    with pytest.raises(ZLError, match=r"--runner .*/missing/zl_runner: no executable file there; build it .*"
                                      r"tools/build_phone_runner.sh"):
        check_runner(local, "binary", tmp_path / "missing" / "zl_runner", None)
    with pytest.raises(ZLError, match=rf"built for {arch}, this host is .*--runner-prefix qemu-{arch}"):
        check_runner(local, "binary", other, None)
    with pytest.raises(ZLError, match=r"--runner-prefix 'zl-no-such-emulator -x': zl-no-such-emulator is not on "
                                      r"PATH; install it"):
        check_runner(local, "binary", other, "zl-no-such-emulator -x")
    with pytest.raises(ZLError, match=r"--runner-prefix '  ': empty"):
        check_runner(local, "binary", other, "  ")
    assert check_runner(local, "binary", other, "env -u X") == (other.resolve(), ("env", "-u", "X"))
    assert check_runner(local, "binary", None, None) == (None, ())  # this host's build
    with pytest.raises(ZLError, match=r"--runner-prefix 'qemu-aarch64': phones start their runner themselves"):
        check_runner(phones, "binary", None, "qemu-aarch64")
    with pytest.raises(ZLError, match=r"phones in --mode app run the app's runtime; drop --runner"):
        check_runner(phones, "app", other, None)
    with pytest.raises(ZLError, match=r"is not an AArch64 ELF executable \(x86_64\); phones run arm64 builds"):
        check_runner(phones, "binary", _fake_elf(tmp_path / "x86_runner", 62), None)
    with pytest.raises(ZLError, match=r"--runtime torch runs PyTorch ranks on this host"):
        TrainSettings(runtime="torch", runner_prefix="env").validate()
    settings = TrainSettings(runner=tmp_path / "missing" / "zl_runner", out=tmp_path / "run")
    with pytest.raises(ZLError, match="no executable file there"):  # at validation, before the export
        settings.validate()
    assert settings.runner.is_absolute()  # what RUN_DIR's settings keep for --resume


def test_local_devices_start_the_runner_under_the_prefix(tmp_path):
    """The deployed --runner is what starts, under --runner-prefix; --version goes the same way."""
    from zl_device.devices.registry import open_devices

    fake = tmp_path / "fake_runner"
    fake.write_text("#!/bin/sh\necho \"zl_runner 9.9 executorch 0.0 fake $PREFIXED\"\n")
    fake.chmod(0o755)
    device = open_devices("local:1", tmp_path / "run", runner_binary=fake, runner_prefix="env PREFIXED=yes")[0]
    assert zdeploy.runner_binary_for(device) == fake.resolve()
    assert device.runner_version() is None  # nothing deployed yet
    device.push(zdeploy.runner_binary_for(device), "zl_runner", mode=0o755)
    assert device.runner_version() == "zl_runner 9.9 executorch 0.0 fake yes"


@pytest.fixture()
def arm64_phones(tmp_path, monkeypatch):
    """Three emulated arm64 phones (tests/emulated_phone.py, `./zl_runner` under qemu-aarch64) the adb server
    lists; `--mode binary` gives them its default build, the static phone binary."""
    from emulated_phone import AppRuntime, EmulatedPhone, emulated_client
    from zl_device.devices import adb as zadb
    from zl_device.devices import network

    no_app = AppRuntime("java", tmp_path / "no-app" / "libzl_jni.so", tmp_path / "no-app")  # binary mode: unused
    phones = [EmulatedPhone(f"zlemu-{i}", tmp_path / "phones" / f"zlemu-{i}", f"127.0.0.{2 + i}", no_app, qemu=QEMU)
              for i in range(3)]
    monkeypatch.setattr(zadb, "connect", lambda start=True: emulated_client(phones))
    monkeypatch.delenv(zdeploy.ANDROID_RUNNER_ENV, raising=False)
    # Phones listen on fixed ports (7100 + k); all emulated phones share this host, where those may be taken.
    plan = network.plan_addresses
    monkeypatch.setattr(network, "plan_addresses", lambda devices, **kw: plan(
        devices, stage_port=network.free_port_base(len(devices)), **kw))
    return phones


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@needs_binary
def test_deploy_and_devices_say_which_runner_the_phone_holds(arm64_phones, tmp_path, monkeypatch):
    """`zl deploy --mode binary` pushes exactly the static phone build (the phone's copy hashes the same) and names
    the zl and ExecuTorch of the runner the phone holds, as `zl devices` does (asked of the file itself)."""
    from typer.testing import CliRunner

    from test_devices import cli_app, make_export

    export = make_export(tmp_path)
    version = subprocess.run([QEMU, str(RUNNER), "--version"], capture_output=True, text=True).stdout.strip()
    result = CliRunner().invoke(cli_app(), ["deploy", "--devices", "zlemu-0,zlemu-1", "--export", str(export)])
    assert result.exit_code == 0, result.output
    want = _sha256(RUNNER)
    for phone in arm64_phones[:2]:
        assert _sha256(phone.local("/data/local/tmp/zerolock/zl_runner")) == want  # the device side's copy
        line = next(ln for ln in result.stdout.splitlines() if ln.startswith(f"{phone.serial}: stage"))
        assert line.endswith(f", runner {version.removeprefix('zl_runner ')} (sha256 {want[:12]})"), line
    assert " aarch64 static kernels=" in version and " executorch 1." in version
    result = CliRunner().invoke(cli_app(), ["devices", "--json"])
    assert result.exit_code == 0, result.output
    runners = {r["name"]: r["runner"] for r in map(json.loads, result.stdout.splitlines())}
    host = subprocess.run([str(zdeploy.runner_binary_for(_local_device(tmp_path))), "--version"],
                          capture_output=True, text=True).stdout.strip()
    assert runners == {"local": host, "zlemu-0": version, "zlemu-1": version, "zlemu-2": ""}
    monkeypatch.setenv("COLUMNS", "250")  # rich's table: one line per device
    result = CliRunner().invoke(cli_app(), ["devices"])
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert version.removeprefix("zl_runner ") in rows["zlemu-0"] and rows["zlemu-2"].split()[-1] == "-", rows


def _local_device(tmp_path: Path):
    from zl_device.devices.local import LocalDevice

    return LocalDevice("local-0", tmp_path / "host")


@pytest.fixture(scope="module")
def _tiny(tmp_path_factory):
    """test_train's export cache, data and clean x86 run (tiny-random, 24 samples, every stage training)."""
    from test_train import RUNNER as HOST_RUNNER
    from test_train import train

    from conftest import native_library_or_skip

    native_library_or_skip()
    if not HOST_RUNNER.is_file():
        pytest.skip(f"{HOST_RUNNER} not built; run `bash setup.sh`")
    cache = tmp_path_factory.mktemp("export-cache")
    rows = [{"prompt": f"item {i} is", "completion": " odd" if i % 2 else " even"} for i in range(40)]
    data = tmp_path_factory.mktemp("data") / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    clean = train(tmp_path_factory.mktemp("clean") / "run", cache, data=str(data))
    return cache, data, clean.run_dir


#: Elements of a trained adapter (a fraction of all) that may differ from the x86 run's by more than
#: runner-vs-eager's tolerance, and by how much at most (a fraction of the peak lr). Another architecture's float
#: order (Eigen's GEMM and aarch64 against OpenBLAS on x86) makes gradients that are rounding noise differ, and
#: Adam's m/√v turns such noise into steps of up to lr: SmolLM2-135M, 16 samples, measured 2026-12-03: 6 of
#: 2,442,240 elements beyond, the largest 8.7e-5 (4.3% of lr 2e-3), the whole adapter 6.2e-6 apart (relative
#: norm). A wrong gradient moves whole tensors by ~lr.
OUTLIER_FRACTION, OUTLIER_LR = 1e-5, 0.1


def _assert_x86_adapter(run_dir: Path, x86_dir: Path) -> None:
    """The run's adapter equals the x86 run's within runner-vs-eager's tolerance (test_train.assert_trained_alike),
    but for at most OUTLIER_FRACTION of its elements, each within OUTLIER_LR x lr; and it trained."""
    import torch

    from test_train import TRAINED_ATOL_LR, TRAINED_RTOL, adapter_tensors, run_lr

    got, want = adapter_tensors(run_dir), adapter_tensors(x86_dir)
    assert got.keys() == want.keys()
    lr = run_lr(x86_dir)
    beyond, total, diff_sq, norm_sq = 0, 0, 0.0, 0.0
    for name, t in want.items():
        diff = (got[name] - t).abs()
        beyond += int((diff > TRAINED_ATOL_LR * lr + TRAINED_RTOL * t.abs()).sum())
        total += t.numel()
        diff_sq, norm_sq = diff_sq + float((diff ** 2).sum()), norm_sq + float((t ** 2).sum())
        assert float(diff.max()) <= OUTLIER_LR * lr, f"{name}: {float(diff.max()):.3g} off (lr {lr:g})"
    assert beyond <= OUTLIER_FRACTION * total, f"{beyond} of {total} elements beyond the tolerance"
    assert (diff_sq / norm_sq) ** 0.5 < 1e-4, f"relative norm {(diff_sq / norm_sq) ** 0.5:.3g}"
    assert any(t.abs().max() > 1e-3 for n, t in got.items() if "lora_B" in n), "nothing trained"
    assert not any(torch.isnan(t).any() for t in got.values())


@needs_binary
def test_local_devices_train_through_the_phone_binary_under_qemu(_tiny, tmp_path):
    """`zl train --runner <static arm64 zl_runner> --runner-prefix qemu-aarch64` on local:3 finishes with the x86
    run's adapter (rounding apart: Eigen's GEMM and aarch64's float order against OpenBLAS's)."""
    from test_train import train

    cache, data, x86 = _tiny
    result = train(tmp_path / "run", cache, data=str(data), runner=RUNNER, runner_prefix=QEMU)
    for k in range(3):
        workdir = result.run_dir / "devices" / f"local-{k}"
        assert _sha256(workdir / "zl_runner") == _sha256(RUNNER)  # the phone's file ran, nothing else could here
    _assert_x86_adapter(result.run_dir, x86)


@needs_binary
def test_binary_mode_trains_with_the_phone_binary_on_arm64_phones(_tiny, arm64_phones, tmp_path):
    """`zl train --devices <3 phones> --mode binary` pushes the static phone build (no --runner: the default),
    starts it over `adb shell` on each (emulated arm64) phone and trains the x86 run's adapter."""
    from test_train import train

    cache, data, x86 = _tiny
    result = train(tmp_path / "run", cache, data=str(data), devices="zlemu-0,zlemu-1,zlemu-2", mode="binary")
    for phone in arm64_phones:
        assert _sha256(phone.local("/data/local/tmp/zerolock/zl_runner")) == _sha256(RUNNER)
        assert any("./zl_runner --config stage_" in c for c in phone.commands), phone.commands
    _assert_x86_adapter(result.run_dir, x86)
