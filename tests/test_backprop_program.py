"""The backprop program (zl_export/backprop_stage.py, docs/design#backprop-program): stage programs that take the
gradient of their output hidden state and give their LoRA gradients and their input's, chained from the last stage back,
equal whole-model backprop in eager PyTorch — the Hugging Face model with PEFT LoRA (B nonzero) and its own CE on the
targets, cut at the same layers with hooks: hidden states, the loss, every LoRA gradient and every input gradient.

Default suite: every family's eager modules (full and Ω readout, fp32 and bf16), the upstream modules' missing
readout, the manifest of `export_pipeline` (exporter stubbed); tiny-random's exported backprop programs train on the
runner as whole-model backprop in tests/test_runner_schedules.py. Slow: tiny-random Llama's middle stage of 3
(grad_hidden in, grad_input out) exported and run by ExecuTorch between the eager first and last stages, every stage
of every family through ExecuTorch, the local-weight program, `zl export --program backprop` with its check. The reference shares no code with the module under test: `F.cross_entropy` on the HF model's logits and
autograd's gradients of its hidden states; the chain (`backprop_chain`) only passes tensors between the steps.
"""

import pytest
import torch
import torch.nn.functional as F

from conftest import native_library_or_skip
from test_model_families import randomize_lora_b
from zl_base.errors import ZLError
from zl_export.backprop_stage import backprop_chain, backprop_step
from zl_export.exporter import build_stage_modules, example_inputs, export_stage, write_program
from zl_export.model_source import load_model
from zl_export.options import ExportOptions, LoraSettings, LossConfig, ProgramSettings
from zl_export.stages import parse_spec
from zl_export.training_program import TrainingProgram

MODELS = {"llama": "tiny-random", "qwen2": "tiny-random-qwen2", "qwen3": "tiny-random-qwen3",
          "phi3": "tiny-random-phi3", "gemma3_text": "tiny-random-gemma3"}
SPLIT = "0-1,2-2,3-3"  # 3 stages of the tiny models' 4 layers: first, middle (input and output), last
SLOTS = 5  # Ω-readout target slots, fewer than a row of example_inputs has targets


def _build(name: str, slots: int = SLOTS, frozen_dtype: str = "bf16", local_weight: float = 0.0, alpha: float = 0.5):
    """The model with LoRA on every projection (B random, so every gradient is nonzero) cut into SPLIT's stages as
    backprop modules; with `local_weight`, upstream stages add their local loss (α `alpha`, no translator)."""
    loaded = load_model(name, seed=3)
    opts = ExportOptions(seq_len=24, micro_batch=2, lora=LoraSettings(4, 8.0, loaded.family.lora_targets),
                         loss=LossConfig(alpha=alpha, translator_rank=0), seed=5, max_targets=slots,
                         frozen_dtype=frozen_dtype)
    peft_model, modules = build_stage_modules(loaded.model, parse_spec(SPLIT, 4), opts,
                                              program=ProgramSettings("backprop", local_weight))
    randomize_lora_b(peft_model)
    return loaded, peft_model, modules, opts


def _whole_model_backprop(peft_model, modules, ids, mask, labels):
    """Whole-model backprop of the HF model's CE on the targets: (loss, the output hidden state of every stage but
    the last, the final loss's gradient with respect to each of them, every LoRA gradient by PEFT name)."""
    base = peft_model.get_base_model()
    outs = {}

    def keep(k):
        def hook(module, args, output):
            h = output[0] if isinstance(output, tuple) else output
            h.retain_grad()
            outs[k] = h
        return hook

    handles = [base.model.layers[m.stage.last].register_forward_hook(keep(m.stage.index)) for m in modules[:-1]]
    try:
        peft_model.zero_grad(set_to_none=True)
        logits = base(input_ids=ids, attention_mask=mask).logits[:, :-1]  # (B, S-1, V): the HF model's own readout
    finally:
        for h in handles:
            h.remove()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
    loss.backward()
    grads = {n.replace(".default.", "."): p.grad.clone() for n, p in peft_model.named_parameters()
             if "lora_" in n and p.grad is not None}
    hidden = [outs[k].detach() for k in range(len(modules) - 1)]
    return loss.detach(), hidden, [outs[k].grad.clone() for k in range(len(modules) - 1)], grads


def _assert_backprop_equal(results, names, ref, rtol=1e-4, atol=1e-6):
    """The chained steps equal whole-model backprop: hidden states, loss, each input gradient, every LoRA
    gradient (`names`: per stage, program name -> PEFT name)."""
    loss, hidden, hidden_grads, grads = ref
    torch.testing.assert_close(results[-1].outputs["loss"], loss, rtol=rtol, atol=atol)
    for k, h in enumerate(hidden):
        # atol 5e-5: ExecuTorch's kernels round differently, and the error of every layer before adds up here
        # (the reference is the whole model's forward, not re-fed the program's hidden state as tests/test_export.py's)
        torch.testing.assert_close(results[k].outputs["hidden"], h, rtol=rtol, atol=5e-5,
                                   msg=lambda m, k=k: f"hidden {k}: {m}")
        got = results[k + 1].outputs["grad_input"]
        assert hidden_grads[k].abs().max() > 0
        torch.testing.assert_close(got, hidden_grads[k], rtol=rtol, atol=rtol * float(hidden_grads[k].abs().max()),
                                   msg=lambda m, k=k: f"grad_input of stage {k + 1}: {m}")
    assert "grad_input" not in results[0].outputs
    got = {names[k][n]: g for k, r in enumerate(results) for n, g in r.gradients.items()}
    assert set(got) == set(grads) and grads
    for n, g in grads.items():
        assert g.abs().max() > 0, n
        # the error of the stages after this one adds up in a gradient: absolute to rtol of the tensor's scale
        torch.testing.assert_close(got[n], g, rtol=rtol, atol=max(atol, rtol * float(g.abs().max())),
                                   msg=lambda m, n=n: f"{n}: {m}")


def _program_names(modules, peft_model) -> list[dict[str, str]]:
    from zl_export.exporter import manifest_names

    out = []
    for m in modules:
        ids = manifest_names(m, peft_model)
        out.append({n: ids[id(p)] for n, p in m.named_parameters() if p.requires_grad})
    return out


@pytest.mark.parametrize("name", list(MODELS.values()))
@pytest.mark.parametrize("slots,dtype", [(0, "fp32"), (SLOTS, "bf16")])
def test_eager_backprop_modules_equal_whole_model_backprop(name, slots, dtype, one_torch_thread):
    """Every family, full and Ω readout, fp32 and bf16 frozen weights: the eager modules chained equal the HF model."""
    loaded, peft_model, modules, opts = _build(name, slots, dtype)
    ids, mask, labels = example_inputs(modules[0], opts, loaded.config.vocab_size, seed=7)[:3]
    assert (mask == 0).any() and (labels == -100).any()
    ref = _whole_model_backprop(peft_model, modules, ids, mask, labels)
    results = backprop_chain(lambda k, *inputs: backprop_step(modules[k], *inputs), modules, ids, mask, labels)
    _assert_backprop_equal(results, _program_names(modules, peft_model), ref, rtol=1e-5, atol=1e-7)


def test_upstream_modules_hold_no_readout_and_the_last_its_true_loss():
    """w = 0: stages before the last own no norm, LM head or translator; the last one reads out, whatever α."""
    _, _, modules, _ = _build("tiny-random")
    assert [m.lm_head is None and m.norm is None and m.translator is None for m in modules] == [True, True, False]
    assert [m.input_names[-1] for m in modules] == ["grad_hidden", "grad_hidden", "labels"]
    assert [m.output_names for m in modules] == [["hidden", "loss"], ["hidden", "loss", "grad_input"],
                                                  ["loss", "grad_input"]]


def test_local_weight_adds_the_weighted_local_gradient(one_torch_thread):
    """w > 0: an upstream stage's loss, LoRA gradients and input gradient are the end-to-end ones (<h, g>'s) plus w
    times its local loss's."""
    w = 0.25
    loaded, peft_model, modules, opts = _build("tiny-random", local_weight=w)
    stage = modules[1]
    x, mask, labels, g = example_inputs(stage, opts, loaded.config.vocab_size, seed=7)
    g = g * 1e-3  # the end-to-end gradient about as large as the local loss's, so neither hides the other
    both = backprop_step(stage, x, mask, labels, g)
    names = [n for n, p in stage.named_parameters() if p.requires_grad]
    xl = x.clone().requires_grad_()
    wrt = [*(p for p in stage.parameters() if p.requires_grad), xl]
    h_in, h = stage.chunk(xl, mask)
    local = stage.loss_terms(h_in, h, labels)[0]
    e2e = torch.autograd.grad((h * g).sum(), wrt, retain_graph=True)
    own = torch.autograd.grad(local, wrt)
    torch.testing.assert_close(both.outputs["local_loss"], local.detach())
    torch.testing.assert_close(both.outputs["loss"], (h * g).sum().detach() + w * local.detach())
    for n, a, b in zip(names + ["grad_input"], e2e, own):
        got = both.outputs["grad_input"] if n == "grad_input" else both.gradients[n]
        assert b.abs().max() > 0, n
        torch.testing.assert_close(got, a + w * b, rtol=1e-5, atol=1e-8, msg=n)


def test_a_bad_local_weight_is_one_error():
    with pytest.raises(ZLError, match=r"--local-weight -1.0: must be 0"):
        ProgramSettings("backprop", -1.0).validate()
    with pytest.raises(ZLError, match=r"--local-weight 0.5: only the backprop program.*add --program backprop"):
        ProgramSettings("zerolock", 0.5).validate()


def _export_and_chain(tmp_path, name, exported=(0, 1, 2)):
    """Export the stages `exported` (the others run eagerly, `backprop_step`), chain all against the reference.
    Returns (the loaded model, the exported stages' manifest entries by index)."""
    native_library_or_skip()
    loaded, peft_model, modules, opts = _build(name)
    entries = {k: write_program(export_stage(modules[k], peft_model, opts, loaded.config.vocab_size), tmp_path)
               for k in exported}
    programs = {k: TrainingProgram(tmp_path / e.file, e.output_names) for k, e in entries.items()}
    ids, mask, labels = example_inputs(modules[0], opts, loaded.config.vocab_size, seed=7)[:3]
    ref = _whole_model_backprop(peft_model, modules, ids, mask, labels)

    def step(k, *inputs):
        return programs[k].step(*inputs) if k in programs else backprop_step(modules[k], *inputs)

    results = backprop_chain(step, modules, ids, mask, labels)
    names = _program_names(modules, peft_model)
    for k, e in entries.items():  # the manifest names the programs' parameters as the modules do
        assert {p.program_name: p.name for p in e.parameters} == names[k]
    _assert_backprop_equal(results, names, ref)
    return loaded, entries


# Slow (~25 s of export): the default suite's test_runner_schedules exports every stage's backprop program of
# tiny-random and trains them on the runner to whole-model backprop's adapter.
@pytest.mark.slow
def test_exported_middle_stage_chained_equals_whole_model_backprop(tmp_path):
    """tiny-random Llama, 3 stages, the middle one (grad_hidden in, grad_input out) through ExecuTorch's runtime
    between the eager first and last: the chain equals whole-model backprop; the manifest entry names its inputs and
    outputs, and the program holds no LM head."""
    loaded, entries = _export_and_chain(tmp_path, "tiny-random", exported=(1,))
    entry, cfg = entries[1], loaded.config
    assert [i.name for i in entry.inputs] == ["hidden", "attention_mask", "labels", "grad_hidden"]
    assert entry.inputs[-1].to_json() == {"name": "grad_hidden", "dtype": "float32", "shape": [2, 24, cfg.hidden_size]}
    assert entry.output_names == ["hidden", "loss", "grad_input"]
    assert entry.outputs[-1].to_json() == {"name": "grad_input", "dtype": "float32", "shape": [2, 24, cfg.hidden_size]}
    head = [cfg.vocab_size, cfg.hidden_size]
    assert head not in _tensor_shapes((tmp_path / entry.file).read_bytes())  # no LM head (nor embedding)


def _tensor_shapes(pte: bytes) -> list[list[int]]:
    """The shape of every tensor a program's method holds (constants, activations, gradients)."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    program = deserialize_pte_binary(pte)
    program = getattr(program, "program", program)  # newer ExecuTorch wraps it with its named data
    return [list(v.val.sizes) for v in program.execution_plan[0].values if type(v.val).__name__ == "Tensor"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS.values()))
def test_exported_backprop_programs_of_every_family(tmp_path, name):
    """Every family, 3 stages, all through ExecuTorch's runtime: the chain equals whole-model backprop."""
    _export_and_chain(tmp_path, name)


def _zl_export(args: list[str]):
    """`zl export ARGS` in-process (a one-command typer app)."""
    import typer
    from typer.testing import CliRunner

    from zl.commands.export import export_command

    app = typer.Typer(add_completion=False)
    app.command("export")(export_command)
    app.callback()(lambda: None)
    return CliRunner().invoke(app, ["export", *args])


def test_local_weight_without_the_backprop_program_is_refused_before_loading(tmp_path):
    result = _zl_export([ "--model", "tiny-random", "--local-weight", "0.5",
                                      "--out", str(tmp_path / "x")])
    assert isinstance(result.exception, ZLError)  # `zl` prints it as one line, exit 2 (zl_base/entry.py)
    assert "--local-weight 0.5: only the backprop program" in str(result.exception)
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_zl_export_program_backprop_checks_and_records_the_kind(tmp_path):
    """`zl export --program backprop` with its check (ExecuTorch's chain against eager's): exit 0, the manifest
    records the program, the check's table shows each stage."""
    import json

    native_library_or_skip()
    out = tmp_path / "export"
    result = _zl_export(["--model", "tiny-random", "--num-stages", "3", "--seq-len", "16",
                                      "--program", "backprop", "--out", str(out)])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["program"] == {"kind": "backprop", "local_weight": 0.0}
    assert [o["name"] for o in manifest["stages"][1]["outputs"]] == ["hidden", "loss", "grad_input"]
    assert "loss ET" in result.output and "|Δ|grad" in result.output  # the check's table


@pytest.mark.slow
def test_exported_local_weight_program_equals_its_eager_step(tmp_path):
    """w > 0 (with the KL term, α 0.5): the middle stage's program holds the readout and computes what its eager
    module does — loss, local_loss, grad_input and every LoRA gradient."""
    native_library_or_skip()
    loaded, peft_model, modules, opts = _build("tiny-random", local_weight=0.25)
    entry = write_program(export_stage(modules[1], peft_model, opts, loaded.config.vocab_size), tmp_path)
    assert entry.output_names == ["hidden", "loss", "local_loss", "grad_input"]
    inputs = example_inputs(modules[1], opts, loaded.config.vocab_size, seed=7)
    got = TrainingProgram(tmp_path / entry.file, entry.output_names).step(*inputs)
    want = backprop_step(modules[1], *inputs)
    for k, v in want.outputs.items():
        torch.testing.assert_close(got.outputs[k], v, rtol=1e-4, atol=1e-6, msg=k)
    for k, v in want.gradients.items():
        torch.testing.assert_close(got.gradients[k], v, rtol=1e-4, atol=1e-6, msg=k)


def test_export_pipeline_builds_backprop_modules_and_records_the_program(tmp_path, monkeypatch):
    """`export_pipeline` with ProgramSettings("backprop", w): backprop modules reach the exporter and the manifest
    records the program and each stage's inputs and outputs (the exporter itself stubbed: no ExecuTorch export)."""
    import json

    from zl_export import exporter
    from zl_export.backprop_stage import BackpropStage
    from zl_export.manifest import stage_entry
    from zl_export.options import ModelSplit
    from zl_export.pipeline import export_pipeline

    def fake_export(module, peft_model, opts, vocab_size, on_phase=None):
        assert isinstance(module, BackpropStage) and module.local_weight == (0.0 if module.is_last else 0.5)
        entry = stage_entry(module, exporter.manifest_names(module, peft_model), opts)
        return exporter.StageProgram(module.stage, b"pte", entry, 0.0)

    monkeypatch.setattr(exporter, "export_stage", fake_export)
    out = tmp_path / "export"
    export_pipeline(ModelSplit("tiny-random", "0-1,2-3"), out, ExportOptions(seq_len=16),
                    program=ProgramSettings("backprop", 0.5))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["program"] == {"kind": "backprop", "local_weight": 0.5}
    assert [[o["name"] for o in s["outputs"]] for s in manifest["stages"]] == [["hidden", "loss", "local_loss"],
                                                                              ["loss", "grad_input"]]
