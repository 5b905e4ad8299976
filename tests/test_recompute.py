"""Recomputation in the backward (zl_export/recompute.py): the readout's cross-entropy in pieces of the vocabulary,
and `--recompute` (each layer computed again in the backward), against the programs without them."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import native_library_or_skip, widen_chunks
from test_frozen_weights import _perturb_lora_b, saved_bytes
from zl_export import frozen_weights, recompute
from zl_export.backprop_stage import backprop_step
from zl_export.exporter import build_stage_modules, example_inputs, export_stage, write_program
from zl_export.frozen_weights import CompactLinear
from zl_export.model_source import load_model
from zl_export.options import ExportOptions, LoraSettings, LossConfig, ProgramSettings
from zl_export.recompute import chunked_cross_entropy, head_pieces, recompute_from, recompute_in_backward
from zl_export.stage_module import SoftCappedHead
from zl_export.stages import parse_spec
from zl_export.training_program import TrainingProgram


def _full_ce(logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    nll = -F.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (nll * valid).sum() / valid.sum().clamp(min=1.0)


@pytest.mark.parametrize("head_kind", ["linear-bias", "bf16", "int8", "int4", "int4-softcap"])
def test_pieces_give_the_cross_entropy_and_gradient_of_the_whole_readout(monkeypatch, head_kind):
    torch.manual_seed(0)
    widen_chunks(monkeypatch, 64 * 70)  # storage chunks of 70 rows: 70, 70, 60
    monkeypatch.setattr(recompute, "LOSS_CHUNK_ELEMENTS", 6 * 32)  # pieces of 32 rows: a chunk in 3, straddling
    linear = nn.Linear(64, 200, bias=head_kind == "linear-bias").requires_grad_(False)
    head = linear if head_kind == "linear-bias" else CompactLinear(linear, head_kind.split("-")[0])
    if head_kind.endswith("softcap"):
        head = SoftCappedHead(head, 3.0)
    pieces = [(first, rows) for first, rows, _ in head_pieces(head, positions=6)]
    if head_kind == "linear-bias":  # one weight: pieces of 32 rows
        assert pieces == [(0, 32), (32, 32), (64, 32), (96, 32), (128, 32), (160, 32), (192, 8)]
    else:  # a piece never straddles a storage chunk
        assert pieces == [(0, 32), (32, 32), (64, 6), (70, 32), (102, 32), (134, 6), (140, 32), (172, 28)]
    normed = torch.randn(2, 3, 64, requires_grad=True)
    targets = torch.tensor([[0, 69, 70], [199, 101, 5]])  # each piece's edges
    valid = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    got = chunked_cross_entropy(normed, head, targets, valid)
    (grad_got,) = torch.autograd.grad(got, normed)
    want = _full_ce(head(normed), targets, valid)
    (grad_want,) = torch.autograd.grad(want, normed)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_got, grad_want, rtol=1e-5, atol=1e-7)
    if head_kind.startswith("int4"):  # eager training (the torch runtime): the same, each piece widened again
        saved_once = saved_bytes(lambda: chunked_cross_entropy(normed, head, targets, valid))[1]
        frozen_weights.compact_for_training(head)
        loss, saved_again = saved_bytes(lambda: chunked_cross_entropy(normed, head, targets, valid))
        (grad_again,) = torch.autograd.grad(loss, normed)
        torch.testing.assert_close(grad_again, grad_got, rtol=1e-6, atol=1e-8)
        # autograd no longer keeps each piece's float32 rows (200 x 64 floats in all), only their compact bytes
        assert saved_again < saved_once - 0.7 * 200 * 64 * 4, (saved_once, saved_again)


def test_the_readout_goes_in_pieces_for_large_logits_or_under_recompute():
    from zl_export.recompute import needs_chunks

    assert not needs_chunks(128, 49152, recompute=False)  # SmolLM2, every position at seq 128: 24 MiB of logits
    assert needs_chunks(128, 49152, recompute=True)
    assert needs_chunks(256, 262144, recompute=False)  # Gemma 3 at seq 256: 256 MiB
    assert not needs_chunks(16, 262144, recompute=True)  # 16 target slots: one piece


class _Toy(nn.Module):
    """Two 'layers' marked for recomputation and a readout in two marked pieces."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.randn(16, 16) / 4), nn.Parameter(torch.randn(16, 16) / 4)
        self.register_buffer("head", torch.randn(40, 16))

    def forward(self, x):
        h = torch.tanh(recompute_from(x) @ self.w1)  # (8, 16)
        h = torch.tanh(recompute_from(h) @ self.w2)
        lse = [torch.logsumexp(recompute_from(h) @ w.T, -1) for w in self.head.split(20)]
        return torch.logsumexp(torch.stack(lse, -1), -1).sum(), h.detach()


def _joint(module, x):
    from torch.export import export
    from torch.export.experimental import _export_forward_backward

    return _export_forward_backward(export(module, (x,), strict=False), joint_loss_index=0)


def test_the_pass_recomputes_large_saved_tensors_and_keeps_the_numbers():
    torch.manual_seed(1)
    module, x = _Toy(), torch.randn(8, 16)
    plain, recomputed = _joint(module, x), _joint(module, x)
    starts = {n.args[0] for n in recomputed.graph.nodes if n.target == torch.ops.zerolock.recompute_from.default}
    copied = recompute_in_backward(recomputed)
    assert copied > 0
    targets = {n.target for n in recomputed.graph.nodes if n.op == "call_function"}
    assert torch.ops.zerolock.recompute_from.default not in targets  # the program never runs the marker
    forward = recompute._forward_nodes(recomputed)

    def from_constants(node):  # a view of the weights (the exporter's later passes handle those)
        return node.op == "placeholder" and node.name != "x" or node.op == "call_function" and all(
            from_constants(a) for a in node.all_input_nodes)

    # No backward node reads a forward tanh or matmul of the layers or pieces (8 rows of 16 or 20) but the regions'
    # starts (each layer's input): only those, the log-sum-exps (8, and the (8, 2) of both pieces) stay saved.
    for node in recomputed.graph.nodes:
        if node in forward or node.op != "call_function":
            continue
        for arg in node.all_input_nodes:
            if arg in forward and arg.op == "call_function" and arg not in starts and not from_constants(arg):
                assert recompute._numel(arg) <= 16, (node.name, arg.name, arg.target)
    got, want = _run(recomputed, module, x), _run(plain, module, x)
    assert len(got) == len(want) == 4  # loss, h, the gradients of w1 and w2
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def _run(joint, module, x):
    """The joint graph's outputs (the forward's, then the gradients) on the module's weights and input x."""
    state = dict(module.state_dict())
    sig = joint.graph_signature
    named = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
    args = [state[named[n.name]] if n.name in named else x for n in joint.graph.nodes if n.op == "placeholder"]
    return joint.graph_module(*args)


def test_a_graph_without_markers_is_left_alone():
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            return (torch.tanh(x @ self.w)).sum(),

    joint = _joint(Plain(), torch.randn(3, 4))
    before = [n.name for n in joint.graph.nodes]
    assert recompute_in_backward(joint) == 0 and [n.name for n in joint.graph.nodes] == before


def _last_stage_program(tmp_path: Path, pieces: bool, recompute_layers: bool, monkeypatch):
    """The backprop program's last stage of tiny-random (every position read out), run once: (outputs, gradients,
    planned bytes)."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    monkeypatch.setattr(recompute, "LOSS_CHUNK_ELEMENTS", 64 * 100 if pieces else 1 << 40)
    loaded = load_model("tiny-random", seed=3)
    opts = ExportOptions(seq_len=32, micro_batch=2, lora=LoraSettings(4, 8.0, ("q_proj", "v_proj")),
                         loss=LossConfig(alpha=(0.5,), translator_rank=0), seed=5, frozen_dtype="int4",
                         max_targets=0, recompute=recompute_layers)
    peft, modules = build_stage_modules(loaded.model, parse_spec("0-1,2-3", 4), opts,
                                        program=ProgramSettings(kind="backprop"))
    _perturb_lora_b(peft)
    module = modules[-1]
    x, mask, labels = example_inputs(module, opts, loaded.config.vocab_size, seed=7)
    eager = backprop_step(module, x, mask, labels)
    program = export_stage(module, peft, opts, loaded.config.vocab_size)
    plan = deserialize_pte_binary(program.buffer)
    plan = (plan.program if hasattr(plan, "program") else plan).execution_plan[0]
    out = tmp_path / f"p{int(pieces)}{int(recompute_layers)}"
    out.mkdir()
    entry = write_program(program, out)
    result = TrainingProgram(out / entry.file, entry.output_names).step(x, mask, labels)
    return eager, result, sum(plan.non_const_buffer_sizes), _slice_spans(plan)


def _slice_spans(plan) -> list[int]:
    """For each slice the program takes of a constant (aten::slice_copy: a readout piece's rows of a head chunk, and
    their scales), how many instructions later its result is first read."""
    names = [op.name for op in plan.operators]
    calls = [i.instr_args for i in plan.chains[0].instructions if type(i.instr_args).__name__ == "KernelCall"]
    spans = []
    for k, call in enumerate(calls):
        source = plan.values[call.args[0]].val
        if names[call.op_index] == "aten::slice_copy" and getattr(source, "allocation_info", 0) is None:
            out = call.args[-1]
            spans.append(next(j - k for j in range(k + 1, len(calls)) if out in calls[j].args))
    return spans


def test_programs_with_pieces_and_recomputation_train_as_the_plain_one(tmp_path, monkeypatch):
    native_library_or_skip()
    _, plain, plain_bytes, _ = _last_stage_program(tmp_path, False, False, monkeypatch)
    _, layers, layers_bytes, _ = _last_stage_program(tmp_path, False, True, monkeypatch)
    eager, both, both_bytes, spans = _last_stage_program(tmp_path, True, True, monkeypatch)
    # Recomputing the layers runs the same operations on the same values: the same numbers, bit for bit.
    for name in ("loss", "grad_input"):
        assert torch.equal(layers.outputs[name], plain.outputs[name]), name
    assert plain.gradients.keys() == layers.gradients.keys() == both.gradients.keys()
    for name in plain.gradients:
        assert torch.equal(layers.gradients[name], plain.gradients[name]), name
        # Pieces sum the log-sum-exp in another order: float rounding, no more.
        torch.testing.assert_close(both.gradients[name], plain.gradients[name], rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(both.outputs["loss"], plain.outputs["loss"], rtol=1e-6, atol=0)
    torch.testing.assert_close(both.outputs["grad_input"], eager.outputs["grad_input"], rtol=1e-4, atol=1e-8)
    # Planned memory (tiny-random: 817 KB): recomputing the two layers saves 27% (most of the rest is the readout's
    # (64, 320) logits and their gradient), the pieces then another 20%.
    assert layers_bytes < 0.8 * plain_bytes and both_bytes < 0.6 * plain_bytes, (plain_bytes, layers_bytes, both_bytes)
    # Each piece's rows of the int4 head (and their scales) are sliced right before that piece widens them, in the
    # forward and again in the backward: a slice taken ahead would hold planned memory across the other pieces (it
    # did: on Gemma 3 270M, ~76 MiB of its last stage's 133 MiB).
    assert spans and max(spans) <= 2, spans


@pytest.mark.slow  # ~50 s; the backprop programs above take the same pass through ExecuTorch in the default suite
def test_a_zerolock_stage_with_its_consistency_term_recomputes_bit_for_bit(tmp_path):
    """Stage 0 of the zerolock programs (α 0.5: its readout and the embedding's, a KL term; the hidden state goes out
    through the marker) with and without --recompute: the same outputs and gradients."""
    native_library_or_skip()
    results = {}
    for layers in (False, True):
        loaded = load_model("tiny-random", seed=3)
        opts = ExportOptions(seq_len=16, micro_batch=2, lora=LoraSettings(4, 8.0, ("q_proj", "v_proj")),
                             loss=LossConfig(alpha=(0.5,), translator_rank=0), seed=5, recompute=layers)
        peft, modules = build_stage_modules(loaded.model, parse_spec("0-1,2-3", 4), opts)
        _perturb_lora_b(peft)
        x, mask, labels = example_inputs(modules[0], opts, loaded.config.vocab_size, seed=7)
        out = tmp_path / f"stage0-{int(layers)}"
        out.mkdir()
        entry = write_program(export_stage(modules[0], peft, opts, loaded.config.vocab_size), out)
        results[layers] = TrainingProgram(out / entry.file, entry.output_names).step(x, mask, labels)
    plain, layers = results[False], results[True]
    assert plain.outputs.keys() == layers.outputs.keys() >= {"hidden", "loss", "consistency_loss"}
    for name in plain.outputs:
        assert torch.equal(layers.outputs[name], plain.outputs[name]), name
    for name in plain.gradients:
        assert torch.equal(layers.gradients[name], plain.gradients[name]), name
