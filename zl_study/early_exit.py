"""A stage's readout used as the classifier: the model cut after stage k, read out through that stage's head.

`EarlyExitModel` quacks like a Hugging Face causal LM for the scorers
(`zl_export.scoring`, `zl_device.results.evaluate`): `get_decoder()` returns the
layers up to the end of stage k followed by the final norm and, when the stage
has one, its readout translator; `get_output_embeddings()` the frozen LM head.
The exit after the last stage is the fine-tuned model itself.
"""

from types import SimpleNamespace

import torch
from torch import nn


class _Body(nn.Module):
    def __init__(self, stages: list[nn.Module]):
        super().__init__()
        self.stages = nn.ModuleList(stages)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **_ignored) -> SimpleNamespace:
        x = input_ids
        for stage in self.stages:
            _, x = stage.chunk(x, attention_mask)  # (B, S, D)
        last = self.stages[-1]
        u = last.norm(x)
        if last.translator is not None:
            u = last.translator(u)
        return SimpleNamespace(last_hidden_state=u)


class EarlyExitModel(nn.Module):
    """Stages 0..k of a split (`StageModule`s sharing one model's weights), read out at the end of stage k."""

    def __init__(self, modules: list[nn.Module], k: int):
        super().__init__()
        self.body = _Body(list(modules[: k + 1]))
        self.head = modules[k].lm_head

    def get_decoder(self) -> nn.Module:
        return self.body

    def get_output_embeddings(self) -> nn.Module:
        return self.head
