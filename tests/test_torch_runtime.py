"""`zl train --runtime torch` on tiny-random: the stages as torch.distributed ranks (gloo on CPU).

The end-to-end tests are `slow`: three spawned ranks each import torch, PEFT and
transformers and build their stage (~40 s on a loaded 2-core host). The fast
tests cover the checkpoint format against `zl merge`, the settings checks and
the torchrun entry point without starting ranks.

    .venv/bin/python -m pytest tests/test_torch_runtime.py -m 'slow or not slow'
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import typer
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import REPO
from zl_base.errors import ZLError

SAMPLES, WINDOW, BATCH = 12, 2, 2  # 6 micro-batches of 2 rows in 3 windows


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    rows = [{"prompt": f"item {i} is", "completion": " odd" if i % 2 else " even"} for i in range(40)]
    path = tmp_path_factory.mktemp("data") / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def settings(out: Path, data_file: Path, **kw):
    from zl_device.run.train_settings import TrainSettings
    from zl_export.data_settings import DataSettings
    from zl_export.options import ExportOptions, LossConfig, ModelSplit

    # ZeroLock's local losses (not the schedule generative data gets by default): per-stage α, a gated KL, lens
    # translators and a per-stage lr, everything a stage's step depends on.
    loss = LossConfig(alpha=(0.5, 0.7, 1.0), first_target="none", gate="target_prob", translator_rank=2,
                      translator_init="lens")
    base = dict(split=ModelSplit("tiny-random"), samples=SAMPLES, window=WINDOW, out=out, rows=DataSettings(seq_len=32),
                data=str(data_file), eval_data=str(data_file), eval_limit=8, timeout_s=600, runtime="torch",
                link_timeout_s=120, stage_lr=(1.0, 1.0, 2.0), schedule="zerolock",
                export=ExportOptions(micro_batch=BATCH, loss=loss))
    return TrainSettings(**{**base, **kw})


@pytest.fixture(scope="module")
def torch_run(data_file, tmp_path_factory):
    from zl_device.run.train_job import run_training

    return run_training(settings(tmp_path_factory.mktemp("torch") / "run", data_file), say=lambda line: None)


def eager_reference(run_dir: Path, logs: list | None = None) -> dict[str, torch.Tensor]:
    """The run retrained in one process by `train_zerolock` from its manifest, job and shard; its TrainLog (every
    stage's window losses) is appended to `logs` if given."""
    from zl_device.torch.eager_training import Budget, OptimizerSettings, stage_parameters, train_zerolock
    from zl_export.exporter import build_stage_modules
    from zl_export.model_source import load_model
    from zl_export.options import ExportOptions
    from zl_export.shard import load_shard
    from zl_export.stages import StageRange
    from zl_export.translator import calibration_batches

    manifest = json.loads((run_dir / "manifest.json").read_text())
    job = json.loads((run_dir / "torch_job.json").read_text())
    opts = ExportOptions.from_manifest(manifest)
    batch = opts.micro_batch
    shard = load_shard(run_dir / "data" / "train.safetensors")
    peft_model, modules = build_stage_modules(
        load_model(manifest["model"]["name"], seed=manifest["seed"]).model,
        [StageRange(st["index"], *st["layers"]) for st in manifest["stages"]], opts, calibration_batches(shard))
    lr = job["lr"]
    base = max(lr)  # a stage may have lr 0
    log = train_zerolock(modules, shard, Budget(job["num_micro_batches"] * batch, job["window_size"], batch),
                         OptimizerSettings.from_config({"lr": base, "weight_decay": job["weight_decay"],
                                                        "schedule": job["schedule"]}),
                         stage_lr=[x / base for x in lr])
    if logs is not None:
        logs.append(log)
    return stage_parameters(modules, peft_model)


def assert_adapter_equals_eager(run_dir: Path, logs: list | None = None) -> dict[str, torch.Tensor]:
    """The run's merged adapter (LoRA and readout translators) equals `eager_reference`'s within rtol 1e-5;
    returns the adapter's tensors by name."""
    merged = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    for head in sorted((run_dir / "adapter" / "early_exit").glob("stage_*.safetensors")):
        merged.update(load_file(str(head)))
    want = eager_reference(run_dir, logs)
    assert set(merged) == set(want)
    for name, t in want.items():
        torch.testing.assert_close(merged[name], t, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    return merged


@pytest.mark.slow
def test_torch_runtime_adapter_equals_the_eager_reference(torch_run, one_torch_thread):
    run_dir = torch_run.run_dir
    merged = assert_adapter_equals_eager(run_dir)
    moved = [n for n, t in merged.items() if "lora_B" in n and t.abs().max() > 1e-3]
    assert len(moved) == sum("lora_B" in n for n in merged), "every stage trained its LoRA B off zero"
    assert merged["zl.translator.stage_0.up"].abs().max() > 0, "the translators trained too"


@pytest.mark.slow
def test_torch_stages_at_lr_0_run_forward_only(data_file, tmp_path, one_torch_thread):
    """`--stage-lr 0,0,1` on torch ranks: ranks 0 and 1 run phase 1 and send, no readout or backward (the runner's
    forward-only stage, docs/design#windows-and-adamw), with the runner's telemetry shape; the adapter and the last
    stage's window losses equal the eager reference's, whose upstream stages compute phase 2 at lr 0."""
    from zl_device.formats.metrics_log import read_lines
    from zl_device.run.train_job import run_training

    run_dir = run_training(settings(tmp_path / "run", data_file, stage_lr=(0.0, 0.0, 1.0)),
                           say=lambda line: None).run_dir
    lines = {k: read_lines(run_dir / "stages" / f"stage_{k}" / "metrics.jsonl") for k in range(3)}
    for k in (0, 1):
        start = next(r for r in lines[k] if r["type"] == "start")
        assert start["forward_only"] is True
        mbs = [r for r in lines[k] if r["type"] == "micro_batch"]
        assert len(mbs) == SAMPLES // BATCH
        assert all(r["forward_only"] and r["phase2_ms"] == 0 and r["loss"] is None and r["phase1_ms"] > 0
                   for r in mbs)
        windows = [r for r in lines[k] if r["type"] == "window"]
        assert [(w["step"], w["mean_loss"], w["forward_only"]) for w in windows] == [
            (w + 1, None, True) for w in range(SAMPLES // BATCH // WINDOW)]
    assert not next(r for r in lines[2] if r["type"] == "start")["forward_only"]
    logs = []
    merged = assert_adapter_equals_eager(run_dir, logs)
    for name, t in merged.items():
        if "lora_B" in name and not name.startswith("zl."):
            layer = int(name.split(".layers.")[1].split(".")[0])
            last_first = json.loads((run_dir / "manifest.json").read_text())["stages"][-1]["layers"][0]
            assert bool(t.abs().max() > 0) == (layer >= last_first), name
    last = [r["mean_loss"] for r in lines[2] if r["type"] == "window"]
    assert last == pytest.approx([window[2] for window in logs[0].losses], rel=1e-5)
    report = json.loads((run_dir / "report.json").read_text())
    assert [s["forward_only"] for s in report["stages"]] == [True, True, False]


@pytest.mark.slow
def test_ranks_of_a_model_directory_load_only_their_layers_and_train_as_eager(data_file, tmp_path,
                                                                               one_torch_thread):
    """A model directory (safetensors): each rank reads only its stage's weights (its `start` line says which
    layers), and the adapter still equals the single-process eager reference built on the whole model."""
    from test_model_source import _save_tiny_llama_dir
    from zl_device.formats.metrics_log import read_lines
    from zl_device.run.train_job import run_training
    from zl_export.options import ExportOptions, LossConfig, ModelSplit

    model_dir = tmp_path / "model"
    _save_tiny_llama_dir(model_dir)
    loss = LossConfig(alpha=(0.5, 0.7, 1.0), translator_rank=2)  # identity translators: no lens fitting
    run_dir = run_training(settings(tmp_path / "run", data_file, split=ModelSplit(str(model_dir)),
                                    export=ExportOptions(micro_batch=BATCH, loss=loss)), say=lambda line: None).run_dir
    manifest = json.loads((run_dir / "manifest.json").read_text())
    for st in manifest["stages"]:
        start = next(r for r in read_lines(run_dir / "stages" / f"stage_{st['index']}" / "metrics.jsonl")
                     if r["type"] == "start")
        assert start["weights"] == f"dir:{model_dir} (layers {st['layers'][0]}-{st['layers'][1]})", start["weights"]
    assert_adapter_equals_eager(run_dir)


@pytest.mark.slow
def test_run_directory_serves_merge_eval_and_report(torch_run, tmp_path):
    from zl.commands.merge import merge_command
    from zl_device.results.report import build_report

    run_dir = torch_run.run_dir
    for name in ("manifest.json", "torch_job.json", "metrics.jsonl", "eval.json", "report.md", "report.json",
                 "plots/loss.png", "adapter/adapter_config.json", "adapter/zl_merge.json"):
        assert (run_dir / name).is_file(), name
    windows = SAMPLES // BATCH // WINDOW
    for k in range(3):
        latest = run_dir / "checkpoints" / f"stage_{k}" / f"window_{windows - 1:06d}"
        progress = json.loads((latest / "progress.json").read_text())
        assert (progress["stage"], progress["window"], progress["optimizer_step"]) == (k, windows - 1, windows)
        assert progress["micro_batches_done"] == progress["extra"]["num_micro_batches"] == SAMPLES // BATCH
        moments = load_file(str(latest / "optimizer.safetensors"))
        assert set(moments) == {f"{n}.{m}" for n in load_file(str(latest / "adapter.safetensors"))
                                for m in ("exp_avg", "exp_avg_sq")}
    # `zl merge` on the run's checkpoints gives the adapter the run wrote.
    app = typer.Typer(add_completion=False)
    app.command("merge")(merge_command)
    out = tmp_path / "adapter"
    result = CliRunner().invoke(app, ["--checkpoints", str(run_dir / "checkpoints"), "--manifest",
                                      str(run_dir / "manifest.json"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    again, run = (load_file(str(d / "adapter_model.safetensors")) for d in (out, run_dir / "adapter"))
    assert again.keys() == run.keys() and all(torch.equal(again[n], run[n]) for n in run)
    # The report: every stage saw every micro-batch once; losses per window; the run event's span.
    report = build_report(run_dir)
    assert [s["micro_batches"] for s in report["stages"]] == [SAMPLES // BATCH] * 3
    assert report["run"]["samples"] == SAMPLES and report["run"]["records_per_s"] > 0
    lines = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for k in range(3):
        window_lines = [r for r in lines if r["type"] == "window" and r["stage"] == k]
        assert [r["window"] for r in window_lines] == list(range(windows))
        assert all(r["mean_loss"] > 0 and r["lr"] > 0 for r in window_lines)
        assert all(r["phase1_ms"] > 0 for r in lines if r["type"] == "micro_batch" and r["stage"] == k)
    assert json.loads((run_dir / "eval.json").read_text())["adapter"]["nll"] > 0


@pytest.mark.slow
def test_a_killed_rank_fails_the_run_with_a_clear_error(data_file, tmp_path):
    """SIGKILL stage 1 in the middle of a run with no restarts left: the run ends in bounded time naming the
    stage, no rank left."""
    from zl_device.run.train_job import run_training

    out = tmp_path / "run"
    errors: list[BaseException] = []

    def train():
        try:
            run_training(settings(out, data_file, samples=400, link_timeout_s=60, max_restarts=0),
                         say=lambda line: None)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors.append(e)

    worker = threading.Thread(target=train)
    worker.start()
    metrics = out / "stages" / "stage_1" / "metrics.jsonl"
    deadline = time.time() + 300
    pid = None
    while time.time() < deadline and pid is None:
        lines = [json.loads(ln) for ln in metrics.read_text().splitlines()] if metrics.is_file() else []
        if any(r["type"] == "micro_batch" for r in lines):
            pid = next(r["pid"] for r in lines if r["type"] == "start")
        time.sleep(0.2)
    assert pid is not None, "stage 1 never trained"
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    worker.join(120)
    assert not worker.is_alive(), "the run hung after a rank died"
    assert time.time() - killed < 60
    assert len(errors) == 1 and isinstance(errors[0], ZLError), errors
    # Whoever the launcher sees fail first: stage 1 killed, or a neighbour that lost its connection to stage 1.
    assert "stage 1" in str(errors[0]), errors[0]
    starts = [json.loads(ln) for k in (0, 2) for ln in (out / "stages" / f"stage_{k}" / "metrics.jsonl").read_text()
              .splitlines() if json.loads(ln)["type"] == "start"]
    for record in starts:
        with pytest.raises(ProcessLookupError):
            os.kill(record["pid"], 0)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines()]


def assert_same_adapter(run_dir: Path, want_dir: Path) -> None:
    got, want = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (run_dir, want_dir))
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.slow
def test_a_failed_rank_restarts_every_rank_to_the_same_adapter(torch_run, data_file, tmp_path):
    """Stage 1 SIGKILLs itself in window 2 (--inject-failure 1@2): every rank starts again, resumes from the
    latest window all committed and replays, as torch elastic restarts a group; the adapter is the clean run's,
    bit for bit, and the report shows the recovery."""
    from zl_device.run.train_job import run_training

    out = tmp_path / "run"
    said: list[str] = []
    result = run_training(settings(out, data_file, inject_failure="1@2"), say=said.append)
    assert "stage 1 died (signal 9): restarting every rank from the latest window all stages checkpointed" in said
    assert_same_adapter(out, torch_run.run_dir)
    lines = read_jsonl(out / "metrics.jsonl")
    starts = {k: [r for r in lines if r["type"] == "start" and r["stage"] == k] for k in range(3)}
    assert all(len(s) == 2 and s[0]["resumed_from_window"] is None for s in starts.values())
    (resumed,) = {s[1]["resumed_from_window"] for s in starts.values()}
    assert resumed in (0, 1)  # one common window, before the failure's
    failure, restart, recovered = (next(r for r in lines if r["type"] == t) for t in ("failure", "restart", "recovered"))
    assert failure["stage"] == 1 and failure["window"] == 2 and failure["micro_batch"] == 4  # killed before mb 4
    assert restart["scope"] == "global" and restart["rolled_back_to_window"] == resumed
    # Stage 1 replays its micro-batches after the common window; its neighbours as far as each had got (≤ 6).
    first = WINDOW * (resumed + 1)
    assert 4 - first <= restart["replayed_micro_batches"] <= 3 * (SAMPLES // BATCH - first)
    assert recovered["downstream_stage"] == 2 and recovered["window"] == 2 and recovered["recovery_ms"] > 0
    (entry,) = result.report["recovery"]
    assert entry["stage"] == 1 and entry["recovery_ms"] == recovered["recovery_ms"]
    assert result.report["run"]["samples"] == SAMPLES


@pytest.mark.slow
def test_resume_after_an_injected_failure_ends_identical(torch_run, data_file, tmp_path):
    """With no restarts left (--max-restarts 0) stage 1's failure in window 2 ends the run; `--resume` rolls every
    stage back to the latest window all committed and replays: the adapter is the clean run's, bit for bit."""
    from zl_device.run.train_job import run_training

    out = tmp_path / "run"
    with pytest.raises(ZLError, match="stage 1"):
        run_training(settings(out, data_file, inject_failure="1@2", max_restarts=0), say=lambda line: None)
    said: list[str] = []
    result = run_training(settings(out, data_file, resume=True), say=said.append)
    assert said[0] == f"resume: {out.resolve()} from the latest window every stage checkpointed"
    lines = read_jsonl(out / "metrics.jsonl")
    starts = {k: [r for r in lines if r["type"] == "start" and r["stage"] == k] for k in range(3)}
    assert all(len(s) == 2 and s[0]["resumed_from_window"] is None for s in starts.values())
    resumed = {s[1]["resumed_from_window"] for s in starts.values()}
    assert len(resumed) == 1 and resumed.pop() in (0, 1)  # one common window, before the failure's
    assert_same_adapter(out, torch_run.run_dir)
    assert result.report["run"]["samples"] == SAMPLES


@pytest.mark.slow
def test_torchrun_runs_the_prepared_job_to_the_same_adapter(torch_run, data_file, tmp_path):
    """`--launcher torchrun` prepares the run; torchrun's ranks train what the spawned ranks trained, bit for bit,
    through an elastic restart: stage 1 SIGKILLs itself in window 2, torchrun (--max-restarts) starts every rank
    again and they resume from the latest window all committed."""
    from zl_device.results.adapter import merge_checkpoints
    from zl_device.run.train_job import run_training

    said: list[str] = []
    run_dir = run_training(settings(tmp_path / "run", data_file, launcher="torchrun", inject_failure="1@2"),
                           say=said.append).run_dir
    command = next(line.strip() for line in said if line.strip().startswith("torchrun "))
    assert "--max-restarts 3 " in command
    assert command.endswith(f"-m zl_device.torch {run_dir / 'torch_job.json'}")
    assert not (run_dir / "checkpoints").exists(), "nothing ran yet"
    args = command.split()[1:]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    starts = [r for r in read_jsonl(run_dir / "stages" / "stage_1" / "metrics.jsonl") if r["type"] == "start"]
    assert [r["resumed_from_window"] is None for r in starts] == [True, False], "one restart, resumed"
    merge_checkpoints(run_dir / "checkpoints", run_dir / "manifest.json", run_dir / "adapter")
    assert_same_adapter(run_dir, torch_run.run_dir)


# --- fast: no ranks -----------------------------------------------------------------------------------


def test_torch_checkpoints_merge_like_the_runners(tmp_path):
    """save_checkpoint writes what `zl merge` reads; keep_last prunes the oldest windows."""
    from zl_device.results.adapter import merge_checkpoints
    from zl_device.torch.checkpoint import save_checkpoint

    from manifest_fixtures import LORA_A, fake_manifest
    from zl_export.manifest import write_manifest

    names = {k: LORA_A.format(k=k) for k in (0, 1)}
    write_manifest(fake_manifest([(0, 0), (1, 1)], files=False), tmp_path)
    root = tmp_path / "checkpoints"
    last = {}
    for k in (0, 1):
        for w in range(3):
            t = torch.full((2, 4), float(10 * k + w))
            last[names[k]] = t
            moments = {f"{names[k]}.exp_avg": t + 1, f"{names[k]}.exp_avg_sq": t + 2}
            save_checkpoint(root / f"stage_{k}", w, {names[k]: t}, moments,
                            {"run_id": "ab" * 16, "stage": k, "window": w, "last_micro_batch": 2 * w + 1,
                             "micro_batches_done": 2 * w + 2, "optimizer_step": w + 1, "lr": 0.1,
                             "extra": {"runtime": "torch", "num_micro_batches": 6, "window_size": 2}}, keep_last=2)
        assert sorted(p.name for p in (root / f"stage_{k}").iterdir()) == ["window_000001", "window_000002"]
    merged = merge_checkpoints(root, tmp_path / "manifest.json", tmp_path / "adapter")
    assert merged.window == 2 and merged.finished and merged.run_id == "ab" * 16
    got = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert all(torch.equal(got[n], t) for n, t in last.items()) and got.keys() == last.keys()


def test_an_optimizer_file_marked_zero_reads_as_zero_moments(tmp_path):
    """The runner stores a held stage's moments (all zero) as an optimizer file without tensors, marked
    moments: zero (docs/design#checkpoints-on-disk): read_checkpoint gives zeros of the adapter's shapes."""
    from safetensors.torch import save_file

    from zl_device.torch.checkpoint import read_checkpoint

    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    where = tmp_path / "window_000000"
    where.mkdir()
    save_file({name: torch.ones(2, 4)}, str(where / "adapter.safetensors"), metadata={"format": "pt"})
    save_file({}, str(where / "optimizer.safetensors"), metadata={"format": "pt", "moments": "zero"})
    (where / "progress.json").write_text(json.dumps({"run_id": "ab" * 16, "stage": 0, "window": 0}))
    tensors, moments, _ = read_checkpoint(where, "ab" * 16, 0)
    assert moments.keys() == {f"{name}.exp_avg", f"{name}.exp_avg_sq"}
    assert all(torch.equal(m, torch.zeros(2, 4)) for m in moments.values())


def test_a_torch_stage_that_diverges_stops_naming_stage_and_window(data_file, tmp_path, one_torch_thread):
    """Issue 43: a window whose loss or weights go nan or inf is not checkpointed; the run stops at once (a ZLError
    in a rank is not retried) naming the stage, the window and the last good checkpoint."""
    from dataclasses import replace

    from zl_device.run.train_job import run_training
    from zl_export.options import ExportOptions, ModelSplit

    # Two ranks, not three, on the plain local loss: every rank starts torch and builds its stage first.
    s = settings(tmp_path / "run", data_file, split=ModelSplit("tiny-random", "0-1,2-3"), stage_lr=(1.0, 1.0),
                 export=ExportOptions(micro_batch=BATCH))
    s = replace(s, optimizer=replace(s.optimizer, lr=1e30))
    with pytest.raises(ZLError, match=r"--runtime torch: stage (\d) failed: stage \1 window \d+: (the mean loss is nan|"
                                      r"after the AdamW step: \S+ holds \d+ non-finite).*; not checkpointed; the stage "
                                      r"stops with its last good checkpoint \((window \d+|none yet)\)"):
        run_training(s, say=lambda line: None)


def test_a_resumed_torch_stage_refuses_a_non_finite_checkpoint(tmp_path):
    """Issue 43: a window whose weights (or AdamW moments) are nan or inf is a damaged run; a restarted rank must not
    train on from it."""
    from safetensors.torch import save_file

    from zl_device.torch.checkpoint import read_checkpoint

    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    where = tmp_path / "window_000003"
    where.mkdir()
    save_file({name: torch.ones(2, 4)}, str(where / "adapter.safetensors"))
    save_file({f"{name}.exp_avg": torch.zeros(2, 4), f"{name}.exp_avg_sq": torch.full((2, 4), float("inf"))},
              str(where / "optimizer.safetensors"))
    (where / "progress.json").write_text(json.dumps({"run_id": "ab" * 16, "stage": 1, "window": 3}))
    with pytest.raises(ZLError, match=r"^stage 1 window 3: checkpoint file .*window_000003/optimizer.safetensors: "
                                      r".*exp_avg_sq holds 8 non-finite value\(s\) \(inf\) of 8.*start it again"):
        read_checkpoint(where, "ab" * 16, 1)


@pytest.mark.parametrize("change, problem", [
    ({"spares": 1}, "--spares is not supported with --runtime torch"),
    ({"recovery": "local"}, "--recovery local is not supported with --runtime torch .a failed rank restarts every"),
    ({"devices": "R58M123,R58M456,R58M789"}, "runs its stages as processes on this host"),
])
def test_options_the_torch_runtime_lacks_are_clear_errors(tmp_path, change, problem):
    from zl_device.run.torch_runtime import check_torch_settings
    from zl_device.run.train_settings import TrainSettings

    with pytest.raises(ZLError, match=problem):
        check_torch_settings(TrainSettings(runtime="torch", **change))
    check_torch_settings(TrainSettings(runtime="torch"))  # the defaults are fine
    assert TrainSettings(runtime="torch").recovery == "global" and TrainSettings(schedule="zerolock").recovery == "local"
    assert TrainSettings().recovery is None  # until the data chooses the schedule (TrainSettings.with_schedule_for)


def test_a_restarted_attempt_resumes_without_the_injected_failure():
    from zl_device.torch.job import TorchJob, for_attempt

    job = TorchJob(model="tiny-random", manifest="m.json", shard="s.safetensors", run_id="ab" * 16, window_size=2,
                   num_micro_batches=6, micro_batch=2, lr=[0.1], weight_decay=0.0, schedule={},
                   checkpoint_dir="c", metrics_dir="m", fail_at=[1, 4])
    assert for_attempt(job, 0) is job
    again = for_attempt(job, 2)
    assert again.resume and again.fail_at is None and again.run_id == job.run_id and not job.resume


def test_recovery_events_come_from_the_ranks_telemetry(tmp_path):
    """A failure of stage 1 mid-window 1 (window 2, 3 stages), the ranks restarted from window 0: the failure,
    restart and recovered events `zl report` reads, from the stages' lines."""
    from zl_device.results.report import build_report
    from zl_device.formats.metrics_log import merge_metrics
    from zl_device.formats.run_layout import RunLayout
    from zl_device.torch.launcher import RankFailure, recovery_events
    from zl_device.formats.windows import WindowPlan

    def start(k, t, first, resumed):
        return {"type": "start", "stage": k, "t_unix_ms": t, "first_micro_batch": first, "resumed_from_window": resumed}

    def mb(k, t, i):
        return {"type": "micro_batch", "stage": k, "t_unix_ms": t, "window": i // 2, "micro_batch": i, "loss": 1.0}

    def window(k, t, w):
        return {"type": "window", "stage": k, "t_unix_ms": t, "window": w, "pss_mib": 1.0}

    done = {0: [0, 1, 2, 3], 1: [0, 1, 2], 2: [0, 1]}  # stage 0 ran ahead; stage 1 died before its 4th
    for k in range(3):
        lines = [start(k, 100, 0, None)] + [mb(k, 200 + 10 * i, i) for i in done[k]]
        lines += [window(k, 205 + 10 * 1, 0)] if len(done[k]) >= 2 else []
        lines += [start(k, 1000, 2, 0)] + [mb(k, 1100 + 10 * i, i) for i in range(2, 6)]
        lines += [window(k, 1135, 1), window(k, 1155, 2)]
        path = tmp_path / "stages" / f"stage_{k}" / "metrics.jsonl"
        path.parent.mkdir(parents=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    events = recovery_events(tmp_path, 3, WindowPlan(6, 2), [RankFailure(1, "died (signal 9)", 300, 400)])
    failure, restart, recovered = events
    assert failure == {"type": "failure", "stage": 1, "t_unix_ms": 300, "detected_after_ms": None, "window": 1,
                       "micro_batch": 3, "reason": "died (signal 9)"}
    assert restart["rolled_back_to_window"] == 0 and restart["scope"] == "global"
    assert restart["replayed_micro_batches"] == (4 - 2) + (3 - 2) + (2 - 2)
    assert recovered["downstream_stage"] == 2 and recovered["t_unix_ms"] == 1135 and recovered["window"] == 1
    assert recovered["recovery_ms"] == 1135 - 400 and recovered["since_failure_ms"] == 1135 - 300
    merge_metrics(RunLayout(tmp_path), 3, events)
    (entry,) = build_report(tmp_path)["recovery"]
    assert entry["stage"] == 1 and entry["replayed_micro_batches"] == 3 and entry["recovery_ms"] == 735


def test_link_timeout_and_launcher_are_checked(tmp_path):
    from zl_device.run.train_job import resumed_settings
    from zl_device.run.train_settings import TrainSettings

    with pytest.raises(ZLError, match="--link-timeout 0: must be a positive number"):
        TrainSettings(runtime="torch", link_timeout_s=0).validate()
    with pytest.raises(ZLError, match="--max-restarts -1: must be 0 .fail at the first failure. or more"):
        TrainSettings(runtime="torch", max_restarts=-1).validate()
    with pytest.raises(ZLError, match="--launcher torchrun: launchers start torch.distributed ranks; add --runtime torch"):
        TrainSettings(launcher="torchrun").validate()
    # --resume works for both runtimes; it needs the directory of an unfinished run.
    with pytest.raises(ZLError, match="no train_settings.json there"):
        resumed_settings(TrainSettings(resume=True, out=tmp_path))


def test_torchrun_entry_point_needs_torchrun_and_a_job(tmp_path, monkeypatch, capsys):
    from zl_device.torch.harness import main
    from zl_device.torch.job import TorchJob

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert main([str(tmp_path / "torch_job.json")]) == 2
    assert "start the ranks with torchrun" in capsys.readouterr().err
    (tmp_path / "torch_job.json").write_text("{}")
    with pytest.raises(ZLError, match=r"torch_job.json \(torch_job.json\): \"model\" is missing; `zl train "
                                      r"--runtime torch` writes one"):
        TorchJob.load(tmp_path / "torch_job.json")


def test_backend_is_nccl_only_with_a_gpu_per_rank(monkeypatch):
    from zl_device.torch import harness

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert harness.backend_and_device("auto", 1, 2) == ("nccl", torch.device("cuda", 1))
    assert harness.backend_and_device("auto", 1, 3) == ("gloo", torch.device("cpu"))
    with pytest.raises(ZLError, match="3 ranks on this host but 2 GPU"):
        harness.backend_and_device("nccl", 0, 3)
    with pytest.raises(ZLError, match="backend 'mpi'"):
        harness.backend_and_device("mpi", 0, 1)


def test_rank_watch_reads_progress_from_complete_lines(tmp_path):
    from zl_device.run.torch_runtime import RankWatch

    path = tmp_path / "stage_0" / "metrics.jsonl"
    path.parent.mkdir()
    watch = RankWatch(tmp_path, 2)
    assert [st.state for st in watch.poll()] == ["starting", "starting"]
    lines = [{"type": "start", "stage": 0}, {"type": "micro_batch", "stage": 0, "micro_batch": 0, "loss": 5.5},
             {"type": "micro_batch", "stage": 0, "micro_batch": 1, "loss": 5.25}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"type": "window", "sta')  # one line half-written
    st = watch.poll()[0]
    assert (st.state, st.micro_batches_done, st.last_loss, st.last_committed_window) == ("running", 2, 5.25, -1)
    with open(path, "a") as f:
        f.write('ge": 0, "window": 0, "pss_mib": 300.5}\n{"type": "done", "stage": 0}\n')
    st = watch.poll()[0]
    assert (st.state, st.last_committed_window, st.pss_mib, st.micro_batches_done) == ("done", 0, 300.5, 2)
    assert st.restarts == 0
    with open(path, "a") as f:  # the ranks restarted
        f.write('{"type": "start", "stage": 0}\n')
    assert watch.poll()[0].restarts == 1


def test_training_peak_rss_leaves_out_what_set_up_held_and_freed():
    """peak_rss_mib counts from reset_peak_rss: 400 MiB touched and freed before it are not in it, 200 MiB touched
    after it are (the done lines' train_peak_rss_mib, per rank in tools/bench_pipelines.py)."""
    import numpy as np

    from zl_device.torch.stage_io import peak_rss_mib, reset_peak_rss

    if peak_rss_mib() is None:
        pytest.skip("no /proc/self/status VmHWM here")
    reset_peak_rss()  # this test process's earlier peaks out of the way
    start = peak_rss_mib()
    setup = np.ones(400 * 2**20 // 8)  # touched: resident
    del setup
    forgotten = reset_peak_rss()
    after_reset = peak_rss_mib()
    training = np.ones(200 * 2**20 // 8)
    peak = peak_rss_mib()
    del training
    assert forgotten >= start + 390, (start, forgotten)  # the set-up peak, returned
    assert after_reset < forgotten - 300, (forgotten, after_reset)  # and no longer counted
    assert peak >= after_reset + 190, (after_reset, peak)


def _link_rank(rank: int, init: str, receive_ahead: bool, out: str) -> None:
    """Stage 0 sends three entries and flushes; stage 1 is 'busy' for 1.5 s before it asks for them."""
    import torch.distributed as dist

    from zl_device.torch.link import StageLink

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    link = StageLink(rank, 2, 1, 8, torch.device("cpu"), depth=4, timeout_s=30, receive_ahead=receive_ahead)
    times = {}
    if rank == 0:
        for mb in range(3):
            link.send(mb, torch.full((1, 5, 8), float(mb)), torch.ones(1, 5, dtype=torch.int64),
                      torch.full((1, 5), mb, dtype=torch.int64))
        link.flush()
        times["flushed"] = time.time()
    else:
        link.start_receiving(0, 3)
        time.sleep(1.5)  # phase 2 of an earlier micro-batch
        times["asked"] = time.time()
        for mb in range(3):
            hidden, mask, labels = link.receive(mb, more=mb < 2)
            assert hidden.shape == (1, 5, 8) and float(hidden[0, 0, 0]) == mb and int(labels[0, 0]) == mb
    Path(out, f"{rank}.json").write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("receive_ahead", [True, False])
def test_on_gloo_entries_land_while_the_receiver_computes(tmp_path, receive_ahead):
    """With the receiving thread the sender's flush (before its commit) returns while stage 1 is still busy, as
    with the runner's peer link; without it gloo moves nothing until stage 1 asks, and the sender waits."""
    import torch.multiprocessing as mp

    from zl_device.devices.network import free_port_base

    mp.start_processes(_link_rank, args=(f"tcp://127.0.0.1:{free_port_base(1)}", receive_ahead, str(tmp_path)),
                       nprocs=2, start_method="spawn")
    flushed = json.loads((tmp_path / "0.json").read_text())["flushed"]
    asked = json.loads((tmp_path / "1.json").read_text())["asked"]
    assert (flushed < asked - 0.5) == receive_ahead, (flushed, asked)


@pytest.mark.slow
def test_a_backprop_schedule_trains_through_zl_train_as_eager_backprop(data_file, tmp_path, one_torch_thread):
    """`zl train --runtime torch --schedule gpipe`: the ranks run the table's GPipe, and the run's adapter is what
    whole-model backprop of the same model (its frozen weights stored as the run's), micro-batches, LoRA
    initialisation and AdamW schedule gives in one process; merge and report take the run as any other."""
    from zl_device.run.train_job import run_training
    from zl_device.torch.eager_training import Budget, OptimizerSettings, train_backprop
    from zl_export.exporter import build_stage_modules
    from zl_export.model_source import load_model
    from zl_export.options import ExportOptions
    from zl_export.shard import load_shard
    from zl_export.stages import StageRange

    run = run_training(settings(tmp_path / "run", data_file, schedule="gpipe", stage_lr=(1.0,),
                                export=ExportOptions(micro_batch=BATCH)), say=lambda line: None)
    run_dir = run.run_dir
    job = json.loads((run_dir / "torch_job.json").read_text())
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert job["pipeline"] == "gpipe" and (run_dir / "report.md").is_file()
    peft_model, _ = build_stage_modules(load_model(manifest["model"]["name"], seed=manifest["seed"]).model,
                                        [StageRange(st["index"], *st["layers"]) for st in manifest["stages"]],
                                        ExportOptions.from_manifest(manifest))
    train_backprop(peft_model, load_shard(run_dir / "data" / "train.safetensors"),
                   Budget(job["num_micro_batches"] * BATCH, job["window_size"], BATCH),
                   OptimizerSettings.from_config({"lr": job["lr"][0], "weight_decay": job["weight_decay"],
                                                  "schedule": job["schedule"]}))
    want = {n: p.detach() for n, p in peft_model.named_parameters() if "lora_" in n}
    merged = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    assert len(merged) == len(want)
    for name, t in merged.items():
        key = next(n for n in want if n.replace(".default", "") == name)
        torch.testing.assert_close(t, want[key], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert any(t.abs().max() > 1e-3 for n, t in merged.items() if "lora_B" in n), "nothing moved"
