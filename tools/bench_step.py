"""One training step of one stage: ExecuTorch runtime next to PyTorch eager, full and Ω readout, side by side in one run.

Exports one stage (by default SmolLM2-135M layers 10-19, a middle stage of
three, micro-batch 1, LoRA r=8 on q/v) per sequence length with the full
readout (`--max-targets 0`: the LM head on every position, the programs
before issue 10) and with the Ω readout (the LM head on T target slots per
sample: one program per T of `--max-targets`, or by default the T `zl train`
fits to each target count of `--targets`: the count rounded up to 4). Then it
times the same step (forward, readout, local loss, backward of the LoRA
parameters) of both programs alternately in the ExecuTorch runtime and in
PyTorch eager, at each thread count and target count, on AG News-shaped input
(a prompt, then N target tokens for each N of `--targets`: 2 is a label word
and end-of-sequence, 16 or 64 a generated completion; right padding), and
prints one table: medians, ExecuTorch / eager, an estimated GFLOP count per
step (`step_gflop`) and the GFLOP/s achieved, and every step against the
eager step of the full-readout program. With --profile it also runs each
program once with an ETDump and eager once under torch.profiler, and prints
where the time goes, grouped by operator, side by side.

    nice -n 10 .venv/bin/python tools/bench_step.py --threads 1 --seq-len 128 --repeats 3   # SmolLM2, stage 10-19
    .venv/bin/python tools/bench_step.py                       # the full grid: seq 32 and 128, 1 and 2 threads
    .venv/bin/python tools/bench_step.py --model tiny-random --stages 0-1,2-3 --stage 1 --seq-len 32   # smoke run
    nice -n 10 .venv/bin/python tools/bench_step.py --seq-len 128 --targets 2,16,64   # many targets (generative data)
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
from dataclasses import replace
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
from zl_export.shard import target_slots_for  # noqa: E402
from zl_export.stages import parse_spec  # noqa: E402
from zl_export.step_check import eager_step  # noqa: E402
from zl_export.training_program import TrainingProgram  # noqa: E402
from custom_ops.runtime import KERNELS_ENV  # noqa: E402

FULL = "full"
MM = "full, mm + permute_copy"
BACKPROP = ("backprop", "eager")  # timed next to the programs: a backprop pipeline's step of the same stage
KERNELS = ("zl", "executorch")


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--stages", default="0-9,10-19,20-29", help="the split the stage comes from")
    ap.add_argument("--stage", type=int, default=1, help="which stage of --stages to time")
    ap.add_argument("--seq-len", type=_ints, default=[32, 128], help="sequence lengths, comma-separated (one export "
                                                                       "of each program per length)")
    ap.add_argument("--threads", type=_ints, default=[1, 2], help="thread counts for both runtimes, comma-separated")
    ap.add_argument("--max-targets", type=_ints, default=None,
                    help="target slots per sample of the Ω-readout programs, comma-separated (one program each; a "
                         "target count is timed on those with at least as many slots). Default: per target count, "
                         "the slots zl train fits to it (rounded up to 4)")
    ap.add_argument("--targets", type=_ints, default=[2],
                    help="target tokens per sample in the timed input, comma-separated (AG News: label word + "
                         "end-of-sequence = 2; generative data: the completion's tokens, e.g. 2,16,64)")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per runtime and program (after one warm-up)")
    ap.add_argument("--profile", action="store_true", help="per-operator breakdown of each program (first thread count)")
    ap.add_argument("--compare-linear", action="store_true",
                    help="also export the full-readout program without the matmul->linear rewrite and time it alongside")
    ap.add_argument("--frozen-dtype", default="fp32", choices=("fp32", "bf16", "int8", "int4"),
                    help="frozen weights of the programs (zl export --frozen-dtype; default fp32: the matrix products "
                         "alone, as the speed issue timed them; bf16/int8 add the widening)")
    ap.add_argument("--kernels", type=_names, default=list(KERNELS),
                    help="kernels of the ExecuTorch step, comma-separated: zl (zl's, the runner's default), "
                         "executorch (ExecuTorch's own); both are timed side by side")
    ap.add_argument("--out", type=Path, default=None, help="keep the .pte files here (default: a temporary directory)")
    ap.add_argument("--reuse", action="store_true", help="time the programs an earlier run left in --out instead of "
                                                          "exporting them again (same model, stage and options)")
    args = ap.parse_args()
    if not 0 < min(args.targets) <= max(args.targets) < min(args.seq_len):
        ap.error(f"--targets {','.join(map(str, args.targets))}: each must be 1..{min(args.seq_len) - 1} (a sample "
                 f"needs a prompt token before its targets within --seq-len {min(args.seq_len)})")
    slots_for = {t: sorted(x for x in args.max_targets if x >= t) if args.max_targets else [target_slots_for(t)]
                 for t in args.targets}  # the Ω programs each target count is timed on (the rest would drop targets)

    if not set(args.kernels) <= set(KERNELS):
        ap.error(f"--kernels {','.join(args.kernels)}: choose from {', '.join(KERNELS)}")
    # Nothing registers zl's kernels until this tool does (below), so that programs loaded before that
    # run on ExecuTorch's own: each program binds its kernels when its method first loads.
    os.environ[KERNELS_ENV] = "executorch"

    loaded = load_model(args.model)
    cfg = loaded.config
    split = parse_spec(args.stages, cfg.num_hidden_layers)
    opts = ExportOptions(seq_len=max(args.seq_len), micro_batch=1, lora=LoraSettings(8, 16.0, ("q_proj", "v_proj")),
                         frozen_dtype=args.frozen_dtype,
                         loss=LossConfig(0.5, "kl_rev"), seed=0)
    peft_model, modules = build_stage_modules(loaded.model, split, opts)
    module = modules[args.stage]
    _nonzero_lora_b(module)  # B = 0 at init would make every lora_A gradient 0
    out = args.out or Path(tempfile.mkdtemp(prefix="zl-bench-"))
    # readout name -> the program's max_targets
    readouts = {FULL: 0, **{f"Ω {x}": x for x in sorted({x for xs in slots_for.values() for x in xs})}}
    print(f"{args.model} stage {args.stage} (layers {split[args.stage]}), micro-batch 1, "
          f"{','.join(map(str, args.targets))} target tokens per sample, readouts: {', '.join(readouts)}; ExecuTorch "
          f"on kernels: {', '.join(args.kernels)}; median of {args.repeats} steps", flush=True)
    files, inputs = {}, {}
    for seq in args.seq_len:
        seq_opts = replace(opts, seq_len=seq)
        for name, slots in readouts.items():
            module.max_targets = slots
            files[seq, name] = _export(module, peft_model, replace(seq_opts, max_targets=slots), cfg,
                                       out / f"s{seq}-{slots}{_dtype_suffix(args.frozen_dtype)}", reuse=args.reuse)
        if args.compare_linear:
            module.max_targets = 0
            files[seq, MM] = _export(module, peft_model, replace(seq_opts, max_targets=0), cfg, out / f"s{seq}-0-mm{_dtype_suffix(args.frozen_dtype)}",
                                     rewrite=False)
        for t in args.targets:
            inputs[seq, t] = example_inputs(module, seq_opts, cfg.vocab_size, seed=1, targets=t)
    programs = _load_programs(files, {seq: inputs[seq, min(args.targets)] for seq in args.seq_len},
                              sorted(args.kernels, key=lambda k: k != "executorch"))

    rows = []
    for seq in args.seq_len:
        for t in args.targets:
            names = [name for (s, name) in files if s == seq and (readouts.get(name, 0) in (0, *slots_for[t]))]
            gflop = {name: step_gflop(cfg, module, seq, 1, readouts.get(name, 0), opts.lora) for name in names}
            seq_programs = {(name, k): p for (s, name, k), p in programs.items() if s == seq and name in names}
            for i, threads in enumerate(args.threads):
                ms = _time(module, seq_programs, readouts, inputs[seq, t], threads, args.repeats)
                base = ms[(FULL, "eager")]
                for name in names:
                    eager = ms[(name, "eager")]
                    et = {k: ms[(name, k)] for k in args.kernels}
                    rows.append((seq, threads, t, name, gflop[name], et, eager, base))
                if BACKPROP in ms:
                    mine = ", ".join(f"{name} {ms[(name, 'eager')] / ms[BACKPROP]:.2f}x" for name in names)
                    print(f"seq {seq}, {t} targets, {threads} thread(s): a backprop pipeline's step of this stage "
                          f"(eager: the layers' forward and backward from a received gradient) {ms[BACKPROP]:.0f} ms; "
                          f"ZeroLock's eager step / it: {mine}", flush=True)
                if args.profile and i == 0:
                    for name in names:
                        module.max_targets = readouts.get(name, 0)
                        print(f"\n--- {name} readout, seq {seq}, {t} targets, {threads} thread(s)")
                        _breakdown(files[seq, name][0], module, inputs[seq, t], out)
    _print_table(rows, args.kernels)



def _print_table(rows: list, kernels: list[str]) -> None:
    label = {"zl": "ET", "executorch": "ET(et)"}  # ExecuTorch on zl's kernels / on ExecuTorch's own
    head = "".join(f"{label[k] + ' ms':>10}" for k in kernels) + f"{'eager ms':>10}"
    head += "".join(f"{label[k] + '/eag':>11}" for k in kernels)
    head += "".join(f"{label[k] + ' GF/s':>12}" for k in kernels) + f"{'eag GF/s':>10}"
    head += "".join(f"{'eag-full/' + label[k]:>17}" for k in kernels) + f"{'eag-full/eag':>14}"
    print(f"\n{'seq':>4} {'thr':>3} {'tgt':>3}  {'readout':<24}{'GFLOP':>7}{head}")
    for seq, thr, tgt, name, gf, et, eager, base in rows:
        line = "".join(f"{et[k]:>10.0f}" for k in kernels) + f"{eager:>10.0f}"
        line += "".join(f"{et[k] / eager:>11.2f}" for k in kernels)
        line += "".join(f"{gf / et[k] * 1e3:>12.1f}" for k in kernels) + f"{gf / eager * 1e3:>10.1f}"
        line += "".join(f"{base / et[k]:>16.2f}x" for k in kernels) + f"{base / eager:>13.2f}x"
        print(f"{seq:>4} {thr:>3} {tgt:>3}  {name:<24}{gf:>7.2f}{line}")
    print("ET: the ExecuTorch step on zl's kernels (the runner's default); ET(et): on ExecuTorch's own "
          "(ZL_KERNELS=executorch); tgt: target tokens per sample in the input.\neag-full/X: the eager step of the full-readout program divided by X's step "
          "(> 1: X is faster).")


def _load_programs(files: dict, inputs: dict, kernels: list[str]) -> dict:
    """Load every program once per kernel choice, ExecuTorch's kernels first; one step each binds the kernels and
    checks that the zl-kernel programs, and only those, call zl's kernels."""
    from custom_ops.runtime import fast_kernel_call_count, gemm_backend, register_fast_kernels

    programs = {}
    for kernel in kernels:
        if kernel == "zl":
            register_fast_kernels()
            print(f"zl's kernels: GEMM on {gemm_backend()}", flush=True)
        for (seq, name), (pte, names) in files.items():
            program = TrainingProgram(pte, names)
            before = fast_kernel_call_count()
            program.step(*inputs[seq])
            if (fast_kernel_call_count() > before) != (kernel == "zl"):
                raise SystemExit(f"{pte} ({kernel} kernels): zl's kernels were "
                                 f"{'not ' if kernel == 'zl' else ''}called")
            programs[seq, name, kernel] = program
    return programs


def _dtype_suffix(dtype: str) -> str:
    """Folder suffix of programs with compact frozen weights (none for fp32, so earlier --out folders still reuse)."""
    return "" if dtype == "fp32" else f"-{dtype}"


def _export(module, peft_model, opts: ExportOptions, cfg, folder: Path, rewrite: bool = True, reuse: bool = False):
    """Export `module` with `opts` into `folder` (or with `reuse`, take the program there); returns (the .pte
    path, the program's output names)."""
    import zl_export.exporter as exporter

    names = ([] if module.is_last else ["hidden"]) + ["loss", "task_loss", "consistency_loss"]
    pte = folder / f"stage_{module.stage.index}.pte"
    if reuse and pte.is_file():
        print(f"reusing {pte}", flush=True)
        return pte, names
    folder.mkdir(parents=True, exist_ok=True)
    saved = exporter._matmuls_to_linear
    if not rewrite:
        exporter._matmuls_to_linear = lambda ep: 0
    try:
        entry = write_program(export_stage(module, peft_model, opts, cfg.vocab_size), folder)
    finally:
        exporter._matmuls_to_linear = saved
    print(f"exported seq {opts.seq_len}, max_targets {opts.max_targets}{'' if rewrite else ', no linear rewrite'}: "
          f"{entry.size_bytes / 2**20:.1f} MiB in {entry.export_s:.1f} s", flush=True)
    return folder / entry.file, entry.output_names


def _time(module, programs: dict, readouts: dict, inputs: tuple, threads: int, repeats: int) -> dict:
    """Median step ms by (program name, "eager" or the ExecuTorch program's kernels); checks that every program and
    runtime gives the same loss."""
    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

    torch.set_num_threads(threads)
    _unsafe_reset_threadpool(threads)

    def eager(slots: int):
        def run(*x):
            module.max_targets = slots
            return eager_step(module, *x)
        return run

    runs = {}
    for (name, kernel), program in programs.items():
        runs[(name, kernel)] = program.step
        runs[(name, "eager")] = eager(readouts.get(name, 0))
    losses = {key: float(run(*inputs).outputs["loss"]) for key, run in runs.items()}  # warm-up and correctness
    if not module.is_last:
        runs[BACKPROP] = _backprop_step(module, inputs)
        runs[BACKPROP](*inputs)  # warm-up
    ref = losses[(FULL, "eager")]
    worst = max(abs(v - ref) / max(abs(ref), 1e-12) for v in losses.values())
    print(f"{threads} thread(s): loss {ref:.6f} (eager, full readout); largest relative difference across programs "
          f"and runtimes {worst:.1e}", flush=True)
    if worst > 1e-4:
        raise SystemExit(f"the programs disagree: {losses}")
    ms: dict = {key: [] for key in runs}
    for _ in range(repeats):  # alternate, so drift (heat, other load) hits all alike
        for key, run in runs.items():
            t0 = time.perf_counter()
            run(*inputs)
            ms[key].append((time.perf_counter() - t0) * 1e3)
    return {key: statistics.median(v) for key, v in ms.items()}


def _backprop_step(module, inputs: tuple):
    """A backprop pipeline's step of the same stage in eager (GPipe, 1F1B, PipeDream): the layers' forward, then
    their backward from the gradient the next stage sends back (random here); no readout, no local loss, and the
    input gradient that goes upstream (stage 0: none)."""
    with torch.no_grad():
        shape = module.chunk(inputs[0], inputs[1])[1].shape
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(2))

    def run(x, mask, *_):  # the step's inputs, as the other runs take them; no labels (no loss)
        module.zero_grad(set_to_none=True)
        _, h = module.chunk(x if module.is_first else x.detach().requires_grad_(True), mask)
        h.backward(grad)
    return run


def step_gflop(cfg, module, seq: int, batch: int, slots: int, lora: LoraSettings) -> float:
    """Estimated GFLOP (2 per multiply-add) of one training step of `module`: matmuls only.

    Layers: the forward, and in the backward the input gradients through every frozen linear (as much as the
    forward) and attention (twice its forward), plus the LoRA adapters (forward, input and weight gradients).
    Readout (D x V per position, on S positions, or on `slots` per sample): this stage's forward and input
    gradient, and the previous readout's forward when the stage has one; the Ω selection (B,T,S)@(B,S,D).
    """
    d, v, inter = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or d // heads
    shapes = {"q_proj": (d, heads * hd), "k_proj": (d, kv_heads * hd), "v_proj": (d, kv_heads * hd),
              "o_proj": (heads * hd, d), "gate_proj": (d, inter), "up_proj": (d, inter), "down_proj": (inter, d)}
    tokens = batch * seq
    linear = sum(i * o for i, o in shapes.values())  # multiply-adds per token and layer
    attention = 2 * heads * seq * hd  # QKᵀ and AV, per token and layer (full S x S, as the eager mask computes it)
    adapters = sum(lora.rank * (i + o) for name, (i, o) in shapes.items() if name in lora.targets)
    per_layer = tokens * (2 * linear + 3 * attention + 3 * adapters)
    positions = batch * (slots if slots else seq)
    readouts = 2 + (1 if module.has_prev_target else 0)  # forward + input gradient, + the previous readout
    select = (3 * batch * slots * seq * d) if slots else 0  # h_in, h forward, h backward
    macs = len(module.layers) * per_layer + readouts * positions * d * v + select
    return 2 * macs / 1e9


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
    name = name.removeprefix("native_call_").removeprefix("aten::").removeprefix("zl::")
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
