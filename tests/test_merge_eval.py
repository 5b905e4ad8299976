"""`zl merge` (stage checkpoints -> one PEFT adapter) and `zl eval` (accuracy and NLL), on a tiny random Llama.

Stage checkpoints are written here the way the C++ runner writes them
(runner/include/zl/checkpoint.h): `stage_<k>/window_NNNNNN/` with
`adapter.safetensors` (F32, PEFT names) and `progress.json`, for a manifest
built by zl_export's own helpers for a 2-stage split of `tiny-random`.
"""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import typer
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from zl.commands.data import data_command
from zl.commands.eval import eval_command
from zl.commands.merge import merge_command
from zl_base.errors import ZLError
from zl_device.results.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MERGE_INFO, load_adapter, merge_checkpoints
from zl_device.results.evaluate import evaluate, limit_rows
from zl_export.model_source import load_model
from zl_export.shard import load_shard

from conftest import brute_force_label_scores

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning"),  # PEFT calls a deprecated transformers API
    pytest.mark.usefixtures("one_torch_thread"),
]

RUN_ID = "00112233445566778899aabbccddeeff"
STAGES = ((0, 1), (2, 3))  # tiny-random has 4 layers




@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    """A manifest of a 2-stage tiny-random export (no programs: merge needs only the parameter lists)."""
    from zl_export.options import ExportOptions, LoraSettings
    from zl_export.lora import attach_lora, peft_names
    from zl_export.manifest import ParameterEntry, StageEntry, build_manifest, write_manifest

    loaded = load_model("tiny-random")
    # LoRA on q and v only (not the default, every projection): the merge's mechanics with fewer tensors to name
    opts = ExportOptions(seq_len=64, lora=LoraSettings(targets=("q_proj", "v_proj")))
    peft_model = attach_lora(loaded.model, opts.lora)
    names = peft_names(peft_model)
    entries = []
    for k, (first, last) in enumerate(STAGES):
        params = tuple(
            ParameterEntry(names[id(p)], tuple(p.shape), n)
            for n, p in peft_model.named_parameters()
            if "lora_" in n and first <= int(re.search(r"layers\.(\d+)\.", n).group(1)) <= last
        )
        entries.append(StageEntry(k, (first, last), (), (), params))
    out = tmp_path_factory.mktemp("export")
    write_manifest(build_manifest(loaded, opts, entries), out)
    return out


def manifest_of(export_dir: Path) -> dict:
    return json.loads((export_dir / "manifest.json").read_text())


def stage_tensors(manifest: dict, seed: int) -> list[dict[str, torch.Tensor]]:
    """Random LoRA values per stage (B non-zero, so the adapter changes the model)."""
    gen = torch.Generator().manual_seed(seed)
    return [{p["name"]: 0.2 * torch.randn(p["shape"], generator=gen) for p in s["parameters"]} for s in manifest["stages"]]


def write_checkpoint(root: Path, k: int, window: int, tensors: dict[str, torch.Tensor], *, run_id: str = RUN_ID,
                     stage: int | None = None, window_size: int = 4, total: int = 8) -> Path:
    """One window directory as the runner's CheckpointStore::save writes it (optimizer state left out)."""
    d = root / f"stage_{k}" / f"window_{window:06d}"
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d / "adapter.safetensors"))
    done = min((window + 1) * window_size, total)
    progress = {
        "format": "zl-checkpoint", "version": 1, "run_id": run_id, "stage": k if stage is None else stage,
        "window": window, "last_micro_batch": done - 1, "micro_batches_done": done, "optimizer_step": window + 1,
        "lr": 1e-4, "created_unix_ms": 0, "params": [{"name": n, "shape": list(t.shape)} for n, t in tensors.items()],
        "extra": {"program": f"stage_{k}.pte", "window_size": window_size, "num_micro_batches": total},
    }
    (d / "progress.json").write_text(json.dumps(progress))
    return d


@pytest.fixture
def run(tmp_path, export_dir):
    """A finished 2-window run: both stages at windows 0 and 1, plus runner leftovers merge must ignore."""
    manifest = manifest_of(export_dir)
    root = tmp_path / "checkpoints"
    values = {w: stage_tensors(manifest, seed=w) for w in (0, 1)}
    for w, per_stage in values.items():
        for k, tensors in enumerate(per_stage):
            write_checkpoint(root, k, w, tensors)
    (root / "stage_0" / ".tmp-window_000002-4242").mkdir()  # a save killed mid-way
    (root / "stage_1" / "input_log").mkdir()
    return root, manifest, values


def lora_state(peft_model) -> dict[str, torch.Tensor]:
    return {n.replace(".default.", "."): p.detach() for n, p in peft_model.named_parameters() if "lora_" in n}


# ---------------------------------------------------------------- merge


def test_merged_adapter_loads_with_peft_and_holds_the_latest_checkpoints(run, export_dir, tmp_path):
    from peft import PeftModel

    root, manifest, values = run
    result = merge_checkpoints(root, export_dir / "manifest.json", tmp_path / "adapter")
    assert result.window == 1 and result.finished and result.run_id == RUN_ID
    expected = {**values[1][0], **values[1][1]}
    assert result.numel == sum(t.numel() for t in expected.values())

    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (8, 16.0, ["q_proj", "v_proj"])
    info = json.loads((tmp_path / "adapter" / MERGE_INFO).read_text())
    assert [s["window"] for s in info["stages"]] == [1, 1] and info["model"]["name"] == "tiny-random"

    base = load_model("tiny-random").model
    reference = load_model("tiny-random").model
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    loaded = lora_state(peft_model)
    assert loaded.keys() == expected.keys()  # every LoRA module of the model got a tensor, none left over
    for name, tensor in expected.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)

    # The adapter means W + (alpha / r) B A on every target projection: fold it into the plain model and compare logits.
    scale = config["lora_alpha"] / config["r"]
    with torch.no_grad():
        for layer, block in enumerate(reference.model.layers):
            for proj in ("q_proj", "v_proj"):
                prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
                a, b = expected[f"{prefix}.lora_A.weight"], expected[f"{prefix}.lora_B.weight"]
                getattr(block.self_attn, proj).weight += scale * b @ a
        ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(peft_model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(load_model("tiny-random").model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_window_option_takes_an_older_window_and_load_adapter_checks_names(run, export_dir, tmp_path):
    root, _, values = run
    result = merge_checkpoints(root, export_dir, tmp_path / "w0", window=0)
    assert result.window == 0
    saved = load_file(str(tmp_path / "w0" / ADAPTER_WEIGHTS))
    for name, tensor in {**values[0][0], **values[0][1]}.items():
        assert torch.equal(saved[name], tensor)
    state = lora_state(load_adapter(load_model("tiny-random").model, tmp_path / "w0"))
    assert all(torch.equal(state[n], t) for n, t in saved.items())
    with pytest.raises(ZLError, match=r"--window 5: stage\(s\) 0, 1 have no checkpoint.*Choose one all stages have: 0, 1"):
        merge_checkpoints(root, export_dir, tmp_path / "w5", window=5)


def test_unfinished_run_is_merged_but_flagged(tmp_path, export_dir):
    manifest = manifest_of(export_dir)
    for k, tensors in enumerate(stage_tensors(manifest, 0)):
        write_checkpoint(tmp_path / "ck", k, 0, tensors, total=128)
    result = merge_checkpoints(tmp_path / "ck", export_dir, tmp_path / "adapter")
    assert result.window == 0 and not result.finished


def _drop_one(tensors, other):
    tensors.pop(sorted(tensors)[0])


def _add_other_stages(tensors, other):
    tensors.update(other)


def _reshape(tensors, other):
    name = sorted(tensors)[0]
    tensors[name] = torch.zeros(tensors[name].shape[0], 4)


def _to_f64(tensors, other):
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].double()


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (_drop_one, r"stage_1/window_000001/adapter.safetensors: lacks 1 of stage 1's 8 LoRA parameters \(first: base_model"),
        (_add_other_stages, r"stage_1/window_000001/adapter.safetensors: has 8 tensor\(s\) that are not stage 1's.*"
                            r"the manifest lists it under stage 0"),
        (_reshape, r"stage_1/window_000001/adapter.safetensors: .*lora_A.weight has shape \[8, 4\], the manifest says \[8, 64\]"),
        (_to_f64, r"stage_1/window_000001/adapter.safetensors: .* is torch.float64, expected torch.float32"),
    ],
    ids=["missing", "extra", "shape", "dtype"],
)
def test_bad_parameters_name_the_file_and_the_fix(run, export_dir, tmp_path, corrupt, message):
    root, _, values = run
    tensors = dict(values[1][1])
    corrupt(tensors, values[1][0])
    write_checkpoint(root, 1, 1, tensors)
    with pytest.raises(ZLError, match=message):
        merge_checkpoints(root, export_dir, tmp_path / "adapter")
    assert not (tmp_path / "adapter" / ADAPTER_WEIGHTS).exists()  # nothing half-merged


def test_non_finite_weights_or_moments_are_refused_naming_stage_and_window(run, export_dir, tmp_path):
    """Issue 43: a checkpoint full of NaN merged with exit 0 (then NLL nan, generations of token 0)."""
    root, _, values = run
    diverged = {n: torch.full_like(t, float("nan")) for n, t in values[1][1].items()}
    write_checkpoint(root, 1, 1, diverged)
    with pytest.raises(ZLError, match=r"^stage 1 window 1: checkpoint file .*stage_1/window_000001/adapter.safetensors: "
                                      r"base_model\S+ holds 512 non-finite value\(s\) \(nan\) of 512, a damaged run; "
                                      r"the run diverged or the file was damaged: merge an earlier --window"):
        merge_checkpoints(root, export_dir, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()
    assert merge_checkpoints(root, export_dir, tmp_path / "w0", window=0).window == 0  # the fix it names works
    write_checkpoint(root, 1, 1, values[1][1])
    moments = {f"{n}.{m}": torch.zeros_like(t) for n, t in values[1][0].items() for m in ("exp_avg", "exp_avg_sq")}
    moments[sorted(moments)[0]][0, 0] = float("inf")
    save_file(moments, str(root / "stage_0" / "window_000001" / "optimizer.safetensors"))
    with pytest.raises(ZLError, match=r"^stage 0 window 1: checkpoint file .*optimizer.safetensors: \S+exp_avg holds 1 "
                                      r"non-finite value\(s\) \(inf\)"):
        merge_checkpoints(root, export_dir, tmp_path / "adapter")


def test_missing_stage_and_diverging_windows(run, export_dir, tmp_path):
    root, manifest, values = run
    write_checkpoint(root, 0, 2, values[1][0])
    with pytest.raises(ZLError, match=r"latest checkpoints are at different windows \(stage 0: 2, stage 1: 1\).*pass --window 1"):
        merge_checkpoints(root, export_dir, tmp_path / "adapter")
    shutil.rmtree(root / "stage_1")
    with pytest.raises(ZLError, match=r"stage 1: no checkpoint at .*stage_1 \(no such directory\)\. The manifest has 2 stages"):
        merge_checkpoints(root, export_dir, tmp_path / "adapter")
    with pytest.raises(ZLError, match=r"checkpoints .*nowhere: no such directory; pass the run's checkpoint root"):
        merge_checkpoints(tmp_path / "nowhere", export_dir, tmp_path / "adapter")
    with pytest.raises(ZLError, match=r"manifest .*manifest.json: no such file"):
        merge_checkpoints(root, tmp_path, tmp_path / "adapter")


def test_checkpoints_of_another_stage_run_or_incomplete_are_refused(run, export_dir, tmp_path):
    root, _, values = run
    write_checkpoint(root, 1, 1, values[1][1], stage=0)
    with pytest.raises(ZLError, match=r"written by stage 0, but found under stage 1's directory"):
        merge_checkpoints(root, export_dir, tmp_path / "adapter")
    write_checkpoint(root, 1, 1, values[1][1], run_id="ff" * 16)
    with pytest.raises(ZLError, match=r"different runs \(stage 0: 0011.*, stage 1: ffff"):
        merge_checkpoints(root, export_dir, tmp_path / "adapter")
    d = write_checkpoint(root, 1, 1, values[1][1])
    (d / "progress.json").unlink()
    with pytest.raises(ZLError, match=r"stage_1/window_000001/progress.json is missing, so the checkpoint is incomplete"):
        merge_checkpoints(root, export_dir, tmp_path / "adapter")
    d = write_checkpoint(root, 1, 1, values[1][1])
    (d / "adapter.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ZLError, match=r"stage_1/window_000001/adapter.safetensors: not a readable safetensors file"):
        merge_checkpoints(root, export_dir, tmp_path / "adapter")


def test_custom_layout(tmp_path, export_dir):
    from zl_device.formats.checkpoints import CheckpointLayout

    manifest = manifest_of(export_dir)
    values = stage_tensors(manifest, 3)
    for k, tensors in enumerate(values):
        write_checkpoint(tmp_path / "ck", k, 0, tensors)
        (tmp_path / "ck" / f"stage_{k}").rename(tmp_path / "ck" / f"s{k}")
    result = merge_checkpoints(tmp_path / "ck", export_dir, tmp_path / "a", layout=CheckpointLayout(stage_dir="s{k}"))
    assert [s.index for s in result.stages] == [0, 1]


# ---------------------------------------------------------------- eval


@pytest.fixture(scope="module")
def demo_dev(tmp_path_factory) -> Path:
    """`zl data --demo --model tiny-random`: the demo task's dev shard (byte tokens, multi-token label words)."""
    out = tmp_path_factory.mktemp("demo")
    result = CliRunner().invoke(_app(), ["data", "--demo", "--model", "tiny-random", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out / "dev.safetensors"


def test_eval_matches_brute_force_and_an_adapter_changes_it(demo_dev, run, export_dir, tmp_path):
    shard = limit_rows(load_shard(demo_dev), 24)
    assert shard.rows == 24
    model = load_model("tiny-random", seed=5).model
    seen = []
    base = evaluate(model, shard, batch_size=5, on_batch=seen.append)
    assert seen == [5, 5, 5, 5, 4]
    ref_acc, ref_nll = brute_force_label_scores(model, shard)
    assert base.accuracy == pytest.approx(ref_acc) and base.nll == pytest.approx(ref_nll, rel=1e-5)
    assert base.label_tokens == int((shard.labels != -100).sum())
    whole = evaluate(model, shard, batch_size=24)
    assert (whole.accuracy, whole.label_tokens) == (base.accuracy, base.label_tokens)
    assert whole.nll == pytest.approx(base.nll, rel=1e-6)

    root, _, _ = run
    merge_checkpoints(root, export_dir, tmp_path / "adapter")
    adapted = load_adapter(model, tmp_path / "adapter")
    tuned = evaluate(adapted, shard, batch_size=8)
    assert abs(tuned.nll - base.nll) > 1e-3
    ref_acc, ref_nll = brute_force_label_scores(adapted, shard)
    assert tuned.accuracy == pytest.approx(ref_acc) and tuned.nll == pytest.approx(ref_nll, rel=1e-5)


def test_eval_nll_on_a_prompt_completion_shard(tmp_path):
    from zl_export import data as zdata
    from zl_export.tokenizer import ByteTokenizer

    rows = [{"prompt": f"say {i}:", "completion": f" {'ab' * (i % 3 + 1)}"} for i in range(6)]
    (tmp_path / "pc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = zdata.load_task(tmp_path / "pc.jsonl")
    tokenized, task = zdata.tokenize(task, ByteTokenizer(), 24)
    zdata.save(tmp_path / "pc.safetensors", tokenized, task, ByteTokenizer(), "tiny-random", {"path": "pc.jsonl"})
    shard = load_shard(tmp_path / "pc.safetensors")
    model = load_model("tiny-random").model
    result = evaluate(model, shard, batch_size=4)
    with torch.no_grad():
        ref = float(model(input_ids=shard.input_ids, attention_mask=shard.attention_mask, labels=shard.labels).loss)
    assert result.accuracy is None and result.nll == pytest.approx(ref, rel=1e-5)


# ---------------------------------------------------------------- CLI


def _app() -> typer.Typer:
    app = typer.Typer(add_completion=False)
    for name, command in (("data", data_command), ("merge", merge_command), ("eval", eval_command)):
        app.command(name)(command)
    return app


def test_cli_merge_then_eval_side_by_side(run, export_dir, demo_dev, tmp_path):
    root, _, _ = run
    adapter = tmp_path / "adapter"
    result = CliRunner().invoke(_app(), ["merge", "-c", str(root), "-m", str(export_dir / "manifest.json"), "-o", str(adapter)])
    assert result.exit_code == 0, result.output
    assert "merged window 1 of 2 stages" in result.stdout and "adapter: 16 tensors" in result.stdout

    out = tmp_path / "eval.json"
    args = ["eval", "--adapter", str(adapter), "--data", str(demo_dev), "--limit", "16", "-b", "8", "--json-out", str(out)]
    result = CliRunner().invoke(_app(), args)  # --model comes from the adapter's zl_merge.json
    assert result.exit_code == 0, result.output
    assert re.search(r"accuracy\s+│\s+\d\.\d{3}\s+│\s+\d\.\d{3}\s+│\s+[+-]\d\.\d{3}", result.stdout)
    report = json.loads(out.read_text())
    assert report["model"] == "tiny-random" and report["rows"] == 16
    shard = limit_rows(load_shard(demo_dev), 16)
    base = evaluate(load_model("tiny-random").model, shard, 8)
    assert report["results"]["base"]["accuracy"] == base.accuracy
    assert report["results"]["base"]["nll"] == pytest.approx(base.nll, rel=1e-6)
    assert report["results"]["adapter"]["nll"] != pytest.approx(base.nll, rel=1e-4)
    # A classification shard: no perplexity or generations (those are for prompt/completion data).
    assert "samples" not in report and report["results"]["base"]["perplexity"] is None
    assert report["results"]["base"]["generated_rows"] == 0 and "ROUGE-L" not in result.stdout


def test_cli_errors_and_help(run, export_dir, demo_dev, tmp_path):
    result = CliRunner().invoke(_app(), ["eval", "--model", "tiny-random", "--adapter", str(tmp_path), "--data", str(demo_dev)])
    assert isinstance(result.exception, ZLError) and "adapter_config.json is missing" in str(result.exception)
    result = CliRunner().invoke(_app(), ["eval", "--model", "tiny-random", "--data", str(demo_dev), "--limit", "0"])
    assert isinstance(result.exception, ZLError) and "--limit 0" in str(result.exception)
    result = CliRunner().invoke(_app(), ["merge", "-c", str(tmp_path / "none"), "-m", str(export_dir), "-o", str(tmp_path / "a")])
    assert isinstance(result.exception, ZLError) and "no such directory" in str(result.exception)
    for command, example in (("merge", "zl merge --checkpoints"), ("eval", "zl eval --model")):
        result = CliRunner().invoke(_app(), [command, "--help"])
        assert result.exit_code == 0 and example in result.output


@pytest.mark.parametrize("damage", ["truncated", "nan"])
def test_eval_refuses_a_damaged_adapter_before_scoring(run, export_dir, demo_dev, tmp_path, damage):
    """Issue 43: a truncated adapter_model.safetensors was a SafetensorError traceback (after scoring the base), a
    NaN one scored NLL nan."""
    root, _, _ = run
    adapter = merge_checkpoints(root, export_dir, tmp_path / "adapter").out
    weights = adapter / ADAPTER_WEIGHTS
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:-100])
        message = f"--adapter {adapter}: {ADAPTER_WEIGHTS}: not a readable safetensors file"
    else:
        save_file({n: t * float("nan") for n, t in load_file(str(weights)).items()}, str(weights))
        message = f"--adapter {adapter}: {ADAPTER_WEIGHTS}: base_model"
    result = CliRunner().invoke(_app(), ["eval", "--adapter", str(adapter), "--data", str(demo_dev), "--limit", "4"])
    assert isinstance(result.exception, ZLError) and str(result.exception).startswith(message), result.output
    assert "\n" not in str(result.exception) and "scoring" not in result.output
    with pytest.raises(ZLError, match="not a readable safetensors file" if damage == "truncated" else "non-finite"):
        load_adapter(load_model("tiny-random").model, adapter)


def test_eval_refuses_another_base_than_the_adapters_unless_forced(run, export_dir, demo_dev, tmp_path):
    """Issue 43: `zl eval --seed 1` scored an adapter trained on tiny-random seed 0 on another random model, without
    a word."""
    root, _, _ = run
    adapter = merge_checkpoints(root, export_dir, tmp_path / "adapter").out
    base = ["eval", "--adapter", str(adapter), "--data", str(demo_dev), "--limit", "4", "-b", "4"]
    for extra, message in (
        (["--seed", "1"], f"--adapter {adapter}: trained on tiny-random (seed 0), not on tiny-random (seed 1) "
                          "(--seed 1); its LoRA weights are deltas of that base's, so on another they say nothing of "
                          "the adapter. Drop --seed to use the adapter's base, or pass --force-base to use "
                          "tiny-random (seed 1) anyway."),
        (["--model", "tiny-random-qwen2"], "trained on tiny-random (seed 0), not on tiny-random-qwen2 (seed 0) "
                                           "(--model tiny-random-qwen2); "),
    ):
        result = CliRunner().invoke(_app(), [*base, *extra])
        assert isinstance(result.exception, ZLError), result.output
        assert message in str(result.exception), str(result.exception)
    out = tmp_path / "forced.json"
    result = CliRunner().invoke(_app(), [*base, "--seed", "1", "--force-base", "--json-out", str(out)])
    assert result.exit_code == 0, result.output
    assert "trained on tiny-random (seed 0); using tiny-random (seed 1) (--force-base)" in result.stderr
    assert CliRunner().invoke(_app(), [*base, "--seed", "0", "--model", "tiny-random"]).exit_code == 0  # its own base
