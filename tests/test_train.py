"""`zl train` end to end on tiny-random with three local devices: report, adapter, failure recovery.

Each run exports once into a shared cache (the first test pays ~40 s), then
deploys, runs three `zl_runner` processes, pulls, merges, evaluates and
reports. A failure injected into any stage must leave the final adapter
bit-identical to the failure-free run's: parameters change only at window
ends, and a replayed window recomputes exactly what the lost one did.
"""

import json
import os
import stat
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, native_library_or_skip

RUNNER = Path(os.environ.get("ZL_RUNNER_BIN", REPO / "build" / "runner" / "zl_runner"))
SAMPLES, WINDOW = 24, 4  # 6 windows


@pytest.fixture(scope="module")
def export_cache(tmp_path_factory) -> Path:
    """One export cache for the session: test_binary_mode_e2e and test_app_mode_e2e import this fixture (and
    clean_run), and their runs export the programs this module's runs do (~20 s each)."""
    native_library_or_skip()
    if not RUNNER.is_file():
        pytest.skip(f"{RUNNER} not built; run `bash setup.sh`")
    cache = tmp_path_factory.getbasetemp() / "train-export-cache"
    cache.mkdir(exist_ok=True)
    return cache


def train(out: Path, cache: Path, **kw):
    from zl_device.run.train_job import run_training
    from zl_device.run.train_settings import TrainSettings
    from zl_export.data_settings import DataSettings
    from zl_export.options import ModelSplit

    kw.setdefault("timeout_s", 300)
    kw.setdefault("rows", DataSettings(seq_len=32))
    kw.setdefault("samples", SAMPLES)
    # Every stage trains (the default holds all but the last still): a failure anywhere then loses training
    # state that recovery must restore bit for bit.
    kw.setdefault("stage_lr", (1.0,))
    kw.setdefault("schedule", "zerolock")  # the data is generative rows, on which the default would be async
    settings = TrainSettings(split=ModelSplit("tiny-random"), window=WINDOW, out=out, export_cache=cache,
                             eval_limit=16, **kw)
    # The demo task needs 64 tokens for the byte tokenizer; with seq_len 32 use a small prompt/completion file.
    return run_training(settings, say=lambda line: None)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    rows = [{"prompt": f"item {i} is", "completion": " odd" if i % 2 else " even"} for i in range(40)]
    path = tmp_path_factory.mktemp("data") / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def clean_run(export_cache, data_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean") / "run"
    return train(out, export_cache, data=str(data_file), eval_data=str(data_file))


def adapter_tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def test_report_files_consistent_with_metrics(clean_run):
    run_dir = clean_run.run_dir
    for name in ("report.json", "report.md", "plots/latency.png", "plots/loss.png", "metrics.jsonl", "eval.json",
                 "adapter/adapter_config.json", "manifest.json"):
        assert (run_dir / name).is_file(), name
    report = json.loads((run_dir / "report.json").read_text())
    lines = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert report["run"]["samples"] == SAMPLES
    for stage in report["stages"]:
        k = stage["index"]
        mbs = [r for r in lines if r["type"] == "micro_batch" and r["stage"] == k]
        assert sorted(r["micro_batch"] for r in mbs) == list(range(SAMPLES))
        for key in ("phase1_ms", "phase2_ms", "queue_ms", "total_ms"):
            values = [r[key] for r in mbs]
            assert stage[key]["median"] == pytest.approx(float(np.median(values)))
            assert stage[key]["p95"] == pytest.approx(float(np.percentile(values, 95)))
        pss = [r["pss_mib"] for r in lines if r.get("stage") == k and r.get("pss_mib") is not None]
        assert stage["peak_pss_mib"] == pytest.approx(max(pss))
    run = next(r for r in lines if r["type"] == "run")
    assert run["control_heartbeats"] == [True, True, True]  # every runner reached the coordinator
    assert report["run"]["wall_s"] == pytest.approx((run["end_unix_ms"] - run["start_unix_ms"]) / 1e3, rel=1e-3)


def test_run_key_shard_and_input_logs_leave_the_devices_when_the_run_ends(clean_run):
    """A finished run keeps no copy of its key (PROTOCOL.md §8; while it can be resumed RUN_DIR/run.key stays:
    test_resume_after_the_host_is_killed_ends_identical); the devices keep programs, checkpoints and telemetry."""
    run_dir = clean_run.run_dir
    assert not list(run_dir.rglob("run.key")), "no run key in RUN_DIR, its device folders or its logs"
    workdirs = sorted((run_dir / "devices").glob("local-*"))
    assert workdirs
    for workdir in workdirs:
        left = {p.relative_to(workdir).as_posix() for p in workdir.rglob("*")}
        assert not {n for n in left if n.endswith("run.key") or n.endswith(".safetensors") and "window_" not in n
                    or "input_log" in n}, left
        assert any(n.startswith("checkpoints/window_") or "/window_" in n for n in left), left


def test_adapter_loads_with_peft_and_equals_final_checkpoints(clean_run):
    from peft import PeftModel

    from zl_export.model_source import load_model

    run_dir = clean_run.run_dir
    merged = adapter_tensors(run_dir)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    expected, heads = {}, {}
    for st in manifest["stages"]:
        windows = sorted((run_dir / "checkpoints" / f"stage_{st['index']}").glob("window_*"))
        assert windows[-1].name == f"window_{SAMPLES // WINDOW - 1:06d}"
        for name, t in load_file(str(windows[-1] / "adapter.safetensors")).items():
            (heads if name.startswith("zl.translator.") else expected)[name] = t
    lora = [p for s in manifest["stages"] for p in s["parameters"] if p.get("role") != "translator"]
    assert merged.keys() == expected.keys() and len(merged) == len(lora)
    # The default readout translators (stages 0 and 1) are checkpointed and merged aside as early-exit heads.
    assert {n.split(".")[2] for n in heads} == {"stage_0", "stage_1"}
    for k in (0, 1):
        saved = load_file(str(run_dir / "adapter" / "early_exit" / f"stage_{k}.safetensors"))
        assert all(torch.equal(saved[n], heads[n]) for n in saved) and len(saved) == 3
    for name, t in expected.items():
        assert torch.equal(merged[name], t), name
    model = PeftModel.from_pretrained(load_model("tiny-random").model, str(run_dir / "adapter"))
    loaded = {n: p for n, p in model.named_parameters() if "lora_" in n}
    some = next(iter(expected))
    match = [p for n, p in loaded.items() if n.replace(".default", "").endswith(some.removeprefix("base_model.model."))]
    assert match and torch.equal(match[0].detach(), expected[some])
    assert any(t.abs().sum() > 0 for n, t in merged.items() if "lora_B" in n)  # training moved B off zero


def eager_zerolock(run_dir: Path, logs: list | None = None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The run's pipeline retrained in PyTorch eager (zl_device.torch.eager_training) from its manifest, configs and shard.

    Args:
        logs: if given, the eager run's TrainLog (per-window losses of every stage) is appended to it.

    Returns:
        (trained tensors by manifest name, the run's merged adapter tensors plus its early-exit heads).
    """
    from zl_device.torch.eager_training import Budget, OptimizerSettings, stage_parameters, train_zerolock
    from zl_export.exporter import build_stage_modules
    from zl_export.model_source import load_model
    from zl_export.options import ExportOptions
    from zl_export.shard import load_shard
    from zl_export.stages import StageRange
    from zl_export.translator import calibration_batches

    manifest = json.loads((run_dir / "manifest.json").read_text())
    configs = [json.loads((run_dir / f"stage_{st['index']}.json").read_text()) for st in manifest["stages"]]
    opts = ExportOptions.from_manifest(manifest)
    batch = opts.micro_batch
    loaded = load_model(manifest["model"]["name"], seed=manifest["seed"])
    shard = load_shard(run_dir / "data" / "train.safetensors")
    peft_model, modules = build_stage_modules(
        loaded.model, [StageRange(st["index"], *st["layers"]) for st in manifest["stages"]], opts,
        calibration_batches(shard))  # lens translators are fitted on the training shard, as zl train does
    optimizer = max((c["optimizer"] for c in configs), key=lambda o: o["lr"])  # a stage may have lr 0
    log = train_zerolock(modules, shard,
                         Budget(configs[0]["num_micro_batches"] * batch, configs[0]["window_size"], batch),
                         OptimizerSettings.from_config(optimizer),
                         stage_lr=[c["optimizer"]["lr"] / optimizer["lr"] for c in configs])
    if logs is not None:
        logs.append(log)
    merged = adapter_tensors(run_dir)
    for head in sorted((run_dir / "adapter" / "early_exit").glob("stage_*.safetensors")):
        merged.update(load_file(str(head)))
    return stage_parameters(modules, peft_model), merged


def run_lr(run_dir: Path) -> float:
    """The peak learning rate of a run's stages (RUN_DIR/stage_<k>.json)."""
    return max(json.loads(p.read_text())["optimizer"]["lr"] for p in run_dir.glob("stage_*.json"))


#: assert_trained_alike's tolerance: relative, and absolute as a fraction of the peak lr.
TRAINED_RTOL, TRAINED_ATOL_LR = 1e-4, 0.01


def assert_trained_alike(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], lr: float) -> None:
    """Two trainings of the same run that differ in float rounding only (eager against the runner, two builds of
    the runner) agree to rtol 1e-4 and atol 1% of the peak lr, tensor by tensor."""
    # atol 1% of the peak lr: Adam moves a weight whose gradient is about zero by up to lr on rounding noise alone
    # (m/√v of noise), so an element of a tensor can differ by ~1e-5 between two correct runs (lr 2e-3: one of
    # 512 by 9.8e-6); a wrong gradient moves whole tensors by ~lr.
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=TRAINED_RTOL, atol=TRAINED_ATOL_LR * lr,
                                   msg=lambda m: f"{name}: {m}")


def assert_eager_equals_run(run_dir: Path, logs: list | None = None,
                            eager: dict | None = None) -> dict[str, torch.Tensor]:
    """The run's adapter equals the eager path's within rtol 1e-4, atol 1% of the lr (and something trained); returns the run's
    tensors. `logs` and `eager` (if given) receive the eager run's TrainLog and its tensors by manifest name."""
    got, merged = eager_zerolock(run_dir, logs)
    assert set(got) == set(merged)
    assert_trained_alike(got, merged, run_lr(run_dir))
    assert sum(int(t.abs().max() > 1e-3) for n, t in merged.items() if "lora_B" in n) > 0, "nothing moved"
    if eager is not None:
        eager.update(got)
    return merged


def test_eager_zerolock_gives_the_adapter_of_the_run(clean_run):
    """The accuracy study's eager path (issue 9) trains what `zl train` trains: the same adapter to rtol 1e-4."""
    assert_eager_equals_run(clean_run.run_dir)


def test_loss_variants_train_through_the_runner_as_in_eager(export_cache, data_file, tmp_path):
    """Per-stage α, a gated KL, no target for stage 0, lens translators and per-stage lr through the real runners.

    The translators train in the runners (checkpoints), stay out of the PEFT adapter and land in
    adapter/early_exit/; everything equals the eager path's result.
    """
    from zl_export.options import ExportOptions, LossConfig

    loss = LossConfig(alpha=(0.5, 0.7, 1.0), first_target="none", gate="target_prob", translator_rank=2,
                      translator_init="lens")
    result = train(tmp_path / "run", export_cache, data=str(data_file), export=ExportOptions(loss=loss),
                   stage_lr=(1.0, 1.0, 2.0))
    run_dir = result.run_dir
    recorded = json.loads((run_dir / "manifest.json").read_text())["loss"]
    assert recorded.pop("calibration")["path"] == str(run_dir / "data" / "train.safetensors")
    assert recorded == loss.to_manifest()
    lrs = [json.loads((run_dir / f"stage_{k}.json").read_text())["optimizer"]["lr"] for k in range(3)]
    assert lrs[2] == 2 * lrs[0] == 2 * lrs[1]
    assert not any("translator" in n for n in adapter_tensors(run_dir)), "translators are not part of the model"
    heads = sorted(p.name for p in (run_dir / "adapter" / "early_exit").iterdir())
    assert heads == ["stage_0.safetensors", "stage_1.safetensors"]  # every stage but the last
    merged = assert_eager_equals_run(run_dir)
    assert merged["zl.translator.stage_0.up"].abs().max() > 0, "the runner trained the translator"


def test_by_default_the_upstream_stages_run_forward_only_and_do_not_train(export_cache, data_file, tmp_path):
    """No --stage-lr: its default, 0,0,1, for which the upstream runners run phase 1 and forward, nothing more
    (docs/design#windows-and-adamw): their
    lines say forward_only with no phase-2 time and no loss, their checkpoints keep the exported LoRA weights (B at
    its zeros) and AdamW moments that are zeros, so not written, the report says they were held still. The eager
    path, whose upstream stages compute their phase 2 at lr 0, gives the same adapter and the same last-stage
    losses."""
    import re

    from safetensors import safe_open

    result = train(tmp_path / "run", export_cache, data=str(data_file), stage_lr=None)
    run_dir = result.run_dir
    manifest = json.loads((run_dir / "manifest.json").read_text())
    last_first = manifest["stages"][-1]["layers"][0]
    tensors = adapter_tensors(run_dir)
    for name, t in tensors.items():
        layer = int(re.search(r"\.layers\.(\d+)\.", name).group(1))
        if "lora_B" in name:
            assert (t.abs().max() > 0) == (layer >= last_first), name
    logs, initial = [], {}
    assert_eager_equals_run(run_dir, logs, initial)  # at lr 0 the eager stages 0 and 1 end where they began
    lines = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    report = json.loads((run_dir / "report.json").read_text())
    for k in (0, 1):
        final = sorted((run_dir / "checkpoints" / f"stage_{k}").glob("window_*"))[-1]
        for name, t in load_file(str(final / "adapter.safetensors")).items():
            assert torch.equal(t, initial[name]), f"stage {k}: {name} moved"
        with safe_open(str(final / "optimizer.safetensors"), "pt") as f:  # zero moments are not written
            assert (list(f.keys()), f.metadata()["moments"]) == ([], "zero")
        assert json.loads((final / "progress.json").read_text())["optimizer_step"] == SAMPLES // WINDOW
        mbs = [r for r in lines if r["type"] == "micro_batch" and r["stage"] == k]
        assert len(mbs) == SAMPLES
        assert all(r["forward_only"] is True and r["phase2_ms"] == 0 and r["loss"] is None for r in mbs)
        assert all(r["forward_only"] and r["mean_loss"] is None for r in lines if r["type"] == "window"
                   and r["stage"] == k)
        assert report["stages"][k]["forward_only"] is True
        assert f"- stage {k}: held still (lr 0), forward only" in (run_dir / "report.md").read_text()
    last = [r for r in lines if r["type"] == "window" and r["stage"] == 2]
    assert not report["stages"][2]["forward_only"] and all(not r["forward_only"] for r in last)
    eager_last = [window[2] for window in logs[0].losses]
    assert [r["mean_loss"] for r in last] == pytest.approx(eager_last, rel=1e-4)


def test_a_hundred_target_tokens_train_through_the_runner_as_in_eager(export_cache, tmp_path):
    """Generative rows with 71 to 99 target tokens (completion bytes and end-of-sequence): the programs get 100 slots
    (the longest, rounded up to 4), and the runners' readout, translators, hidden-state frames and shards carry
    them: the adapter equals the eager path's, which reads out every target."""
    from zl_export.data_settings import DataSettings

    words = "north south east west river stone cloud field".split()
    rows = [{"prompt": f"row {i}:", "completion": " " + " ".join(words[(i + j) % 8] for j in range(20))[: 69 + 4 * i]}
            for i in range(8)]
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = train(tmp_path / "run", export_cache, data=str(data), rows=DataSettings(seq_len=128), samples=8)
    manifest = json.loads((result.run_dir / "manifest.json").read_text())
    assert manifest["max_targets"] == 100  # 99 completion bytes + end-of-sequence, a multiple of 4
    assert_eager_equals_run(result.run_dir)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_injected_failure_with_local_recovery_ends_identical(clean_run, export_cache, data_file, tmp_path, stage):
    result = train(tmp_path / "run", export_cache, data=str(data_file), inject_failure=f"{stage}@2")
    events = [json.loads(ln) for ln in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    kinds = [e["type"] for e in events if e["type"] in ("failure", "restart", "recovered")]
    assert kinds == ["failure", "restart", "recovered"], kinds
    failure = next(e for e in events if e["type"] == "failure")
    assert failure["stage"] == stage and failure["window"] == 2
    # Killed after sending micro-batch 9 (window 2 = 8..11): the accumulator snapshot of micro-batch 8 lets the
    # restart continue at 9; nothing done is replayed.
    restart = next(e for e in events if e["type"] == "restart")
    assert restart["replayed_micro_batches"] == 0, restart
    starts = [e for e in events if e["type"] == "start" and e["stage"] == stage]
    assert starts[-1]["first_micro_batch"] == 9 and starts[-1]["resumed_from_snapshot"] == 1, starts[-1]
    clean, recovered = adapter_tensors(clean_run.run_dir), adapter_tensors(result.run_dir)
    for name, t in clean.items():
        assert torch.equal(recovered[name], t), name
    report = json.loads((result.run_dir / "report.json").read_text())
    assert report["recovery"] and report["recovery"][0]["stage"] == stage


def test_a_stalled_living_stage_is_restarted_not_its_neighbours(clean_run, export_cache, data_file, tmp_path,
                                                                monkeypatch):
    """Stage 1 parks in window 2 and stays alive (heartbeats go on from its timer thread): the coordinator must
    find it by its lack of progress, blame it -- not stage 0 held back by it, nor stage 2 starved by it --
    restart it alone, and end with the clean run's adapter. Without stall detection the run times out."""
    from zl_device.executorch.coordinator import Coordinator

    # The hold of --inject-failure without the kill that normally follows it: a stage that stopped computing.
    monkeypatch.setattr(Coordinator, "_maybe_inject", lambda self: None)
    result = train(tmp_path / "run", export_cache, data=str(data_file), inject_failure="1@2", stall_timeout_s=8.0,
                   timeout_s=150)
    events = [json.loads(ln) for ln in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    failures = [e for e in events if e["type"] == "failure"]
    assert [(f["stage"], f["window"]) for f in failures] == [(1, 2)], failures
    assert failures[0]["reason"].startswith("stalled: no progress for "), failures[0]
    assert failures[0]["detected_after_ms"] >= 8000
    assert [e["stage"] for e in events if e["type"] == "restart"] == [1]
    assert [e["stage"] for e in events if e["type"] == "recovered"] == [1]
    clean, recovered = adapter_tensors(clean_run.run_dir), adapter_tensors(result.run_dir)
    for name, t in clean.items():
        assert torch.equal(recovered[name], t), name
    report = (result.run_dir / "report.md").read_text()
    assert "| 1 | stalled: no progress for " in report


def test_global_recovery_replays_more_than_local(clean_run, export_cache, data_file, tmp_path):
    """Global rolls every stage back to the common checkpoint; local continues the failed stage's window from
    its accumulator snapshot (nothing replayed), or without snapshots replays the window from its checkpoint."""
    arms = {"local": {}, "global": {"recovery": "global"}, "local-no-snapshots": {"accumulator_snapshots": False}}
    replayed = {}
    for arm, kw in arms.items():
        result = train(tmp_path / arm, export_cache, data=str(data_file), inject_failure="1@3", **kw)
        events = [json.loads(ln) for ln in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
        replayed[arm] = sum(e["replayed_micro_batches"] for e in events if e["type"] == "restart")
        clean, got = adapter_tensors(clean_run.run_dir), adapter_tensors(result.run_dir)
        assert all(torch.equal(got[n], t) for n, t in clean.items()), arm
    assert replayed["global"] > replayed["local-no-snapshots"] > replayed["local"] == 0, replayed


@pytest.mark.parametrize("recovery", ["local", "global"])
def test_a_hot_standby_takes_over_with_its_program_loaded_before_the_failure(clean_run, export_cache, data_file,
                                                                            tmp_path, recovery):
    """--standby: the replacement of the killed stage (every stage, under global recovery) is the standby that
    mapped its program and loaded its method before the failure; it only restores, replays and connects. The
    adapter is the clean run's, a new standby follows the recovery, and none is left when the run ends."""
    # The failure at window 4 of 6: the standbys map and load their programs while the first windows run (at
    # window 2 a loaded host once lost that race by 2 ms, the standby loading after the kill).
    result = train(tmp_path / "run", export_cache, data=str(data_file), inject_failure="1@4", recovery=recovery,
                   standby=True)
    events = [json.loads(ln) for ln in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    failure = next(e for e in events if e["type"] == "failure")
    restart = next(e for e in events if e["type"] == "restart")
    recovered = next(e for e in events if e["type"] == "recovered")
    assert restart["standby"] is True, restart
    assert recovered["since_failure_ms"] >= recovered["recovery_ms"] >= 0, recovered
    restarted = [1] if recovery == "local" else [0, 1, 2]
    for k in range(3):
        starts = [e for e in events if e["type"] == "start" and e["stage"] == k]
        if k not in restarted:
            assert len(starts) == 1, (k, starts)
            continue
        assert len(starts) == 2, (k, starts)
        first, replacement = starts
        assert not first["standby"] and replacement["standby"], (k, starts)
        # Loaded while the stage it replaced still ran; told to take over only after the kill.
        assert replacement["program_loaded_unix_ms"] < failure["t_unix_ms"] <= replacement["took_over_unix_ms"] + 1, \
            (k, replacement, failure)
        assert replacement["resumed_from_window"] is not None
    for k in range(3):
        workdir = result.run_dir / "devices" / f"local-{k}"
        assert not (workdir / "standby.pid").exists(), f"stage {k}'s standby outlived the run"
        out = (workdir / "runner.out").read_text()
        # One standby from the start; a second one after the recovery for a stage whose standby took over, if
        # that stage was still running when the recovery ended (on this tiny model it may already be done, and
        # a finished stage gets none).
        assert 1 <= out.count('"event": "standby"') <= 1 + (k in restarted), (k, out)
    clean, recovered_adapter = adapter_tensors(clean_run.run_dir), adapter_tensors(result.run_dir)
    for name, t in clean.items():
        assert torch.equal(recovered_adapter[name], t), name
    report = (result.run_dir / "report.md").read_text()
    assert "| standby | recovery (ms) | since the failure (ms) |" in report


@pytest.mark.parametrize("recovery", ["local", "global"])
def test_resume_after_the_host_is_killed_ends_identical(clean_run, export_cache, data_file, tmp_path, recovery):
    """SIGKILL `zl train` once the last stage has committed a window; its runners run on without a host.
    `zl train --resume` stops them, continues from the stages' checkpoints and ends with the clean run's adapter."""
    import signal
    import subprocess
    import sys
    import time

    from zl_device.run.train_job import run_training
    from zl_device.run.train_settings import TrainSettings

    out = tmp_path / "run"
    host = subprocess.Popen([sys.executable, "-c", (
        "import sys; from pathlib import Path; sys.path[:0] = [sys.argv[1], sys.argv[2]]\n"
        "from test_train import train\n"
        "train(Path(sys.argv[3]), Path(sys.argv[4]), data=sys.argv[5], link_profile='constrained', recovery=sys.argv[6])"),
        str(REPO), str(Path(__file__).parent), str(out), str(export_cache), str(data_file), recovery],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    checkpoints = out / "devices" / "local-2" / "checkpoints"

    def committed() -> bool:  # window 1 or a later one (keep_last prunes window 1 two windows on)
        return any(p.name > "window_000000" for p in checkpoints.glob("window_*")) if checkpoints.is_dir() else False

    deadline = time.monotonic() + 240
    while not committed():
        assert host.poll() is None, host.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "the run never committed window 1"
        time.sleep(0.02)
    host.send_signal(signal.SIGKILL)
    host.wait()
    # A runner that already finished its samples has removed its pid file (stage 0 can be done before stage 2
    # commits window 1); the others must outlive the host.
    pids = []
    for k in range(3):
        try:
            pids.append(int((out / "devices" / f"local-{k}" / "runner.pid").read_text()))
        except FileNotFoundError:
            pass

    def alive(pid: int) -> bool:
        return Path(f"/proc/{pid}").exists() and " Z " not in Path(f"/proc/{pid}/stat").read_text()

    assert any(alive(pid) for pid in pids), "the runners outlive their host (the case --resume must handle)"
    # Unfinished: the key stays (owner-only) for --resume, and the marker says how to resume.
    assert stat.S_IMODE((out / "run.key").stat().st_mode) == 0o600
    assert f"zl train --resume --out {out.resolve()}" in (out / "UNFINISHED.txt").read_text()
    result = run_training(TrainSettings(out=out, resume=True), say=lambda line: None)
    assert not (out / "run.key").exists() and not (out / "UNFINISHED.txt").exists(), "finished: key and marker go"
    events = [json.loads(ln) for ln in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    resume = [e for e in events if e["type"] == "resume"]
    assert len(resume) == 1 and resume[0]["scope"] == recovery, resume
    clean, resumed = adapter_tensors(clean_run.run_dir), adapter_tensors(result.run_dir)
    for name, t in clean.items():
        assert torch.equal(resumed[name], t), name
    assert not any(alive(pid) for pid in pids), "the previous host's runners were stopped, not left running"
    from zl_base.errors import ZLError

    with pytest.raises(ZLError, match="that run finished"):
        run_training(TrainSettings(out=out, resume=True), say=lambda line: None)


def test_resume_after_a_failure_with_no_restarts_left_ends_identical(clean_run, export_cache, data_file, tmp_path,
                                                                     monkeypatch):
    """`--max-restarts 0 --inject-failure 1@1`: stage 1 is SIGKILLed in window 1 and the run gives up; stage 0 has
    run on by then, sending micro-batches 8-10 into a queue nobody acknowledges and saving an accumulator snapshot
    of window 2 that holds them. Those hidden states died with stage 0's process: `zl train --resume` must not
    continue stage 0 from that snapshot (it would never send them again and stage 1 would wait for them until the
    stall detector gave up) but from its checkpoint, and end with the clean run's adapter."""
    from zl_base.errors import ZLError
    from zl_device.formats.checkpoints import snapshot_metadata
    from zl_device.executorch.coordinator import Coordinator
    from zl_device.run.train_job import run_training
    from zl_device.run.train_settings import TrainSettings

    out = tmp_path / "run"
    stage_0 = out / "devices" / "local-0" / "checkpoints"
    log_1 = out / "devices" / "local-1" / "checkpoints" / "input_log"

    def wait_for(what: str, ready) -> None:
        deadline = time.monotonic() + 60
        while not ready():
            assert time.monotonic() < deadline, what
            time.sleep(0.01)

    def snapshot() -> dict:
        path = stage_0 / "accumulator.safetensors"
        return (snapshot_metadata(path.read_bytes()) if path.is_file() else None) or {}

    # Where the race that the report hit ends, every time: the kill once stage 0 committed window 1 (stage 1
    # logged 4-7), the stop of the others once stage 0's snapshot holds 8-10 of window 2.
    inject, stop_all = Coordinator._maybe_inject, Coordinator.stop_all

    def kill_after_window_1(self):
        if self.table.hold_seen and not self._injected:
            wait_for("stage 0 never committed window 1", lambda: (stage_0 / "window_000001").is_dir())
        inject(self)

    def stop_after_snapshot(self):
        wait_for("stage 0 never snapshotted window 2", lambda: snapshot().get("micro_batches_done") == "11")
        stop_all(self)

    monkeypatch.setattr(Coordinator, "_maybe_inject", kill_after_window_1)
    monkeypatch.setattr(Coordinator, "stop_all", stop_after_snapshot)
    with pytest.raises(ZLError, match="stage 1 failed 1 times"):
        train(out, export_cache, data=str(data_file), inject_failure="1@1", max_restarts=0, stall_timeout_s=15.0,
              timeout_s=120)
    monkeypatch.undo()
    assert snapshot()["window"] == "2" and snapshot()["micro_batches_done"] == "11", snapshot()
    assert not (log_1 / f"entry-{10:020d}-w{2:020d}.zlf").exists(), "stage 1 never got micro-batch 10"
    result = run_training(TrainSettings(out=out, resume=True), say=lambda line: None)
    events = [json.loads(ln) for ln in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["type"] == "failure"]
    starts = [e for e in events if e["type"] == "start" and e["stage"] == 0]
    assert starts[-1]["first_micro_batch"] == 8 and starts[-1]["resumed_from_snapshot"] == 0, starts[-1]
    clean, resumed = adapter_tensors(clean_run.run_dir), adapter_tensors(result.run_dir)
    for name, t in clean.items():
        assert torch.equal(resumed[name], t), name


def wait_for_a_window(host, checkpoints: Path, timeout_s: float) -> None:
    """Wait until a `zl train` subprocess's stage committed a window into `checkpoints` (fail if it ends first)."""
    deadline = time.monotonic() + timeout_s
    while not (checkpoints.is_dir() and any(checkpoints.glob("window_*"))):
        assert host.poll() is None, host.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "the run never committed a window"
        time.sleep(0.02)


def stop_with_sigterm(host, timeout_s: float) -> int:
    """SIGTERM a `zl train` subprocess; its exit status (fail if it takes longer than `timeout_s`)."""
    import signal
    import subprocess

    host.send_signal(signal.SIGTERM)
    try:
        return host.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        host.kill()
        pytest.fail(f"zl train did not exit within {timeout_s:g} s of SIGTERM")


def test_a_stopped_zl_train_stops_its_runners_and_resume_finishes_the_run(export_cache, data_file, tmp_path,
                                                                           monkeypatch):
    """`zl train` (the CLI, in a subprocess) stopped by SIGTERM once the last stage has committed a window: it exits
    within seconds with 143 and one line saying how to resume, no runner is left running, the run is kept
    (UNFINISHED.txt, run.key), and `zl train --resume` finishes it. (Before, SIGTERM ended zl train at once and the
    runners trained on without a host until `--resume` stopped them.)"""
    import subprocess
    import sys

    from zl_device.run.train_job import run_training
    from zl_device.run.train_settings import TrainSettings

    cache = tmp_path / "cache"  # $ZL_CACHE_DIR/exports: this module's export cache, whose tiny-random export fits
    cache.mkdir()
    (cache / "exports").symlink_to(export_cache, target_is_directory=True)
    monkeypatch.setenv("ZL_CACHE_DIR", str(cache))
    out = tmp_path / "run"
    log = (tmp_path / "zl.out").open("wb")
    host = subprocess.Popen(
        [sys.executable, "-c", "from zl.cli import main; main()", "train", "--model", "tiny-random", "--seq-len", "32",
         "--data", str(data_file), "--samples", "800", "--window", str(WINDOW), "--stage-lr", "1", "--schedule", "zerolock", "--out", str(out)],
        cwd=REPO, stdout=log, stderr=subprocess.PIPE)
    wait_for_a_window(host, out / "devices" / "local-2" / "checkpoints", 300)
    pids = [int((out / "devices" / f"local-{k}" / "runner.pid").read_text()) for k in range(3)]

    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    assert all(alive(pid) for pid in pids), "the runners were done before the stop: nothing was tested"
    stopped = time.monotonic()
    code = stop_with_sigterm(host, 60)
    took = time.monotonic() - stopped
    err = host.stderr.read().decode().strip().splitlines()
    assert code == 143, (code, err[-5:])  # 128 + SIGTERM, as a shell reports it
    assert took < 30, f"zl train took {took:.1f} s to stop"  # measured: about 2-5 s on a loaded 2-core host
    assert err[-1] == (f"stopped (SIGTERM): the stages are stopped and keep their checkpoints; continue the run with "
                       f"`zl train --resume --out {out.resolve()}`"), err[-5:]
    assert not any(alive(pid) for pid in pids), "a runner outlived the stopped zl train"
    codes = [(out / "devices" / f"local-{k}" / "runner.exit").read_text().strip() for k in range(3)]
    assert codes == ["3", "3", "3"], f"the runners did not stop on request (exit 3): {codes}"
    assert (out / "UNFINISHED.txt").is_file() and (out / "run.key").is_file()
    result = run_training(TrainSettings(out=out, resume=True), say=lambda line: None)
    assert result.report and not (out / "UNFINISHED.txt").exists() and not (out / "run.key").exists()
    events = [json.loads(ln) for ln in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e["type"] for e in events if e["type"] == "resume"] == ["resume"]
    assert max(e["window"] for e in events if e["type"] == "window" and e["stage"] == 2) == 800 // WINDOW - 1


def test_bad_inputs_are_clear_errors(export_cache, tmp_path):
    from zl_base.errors import ZLError

    with pytest.raises(ZLError, match="expected STAGE@WINDOW"):
        from zl_device.formats.injection import Injection

        Injection.parse("1-2", 3, 6)
    with pytest.raises(ZLError, match="stage 5 does not exist"):
        Injection.parse("5@1", 3, 6)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    with pytest.raises(ZLError, match="exists and is not empty"):
        train(busy, export_cache)
    with pytest.raises(ZLError, match="gives 2 device"):
        train(tmp_path / "few", export_cache, devices="local:2")


def test_too_few_target_slots_fail_before_the_export(export_cache, data_file, tmp_path):
    """A training row with more targets than --max-targets fails in seconds, naming the row, not after the export."""
    from zl_base.errors import ZLError
    from zl_export.options import ExportOptions

    cached = set(export_cache.iterdir())
    with pytest.raises(ZLError, match=r"rows\.jsonl line 1: 6 target tokens, more than the programs' 2 target slots "
                                      r"\(39 more rows too\); pass --max-targets 6 or more"):
        train(tmp_path / "run", export_cache, data=str(data_file), export=ExportOptions(max_targets=2))
    assert set(export_cache.iterdir()) == cached, "nothing was exported"


def test_target_slots_follow_the_training_data(tmp_path):
    """Without --max-targets `zl train` fits the slots to its data: the largest target count rounded up to 4."""
    from zl_device.run.train_data import run_max_targets
    from zl_device.run.train_settings import TrainSettings
    from zl_export import data as zdata
    from zl_export.options import ExportOptions
    from zl_export.tokenizer import ByteTokenizer

    def shard(completion: str) -> Path:
        src = tmp_path / f"{len(completion)}.jsonl"
        src.write_text(json.dumps({"prompt": "p", "completion": completion}) + "\n")
        tokenized, task = zdata.tokenize(zdata.load_task(src, "auto"), ByteTokenizer(), 64)
        path = tmp_path / f"{len(completion)}.safetensors"
        zdata.save(path, tokenized, task, ByteTokenizer(), "tiny-random", {"path": str(src)})
        return path

    said = []
    assert run_max_targets(TrainSettings(), shard(" ok"), said.append) == 4  # 3 bytes + EOS
    assert run_max_targets(TrainSettings(), shard(" " + "x" * 19), said.append) == 24  # 20 bytes + EOS = 21 targets
    assert said[-1] == "data: up to 21 target tokens per sample -> 24 target slots (--max-targets)"
    assert run_max_targets(TrainSettings(export=ExportOptions(max_targets=0)), shard(" " + "x" * 19), said.append) == 0
    assert run_max_targets(TrainSettings(export=ExportOptions(max_targets=30)), shard(" " + "x" * 19), said.append) == 30
