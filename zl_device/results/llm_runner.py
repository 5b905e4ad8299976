"""ExecuTorch's own LLM runner, `llama_main`, on an inference program of `zl export-model` (issue 55).

`tools/build_llm_runner.sh` builds it from an ExecuTorch checkout: for this host (build-llm/x86_64/llama_main) and
as a static aarch64 binary (build-llm/aarch64/llama_main) that `zl deploy --program` pushes beside the program
(`zl_device.devices.deploy.llm_runner_binary`) and that runs here under `qemu-aarch64` with no sysroot. This module
runs one on a prompt and reads what it printed back:

- `run_llama_main`: one greedy generation; the continuation it printed and the timings of its `PyTorchObserver`
  line (prompt and generated tokens, load, prefill and decode speed), and the process's peak RSS.
- `TokenizerPieces` (`printed_text` for one call): the bytes llama_main prints for token ids (its `safe_printf` of
  each decoded piece), so that its output can be compared with another runtime's token ids exactly, byte tokens of
  random models included.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from zl_base.errors import ZLError
from zl_device.devices.deploy import LLM_RUNNER_HINT

#: The line llama_main prints after the continuation (extension/llm/runner/stats.h).
OBSERVER = "PyTorchObserver "


@dataclass
class LlamaMainResult:
    """One run of llama_main: what it printed after the prompt, and its own statistics."""

    text: bytes  # the continuation as printed (the echoed prompt and the trailing newline removed)
    prompt_tokens: int
    generated_tokens: int  # new tokens, the first (the prefill's) included
    load_s: float
    prefill_tok_s: float
    decode_tok_s: float  # tokens after the first over the time after it, as llama_main reports its rate
    peak_rss_kib: int  # the process's high-water mark (the emulator's, under qemu)
    seconds: float  # wall time of the whole process
    command: list[str]


def llama_main_command(binary: Path, program: Path, tokenizer: Path, prompt: str, max_new_tokens: int,
                       threads: int = 1, data_path: Path | None = None, num_bos: int = 0, ignore_eos: bool = False,
                       emulator: list[str] | None = None) -> list[str]:
    """The command line of one greedy generation (temperature 0) of `max_new_tokens` at most."""
    command = [*(emulator or []), str(binary), f"--model_path={program}", f"--tokenizer_path={tokenizer}",
               f"--prompt={prompt}", "--temperature=0", f"--max_new_tokens={max_new_tokens}",
               f"--cpu_threads={threads}", f"--num_bos={num_bos}", "--warmup=false"]
    if data_path is not None:
        command.append(f"--data_paths={data_path}")
    if ignore_eos:
        command.append("--ignore_eos")
    return command


def run_llama_main(command: list[str], prompt: str, timeout: float = 600) -> LlamaMainResult:
    """Run `command` (`llama_main_command`) and parse what it printed.

    Raises:
        ZLError: it failed (its last lines of stderr in the message), or printed no statistics line.
    """
    start = time.perf_counter()
    try:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as e:
        raise ZLError(f"{command[0]}: cannot run it ({e}); build llama_main with {LLM_RUNNER_HINT}.") from e
    # Read both pipes on threads and reap the process with wait4, which returns its own peak RSS.
    streams: dict[str, bytes] = {}
    readers = [threading.Thread(target=lambda n=n, f=f: streams.__setitem__(n, f.read()))
               for n, f in (("out", process.stdout), ("err", process.stderr))]
    for reader in readers:
        reader.start()
    timer = threading.Timer(timeout, process.kill)
    timer.start()
    try:
        _, status, usage = os.wait4(process.pid, 0)
    finally:
        timer.cancel()
    process.returncode = os.waitstatus_to_exitcode(status)
    for reader in readers:
        reader.join()
    seconds = time.perf_counter() - start
    if seconds >= timeout:
        raise ZLError(f"{command[0]}: no answer in {timeout:.0f} s; run it by hand: {' '.join(command)}")
    if process.returncode != 0:
        tail = " | ".join(streams["err"].decode(errors="replace").strip().splitlines()[-4:]) or "nothing on stderr"
        raise ZLError(f"{command[0]} failed (exit {process.returncode}): {tail}")
    return parse_output(streams["out"], prompt, usage.ru_maxrss, seconds, command)


def parse_output(stdout: bytes, prompt: str, rss_kib: int, seconds: float, command: list[str]) -> LlamaMainResult:
    """llama_main's stdout is the prompt (echoed), the continuation, a newline, then `PyTorchObserver {json}`."""
    at = stdout.rfind(OBSERVER.encode())
    if at < 0:
        raise ZLError(f"{command[0]} printed no {OBSERVER.strip()} line; is it ExecuTorch's llama_main? Its "
                      f"output began: {stdout[:200]!r}")
    stats = json.loads(stdout[at + len(OBSERVER):].splitlines()[0])
    text = stdout[:at]
    echo = prompt.encode()
    if not text.startswith(echo):
        raise ZLError(f"{command[0]} did not echo the prompt first: {text[:200]!r}")
    text = text[len(echo):]
    text = text[:-1] if text.endswith(b"\n") else text
    # generated_tokens counts the tokens after the first, which the prefill gives (extension/llm/runner/
    # text_llm_runner.cpp); prompt_eval_end_ms is taken once that first token is sampled.
    prompt_ms = stats["prompt_eval_end_ms"] - stats["inference_start_ms"]
    decode_ms = stats["inference_end_ms"] - stats["prompt_eval_end_ms"]
    after_first = stats["generated_tokens"]
    return LlamaMainResult(
        text=text, prompt_tokens=stats["prompt_tokens"], generated_tokens=after_first + 1,
        load_s=(stats["model_load_end_ms"] - stats["model_load_start_ms"]) / 1000,
        prefill_tok_s=stats["prompt_tokens"] / max(prompt_ms, 1) * 1000,
        decode_tok_s=after_first / max(decode_ms, 1) * 1000 if after_first else 0.0,
        peak_rss_kib=rss_kib, seconds=seconds, command=command)


class TokenizerPieces:
    """A tokenizer.json read once, for what llama_main prints of token ids. `size` is the ids it knows (vocabulary
    and added tokens): the size of llama_main's sampler, which takes the tokenizer's vocab_size
    (extension/llm/runner/llm_runner_helper.cpp), not the model's."""

    def __init__(self, tokenizer_json: Path):
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        spec = json.loads(Path(tokenizer_json).read_text())
        self._tokens = {i: t for t, i in spec["model"]["vocab"].items()}
        self._tokens.update({t["id"]: t["content"] for t in spec.get("added_tokens", [])})
        self._specials = {t["id"] for t in spec.get("added_tokens", [])}
        self._byte_level = (spec.get("decoder") or {}).get("type") == "ByteLevel"
        self._to_byte = {c: b for b, c in bytes_to_unicode().items()}
        self.size = len(self._tokens)

    def pieces(self, ids: list[int], eos_ids: set[int] | frozenset = frozenset()) -> list[bytes]:
        """What llama_main prints for each of the generated `ids`: the token's piece (its bytes, through the
        tokenizer's byte-level alphabet; a special token's content), nothing for a single byte that is neither
        printable nor space (`safe_printf`, extension/llm/runner/util.h, drops those), and a newline after an end of
        sequence that stops the loop (any but the first token: text_token_generator.h prints one there)."""
        out = []
        for k, i in enumerate(ids):
            token = self._tokens[i]
            plain = self._byte_level and i not in self._specials
            piece = bytes(self._to_byte[c] for c in token) if plain else token.encode()
            if len(piece) == 1 and not (0x20 <= piece[0] <= 0x7E or 0x09 <= piece[0] <= 0x0D):  # C's isprint, isspace
                piece = b""
            out.append(piece + (b"\n" if k > 0 and i in eos_ids else b""))
        return out

    def text(self, ids: list[int], eos_ids: set[int] | frozenset = frozenset()) -> bytes:
        """`pieces` joined: llama_main's output for `ids` between the echoed prompt and its final newline."""
        return b"".join(self.pieces(ids, eos_ids))


def printed_text(tokenizer_json: Path, ids: list[int], eos_ids: set[int] | frozenset = frozenset()) -> bytes:
    """What llama_main prints for `ids` (`TokenizerPieces.text`), the tokenizer read for this call alone."""
    return TokenizerPieces(tokenizer_json).text(ids, eos_ids)
