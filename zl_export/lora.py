"""LoRA adapters through PEFT, and the PEFT names of their parameters.

Only LoRA parameters are trainable; everything else is frozen and becomes a
constant of the exported program. Dropout is 0: a training program is a fixed
graph, and the pipeline's replay after a failure must recompute exactly.
"""

import torch
from torch import nn

from zl_export.model_family import family_of_model
from zl_export.options import LoraSettings


def attach_lora(model: nn.Module, settings: LoraSettings, seed: int = 0) -> nn.Module:
    """Wrap `model` with PEFT LoRA adapters and freeze everything else.

    `lora_A` is initialised from `seed`, `lora_B` with zeros (PEFT's default),
    so the adapted model starts equal to the base model.

    Returns:
        the `PeftModel`.

    Targets not given (`settings.targets` None) are the family's default (`ModelFamily.default_lora_targets`).

    Raises:
        ZLError: a bad rank or α, or a target that is not a projection of the model's family.
    """
    from peft import LoraConfig, get_peft_model

    family = family_of_model(model)
    settings = settings.for_family(family)  # no --lora-targets: the family's default
    settings.validate(family)
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        target_modules=list(settings.targets),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config)
    for name, param in peft_model.named_parameters():
        param.requires_grad_("lora_" in name)
    return peft_model


def peft_names(peft_model: nn.Module) -> dict[int, str]:
    """Map `id(parameter)` of every LoRA parameter to its name in a saved PEFT adapter.

    PEFT stores `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`
    (the adapter name `default` dropped), which is what
    `PeftModel.from_pretrained` expects in `adapter_model.safetensors`.
    """
    names = {}
    for name, param in peft_model.named_parameters():
        if "lora_" in name:
            names[id(param)] = name.replace(".default.", ".")
    return names


def adapter_config(settings: LoraSettings, base_model_name: str) -> dict:
    """`adapter_config.json` for the merged adapter (the keys PEFT reads)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": 0.0,
        "target_modules": list(settings.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
