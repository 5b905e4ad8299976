"""Inference on this host, one thread: `zl export-model`'s programs (none / int8 / int4) next to PyTorch eager.

For one model (by default SmolLM2-135M, its base weights: merging an adapter changes values, not speed) it exports
each quantization once into --work, then runs every variant in its own process, --rounds times interleaved (a busy
spell of a shared machine hits them alike), and prints one table: program size, load time, peak RSS (the process's
high-water mark, and above the RSS after imports), prefill tokens/s (a --prompt-tokens prompt in one call) and
decode tokens/s (--new-tokens greedy tokens, one call each, from the KV cache). Each figure is the best of the rounds
(other processes only ever add time). Eager: the Hugging Face model with its dynamic KV cache, torch 1 thread.

    nice -n 10 .venv/bin/python tools/bench_inference.py                        # smollm2-135m, prompt 128, 64 new
    .venv/bin/python tools/bench_inference.py --model tiny-random --rounds 1     # smoke run
    .venv/bin/python tools/bench_inference.py --work runs/bench-inference --reuse   # time the programs again
    .venv/bin/python tools/bench_inference.py --reuse --dev runs/demo-data/dev.safetensors --rows 16   # + accuracy
    nice -n 10 .venv/bin/python tools/bench_inference.py --programs runs/export-demo-async   # a run's programs
    nice -n 10 .venv/bin/python tools/bench_inference.py --variants eager,int8,int8-static --max-seq-len 512
    nice -n 10 .venv/bin/python tools/bench_inference.py --llama-main build-llm/x86_64/llama_main   # + ExecuTorch's runner

With --programs DIR it exports nothing and times the programs `zl export-model` wrote there as
model-<quantization>.pte (e.g. a trained run's, with their --max-seq-len); --model is then their base, whose eager
model is the row they are compared with.

A variant named QUANTIZATION-static (e.g. int8-static) is that program exported with `--kv-cache static`
(transformers' static cache, a copy of the whole cache per token) instead of the in-place cache, so that the two
are timed side by side. --max-seq-len sizes every program's cache (default: the prompt plus the new tokens).

With --llama-main PATH (ExecuTorch's LLM runner, tools/build_llm_runner.sh's host build) every program is also
timed in it, in the same rounds, one thread (`--cpu_threads 1`): a row "VARIANT llama_main" with its own figures
(its PyTorchObserver line: prefill over the prompt, decode over the tokens after the first; the peak RSS of its
process). Its prompt is text of about --prompt-tokens tokens (the count it reports is in the JSON) and it decodes
--new-tokens ignoring end of sequence: the same work as the Python rows, in C++ without the Python calls between.

With --dev SHARD (a `zl data` shard of the model), each program is also compared with the eager model on the
shard's first --rows rows (`compare_with_model`: logits' max relative error, NLL of the rows, greedy continuations
of --new-tokens from each row's prompt part identical or not).
"""

import argparse
import json
import logging
import subprocess
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
warnings.filterwarnings("ignore")
for _name in ("torchao", "torch.utils._pytree", "executorch"):
    logging.getLogger(_name).setLevel(logging.ERROR)

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("eager", "none", "int8", "int4")  # and QUANTIZATION-static: the same with --kv-cache static


def status_kib(field: str = "VmRSS") -> int:
    """A KiB field of /proc/self/status: VmRSS (resident now) or VmHWM (its peak). Not getrusage's ru_maxrss, which
    survives exec: a child of an exporting parent would report the parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def measure(variant: str, model_name: str, program: Path | None, prompt_tokens: int, new_tokens: int) -> dict:
    """One variant in this process: load it, prefill a prompt, decode greedily; seconds and KiB."""
    import torch

    torch.set_num_threads(1)
    import executorch.kernels.quantized  # noqa: F401
    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

    _unsafe_reset_threadpool(1)  # XNNPACK's threadpool: one thread, as torch
    from zl_device.results.program_runner import ProgramRunner
    from zl_export.model_source import load_model

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 200, (prompt_tokens,), generator=generator).tolist()
    baseline = status_kib()
    start = time.perf_counter()
    if variant == "eager":
        model = load_model(model_name).model.eval()
        load = time.perf_counter() - start
        with torch.no_grad():
            start = time.perf_counter()
            out = model(torch.tensor([ids]), use_cache=True)  # prefill
            prefill = time.perf_counter() - start
            cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
            start = time.perf_counter()
            for _ in range(new_tokens):
                out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
                cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
            decode = time.perf_counter() - start
        size = None
    else:
        runner = ProgramRunner(program)
        load = time.perf_counter() - start
        start = time.perf_counter()
        logits = runner.logits(ids)
        prefill = time.perf_counter() - start
        token = int(logits[-1].argmax())
        start = time.perf_counter()
        for i in range(new_tokens):
            token = int(runner.logits([token], prompt_tokens + i)[-1].argmax())
        decode = time.perf_counter() - start
        size = program.stat().st_size
    peak = status_kib("VmHWM")
    return {"variant": variant, "bytes": size, "load_s": load, "peak_rss_kib": peak, "peak_above_imports_kib":
            peak - baseline, "prefill_tok_s": prompt_tokens / prefill, "decode_tok_s": new_tokens / decode}


def export(model_name: str, work: Path, variant: str, max_seq_len: int, reuse: bool) -> Path:
    """The program of `model_name` for `variant` (a quantization, -static for the static cache) in `work` (exported
    unless --reuse finds it)."""
    from zl_export.inference_program import export_program
    from zl_export.model_source import load_model

    out = work / f"{model_name}-{variant}-{max_seq_len}.pte"
    if reuse and out.is_file():
        return out
    loaded = load_model(model_name)
    quantize, static = variant.removesuffix("-static"), variant.endswith("-static")
    info = export_program(loaded.model, out, quantize, max_seq_len, (loaded.tokenizer.eos_token_id,),
                          kv_cache="static" if static else "in-place")
    print(f"exported {out} ({info.bytes / 2**20:.1f} MiB) in {info.seconds:.0f} s", file=sys.stderr, flush=True)
    return out


def measure_llama_main(runner: Path, program: Path, prompt: str, new_tokens: int) -> dict:
    """One program in ExecuTorch's llama_main (its tokenizer.json beside it), one thread: the row's figures."""
    from zl_device.results.llm_runner import llama_main_command, run_llama_main

    got = run_llama_main(llama_main_command(runner, program, program.parent / "tokenizer.json", prompt, new_tokens,
                                            threads=1, ignore_eos=True), prompt)
    return {"variant": "llama_main", "bytes": program.stat().st_size, "load_s": got.load_s,
            "peak_rss_kib": got.peak_rss_kib, "peak_above_imports_kib": None, "prefill_tok_s": got.prefill_tok_s,
            "decode_tok_s": got.decode_tok_s, "prompt_tokens": got.prompt_tokens,
            "generated_tokens": got.generated_tokens}


def llama_main_prompt(model_name: str, programs: dict[str, Path], prompt_tokens: int) -> str:
    """Text of about `prompt_tokens` tokens for llama_main, and the tokenizer files it reads beside every program
    (written where `zl export-model` did not)."""
    from zl_export.inference_program import write_tokenizer_files
    from zl_export.model_source import load_tokenizer

    tokenizer = load_tokenizer(model_name)
    for folder in {p.parent for p in programs.values()}:
        if not (folder / "tokenizer.json").is_file():
            write_tokenizer_files(tokenizer, folder)
    sentence = "The quick brown fox jumps over the lazy dog while the phone trains its adapter. "
    ids = tokenizer.encode(sentence * (prompt_tokens // 4 + 1))[:prompt_tokens]
    return tokenizer.decode(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="Model to export and time (its base weights).")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="Of eager,none,int8,int4 and none-static, int8-static, int4-static.")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="Prompt length of the prefill.")
    parser.add_argument("--new-tokens", type=int, default=64, help="Tokens decoded after it.")
    parser.add_argument("--max-seq-len", type=int, help="KV cache positions of the exported programs (default: "
                        "--prompt-tokens + --new-tokens + 1).")
    parser.add_argument("--rounds", type=int, default=3, help="Runs of every variant, interleaved; best kept.")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-inference", help="Where programs go.")
    parser.add_argument("--reuse", action="store_true", help="Time the programs already in --work.")
    parser.add_argument("--programs", type=Path, help="Time DIR/model-<quantization>.pte of `zl export-model` "
                                                      "instead of exporting.")
    parser.add_argument("--json-out", type=Path, help="Also write the table as JSON.")
    parser.add_argument("--dev", type=Path, help="A shard to compare each program with the eager model on.")
    parser.add_argument("--rows", type=int, default=16, help="--dev rows compared.")
    parser.add_argument("--llama-main", type=Path, help="ExecuTorch's llama_main (tools/build_llm_runner.sh's host "
                        "build): every program is timed in it too.")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one variant (JSON on stdout)
    parser.add_argument("--program", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.model, args.program, args.prompt_tokens, args.new_tokens)))
        return
    variants = [v for v in args.variants.split(",") if v]
    max_seq_len = args.max_seq_len or args.prompt_tokens + args.new_tokens + 1
    if max_seq_len <= args.prompt_tokens + args.new_tokens:
        parser.error(f"--max-seq-len {max_seq_len}: the cache must hold the prompt and the new tokens, at least "
                     f"{args.prompt_tokens + args.new_tokens + 1}.")
    if args.programs:
        programs = {v: args.programs / f"model-{v}.pte" for v in variants if v != "eager"}
        missing = [str(p) for p in programs.values() if not p.is_file()]
        if missing:
            parser.error(f"--programs {args.programs}: no {', '.join(missing)}; write them with `zl export-model RUN "
                         f"--out {args.programs}/model-<quantization>.pte`, or pick --variants.")
    else:
        programs = {v: export(args.model, args.work, v, max_seq_len, args.reuse) for v in variants if v != "eager"}
    if args.llama_main and not args.llama_main.is_file():
        parser.error(f"--llama-main {args.llama_main}: no such file; build it with tools/build_llm_runner.sh")
    prompt = llama_main_prompt(args.model, programs, args.prompt_tokens) if args.llama_main else ""
    best: dict[str, dict] = {}
    for _ in range(args.rounds):
        for v in variants:
            command = [sys.executable, __file__, "--one", v, "--model", args.model, "--prompt-tokens",
                       str(args.prompt_tokens), "--new-tokens", str(args.new_tokens)]
            if v in programs:
                command += ["--program", str(programs[v])]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            keep_best(best, v, json.loads(done.stdout.strip().splitlines()[-1]))
            if args.llama_main and v in programs:
                keep_best(best, f"{v} llama_main", measure_llama_main(args.llama_main, programs[v], prompt,
                                                                      args.new_tokens))
    if best:
        print_speed_table(args, list(best), best, None if args.programs else max_seq_len)
    accuracy = accuracy_table(args.model, programs, args.dev, args.rows, args.new_tokens) if args.dev else {}
    if args.json_out:
        args.json_out.write_text(json.dumps({"model": args.model, "prompt_tokens": args.prompt_tokens,
                                             "new_tokens": args.new_tokens, "rounds": args.rounds,
                                             "results": best, "accuracy": accuracy}, indent=2) + "\n")


def keep_best(best: dict[str, dict], name: str, row: dict) -> None:
    """Fold one round's row into best[name]: the fastest speeds and load, the highest memory (other processes only
    ever add time; a peak is a peak)."""
    old = best.get(name)
    best[name] = row if old is None else {
        **row, **{k: max(old[k], row[k]) for k in ("prefill_tok_s", "decode_tok_s")},
        **{k: min(old[k], row[k]) for k in ("load_s",)},
        **{k: max(old[k] or 0, row[k] or 0) or None for k in ("peak_rss_kib", "peak_above_imports_kib")}}


def print_speed_table(args, variants: list[str], best: dict[str, dict], max_seq_len: int | None) -> None:
    """The speed table: one row per variant, decode speed also as a multiple of eager's."""
    eager = best.get("eager")
    cache = f", KV cache of {max_seq_len} positions" if max_seq_len else ""
    print(f"{args.model}, prompt {args.prompt_tokens} tokens, {args.new_tokens} decoded{cache}, 1 thread, best of "
          f"{args.rounds}")
    print(f"{'variant':<16} {'size MiB':>9} {'load s':>7} {'peak RSS MiB':>13} {'above imports':>14} "
          f"{'prefill tok/s':>14} {'decode tok/s':>13} {'decode vs eager':>16}")
    for v in variants:
        r = best[v]
        size = f"{r['bytes'] / 2**20:.1f}" if r["bytes"] else "-"
        ratio = f"{r['decode_tok_s'] / eager['decode_tok_s']:.2f}x" if eager else "-"
        above = f"{r['peak_above_imports_kib'] / 1024:.0f}" if r["peak_above_imports_kib"] is not None else "-"
        print(f"{v:<16} {size:>9} {r['load_s']:>7.2f} {r['peak_rss_kib'] / 1024:>13.0f} {above:>14} "
              f"{r['prefill_tok_s']:>14.1f} {r['decode_tok_s']:>13.1f} {ratio:>16}")


def accuracy_table(model_name: str, programs: dict[str, Path], shard_path: Path, rows: int, new_tokens: int) -> dict:
    """Each program against the eager model on the shard's first `rows` rows; printed and returned."""
    import torch

    torch.set_num_threads(1)
    from zl_device.results.generation import split_row
    from zl_device.results.program_runner import ProgramRunner, compare_with_model
    from zl_export.model_source import load_model
    from zl_export.shard import load_shard

    loaded = load_model(model_name)
    shard = load_shard(shard_path)
    picked = range(min(rows, shard.rows))
    ids = [shard.input_ids[r, : int(shard.attention_mask[r].sum())].tolist() for r in picked]
    prompts = [split_row(shard, r)[0] for r in picked]
    print(f"\n{model_name} programs vs eager on {len(ids)} rows of {shard_path} (greedy: {new_tokens} tokens)")
    print(f"{'variant':<8} {'logits max rel err':>19} {'NLL eager':>10} {'NLL program':>12} {'change':>8} "
          f"{'greedy identical':>17}")
    table = {}
    for variant, program in programs.items():
        runner = ProgramRunner(program)
        c = compare_with_model(runner, loaded.model, ids, new_tokens, loaded.tokenizer.eos_token_id, prompts)
        table[variant] = {"max_relative_error": c.max_relative_error, "nll_eager": c.nll_model,
                          "nll_program": c.nll_program, "greedy_identical": c.greedy_agree, "rows": c.prompts}
        print(f"{variant:<8} {c.max_relative_error:>19.2e} {c.nll_model:>10.4f} {c.nll_program:>12.4f} "
              f"{c.nll_change:>+8.4f} {c.greedy_agree:>9}/{c.prompts:<7}")
    return table


if __name__ == "__main__":
    main()
