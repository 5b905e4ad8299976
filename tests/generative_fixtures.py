"""Helpers of the generative tests (test_eval_generative.py, test_generate.py): a prompt/completion shard for
tiny-random, a LoRA adapter trained here, with PEFT and backprop, to reproduce its completions, and a run directory
trained so on chat rows."""

import json
from pathlib import Path

import torch

# Short completions the tiny model can learn in a few hundred steps; prompts long enough to be told apart.
ROWS = [
    {"prompt": "Q: colour of the sky?\nA:", "completion": " blue"},
    {"prompt": "Q: fruit that is red?\nA:", "completion": " apple"},
    {"prompt": "Q: two plus two?\nA:", "completion": " 4"},
    {"prompt": "Q: opposite of hot?\nA:", "completion": " cold"},
]
# Chat rows: one-word replies to short questions, one with a system turn (tiny-random renders them with the plain
# fallback, having no chat template).
CHAT_ROWS = [
    {"messages": [{"role": "user", "content": "colour of the sky?"}, {"role": "assistant", "content": "blue"}]},
    {"messages": [{"role": "user", "content": "fruit that is red?"}, {"role": "assistant", "content": "apple"}]},
    {"messages": [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "two plus two?"},
                  {"role": "assistant", "content": "four"}]},
]
ALL_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_rows(path: Path, rows: list[dict] = ROWS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prompt_completion_shard(directory: Path, rows: list[dict] = ROWS, seq_len: int = 48):
    """`zl data`'s shard of `rows` for tiny-random (byte tokens); returns the loaded Shard."""
    from zl_export import data as zdata
    from zl_export.shard import load_shard
    from zl_export.tokenizer import ByteTokenizer

    task = zdata.load_task(write_rows(directory / "pc.jsonl", rows))
    tokenized, task = zdata.tokenize(task, ByteTokenizer(), seq_len)
    zdata.save(directory / "pc.safetensors", tokenized, task, ByteTokenizer(), "tiny-random", {"path": "pc.jsonl"})
    return load_shard(directory / "pc.safetensors")


def chat_run(run: Path, rows: list[dict] = CHAT_ROWS, seq_len: int = 80) -> Path:
    """A finished `zl train` run on chat `rows` as far as `zl generate` looks: RUN/data/train.safetensors and its
    sidecar, written as `zl train --data chat.jsonl` writes them (row order kept), and RUN/adapter memorizing the
    replies."""
    from zl_export.shard import load_shard
    from zl_export.shard_jobs import file_job, write_shard
    from zl_export.tokenizer import ByteTokenizer

    run.mkdir(parents=True, exist_ok=True)
    job = file_job(write_rows(run / "chat.jsonl", rows), "auto", "train")
    path, _ = write_shard(job, ByteTokenizer(), "tiny-random", seq_len, run / "data")
    memorized_adapter(run / "adapter", load_shard(path))
    return run


def memorized_adapter(out: Path, shard, steps: int = 1000, seed: int = 0) -> Path:
    """Train LoRA (rank 8, every projection) on `shard` until greedy decoding reproduces its completions; save it
    as PEFT does (adapter_config.json, adapter_model.safetensors) in `out`. It stops as soon as they are reproduced;
    how many steps that takes depends on the host's floating point (300 were too few for the chat rows on one host)."""
    from safetensors.torch import save_file

    from zl_device.results.generation import generate_ids, split_row
    from zl_export.lora import adapter_config, attach_lora, peft_names
    from zl_export.model_source import load_model
    from zl_export.options import LoraSettings

    loaded = load_model("tiny-random", seed=seed)
    settings = LoraSettings(8, 16.0, ALL_LINEARS)
    model = attach_lora(loaded.model, settings, seed=seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-2)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for step in range(steps):
            model.train()
            loss = model(input_ids=shard.input_ids, attention_mask=shard.attention_mask, labels=shard.labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 25 == 24:
                split = [split_row(shard, r) for r in range(shard.rows)]
                new = generate_ids(model, loaded.tokenizer, [p for p, _ in split], 8)
                if all(n == c for n, (_, c) in zip(new, split)):
                    break
    names = peft_names(model)
    out.mkdir(parents=True, exist_ok=True)
    save_file({names[id(p)]: p.detach().contiguous() for p in params}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(adapter_config(settings, "tiny-random")))
    return out


def random_run(run: Path, model: str = "tiny-random", seed: int = 0) -> Path:
    """A finished run as far as `zl export-model` looks (test_export_model.py, tools/check_llm_runner.py):
    RUN/adapter, a rank-4 LoRA on every projection whose B is random (PEFT starts it at zero, which would make
    merging a no-op)."""
    from safetensors.torch import save_file

    from zl_export.lora import adapter_config, attach_lora, peft_names
    from zl_export.model_source import load_model
    from zl_export.options import LoraSettings

    loaded = load_model(model, seed=0)
    settings = LoraSettings(4, 8.0, loaded.family.default_lora_targets)
    peft_model = attach_lora(loaded.model, settings, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    names = peft_names(peft_model)
    for p in peft_model.parameters():
        if p.requires_grad:
            tensors[names[id(p)]] = (torch.randn(p.shape, generator=generator) * 0.05).contiguous()
    (run / "adapter").mkdir(parents=True)
    save_file(tensors, str(run / "adapter" / "adapter_model.safetensors"))
    (run / "adapter" / "adapter_config.json").write_text(json.dumps(adapter_config(settings, model)))
    return run
