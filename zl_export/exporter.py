"""Export each pipeline stage as an ExecuTorch training program (docs/design#stage-program).

    torch.export (ATen)  ->  _export_forward_backward (joint fwd+bwd, loss = `loss`)
    ->  rewrite empty_permuted  ->  to_edge  ->  to_executorch  ->  stage_<k>.pte

The emitted program returns user outputs, then the LoRA gradients, then the
LoRA parameters (ExecuTorch's training convention, sliced by the
`__et_training_*` index methods). A backprop program (zl_export/backprop_stage.py,
docs/design#backprop-program) also returns its input's gradient, as the last user output.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from zl_base.errors import ZLError
from zl_export.frozen_weights import compact_frozen_weights, restore_frozen_weights, widen_per_use
from zl_export.recompute import recompute_in_backward
from zl_export.backprop_stage import BackpropStage
from zl_export.lora import attach_lora, peft_names
from zl_export.manifest import StageEntry, stage_entry
from zl_export.options import ExportOptions, ProgramSettings
from zl_export.stage_module import StageModule
from zl_export.stages import StageRange
from zl_export.translator import fit_lenses, translator_name

MARKER_OP = "zerolock::pipeline_marker.out"


@dataclass
class StageProgram:
    """One exported stage: its program bytes and what the manifest records of it (less the program file)."""

    stage: StageRange
    buffer: bytes
    entry: StageEntry  # inputs, outputs, parameters in gradient order
    export_s: float


def build_stage_modules(
    base_model: torch.nn.Module, stages: list[StageRange], opts: ExportOptions,
    calibration: list[tuple[torch.Tensor, torch.Tensor]] | None = None, program: ProgramSettings | None = None,
) -> tuple[torch.nn.Module, list[StageModule]]:
    """Attach LoRA to `base_model` and cut it into one `StageModule` per stage.

    Args:
        calibration: (input_ids, attention_mask) rows to fit the readout lenses on
            (`translator_init="lens"`; zl_export.translator.fit_lenses).
        program: which program the modules compute; default (and kind zerolock) `StageModule`s, kind backprop
            `BackpropStage`s.

    Returns:
        (peft_model, stage modules); the modules share the peft model's weights.

    Raises:
        ZLError: lens translators without calibration rows.
    """
    opts.loss.validate(len(stages))
    # A model that went through here before (its LoRA unloaded) still holds compact frozen weights: float32 first.
    restore_frozen_weights(base_model)
    peft_model = attach_lora(base_model, opts.lora, seed=opts.seed)
    compact_frozen_weights(peft_model, opts.frozen_dtype, opts.embedding_dtype)  # in place (fp32: as is)
    if program is not None and program.kind == "backprop":
        modules = [BackpropStage(peft_model, s, len(stages), opts.loss, seed=opts.seed, max_targets=opts.target_slots,
                                 local_weight=program.local_weight, recompute=opts.recompute).eval() for s in stages]
    else:
        modules = [StageModule(peft_model, s, len(stages), opts.loss, seed=opts.seed, max_targets=opts.target_slots,
                               recompute=opts.recompute).eval() for s in stages]
    hidden = base_model.config.hidden_size
    if opts.loss.translator_rank > hidden:
        raise ZLError(f"--translator-rank {opts.loss.translator_rank}: more than the model's hidden size {hidden}; "
                      f"use {hidden} (a full-rank map) or less.")
    if opts.loss.translator_rank and opts.loss.translator_init == "lens" and any(m.translator is not None for m in modules):
        if not calibration:
            raise ZLError("--translator-init lens needs calibration rows (the training shard); none were given.")
        for k, lens in fit_lenses(modules, calibration).items():
            modules[k].translator.start_from(lens)
    return peft_model, modules


def manifest_names(module: StageModule, peft_model: torch.nn.Module) -> dict[int, str]:
    """`id(parameter)` -> manifest name of every trainable parameter of `module`: PEFT names for LoRA (merge into
    one adapter), `zl.translator.stage_<k>.*` for its readout translator."""
    names = peft_names(peft_model)
    if module.translator is not None:
        names.update({id(p): translator_name(module.stage.index, n) for n, p in module.translator.named_parameters()})
    return names


def example_inputs(module: StageModule, opts: ExportOptions, vocab_size: int, seed: int = 0,
                   targets: int | None = None) -> tuple:
    """Deterministic inputs of the program's shapes: the first row right-padded, some labels ignored.

    Args:
        targets: label only the last `targets` real tokens of each row (a completion after a prompt, e.g. 2
            for AG News: label word + EOS). Default: everything after a short "prompt", capped at the
            program's target slots, so that no target is dropped.

    Returns:
        (input_ids (B,S) int64 | hidden (B,S,D) f32, attention_mask (B,S) int64, labels (B,S) int64), then for a
        backprop program's stage before the last grad_hidden (B,S,D) f32.
    """
    batch, seq = opts.micro_batch, opts.seq_len
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, seq - max(1, seq // 4) :] = 0  # right padding on the first row
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, : max(1, seq // 8)] = -100  # an ignored "prompt"
    if targets is None and module.max_targets > 0:
        targets = module.max_targets
    if targets is not None:  # keep the last `targets` labels of each row (a target is a label after position 0)
        kept = (labels != -100).long().flip(1).cumsum(1).flip(1)  # (B, S): labels from here to the row's end
        labels = labels.masked_fill(kept > targets, -100)
    x = ids if module.is_first else torch.randn(batch, seq, module.hidden_size, generator=gen)
    if isinstance(module, BackpropStage) and not module.is_last:
        return x, mask, labels, torch.randn(batch, seq, module.hidden_size, generator=gen)
    return x, mask, labels


def export_stage(
    module: StageModule,
    peft_model: torch.nn.Module,
    opts: ExportOptions,
    vocab_size: int,
    on_phase: Callable[[str], None] = lambda phase: None,
) -> StageProgram:
    """Export one stage to an ExecuTorch training program.

    Args:
        module: the stage.
        peft_model: the model the stage was cut from (for PEFT parameter names).
        opts: shapes, LoRA and loss settings.
        vocab_size: range of example token ids.
        on_phase: called with the name of each export phase, for progress display.
    """
    from executorch.exir import EdgeCompileConfig, to_edge
    from torch.export import export
    from torch.export.experimental import _export_forward_backward

    start = time.perf_counter()
    inputs = example_inputs(module, opts, vocab_size)
    if isinstance(module, BackpropStage) and not module.is_first:
        inputs[0].requires_grad_()  # the joint graph then computes the input's gradient, grad_input
    on_phase("torch.export")
    ep = export(module, inputs, strict=False)
    on_phase("joint graph")
    joint = _export_forward_backward(ep, joint_loss_index=module.loss_output_index)
    recompute_in_backward(joint)  # before the input gradient joins the outputs: it tells forward from backward
    input_gradients_as_outputs(joint)
    _rewrite_empty_permuted(joint)
    _matmuls_to_linear(joint)
    _schedule_marker_first(joint)
    widen_per_use(joint)
    grad_fqns = [
        spec.target for spec in joint.graph_signature.output_specs if spec.kind.name == "GRADIENT_TO_PARAMETER"
    ]
    on_phase("to_edge")
    # The marker is a custom op outside the edge dialect's core set.
    # linear stays linear (see _matmuls_to_linear): ExecuTorch's linear.out kernel needs no transposed copy.
    edge = to_edge(joint, compile_config=EdgeCompileConfig(_check_ir_validity=False,
                                                           preserve_ops=[torch.ops.aten.linear.default]))
    on_phase("to_executorch")
    program = edge.to_executorch()
    buffer = program.buffer
    entry = stage_entry(module, manifest_names(module, peft_model), opts, program_names=grad_fqns)
    return StageProgram(stage=module.stage, buffer=buffer, entry=entry, export_s=time.perf_counter() - start)


def write_program(program: StageProgram, out_dir: Path) -> StageEntry:
    """Write `stage_<k>.pte` and return its manifest entry."""
    name = f"stage_{program.stage.index}.pte"
    path = out_dir / name
    tmp = path.with_suffix(".pte.tmp")
    tmp.write_bytes(program.buffer)
    tmp.replace(path)
    return program.entry.with_program(name, program.buffer, program.export_s)


def input_gradients_as_outputs(ep: torch.export.ExportedProgram) -> int:
    """Move the gradients of user inputs among the user outputs, after the others; returns how many moved.

    The joint graph returns an input's gradient (`GRADIENT_TO_USER_INPUT`) after the parameters' gradients, where
    ExecuTorch's training convention (user outputs, then one gradient per parameter, then the parameters, sliced
    by the `__et_training_*` index methods) has no place for it: ExecuTorch would count it as a parameter's
    gradient and shift every slice after it. As the last user output it is one more output of the program.
    """
    from torch.export.graph_signature import ExportGraphSignature, OutputKind, OutputSpec

    specs = list(ep.graph_signature.output_specs)
    moved = [i for i, spec in enumerate(specs) if spec.kind == OutputKind.GRADIENT_TO_USER_INPUT]
    if not moved:
        return 0
    user_kinds = (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT)
    user = [i for i, spec in enumerate(specs) if spec.kind in user_kinds]
    if user != list(range(len(user))):
        raise RuntimeError(f"joint graph outputs {[s.kind.name for s in specs]}: expected the user outputs first")
    order = user + moved + [i for i in range(len(specs)) if i not in user and i not in moved]
    output = next(n for n in ep.graph.nodes if n.op == "output")
    values = list(output.args[0])
    output.args = (tuple(values[i] for i in order),)
    ep._graph_signature = ExportGraphSignature(  # no public setter: the signature is rebuilt from its specs
        list(ep.graph_signature.input_specs),
        [OutputSpec(OutputKind.USER_OUTPUT, specs[i].arg, None) if i in moved else specs[i] for i in order])
    ep.graph_module.recompile()
    return len(moved)


def _rewrite_empty_permuted(ep: torch.export.ExportedProgram) -> None:
    """Replace `aten.empty_permuted` (from the SiLU backward) with `aten.empty` of the same shape.

    The edge dialect has no `empty_permuted`. Its result is an uninitialised
    buffer whose values are all overwritten, so only the memory layout could
    differ; in these graphs the permutation is the identity anyway.
    """
    graph = ep.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target == torch.ops.aten.empty_permuted.default:
            with graph.inserting_before(node):
                empty = graph.call_function(torch.ops.aten.empty.memory_format, (node.args[0],), dict(node.kwargs))
            empty.meta = dict(node.meta)
            node.replace_all_uses_with(empty)
            graph.erase_node(node)
    graph.lint()
    ep.graph_module.recompile()


_TRANSPOSES = (torch.ops.aten.permute.default, torch.ops.aten.t.default)


def _is_2d_transpose(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target not in _TRANSPOSES:
        return False
    return node.target == torch.ops.aten.t.default or list(node.args[1]) in ([1, 0], [-1, -2], [1, -2], [-1, 0])


def _matmuls_to_linear(ep: torch.export.ExportedProgram) -> int:
    """Take the weight transposes out of the matmuls; returns how many matmuls changed.

    The joint graph computes an `nn.Linear` forward as `mm(x, t(W))` and its
    input gradient as `mm(g, t(t(W)))`. ExecuTorch runs every `t` as
    `permute_copy`, a real copy of the weight: all the frozen base weights
    and the LM head, twice a step. Rewritten, `mm(x, t(W))` becomes
    `linear(x, W)` (ExecuTorch's `linear.out` reads W as it is) and
    `mm(g, t(t(W)))` becomes `mm(g, W)`; `addmm` likewise.
    """
    graph, count = ep.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target == torch.ops.aten.mm.default:
            x, wt = node.args
            bias = None
        elif node.target == torch.ops.aten.addmm.default and not node.kwargs:
            bias, x, wt = node.args
        else:
            continue
        if not (isinstance(wt, torch.fx.Node) and _is_2d_transpose(wt)):
            continue
        weight = wt.args[0]
        with graph.inserting_before(node):
            if isinstance(weight, torch.fx.Node) and _is_2d_transpose(weight):  # x @ t(t(W)) = x @ W
                args = (x, weight.args[0]) if bias is None else (bias, x, weight.args[0])
                new = graph.call_function(node.target, args)
            else:
                args = (x, weight) if bias is None else (x, weight, bias)
                new = graph.call_function(torch.ops.aten.linear.default, args)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        if not wt.users:
            graph.erase_node(wt)
            if isinstance(weight, torch.fx.Node) and _is_2d_transpose(weight) and not weight.users:
                graph.erase_node(weight)
        count += 1
    graph.lint()
    ep.graph_module.recompile()
    return count


def _schedule_marker_first(ep: torch.export.ExportedProgram) -> None:
    """Order the graph so the marker runs as soon as the chunk output exists.

    Everything the marker does not depend on (activation copies kept for the
    backward, the previous readout, the loss, the backward) moves after it,
    keeping relative order. The emitted program then reaches the marker with
    the least work (phase 1 is the chunk forward only), which is what the
    stage contract asks and what makes early forwarding pay.
    """
    graph = ep.graph
    nodes = list(graph.nodes)
    markers = [n for n in nodes if n.op == "call_function" and "pipeline_marker" in str(n.target)]
    if not markers:
        return  # the last stage has no hidden output
    (marker,) = markers
    ancestors, stack = set(), list(marker.all_input_nodes)
    while stack:
        node = stack.pop()
        if node not in ancestors:
            ancestors.add(node)
            stack.extend(node.all_input_nodes)
    cursor = marker
    for node in nodes[: nodes.index(marker)]:
        if node.op == "call_function" and node not in ancestors:
            cursor.append(node)
            cursor = node
    graph.lint()
    ep.graph_module.recompile()
