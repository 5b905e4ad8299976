"""zl_export.pipeline: a whole export with progress hooks, the one-step check, and the caller's model kept."""

import torch

from conftest import native_library_or_skip
from zl_export.manifest import load_export
from zl_export.model_source import load_model
from zl_export.options import ExportOptions, ModelSplit
from zl_export.pipeline import ExportProgress, export_pipeline


class Recorder(ExportProgress):
    def __init__(self):
        self.events = []

    def loaded(self, model, loaded, stages, load_s):
        self.events.append(("loaded", model, [str(s) for s in stages]))

    def stage_done(self, index, size_bytes, export_s):
        self.events.append(("done", index, size_bytes > 0))

    def exported(self, manifest, shown_dir):
        self.events.append(("exported", shown_dir.name))

    def checked(self, checks):
        self.events.append(("checked", [c.index for c in checks]))


def test_export_pipeline_reports_checks_and_gives_the_model_back(tmp_path):
    native_library_or_skip()
    loaded = load_model("tiny-random", seed=0)
    before = {n: p.detach().clone() for n, p in loaded.model.named_parameters()}
    progress = Recorder()
    result = export_pipeline(ModelSplit("tiny-random", "0-1,2-3"), tmp_path / "tmp", ExportOptions(seq_len=64), check=True,
                             progress=progress, loaded=loaded, shown_dir=tmp_path / "final")
    assert progress.events == [("loaded", "tiny-random", ["0-1", "2-3"]), ("done", 0, True), ("done", 1, True),
                               ("exported", "final"), ("checked", [0, 1])]
    assert load_export(tmp_path / "tmp", verify=True) == result.exported
    assert [c.index for c in result.checks] == [0, 1] and all(c.loss_diff() < 1e-3 for c in result.checks)
    after = dict(loaded.model.named_parameters())
    assert not any("lora_" in n for n in after), "the LoRA layers are removed from the caller's model"
    assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)
