"""A whole export: load the model, split it, export every stage, write the manifest, optionally check one step.

Used by `zl export` and by `zl train` (through its export cache). The caller
sees progress through an `ExportProgress`, whose hooks do nothing by default;
the CLI's subclass draws (zl/commands/export.py).
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from zl_export.options import ExportOptions, ModelSplit, ProgramSettings

if TYPE_CHECKING:
    from zl_export.manifest import Manifest
    from zl_export.model_source import LoadedModel
    from zl_export.stages import StageRange
    from zl_export.step_check import StageCheck


class ExportProgress:
    """What an export reports as it goes. Subclass and override the hooks you show."""

    def loading(self, model: str) -> AbstractContextManager:
        """Wraps loading the model (seconds; a GGUF's first conversion ~30 s)."""
        return nullcontext()

    def loaded(self, model: str, loaded: LoadedModel, stages: list[StageRange], load_s: float) -> None:
        """The model is loaded (in `load_s` seconds; 0 when the caller had it) and split."""

    def stage_phase(self, index: int, phase: str) -> None:
        """Stage `index` entered `phase` (the exporter's phases, then "writing")."""

    def stage_done(self, index: int, size_bytes: int, export_s: float) -> None:
        """Stage `index`'s program is written."""

    def exported(self, manifest: Manifest, shown_dir: Path) -> None:
        """Every program and the manifest are written; `shown_dir` is the directory to name."""

    def checking(self) -> AbstractContextManager:
        """Wraps the one-step check of every stage."""
        return nullcontext()

    def checked(self, checks: list[StageCheck]) -> None:
        """The check's results, before they are judged."""


@dataclass
class ExportResult:
    exported: Manifest  # what manifest.json records
    checks: list[StageCheck] | None  # with check=True: one step per stage, ExecuTorch next to eager


def calibration_rows(opts: ExportOptions, loaded: LoadedModel, shard_path: Path | None):
    """(rows to fit the readout lenses on, what they were) — (None, None) unless the translators start as lenses."""
    from zl_export.translator import CALIBRATION_ROWS, calibration_batches

    if not (opts.loss.translator_rank and opts.loss.translator_init == "lens"):
        return None, None
    if shard_path is not None:
        from zl_export.shard import file_sha256, load_shard

        shard = load_shard(shard_path)
        shard.check_matches(tokenizer=loaded.tokenizer)
        source = {"path": str(Path(shard_path).resolve()), "sha256": file_sha256(Path(shard_path))}
    else:
        from zl_export import data as zdata
        from zl_export.demo_task import demo_rows
        from zl_export.shard import Shard

        tokenized, _ = zdata.tokenize(zdata.demo_task(demo_rows(opts.seed)["train"]), loaded.tokenizer, 512,
                                      truncate=True)
        shard = Shard(Path("demo"), tokenized.input_ids, tokenized.attention_mask, tokenized.labels, {})
        source = {"path": "demo", "seed": opts.seed}
    return calibration_batches(shard), {**source, "rows": min(CALIBRATION_ROWS, shard.rows)}


def export_pipeline(split: ModelSplit, out: Path, opts: ExportOptions, check: bool = False,
                    progress: ExportProgress | None = None, loaded: LoadedModel | None = None,
                    shown_dir: Path | None = None, calibration: Path | None = None,
                    program: ProgramSettings | None = None) -> ExportResult:
    """Export every stage of `split` into `out` (stage_<k>.pte, manifest.json).

    Args:
        program: which program each stage gets (docs/design#backprop-program); default: zerolock, the runner's.
        calibration: a shard whose first rows fit the readout lenses (`translator_init="lens"`); default: the
            built-in demo task's rows under the model's tokenizer.
        loaded: the model, when the caller has loaded it already (with seed `opts.seed`); its LoRA layers are
            removed again at the end, so the caller keeps the base model.
        shown_dir: the directory to name in progress (`zl train` exports into a temporary `out`).

    Raises:
        ZLError: bad options, model source or stage spec, or ExecuTorch disagreeing with eager in the check.
    """
    from zl_export.exporter import build_stage_modules, export_stage, write_program
    from zl_export.frozen_weights import restore_frozen_weights
    from zl_export.manifest import build_manifest, write_manifest
    from zl_export.model_source import load_model
    from zl_export.step_check import check_agreement, check_backprop_pipeline, check_pipeline, demo_inputs

    progress = progress or ExportProgress()
    program = program or ProgramSettings()
    split.validate()
    opts.validate()
    program.validate()
    opts.loss.validate(split.count)
    load_s = 0.0
    if loaded is None:
        with progress.loading(split.model):
            t0 = time.perf_counter()
            loaded = load_model(split.model, seed=opts.seed)
            load_s = time.perf_counter() - t0
    cfg = loaded.config
    opts.validate(cfg.max_position_embeddings)
    stages = split.ranges(cfg.num_hidden_layers)
    progress.loaded(split.model, loaded, stages, load_s)
    lens_rows, lens_source = calibration_rows(opts, loaded, calibration)
    peft_model, modules = build_stage_modules(loaded.model, stages, opts, lens_rows, program)
    try:
        out.mkdir(parents=True, exist_ok=True)
        entries = []
        for module in modules:
            k = module.stage.index
            exported = export_stage(module, peft_model, opts, cfg.vocab_size, lambda phase, k=k: progress.stage_phase(k, phase))
            progress.stage_phase(k, "writing")
            entries.append(write_program(exported, out))
            progress.stage_done(k, len(exported.buffer), exported.export_s)
            del exported
        manifest = build_manifest(loaded, opts, entries, program, calibration=lens_source)
        write_manifest(manifest, out)
        progress.exported(manifest, shown_dir or out)
        checks = None
        if check:
            with progress.checking():
                run_check = check_backprop_pipeline if program.kind == "backprop" else check_pipeline
                checks = run_check(out, manifest, modules, demo_inputs(loaded.tokenizer, modules[0], opts, cfg.vocab_size))
            progress.checked(checks)
            check_agreement(checks)
        return ExportResult(manifest, checks)
    finally:
        restore_frozen_weights(peft_model)  # float32 frozen weights again (--frozen-dtype bf16/int8)
        peft_model.unload()  # the caller's model without LoRA layers again
