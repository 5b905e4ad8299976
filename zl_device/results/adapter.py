"""Merge per-stage LoRA checkpoints into one PEFT adapter (`zl merge`, docs/design#stage-program, #run-outputs).

Each stage runner checkpoints only its own LoRA parameters, under their PEFT
names (runner/include/zl/checkpoint.h):

    <checkpoints>/stage_<k>/window_000012/adapter.safetensors   F32, PEFT names
    <checkpoints>/stage_<k>/window_000012/progress.json         stage, window, run_id, progress

The orchestrator gives stage k the runner `checkpoint_dir` `stage_<k>` under
the run's checkpoint root (zl_device/formats/checkpoints.py `CheckpointLayout` says so, and can be changed).
Because every name is a PEFT name and the manifest lists each stage's
parameters, merging is a union of the stages' tensors checked against the
manifest: every parameter present exactly once with its shape, nothing else,
and all stages at the same window. The result is a directory that
`PeftModel.from_pretrained(base_model, out)` loads:

    adapter_config.json          from the manifest's LoRA settings (zl_export.lora.adapter_config)
    adapter_model.safetensors    all stages' LoRA tensors, F32
    zl_merge.json                where they came from: manifest, stage windows, run id
    early_exit/stage_<k>.safetensors   a stage's readout translator (`--translator-rank`), if it has one:
                                 not part of the fine-tuned model, an early-exit head of stage k
"""

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zl_base.errors import ZLError
from zl_base.json_reader import read_typed
from zl_device.formats.checkpoints import DEFAULT_LAYOUT, CheckpointLayout
from zl_device.formats.tensor_files import check_finite, read_tensors
from zl_export.lora import adapter_config
from zl_export.manifest import MANIFEST, Manifest, StageEntry, read_manifest
from zl_export.translator import is_translator_name

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MERGE_INFO = "zl_merge.json"
EARLY_EXIT_DIR = "early_exit"


@dataclass
class StageCheckpoint:
    """What was taken from one stage."""

    index: int
    window: int
    path: Path  # the adapter file
    tensors: int
    numel: int
    progress: dict  # progress.json


@dataclass
class MergeResult:
    out: Path
    stages: list[StageCheckpoint]
    window: int
    run_id: str | None
    finished: bool  # every stage's checkpoint covers its run's last micro-batch (as far as progress.json says)
    config: dict = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.stages)


def base_model_reference(manifest: Manifest) -> str:
    """What `adapter_config.json` names as the base model: a hub id or directory when the weights came from one.

    The built-in names (`smollm2-135m`, `tiny-random`) are zl's, so they are
    kept as they are: `zl eval --model NAME` resolves them.
    """
    kind, _, where = manifest.model.source.partition(":")
    if kind in ("hub", "dir") and where:
        return where
    return manifest.model.name


def merge_checkpoints(
    checkpoints: Path | str,
    manifest_path: Path | str,
    out: Path | str,
    window: int | None = None,
    layout: CheckpointLayout = DEFAULT_LAYOUT,
) -> MergeResult:
    """Collect one checkpoint per stage and write a PEFT adapter directory.

    Args:
        checkpoints: the checkpoint root (`RUN_DIR/checkpoints`).
        manifest_path: the export's `manifest.json` (or a directory holding it).
        out: the adapter directory to write (created; existing adapter files are replaced).
        window: take this window of every stage; None takes each stage's
            latest, which must be the same window on all stages.
        layout: where stage and window directories are under `checkpoints`.

    Returns:
        what was merged.

    Raises:
        ZLError: a missing stage or window, stages at different windows, a
            checkpoint of another stage or run, a missing, extra, wrongly
            shaped or non-F32 parameter, a parameter listed twice in the manifest,
            an unreadable file, or a weight or AdamW moment that is nan or inf
            (a damaged run; the message names the stage and window).
    """
    manifest_file = Path(manifest_path) / MANIFEST if Path(manifest_path).is_dir() else Path(manifest_path)
    manifest = read_manifest(manifest_file)
    root = Path(checkpoints)
    if not root.is_dir():
        raise ZLError(
            f"checkpoints {root}: no such directory; pass the run's checkpoint root (RUN_DIR/checkpoints), "
            f"which holds {layout.stage_dir.format(k='<k>')}/window_NNNNNN/{layout.adapter_file} per stage."
        )
    stages = manifest.stages  # in index order (Manifest.from_json)
    owner = _parameter_owners(stages, manifest_file)
    chosen = _choose_window(root, stages, window, layout)

    merged: dict[str, torch.Tensor] = {}
    heads: dict[int, dict[str, torch.Tensor]] = {}  # stage -> its readout translator's tensors
    taken: list[StageCheckpoint] = []
    run_ids: dict[int, str] = {}
    finished = True
    for stage in stages:
        k = stage.index
        window_dir = layout.stage_root(root, k) / layout.window_dir.format(window=chosen)
        progress = _read_progress(window_dir / layout.progress_file, k, chosen)
        run_ids[k] = progress.get("run_id")
        total = (progress.get("extra") or {}).get("num_micro_batches")
        if total is None or progress.get("micro_batches_done") != total:
            finished = False
        tensors = _read_stage_adapter(window_dir / layout.adapter_file, stage, chosen, owner)
        _check_optimizer_state(window_dir / layout.optimizer_file, k, chosen)
        head = {n: tensors.pop(n) for n in [n for n in tensors if is_translator_name(n)]}
        if head:
            heads[k] = head
        merged.update(tensors)
        taken.append(StageCheckpoint(k, chosen, window_dir / layout.adapter_file, len(tensors),
                                     sum(t.numel() for t in tensors.values()), progress))
    if len(set(run_ids.values())) > 1:
        listing = ", ".join(f"stage {k}: {r}" for k, r in run_ids.items())
        raise ZLError(
            f"checkpoints {root}: the stages come from different runs ({listing}); "
            "merge the checkpoints of one run (one RUN_DIR/checkpoints)."
        )
    recorded = manifest.to_json()  # zl_merge.json repeats the manifest's model and lora as it records them
    config = adapter_config(manifest.options.lora, base_model_reference(manifest))
    run_id = next(iter(run_ids.values()), None)
    info = {
        "format": "zl-merge",
        "version": 1,
        "manifest": str(manifest_file.resolve()),
        "model": recorded["model"],
        "tokenizer": manifest.tokenizer,
        "lora": recorded["lora"],
        "run_id": run_id,
        "window": chosen,
        "finished": finished,
        "stages": [
            {"index": s.index, "layers": list(stages[s.index].layers), "window": s.window, "checkpoint": str(s.path.resolve()),
             "tensors": s.tensors, "micro_batches_done": s.progress.get("micro_batches_done"),
             "num_micro_batches": (s.progress.get("extra") or {}).get("num_micro_batches"),
             "optimizer_step": s.progress.get("optimizer_step")}
            for s in taken
        ],
    }
    _write_adapter(Path(out), merged, config, info, heads)
    return MergeResult(Path(out), taken, chosen, run_id, finished, config)


def _parameter_owners(stages: Sequence[StageEntry], manifest_file: Path) -> dict[str, int]:
    """PEFT name -> stage index; a name on two stages would make the merge ambiguous."""
    owner: dict[str, int] = {}
    for stage in stages:
        for p in stage.parameters:
            if p.name in owner:
                raise ZLError(
                    f"manifest {manifest_file}: parameter {p.name} is listed by stage {owner[p.name]} and stage "
                    f"{stage.index}; each LoRA parameter belongs to one stage. Export again."
                )
            owner[p.name] = stage.index
    return owner


def _choose_window(root: Path, stages: Sequence[StageEntry], window: int | None, layout: CheckpointLayout) -> int:
    """The window every stage is merged at: `window`, or the latest one, which all stages must share."""
    per_stage: dict[int, list[int]] = {}
    for stage in stages:
        k = stage.index
        stage_root = layout.stage_root(root, k)
        windows = layout.windows(stage_root) if stage_root.is_dir() else []
        if not windows:
            where = "no such directory" if not stage_root.is_dir() else "no window directory in it"
            raise ZLError(
                f"stage {k}: no checkpoint at {stage_root} ({where}). The manifest has {len(stages)} stages; "
                f"stage {k} must have committed at least one window (pull its checkpoints into {root} first)."
            )
        per_stage[k] = windows
    listing = "; ".join(f"stage {k}: {', '.join(map(str, w))}" for k, w in per_stage.items())
    if window is not None:
        lacking = [k for k, w in per_stage.items() if window not in w]
        if lacking:
            common = sorted(set.intersection(*(set(w) for w in per_stage.values())))
            raise ZLError(
                f"--window {window}: stage(s) {', '.join(map(str, lacking))} have no checkpoint of that window "
                f"(windows on disk: {listing}). "
                + (f"Choose one all stages have: {', '.join(map(str, common))}." if common else "No window is on every stage.")
            )
        return window
    latest = {k: w[-1] for k, w in per_stage.items()}
    if len(set(latest.values())) > 1:
        common = sorted(set.intersection(*(set(w) for w in per_stage.values())))
        hint = (f"pass --window {common[-1]} (the latest window every stage has)" if common
                else "no window is on every stage; let the run finish (or resume it) and merge again")
        raise ZLError(
            f"the stages' latest checkpoints are at different windows ({', '.join(f'stage {k}: {w}' for k, w in latest.items())}), "
            f"so they would not form one model state; {hint}. Windows on disk: {listing}."
        )
    return next(iter(latest.values()))


def _read_progress(path: Path, k: int, window: int) -> dict:
    """progress.json of a window, checked against the stage and window it was found under."""
    if not path.is_file():
        raise ZLError(
            f"checkpoint file {path} is missing, so the checkpoint is incomplete (the runner writes it with every "
            "window); copy the whole window directory, or merge another --window."
        )
    fix = "the checkpoint is corrupt, merge another --window"
    progress = read_typed(path, dict[str, Any], f"checkpoint file {path}", fix)
    if progress.get("format") != "zl-checkpoint":
        raise ZLError(f"checkpoint file {path}: format {progress.get('format')!r}, expected 'zl-checkpoint'.")
    if progress.get("stage") != k:
        raise ZLError(
            f"checkpoint file {path}: written by stage {progress.get('stage')}, but found under stage {k}'s directory; "
            "each stage's checkpoints must be in its own directory (stage_<k>)."
        )
    if progress.get("window") != window:
        raise ZLError(f"checkpoint file {path}: says window {progress.get('window')}, its directory says {window}; the checkpoint is corrupt.")
    return progress


#: The fix for a checkpoint whose tensors are not finite.
_DIVERGED = ("the run diverged or the file was damaged: merge an earlier --window (the stages keep their last "
             "windows), or train again with a lower --lr (or --stage-lr).")


def _read_stage_adapter(path: Path, stage: StageEntry, window: int, owner: dict[str, int]) -> dict[str, torch.Tensor]:
    """Load one stage's adapter.safetensors and check it holds exactly the manifest's parameters of that stage, all
    finite."""
    k = stage.index
    if not path.is_file():
        raise ZLError(f"checkpoint file {path} is missing, so the checkpoint is incomplete; copy the whole window directory, or merge another --window.")
    tensors = read_tensors(path, f"checkpoint file {path}", "merge another --window.")
    expected = {p.name: list(p.shape) for p in stage.parameters}
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise ZLError(
            f"checkpoint file {path}: lacks {len(missing)} of stage {k}'s {len(expected)} LoRA parameters "
            f"(first: {missing[0]}); is it from an export with other --lora-targets or --stages? "
            "Merge with the manifest of the export the run used."
        )
    extra = [n for n in tensors if n not in expected]
    if extra:
        name = extra[0]
        where = f"the manifest lists it under stage {owner[name]}" if name in owner else "the manifest does not list it"
        raise ZLError(
            f"checkpoint file {path}: has {len(extra)} tensor(s) that are not stage {k}'s parameters (first: {name}; {where}). "
            "Merge with the manifest of the export the run used, and keep each stage's checkpoints in its own directory."
        )
    for name, shape in expected.items():
        t = tensors[name]
        if list(t.shape) != shape:
            raise ZLError(
                f"checkpoint file {path}: {name} has shape {list(t.shape)}, the manifest says {shape}; "
                "the checkpoint is from another export (--lora-rank?). Merge with the manifest the run used."
            )
        if t.dtype != torch.float32:
            raise ZLError(f"checkpoint file {path}: {name} is {t.dtype}, expected torch.float32 (F32) as the runner writes it.")
    check_finite(tensors, f"stage {k} window {window}: checkpoint file {path}", _DIVERGED)
    return tensors


def _check_optimizer_state(path: Path, k: int, window: int) -> None:
    """A window's AdamW moments, where the checkpoint has them, are finite too: non-finite moments mean the run was
    damaged even where the weights still look sound (the next step would spread them)."""
    if path.is_file():
        check_finite(read_tensors(path, f"checkpoint file {path}", "merge another --window."),
                     f"stage {k} window {window}: checkpoint file {path}", _DIVERGED)


def _write_adapter(out: Path, tensors: dict[str, torch.Tensor], config: dict, info: dict,
                   heads: dict[int, dict[str, torch.Tensor]]) -> None:
    """Write the adapter files, each under a temporary name and renamed, weights first; early-exit heads aside."""
    from safetensors.torch import save_file

    if out.exists() and not out.is_dir():
        raise ZLError(f"--out {out}: exists and is not a directory; pass a directory for the adapter.")
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (ADAPTER_WEIGHTS + ".tmp")
    save_file({n: t.contiguous() for n, t in sorted(tensors.items())}, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / ADAPTER_WEIGHTS)
    for k, head in heads.items():
        (out / EARLY_EXIT_DIR).mkdir(exist_ok=True)
        tmp = out / EARLY_EXIT_DIR / f"stage_{k}.safetensors.tmp"
        save_file({n: t.contiguous() for n, t in sorted(head.items())}, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, tmp.with_suffix(""))
    for name, content in ((ADAPTER_CONFIG, config), (MERGE_INFO, info)):
        tmp = out / (name + ".tmp")
        tmp.write_text(json.dumps(content, indent=2) + "\n")
        os.replace(tmp, out / name)


def check_adapter_dir(adapter_dir: Path | str) -> Path:
    """Raise ZLError unless `adapter_dir` holds the two files PEFT loads, its weights readable and finite; returns
    it as a Path. Cheap (an adapter is a few MB): commands call it before any model loads."""
    adapter_dir = Path(adapter_dir)
    adapter_weights(adapter_dir)
    return adapter_dir


def adapter_weights(adapter_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors of `adapter_dir`'s adapter_model.safetensors, checked: the two files there, the weights readable
    (not cut short) and finite.

    Raises:
        ZLError: a missing file, a truncated or garbled weights file, or a weight that is nan or inf.
    """
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (adapter_dir / name).is_file():
            raise ZLError(
                f"--adapter {adapter_dir}: {name} is missing; pass a directory written by `zl merge` "
                "(RUN_DIR/adapter) or by PEFT's save_pretrained."
            )
    label = f"--adapter {adapter_dir}: {ADAPTER_WEIGHTS}"
    tensors = read_tensors(adapter_dir / ADAPTER_WEIGHTS, label, "merge the run's checkpoints again (`zl merge`) "
                           "or copy the adapter again.")
    check_finite(tensors, label, "the run diverged or the file was damaged: train again with a lower --lr, or "
                 "merge an earlier window (`zl merge --window N`).")
    return tensors


def load_adapter(model: torch.nn.Module, adapter_dir: Path | str) -> torch.nn.Module:
    """Wrap `model` with the PEFT adapter in `adapter_dir` (as written by `merge_checkpoints`), for inference.

    Checks that the adapter fits the model: every LoRA parameter PEFT creates
    gets a tensor from the file and every tensor in the file is used.

    Raises:
        ZLError: missing files, unreadable or non-finite weights, or an adapter for another model (names or shapes
            differ).
    """
    from peft import PeftModel

    adapter_dir = Path(adapter_dir)
    saved = set(adapter_weights(adapter_dir))
    try:
        peft_model = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=False)
    except (RuntimeError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ZLError(f"--adapter {adapter_dir}: does not fit this model ({first}); was it trained on another --model?") from e
    created = {n.replace(".default.", ".") for n, _ in peft_model.named_parameters() if "lora_" in n}
    if saved != created:
        unused, missing = sorted(saved - created), sorted(created - saved)
        detail = f"{len(missing)} LoRA parameters of the model have no tensor (first: {missing[0]})" if missing else (
            f"{len(unused)} tensors match no LoRA parameter of the model (first: {unused[0]})")
        raise ZLError(f"--adapter {adapter_dir}: {detail}; was it trained on another --model?")
    return peft_model.eval()
