"""ZeroLock's eager training (zl_device.torch.eager_training, the accuracy study's and the torch runtime's
reference) against backprop on generative data: with every stage but the last held still, ZeroLock's last stage
trains on the true next-token loss over every completion token, so it must give the adapter of last-stage-only
backprop (frozen weights in float32 for both: bf16 would round them for ZeroLock only). A local loss that dropped,
shifted or re-weighted target tokens (the many-target case) would differ."""

import pytest
import torch

from conftest import write_demo_data
from generative_fixtures import prompt_completion_shard
from zl_device.torch.eager_training import (Budget, OptimizerSettings, freeze_lora_below, stage_parameters,
                                            train_backprop, train_zerolock)
from zl_export.exporter import build_stage_modules
from zl_export.lora import attach_lora
from zl_export.model_source import load_model
from zl_export.options import ExportOptions, LoraSettings, LossConfig
from zl_export.shard import fitted_target_slots
from zl_export.stages import parse_spec

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning"),
    pytest.mark.usefixtures("one_torch_thread"),
]


def lora_weights(peft_model) -> dict[str, torch.Tensor]:
    """LoRA tensors under the manifest's PEFT names (without the adapter name, as the saved adapter has them)."""
    return {n.replace(".default", ""): p.detach().clone() for n, p in peft_model.named_parameters() if "lora_" in n}


def test_with_the_upstream_stages_still_zerolock_trains_the_last_stage_as_last_stage_backprop(tmp_path):
    shard = prompt_completion_shard(tmp_path)
    assert int((shard.labels != -100).sum(1).max()) > 4  # many target tokens per row, not a label word
    split = parse_spec("0-1,2-3", 4)
    budget = Budget(samples=8, window=2, micro_batch=1)
    opt = OptimizerSettings(lr=1e-2)
    lora = LoraSettings(rank=4, alpha=8.0, targets=("q_proj", "v_proj"))

    opts = ExportOptions(seq_len=shard.input_ids.shape[1], lora=lora, loss=LossConfig(alpha=(1.0,)),
                         max_targets=fitted_target_slots(shard.labels)[1], seed=0, frozen_dtype="fp32")
    peft_model, modules = build_stage_modules(load_model("tiny-random").model, split, opts)
    # lr x0 upstream: AdamW's update and its weight decay are both scaled by the lr, so stage 0 stays as it began.
    train_zerolock(modules, shard, budget, opt, stage_lr=(0.0, 1.0))
    zerolock = stage_parameters(modules, peft_model)

    reference = attach_lora(load_model("tiny-random").model, lora, seed=0)
    freeze_lora_below(reference, split[-1].first)
    before = lora_weights(reference)
    train_backprop(reference, shard, budget, opt)
    after = lora_weights(reference)

    last = [n for n in zerolock if ".layers.2." in n or ".layers.3." in n]
    assert len(last) == 8  # 2 layers x q, v x A, B
    for name in last:
        torch.testing.assert_close(zerolock[name], after[name], rtol=1e-4, atol=1e-6, msg=name)
        assert not torch.equal(zerolock[name], before[name]) or "lora_A" in name  # B starts at 0 and moves
    for name in zerolock.keys() - set(last):
        if name in before:
            torch.testing.assert_close(zerolock[name], before[name], rtol=0, atol=0, msg=name)


def test_the_default_holds_the_upstream_stages_still_on_any_data_and_notes_what_a_given_stage_lr_risks(tmp_path):
    """--stage-lr's default is 0,..,0,1 on label words and on generative rows alike (said in a line, which on
    generative rows points at --schedule async); a --stage-lr that trains the stages before the last gets the
    study's note for its kind of data, and stands."""

    from zl_device.run.resolved_run import run_stage_lr
    from zl_device.run.resolved_run import stage_lr_note
    from zl_device.run.train_settings import TrainSettings
    from zl_export.options import ModelSplit

    prompt_completion_shard(tmp_path)
    generative = tmp_path / "pc.safetensors"
    labels = write_demo_data(tmp_path / "demo") / "train.safetensors"

    def zerolock(**kw):
        return TrainSettings(schedule="zerolock", **kw)

    for shard in (generative, labels):
        assert run_stage_lr(zerolock()) == (0.0, 0.0, 1.0)
        note = stage_lr_note(zerolock(), shard)
        assert note.startswith("--stage-lr 0,0,1 (the default)")
        assert ("--schedule async" in note and "headlines-smollm2-135m-1024-async" in note) == (shard == generative)
        assert run_stage_lr(zerolock(split=ModelSplit(num_stages=2))) == (0.0, 1.0)
        one = zerolock(split=ModelSplit(num_stages=1))
        assert run_stage_lr(one) == (1.0,) and stage_lr_note(one, shard) is None
        assert stage_lr_note(TrainSettings(schedule="async"), shard) is None  # every stage on the final gradient
        for given in ((0.0, 0.0, 1.0), (0.0, 0.5, 1.0), (1.0,)):
            note = stage_lr_note(zerolock(stage_lr=given), shard)
            assert run_stage_lr(zerolock(stage_lr=given)) == (given * 3 if len(given) == 1 else given)  # it stands
            assert (note is None) == (given == (0.0, 0.0, 1.0))
            if note is not None:
                assert "--stage-lr 0,0,1" in note
                assert ("headlines-smollm2-135m-1024-local-losses" in note) == (shard == generative)
                assert ("agnews-gemma3-270m-1024" in note) == (shard == labels)


def test_a_forward_only_stage_step_hands_on_the_same_hidden_state_and_only_counts_its_windows(tmp_path):
    """The torch runtime's stage held still (StageStep(forward_only=True)): phase 1 without autograd gives the hidden
    state of a whole step bit for bit; its windows leave the weights and AdamW moments alone and advance the
    schedule as a stepping stage's would."""
    from zl_device.torch.eager_training import StageStep, micro_batch

    shard = prompt_completion_shard(tmp_path)
    opts = ExportOptions(seq_len=shard.input_ids.shape[1], loss=LossConfig(alpha=(1.0,)),
                         max_targets=fitted_target_slots(shard.labels)[1], seed=0, frozen_dtype="fp32")
    split = parse_spec("0-1,2-3", 4)
    _, (whole_module, _) = build_stage_modules(load_model("tiny-random").model, split, opts)
    _, (held_module, _) = build_stage_modules(load_model("tiny-random").model, split, opts)
    opt = OptimizerSettings(lr=1e-2, warmup_windows=1)
    whole = StageStep(whole_module, 0.0, opt, num_windows=3)
    held = StageStep(held_module, 0.0, opt, num_windows=3, forward_only=True)
    before = [p.detach().clone() for p in held.params]
    for w in range(3):
        whole.start_window()
        held.start_window()
        for mb in (2 * w, 2 * w + 1):
            x, mask, labels = micro_batch(shard, mb, 1)
            h = held.begin(x, mask)
            assert not h.requires_grad
            assert torch.equal(h, whole.begin(x, mask))
            whole.finish(labels)
        (whole_lr, whole_means), (held_lr, held_means) = whole.end_window(), held.end_window()
        assert whole_lr == held_lr == 0.0 and None not in whole_means and held_means == [None, None, None]
        assert held.optimizer_step == whole.optimizer_step == w + 1
    assert all(torch.equal(p, b) for p, b in zip(held.params, before))
    assert not held.optimizer.state, "a forward-only stage made AdamW state"
    assert all(p.grad is None for p in held.params)
    with pytest.raises(RuntimeError, match="forward-only"):
        held.finish(labels)
    with pytest.raises(ValueError, match="lr 0"):
        StageStep(held_module, 1e-3, opt, num_windows=3, forward_only=True)
