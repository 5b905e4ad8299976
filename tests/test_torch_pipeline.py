"""The backprop baselines (zl_device/torch/schedules/backprop_ranks.py): GPipe and 1F1B on three gloo ranks, each
rank running its list from the schedule table, tiny-random (PipeDream: test_torch_pipedream.py; the bench test runs
all four pipelines).

Each schedule's mean gradient over a window must equal single-process backprop
of the same micro-batches (`causal_lm_loss`, the full PEFT model); a short last
window drains as its own; both schedules train to the same LoRA weights, and
each rank holds the micro-batches its list keeps in flight (GPipe: the window;
1F1B: K-k).
Slow: the ranks are spawned processes (~40 s on a loaded 2-core host).
"""

import datetime
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from zl_export.shard import write_shard

BATCH, WINDOW, MICRO_BATCHES, SEQ = 2, 4, 6, 24  # windows: micro-batches 0-3, then a short 4-5
STAGES = [(0, 0), (1, 2), (3, 3)]


def make_shard(path: Path) -> Path:
    """10 rows of byte tokens: a random prompt of varying length, then a 2-token completion + EOS; right-padded."""
    gen = torch.Generator().manual_seed(3)
    rows = 10
    ids = torch.full((rows, SEQ), 257, dtype=torch.int64)  # ByteTokenizer: 256 EOS, 257 padding
    labels = torch.full((rows, SEQ), -100, dtype=torch.int64)
    for i in range(rows):
        prompt = 6 + i % 9
        ids[i, :prompt] = torch.randint(97, 123, (prompt,), generator=gen)
        ids[i, prompt:prompt + 3] = torch.tensor([ord("o"), ord("k") if i % 2 else ord("n"), 256])
        labels[i, prompt:prompt + 3] = ids[i, prompt:prompt + 3]
    mask = (ids != 257).to(torch.int64)
    write_shard(path, {"input_ids": ids, "attention_mask": mask, "labels": labels},
                {"tokenizer": {"name": "bytes", "model": "tiny-random", "eos_token_id": 256, "pad_token_id": 257},
                 "format": "prompt_completion"})
    return path


def build(seed: int = 0):
    from zl_export.exporter import build_stage_modules, manifest_names
    from zl_export.model_source import load_model
    from zl_export.options import ExportOptions, LossConfig
    from zl_export.stages import StageRange

    opts = ExportOptions(seq_len=SEQ, micro_batch=BATCH, loss=LossConfig(translator_rank=0), seed=seed)
    peft_model, modules = build_stage_modules(load_model("tiny-random", seed=seed).model,
                                              [StageRange(k, a, b) for k, (a, b) in enumerate(STAGES)], opts)
    names = manifest_names(modules[0], peft_model)
    return peft_model, modules, names


def rank_main(rank: int, port: int, shard_path: str, out: str, runs: list[tuple[str, str, int, int]]) -> None:
    """Spawned: for each (name, schedule, micro-batches, window) of `runs`, the schedule's `ScheduledStage` on fresh
    modules over the whole plan: window 0's gradient, the trained weights, each window's (loss, lr), memory."""
    import torch.distributed as dist

    from zl_device.formats.windows import WindowPlan
    from zl_device.torch.backprop import window_rows
    from zl_device.torch.eager_training import OptimizerSettings
    from zl_device.torch.schedules.backprop_ranks import ScheduledStage
    from zl_export.shard import load_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(STAGES),
                            timeout=datetime.timedelta(seconds=120))
    try:
        shard = load_shard(shard_path)
        for name, kind, n, m in runs:
            _, modules, names = build()
            plan = WindowPlan(n, m)
            pipe = ScheduledStage(modules[rank], rank, len(STAGES), torch.device("cpu"), kind, 5e-3,
                                  OptimizerSettings(), plan, timeout_s=120)
            windows = []

            def weights(what: str, grad: bool = False) -> None:
                save_file({names[id(p)]: (p.grad if grad else p).detach().clone() for p in pipe.params},
                          f"{out}/{name}_{what}_{rank}.safetensors")

            def on_window(w, loss, lr):
                if w == 0:
                    weights("grad", grad=True)  # the window's mean gradient
                windows.append([w, loss, lr])

            pipe.run(lambda mb: window_rows(shard, range(mb, mb + 1), BATCH),
                     (BATCH, SEQ, modules[rank].norm.weight.shape[-1]), on_window)
            weights("params")
            Path(f"{out}/{name}_run_{rank}.json").write_text(json.dumps(
                {"windows": windows, "in_flight_max": pipe.in_flight_max,
                 "stash_versions_max": pipe.stash_versions_max}))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn_stages(runs: list[tuple[str, str, int, int]], out: Path) -> tuple[Path, Path]:
    """`rank_main` as one process per stage on a fresh shard in `out`; (out, shard)."""
    import torch.multiprocessing as mp

    from zl_device.devices.network import free_port_base

    shard = make_shard(out / "train.safetensors")
    mp.start_processes(rank_main, args=(free_port_base(1), str(shard), str(out), runs), nprocs=len(STAGES), join=True,
                       start_method="spawn")
    return out, shard


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    return spawn_stages([(kind, kind, MICRO_BATCHES, WINDOW) for kind in ("gpipe", "1f1b")],
                        tmp_path_factory.mktemp("pipelined"))


def load_all(out: Path, kind: str, what: str) -> dict[str, torch.Tensor]:
    merged = {}
    for k in range(len(STAGES)):
        merged.update(load_file(str(out / f"{kind}_{what}_{k}.safetensors")))
    return merged


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_pipelined_gradient_equals_single_process_backprop(pipelined, kind, one_torch_thread):
    from zl_device.torch.eager_training import causal_lm_loss, micro_batch
    from zl_export.shard import load_shard

    out, shard_path = pipelined
    shard = load_shard(shard_path)
    peft_model, _, names = build()
    peft_model.train()
    for mb in range(WINDOW):  # window 0
        causal_lm_loss(peft_model, *micro_batch(shard, mb, BATCH)).backward()
    want = {names[id(p)]: p.grad / WINDOW for p in peft_model.parameters() if p.requires_grad}
    got = load_all(out, kind, "grad")
    assert got.keys() == want.keys()
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-8, msg=lambda m: f"{name}: {m}")
    assert sum(float(g.abs().sum()) for g in want.values()) > 0
    run = [json.loads((out / f"{kind}_run_{k}.json").read_text()) for k in range(len(STAGES))]
    losses = [loss for _, loss, _ in run[-1]["windows"]]
    assert len(losses) == 2 and all(loss > 0 for loss in losses)
    assert all(loss is None for r in run[:-1] for _, loss, _ in r["windows"])
    # The memory each list bounds: GPipe holds the window (4), 1F1B K-k (a window's step between: one version).
    assert [r["in_flight_max"] for r in run] == ([4, 4, 1] if kind == "gpipe" else [3, 2, 1])
    assert [r["stash_versions_max"] for r in run] == [1, 1, 1]


@pytest.mark.slow
def test_gpipe_and_1f1b_train_the_same_weights(pipelined):
    """Same micro-batches, same mean gradients, same AdamW: the schedules differ in order and memory, not result."""
    out, _ = pipelined
    gpipe, one_f = load_all(out, "gpipe", "params"), load_all(out, "1f1b", "params")
    assert gpipe.keys() == one_f.keys()
    for name, t in gpipe.items():
        torch.testing.assert_close(one_f[name], t, rtol=1e-6, atol=1e-8, msg=lambda m: f"{name}: {m}")
    assert any(float(t.abs().max()) > 1e-3 for n, t in gpipe.items() if "lora_B" in n), "training moved LoRA B"


@pytest.mark.slow
def test_bench_pipelines_measures_every_pipeline(tmp_path, capsys):
    """tools/bench_pipelines.py on tiny-random: one row per pipeline (ZeroLock on torch and on the runner, the three
    backprop baselines), figures from the stages' telemetry, every adapter scored on the same dev rows, a plot."""
    from conftest import load_tool

    bench = load_tool("bench_pipelines")
    results = bench.main(["--samples", "8", "--window", "4", "--seq-len", "64", "--eval-limit", "16",
                          "--out", str(tmp_path / "bench"), "--json", str(tmp_path / "bench.json")])
    assert [r["pipeline"] for r in results] == ["zerolock", "zerolock-et", "gpipe", "1f1b", "async"]
    for r in results:
        assert r["samples"] == 8 and r["records_per_s"] == pytest.approx(8 / r["wall_s"])
        least = 5 if r["pipeline"] == "zerolock-et" else 100  # a tiny program in a runner; libtorch in a rank
        for key in ("peak_rss_mib", "train_peak_rss_mib"):
            assert len(r[key]) == 3 and all(m > least for m in r[key]), (r["pipeline"], key, r[key])
        assert all(t <= p for t, p in zip(r["train_peak_rss_mib"], r["peak_rss_mib"])), r
        assert all(0 < b < 2 for b in r["busy_share"]), r["busy_share"]  # gloo's I/O threads count as CPU too
        assert 0 <= r["accuracy"] <= 1 and r["nll"] > 0, r
        assert (Path(r["adapter"]) / "adapter_model.safetensors").is_file(), r["adapter"]
    # The same local-loss job on torch and on the runner: the same losses (float32 both, rounding apart).
    assert results[1]["last_stage_last_loss"] == pytest.approx(results[0]["last_stage_last_loss"], rel=1e-4)
    # Same data, same first window: the last stage's first loss is the same plain CE in the backprop baselines
    # (PipeDream's first window: every forward before any step).
    for r in results[3:]:
        assert r["last_stage_first_loss"] == pytest.approx(results[2]["last_stage_first_loss"], rel=1e-5)
    # GPipe and 1F1B train the same weights, so their adapters score alike.
    assert results[3]["nll"] == pytest.approx(results[2]["nll"], rel=1e-4)
    # PipeDream's memory: K-k micro-batches in flight on stage k; 2 windows of 4 -> two weight versions on 0 and 1.
    assert results[4]["in_flight_max"] == [3, 2, 1] and results[4]["stash_versions_max"] == [2, 2, 1]
    assert results[0]["in_flight_max"] == [None] * 3
    printed = capsys.readouterr().out
    assert sum(line.startswith("|") for line in printed.splitlines()) == 8  # header, rule, 5 pipelines, base
    assert "| 3/2 / 2/2 / 1/1 |" in printed and "zerolock vs async: records/s" in printed
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["results"] == results and saved["base"]["rows"] == 16
    assert (tmp_path / "bench" / "pipelines.png").stat().st_size > 10_000


def test_bench_pipelines_prints_unmeasured_peaks_as_dashes(tmp_path):
    """A host without /proc VmHWM reports no peak (None): the table, the ratios and the plot still come out."""
    from conftest import load_tool

    bench = load_tool("bench_pipelines")

    def result(name, peaks):
        return {"pipeline": name, "records_per_s": 2.0, "wall_s": 4.0, "train_peak_rss_mib": peaks,
                "peak_rss_mib": peaks, "busy_share": [0.5, 0.5], "last_stage_first_loss": 1.0,
                "last_stage_last_loss": 0.5, "in_flight_max": [None, None], "stash_versions_max": [None, None]}

    results = [result("zerolock", [None, 10.0]), result("async", [20.0, None])]
    assert "| - / 10 | - / 10 |" in bench.table(results, None)
    assert bench.ratios(results) == ["zerolock vs async: records/s 1.00x, peak RSS in training per rank - / -x"]
    assert bench.plot(results, tmp_path / "p.png").stat().st_size > 0
