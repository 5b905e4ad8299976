"""The stage runner end to end: `zl_runner` processes on localhost against a PyTorch eager reference.

Each test exports tiny-random stage programs (seq_len 16), makes a demo shard,
starts one `zl_runner` per stage (last stage first, each listening on a free
port) and reads the LoRA parameters of the final checkpoint of every stage
(`window_*/adapter.safetensors`, PEFT names). The reference runs the same
pipeline in eager PyTorch: every stage's local loss, mean gradient over each
window, `torch.optim.AdamW` + `LambdaLR` with the runner's schedule.

    cmake --build build -j2 --target zl_runner zl_runner_tests
    .venv/bin/python -m pytest tests/test_runner.py            # fast ones
    .venv/bin/python -m pytest tests/test_runner.py -m slow    # 2 stages, more windows

The runner binary is build/runner/zl_runner (override with
$ZL_RUNNER_BIN); the programs need the marker kernel (build/custom_ops, or
$ZL_CUSTOM_OPS_LIB).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from conftest import REPO, native_library_or_skip

from zl_device.formats.lr_schedule import lr_factor

SEQ_LEN = 16
RUN_ID = "0123456789abcdef0123456789abcdef"
RUN_KEY = "5a" * 32
OPTIMIZER = {"lr": 2e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
             "schedule": {"kind": "warmup_cosine", "warmup_steps": 1, "min_lr_ratio": 0.1}}
PROCESS_TIMEOUT_S = 120


def runner_bin() -> Path:
    return Path(os.environ.get("ZL_RUNNER_BIN", REPO / "build" / "runner" / "zl_runner")).resolve()


@pytest.fixture(scope="module")
def runner() -> Path:
    path = runner_bin()
    if not path.is_file():
        pytest.skip(f"{path} not built; run `cmake --build build -j2 --target zl_runner` (or set ZL_RUNNER_BIN)")
    native_library_or_skip()
    return path


# --- programs and data -----------------------------------------------------------------------------------


def export_programs(out: Path, num_stages: int) -> Path:
    """`zl export --model tiny-random --num-stages K --seq-len 16`, in-process."""
    from custom_ops import load_library
    from zl_export.exporter import build_stage_modules, export_stage, write_program
    from zl_export.options import ExportOptions
    from zl_export.manifest import build_manifest, write_manifest
    from zl_export.model_source import load_model
    from zl_export.stages import balanced_split

    load_library()
    loaded = load_model("tiny-random", seed=0)
    opts = ExportOptions(seq_len=SEQ_LEN, micro_batch=1, seed=0)
    stages = balanced_split(loaded.config.num_hidden_layers, num_stages)
    peft_model, modules = build_stage_modules(loaded.model, stages, opts)
    entries = [write_program(export_stage(m, peft_model, opts, loaded.config.vocab_size), out) for m in modules]
    write_manifest(build_manifest(loaded, opts, entries), out)
    return out


@pytest.fixture(scope="session")
def export3(tmp_path_factory) -> Path:
    native_library_or_skip()
    return export_programs(tmp_path_factory.mktemp("export3"), 3)


@pytest.fixture(scope="session")
def shard(tmp_path_factory) -> Path:
    """The demo task's train shard at seq_len 16 (`zl data --demo`, prompts cut from the left)."""
    out = tmp_path_factory.mktemp("data")
    proc = subprocess.run(
        [sys.executable, "-m", "zl.cli", "data", "--demo", "--model", "tiny-random", "--out", str(out),
         "--seq-len", str(SEQ_LEN), "--truncate", "--split", "train"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out / "train.safetensors"


# --- running a pipeline ----------------------------------------------------------------------------------


@dataclass
class Pipeline:
    """One localhost run: a directory with a config, logs and checkpoints per stage."""

    runner: Path
    export_dir: Path
    shard: Path
    run_dir: Path
    num_stages: int
    num_micro_batches: int
    window_size: int
    early_forwarding: bool = True
    link_profile: str = "local"
    optimizer: dict = field(default_factory=lambda: dict(OPTIMIZER))
    overrides: dict[int, dict] = field(default_factory=dict)  # extra config fields per stage
    commands: dict[int, list[str]] = field(default_factory=dict)  # a stage's command instead of the runner
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)
    starts: dict[int, int] = field(default_factory=dict)

    def config_path(self, k: int) -> Path:
        return self.run_dir / f"stage{k}.json"

    def config(self, k: int) -> dict:
        cfg = {
            "program": str(self.export_dir / f"stage_{k}.pte"),
            "stage_index": k,
            "num_stages": self.num_stages,
            "run_key_file": "run.key",
            "run_id": RUN_ID,
            "window_size": self.window_size,
            "num_micro_batches": self.num_micro_batches,
            "in_flight_depth": 2,
            "checkpoint_dir": f"ckpt{k}",
            "log_path": f"metrics{k}.jsonl",
            "early_forwarding": self.early_forwarding,
            "link_profile": self.link_profile,
            "input_timeout_s": 60,
            "threads": 1,
            "optimizer": self.optimizer,
        }
        if k == 0:
            cfg["data_shard"] = str(self.shard)
        if k > 0:
            cfg["listen"] = "127.0.0.1:0"
        cfg.update(self.overrides.get(k, {}))
        return cfg

    def edit_config(self, k: int, **changes) -> None:
        """Change fields of a written config (None removes one), e.g. before a restart."""
        cfg = json.loads(self.config_path(k).read_text())
        for key, value in changes.items():
            if value is None:
                cfg.pop(key, None)
            else:
                cfg[key] = value
        self.config_path(k).write_text(json.dumps(cfg, indent=2))

    def wait_for(self, predicate, what: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}")
            for k, proc in self.procs.items():
                if proc.poll() not in (None, 0):
                    pytest.fail(f"stage {k} exited with {proc.returncode} while waiting for {what}:\n{self.stderr(k)}")
            time.sleep(0.005)

    def events(self, k: int, kind: str) -> list[dict]:
        """Telemetry events of one type so far (a line being written is skipped)."""
        path = self.run_dir / f"metrics{k}.jsonl"
        out = []
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if event.get("type") == kind:
                out.append(event)
        return out

    def park(self, victim: int, micro_batch: int) -> None:
        """Wait until `victim` holds at `micro_batch` (hold_at_micro_batch) and downstream has consumed it."""
        self.wait_for(lambda: self.events(victim, "hold"), f"stage {victim} to hold at micro-batch {micro_batch}")
        if victim < self.num_stages - 1:
            self.wait_for(lambda: micro_batch in micro_batches_logged(self.run_dir / f"metrics{victim + 1}.jsonl"),
                          f"stage {victim + 1} to consume micro-batch {micro_batch}")

    def start_all(self) -> None:
        """Start the last stage first; each upstream gets the port its downstream reported."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "run.key").write_text(RUN_KEY + "\n")
        downstream_port = None
        for k in reversed(range(self.num_stages)):
            cfg = self.config(k)
            if downstream_port is not None:
                cfg["downstream"] = f"127.0.0.1:{downstream_port}"
            self.config_path(k).write_text(json.dumps(cfg, indent=2))
            self.start(k)
            if k > 0:
                downstream_port = self.wait_port(k)
                # A restarted stage must come back on the port its upstream knows.
                cfg["listen"] = f"127.0.0.1:{downstream_port}"
                self.config_path(k).write_text(json.dumps(cfg, indent=2))

    def start(self, k: int, resume: bool = False) -> None:
        n = self.starts.get(k, 0)
        self.starts[k] = n + 1
        command = self.commands.get(k, [str(self.runner)])
        args = command + ["--config", str(self.config_path(k))] + (["--resume"] if resume else [])
        self.procs[k] = subprocess.Popen(
            args, cwd=self.run_dir, stdout=open(self.run_dir / f"stdout{k}.{n}", "w"),
            stderr=open(self.run_dir / f"stderr{k}.{n}", "w"),
        )

    def wait_port(self, k: int) -> int:
        path = self.run_dir / f"stdout{k}.{self.starts[k] - 1}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for line in path.read_text().splitlines():
                event = json.loads(line)
                if event.get("event") == "listening":
                    return int(event["port"])
            if self.procs[k].poll() is not None:
                pytest.fail(f"stage {k} exited with {self.procs[k].returncode}: {self.stderr(k)}")
            time.sleep(0.02)
        pytest.fail(f"stage {k} did not report its port: {self.stderr(k)}")

    def stderr(self, k: int) -> str:
        return (self.run_dir / f"stderr{k}.{self.starts[k] - 1}").read_text()[-3000:]

    def wait_all(self) -> None:
        deadline = time.monotonic() + PROCESS_TIMEOUT_S
        try:
            for k, proc in sorted(self.procs.items()):
                rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                assert rc == 0, f"stage {k} exited with {rc}:\n{self.stderr(k)}"
        finally:
            self.kill_all()

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def metrics(self, k: int) -> list[dict]:
        path = self.run_dir / f"metrics{k}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def final_adapter(self, k: int) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        windows = sorted((self.run_dir / f"ckpt{k}").glob("window_*"))
        assert windows, f"stage {k} wrote no checkpoint"
        last = windows[-1]
        progress = json.loads((last / "progress.json").read_text())
        assert progress["micro_batches_done"] == self.num_micro_batches, progress
        return load_file(str(last / "adapter.safetensors"))

    def run(self) -> list[dict[str, torch.Tensor]]:
        self.start_all()
        self.wait_all()
        return [self.final_adapter(k) for k in range(self.num_stages)]


def make_pipeline(runner, export_dir, shard, tmp_path, name, **kw) -> Pipeline:
    num_stages = len(json.loads((export_dir / "manifest.json").read_text())["stages"])
    kw.setdefault("num_micro_batches", 12)
    kw.setdefault("window_size", 4)
    return Pipeline(runner, export_dir, shard, tmp_path / name, num_stages, **kw)


def micro_batches_logged(path: Path) -> list[int]:
    """Micro-batch ids in a telemetry file so far (a line being written is skipped)."""
    ids = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("type") == "micro_batch":
            ids.append(event["micro_batch"])
    return ids


# --- the eager reference ---------------------------------------------------------------------------------


def eager_reference(export_dir: Path, shard_path: Path, num_micro_batches: int, window_size: int,
                    optimizer: dict = OPTIMIZER) -> tuple[dict[str, torch.Tensor], list[list[float]]]:
    """The pipeline in PyTorch eager with local AdamW per stage.

    Returns:
        (final LoRA parameters by PEFT name, loss per micro-batch per stage)
    """
    from zl_export.exporter import build_stage_modules
    from zl_export.options import ExportOptions
    from zl_export.model_source import load_model
    from zl_export.shard import load_shard
    from zl_export.stages import StageRange

    manifest = json.loads((export_dir / "manifest.json").read_text())
    opts = ExportOptions.from_manifest(manifest)
    loaded = load_model(manifest["model"]["name"], seed=manifest["seed"])
    stages = [StageRange(s["index"], *s["layers"]) for s in manifest["stages"]]
    _, modules = build_stage_modules(loaded.model, stages, opts)
    num_windows = -(-num_micro_batches // window_size)
    optimizers, schedulers, params = [], [], []
    for module in modules:
        named = {n: p for n, p in module.named_parameters() if p.requires_grad}
        params.append(named)
        opt = torch.optim.AdamW(list(named.values()), lr=optimizer["lr"], betas=tuple(optimizer["betas"]),
                                eps=optimizer["eps"], weight_decay=optimizer["weight_decay"])
        optimizers.append(opt)
        schedulers.append(torch.optim.lr_scheduler.LambdaLR(
            opt, lambda t: lr_factor(t, optimizer["schedule"], num_windows)))
    data = load_shard(shard_path)
    batch = manifest["micro_batch"]
    batches = data.rows // batch
    losses, count = [], 0
    for mb in range(num_micro_batches):
        j = mb % batches
        x = data.input_ids[j * batch:(j + 1) * batch]
        mask = data.attention_mask[j * batch:(j + 1) * batch]
        labels = data.labels[j * batch:(j + 1) * batch]
        row = []
        for module in modules:
            outs = module(x, mask, labels)
            loss = outs[module.loss_output_index]
            loss.backward()
            row.append(float(loss))
            if not module.is_last:
                x = outs[0].detach()
        losses.append(row)
        count += 1
        if (mb + 1) % window_size == 0 or mb + 1 == num_micro_batches:
            for named, opt, sched in zip(params, optimizers, schedulers):
                for p in named.values():
                    p.grad /= count  # the runner steps on the MEAN gradient of the window
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
            count = 0
    final = {}
    for s, named in zip(manifest["stages"], params):
        by_program = {p["program_name"]: p["name"] for p in s["parameters"]}
        final.update({by_program[n]: p.detach().clone() for n, p in named.items()})
    return final, losses


# --- tests -----------------------------------------------------------------------------------------------


def test_stage_program_gtests(export3):
    """The C++ two-phase tests (tests/stage_program_test.cpp) on this session's 3-stage export."""
    binary = Path(os.environ.get("ZL_RUNNER_TESTS_BIN", runner_bin().parent / "zl_runner_tests"))
    if not binary.is_file():
        pytest.skip(f"{binary} not built; run `cmake --build build -j2 --target zl_runner_tests`")
    proc = subprocess.run([str(binary), "--gtest_filter=StageProgram*", "--gtest_brief=1"],
                          env={**os.environ, "ZL_TEST_EXPORT_DIR": str(export3)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "PASSED" in proc.stdout and "SKIPPED" not in proc.stdout, proc.stdout[-2000:]


def jni_host_classes() -> tuple[Path, Path]:
    """The JNI library and the compiled host-test classes (android_app/jni/CMakeLists.txt), or skip."""
    jni_dir = runner_bin().parent.parent / "android_app" / "jni"  # the build tree mirrors the sources
    library, classes = jni_dir / "libzl_jni.so", jni_dir / "host_test_classes"
    if not library.is_file() or not (classes / "com" / "zerolock" / "zl" / "AppStageDriver.class").is_file():
        pytest.skip(f"{library} or its host-test classes not built (needs a JDK); run `cmake --build build -j2`")
    return library, classes


def test_jni_bridge_host_check_on_a_real_export(export3, tmp_path):
    """The app's JNI surface from a JVM, including stopNative on a stage that loaded a real program and waits."""
    library, classes = jni_host_classes()
    proc = subprocess.run(["java", f"-Dzl.jni.library={library}", "-cp", str(classes), "com.zerolock.zl.JniHostCheck",
                           str(tmp_path)], env={**os.environ, "ZL_TEST_EXPORT_DIR": str(export3)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " 0 failed" in proc.stdout and "SKIP" not in proc.stdout, proc.stdout[-2000:]
    assert "PASS stopNative ends a running stage" in proc.stdout


def test_stage_run_through_the_app_native_path_trains_identically(runner, export3, shard, tmp_path):
    """Stage 1 run as the app runs it (JNI: startNative, statusNative polling) gives bit-identical adapters.

    It also leaves the files the host's app backend reads: runner.pid (the JVM's pid), the listening and done
    events in runner.out, runner.exit 0.
    """
    library, classes = jni_host_classes()
    binary = make_pipeline(runner, export3, shard, tmp_path, "binary", num_micro_batches=8).run()
    app = make_pipeline(runner, export3, shard, tmp_path, "app", num_micro_batches=8, commands={
        1: ["java", f"-Dzl.jni.library={library}", "-cp", str(classes), "com.zerolock.zl.AppStageDriver"]})
    adapters = app.run()
    for a, b in zip(binary, adapters):
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name
    run = app.run_dir
    assert (run / "runner.pid").read_text() == f"{app.procs[1].pid}\n"
    assert (run / "runner.exit").read_text() == "0\n"
    events = [json.loads(line)["event"] for line in (run / "runner.out").read_text().splitlines()]
    assert events == ["listening", "done"], events
    assert "app: stage 1 of 3" in (run / "runner.err").read_text()
    assert len(app.metrics(1)) > 8  # telemetry as from zl_runner: one line per micro-batch, window, done


def test_help_lists_every_config_field(runner):
    out = subprocess.run([str(runner), "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0
    for name in ("--config", "--resume", "program", "early_forwarding", "window_size", "input_timeout_s"):
        assert name in out.stdout


def test_three_stages_match_eager_reference(runner, export3, shard, tmp_path):
    """Final LoRA parameters of every stage (3 windows, warmup-cosine) equal eager AdamW's to rtol 1e-4."""
    pipe = make_pipeline(runner, export3, shard, tmp_path, "run")
    adapters = pipe.run()
    expected, eager_losses = eager_reference(export3, shard, pipe.num_micro_batches, pipe.window_size)

    got = {}
    for adapter in adapters:
        assert not set(adapter) & set(got), "two stages wrote the same parameter"
        got.update(adapter)
    assert set(got) == set(expected)
    moved = 0
    for name, want in expected.items():
        torch.testing.assert_close(got[name], want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
        moved += int("lora_B" in name and bool(want.abs().max() > 1e-4))
    assert moved > 0, "no lora_B moved: the comparison would not catch a runner that never steps"
    assert any(n.startswith("base_model.model.model.layers.3.") for n in got), "PEFT names carry global layer numbers"

    for k in range(pipe.num_stages):
        lines = [m for m in pipe.metrics(k) if m["type"] == "micro_batch"]
        assert [m["micro_batch"] for m in lines] == list(range(pipe.num_micro_batches))
        for m in lines:
            assert m["loss"] == pytest.approx(eager_losses[m["micro_batch"]][k], rel=1e-4)
            for key in ("phase1_ms", "phase2_ms", "queue_ms", "send_ms", "total_ms"):
                assert m[key] >= 0
            assert m["pss_mib"] is None or m["pss_mib"] > 0
        windows = [m for m in pipe.metrics(k) if m["type"] == "window"]
        assert [w["window"] for w in windows] == [0, 1, 2]
        assert [w["step"] for w in windows] == [1, 2, 3]
    # Committed windows leave no input-log entries behind.
    for k in (1, 2):
        assert not list((pipe.run_dir / f"ckpt{k}" / "input_log").glob("entry-*"))


def test_early_forwarding_off_gives_identical_parameters(runner, export3, shard, tmp_path):
    """Sending after phase 2 changes timing only: the adapters are bit-identical."""
    on = make_pipeline(runner, export3, shard, tmp_path, "on", num_micro_batches=8).run()
    off = make_pipeline(runner, export3, shard, tmp_path, "off", num_micro_batches=8, early_forwarding=False).run()
    for a, b in zip(on, off):
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name


def initial_parameters(export_dir: Path) -> dict[str, torch.Tensor]:
    """Every stage's LoRA parameters as exported (PEFT names): the values the programs start from."""
    from zl_export.exporter import build_stage_modules
    from zl_export.model_source import load_model
    from zl_export.options import ExportOptions
    from zl_export.stages import StageRange

    manifest = json.loads((export_dir / "manifest.json").read_text())
    loaded = load_model(manifest["model"]["name"], seed=manifest["seed"])
    _, modules = build_stage_modules(loaded.model, [StageRange(s["index"], *s["layers"]) for s in manifest["stages"]],
                                     ExportOptions.from_manifest(manifest))
    out = {}
    for s, module in zip(manifest["stages"], modules):
        by_program = {p["program_name"]: p["name"] for p in s["parameters"]}
        out.update({by_program[n]: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad})
    return out


@pytest.mark.parametrize("early", [True, False])
def test_a_stage_at_lr_0_runs_forward_only(runner, export3, shard, tmp_path, early):
    """Stages 0 and 1 at lr 0 (`--stage-lr 0,0,1`) run phase 1 only: they send, skip readout, loss and backward,
    and their weights and AdamW moments stay as exported while the step count goes on. Stage 2 sees the same hidden
    states as when they also ran phase 2 at lr 0 (forward_only_at_lr0 false): its losses and adapter are
    bit-identical."""
    from safetensors.torch import load_file

    held = {**OPTIMIZER, "lr": 0.0}
    fast = make_pipeline(runner, export3, shard, tmp_path, "forward-only", early_forwarding=early,
                         overrides={0: {"optimizer": held}, 1: {"optimizer": held}})
    full = make_pipeline(runner, export3, shard, tmp_path, "phase-2", early_forwarding=early,
                         overrides={k: {"optimizer": held, "forward_only_at_lr0": False} for k in (0, 1)})
    fast_adapters, full_adapters = fast.run(), full.run()

    initial = initial_parameters(export3)
    for k in (0, 1):
        for name, t in fast_adapters[k].items():
            assert torch.equal(t, initial[name]), f"stage {k} {name} moved"
        last = sorted((fast.run_dir / f"ckpt{k}").glob("window_*"))[-1]
        progress = json.loads((last / "progress.json").read_text())
        assert (progress["optimizer_step"], progress["lr"]) == (3, 0.0)
        moments = load_file(str(last / "optimizer.safetensors"))
        assert all(not m.any() for m in moments.values()), "a forward-only stage touched its AdamW moments"
        full_moments = load_file(str(sorted((full.run_dir / f"ckpt{k}").glob("window_*"))[-1] / "optimizer.safetensors"))
        assert any(m.any() for m in full_moments.values()), "phase 2 at lr 0 moves the moments (the comparison's arm)"
        assert "KernelCall failed" not in fast.stderr(k), fast.stderr(k)

        start = next(m for m in fast.metrics(k) if m["type"] == "start")
        assert start["forward_only"] is True and start["config"]["forward_only_at_lr0"] is True
        mbs = [m for m in fast.metrics(k) if m["type"] == "micro_batch"]
        assert [m["micro_batch"] for m in mbs] == list(range(fast.num_micro_batches))
        for m in mbs:
            assert m["forward_only"] is True and m["phase2_ms"] == 0 and m["phase1_ms"] > 0
            assert m["loss"] is None and m["task_loss"] is None and m["consistency_loss"] is None
        windows = [m for m in fast.metrics(k) if m["type"] == "window"]
        assert [(w["step"], w["lr"], w["mean_loss"], w["forward_only"]) for w in windows] == [
            (1, 0.0, None, True), (2, 0.0, None, True), (3, 0.0, None, True)]
        full_mbs = [m for m in full.metrics(k) if m["type"] == "micro_batch"]
        assert all(not m["forward_only"] and m["phase2_ms"] > 0 and m["loss"] is not None for m in full_mbs)
        print(f"stage {k} (early forwarding {early}): median phase1 "
              f"{statistics.median(m['phase1_ms'] for m in mbs):.2f} ms, total "
              f"{statistics.median(m['total_ms'] for m in mbs):.2f} ms forward only; phase1 "
              f"{statistics.median(m['phase1_ms'] for m in full_mbs):.2f} ms, phase2 "
              f"{statistics.median(m['phase2_ms'] for m in full_mbs):.2f} ms, total "
              f"{statistics.median(m['total_ms'] for m in full_mbs):.2f} ms with phase 2")

    def last_stage_losses(pipe: Pipeline) -> list[tuple]:
        return [(m["micro_batch"], m["loss"], m["task_loss"], m["consistency_loss"], m["forward_only"])
                for m in pipe.metrics(2) if m["type"] == "micro_batch"]

    assert last_stage_losses(fast) == last_stage_losses(full)
    assert all(loss is not None for _, loss, *_ in last_stage_losses(fast))
    assert fast_adapters[2].keys() == full_adapters[2].keys()
    for name, t in fast_adapters[2].items():
        assert torch.equal(t, full_adapters[2][name]), name
    assert any(not torch.equal(t, initial[name]) for name, t in fast_adapters[2].items()), "stage 2 trained"


@pytest.mark.parametrize("early", [True, False])
def test_hidden_state_leaves_before_phase_2_only_with_early_forwarding(runner, export3, shard, tmp_path, early):
    """Stage 0 parks between phase 1 and phase 2 of micro-batch 5: stage 1 gets it only with early forwarding."""
    held = 5
    pipe = make_pipeline(runner, export3, shard, tmp_path, "ef", num_micro_batches=8, early_forwarding=early,
                         overrides={0: {"hold_at_micro_batch": held}})
    pipe.start_all()
    try:
        pipe.wait_for(lambda: pipe.events(0, "hold"), "stage 0 to hold")
        consumed = lambda: micro_batches_logged(pipe.run_dir / "metrics1.jsonl")  # noqa: E731
        if early:
            pipe.wait_for(lambda: held in consumed(), f"stage 1 to consume micro-batch {held}")
        else:
            pipe.wait_for(lambda: held - 1 in consumed(), f"stage 1 to consume micro-batch {held - 1}")
            time.sleep(0.5)
            assert held not in consumed(), "without early forwarding the hidden state left before phase 2"
        pipe.procs[0].send_signal(signal.SIGTERM)
        assert pipe.procs[0].wait(timeout=10) == 3, pipe.stderr(0)
    finally:
        pipe.kill_all()


KILL_N, KILL_M = 16, 4


@pytest.fixture(scope="module")
def clean_adapters(runner, export3, shard, tmp_path_factory) -> list[dict[str, torch.Tensor]]:
    """The failure-free run the kill tests compare with (16 micro-batches, windows of 4), its programs read into heap
    memory (`load_mode: file`): the kill runs map them (the default), so equal adapters also show that a mapped
    program trains bit-identically to a heap-loaded one (docs/design#frozen-weights)."""
    heap = {k: {"load_mode": "file"} for k in range(3)}
    return make_pipeline(runner, export3, shard, tmp_path_factory.mktemp("clean"), "clean",
                         num_micro_batches=KILL_N, window_size=KILL_M, overrides=heap).run()


@pytest.mark.parametrize("snapshots", [True, False], ids=["snapshot", "replay"])
@pytest.mark.parametrize("victim", [1, 0, 2])
def test_sigkill_and_resume_ends_identical(runner, export3, shard, tmp_path, clean_adapters, victim, snapshots):
    """SIGKILL one stage inside window 2, restart it with --resume: every adapter equals the clean run's, bit for bit.

    The victim parks (hold_at_micro_batch) right after micro-batch 9 went
    downstream and before its phase 2, the worst moment; the kill lands there.
    With its accumulator snapshot (micro-batch 8 accumulated) it continues at 9;
    without, it replays 8-9: stage 1 (the middle) from its input log,
    re-sending them to stage 2, which drops the duplicates; stage 0 re-reads
    its shard; stage 2 replays from its log.
    """
    n, m = KILL_N, KILL_M
    held = 2 * m + 1  # micro-batch 9, inside window 2 (8..11)
    resume_at = held if snapshots else 2 * m
    pipe = make_pipeline(runner, export3, shard, tmp_path, "kill", num_micro_batches=n, window_size=m,
                         overrides={victim: {"hold_at_micro_batch": held, "accumulator_snapshots": snapshots}})
    pipe.start_all()
    try:
        pipe.park(victim, held)
        pipe.procs[victim].send_signal(signal.SIGKILL)
        pipe.procs[victim].wait()
        pipe.edit_config(victim, hold_at_micro_batch=None)
        pipe.start(victim, resume=True)
        pipe.wait_all()
    finally:
        pipe.kill_all()
    resumed = [pipe.final_adapter(k) for k in range(pipe.num_stages)]

    starts = pipe.events(victim, "start")
    assert len(starts) == 2 and starts[1]["resumed_from_window"] == 1, starts
    assert starts[1]["first_micro_batch"] == resume_at and starts[1]["resumed_from_snapshot"] == resume_at - 2 * m
    replayed = micro_batches_logged(pipe.run_dir / f"metrics{victim}.jsonl")
    assert replayed == list(range(held)) + list(range(resume_at, n)), replayed
    finals = {k: pipe.events(k, "done")[-1] for k in range(pipe.num_stages)}
    resent = held + 1 - resume_at  # 9 (and 8 without a snapshot)
    if victim < pipe.num_stages - 1:
        assert finals[victim + 1]["receiver"]["duplicates"] >= resent, "downstream saw none of the re-sent hidden states"
    if victim > 0:
        # Micro-batches 8 and 9 were in the victim's input log: replayed from disk, not received again.
        assert finals[victim]["receiver"]["accepted"] <= finals[victim]["micro_batches"] - resent, finals[victim]
    for a, b in zip(clean_adapters, resumed):
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), f"{name} differs after kill of stage {victim} + resume"


def test_a_forward_only_stage_killed_mid_window_continues_from_its_snapshot(runner, export3, shard, tmp_path):
    """Stage 1 held still by lr 0 (forward only) is SIGKILLed after sending micro-batch 9: its accumulator snapshot
    holds no gradient, only how far window 2 got, so the restart continues at 9, the window still counts its 4
    micro-batches and one (skipped) step, and every adapter equals the kill-free forward-only run's."""
    n, m, held = KILL_N, KILL_M, 2 * KILL_M + 1
    still = {0: {"optimizer": {**OPTIMIZER, "lr": 0.0}}, 1: {"optimizer": {**OPTIMIZER, "lr": 0.0}}}
    clean = make_pipeline(runner, export3, shard, tmp_path, "clean", num_micro_batches=n, window_size=m,
                          overrides=still).run()
    pipe = make_pipeline(runner, export3, shard, tmp_path, "kill", num_micro_batches=n, window_size=m,
                         overrides={**still, 1: {**still[1], "hold_at_micro_batch": held}})
    pipe.start_all()
    try:
        pipe.park(1, held)
        pipe.procs[1].send_signal(signal.SIGKILL)
        pipe.procs[1].wait()
        pipe.edit_config(1, hold_at_micro_batch=None)
        pipe.start(1, resume=True)
        pipe.wait_all()
    finally:
        pipe.kill_all()
    starts = pipe.events(1, "start")
    assert (starts[1]["first_micro_batch"], starts[1]["resumed_from_snapshot"], starts[1]["forward_only"]) == (
        held, 1, True), starts[1]
    windows = {w["window"]: w for w in pipe.events(1, "window")}
    assert (windows[2]["micro_batches"], windows[2]["step"], windows[2]["mean_loss"]) == (m, 3, None)
    for k, adapter in enumerate(pipe.final_adapter(k) for k in range(pipe.num_stages)):
        assert adapter.keys() == clean[k].keys()
        for name in adapter:
            assert torch.equal(adapter[name], clean[k][name]), f"stage {k}: {name}"


def test_sigterm_stops_without_commit_and_resume_completes(runner, export3, shard, tmp_path, clean_adapters):
    """SIGTERM (what `zl train` and the app's stop send) ends a stage with exit 3 and no half window; --resume finishes it."""
    held = 2 * KILL_M + 1
    pipe = make_pipeline(runner, export3, shard, tmp_path, "term", num_micro_batches=KILL_N, window_size=KILL_M,
                         overrides={1: {"hold_at_micro_batch": held}})
    pipe.start_all()
    try:
        pipe.park(1, held)
        pipe.procs[1].send_signal(signal.SIGTERM)
        assert pipe.procs[1].wait(timeout=10) == 3, pipe.stderr(1)
        assert "stop requested" in pipe.stderr(1)
        windows = sorted(p.name for p in (pipe.run_dir / "ckpt1").glob("window_*"))
        assert windows[-1] == "window_000001", windows  # window 2 was not committed
        pipe.edit_config(1, hold_at_micro_batch=None)
        pipe.start(1, resume=True)
        pipe.wait_all()
    finally:
        pipe.kill_all()
    for a, b in zip(clean_adapters, [pipe.final_adapter(k) for k in range(pipe.num_stages)]):
        for name in a:
            assert torch.equal(a[name], b[name]), name


def kill_parked_and_corrupt_newest_checkpoint(pipe: Pipeline, victim: int, held: int, damage: str = "truncated") -> Path:
    """Park `victim` inside window 2, SIGKILL it and damage its newest checkpoint (window 1): truncate its adapter,
    or (`damage` "nan") make one of its weights nan in an intact file; returns that dir."""
    from safetensors.torch import load_file, save_file

    pipe.park(victim, held)
    pipe.procs[victim].send_signal(signal.SIGKILL)
    pipe.procs[victim].wait()
    newest = pipe.run_dir / f"ckpt{victim}" / "window_000001"
    adapter = newest / "adapter.safetensors"
    if damage == "nan":
        tensors = load_file(str(adapter))
        tensors[sorted(tensors)[-1]].view(-1)[3] = float("nan")
        save_file(tensors, str(adapter), metadata={"format": "pt"})
    else:
        adapter.write_bytes(adapter.read_bytes()[:100])
    pipe.edit_config(victim, hold_at_micro_batch=None)
    return newest


@pytest.mark.parametrize("damage", ["truncated", "nan"])
def test_corrupt_newest_checkpoint_of_stage_0_falls_back_exactly(runner, export3, shard, tmp_path, clean_adapters,
                                                                 damage):
    """Stage 0 can replay anything from its shard: it resumes from window 0 and ends bit-identical to a clean run.
    A weight that is nan (issue 43: resume took the newest checkpoint whatever it held) is damage like a torn file."""
    held = 2 * KILL_M + 1
    pipe = make_pipeline(runner, export3, shard, tmp_path, "corrupt0", num_micro_batches=KILL_N, window_size=KILL_M,
                         overrides={0: {"hold_at_micro_batch": held}})
    pipe.start_all()
    try:
        newest = kill_parked_and_corrupt_newest_checkpoint(pipe, 0, held, damage)
        corrupt_bytes = (newest / "adapter.safetensors").read_bytes()
        pipe.start(0, resume=True)
        pipe.wait_all()
    finally:
        pipe.kill_all()
    starts = pipe.events(0, "start")
    assert starts[-1]["resumed_from_window"] == 0, starts
    assert "window_000001 is unusable" in pipe.stderr(0), pipe.stderr(0)
    if damage == "nan":
        assert "holds nan at element 3 (a damaged run: not finite)" in pipe.stderr(0), pipe.stderr(0)
    aside = list((pipe.run_dir / "ckpt0").glob("corrupt-window_000001-*"))
    assert len(aside) == 1 and (aside[0] / "adapter.safetensors").read_bytes() == corrupt_bytes, aside
    for a, b in zip(clean_adapters, [pipe.final_adapter(k) for k in range(pipe.num_stages)]):
        for name in a:
            assert torch.equal(a[name], b[name]), name


def test_corrupt_newest_checkpoint_without_exact_fallback_stops_with_exit_2(runner, export3, shard, tmp_path):
    """Stage 1's input log lost window 1 when it was committed: no exact fallback, so exit 2 (not retried), dir kept."""
    held = 2 * KILL_M + 1
    pipe = make_pipeline(runner, export3, shard, tmp_path, "corrupt1", num_micro_batches=KILL_N, window_size=KILL_M,
                         overrides={1: {"hold_at_micro_batch": held}})
    pipe.start_all()
    try:
        newest = kill_parked_and_corrupt_newest_checkpoint(pipe, 1, held)
        before = {p.name: p.read_bytes() for p in newest.iterdir()}
        pipe.start(1, resume=True)
        assert pipe.procs[1].wait(timeout=60) == 2, pipe.stderr(1)
    finally:
        pipe.kill_all()
    err = pipe.stderr(1)
    assert f"{pipe.run_dir / 'ckpt1' / 'window_000001'}" in err or "ckpt1/window_000001 is unusable" in err, err
    assert "no longer holds micro-batch 4" in err and "intact copy" in err, err
    assert {p.name: p.read_bytes() for p in newest.iterdir()} == before  # left exactly as it was


@pytest.mark.parametrize("lr, problem, kept", [
    # ±1e30 weights after window 0's step are finite, but their products overflow in window 1's forward.
    (1e30, "stage 0 window 1: the loss summed over its 4 micro-batches is nan", ["window_000000"]),
    # A step of 1e39 leaves float32's range: the weights are inf with the window's loss still finite.
    (1e39, "stage 0 window 0: the AdamW step made base_model.", []),
], ids=["loss", "weights"])
def test_a_stage_that_goes_non_finite_stops_with_exit_2_keeping_its_last_good_checkpoint(runner, export3, shard,
                                                                                        tmp_path, lr, problem, kept):
    """Issue 43: a stage whose loss or weights go nan or inf stops at once (exit 2: a restart would replay into the
    same values), names the stage and window, and checkpoints nothing past its last good window."""
    wild = {0: {"optimizer": {**OPTIMIZER, "lr": lr, "schedule": {"kind": "constant"}}}}
    pipe = make_pipeline(runner, export3, shard, tmp_path, "diverged", num_micro_batches=KILL_N, window_size=KILL_M,
                         overrides=wild)
    pipe.start_all()
    try:
        assert pipe.procs[0].wait(timeout=PROCESS_TIMEOUT_S) == 2, pipe.stderr(0)
    finally:
        pipe.kill_all()
    err = pipe.stderr(0)
    assert problem in err and "a damaged run (diverged?): not stepped or checkpointed" in err, err
    assert f"last good checkpoint ({'window 0' if kept else 'none yet'})" in err, err
    assert sorted(p.name for p in (pipe.run_dir / "ckpt0").glob("window_*")) == kept


def run_single(runner: Path, run_dir: Path, cfg: dict, *extra: str) -> subprocess.CompletedProcess:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.key").write_text(RUN_KEY + "\n")
    (run_dir / "stage.json").write_text(json.dumps(cfg))
    return subprocess.run([str(runner), "--config", str(run_dir / "stage.json"), *extra], cwd=run_dir,
                          capture_output=True, text=True, timeout=60)


def test_program_of_another_stage_is_refused(runner, export3, shard, tmp_path):
    pipe = make_pipeline(runner, export3, shard, tmp_path, "x")
    cfg = {**pipe.config(0), "program": str(export3 / "stage_1.pte"), "downstream": "127.0.0.1:9"}
    proc = run_single(runner, tmp_path / "wrong", cfg)
    assert proc.returncode == 1
    assert "is stage 1" in proc.stderr and "config says stage 0" in proc.stderr, proc.stderr[-1000:]


def test_fresh_start_over_existing_checkpoints_is_refused(runner, export3, shard, tmp_path):
    """resume: false must not silently train on top of (or over) an earlier run's checkpoints."""
    cfg = {**make_pipeline(runner, export3, shard, tmp_path, "x").config(2), "resume": False}  # the last stage
    run_dir = tmp_path / "fresh"
    (run_dir / "ckpt2" / "window_000000").mkdir(parents=True)
    proc = run_single(runner, run_dir, cfg)
    assert proc.returncode == 1
    assert "already holds window 0" in proc.stderr, proc.stderr[-1000:]


def test_missing_manifest_names_the_fix(runner, export3, shard, tmp_path):
    pipe = make_pipeline(runner, export3, shard, tmp_path, "x")
    cfg = {**pipe.config(0), "manifest": str(tmp_path / "nowhere" / "manifest.json"), "downstream": "127.0.0.1:9"}
    proc = run_single(runner, tmp_path / "nomanifest", cfg)
    assert proc.returncode == 1
    assert "nowhere/manifest.json" in proc.stderr and "PEFT" in proc.stderr, proc.stderr[-1000:]


@pytest.mark.slow
def test_two_stages_match_eager_reference(runner, shard, tmp_path_factory, tmp_path):
    """Two stages, 5 windows with a short last one, constant lr."""
    export2 = export_programs(tmp_path_factory.mktemp("export2"), 2)
    optimizer = {**OPTIMIZER, "schedule": {"kind": "constant"}}
    pipe = make_pipeline(runner, export2, shard, tmp_path, "run2", num_micro_batches=18, window_size=4,
                         optimizer=optimizer)
    adapters = pipe.run()
    expected, _ = eager_reference(export2, shard, 18, 4, optimizer)
    got = {k: v for a in adapters for k, v in a.items()}
    assert set(got) == set(expected)
    for name, want in expected.items():
        torch.testing.assert_close(got[name], want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
