"""`zl generate`: prompts through a base model and its LoRA adapter, side by side, tokens streamed as they come.

A run trained on chat rows gets its prompts as it saw them: each one a user turn rendered with the renderer of
`zl data` (`zl_export.chat.render_turns`: the tokenizer's chat template with the assistant's turn opened, or the
plain fallback the run's sidecar records).
"""

import json
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from zl_base.errors import ZLError
from zl_device.formats.run_layout import RunLayout
from zl_export.records import check_text, is_tabular, json_kind, json_line
from zl.options import settings_command
from zl.paths import check_out_file
from zl_base.settings import setting

console = Console()
err_console = Console(stderr=True)

JSONL_SUFFIXES = (".jsonl", ".ndjson")
LABELS = {"base": "cyan", "adapter": "green", "program": "magenta"}  # what is shown for each model, and its colour
WIDTH = max(map(len, LABELS))


@dataclass
class Prompt:
    """One prompt as given: an argument, a line, a JSONL "prompt" field, or a JSONL row's conversation."""

    text: str  # as typed; a conversation: its last (user) turn
    where: str  # names it in errors, e.g. "--file p.jsonl line 3"
    messages: list[dict[str, str]] | None = None  # a "messages" row, checked (ends in a user turn)


@dataclass
class Rendering:
    """Whether plain prompts become a chat user turn, and why (shown in the header and kept in --json-out)."""

    chat: bool
    plain: bool  # force the plain fallback: the run's chat rows were rendered with it
    reason: str  # e.g. "--chat", "as the run trained: runs/r1/data/train.json"


@dataclass(frozen=True)
class GenerateArgs:
    """`zl generate`'s prompts and options."""

    prompts: tuple[str, ...] | None = setting(None, "Prompts, used verbatim as `zl data` uses a prompt (in bash, "
                                                    "$'Q: hi?\\nA:' holds a newline), or each as a user turn with "
                                                    "--chat. Without them: --file, or one prompt per line on stdin.",
                                              argument="PROMPTS...")
    run: Path | None = setting(None, "Run directory of `zl train`: its adapter/ and the model the run trained.",
                               flag="--run -r")
    adapter: Path | None = setting(None, "PEFT adapter directory (from `zl merge`, or PEFT's save_pretrained), "
                                         "instead of --run.", flag="--adapter -a")
    model: str | None = setting(None, "Base model: smollm2-135m, tiny-random, a hub id or a directory (default: the "
                                      "one the adapter was trained on, from zl_merge.json or adapter_config.json).",
                                flag="--model -m")
    force_base: bool = setting(False, "Use --model even when the adapter was trained on another base (refused "
                                      "otherwise: its generations there say nothing of it).", flag="--force-base")
    file: Path | None = setting(None, "Prompts from a file: one per line, or JSONL (.jsonl, or lines starting with "
                                      "'{') with a \"prompt\" field or a \"messages\" conversation ending in a user "
                                      "turn per line (ShareGPT's \"conversations\" and Alpaca's \"instruction\" "
                                      "too); the same rows from .parquet/.arrow; - reads stdin.", flag="--file -f")
    chat: bool | None = setting(None, "Render each prompt as one user turn, as `zl data` renders chat rows (the "
                                      "tokenizer's chat template, assistant turn opened; the plain <|user|> fallback "
                                      "without one), or send it verbatim. Default: as the run's training data was "
                                      "(--run); with --adapter, verbatim: pass --chat for an adapter trained on chat "
                                      "rows.")
    system: str | None = setting(None, "Chat: a system turn before each prompt (a \"messages\" row with its own keeps "
                                       "that).")
    show_prompt: bool = setting(False, "Show each prompt as the model gets it (rendered, special tokens spelled out) "
                                       "instead of as typed.", flag="--show-prompt")
    max_new_tokens: int = setting(64, "Most tokens generated per prompt and model.", flag="--max-new-tokens -n")
    sample: bool = setting(False, "Sample tokens (with --temperature, --top-p, --seed) instead of greedy decoding.",
                           flag="--sample")
    temperature: float = setting(1.0, "--sample: softmax temperature (lower is more deterministic).")
    top_p: float = setting(1.0, "--sample: keep the smallest set of tokens whose probability reaches P (1: all).")
    seed: int = setting(0, "--sample: random seed; every prompt and model starts from it, so a rerun gives the same "
                           "text.")
    json_out: Path | None = setting(None, "Also write the prompts and both generations to this JSON file.")
    program: Path | None = setting(None, "An inference program of `zl export-model` (.pte): generate with it, run by "
                                         "ExecuTorch's runtime, next to the adapter instead of the base model.")


GENERATE_DOC = """Continue prompts with the base model and with the fine-tuned adapter, one after the other, streamed.

What to run first after `zl train`: each prompt is shown, then the base
model's continuation, then the adapter's, labelled. A continuation ends at
the end-of-sequence token or after --max-new-tokens (shown as …).
Decoding is greedy (deterministic) unless --sample. A run trained on chat
rows gets each prompt as a user turn rendered as its training prompts were.

Examples:

  zl generate --run runs/r1 $'Q: What is the capital of France?\\nA:'

  zl generate --adapter runs/r1/adapter --model smollm2-135m "Hello, my name is" "The best phone is"

  zl generate --run runs/r1 --file prompts.jsonl --max-new-tokens 128

  zl generate --adapter runs/r1/adapter --chat --system "Answer in one word." --show-prompt "Capital of France?"

  echo "Write a haiku about phones:" | zl generate --run runs/r1 --sample --temperature 0.7 --seed 7

  zl generate --run runs/r1 --program runs/r1/model-int8.pte "Hello"   # the phone's program vs the adapter
"""


def run_generate(args: GenerateArgs) -> None:
    """Stream each prompt's continuation by the base model, then by the adapter; write --json-out."""
    from zl_device.results.adapter import load_adapter
    from zl_device.results.generation import Decoding, encode_prompt
    from zl_export.model_source import load_model

    run, adapter, model, file, chat, system = args.run, args.adapter, args.model, args.file, args.chat, args.system
    max_new_tokens, sample, temperature, top_p, seed = (args.max_new_tokens, args.sample, args.temperature,
                                                        args.top_p, args.seed)
    json_out = args.json_out
    if max_new_tokens < 1:
        raise ZLError(f"--max-new-tokens {max_new_tokens}: must be at least 1, e.g. --max-new-tokens 64.")
    decoding = Decoding(sample, temperature, top_p, seed)
    decoding.validate()
    if not sample and (temperature != 1.0 or top_p != 1.0):
        err_console.print("[yellow]note:[/] --temperature and --top-p apply with --sample; decoding is greedy.")
    check_out_file(json_out, "--json-out", "generations.json")
    runner = _program_runner(args.program)  # before the model: a bad --program is found at once
    adapter_dir, model_name, model_seed = adapter_source(run, adapter, model, args.force_base)
    given = read_prompts(list(args.prompts or ()), file)
    rendering = _rendering(chat, system, run, adapter_dir, given)

    with err_console.status(f"loading {model_name} and {adapter_dir}"):
        loaded = load_model(model_name, seed=model_seed)
        tuned = load_adapter(loaded.model, adapter_dir)
    if runner is not None and runner.vocab_size != loaded.config.vocab_size:
        raise ZLError(f"--program {args.program}: a model of {runner.vocab_size} tokens, but {model_name} has "
                      f"{loaded.config.vocab_size}; pass the program `zl export-model` wrote for this run.")
    tokenizer = loaded.tokenizer
    texts, template = _render(given, rendering, system, tokenizer)
    encoded = [encode_prompt(tokenizer, t) for t in texts]  # as `zl data` starts a sample: BOS where it adds one
    _check_lengths(texts, encoded, max_new_tokens, loaded.config, model_name)
    longest = max(len(ids) for ids in encoded)
    if runner is not None and longest + max_new_tokens > runner.max_seq_len:
        raise ZLError(f"--program {args.program}: a prompt of {longest} tokens + --max-new-tokens {max_new_tokens} "
                      f"exceed its KV cache of {runner.max_seq_len} positions; lower --max-new-tokens or export with a "
                      "larger --max-seq-len.")

    shown = ("adapter", "program") if runner is not None else ("base", "adapter")
    how = (f"sampling (temperature {temperature:g}, top-p {top_p:g}, seed {seed})" if sample else "greedy")
    versus = (f"adapter {escape(str(adapter_dir))} vs program {escape(str(args.program))}" if runner is not None
              else f"base vs adapter {escape(str(adapter_dir))}")
    console.print(f"[bold]{escape(model_name)}[/] {versus} · {how} · "
                  f"at most {max_new_tokens} new tokens", highlight=False, soft_wrap=True)
    console.print(f"prompts: {escape(_describe(rendering, template, system, tokenizer))}", highlight=False,
                  soft_wrap=True)
    outputs = []
    for i, (prompt, text, ids) in enumerate(zip(given, texts, encoded)):
        console.print(f"\n[bold]prompt {i + 1}/{len(texts)}[/] ({len(ids)} tokens)", highlight=False)
        console.out(_indented(_shown(prompt, text, args.show_prompt), "  "), highlight=False)
        row = {"prompt": prompt.text, **({"messages": prompt.messages} if prompt.messages else {}),
               "rendered_prompt": text}
        for name in shown:
            # Base: the same PEFT model with its adapter switched off (no second copy of the weights).
            with tuned.disable_adapter() if name == "base" else nullcontext():
                row[name], row[f"{name}_tokens"] = _stream(runner if name == "program" else tuned, tokenizer, ids,
                                                           max_new_tokens, decoding, name)
            row[f"{name}_stopped"] = "max_new_tokens" if row[f"{name}_tokens"] >= max_new_tokens else "eos"
        outputs.append(row)
    if json_out is not None:
        _write_json(json_out, {"model": model_name, "adapter_dir": str(adapter_dir),
                               **({"program": str(args.program)} if runner is not None else {}),
                               "max_new_tokens": max_new_tokens,
                               "decoding": {"sample": sample, "temperature": temperature, "top_p": top_p,
                                            "seed": seed} if sample else {"sample": False},
                               "chat": {"template": template, "system": system, "from": rendering.reason}
                               if template else None,
                               "outputs": outputs})
        console.print(f"\ngenerations written to {json_out}")


def _program_runner(program: Path | None):
    """The ExecuTorch program of --program, loaded (None without it)."""
    if program is None:
        return None
    from zl_device.results.program_runner import ProgramRunner
    from zl_export.program_record import check_program

    with err_console.status(f"checking and loading {program}"):
        record = check_program(program)
        return ProgramRunner(program, None if record.data_file is None else program.parent / record.data_file)


def _stream(model, tokenizer, ids: list[int], max_new_tokens: int, decoding, name: str) -> tuple[str, int]:
    """Generate for one prompt, printing the tokens after a label as they come; returns (text, tokens). `model` is
    a PyTorch model, or a `ProgramRunner` (--program)."""
    import torch

    from zl_device.results.program_runner import ProgramRunner
    from zl_device.results.generation import generate_ids, token_printer, visible

    prefix = f"  {name:<{WIDTH}} │ "
    console.print(f"  [bold {LABELS[name]}]{name:<{WIDTH}}[/] │ ", end="", highlight=False)

    def write(text: str) -> None:
        console.out(visible(text).replace("\n", "\n" + " " * (len(prefix) - 2) + "│ "), end="", highlight=False)

    printer = token_printer(tokenizer, write)
    if isinstance(model, ProgramRunner):
        printer.put(torch.tensor([ids]))  # the prompt, which the printer skips
        new = model.generate(ids, max_new_tokens, tokenizer.eos_token_id, decoding.sample, decoding.temperature,
                             decoding.top_p, decoding.seed, on_token=lambda t: printer.put(torch.tensor([t])))
        printer.end()
    else:
        (new,) = generate_ids(model, tokenizer, [ids], max_new_tokens, decoding, printer)
    if not new:
        console.print("[dim](end of sequence at once)[/]", end="")
    elif len(new) >= max_new_tokens:
        console.print("[dim] …[/]", end="")
    console.out("")
    return tokenizer.decode(new), len(new)


def _indented(text: str, indent: str) -> str:
    return "\n".join(indent + line for line in text.split("\n"))


def adapter_source(run: Path | None, adapter: Path | None, model: str | None, force_base: bool = False,
                   run_flag: str = "--run") -> tuple[Path, str, int]:
    """(adapter directory, base model, seed of a random-weight model) from --run or --adapter and --model; the one
    way `zl generate` and `zl export-model` (whose run is RUN_DIR: `run_flag`) find a run's adapter and base.

    Raises:
        ZLError: neither or both of --run and --adapter, a missing run directory or adapter, or a --model other
            than the adapter's base without --force-base.
    """
    from zl_device.results.adapter import check_adapter_dir
    from zl_device.results.generation import choose_base
    from zl_export.options import DEFAULT_MODEL

    if (run is None) == (adapter is None):
        raise ZLError("pass either --run RUN_DIR (a `zl train` run directory) or --adapter DIR (a PEFT adapter) "
                      f"{'and not both' if run else 'to compare with the base model'}, e.g. zl generate --run runs/r1 "
                      "\"Hello\".")
    if run is not None:
        if not run.is_dir():
            example = f"{run_flag} runs/r1" if run_flag.startswith("-") else "runs/r1"
            raise ZLError(f"{run_flag} {run}: no such directory; pass the --out of a `zl train` run, e.g. {example}.")
        layout = RunLayout(run)
        adapter = layout.adapter
        if not adapter.is_dir():
            unfinished = layout.markers[0].is_file()
            raise ZLError(f"{run_flag} {run}: no adapter/ in it, "
                          + ("the run has not finished; continue it with `zl train --resume --out "
                             f"{run}` (see {layout.markers[0]})." if unfinished else
                             "so it is not a finished `zl train` run directory; merge a run's checkpoints with "
                             f"`zl merge --out {adapter}`"
                             + (" or pass --adapter DIR." if run_flag == "--run" else ".")))
    try:
        check_adapter_dir(adapter)
        name, seed, note = choose_base(adapter, model, None, DEFAULT_MODEL, force=force_base)
    except ZLError as e:
        raise ZLError(str(e).replace("--adapter", run_flag if run is not None else "--adapter", 1)) from None
    if note:
        err_console.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)
    return adapter, name, seed


def _rendering(chat: bool | None, system: str | None, run: Path | None, adapter_dir: Path,
               given: list[Prompt]) -> Rendering:
    """How prompts are rendered: --chat/--no-chat, else as the run's training data was, else verbatim.

    Raises:
        ZLError: --system without chat rendering, or a "messages" row with --no-chat.
    """
    from zl_device.results.generation import run_chat_record
    from zl_export.chat import PLAIN

    record = run_chat_record(run) if run is not None else None
    plain = bool(record and record.chat and record.template == PLAIN)
    if chat is not None:
        rendering = Rendering(chat, plain, "--chat" if chat else "--no-chat")
    elif record is not None:
        rendering = Rendering(record.chat, plain, f"as the run trained{'' if record.chat else ' on non-chat rows'}: "
                                                  f"{record.sidecar}")
    elif run is not None:
        rendering = Rendering(False, False, "the run records no training data; pass --chat if it trained on chat rows")
    else:
        rendering = Rendering(False, False,
                              "--adapter records no training data; pass --chat if it trained on chat rows")
        sibling = run_chat_record(adapter_dir.parent) if RunLayout(adapter_dir.parent).data.is_dir() else None
        if sibling is not None and sibling.chat:
            err_console.print(f"[yellow]note:[/] {escape(str(adapter_dir))} is the adapter of run "
                              f"{escape(str(adapter_dir.parent))}, which trained on chat rows; pass --chat (or --run "
                              f"{escape(str(adapter_dir.parent))}) to render prompts as it did.", highlight=False)
    if system is not None:
        if not system.strip():
            raise ZLError("--system is empty; give the system turn some text, e.g. --system \"Answer in one word.\".")
        check_text(system, "--system")
        if not rendering.chat:
            raise ZLError(f"--system: prompts go verbatim ({rendering.reason}), so there is no conversation to put a "
                          "system turn in; pass --chat to render each prompt as a user turn.")
    if chat is False:
        row = next((p for p in given if p.messages is not None), None)
        if row is not None:
            raise ZLError(f"{row.where}: a \"messages\" row is a conversation, which --no-chat cannot send "
                          "verbatim; drop --no-chat, or give the row as {\"prompt\": \"some text\"}.")
    return rendering


def _render(given: list[Prompt], rendering: Rendering, system: str | None, tokenizer) -> tuple[list[str], str | None]:
    """The text the model gets for each prompt, and the chat rendering used ("tokenizer", "plain"; None when every
    prompt went verbatim). Conversations are rendered whatever the default, as `zl data` renders a row's turns
    before its reply."""
    from zl_export.chat import render_turns

    texts, template = [], None
    for prompt in given:
        if prompt.messages is None and not rendering.chat:
            texts.append(prompt.text)
            continue
        turns = prompt.messages or [{"role": "user", "content": prompt.text}]
        if system is not None and turns[0]["role"] != "system":
            turns = [{"role": "system", "content": system}, *turns]
        text, template = render_turns(tokenizer, turns, prompt.where, rendering.plain)
        texts.append(text)
    return texts, template


def _describe(rendering: Rendering, template: str | None, system: str | None, tokenizer) -> str:
    """The header's word on rendering, e.g. "chat, plain <|user|> fallback (as the run trained:
    runs/r1/data/train.json)"."""
    if template is None:
        return f"verbatim ({rendering.reason})"
    how = f"{tokenizer.name}'s chat template" if template == "tokenizer" else "plain <|user|> fallback"
    if not rendering.chat:  # only "messages" rows were rendered
        return f"verbatim ({rendering.reason}); \"messages\" rows as chat, {how}"
    return f"chat, {how} ({rendering.reason})" + (f" · system: {system!r}" if system is not None else "")


def _shown(prompt: Prompt, text: str, rendered: bool) -> str:
    """What is printed for a prompt: the rendered text (--show-prompt), else as typed (a conversation's turns)."""
    from zl_device.results.generation import visible

    if rendered:
        return visible(text)
    if prompt.messages:
        return "\n".join(f"{m['role']}: " + visible(m["content"]) for m in prompt.messages)
    return visible(prompt.text)


def read_prompts(arguments: list[str], file: Path | None, stdin=None) -> list[Prompt]:
    """The prompts: the arguments, then those of --file (or of stdin when there are neither).

    A file (or stdin) holds one prompt per line (blank lines skipped), or JSONL with a "prompt" field or a
    "messages" conversation ending in a user turn per line: a .jsonl/.ndjson file, or lines that all start with "{"
    (`_prompt_of`: ShareGPT's "conversations" and Alpaca's "instruction" rows too); a Parquet or Arrow file, or a
    `datasets.save_to_disk` directory, holds such rows.

    Raises:
        ZLError: an empty prompt, an unreadable file, a bad JSONL line (with its number), or no prompt at all.
    """
    stdin = sys.stdin if stdin is None else stdin
    prompts = []
    for i, text in enumerate(arguments, 1):
        if not text.strip():
            raise ZLError(f"prompt argument {i} is empty; give each prompt some text, e.g. zl generate --run RUN "
                          "\"Q: What is 2+2?\\nA:\".")
        prompts.append(Prompt(text, f"prompt argument {i}"))
    if file is not None and str(file) != "-" and is_tabular(file) and file.exists():
        prompts += _read_rows(file)
    elif file is not None and str(file) != "-":
        text = _read_file(file)
        prompts += _parse(text, f"--file {file}", file.suffix.lower() in JSONL_SUFFIXES or _looks_jsonl(text))
    elif str(file) == "-" or (not arguments and not stdin.isatty()):
        text = stdin.read()
        prompts += _parse(text, "stdin", _looks_jsonl(text))
    for prompt in prompts:  # an argument of bytes that are not UTF-8, or a JSON \\ud800 escape without its pair
        check_text(prompt.text, prompt.where)
    if not prompts:
        raise ZLError("no prompts: pass them as arguments, with --file FILE (one per line, or JSONL with a "
                      "\"prompt\" field or \"messages\") or on stdin, e.g. echo \"Hello\" | zl generate --run runs/r1.")
    return prompts


def _looks_jsonl(text: str) -> bool:
    lines = [line for line in text.splitlines() if line.strip()]
    return bool(lines) and all(line.lstrip().startswith("{") for line in lines)


def _read_file(path: Path) -> str:
    if not path.is_file():
        what = "a directory" if path.is_dir() else "no such file"
        raise ZLError(f"--file {path}: {what}; pass a text file with one prompt per line, or JSONL with a "
                      "\"prompt\" field.")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ZLError(f"--file {path}: not UTF-8 text (byte {e.start}); save it as UTF-8.") from e


def _parse(text: str, where: str, jsonl: bool) -> list[Prompt]:
    prompts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if not jsonl:
            prompts.append(Prompt(line, f"{where} line {number}"))
            continue
        row = json_line(line, f"{where} line {number}")  # nesting, duplicate keys, JSON: one line each
        prompts.append(_prompt_of(row, f"{where} line {number}"))
    return prompts


def _read_rows(path: Path) -> list[Prompt]:
    """A Parquet or Arrow file, or a `datasets.save_to_disk` directory: a prompt per row, as JSONL lines are read."""
    from zl_export.records import at_row, read_records

    _, records = read_records(path)
    # A table has every column in every row: a null there is a field the row does not have
    return [_prompt_of({k: v for k, v in row.items() if v is not None}, f"--file {at_row(path, number)}")
            for number, row in records]


def _prompt_of(row: object, where: str) -> Prompt:
    """The prompt of one JSONL line or table row: its "prompt"; a "messages" conversation (or ShareGPT's
    "conversations") ending in the user turn to answer; or an Alpaca row's "instruction" (and "input") in the Alpaca
    prompt, as `zl data` renders it for training."""
    from zl_export.chat import parse_prompt_messages, sharegpt_turns

    if isinstance(row, dict) and "conversations" in row and "messages" not in row:
        messages = parse_prompt_messages(sharegpt_turns(row["conversations"], where), where)
        return Prompt(messages[-1]["content"], where, messages)
    if isinstance(row, dict) and "messages" in row:
        messages = parse_prompt_messages(row["messages"], where)
        return Prompt(messages[-1]["content"], where, messages)
    if isinstance(row, dict) and "prompt" not in row and isinstance(row.get("instruction"), str):
        from zl_export.data import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT

        given = row.get("input")
        if given is not None and not isinstance(given, str):
            raise ZLError(f"{where}: \"input\" is a JSON {json_kind(given)}; expected text (or empty, or absent).")
        template = ALPACA_PROMPT if (given or "").strip() else ALPACA_PROMPT_NO_INPUT
        return Prompt(template.format(instruction=row["instruction"], input=given or ""), where)
    prompt = row.get("prompt") if isinstance(row, dict) else None
    if not isinstance(prompt, str) or not prompt.strip():
        found = "no \"prompt\" field or \"messages\"" if not isinstance(row, dict) or "prompt" not in row else (
            "an empty \"prompt\"" if isinstance(prompt, str) else f"a \"prompt\" of type {type(prompt).__name__}")
        raise ZLError(f"{where}: {found}; expected {{\"prompt\": \"some text\"}}, {{\"messages\": [{{\"role\": "
                      "\"user\", \"content\": \"some text\"}]}, ShareGPT's \"conversations\" or Alpaca's "
                      "\"instruction\" on every line.")
    return Prompt(prompt, where)


def _check_lengths(texts: list[str], encoded: list[list[int]], max_new_tokens: int, config, model: str) -> None:
    """Every prompt has a token and fits the model's context with its new tokens."""
    limit = getattr(config, "max_position_embeddings", None)
    for i, (text, ids) in enumerate(zip(texts, encoded), 1):
        if not ids:
            raise ZLError(f"prompt {i} ({text!r}) has no tokens for {model}; give it some text.")
        if limit is not None and len(ids) + max_new_tokens > limit:
            raise ZLError(f"prompt {i}: {len(ids)} tokens + --max-new-tokens {max_new_tokens} exceed {model}'s "
                          f"context of {limit} tokens; shorten the prompt or lower --max-new-tokens.")


def _write_json(path: Path, content: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


generate_command = settings_command(GenerateArgs, run_generate, GENERATE_DOC)
COMMANDS = {"generate": generate_command}
