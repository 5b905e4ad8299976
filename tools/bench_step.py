"""One training step of one stage: ExecuTorch runtime next to PyTorch eager, side by side in one run.

Exports one stage (by default SmolLM2-135M layers 10-19, a middle stage of
three, seq 128, micro-batch 1, LoRA r=8 on q/v), then times the same step
(forward, readout, local loss, backward of the LoRA parameters) alternately
in the ExecuTorch runtime and in PyTorch eager, with the same thread count,
and prints the medians and their ratio. With --profile it also runs the
program once with an ETDump and eager once under torch.profiler, and prints
where the time goes, grouped by operator, side by side.

    .venv/bin/python tools/bench_step.py                       # SmolLM2, stage 10-19, 2 threads
    .venv/bin/python tools/bench_step.py --threads 1 --repeats 7
    .venv/bin/python tools/bench_step.py --model tiny-random --stages 0-1,2-3 --stage 1   # smoke run
"""

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
warnings.filterwarnings("ignore")
for _name in ("torchao", "torch.utils._pytree", "executorch"):
    logging.getLogger(_name).setLevel(logging.ERROR)

import torch  # noqa: E402

from zl_export.exporter import build_stage_modules, example_inputs, export_stage, write_program  # noqa: E402
from zl_export.options import ExportOptions, LoraSettings, LossConfig  # noqa: E402
from zl_export.model_source import load_model  # noqa: E402
from zl_export.stages import parse_spec  # noqa: E402
from zl_export.step_check import eager_step  # noqa: E402
from zl_export.training_program import TrainingProgram  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--stages", default="0-9,10-19,20-29", help="the split the stage comes from")
    ap.add_argument("--stage", type=int, default=1, help="which stage of --stages to time")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2, help="threads for both runtimes")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per runtime (after one warm-up each)")
    ap.add_argument("--no-profile", action="store_true", help="skip the per-operator breakdown")
    ap.add_argument("--compare-linear", action="store_true",
                    help="also export the stage without the matmul->linear rewrite and time it alongside")
    ap.add_argument("--out", type=Path, default=None, help="keep the .pte here (default: a temporary directory)")
    args = ap.parse_args()

    from executorch.extension.pybindings.portable_lib import _threadpool_get_thread_count, _unsafe_reset_threadpool

    torch.set_num_threads(args.threads)
    _unsafe_reset_threadpool(args.threads)
    loaded = load_model(args.model)
    split = parse_spec(args.stages, loaded.config.num_hidden_layers)
    opts = ExportOptions(seq_len=args.seq_len, micro_batch=1, lora=LoraSettings(8, 16.0, ("q_proj", "v_proj")),
                         loss=LossConfig(0.5, "kl_rev"), seed=0)
    peft_model, modules = build_stage_modules(loaded.model, split, opts)
    module = modules[args.stage]
    _nonzero_lora_b(module)  # B = 0 at init would make every lora_A gradient 0
    out = args.out or Path(tempfile.mkdtemp(prefix="zl-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"{args.model} stage {args.stage} (layers {split[args.stage]}), seq {args.seq_len}, micro-batch 1, "
          f"threads: torch {torch.get_num_threads()}, ExecuTorch {_threadpool_get_thread_count()}", flush=True)
    program_entry = write_program(export_stage(module, peft_model, opts, loaded.config.vocab_size), out)
    print(f"exported {program_entry['file']}: {program_entry['size_bytes'] / 2**20:.1f} MiB in {program_entry['export_s']:.1f} s",
          flush=True)
    names = [o["name"] for o in program_entry["outputs"]]
    program = TrainingProgram(out / program_entry["file"], names)
    inputs = example_inputs(module, opts, loaded.config.vocab_size, seed=1)
    runs = {"ExecuTorch": program.step, "eager": lambda *x: eager_step(module, *x)}
    if args.compare_linear:
        import zl_export.exporter as exporter

        rewrite, exporter._matmuls_to_linear = exporter._matmuls_to_linear, lambda ep: 0
        try:
            plain_dir = out / "without_linear_rewrite"
            plain_dir.mkdir(exist_ok=True)
            plain = write_program(export_stage(module, peft_model, opts, loaded.config.vocab_size), plain_dir)
        finally:
            exporter._matmuls_to_linear = rewrite
        print(f"exported without the matmul->linear rewrite: {plain['size_bytes'] / 2**20:.1f} MiB", flush=True)
        runs["ExecuTorch, mm + permute_copy"] = TrainingProgram(plain_dir / plain["file"], names).step

    first = {name: run(*inputs) for name, run in runs.items()}  # warm-up (and a correctness check)
    ms: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):  # alternate, so drift (heat, other load) hits all alike
        for name, run in runs.items():
            t0 = time.perf_counter()
            run(*inputs)
            ms[name].append((time.perf_counter() - t0) * 1e3)
    print("loss: " + ", ".join(f"{name} {float(r.outputs['loss']):.6f}" for name, r in first.items()))
    eager_med = statistics.median(ms["eager"])
    print(f"step ms (median of {args.repeats}, [min-max]):")
    for name, values in ms.items():
        med = statistics.median(values)
        print(f"  {name:<32}{med:>8.0f}  [{min(values):.0f}-{max(values):.0f}]   / eager = {med / eager_med:.2f}")
    if not args.no_profile:
        _breakdown(out / program_entry["file"], module, inputs, out)


def _nonzero_lora_b(module: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.01)


def _breakdown(pte: Path, module, inputs, out: Path) -> None:
    """Per-operator time of one step in each runtime, grouped into comparable families."""
    et = _etdump_op_ms(pte, inputs, out)
    eager = _profiler_op_ms(module, inputs)
    fam_et, fam_eager = _families(et), _families(eager)
    total_et, total_eager = sum(et.values()), sum(eager.values())
    print(f"\nwhere the time goes (one step; operator self time, ms): ExecuTorch {total_et:.0f}, eager {total_eager:.0f}")
    print(f"{'operator family':<26}{'ExecuTorch':>12}{'eager':>10}{'ratio':>8}")
    for fam in sorted(set(fam_et) | set(fam_eager), key=lambda f: -fam_et.get(f, 0.0)):
        a, b = fam_et.get(fam, 0.0), fam_eager.get(fam, 0.0)
        if max(a, b) < 0.5:
            continue
        print(f"{fam:<26}{a:>12.1f}{b:>10.1f}{(a / b if b else float('inf')):>8.2f}")
    print("\nExecuTorch top kernels:")
    for name, ms in sorted(et.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {name:<48}{ms:>9.1f}")


def _etdump_op_ms(pte: Path, inputs, out: Path) -> dict[str, float]:
    from custom_ops import load_library
    from executorch.devtools import Inspector
    from executorch.extension.pybindings.portable_lib import _load_for_executorch

    load_library()
    m = _load_for_executorch(str(pte), enable_etdump=True)
    m.run_method("forward", list(inputs))  # the joint method: same work as forward_backward
    dump = out / "step.etdp"
    m.write_etdump_result_to_file(str(dump))
    inspector = Inspector(etdump_path=str(dump))
    ms: dict[str, float] = defaultdict(float)
    calls = 0.0  # OPERATOR_CALL events enclose the kernels: their sum minus the kernels' is dispatch overhead
    for block in inspector.event_blocks:
        for event in block.events:
            if event.perf_data is None or event.name in ("Method::execute", "Program::load_method", "Method::init"):
                continue
            t = sum(event.perf_data.raw) / len(event.perf_data.raw)
            if event.name == "OPERATOR_CALL":
                calls += t
            else:
                ms[_short(event.name)] += t
    print(f"ExecuTorch: {calls:.0f} ms in operator calls, {sum(ms.values()):.0f} ms of it in kernels "
          f"(dispatch overhead {calls - sum(ms.values()):.0f} ms)")
    return dict(ms)


def _profiler_op_ms(module, inputs) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        eager_step(module, *inputs)
    ms: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        if e.key.startswith("aten::"):
            ms[_short(e.key)] += e.self_cpu_time_total / 1e3
    return dict(ms)


def _short(name: str) -> str:
    """`native_call_mm.out` / `aten::mm` -> `mm`."""
    name = name.removeprefix("native_call_").removeprefix("aten::")
    return name.split(".")[0]


_FAMILIES = {
    "matmul (mm/bmm/addmm/linear)": ("mm", "bmm", "addmm", "linear", "matmul"),
    "softmax / log_softmax (+bw)": ("_softmax", "softmax", "_log_softmax", "log_softmax", "_softmax_backward_data",
                                    "_log_softmax_backward_data"),
    "copies / layout": ("clone", "copy_", "_to_copy", "copy", "permute_copy", "view_copy", "expand_copy", "transpose_copy",
                        "t_copy", "unsqueeze_copy", "squeeze_copy", "slice_copy", "select_copy", "cat", "contiguous",
                        "alias_copy", "index", "unsafe_view", "_unsafe_view", "as_strided_copy", "split_with_sizes_copy"),
    "elementwise": ("mul", "add", "sub", "div", "neg", "rsqrt", "pow", "silu", "sigmoid", "exp", "log", "where", "masked_fill",
                    "eq", "ne", "lt", "gt", "logical_not", "bitwise_and", "full_like", "fill_", "zeros", "ones", "empty",
                    "full", "scalar_tensor", "_assert_tensor_metadata", "rsub", "cos", "sin", "maximum", "minimum"),
    "reductions": ("sum", "mean", "amax", "max", "min", "argmax", "nll_loss_forward", "nll_loss_backward", "nll_loss",
                   "nll_loss_nd", "cross_entropy_loss"),
}


def _families(ms: dict[str, float]) -> dict[str, float]:
    lookup = {op: fam for fam, ops in _FAMILIES.items() for op in ops}
    out: dict[str, float] = defaultdict(float)
    for op, t in ms.items():
        out[lookup.get(op, "other")] += t
    return dict(out)


if __name__ == "__main__":
    main()
