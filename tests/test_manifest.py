"""The typed manifest (zl_export/manifest.py, docs/design#manifest): one stage-entry builder, one reader.

The JSON stays what the C++ runner reads (runner/src/stage_manifest.cpp): the round trip is checked
byte for byte and key for key; old manifests read with their defaults; a damaged one is one ZLError naming the file
and the field.
"""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from manifest_fixtures import fake_manifest
from zl_base.errors import ZLError
from zl_export.manifest import (MANIFEST, Manifest, build_manifest, load_export, read_manifest, stage_count,
                                stage_entry, write_manifest)
from zl_export.options import ExportOptions, LoraSettings, LossConfig, ProgramSettings

OLD_RUN = Path(__file__).resolve().parent / "data" / "runner_kill_run" / MANIFEST


@pytest.fixture(scope="module")
def built():
    """A manifest of tiny-random's 3 stages with readout translators, built as `zl train --runtime torch` builds
    it (the stage modules, no programs)."""
    from zl_export.exporter import build_stage_modules, manifest_names
    from zl_export.model_source import load_model
    from zl_export.stages import parse_spec

    loaded = load_model("tiny-random")
    opts = ExportOptions(seq_len=16, micro_batch=2, max_targets=4, loss=LossConfig(translator_rank=2))
    peft_model, modules = build_stage_modules(loaded.model, parse_spec("0-1,2,3", 4), opts)
    try:
        entries = [stage_entry(m, manifest_names(m, peft_model), opts) for m in modules]
        params = [{n for n, p in m.named_parameters() if p.requires_grad} for m in modules]
    finally:
        peft_model.unload()
    return build_manifest(loaded, opts, entries, ProgramSettings("backprop", 0.5), runtime="torch"), params


def test_a_written_manifest_reads_back_equal_and_rewrites_byte_for_byte(built, tmp_path):
    manifest, _ = built
    path = write_manifest(manifest, tmp_path)
    text = path.read_text()
    again = read_manifest(path)
    assert again == manifest
    (tmp_path / "again").mkdir()
    write_manifest(again, tmp_path / "again")
    assert (tmp_path / "again" / MANIFEST).read_text() == text
    # The keys and their order, as the runner and earlier versions read them (docs/design#manifest).
    data = json.loads(text)
    assert list(data) == ["format_version", "zl_version", "created", "model", "tokenizer", "seq_len", "micro_batch",
                          "lora", "loss", "seed", "frozen_dtype", "embedding_dtype", "max_targets", "recompute", "stages",
                          "program", "runtime"]
    assert data["lora"] == {"rank": 8, "alpha": 16.0, "targets": list(again.options.lora.targets), "dropout": 0.0}
    assert data["program"] == {"kind": "backprop", "local_weight": 0.5} and data["max_targets"] == 4
    assert list(data["stages"][0]) == ["index", "layers", "inputs", "outputs", "parameters"]  # no program file
    assert list(data["stages"][0]["parameters"][0]) == ["name", "program_name", "shape"]
    assert data["stages"][0]["inputs"][0] == {"name": "input_ids", "dtype": "int64", "shape": [2, 16]}


def test_the_stage_entry_lists_every_trainable_parameter_with_its_role(built):
    manifest, params = built
    assert stage_count(manifest) == manifest.num_stages == 3 and stage_count(manifest.to_json()) == 3
    for entry, names in zip(manifest.stages, params):
        assert {p.program_name for p in entry.parameters} == names
        translators = [p.name for p in entry.parameters if p.is_translator]
        # stages before the last carry a readout translator (scale, down, up), named apart from the LoRA tensors
        assert len(translators) == (3 if entry.index < 2 else 0)
        assert all(n.startswith("zl.translator.stage_") for n in translators)
    assert [s.range.first for s in manifest.stages] == [0, 2, 3]
    assert manifest.stages[1].output_names == ["hidden", "loss", "task_loss", "consistency_loss"]


def test_an_old_manifest_reads_with_the_defaults_of_its_time(tmp_path):
    """A manifest of 2026-11 (tests/data: no program, no frozen_dtype, no max_targets, alpha a number): zerolock,
    fp32 weights, every position read out."""
    old = read_manifest(OLD_RUN)
    assert old.program == ProgramSettings("zerolock", 0.0)
    assert old.options.frozen_dtype == "fp32" and old.options.target_slots == 0
    assert [s.layers for s in old.stages] == [(0, 1), (2, 2), (3, 3)] and old.stages[0].file == "stage_0.pte"
    assert old.model.hidden_size == 64 and old.model.family == "llama"


def _corrupt(tmp_path: Path, change) -> Path:
    data = fake_manifest([(0, 1), (2, 3)]).to_json()
    change(data)
    path = tmp_path / MANIFEST
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("change, problem", [
    (lambda d: d["stages"][1].pop("layers"), r'"stages\[1\].layers" is missing'),
    (lambda d: d["stages"][0]["parameters"][0].update(shape="2x4"),
     r'"stages\[0\].parameters\[0\].shape" is "2x4", expected a list of integers'),
    (lambda d: d["stages"][1].update(index=0), r'"stages" has indices \[0, 0\], expected 0..n-1 in order'),
    (lambda d: d["model"].pop("hidden_size"), r'"model.hidden_size" is missing'),
    (lambda d: d.update(program={"kind": "backward"}), r'"program.kind" is \'backward\', expected one of zerolock, backprop'),
    (lambda d: d.pop("lora"), r'"lora" is missing'),
    (lambda d: d["stages"][0].update(size_bytes="big"), r'"stages\[0\].size_bytes" is "big", expected int'),
], ids=["no layers", "shape a string", "indices", "no hidden size", "program kind", "no lora", "size a string"])
def test_a_damaged_manifest_names_the_file_and_the_field(tmp_path, change, problem):
    path = _corrupt(tmp_path, change)
    with pytest.raises(ZLError, match=f"manifest {path}: {problem}; the file is damaged or from another version of zl; "
                                      "export again"):
        read_manifest(path)


def test_a_manifest_of_another_format_or_no_object_is_one_error(tmp_path):
    path = _corrupt(tmp_path, lambda d: d.update(format_version=2))
    with pytest.raises(ZLError, match="format_version 2, this zl reads 1; export again"):
        read_manifest(path)
    path.write_text("[1, 2]")
    with pytest.raises(ZLError, match="not a JSON object but list"):
        read_manifest(tmp_path)  # a directory holding manifest.json reads it
    path.write_text("{")
    with pytest.raises(ZLError, match="not valid JSON"):
        read_manifest(path)


def test_an_export_needs_its_programs(tmp_path):
    write_manifest(fake_manifest([(0, 1)], files=False), tmp_path)
    with pytest.raises(ZLError, match=r"stage 0 has no program \"file\".*pass the output directory of `zl export`"):
        load_export(tmp_path)
    write_manifest(fake_manifest([(0, 1)]), tmp_path)
    with pytest.raises(ZLError, match="stage_0.pte: listed in the manifest but missing"):
        load_export(tmp_path)


def test_options_come_back_as_recorded():
    """The LoRA targets resolved for the family, the target slots, the calibration note."""
    manifest = replace(fake_manifest([(0, 3)]), calibration={"path": "demo", "rows": 8})
    data = manifest.to_json()
    assert data["loss"]["calibration"] == {"path": "demo", "rows": 8}
    again = Manifest.from_json(data, "x/manifest.json")
    assert again == manifest and again.options.lora == LoraSettings(2, 4.0, ("q_proj",))
