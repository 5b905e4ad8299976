"""ExecuTorch's llama_main (tools/build_llm_runner.sh) against `zl generate --program`'s runtime, same programs.

    .venv/bin/python tools/check_llm_runner.py --runner build-llm/x86_64/llama_main        # tiny-random programs
    .venv/bin/python tools/check_llm_runner.py --runner build-llm/aarch64/llama_main --emulator "env -i qemu-aarch64"
    .venv/bin/python tools/check_llm_runner.py --runner build-llm/x86_64/llama_main \\
        --program runs/r1/model-int8.pte --program runs/r1/model-none.pte --prompt "Article: ...\\nHeadline:" -n 24

For each program (by default a tiny-random run's, exported by `zl export-model` in float and int8 into --work) and
each prompt, greedy: the continuation of the Python runtime (`ProgramRunner`, what `zl generate --program` runs) as
token ids, the bytes llama_main prints for those ids (`TokenizerPieces`: its `safe_printf` of each piece), and what
llama_main printed; the prompt's token count must agree too. llama_main samples over the tokenizer's ids only (its
sampler takes the tokenizer's vocab_size), so the Python side's argmax is over the same ids; where the model's
vocabulary is larger (tiny-random: 320 against 258 byte tokens) the column "zl generate" says whether the
continuation is still `zl generate --program`'s own (SmolLM2's are the same size: always). The prompt goes to both as
text, no chat template (`zl generate --raw`); a BOS is prepended where the tokenizer adds one (`--num_bos 1`).

A table per program. Exit status 1 unless every float program is identical on every prompt. A quantized program is
measured, not judged, past a sanity bound: its continuations may part (XNNPACK's int8 kernels are another build here
than in the wheel, and other code on Arm, and an activation quantized on the fly that rounds the other way moves
logits by tenths), and each parting is printed with the rank and logit of llama_main's token among the Python
runtime's there; it fails only where that token is not among the Python runtime's 10 best, or a prompt's token
count differs.

--emulator runs the runner under a command (e.g. "env -i qemu-aarch64": the static phone build with an empty
environment and no sysroot). The decode tokens/s printed are llama_main's own (its PyTorchObserver line), on the
threads of --threads (default 1); under an emulator they say nothing of a phone.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
warnings.filterwarnings("ignore")

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ("Once upon a time", "The capital of France is", "def fib(n):")


def tiny_programs(work: Path, model: str = "tiny-random", quantizations: tuple[str, ...] = ("none", "int8"),
                  max_seq_len: int = 64) -> list[Path]:
    """A run of `model` with a seeded random adapter (the suite's `random_run`), exported by `zl export-model` at
    each of `quantizations` into `work` as model-Q.pte, unless there."""
    sys.path.insert(0, str(ROOT / "tests"))
    from generative_fixtures import random_run  # the suite's tiny run: a seeded random adapter

    programs = [work / f"model-{q}.pte" for q in quantizations]
    if all(p.is_file() for p in programs):
        return programs
    import subprocess

    from tools.checkout_zl import checkout_zl

    run = work / "run"
    if not (run / "adapter").is_dir():
        random_run(run, model)
    for program, quantize in zip(programs, quantizations):
        command, env = checkout_zl(["export-model", str(run), "--out", str(program), "--quantize", quantize,
                                    "--max-seq-len", str(max_seq_len), "--force"])
        subprocess.run(command, env=env, check=True)
    return programs


def greedy(python, ids: list[int], new_tokens: int, vocab: int) -> list[int]:
    """Greedy ids after `ids` over the first `vocab` logits, as llama_main picks them: every new token, the end of
    sequence included (it prints that one, then stops); the prefill's first token is not checked for it."""
    budget = min(new_tokens, python.max_seq_len - len(ids))
    logits = python.logits(ids)[-1]
    new: list[int] = []
    while len(new) < budget:
        new.append(int(logits[:vocab].argmax()))
        if len(new) > 1 and new[-1] in python.eos_ids:
            break
        if len(new) < budget:
            logits = python.logits(new[-1:], len(ids) + len(new) - 1)[-1]
    return new


def check_program(program: Path, runner: Path, emulator: list[str], prompts: list[str], new_tokens: int,
                  threads: int) -> bool:
    """One program: every prompt through both runtimes; prints a table. Passes (returns True) when a float program's
    continuations are identical on every prompt; a quantized one's when each is identical or parts at a token among
    the Python runtime's 10 best there (`first_difference`), its prompt counted alike."""
    from zl_device.results.llm_runner import TokenizerPieces, llama_main_command, run_llama_main
    from zl_device.results.program_runner import ProgramRunner
    from zl_export.model_source import load_tokenizer
    from zl_export.program_record import check_program as read_record
    from zl_export.tokenizer import bos_ids, encode_prompt

    record = read_record(program)
    data = program.parent / record.data_file if record.data_file else None
    tokenizer = load_tokenizer(record.model)
    tokenizer_json = program.parent / "tokenizer.json"
    python = ProgramRunner(program, data)
    print(f"{program} ({record.model}, {record.quantize}, KV cache {record.max_seq_len}): llama_main "
          f"{runner}{' under ' + ' '.join(emulator) if emulator else ''}, {threads} thread(s)")
    table = TokenizerPieces(tokenizer_json)
    vocab = table.size  # llama_main's sampler is the tokenizer's size
    if vocab < python.vocab_size:
        print(f"  (llama_main samples over the tokenizer's {vocab} ids, the model has {python.vocab_size}: the Python "
              "side's greedy is taken over the same ids; 'zl generate' says whether that changed its continuation)")
    print(f"  {'prompt':<28} {'tokens':>6} {'new':>4} {'same':>5} {'zl generate':>10} {'decode tok/s':>13}  "
          "continuation (llama_main)")
    same_rows, flips = [], 0
    for prompt in prompts:
        ids = encode_prompt(tokenizer, prompt)
        new = greedy(python, ids, new_tokens, vocab)
        same_as_zl = True  # the same argmax over all ids: zl generate's continuation, up to its end of sequence
        if vocab < python.vocab_size:
            zl_generate = python.generate(ids, new_tokens)
            cut = len(zl_generate)  # zl generate stops before an end of sequence; llama_main prints it
            same_as_zl = new[:cut] == zl_generate and (len(new) == cut or new[cut] in python.eos_ids)
        pieces = table.pieces(new, set(python.eos_ids))
        expected = b"".join(pieces)
        command = llama_main_command(runner, program, tokenizer_json, prompt, new_tokens, threads, data,
                                     num_bos=1 if bos_ids(tokenizer) and ids[:1] == bos_ids(tokenizer) else 0,
                                     emulator=emulator)
        got = run_llama_main(command, prompt)
        same = got.text == expected and got.prompt_tokens == len(ids) and got.generated_tokens == len(new)
        same_rows.append(same)
        shown = got.text.decode(errors="replace").replace("\n", "\\n")
        print(f"  {prompt[:28]!s:<28} {got.prompt_tokens:>6} {got.generated_tokens:>4} {'yes' if same else 'NO':>5} "
              f"{'yes' if same_as_zl else 'no':>10} {got.decode_tok_s:>13.1f}  {shown[:50]}")
        if not same:
            where, tie = first_difference(python, table, ids, new, pieces, got.text)
            flips += tie and got.prompt_tokens == len(ids)
            print(f"    python: {len(ids)} prompt tokens, {len(new)} new: {expected!r}\n"
                  f"    llama_main: {got.prompt_tokens} prompt tokens, {got.generated_tokens} new: {got.text!r}\n"
                  f"    {where}\n    command: {shlex.join(command)}")
    identical = sum(same_rows)
    if record.quantize == "none":
        print(f"  identical on {identical}/{len(prompts)} prompts (a float program must be identical on every one)")
        return identical == len(prompts)
    parted = "" if identical == len(prompts) else (
        f"; where they part ({len(prompts) - identical}), llama_main took another of the Python runtime's 10 best "
        f"tokens on {flips} (activations quantized on the fly round apart across XNNPACK builds and CPUs)")
    print(f"  identical on {identical}/{len(prompts)} prompts{parted}")
    return identical + flips == len(prompts)


def first_difference(python, table, ids: list[int], new: list[int], pieces: list[bytes],
                     text: bytes) -> tuple[str, bool]:
    """Where llama_main's text leaves the Python continuation: the new token whose piece holds the first byte that
    differs, and the rank of llama_main's token there among the Python runtime's 10 best (the candidate whose piece
    it printed, longest first) with its logit against the best. Returns (what to print, whether it is among them)."""
    common = next((k for k, (a, b) in enumerate(zip(b"".join(pieces), text)) if a != b),
                  min(len(text), sum(map(len, pieces))))
    printed = 0
    for k, piece in enumerate(pieces):
        if printed + len(piece) > common:
            break
        printed += len(piece)
    logits = python.logits(ids + new[:k])[-1][:table.size]
    top = logits.topk(10)
    candidates = [(rank, int(i), table.text([int(i)])) for rank, i in enumerate(top.indices, 1)]
    taken = [c for c in candidates if c[2] and text[printed:].startswith(c[2])]
    where = (f"first difference at new token {k + 1} of {len(new)}: the Python runtime's best there is id "
             f"{int(top.indices[0])} ({float(top.values[0]):.4f})")
    if not taken:
        return where + "; llama_main's token is not among its 10 best", False
    rank, token, _ = max(taken, key=lambda c: len(c[2]))
    return (where + f", llama_main took its choice #{rank}, id {token} ({float(logits[token]):.4f}, "
            f"{float(top.values[0] - logits[token]):.4f} below)"), True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runner", type=Path, required=True, help="llama_main to check.")
    parser.add_argument("--emulator", default="", help='Run it under this command, e.g. "env -i qemu-aarch64".')
    parser.add_argument("--program", type=Path, action="append", help="A `zl export-model` program (repeatable; "
                        "default: tiny-random's, exported into --work).")
    parser.add_argument("--prompt", action="append", help=f"A prompt (repeatable; default: {list(PROMPTS)}).")
    parser.add_argument("--file", type=Path, help='Prompts from a JSONL file of {"prompt": ...} rows (prompt/'
                        'completion rows: the completion is ignored), after any --prompt.')
    parser.add_argument("-n", "--new-tokens", type=int, default=16, help="Greedy tokens after each prompt.")
    parser.add_argument("--threads", type=int, default=1, help="llama_main's --cpu_threads.")
    parser.add_argument("--work", type=Path, default=ROOT / "build-llm" / "check", help="Where tiny-random's "
                        "programs go.")
    args = parser.parse_args(argv)
    if not args.runner.is_file():
        parser.error(f"--runner {args.runner}: no such file; build it with tools/build_llm_runner.sh")
    prompts = list(args.prompt or [])
    if args.file:
        prompts += [json.loads(line)["prompt"] for line in args.file.read_text().splitlines() if line.strip()]
    programs = args.program or tiny_programs(args.work)
    results = [check_program(p, args.runner.resolve(), shlex.split(args.emulator), prompts or list(PROMPTS),
                             args.new_tokens, args.threads) for p in programs]
    print("llama_main and the Python runtime agree (float: identical; quantized: identical, or parted at one of its 10 best)"
          if all(results) else "llama_main and the Python runtime DIFFER (see the rows marked NO)")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
