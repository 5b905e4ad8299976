"""zl_study/backprop_baseline.py (`tools/train_backprop_baseline.py`): the single-process backprop baseline of
issue 4, on tiny-random.

The schedule must be the runner's (zl/lr_schedule.h, and the runner itself
through `zl_adamw_check` when it is built), training must lower the loss on a
trivially learnable shard, and `--run-dir` must pick up a `zl train` run's
data, budget, optimizer and LoRA settings.

    .venv/bin/python -m pytest tests/test_backprop_baseline.py
"""

import json
import math
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import REPO
from zl_base.errors import ZLError
from zl_export.shard import write_shard
from zl_study import backprop_baseline as bpb

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def learnable_shard(tmp_path_factory) -> Path:
    """4 rows of 16 byte tokens: a random prompt, then always the completion "x" + EOS. Trivially learnable."""
    gen = torch.Generator().manual_seed(0)
    rows, seq_len, prompt = 4, 16, 10
    ids = torch.full((rows, seq_len), 257, dtype=torch.int64)  # ByteTokenizer: 256 EOS, 257 padding
    ids[:, :prompt] = torch.randint(97, 123, (rows, prompt), generator=gen)
    ids[:, prompt], ids[:, prompt + 1] = ord("x"), 256
    mask = (ids != 257).to(torch.int64)
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    labels[:, :prompt] = -100
    path = tmp_path_factory.mktemp("learnable") / "train.safetensors"
    write_shard(path, {"input_ids": ids, "attention_mask": mask, "labels": labels},
                {"tokenizer": {"name": "bytes", "model": "tiny-random", "eos_token_id": 256, "pad_token_id": 257},
                 "format": "prompt_completion"})
    return path


# ---------------------------------------------------------------- schedule


def test_schedule_is_the_runner_formula():
    """warmup_cosine W=2, T=6, r=0.1 (zl/lr_schedule.h): 1/2, 1, then cosine to 0.1 at t=6, flat after."""
    s = bpb.Schedule("warmup_cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    cosine = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p / 4)) for p in range(5)]
    assert [s.factor(t) for t in range(8)] == pytest.approx([0.5, 1.0, *cosine, 0.1], rel=1e-15)
    assert cosine[0] == 1.0 and cosine[-1] == pytest.approx(0.1)
    assert bpb.Schedule("constant").factor(5) == 1.0


def test_lambda_lr_steps_like_zl_train():
    """13 samples, window 2 -> 7 windows; zl train's schedule: W = 2, T = 0 -> 7, floor 0.1; one LambdaLR step per window."""
    s = bpb.BaselineSettings(samples=13, window=2, lr=1e-2, schedule=bpb.default_schedule(13, 2))
    assert (s.num_micro_batches, s.num_windows) == (13, 7)
    sched = s.resolved_schedule()
    assert (sched.warmup_steps, sched.total_steps, sched.min_lr_ratio) == (2, 7, 0.1)
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer, scheduler = bpb.make_optimizer([param], s)
    lrs = []
    for _ in range(s.num_windows):
        lrs.append(optimizer.param_groups[0]["lr"])
        param.grad = torch.ones(3)
        optimizer.step()
        scheduler.step()
    want = [1e-2 * f for f in (0.5, 1.0)] + [1e-2 * (0.1 + 0.45 * (1 + math.cos(math.pi * p / 5))) for p in range(5)]
    assert lrs == pytest.approx(want, rel=1e-12)
    # One window: zl train's warm-up is min(2, windows - 1) = 0 steps, so the single step is at the full lr.
    assert bpb.default_schedule(4, 8).warmup_steps == 0


def test_lrs_equal_the_runners(tmp_path):
    """The runner's own AdamW (`zl_adamw_check`) reports the lr of each step: the baseline's LambdaLR gives the same."""
    binary = REPO / "build" / "android_app" / "native" / "zl_adamw_check"
    if not binary.is_file():
        pytest.skip(f"{binary} not built; run `cmake --build build -j2 --target zl_adamw_check`")
    n, m = 11, 2
    optimizer = {"lr": 3e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
                 "schedule": {"kind": "warmup_cosine", "warmup_steps": 2, "min_lr_ratio": 0.1}}
    save_file({"p": torch.zeros(3)}, str(tmp_path / "params.safetensors"))
    save_file({f"p@{k}": torch.ones(3) for k in range(n)}, str(tmp_path / "grads.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"num_micro_batches": n, "window_size": m, "optimizer": optimizer}))
    proc = subprocess.run([str(binary), "--params", str(tmp_path / "params.safetensors"), "--grads",
                           str(tmp_path / "grads.safetensors"), "--config", str(tmp_path / "config.json"),
                           "--out", str(tmp_path / "out.safetensors")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    runner_lrs = load_file(str(tmp_path / "out.safetensors"))["__lr__"].tolist()

    s = bpb.BaselineSettings(samples=n, window=m, lr=3e-3, schedule=bpb.Schedule("warmup_cosine", 2, 0, 0.1))
    param = torch.nn.Parameter(torch.zeros(3))
    opt, scheduler = bpb.make_optimizer([param], s)
    ours = []
    for _ in range(s.num_windows):
        ours.append(opt.param_groups[0]["lr"])
        param.grad = torch.ones(3)
        opt.step()
        scheduler.step()
    assert len(runner_lrs) == 6
    assert ours == pytest.approx(runner_lrs, rel=1e-12)


def test_micro_batches_wrap_like_the_runner():
    """data_shard.cpp DataShard::micro_batch: j = mb mod floor(N/B); a partial last group of rows is never used."""
    assert [bpb.micro_batch_rows(mb, 5, 2) for mb in range(5)] == [slice(0, 2), slice(2, 4), slice(0, 2), slice(2, 4),
                                                                   slice(0, 2)]
    assert bpb.micro_batch_rows(7, 4, 1) == slice(3, 4)


# ---------------------------------------------------------------- training


def test_loss_decreases_and_the_report_has_all_rows(learnable_shard, tmp_path):
    """12 windows of 2 micro-batches (wrapping over 4 rows): the window loss falls and the dev NLL beats the base.

    tiny-random's head is small and random (init std 0.02), so even a constant completion only gets from
    ln(320) = 5.8 to about 5 nats; the test asks for a drop of 0.5.
    """
    zl_eval = tmp_path / "eval.json"
    zl_eval.write_text(json.dumps({"rows": 2, "base": {"nll": 9.9, "accuracy": None},
                                   "adapter": {"rows": 2, "label_tokens": 4, "accuracy": None, "nll": 1.5, "seconds": 0.1}}))
    out = tmp_path / "baseline.json"
    report = bpb.run(["--model", "tiny-random", "--train", str(learnable_shard), "--dev", str(learnable_shard),
                      "--samples", "24", "--window", "2", "--lr", "3e-2", "--threads", "1",
                      "--zl-eval", str(zl_eval), "--json-out", str(out)])
    losses = report["training"]["window_losses"]
    assert len(losses) == 12
    assert losses[-1] < losses[0] - 0.5, f"window losses {losses}"
    assert report["backprop"]["nll"] < report["base"]["nll"] - 0.5
    # Window 0 (rows 0 and 1, LoRA B still 0) is the base model's loss; the dev rows are the same two rows,
    # so the training loss and zl eval's NLL use the same targets and mean.
    assert report["dev"]["rows"] == 2  # as many rows as the ZeroLock eval scored
    assert losses[0] == pytest.approx(report["base"]["nll"], rel=1e-5)
    lrs = report["training"]["window_lrs"]
    sched = bpb.Schedule("warmup_cosine", 2, 12, 0.1)
    assert lrs == pytest.approx([3e-2 * sched.factor(t) for t in range(12)], rel=1e-12)
    assert report["zerolock"]["nll"] == 1.5
    assert json.loads(out.read_text())["settings"]["schedule"] == {"kind": "warmup_cosine", "warmup_steps": 2,
                                                                    "total_steps": 12, "min_lr_ratio": 0.1}


def test_a_window_steps_on_the_mean_gradient_of_its_micro_batches(learnable_shard):
    """One window of 2 micro-batches (rows 0, 1): the gradient AdamW saw is (g0 + g1) / 2 at the initial LoRA weights."""
    from zl_export.lora import attach_lora
    from zl_export.model_source import load_model
    from zl_export.shard import load_shard

    shard = load_shard(learnable_shard)
    s = bpb.BaselineSettings(model="tiny-random", samples=2, window=2, lr=1e-2, schedule=bpb.Schedule("constant"))
    trained = attach_lora(load_model("tiny-random").model, s.lora)
    bpb.train_backprop(trained, shard, s)  # .grad keeps the last window's accumulated gradient

    reference = attach_lora(load_model("tiny-random").model, s.lora)  # same seed: same initial weights
    for row in (0, 1):
        bpb.causal_lm_loss(reference, shard.input_ids[row:row + 1], shard.attention_mask[row:row + 1],
                           shard.labels[row:row + 1]).backward()
    grads = {n: p.grad for n, p in trained.named_parameters() if p.requires_grad}
    summed = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    assert grads.keys() == summed.keys() and len(grads) == 56  # 4 layers x 7 projections (the default) x A,B
    assert any(g.abs().max() > 0 for g in grads.values())
    for name, g in grads.items():
        torch.testing.assert_close(g, summed[name] / 2, rtol=1e-5, atol=1e-8, msg=name)


# ---------------------------------------------------------------- --run-dir and errors


def _fake_run_dir(root: Path, demo_data: Path, seq_len: int = 64) -> Path:
    """What `zl train` leaves behind that the baseline reads: stage_0.json, manifest.json, data/."""
    run = root / "run"
    (run / "data").mkdir(parents=True)
    for name in ("train", "dev"):
        for ext in (".safetensors", ".json"):
            shutil.copyfile(demo_data / f"{name}{ext}", run / "data" / f"{name}{ext}")
    (run / "stage_0.json").write_text(json.dumps({
        "stage_index": 0, "window_size": 4, "num_micro_batches": 10, "threads": 1,
        "optimizer": {"lr": 3e-3, "weight_decay": 0.0, "betas": [0.8, 0.99],
                      "schedule": {"kind": "warmup_cosine", "warmup_steps": 1, "min_lr_ratio": 0.2}},
        "data_shard": "/elsewhere/train.safetensors"}))
    (run / "manifest.json").write_text(json.dumps({
        "format_version": 1, "model": {"name": "tiny-random", "num_layers": 4}, "tokenizer": "bytes",
        "seq_len": seq_len, "micro_batch": 2, "seed": 3,
        "lora": {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "k_proj"], "dropout": 0.0}, "stages": []}))
    return run


def test_run_dir_gives_data_budget_optimizer_and_lora(demo_data, tmp_path):
    run = _fake_run_dir(tmp_path, demo_data)
    s = bpb.settings_from_run_dir(run)
    assert (s.model, s.seed, s.samples, s.window, s.micro_batch, s.seq_len) == ("tiny-random", 3, 20, 4, 2, 64)
    assert (s.num_micro_batches, s.num_windows) == (10, 3)
    assert (s.lr, s.betas, s.eps, s.weight_decay) == (3e-3, (0.8, 0.99), 1e-8, 0.0)
    assert s.resolved_schedule() == bpb.Schedule("warmup_cosine", 1, 3, 0.2)  # T = number of windows
    assert (s.lora.rank, s.lora.alpha, s.lora.targets) == (4, 8.0, ("q_proj", "k_proj"))
    assert s.train == run / "data" / "train.safetensors" and s.dev == run / "data" / "dev.safetensors"

    # Options on the command line override the run directory; the rest stays.
    s = bpb.build_settings(bpb.parse_args(["--run-dir", str(run), "--threads", "1", "--samples", "40"]))
    assert (s.threads, s.samples, s.window, s.lr, s.resolved_schedule().total_steps) == (1, 40, 4, 3e-3, 5)


def test_user_mistakes_are_one_zlerror(demo_data, tmp_path):
    with pytest.raises(ZLError, match="stage_0.json: no such file"):
        bpb.settings_from_run_dir(demo_data)
    with pytest.raises(ZLError, match="no such directory"):
        bpb.settings_from_run_dir(tmp_path / "missing")
    with pytest.raises(ZLError, match="no training data"):
        bpb.build_settings(bpb.parse_args(["--model", "tiny-random"]))
    with pytest.raises(ZLError, match="--window 0"):
        bpb.build_settings(bpb.parse_args(["--train", "x.safetensors", "--window", "0"]))

    from zl_export.tokenizer import ByteTokenizer

    s = bpb.BaselineSettings(model="tiny-random", train=tmp_path / "nope.safetensors")
    with pytest.raises(ZLError, match="nope.safetensors: no such file"):
        bpb.load_shards(s, ByteTokenizer(), 320)
    s = bpb.settings_from_run_dir(_fake_run_dir(tmp_path, demo_data, seq_len=32))
    with pytest.raises(ZLError, match="seq_len 64, the program expects 32"):
        bpb.load_shards(s, ByteTokenizer(), 320)
    s.seq_len = None
    with pytest.raises(ZLError, match="tokenized for 'bytes'"):
        bpb.load_shards(s, SimpleNamespace(name="smollm2-135m", bos_token_id=None), 49152)
    with pytest.raises(ZLError, match="its rows start with no beginning-of-sequence token"):  # made before zl added BOS
        bpb.load_shards(s, SimpleNamespace(name="bytes", bos_token_id=1), 320)
