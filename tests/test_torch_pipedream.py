"""PipeDream (zl_device/torch/schedules/backprop_ranks.py, the schedule table's async row): asynchronous 1F1B with
weight stashing on three gloo ranks.

- one window: no stage steps before every backward is done, so the gradient is
  single-process backprop's (rtol 1e-5);
- three windows of 2 micro-batches: stages step at different times; the
  trained weights and losses equal a single-process simulation of the same
  schedule written here (each stage's F/B order, stashed weights at the
  backward by recomputing the forward on them) — and differ from the same
  simulation with the current weights at the backward (no stashing).
Slow: the ranks are spawned processes.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from test_torch_pipeline import BATCH, STAGES, build, load_all, spawn_stages

ONE_WINDOW = (4, 4)  # (micro-batches, window): 4 micro-batches, no step before the last backward
ASYNC = (6, 2)  # 3 windows of 2: with K = 3, stage 0 runs forwards of window w+1 before window w's step


@pytest.fixture(scope="module")
def pipedream(tmp_path_factory):
    return spawn_stages([("one", "async", *ONE_WINDOW), ("async", "async", *ASYNC)],
                        tmp_path_factory.mktemp("pipedream"))


def simulate(shard, num_micro_batches: int, window: int, stash: bool):
    """Single process, the same schedule: stage k runs K-1-k forwards, then one forward / one backward, and takes
    its AdamW step after the backward of its window's last micro-batch. A forward runs on the stage's weights of
    that moment, which it records; the backward recomputes the forward on the recorded weights (`stash`) or on
    the current ones. Returns (trained LoRA weights by manifest name, last stage's mean loss per window)."""
    from zl_device.torch.eager_training import OptimizerSettings, runner_optimizer
    from zl_device.torch.backprop import window_rows
    from zl_export.local_loss import shift_targets

    _, modules, names = build()
    K, N = len(STAGES), num_micro_batches
    windows = -(-N // window)
    lora = [[p for n, p in m.named_parameters() if p.requires_grad and "lora_" in n] for m in modules]
    opts = [runner_optimizer([{"params": ps, "lr": 5e-3}], OptimizerSettings(), windows)[0:2] for ps in lora]
    order = []
    for k in range(K):
        warm = K - 1 - k
        steady = [op for i in range(warm, N) for op in (("F", i), ("B", i - warm))]
        order.append([("F", i) for i in range(warm)] + steady + [("B", i) for i in range(N - warm, N)])

    def forward(k, x, mask, labels, weights):
        with torch.no_grad():
            for p, w in zip(lora[k], weights):
                p.copy_(w)
        h = modules[k].chunk(x, mask)[1]  # (B, S, D)
        if k < K - 1:
            return h
        targets, valid = shift_targets(labels)
        rows, cols = valid.bool().nonzero(as_tuple=True)
        logits = modules[k].lm_head(modules[k].norm(h)[rows, cols])  # (targets, V)
        return torch.nn.functional.cross_entropy(logits, targets[rows, cols])

    acts, grads, seen, losses, done = {}, {}, {}, [[] for _ in range(windows)], [0] * K
    while any(done[k] < len(order[k]) for k in range(K)):
        for k in range(K):
            if done[k] == len(order[k]):
                continue
            op, mb = order[k][done[k]]
            ids, mask, labels = window_rows(shard, range(mb, mb + 1), BATCH)
            if op == "F" and (k == 0 or (k - 1, mb) in acts):
                x = ids if k == 0 else acts[(k - 1, mb)]
                seen[(k, mb)] = (x, [p.detach().clone() for p in lora[k]])
                with torch.no_grad():
                    out = forward(k, x, mask, labels, seen[(k, mb)][1])
                if k == K - 1:
                    losses[mb // window].append(float(out))
                else:
                    acts[(k, mb)] = out
            elif op == "B" and (k == K - 1 or (k + 1, mb) in grads):
                x, weights = seen.pop((k, mb))
                current = [p.detach().clone() for p in lora[k]]
                x = x.clone().requires_grad_(k > 0)
                out = forward(k, x, mask, labels, weights if stash else current)
                out.backward(None if k == K - 1 else grads.pop((k + 1, mb)))
                with torch.no_grad():
                    for p, c in zip(lora[k], current):
                        p.copy_(c)  # back to the stage's current weights
                if k > 0:
                    grads[(k, mb)] = x.grad
                if mb == min(N, (mb // window + 1) * window) - 1:
                    for p in lora[k]:
                        p.grad /= mb % window + 1
                    opts[k][0].step()
                    opts[k][1].step()
                    for p in lora[k]:
                        p.grad = None
            else:
                continue  # waiting for a neighbour
            done[k] += 1
    trained = {names[id(p)]: p.detach().clone() for ps in lora for p in ps}
    return trained, [sum(w) / len(w) for w in losses]


@pytest.mark.slow
def test_pipedream_one_window_gradient_equals_single_process_backprop(pipedream, one_torch_thread):
    from zl_device.torch.eager_training import causal_lm_loss, micro_batch
    from zl_export.shard import load_shard

    out, shard_path = pipedream
    shard = load_shard(shard_path)
    peft_model, _, names = build()
    peft_model.train()
    n, _ = ONE_WINDOW
    for mb in range(n):
        causal_lm_loss(peft_model, *micro_batch(shard, mb, BATCH)).backward()
    want = {names[id(p)]: p.grad / n for p in peft_model.parameters() if p.requires_grad}
    got = load_all(out, "one", "grad")
    assert got.keys() == want.keys()
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-8, msg=lambda m: f"{name}: {m}")
    assert sum(float(g.abs().sum()) for g in want.values()) > 0
    one = [json.loads((out / f"one_run_{k}.json").read_text()) for k in range(len(STAGES))]
    assert [r["stash_versions_max"] for r in one] == [1, 1, 1]  # nobody steps while a micro-batch is in flight


@pytest.mark.slow
def test_pipedream_equals_simulated_asynchronous_schedule_with_stashing(pipedream, one_torch_thread):
    from zl_export.shard import load_shard

    out, shard_path = pipedream
    shard = load_shard(shard_path)
    stashed, stashed_losses = simulate(shard, *ASYNC, stash=True)
    got = load_all(out, "async", "params")
    assert got.keys() == stashed.keys()
    for name, t in stashed.items():
        torch.testing.assert_close(got[name], t, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    assert any(float(t.abs().max()) > 1e-3 for n, t in got.items() if "lora_B" in n), "training moved LoRA B"
    run = [json.loads((out / f"async_run_{k}.json").read_text()) for k in range(len(STAGES))]
    last = run[-1]["windows"]
    assert [w for w, _, _ in last] == [0, 1, 2]
    assert [loss for _, loss, _ in last] == pytest.approx(stashed_losses, rel=1e-5)
    # Memory: stage k holds up to K-k micro-batches; across a step, two weight versions.
    assert [r["in_flight_max"] for r in run] == [3, 2, 1]
    assert [r["stash_versions_max"] for r in run] == [2, 2, 1]


@pytest.mark.slow
def test_pipedream_backward_uses_the_stashed_weights(pipedream, one_torch_thread):
    """The same schedule with the backward on the stage's current weights (no stashing) trains weights far outside
    the simulation's tolerance on stages 0 and 1, which step while their micro-batches are in flight (the last
    stage's forward and backward are adjacent; it differs only through its inputs)."""
    from zl_export.shard import load_shard

    out, shard_path = pipedream
    current, _ = simulate(load_shard(shard_path), *ASYNC, stash=False)
    for k in range(len(STAGES) - 1):
        got = load_file(str(out / f"async_params_{k}.safetensors"))
        diff = max(float((t - current[n]).abs().max() / current[n].abs().max()) for n, t in got.items())
        assert diff > 1e-3, f"stage {k}: trained as with the current weights at the backward (rel diff {diff})"


@pytest.mark.parametrize("stash", [True, False])
def test_stale_backprop_is_the_asynchronous_schedule_in_one_process(tmp_path, one_torch_thread, stash):
    """Fast: zl_device/torch/stale_backprop.py (whole-model backprop with each stage on its stashed version, as the
    accuracy study trains an asynchronous arm) equals the op-by-op simulation above with stashing, and differs
    from it without (so the comparison can fail)."""
    from test_torch_pipeline import make_shard
    from zl_device.torch.eager_training import Budget, OptimizerSettings
    from zl_device.torch.stale_backprop import train_stale_backprop
    from zl_export.shard import load_shard

    shard = load_shard(make_shard(tmp_path / "train.safetensors"))
    want, want_losses = simulate(shard, *ASYNC, stash=stash)
    peft_model, _, names = build()
    n, m = ASYNC
    log = train_stale_backprop(peft_model, shard, Budget(n * BATCH, m, BATCH), OptimizerSettings(lr=5e-3),
                               [range(a, b + 1) for a, b in STAGES])
    got = {names[id(p)]: p.detach() for p in peft_model.parameters() if p.requires_grad}
    assert got.keys() == want.keys()
    # Relative to each tensor's norm: Adam turns float-order noise in near-zero gradients (a k_proj lora_A here)
    # into up to a fraction of a step, so an elementwise tolerance would test the noise (stashed: 7e-4 here;
    # current weights at the backward: 0.28).
    worst = max(float((got[k] - want[k]).norm() / want[k].norm()) for k in want)
    assert (worst < 1e-2) == stash, f"worst relative difference {worst:.2e}: stashed weights must match the " \
                                    "schedule, current ones must not"
    if stash:
        assert [x for (x,) in log.losses] == pytest.approx(want_losses, rel=1e-4)


def test_stashed_versions_lag_by_the_warm_up_forwards():
    """Stage k's micro-batch j runs on window_of(j - (K-1-k)): with K = 3, m = 2, stage 0 runs the first two
    micro-batches of each window on the previous version, stage 1 the first, the last stage none."""
    from zl_device.formats.windows import WindowPlan
    from zl_device.torch.stale_backprop import stashed_version

    plan = WindowPlan(6, 2)
    assert [[stashed_version(k, 3, j, plan) for j in range(6)] for k in range(3)] == [
        [0, 0, 0, 0, 1, 1], [0, 0, 0, 1, 1, 2], [0, 0, 1, 1, 2, 2]]
