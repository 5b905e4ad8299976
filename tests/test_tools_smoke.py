"""Every benchmark in tools/ runs (issue 54 item 5): each once, on tiny-random, in seconds, as its docstring's smoke
run says, so a change that breaks one fails the suite instead of the next sitting (bench_step.py once failed at its
first export for weeks: `'StageEntry' object is not subscriptable`). The figures they exist for are measured by
hand on the real models (docs/benchmarks.md); here only that each runs end to end and prints its table."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import REPO

PYTHON = sys.executable


def run_tool(name: str, *args, timeout: int = 600) -> str:
    """stdout of `python tools/NAME.py ARGS`; fails the test with its stderr's tail when it exits non-zero."""
    proc = subprocess.run([PYTHON, str(REPO / "tools" / f"{name}.py"), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, f"tools/{name}.py exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc.stdout


def zl(*args) -> None:
    proc = subprocess.run([PYTHON, "-m", "zl.cli", *map(str, args)], capture_output=True, text=True, timeout=600,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def export3(tmp_path_factory):
    """A tiny-random export of three stages and a demo shard at its sequence length."""
    root = tmp_path_factory.mktemp("tools")
    zl("export", "--model", "tiny-random", "--num-stages", "3", "--seq-len", "64", "--out", root / "export",
       "--no-check")
    zl("data", "--demo", "--model", "tiny-random", "--seq-len", "64", "--split", "train", "--out", root / "data")
    return root / "export", root / "data" / "train.safetensors"


def test_bench_step(tmp_path):
    out = run_tool("bench_step", "--model", "tiny-random", "--stages", "0-1,2-3", "--stage", "1", "--seq-len", "32",
                   "--threads", "1", "--repeats", "1", "--out", tmp_path / "programs")
    assert "ExecuTorch" in out or "executorch" in out.lower(), out
    assert list((tmp_path / "programs").rglob("*.pte")), "the programs it timed"


def test_bench_memory(tmp_path):
    out = run_tool("bench_memory", "--model", "tiny-random", "--stages", "0-1,2-3", "--steps", "2", "--rounds", "1",
                   "--dtypes", "int8", "--load-modes", "mmap", "--widen-chunks", "24,11", "--json", tmp_path / "m.json")
    rows = json.loads((tmp_path / "m.json").read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    assert [r["widen_chunk"] for r in rows] == [24, 11] and all(r.get("peak_pss_mib", 0) > 0 for r in rows), rows
    assert "int8" in out
    # weights in chunks of 2^11 elements (32 of tiny-random's 64-wide rows): another program, the same step
    assert rows[0]["pte_mib"] != rows[1]["pte_mib"], rows
    assert abs(rows[0]["first_loss"] - rows[1]["first_loss"]) < 1e-4 * abs(rows[0]["first_loss"]), rows


def test_bench_memory_recompute_on_the_last_stage_and_reuse(tmp_path):
    args = ("--model", "tiny-random", "--stages", "0-1,2-3", "--stage", "1", "--program", "backprop", "--max-targets",
            "0", "--seq-len", "32", "--steps", "2", "--rounds", "1", "--dtypes", "int4", "--recompute", "on",
            "--load-modes", "mmap", "--work", tmp_path / "work", "--readout-pieces", "22,12")
    run_tool("bench_memory", *args, "--keep")
    proc = subprocess.run([PYTHON, str(REPO / "tools" / "bench_memory.py"), *map(str, args), "--reuse", "--json",
                           tmp_path / "m.json"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("reusing") == 2 and "export" not in proc.stderr, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "m.json").read_text())
    assert [(r["recompute"], r["readout_piece"]) for r in rows] == [(True, 22), (True, 12)], rows
    assert all(r["peak_pss_mib"] > 0 for r in rows), rows
    # 32 x 258 logits: one piece of 2^22, three of 2^12; the same loss either way
    assert rows[0]["pte_mib"] != rows[1]["pte_mib"], rows
    assert abs(rows[0]["first_loss"] - rows[1]["first_loss"]) < 1e-4 * abs(rows[0]["first_loss"]), rows


def test_bench_inference(tmp_path):
    """With a stand-in for ExecuTorch's llama_main (a script that prints what it prints), whose row is read from its
    statistics line; the real one is timed where tools/build_llm_runner.sh built it."""
    fake = tmp_path / "llama_main"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do case "$a" in --prompt=*) p="${a#--prompt=}" ;; esac; done\n'
                    'printf "%s and more\\n" "$p"\n'
                    'echo \'PyTorchObserver {"prompt_tokens": 8, "generated_tokens": 4, "model_load_start_ms": 0, '
                    '"model_load_end_ms": 10, "inference_start_ms": 20, "prompt_eval_end_ms": 28, '
                    '"inference_end_ms": 40}\'\n')
    fake.chmod(0o755)
    out = run_tool("bench_inference", "--model", "tiny-random", "--rounds", "1", "--variants", "eager,none",
                   "--prompt-tokens", "8", "--new-tokens", "4", "--work", tmp_path / "work", "--json-out",
                   tmp_path / "i.json", "--llama-main", fake)
    table = json.loads((tmp_path / "i.json").read_text())
    assert "eager" in out and "none" in out and table, out
    assert table["results"]["none llama_main"]["decode_tok_s"] == pytest.approx(4 / 0.012), out


def test_bench_early_forwarding(export3, tmp_path):
    export, shard = export3
    out = run_tool("bench_early_forwarding", "--export", export, "--shard", shard, "--micro-batches", "8",
                   "--window-size", "4", "--warmup", "1", "--json", tmp_path / "e.json")
    assert json.loads((tmp_path / "e.json").read_text()) and "early" in out.lower(), out


def test_bench_recovery(export3, tmp_path):
    out = run_tool("bench_recovery", "--model", "tiny-random", "--stages", "0-1,2-2,3-3", "--data", export3[1], "--seq-len", "64",
                   "--samples", "16",
                   "--window", "4", "--fail-windows", "1", "--arms", "local", "--out", tmp_path / "runs", "--json",
                   tmp_path / "r.json")
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved and "local" in out, out


def test_bench_plan(tmp_path):
    out = run_tool("bench_plan", "--model", "tiny-random", "--devices", "local:3", "--cpu-quota", "1.0,0.5,0.5",
                   "--seq-len", "64", "--samples", "16", "--window", "4", "--eval-limit", "4", "--out",
                   tmp_path / "runs", "--json", tmp_path / "p.json")
    saved = json.loads((tmp_path / "p.json").read_text())
    assert saved and "records/s" in out, out


def test_compare_step_passes_equal_outputs_and_fails_different_ones(tmp_path):
    values = {"stage0.loss": np.array(2.5, np.float32), "stage0.task_loss": np.array(2.0, np.float32),
              "stage0.consistency_loss": np.array(0.5, np.float32), "stage0.grad.w": np.ones((2, 3), np.float32)}
    save_file(values, str(tmp_path / "x86.safetensors"))
    save_file(values, str(tmp_path / "arm.safetensors"))
    args = [PYTHON, str(REPO / "tools" / "compare_step.py"), str(tmp_path / "x86.safetensors"),
            str(tmp_path / "arm.safetensors")]
    assert subprocess.run(args, capture_output=True).returncode == 0
    save_file({**values, "stage0.grad.w": np.full((2, 3), 1.1, np.float32)}, str(tmp_path / "arm.safetensors"))
    assert subprocess.run(args, capture_output=True).returncode != 0
