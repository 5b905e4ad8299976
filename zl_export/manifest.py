"""`manifest.json`: what an export directory holds (docs/design#manifest), as typed values.

    Manifest ── model: ModelInfo, options: ExportOptions, program: ProgramSettings, stages: [StageEntry]
    StageEntry ── inputs / outputs: [TensorSpec], parameters: [ParameterEntry] (gradient order), program file

Written by `zl export` and by `zl train --runtime torch` (no programs), read by the runner (C++,
runner/src/stage_manifest.cpp: the JSON keys stay as they are), `zl merge`, `zl report`, the train job.
`stage_entry` builds a stage's entry for both writers; `Manifest.from_json` / `read_manifest` are the one reader.
Parameters are listed per stage in gradient order, under their PEFT names, so per-stage checkpoints merge into one
`adapter_model.safetensors`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from zl_base import __version__
from zl_base.errors import ZLError
from zl_base.json_reader import read_json_file
from zl_export.options import PROGRAM_KINDS, ExportOptions, ProgramSettings
from zl_export.stages import StageRange

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TRANSLATOR_ROLE = "translator"

# The tensors of the programs' inputs and outputs by name: hidden states and their gradients (B, S, D), token
# tensors (B, S); every other output is a float32 scalar (a loss).
_STATE_NAMES = ("hidden", "grad_hidden", "grad_input")
_TOKEN_NAMES = ("input_ids", "attention_mask", "labels")

#: The fix for a manifest that is damaged or older than the field the reader needs.
_REEXPORT = ("the file is damaged or from another version of zl; export again with this zl (`zl export`, or "
             "`zl train` without --resume)")


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a stage's program: `{name, dtype, shape}`."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class ParameterEntry:
    """One trainable tensor of a stage: its manifest name (PEFT name, or `zl.translator.stage_<k>.*`), its name in
    the stage module and program, its shape, and `role` "translator" for a readout translator's tensors."""

    name: str
    shape: tuple[int, ...]
    program_name: str | None = None  # None only in torch-runtime manifests from before it was recorded there
    role: str | None = None

    @property
    def is_translator(self) -> bool:
        return self.role == TRANSLATOR_ROLE

    def to_json(self) -> dict:
        out: dict[str, Any] = {"name": self.name}
        if self.program_name is not None:
            out["program_name"] = self.program_name
        out["shape"] = list(self.shape)
        if self.role is not None:
            out["role"] = self.role
        return out


@dataclass(frozen=True)
class StageEntry:
    """One stage of the manifest's `stages[]`. The program fields (`file`, `sha256`, `size_bytes`, `export_s`) are
    None where no program was exported (`zl train --runtime torch`)."""

    index: int
    layers: tuple[int, int]  # [first, last], inclusive
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    parameters: tuple[ParameterEntry, ...]  # in gradient order
    file: str | None = None
    sha256: str | None = None
    size_bytes: int | None = None
    export_s: float | None = None

    @property
    def range(self) -> StageRange:
        """The stage's layers as the split names them."""
        return StageRange(self.index, *self.layers)

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.outputs]

    def with_program(self, file: str, buffer: bytes, export_s: float) -> StageEntry:
        """This entry with its program file `file` (holding `buffer`, exported in `export_s` seconds)."""
        return replace(self, file=file, sha256=hashlib.sha256(buffer).hexdigest(), size_bytes=len(buffer),
                       export_s=round(export_s, 2))

    def to_json(self) -> dict:
        out: dict[str, Any] = {"index": self.index, "layers": list(self.layers)}
        if self.file is not None:
            out.update(file=self.file, sha256=self.sha256, size_bytes=self.size_bytes, export_s=self.export_s)
        out["inputs"] = [t.to_json() for t in self.inputs]
        out["outputs"] = [t.to_json() for t in self.outputs]
        out["parameters"] = [p.to_json() for p in self.parameters]
        return out


@dataclass(frozen=True)
class ModelInfo:
    """The manifest's `model`: the exported model and its family (docs/design#model-families)."""

    name: str
    source: str
    model_type: str
    family: str
    family_traits: tuple[str, ...]
    tied_head: bool
    num_layers: int
    hidden_size: int
    vocab_size: int
    dtype: str = "float32"

    def to_json(self) -> dict:
        return {"name": self.name, "source": self.source, "model_type": self.model_type, "family": self.family,
                "family_traits": list(self.family_traits), "tied_head": self.tied_head, "num_layers": self.num_layers,
                "hidden_size": self.hidden_size, "vocab_size": self.vocab_size, "dtype": self.dtype}


@dataclass(frozen=True)
class Manifest:
    """A whole `manifest.json`. `options` are the export's options with the LoRA targets resolved for the family
    and `max_targets` the programs' target slots, as recorded."""

    model: ModelInfo
    tokenizer: str
    options: ExportOptions
    stages: tuple[StageEntry, ...]
    program: ProgramSettings = ProgramSettings()  # manifests from before "program": zerolock
    calibration: dict | None = None  # where lens translators were fitted (loss.calibration)
    runtime: str | None = None  # "torch": written by `zl train --runtime torch`, no programs
    zl_version: str = __version__
    created: str = ""
    format_version: int = FORMAT_VERSION

    @property
    def num_stages(self) -> int:
        """How many stages the export has: the one source once exported (before, the split's `ModelSplit.count`).
        Everything downstream (stage configs, devices, ranks, the run's metrics) takes it from here."""
        return len(self.stages)

    def to_json(self) -> dict:
        """The JSON object of manifest.json, key for key as the runner and earlier versions read it."""
        options = self.options.to_manifest()  # seq_len, micro_batch, lora, loss, seed, frozen_dtype, max_targets
        options["lora"]["dropout"] = 0.0  # a note for PEFT's adapter_config: the programs' LoRA has no dropout
        if self.calibration is not None:
            options["loss"]["calibration"] = self.calibration
        out = {"format_version": self.format_version, "zl_version": self.zl_version, "created": self.created,
               "model": self.model.to_json(), "tokenizer": self.tokenizer, **options,
               "stages": [s.to_json() for s in self.stages], "program": self.program.to_manifest()}
        if self.runtime is not None:
            out["runtime"] = self.runtime
        return out

    @classmethod
    def from_json(cls, data: Any, source: Path | str) -> Manifest:
        """The manifest in `data` (a manifest.json's JSON value) read from `source` (for the errors).

        Raises:
            ZLError: not an object, another format version, or a missing or mistyped field; the message names the
                file and the field.
        """
        return _Reader(f"manifest {source}").manifest(data)


def build_manifest(loaded, opts: ExportOptions, stages: Sequence[StageEntry], program: ProgramSettings | None = None,
                   calibration: dict | None = None, runtime: str | None = None) -> Manifest:
    """The manifest of an export of `loaded` (a `LoadedModel`) with `opts` into `stages`.

    Args:
        program: the stages' programs (default zerolock); calibration: where lens translators were fitted;
        runtime: "torch" for a run's manifest without programs.
    """
    from zl_export.model_family import family_of

    cfg = loaded.config
    family = family_of(cfg.model_type)
    model = ModelInfo(name=loaded.name, source=loaded.source, model_type=cfg.model_type, family=family.key,
                      family_traits=tuple(family.traits()),
                      tied_head=bool(getattr(cfg, "tie_word_embeddings", False)), num_layers=cfg.num_hidden_layers,
                      hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size)
    # as recorded: no targets given are the family's default, by name (so `zl merge`'s adapter_config names
    # modules), and max_targets is the programs' slots
    options = replace(opts, lora=opts.lora.for_family(family), max_targets=opts.target_slots)
    return Manifest(model=model, tokenizer=loaded.tokenizer.name, options=options, stages=tuple(stages),
                    program=program or ProgramSettings(), calibration=calibration, runtime=runtime,
                    created=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def tensor_spec(name: str, opts: ExportOptions, hidden: int) -> TensorSpec:
    """The spec of the program input or output `name` under `opts`' shapes and hidden size `hidden`."""
    b, s = opts.micro_batch, opts.seq_len
    if name in _TOKEN_NAMES:
        return TensorSpec(name, "int64", (b, s))
    return TensorSpec(name, "float32", (b, s, hidden) if name in _STATE_NAMES else ())


def stage_entry(module, names: Mapping[int, str], opts: ExportOptions,
                program_names: Sequence[str] | None = None) -> StageEntry:
    """The manifest entry of `module`'s stage (a `StageModule`), less its program file (`StageEntry.with_program`).

    The one builder of a stage entry: the exporter's and the torch runtime's.

    Args:
        names: id(parameter) -> manifest name (`zl_export.exporter.manifest_names`).
        program_names: the trainable parameters' names in `module`, in the program's gradient order (the exporter:
            the joint graph's); default the module's trainable parameters in their order, which is the same order.
    """
    from zl_export.translator import is_translator_name

    params = dict(module.named_parameters())
    if program_names is None:
        program_names = [n for n, p in params.items() if p.requires_grad]
    hidden = module.hidden_size
    parameters = []
    for fqn in program_names:
        name = names[id(params[fqn])]
        parameters.append(ParameterEntry(name, tuple(params[fqn].shape), fqn,
                                         TRANSLATOR_ROLE if is_translator_name(name) else None))
    return StageEntry(index=module.stage.index, layers=(module.stage.first, module.stage.last),
                      inputs=tuple(tensor_spec(n, opts, hidden) for n in module.input_names),
                      outputs=tuple(tensor_spec(n, opts, hidden) for n in module.output_names),
                      parameters=tuple(parameters))


def stage_count(manifest: Manifest | dict) -> int:
    """`manifest.num_stages`; also of a manifest's JSON object, which zl_device/executorch/launch.py still passes."""
    return manifest.num_stages if isinstance(manifest, Manifest) else len(manifest["stages"])


def write_manifest(manifest: Manifest, out_dir: Path) -> Path:
    """Write `out_dir/manifest.json` (through a `.tmp` file and a rename)."""
    path = Path(out_dir) / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest.to_json(), indent=2) + "\n")
    tmp.replace(path)
    return path


def read_manifest(path: Path | str) -> Manifest:
    """Read and check one `manifest.json` (or the one in directory `path`) without needing its programs next to it
    (run directories, merge, report).

    Raises:
        ZLError: no file, not JSON, another format version, or a missing or mistyped field.
    """
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST
    data = read_json_file(path, f"manifest {path}", missing="pass the manifest.json that `zl export` wrote "
                          "(EXPORT_DIR/manifest.json).", invalid="export again with `zl export`.")
    return Manifest.from_json(data, path)


def as_manifest(manifest: Manifest | dict, source: Path | str) -> Manifest:
    """`manifest` typed; a JSON object is read from `source`."""
    return manifest if isinstance(manifest, Manifest) else Manifest.from_json(manifest, source)


def load_export(export_dir: Path | str, verify: bool = False) -> Manifest:
    """Read and check `export_dir/manifest.json` and that every program it lists is there.

    Args:
        export_dir: an output directory of `zl export`.
        verify: also check each program's sha256 (reads every `.pte`).

    Raises:
        ZLError: a missing or malformed manifest, an unknown format version, a stage without a program file, a
            missing program, or (with `verify`) a program whose hash differs.
    """
    manifest = read_manifest(Path(export_dir) / MANIFEST)
    for stage in manifest.stages:
        if stage.file is None:
            raise ZLError(f"manifest {Path(export_dir) / MANIFEST}: stage {stage.index} has no program \"file\" (a "
                          "`zl train --runtime torch` run's manifest?); pass the output directory of `zl export`.")
        program = Path(export_dir) / stage.file
        if not program.is_file():
            raise ZLError(f"{program}: listed in the manifest but missing; export again.")
        if verify:
            digest = hashlib.sha256(program.read_bytes()).hexdigest()
            if digest != stage.sha256:
                raise ZLError(
                    f"{program}: sha256 {digest[:12]}… differs from the manifest's {(stage.sha256 or '')[:12]}…; "
                    "the file is corrupt or from another export. Export again."
                )
    return manifest


class _Reader:
    """Reads a manifest's JSON value field by field; every error names the file, the field and the fix."""

    def __init__(self, label: str):
        self.label = label

    def fail(self, where: str, problem: str) -> ZLError:
        return ZLError(f"{self.label}: {where} {problem}; {_REEXPORT}.")

    def get(self, obj: dict, key: str, kind: type | tuple[type, ...], where: str, default: Any = ...) -> Any:
        """`obj[key]`, which must be a `kind` (ints are floats too; bools are not ints)."""
        field = f"{where}.{key}" if where else key
        if key not in obj:
            if default is not ...:
                return default
            raise self.fail(f"\"{field}\"", "is missing")
        value = obj[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            names = " or ".join(k.__name__ for k in kinds)
            raise self.fail(f"\"{field}\"", f"is {json.dumps(value)[:40]}, expected {names}")
        return value

    def ints(self, obj: dict, key: str, where: str, length: int | None = None) -> tuple[int, ...]:
        """`obj[key]`: a list of integers (of `length`, when given), as a tuple."""
        if key not in obj:
            raise self.fail(f"\"{where}.{key}\"", "is missing")
        values = obj[key]
        if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values) or (
                length is not None and len(values) != length):
            what = f"{length} integers" if length is not None else "a list of integers"
            raise self.fail(f"\"{where}.{key}\"", f"is {json.dumps(values)[:40]}, expected {what}")
        return tuple(values)

    def objects(self, obj: dict, key: str, where: str, default: Any = ...) -> list[tuple[dict, str]]:
        items = self.get(obj, key, list, where, default)
        out = []
        for i, item in enumerate(items):
            at = f"{where}.{key}[{i}]" if where else f"{key}[{i}]"
            if not isinstance(item, dict):
                raise self.fail(f"\"{at}\"", f"is {json.dumps(item)[:40]}, expected an object")
            out.append((item, at))
        return out

    def tensor(self, obj: dict, at: str) -> TensorSpec:
        return TensorSpec(self.get(obj, "name", str, at), self.get(obj, "dtype", str, at), self.ints(obj, "shape", at))

    def parameter(self, obj: dict, at: str) -> ParameterEntry:
        return ParameterEntry(self.get(obj, "name", str, at), self.ints(obj, "shape", at),
                              self.get(obj, "program_name", str, at, None), self.get(obj, "role", str, at, None))

    def stage(self, obj: dict, at: str) -> StageEntry:
        return StageEntry(
            index=self.get(obj, "index", int, at), layers=self.ints(obj, "layers", at, length=2),
            # absent from trimmed manifests (tests/data/runner_kill_run): nothing recorded
            inputs=tuple(self.tensor(t, a) for t, a in self.objects(obj, "inputs", at, [])),
            outputs=tuple(self.tensor(t, a) for t, a in self.objects(obj, "outputs", at, [])),
            parameters=tuple(self.parameter(p, a) for p, a in self.objects(obj, "parameters", at, [])),
            file=self.get(obj, "file", str, at, None), sha256=self.get(obj, "sha256", str, at, None),
            size_bytes=self.get(obj, "size_bytes", int, at, None), export_s=self.get(obj, "export_s", float, at, None))

    def model(self, obj: dict) -> ModelInfo:
        m = self.get(obj, "model", dict, "")
        at = "model"
        return ModelInfo(
            name=self.get(m, "name", str, at), source=self.get(m, "source", str, at, ""),
            model_type=self.get(m, "model_type", str, at, "llama"), family=self.get(m, "family", str, at, "llama"),
            family_traits=tuple(self.get(m, "family_traits", list, at, [])),
            tied_head=self.get(m, "tied_head", bool, at, False), num_layers=self.get(m, "num_layers", int, at),
            hidden_size=self.get(m, "hidden_size", int, at), vocab_size=self.get(m, "vocab_size", int, at),
            dtype=self.get(m, "dtype", str, at, "float32"))

    def manifest(self, data: Any) -> Manifest:
        if not isinstance(data, dict):
            raise ZLError(f"{self.label}: not a JSON object but {type(data).__name__}; is it a manifest of "
                          "`zl export`? Pass EXPORT_DIR/manifest.json.")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise ZLError(f"{self.label}: format_version {version!r}, this zl reads {FORMAT_VERSION}; export again "
                          "with this zl.")
        stages = tuple(self.stage(s, at) for s, at in self.objects(data, "stages", ""))
        indices = [s.index for s in stages]
        if not stages or indices != list(range(len(stages))):
            raise self.fail("\"stages\"", f"has indices {indices}, expected 0..n-1 in order")
        self.get(data, "lora", dict, "")  # zl merge's adapter_config: rank, alpha, targets
        self.get(data, "loss", dict, "", {})
        try:  # every option by its field name; a manifest from before an option holds its default, and one from
            # before max_targets read out every position (0)
            options = ExportOptions.from_manifest({**data, "max_targets": data.get("max_targets", 0)})
        except (TypeError, ValueError) as e:
            raise self.fail("an export option", f"does not read ({e})") from e
        program = self.get(data, "program", dict, "", None)
        if program is not None:
            kind = self.get(program, "kind", str, "program")
            if kind not in PROGRAM_KINDS:
                raise self.fail("\"program.kind\"", f"is {kind!r}, expected one of {', '.join(PROGRAM_KINDS)}")
            program = ProgramSettings(kind, self.get(program, "local_weight", float, "program", 0.0))
        calibration = self.get(data.get("loss", {}), "calibration", dict, "loss", None)
        return Manifest(model=self.model(data), tokenizer=self.get(data, "tokenizer", str, "", ""), options=options,
                        stages=stages, program=program or ProgramSettings(), calibration=calibration,
                        runtime=self.get(data, "runtime", str, "", None),
                        zl_version=self.get(data, "zl_version", str, "", ""), created=self.get(data, "created", str, "", ""),
                        format_version=version)
