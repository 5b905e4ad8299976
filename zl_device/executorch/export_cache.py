"""`zl train`'s export step: the stage programs for a run's options, exported once and reused from a cache.

    $ZL_CACHE_DIR/exports/<key>/   stage_<k>.pte, manifest.json    (key: `export_key`)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Protocol

from zl_base.errors import ZLError
from zl_export.manifest import MANIFEST, Manifest
from zl_export.options import ExportOptions, ModelSplit, ProgramSettings

log = logging.getLogger(__name__)

class ExportSettings(Protocol):
    """What the export step reads of a run's settings (`zl train`'s `TrainSettings` has them)."""

    split: ModelSplit
    export_cache: Path | None  # the cache folder; None: $ZL_CACHE_DIR/exports


EXPORT_CACHE_VERSION = 7  # bump when the exporter's output changes for the same options (7: int4 exports in 2^20 chunks)


def export_key(s: ExportSettings, opts: ExportOptions, calibration: Path | None = None,
               program: ProgramSettings | None = None) -> str:
    """A hash of what determines the stage programs: model identity, split, every export option (`opts` as the
    manifest records it, `ExportOptions.to_manifest`), the program kind (zerolock programs keep the keys they had
    before there were others) and, for lens translators, the calibration shard's content."""
    from zl_export.model_source import resolve

    kind, path = resolve(s.split.model)
    identity = {"spec": s.split.model, "kind": kind}
    if path is not None:
        probe = path / "config.json" if path.is_dir() else path
        st = probe.stat()
        identity.update(path=str(path.resolve()), size=st.st_size, mtime_ns=st.st_mtime_ns)
    blob = {"v": EXPORT_CACHE_VERSION, "model": identity, "stages": s.split.key, "opts": opts.to_manifest()}
    if program is not None and program.kind != "zerolock":
        blob["program"] = program.to_manifest()
    if opts.loss.translator_rank and opts.loss.translator_init == "lens" and calibration is not None:
        from zl_export.shard import file_sha256

        blob["calibration"] = file_sha256(Path(calibration))
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:16]


def export_cached(s: ExportSettings, opts: ExportOptions, load, say, progress=None,
                  calibration: Path | None = None, program: ProgramSettings | None = None) -> tuple[Path, Manifest]:
    """The export directory for `s` with the run's resolved options `opts`: reused from the cache when
    complete, else exported into it.

    Args:
        load: returns the run's `LoadedModel` (called only when there is something to export).
        progress: a zl_export.pipeline.ExportProgress that sees the export, if there is one.
        calibration: the training shard, to fit lens translators on.
        program: which program every stage gets (docs/design#backprop-program); default: zerolock.
    """
    from zl_export.model_source import cache_dir
    from zl_export.pipeline import export_pipeline

    root = s.export_cache or cache_dir() / "exports"
    target = root / export_key(s, opts, calibration, program)
    if manifest := _complete_export(target, warn=True):
        say(f"export: reusing {target}")
        return target, manifest
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    opts.validate()  # before minutes of loading
    manifest = export_pipeline(s.split, tmp, opts, progress=progress, loaded=load(), shown_dir=target,
                               calibration=calibration, program=program).exported
    if done := _complete_export(target):  # another run of the same options finished first (two runs, or tests,
        shutil.rmtree(tmp, ignore_errors=True)  # side by side): keep its export, which it may be reading now
        return target, done
    shutil.rmtree(target, ignore_errors=True)  # an incomplete or unusable export
    os.replace(tmp, target)
    return target, manifest


def _complete_export(target: Path, warn: bool = False) -> Manifest | None:
    """`target`'s manifest when every stage program it names is there at its size; else None (logged if `warn`)."""
    from zl_export.manifest import load_export

    if not (target / MANIFEST).is_file():
        return None
    try:
        manifest = load_export(target)
        if all((target / st.file).stat().st_size == st.size_bytes for st in manifest.stages):
            return manifest
    except (ZLError, OSError) as e:
        if warn:
            log.warning("export cache %s is unusable (%s); exporting again", target, e)
    return None
