"""The runner's AdamW (runner/src/adamw.cpp) against torch.optim.AdamW, through `zl_adamw_check`.

Both sides get the same initial parameters and per-micro-batch gradients; the
runner accumulates a window's gradients and steps on their MEAN, the reference
averages the same way, steps `torch.optim.AdamW` and a `LambdaLR` carrying the
runner's schedule (zl/lr_schedule.h). Every parameter after each of 20 steps
must agree to 1e-6.

    cmake --build build -j2 --target zl_adamw_check
    .venv/bin/python -m pytest tests/test_adamw.py

The binary is build/runner/zl_adamw_check (override with
$ZL_ADAMW_CHECK_BIN).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import REPO

from zl_device.formats.lr_schedule import lr_factor

STEPS = 20
SHAPES = {"layers.0.q_proj.lora_A.weight": (4, 16), "layers.0.q_proj.lora_B.weight": (16, 4), "bias_like": (7,)}


def adamw_check_bin() -> Path:
    default = REPO / "build" / "runner" / "zl_adamw_check"
    return Path(os.environ.get("ZL_ADAMW_CHECK_BIN", default)).resolve()


@pytest.fixture(scope="module")
def binary() -> Path:
    path = adamw_check_bin()
    if not path.is_file():
        pytest.skip(f"{path} not built; run `cmake --build build -j2 --target zl_adamw_check` (or set ZL_ADAMW_CHECK_BIN)")
    return path


def make_inputs(n: int, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Initial parameters and n micro-batch gradients of mixed scales (some tiny, one all-zero micro-batch)."""
    gen = torch.Generator().manual_seed(seed)
    params = {name: torch.randn(shape, generator=gen) * 0.1 for name, shape in SHAPES.items()}
    grads = {}
    for k in range(n):
        for name, shape in SHAPES.items():
            scale = 1e-4 if name.endswith("lora_A.weight") else 1.0
            g = torch.randn(shape, generator=gen) * scale * (1 + k % 3)
            grads[f"{name}@{k}"] = torch.zeros(shape) if k == 1 else g
    return params, grads


def torch_reference(params, grads, n: int, m: int, optimizer: dict) -> tuple[dict[str, torch.Tensor], list[float], dict]:
    """Trajectory [steps, *shape] per parameter and lr per step, plus the optimizer's final state."""
    steps = -(-n // m)
    live = {name: torch.nn.Parameter(p.clone()) for name, p in params.items()}
    opt = torch.optim.AdamW(list(live.values()), lr=optimizer["lr"], betas=tuple(optimizer["betas"]),
                            eps=optimizer["eps"], weight_decay=optimizer["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: lr_factor(t, optimizer["schedule"], steps))
    trajectory = {name: [] for name in live}
    lrs = []
    for start in range(0, n, m):
        window = range(start, min(start + m, n))
        for name, p in live.items():
            p.grad = torch.stack([grads[f"{name}@{k}"] for k in window]).sum(0) / len(window)
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        for name, p in live.items():
            trajectory[name].append(p.detach().clone())
    state = {name: opt.state[p] for name, p in live.items()}
    return {name: torch.stack(ts) for name, ts in trajectory.items()}, lrs, state


def run_check(binary: Path, tmp_path: Path, params, grads, n: int, m: int, optimizer: dict, checkpoint_dir=None):
    save_file(params, str(tmp_path / "params.safetensors"))
    save_file(grads, str(tmp_path / "grads.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"num_micro_batches": n, "window_size": m, "optimizer": optimizer}))
    args = [str(binary), "--params", str(tmp_path / "params.safetensors"), "--grads", str(tmp_path / "grads.safetensors"),
            "--config", str(tmp_path / "config.json"), "--out", str(tmp_path / "trajectory.safetensors")]
    if checkpoint_dir is not None:
        args += ["--checkpoint-dir", str(checkpoint_dir)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return load_file(str(tmp_path / "trajectory.safetensors"))


SCHEDULES = {
    "constant": {"kind": "constant"},
    "warmup_cosine": {"kind": "warmup_cosine", "warmup_steps": 4, "min_lr_ratio": 0.1},
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("window", [1, 3])
def test_trajectory_matches_torch_adamw(binary, tmp_path, schedule, window):
    """20 steps; with window 3 the last window is short (58 micro-batches), so the mean uses k = 1."""
    n = STEPS * window - (window - 1)
    optimizer = {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.05, "schedule": SCHEDULES[schedule]}
    params, grads = make_inputs(n, seed=window)
    got = run_check(binary, tmp_path, params, grads, n, window, optimizer)
    want, lrs, _ = torch_reference(params, grads, n, window, optimizer)

    assert got["__lr__"].tolist() == pytest.approx(lrs, rel=1e-12, abs=0)
    for name, traj in want.items():
        assert got[name].shape == (STEPS, *SHAPES[name])
        diff = (got[name] - traj).abs().max().item()
        assert diff <= 1e-6, f"{name}: max |runner - torch| = {diff:.3e} over {STEPS} steps"
    moved = (want["layers.0.q_proj.lora_B.weight"][-1] - params["layers.0.q_proj.lora_B.weight"]).abs().max()
    assert moved > 1e-2, "the parameters barely moved; the comparison would be vacuous"
    if schedule == "warmup_cosine":
        assert lrs[0] == pytest.approx(optimizer["lr"] / 4) and lrs[-1] < optimizer["lr"] / 2


def test_checkpoint_holds_torch_optimizer_state(binary, tmp_path):
    """The window checkpoint's moments equal torch's exp_avg / exp_avg_sq, under "<name>.exp_avg" etc."""
    n, m = 12, 4
    optimizer = {"lr": 1e-3, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.0, "schedule": {"kind": "constant"}}
    params, grads = make_inputs(n, seed=7)
    run_check(binary, tmp_path, params, grads, n, m, optimizer, checkpoint_dir=tmp_path / "ckpt")
    want, _, state = torch_reference(params, grads, n, m, optimizer)
    last = tmp_path / "ckpt" / "window_000002"
    adapter = load_file(str(last / "adapter.safetensors"))
    moments = load_file(str(last / "optimizer.safetensors"))
    progress = json.loads((last / "progress.json").read_text())
    assert progress["optimizer_step"] == 3 and progress["micro_batches_done"] == n
    for name in SHAPES:
        assert (adapter[name] - want[name][-1]).abs().max() <= 1e-6
        assert (moments[f"{name}.exp_avg"] - state[name]["exp_avg"]).abs().max() <= 1e-6
        assert (moments[f"{name}.exp_avg_sq"] - state[name]["exp_avg_sq"]).abs().max() <= 1e-6


def test_rejects_a_bad_optimizer_config(binary, tmp_path):
    params, grads = make_inputs(2, seed=0)
    save_file(params, str(tmp_path / "p.safetensors"))
    save_file(grads, str(tmp_path / "g.safetensors"))
    (tmp_path / "c.json").write_text(json.dumps({"num_micro_batches": 2, "window_size": 1, "optimizer": {"lr": -1.0}}))
    proc = subprocess.run([str(binary), "--params", str(tmp_path / "p.safetensors"), "--grads", str(tmp_path / "g.safetensors"),
                           "--config", str(tmp_path / "c.json"), "--out", str(tmp_path / "t.safetensors")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "lr" in proc.stderr
