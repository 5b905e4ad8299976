"""`zl export-model`: a run's tuned model as an ExecuTorch inference program for the phone (the work is
zl_export/inference_program.py; the check runs it with zl_device/results/program_runner.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from zl_base.errors import ZLError
from zl.options import settings_command
from zl_base.settings import REQUIRED, check_fields, setting
from zl_export.inference_program import DEFAULT_MAX_SEQ_LEN, KV_CACHES, QUANTIZATIONS

console = Console()
err_console = Console(stderr=True)
log = logging.getLogger(__name__)

CHECK_ROWS = 8  # dev rows (else built-in prompts) the check compares on, by default
CHECK_NEW_TOKENS = 16  # greedy tokens compared per row
_FALLBACK_PROMPTS = ("Q: What is the capital of France?\nA:", "The best thing about phones is",
                     "Once upon a time, there was")


@dataclass(frozen=True)
class ExportModelArgs:
    """`zl export-model`'s run, output and options."""

    run: Path = setting(REQUIRED, "Run directory of `zl train`: its adapter/ and the model the run trained.",
                        argument="RUN_DIR")
    out: Path = setting(REQUIRED, "The program to write (.pte); tokenizer.json and tokenizer_config.json go next to "
                                  "it.", flag="--out -o")
    quantize: str = setting("int8", "Weights: none (float32), int8 (8-bit per channel, activations quantized on the "
                                    "fly: XNNPACK qd8-qc8w) or int4 (4-bit in groups of 32).",
                            choices=QUANTIZATIONS)
    max_seq_len: int = setting(DEFAULT_MAX_SEQ_LEN, "KV cache positions: prompt plus generated tokens, at most "
                                                    "(capped at the model's context).", flag="--max-seq-len")
    kv_cache: str = setting("in-place", "KV cache: in-place (written by ExecuTorch's LLM ops update_cache and "
                                        "custom_sdpa, as its LLM runners expect) or static (plain ATen ops, for a "
                                        "runtime built without them; copies the cache every token).",
                            flag="--kv-cache", choices=KV_CACHES)
    check: bool = setting(True, "Run the program with ExecuTorch's runtime here and compare it with the PEFT model "
                                "on the run's dev rows (logits, NLL, greedy continuations).", flag="--check/--no-check")
    check_rows: int = setting(CHECK_ROWS, "Dev rows the check compares on (each a prefill in both and two greedy "
                                          "continuations: seconds a row on a 135M model).", flag="--check-rows")
    shared_base: bool = setting(False, "Keep the LoRA weights unmerged in a small program and write the base's "
                                       "weights once to base.ptd beside it, the same file for every adapter of that "
                                       "base (ExecuTorch's program-data separation): a phone holds one base and a "
                                       "small program per tuning. --quantize applies to the base; the LoRA "
                                       "weights stay float.",
                                flag="--shared-base/--no-shared-base")
    force: bool = setting(False, "Replace --out (and tokenizer files beside it) if they exist.", flag="--force")

    def validate(self) -> None:
        """Every check that needs no model, before anything loads: the options and --out.

        Raises:
            ZLError: naming the flag, the value and the fix.
        """
        check_fields(self)
        if self.check_rows < 1:
            raise ZLError(f"--check-rows {self.check_rows}: must be at least 1, e.g. --check-rows {CHECK_ROWS}; "
                          "--no-check skips the check.")
        if self.max_seq_len < 2:
            raise ZLError(f"--max-seq-len {self.max_seq_len}: must be at least 2 (a prompt token and a new one), "
                          f"e.g. --max-seq-len {DEFAULT_MAX_SEQ_LEN}.")
        _check_out(self.out, self.force)


EXPORT_MODEL_DOC = """Merge a run's adapter into its base model; write an ExecuTorch program that generates text on a phone.

The program (KV cache, prompt prefilled in one call, XNNPACK delegate) is
what ExecuTorch's LLM runners load, with the tokenizer.json written next to
it. It is then run here with ExecuTorch's runtime and compared with the PEFT
model on the run's dev rows (--check-rows): logits (float: equal within
1e-3), NLL over all tokens and over the answer tokens, and greedy
continuations.

Examples:

  zl export-model runs/r1 --out runs/r1/model-int8.pte

  zl export-model runs/r1 --out phone/model.pte --quantize int4 --max-seq-len 1024

  zl export-model runs/r1 --out runs/r1/model.pte --quantize none --force

  zl export-model runs/r1 --out phone/r1.pte --shared-base   # + phone/base.ptd (int8), shared

Then: zl generate --run runs/r1 --program runs/r1/model-int8.pte "Hello"
"""


def run_export_model(args: ExportModelArgs) -> None:
    """Check the output paths, load and merge the tuned model, export, write the tokenizer, check the program."""
    from zl.commands.generate import adapter_source
    from zl_device.results.adapter import load_adapter
    from zl_export.inference_program import (check_quantization, check_tokenizer_files, export_program, merged_model,
                                             write_tokenizer_files)
    from zl_export.model_source import load_model
    from zl_export.program_record import write_program_record

    out = args.out
    args.validate()
    adapter_dir, model_name, seed = adapter_source(args.run, None, None, run_flag="RUN_DIR")
    with err_console.status(f"loading {model_name} and {adapter_dir}"):
        loaded = load_model(model_name, seed=seed)
        check_tokenizer_files(loaded.tokenizer, out.parent, args.force)  # before minutes of exporting, not after
        tuned = load_adapter(loaded.model, adapter_dir)
        # --shared-base: the LoRA layers stay (their weights in the program, the base's in base.ptd)
        model = tuned.base_model.model.eval().requires_grad_(False) if args.shared_base else merged_model(tuned)
        check_quantization(model, args.quantize, loaded.family.name)
    limit = int(getattr(model.config, "max_position_embeddings", args.max_seq_len) or args.max_seq_len)
    max_seq_len = min(args.max_seq_len, limit)
    tokenizer = loaded.tokenizer
    bos = getattr(tokenizer, "bos_token_id", None)
    with err_console.status(f"exporting {model_name} ({args.quantize}) to {out}: torch.export, XNNPACK, "
                            "to_executorch (a minute or more)"):
        info = export_program(model, out, args.quantize, max_seq_len, (tokenizer.eos_token_id,), bos, args.kv_cache,
                              shared_base=args.shared_base)
    files = write_tokenizer_files(tokenizer, out.parent, args.force)
    write_program_record(out, model_name, args.quantize, max_seq_len, info.kv_cache,
                         ["forward", *info.metadata], files, info.data)
    how = (f"LoRA unmerged, the base's weights in {info.data} ({info.data.stat().st_size / 2**20:.1f} MiB, shared "
           "by every adapter of this base)") if info.data is not None else "merged"
    console.print(f"[bold]{escape(str(out))}[/]: {model_name} + {adapter_dir} {how}, {args.quantize} weights, "
                  f"KV cache of {max_seq_len} positions ({info.kv_cache}), {info.bytes / 2**20:.1f} MiB, exported in "
                  f"{info.seconds:.0f} s", highlight=False, soft_wrap=True)
    console.print("tokenizer: " + ", ".join(str(f) for f in files), highlight=False, soft_wrap=True)
    if args.check:
        _check(args.run, out, model_name, seed, adapter_dir, tokenizer, args.quantize, args.check_rows, info.data)
    console.print(f"next: zl generate --run {args.run} --program {out} \"Hello\"", highlight=False, soft_wrap=True)


def _check_out(out: Path, force: bool) -> None:
    """--out names a .pte file that does not exist yet (or --force), in a directory that can hold it."""
    from zl.paths import check_out_file

    check_out_file(out, "--out", "model.pte")
    if out.suffix != ".pte":
        raise ZLError(f"--out {out}: not a .pte file name; ExecuTorch programs end in .pte, e.g. --out "
                      f"{out.with_suffix('.pte')}.")
    if out.exists() and not force:
        raise ZLError(f"--out {out}: exists; pass --force to replace it, or another --out.")


def _check(run: Path, out: Path, model_name: str, seed: int, adapter_dir: Path, tokenizer, quantize: str,
           check_rows: int, data: Path | None = None) -> None:
    """Run the program with ExecuTorch's runtime and compare it with the PEFT model (reloaded: merging spent it)."""
    from zl_device.results.adapter import load_adapter
    from zl_device.results.program_runner import ProgramRunner, compare_with_model
    from zl_export.model_source import load_model

    with err_console.status(f"checking {out} against the PEFT model"):
        runner = ProgramRunner(out, data)
        rows, prompts, where = _check_prompts(run, tokenizer, runner.max_seq_len - CHECK_NEW_TOKENS, check_rows)
        tuned = load_adapter(load_model(model_name, seed=seed).model, adapter_dir)
        result = compare_with_model(runner, tuned, rows, CHECK_NEW_TOKENS, tokenizer.eos_token_id, prompts)
    ok = result.max_relative_error <= 1e-3 or quantize != "none"
    answers = "" if result.answer_nll_change is None else (
        f", on the {result.answer_tokens} answer tokens {result.answer_nll_model:.4f} -> "
        f"{result.answer_nll_program:.4f} ({result.answer_nll_change:+.4f})")
    console.print(f"check on {result.prompts} {where} (ExecuTorch runtime vs PEFT): logits max relative error "
                  f"{result.max_relative_error:.2e}{'' if ok else ' [red](over 1e-3)[/]'}, NLL {result.nll_model:.4f} "
                  f"-> {result.nll_program:.4f} nats/token ({result.nll_change:+.4f}){answers}, greedy "
                  f"continuations identical on {result.greedy_agree}/{result.prompts}", highlight=False,
                  soft_wrap=True)


def _check_prompts(run: Path, tokenizer, room: int, count: int) -> tuple[list[list[int]], list[list[int]], str]:
    """What to check on: the first `count` of the run's dev rows (else its training rows), each cut to `room` tokens,
    with their prompt parts to generate from; else built-in prompts. Returns (rows, prompts, what they are)."""
    from zl_device.formats.run_layout import RunLayout
    from zl_device.results.generation import split_row
    from zl_export.shard import load_shard
    from zl_export.tokenizer import encode_prompt

    layout = RunLayout(run)
    for path, what in ((layout.dev_shard, "dev rows"), (layout.train_shard, "training rows")):
        if not path.is_file():
            continue
        shard = load_shard(path)
        rows, prompts = [], []
        for r in range(min(count, shard.rows)):
            ids = shard.input_ids[r, : int(shard.attention_mask[r].sum())].tolist()[:room]
            try:
                prompt = split_row(shard, r)[0][:room]
            except ZLError:  # a row without a completion (plain text): generate after the whole row
                prompt = ids
            if len(ids) >= 2:
                rows.append(ids)
                prompts.append(prompt)
        if rows:
            return rows, prompts, f"{what} of {path}"
    rows = [ids for ids in (encode_prompt(tokenizer, p)[:room] for p in _FALLBACK_PROMPTS) if len(ids) >= 2]
    return rows, rows, "built-in prompts (the run has no data/)"


export_model_command = settings_command(ExportModelArgs, run_export_model, EXPORT_MODEL_DOC)
COMMANDS = {"export-model": export_model_command}
