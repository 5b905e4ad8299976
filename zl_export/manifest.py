"""`manifest.json`: what an export directory holds (docs/design.md §3).

Written by `zl export`, read by the runner's host side, `zl merge` and the
tests. Parameters are listed per stage in gradient order, under their PEFT
names, so per-stage checkpoints merge into one `adapter_model.safetensors`.
"""

import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path

from zl_base import __version__
from zl_base.errors import ZLError, read_json_file
from zl_export.model_family import family_of

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def build_manifest(loaded, opts, stage_entries: list[dict]) -> dict:
    """The manifest of an export of `loaded` (a `LoadedModel`) with `opts` (an `ExportOptions`)."""
    cfg = loaded.config
    family = family_of(cfg.model_type)
    options = opts.to_manifest()
    options["lora"]["dropout"] = 0.0  # a note for PEFT's adapter_config: the programs' LoRA has no dropout
    options["lora"]["targets"] = list(opts.lora.for_family(family).targets)  # none given: the family's default
    return {
        "format_version": FORMAT_VERSION,
        "zl_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": {
            "name": loaded.name,
            "source": loaded.source,
            "model_type": cfg.model_type,
            # the family's layer (zl_export/model_family.py) and what sets it apart from Llama
            "family": family.key,
            "family_traits": family.traits(),
            "tied_head": bool(getattr(cfg, "tie_word_embeddings", False)),
            "num_layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "dtype": "float32",
        },
        "tokenizer": loaded.tokenizer.name,
        **options,  # seq_len, micro_batch, lora, loss, seed, frozen_dtype, max_targets: every export option
        "stages": stage_entries,
    }


def stage_count(manifest: dict) -> int:
    """How many stages an export has: its manifest's "stages" (the one source once exported; before, the split's
    `ModelSplit.count`). Everything downstream (stage configs, devices, ranks, the run's metrics) takes it from
    here rather than from a list of its own (per-stage learning rates, devices)."""
    return len(manifest["stages"])


def write_manifest(manifest: dict, out_dir: Path) -> Path:
    path = out_dir / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(path)
    return path


def read_manifest_file(path: Path) -> dict:
    """Read and check one `manifest.json` without needing its programs next to it (run directories, merge).

    Raises:
        ZLError: no file, not a JSON object, another format version, or no list of stages with indices.
    """
    path = Path(path)
    manifest = read_json_file(path, f"manifest {path}", missing="pass the manifest.json that `zl export` wrote "
                              "(EXPORT_DIR/manifest.json).", invalid="export again with `zl export`.")
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        seen = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise ZLError(f"manifest {path}: format_version {seen!r}, this zl reads {FORMAT_VERSION}; export again with this zl.")
    stages = manifest.get("stages")
    if not isinstance(stages, list) or not all(isinstance(st, dict) and isinstance(st.get("index"), int) for st in stages):
        raise ZLError(f"manifest {path}: no \"stages\" list of {{\"index\", \"layers\", ...}}; is it a manifest of "
                      "`zl export`?")
    return manifest


def load_manifest(export_dir: Path, verify: bool = False) -> dict:
    """Read and check `export_dir/manifest.json`.

    Args:
        export_dir: an output directory of `zl export`.
        verify: also check each program's sha256 (reads every `.pte`).

    Raises:
        ZLError: a missing or malformed manifest, an unknown format version, a
            missing program, or (with `verify`) a program whose hash differs.
    """
    manifest = read_manifest_file(Path(export_dir) / MANIFEST)
    for stage in manifest.get("stages", []):
        program = Path(export_dir) / stage["file"]
        if not program.is_file():
            raise ZLError(f"{program}: listed in the manifest but missing; export again.")
        if verify:
            digest = hashlib.sha256(program.read_bytes()).hexdigest()
            if digest != stage["sha256"]:
                raise ZLError(
                    f"{program}: sha256 {digest[:12]}… differs from the manifest's {stage['sha256'][:12]}…; "
                    "the file is corrupt or from another export. Export again."
                )
    return manifest
