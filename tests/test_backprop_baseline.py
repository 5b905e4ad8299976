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
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import REPO
from manifest_fixtures import fake_manifest
from zl_base.errors import ZLError
from zl_base.settings import to_json
from zl_device.formats.lr_schedule import OptimizerSettings, lr_factor
from zl_device.formats.run_layout import RunLayout
from zl_device.run.train_settings import TrainSettings
from zl_device.torch.eager_training import causal_lm_loss, micro_batch_rows, runner_optimizer
from zl_export.manifest import write_manifest
from zl_export.options import LoraSettings
from zl_export.shard import write_shard
from zl_study import backprop_baseline as bpb

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")]


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
    s = OptimizerSettings(schedule_kind="warmup_cosine", warmup_windows=2, total_steps=6, min_lr_ratio=0.1).schedule
    cosine = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p / 4)) for p in range(5)]
    assert [lr_factor(t, s, 100) for t in range(8)] == pytest.approx([0.5, 1.0, *cosine, 0.1], rel=1e-15)
    assert cosine[0] == 1.0 and cosine[-1] == pytest.approx(0.1)
    assert lr_factor(5, OptimizerSettings(schedule_kind="constant").schedule, 6) == 1.0


def test_lambda_lr_steps_like_zl_train():
    """13 samples, window 2 -> 7 windows; zl train's schedule: W = 2, T = 0 -> 7, floor 0.1; one LambdaLR step per window."""
    s = bpb.build_settings(bpb.parse_args(["--train", "x.safetensors", "--samples", "13", "--window", "2",
                                           "--lr", "1e-2"]))
    assert (s.num_micro_batches, s.num_windows) == (13, 7)
    sched = s.schedule()
    assert (sched["warmup_steps"], sched["total_steps"], sched["min_lr_ratio"]) == (2, 7, 0.1)
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer, scheduler = runner_optimizer([{"params": [param], "lr": s.optimizer.lr}], s.optimizer, s.num_windows)
    lrs = []
    for _ in range(s.num_windows):
        lrs.append(optimizer.param_groups[0]["lr"])
        param.grad = torch.ones(3)
        optimizer.step()
        scheduler.step()
    want = [1e-2 * f for f in (0.5, 1.0)] + [1e-2 * (0.1 + 0.45 * (1 + math.cos(math.pi * p / 5))) for p in range(5)]
    assert lrs == pytest.approx(want, rel=1e-12)
    # One window: zl train's warm-up is min(2, windows - 1) = 0 steps, so the single step is at the full lr.
    one = bpb.build_settings(bpb.parse_args(["--train", "x.safetensors", "--samples", "4", "--window", "8"]))
    assert one.schedule()["warmup_steps"] == 0


def test_lrs_equal_the_runners(tmp_path):
    """The runner's own AdamW (`zl_adamw_check`) reports the lr of each step: the baseline's LambdaLR gives the same."""
    binary = REPO / "build" / "runner" / "zl_adamw_check"
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

    s = bpb.BaselineSettings(samples=n, window=m, optimizer=OptimizerSettings.from_config(optimizer))
    param = torch.nn.Parameter(torch.zeros(3))
    opt, scheduler = runner_optimizer([{"params": [param], "lr": s.optimizer.lr}], s.optimizer, s.num_windows)
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
    assert [micro_batch_rows(mb, 5, 2) for mb in range(5)] == [slice(0, 2), slice(2, 4), slice(0, 2), slice(2, 4),
                                                               slice(0, 2)]
    assert micro_batch_rows(7, 4, 1) == slice(3, 4)


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
    sched = {"kind": "warmup_cosine", "warmup_steps": 2, "min_lr_ratio": 0.1}
    assert lrs == pytest.approx([3e-2 * lr_factor(t, sched, 12) for t in range(12)], rel=1e-12)
    assert report["zerolock"]["nll"] == 1.5
    assert json.loads(out.read_text())["settings"]["schedule"] == {"kind": "warmup_cosine", "warmup_steps": 2,
                                                                    "total_steps": 12, "min_lr_ratio": 0.1}


def test_a_window_steps_on_the_mean_gradient_of_its_micro_batches(learnable_shard):
    """One window of 2 micro-batches (rows 0, 1): the gradient AdamW saw is (g0 + g1) / 2 at the initial LoRA weights."""
    from zl_export.lora import attach_lora
    from zl_export.model_source import load_model
    from zl_export.shard import load_shard

    shard = load_shard(learnable_shard)
    s = bpb.BaselineSettings(model="tiny-random", samples=2, window=2,
                             optimizer=OptimizerSettings(lr=1e-2, schedule_kind="constant"))
    trained = attach_lora(load_model("tiny-random").model, s.lora)
    bpb.train_backprop(trained, shard, s)  # .grad keeps the last window's accumulated gradient

    reference = attach_lora(load_model("tiny-random").model, s.lora)  # same seed: same initial weights
    for row in (0, 1):
        causal_lm_loss(reference, shard.input_ids[row:row + 1], shard.attention_mask[row:row + 1],
                           shard.labels[row:row + 1]).backward()
    grads = {n: p.grad for n, p in trained.named_parameters() if p.requires_grad}
    summed = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    assert grads.keys() == summed.keys() and len(grads) == 56  # 4 layers x 7 projections (the default) x A,B
    assert any(g.abs().max() > 0 for g in grads.values())
    for name, g in grads.items():
        torch.testing.assert_close(g, summed[name] / 2, rtol=1e-5, atol=1e-8, msg=name)


# ---------------------------------------------------------------- --run-dir and errors


def _fake_run_dir(root: Path, demo_data: Path, seq_len: int = 64, stage_lr: tuple[float, ...] = (1.0,),
                  settings: bool = False, name: str = "run") -> Path:
    """What `zl train --lr 3e-3 --stage-lr STAGE_LR` leaves behind that the baseline reads: stage_<k>.json (lr 3e-3
    times stage k's multiplier), manifest.json, data/, and with `settings` train_settings.json (as open_run writes
    it)."""
    run = root / name
    (run / "data").mkdir(parents=True)
    for split in ("train", "dev"):
        for ext in (".safetensors", ".json"):
            shutil.copyfile(demo_data / f"{split}{ext}", run / "data" / f"{split}{ext}")
    for k, multiplier in enumerate(stage_lr):
        (run / f"stage_{k}.json").write_text(json.dumps({
            "program": f"stage_{k}.pte", "stage_index": k, "num_stages": len(stage_lr), "run_key_file": "run.key",
            "run_id": "ab" * 16, "checkpoint_dir": "checkpoints", "window_size": 4, "num_micro_batches": 10,
            "threads": 1,
            "optimizer": {"lr": 3e-3 * multiplier, "weight_decay": 0.0, "betas": [0.8, 0.99],
                          "schedule": {"kind": "warmup_cosine", "warmup_steps": 1, "min_lr_ratio": 0.2}},
            "data_shard": "/elsewhere/train.safetensors"}))
    if settings:
        saved = TrainSettings(optimizer=OptimizerSettings(lr=3e-3), stage_lr=stage_lr, out=run)
        RunLayout(run).settings.write_text(json.dumps(to_json(saved), indent=2) + "\n")
    manifest = fake_manifest([(0, 1), (2, 3)], seq_len=seq_len, micro_batch=2)
    write_manifest(replace(manifest, options=replace(manifest.options, seed=3,
                                                     lora=LoraSettings(4, 8.0, ("q_proj", "k_proj")))), run)
    return run


def test_run_dir_gives_data_budget_optimizer_and_lora(demo_data, tmp_path):
    run = _fake_run_dir(tmp_path, demo_data)
    s = bpb.settings_from_run_dir(run)
    assert (s.model, s.seed, s.samples, s.window, s.micro_batch, s.seq_len) == ("tiny-random", 3, 20, 4, 2, 64)
    assert (s.num_micro_batches, s.num_windows) == (10, 3)
    assert (s.optimizer.lr, s.optimizer.betas, s.optimizer.eps, s.optimizer.weight_decay) == (3e-3, (0.8, 0.99), 1e-8,
                                                                                              0.0)
    assert s.schedule() == {"kind": "warmup_cosine", "warmup_steps": 1, "total_steps": 3,  # T = number of windows
                            "min_lr_ratio": 0.2}
    assert (s.lora.rank, s.lora.alpha, s.lora.targets) == (4, 8.0, ("q_proj", "k_proj"))
    assert s.train == run / "data" / "train.safetensors" and s.dev == run / "data" / "dev.safetensors"

    # Options on the command line override the run directory; the rest stays.
    s = bpb.build_settings(bpb.parse_args(["--run-dir", str(run), "--threads", "1", "--samples", "40"]))
    assert (s.threads, s.samples, s.window, s.optimizer.lr, s.schedule()["total_steps"]) == (1, 40, 4, 3e-3, 5)


@pytest.mark.parametrize("stage_lr, settings", [((0.0, 0.0, 1.0), True), ((0.0, 0.0, 1.0), False),
                                                ((0.5, 0.5, 2.0), True)])
def test_run_dir_trains_at_the_runs_lr_not_stage_0s(demo_data, tmp_path, stage_lr, settings):
    """`zl train`'s default --stage-lr holds stage 0 still, so stage_0.json's lr is 0: the baseline takes the run's
    --lr from train_settings.json (a run without it: the first trained stage's lr), never a stage's multiplied one."""
    run = _fake_run_dir(tmp_path, demo_data, stage_lr=stage_lr, settings=settings)
    s = bpb.build_settings(bpb.parse_args(["--run-dir", str(run)]))
    assert s.optimizer.lr == pytest.approx(3e-3, rel=1e-15)
    assert s.optimizer.betas == (0.8, 0.99) and s.schedule()["warmup_steps"] == 1  # the rest: stage 0's config


def test_user_mistakes_are_one_zlerror(demo_data, tmp_path):
    with pytest.raises(ZLError, match="stage_0.json: no such file"):
        bpb.settings_from_run_dir(demo_data)
    with pytest.raises(ZLError, match="no such directory"):
        bpb.settings_from_run_dir(tmp_path / "missing")
    with pytest.raises(ZLError, match="no training data"):
        bpb.build_settings(bpb.parse_args(["--model", "tiny-random"]))
    with pytest.raises(ZLError, match="--window 0"):
        bpb.build_settings(bpb.parse_args(["--train", "x.safetensors", "--window", "0"]))
    held = _fake_run_dir(tmp_path, demo_data, stage_lr=(0.0, 0.0), name="held")  # no stage trains, no settings
    with pytest.raises(ZLError, match=r"no train_settings.json and no stage config with a positive lr .*pass"):
        bpb.settings_from_run_dir(held)
    RunLayout(held).settings.write_text(json.dumps({"optimizer": {}}))
    with pytest.raises(ZLError, match="train_settings.json holds no optimizer lr .*Pass the run's --lr"):
        bpb.settings_from_run_dir(held)
    assert bpb.build_settings(bpb.parse_args(["--run-dir", str(held), "--lr", "1e-3"])).optimizer.lr == 1e-3

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
