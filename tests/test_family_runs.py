"""`zl train` end to end for each model family on its tiny random model, with both runtimes (the ExecuTorch runner
with three local devices, and `--runtime torch`), then `zl merge`'s adapter through PEFT and `zl eval`.

Llama's runs are tests/test_train.py's and tests/test_torch_runtime.py's. Here every other family trains with the
defaults a user gets (no --lora-targets: every projection of the family, so Phi-3 adapts its fused qkv_proj), and:

- the adapter equals the same pipeline trained in PyTorch eager (`train_zerolock`), tensor by tensor;
- `PeftModel.from_pretrained` on a fresh Hugging Face model of the family loads it and computes the logits of that
  eagerly trained model (not those of the base model);
- `zl eval` scores base and adapter on the run's data.

The default suite runs Gemma 3 through the runner (the family with the most traits: sliding-window and global
layers with two rotary tables, logit soft-capping, the embedding scale, a tied head); everything else is slow
(each run exports and trains for about a minute on a loaded 2-core host):

    .venv/bin/python -m pytest tests/test_family_runs.py -m 'slow or not slow'
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, native_library_or_skip

MODELS = ("tiny-random-qwen2", "tiny-random-qwen3", "tiny-random-phi3", "tiny-random-gemma3")
FAST = ("tiny-random-gemma3", "executorch")  # the one run of the default suite
SAMPLES, WINDOW = 8, 4  # 2 windows
RUNNER = REPO / "build" / "runner" / "zl_runner"


def _cases():
    for name in MODELS:
        for runtime in ("executorch", "torch"):
            marks = () if (name, runtime) == FAST else (pytest.mark.slow,)
            yield pytest.param(name, runtime, marks=marks, id=f"{name}-{runtime}")


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    rows = [{"prompt": f"item {i} is", "completion": " odd" if i % 2 else " even"} for i in range(24)]
    path = tmp_path_factory.mktemp("data") / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _train(name: str, runtime: str, out: Path, data: Path):
    from zl_device.run.train_job import run_training
    from zl_device.run.train_settings import TrainSettings
    from zl_export.data_settings import DataSettings
    from zl_export.options import ModelSplit

    extra = {"runtime": "torch", "link_timeout_s": 120} if runtime == "torch" else {}
    settings = TrainSettings(split=ModelSplit(name), samples=SAMPLES, window=WINDOW, out=out,
                             export_cache=out.parent / "export-cache", rows=DataSettings(seq_len=24), data=str(data),
                             eval_data=str(data), eval_limit=8, timeout_s=600,
                             stage_lr=(1.0,), schedule="zerolock",  # every stage on its local loss (generative
                             # data would hold all but the last still under zerolock, and choose async without it)
                             **extra)
    return run_training(settings, say=lambda line: None)


def _eager_reference(run_dir: Path, runtime: str):
    """The run's pipeline trained in one process by `train_zerolock` from its manifest, configs and shard.

    Returns:
        (the trained PEFT model, its trainable tensors by manifest name).
    """
    from zl_device.torch.eager_training import Budget, OptimizerSettings, stage_parameters, train_zerolock
    from zl_export.exporter import build_stage_modules
    from zl_export.model_source import load_model
    from zl_export.options import ExportOptions
    from zl_export.shard import load_shard
    from zl_export.stages import StageRange
    from zl_export.translator import calibration_batches

    manifest = json.loads((run_dir / "manifest.json").read_text())
    opts = ExportOptions.from_manifest(manifest)
    shard = load_shard(run_dir / "data" / "train.safetensors")
    peft_model, modules = build_stage_modules(
        load_model(manifest["model"]["name"], seed=manifest["seed"]).model,
        [StageRange(st["index"], *st["layers"]) for st in manifest["stages"]], opts, calibration_batches(shard))
    if runtime == "torch":
        job = json.loads((run_dir / "torch_job.json").read_text())
        lr = job["lr"]
        steps, window = job["num_micro_batches"], job["window_size"]
        optimizer = {"lr": max(lr), "weight_decay": job["weight_decay"], "schedule": job["schedule"]}
    else:
        configs = [json.loads((run_dir / f"stage_{st['index']}.json").read_text()) for st in manifest["stages"]]
        lr = [c["optimizer"]["lr"] for c in configs]
        steps, window = configs[0]["num_micro_batches"], configs[0]["window_size"]
        optimizer = max((c["optimizer"] for c in configs), key=lambda o: o["lr"])  # a stage may have lr 0
    batch = opts.micro_batch
    train_zerolock(modules, shard, Budget(steps * batch, window, batch), OptimizerSettings.from_config(optimizer),
                   stage_lr=[x / optimizer["lr"] for x in lr])
    return peft_model, stage_parameters(modules, peft_model)


@pytest.mark.parametrize("name,runtime", list(_cases()))
def test_a_family_trains_merges_and_evaluates(name, runtime, data_file, tmp_path, one_torch_thread):
    from peft import PeftModel
    from typer.testing import CliRunner

    from zl_export.model_family import family_of
    from zl_export.model_source import load_model

    if runtime == "executorch":
        native_library_or_skip()
        if not RUNNER.is_file():
            pytest.skip(f"{RUNNER} not built; run `bash setup.sh`")
    result = _train(name, runtime, tmp_path / "run", data_file)
    run_dir = result.run_dir
    manifest = json.loads((run_dir / "manifest.json").read_text())
    family = family_of(manifest["model"]["model_type"])
    assert manifest["model"]["family"] == family.key and len(manifest["stages"]) == 3
    # No --lora-targets: the family's default, recorded resolved (zl merge's adapter_config reads it).
    assert manifest["lora"]["targets"] == list(family.default_lora_targets)
    adapter_config = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["target_modules"] == list(family.default_lora_targets)

    merged = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    for head in sorted((run_dir / "adapter" / "early_exit").glob("stage_*.safetensors")):
        merged.update(load_file(str(head)))
    trained, want = _eager_reference(run_dir, runtime)
    assert set(merged) == set(want)
    # atol 2.5% of the lr (2e-3): Adam moves a weight whose gradient is about zero by up to lr on rounding noise alone
    # (m/√v of noise), so an element or two of a tensor differs by ~1e-5 between two correct runs; a wrong gradient
    # moves whole tensors by ~lr.
    for n, t in want.items():
        torch.testing.assert_close(merged[n], t, rtol=1e-4, atol=5e-5, msg=lambda m: f"{name} {n}: {m}")
    assert any(float(t.abs().max()) > 1e-3 for n, t in merged.items() if "lora_B" in n), "training moved nothing"

    # PEFT loads every tensor into the module it was trained in (the trained model's module of that name), and the
    # model computes what the trained one computes (on float32 frozen weights: the eager model holds them as the
    # programs do, in bf16, so the reference is the family's model with the trained modules' LoRA weights).
    from zl_export.lora import attach_lora
    from zl_export.options import LoraSettings

    peft = PeftModel.from_pretrained(load_model(name, seed=manifest["seed"]).model, str(run_dir / "adapter"))
    loaded = {n: p for n, p in peft.named_parameters() if "lora_" in n}
    trained_lora = {n: p for n, p in trained.named_parameters() if "lora_" in n}
    assert set(loaded) == set(trained_lora) and loaded
    for n, p in loaded.items():
        assert torch.equal(p, merged[n.replace(".default.", ".")]), n
    lora = manifest["lora"]
    ref = attach_lora(load_model(name, seed=manifest["seed"]).model,
                      LoraSettings(lora["rank"], lora["alpha"], tuple(lora["targets"])))
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "lora_" in n:
                p.copy_(trained_lora[n])
    ids = torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want_logits = peft(input_ids=ids).logits, ref(input_ids=ids).logits
        plain = load_model(name, seed=manifest["seed"]).model(input_ids=ids).logits
    torch.testing.assert_close(got, want_logits, rtol=1e-3, atol=1e-4, msg=name)
    assert float((got - plain).abs().max()) > 1e-3, f"{name}: the adapter changes nothing"

    import typer

    from zl.commands.eval import eval_command

    app = typer.Typer(add_completion=False)
    app.command("eval")(eval_command)
    app.command("unused")(lambda: None)
    out = tmp_path / "eval.json"
    cli = CliRunner().invoke(app, ["eval", "--adapter", str(run_dir / "adapter"), "--data",
                                   str(run_dir / "data" / "train.safetensors"), "--limit", "8",
                                   "--generate-rows", "0", "--json-out", str(out)])
    assert cli.exit_code == 0, cli.output
    report = json.loads(out.read_text())
    assert report["model"] == name and report["rows"] == 8
    assert report["results"]["adapter"]["nll"] != pytest.approx(report["results"]["base"]["nll"], rel=1e-4)
