"""Small manifests for tests that need one without exporting: built through the typed form, so they are real ones."""

from zl_export.manifest import Manifest, ModelInfo, ParameterEntry, StageEntry
from zl_export.options import ExportOptions, LoraSettings

#: The parameter names of `fake_manifest`'s stages: one LoRA A matrix per stage.
LORA_A = "base_model.model.model.layers.{k}.self_attn.q_proj.lora_A.weight"


def fake_manifest(layers: list[tuple[int, int]], files: bool = True, parameters: bool = True, seq_len: int = 16,
                  micro_batch: int = 2, hidden_size: int = 16, source: str = "random") -> Manifest:
    """A tiny-random manifest with a stage per (first, last) of `layers`: program files `stage_<k>.pte` (hash
    "unused") unless not `files`; one (2, 4) parameter `LORA_A` per stage when `parameters`."""
    stages = tuple(
        StageEntry(k, (first, last), (), (), (ParameterEntry(LORA_A.format(k=k), (2, 4), "lora_a"),) if parameters else (),
                   **({"file": f"stage_{k}.pte", "sha256": "unused", "size_bytes": 0, "export_s": 0.0} if files else {}))
        for k, (first, last) in enumerate(layers))
    model = ModelInfo("tiny-random", source, "llama", "llama", (), False, layers[-1][1] + 1, hidden_size, 256)
    options = ExportOptions(seq_len=seq_len, micro_batch=micro_batch, lora=LoraSettings(2, 4.0, ("q_proj",)),
                            max_targets=0)  # as recorded: the programs' target slots
    return Manifest(model=model, tokenizer="bytes", options=options, stages=stages)
