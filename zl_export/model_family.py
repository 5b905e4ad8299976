"""What differs between the model families zl splits, said once per family (docs/design#model-families).

Every supported family is a Hugging Face `*ForCausalLM` with the same outline, which the stage split relies on:

    model.model.embed_tokens -> model.model.layers[i](h, attention_mask, position_ids, position_embeddings)
    -> model.model.norm -> model.lm_head            (rotary tables from model.model.rotary_emb)

What a decoder layer computes inside (a q/k/v bias, QK-norm, fused projections, Gemma's (1 + w) RMSNorm, the
attention scale and soft-capping) is the Hugging Face layer's own business: a stage runs those layers as they are.
What a stage has to do differently per family is said here: the attention mask of each layer (causal, or causal
within a sliding window), which rotary table a layer takes (Gemma 3: local and global layers rotate with their own
base), the readout (Gemma 3 configs may soft-cap the logits), the LoRA target names and the buffers a model built
on the meta device has to recompute. The remaining flags describe the family (the manifest records them, the tests
check the tiny models have them, `CompactLinear` keeps Qwen2's biases).

Torch-free at import, like zl_export/options.py, so the CLI can check `--lora-targets` without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zl_base.errors import ZLError

# Sliding-window attention: "none"; "layer_types" (config.layer_types says per layer: "sliding_attention" layers see
# the last config.sliding_window positions, Qwen2/3 with use_sliding_window, Gemma 3); "all" (every layer, when
# config.sliding_window is set: Phi-3).
SLIDING_KINDS = ("none", "layer_types", "all")
_SEPARATE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The tiny random models' common shape: small enough for a test export in about a minute.
_TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)


@dataclass(frozen=True)
class ModelFamily:
    """One architecture family: how zl finds its parts and what it must do differently for it."""

    name: str  # shown to users, e.g. "Qwen2"
    model_types: tuple[str, ...]  # the `model_type`s of its Hugging Face configs
    config_class: str  # transformers classes (imported when needed)
    model_class: str
    examples: str  # models of the family, for messages
    lora_targets: tuple[str, ...]  # the linear layers LoRA may adapt, by module name

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        """What LoRA adapts when --lora-targets is not given: every projection of the family's layers (attention
        and MLP). The default trains one stage (the last; the others are held still), a third of the layers
        whole-model backprop trains: on AG News at 4,096 samples, q and v alone left it 1.3 points behind
        backprop and every projection put it above (docs/studies/README.md, agnews-smollm2-135m-4096)."""
        return self.lora_targets
    gguf_arch: str = ""  # general.architecture of the family's GGUF files (llama.cpp's name)
    tiny: dict = field(default_factory=dict)  # config of the family's tiny random model (tests)
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm on every head's queries and keys (Qwen3, Gemma 3)
    fused_projections: bool = False  # qkv_proj and gate_up_proj instead of q/k/v and gate/up (Phi-3)
    norm_plus_one: bool = False  # RMSNorm scales by (1 + w) (Gemma)
    embedding_scale: bool = False  # embeddings are multiplied by sqrt(D) (Gemma: embed_tokens.embed_scale)
    sliding: str = "none"  # see SLIDING_KINDS
    rotary_per_layer_type: bool = False  # rotary_emb(x, position_ids, layer_type): one table per layer type (Gemma 3)
    logit_softcap: bool = False  # its configs may set final_logit_softcapping: logits = c·tanh(logits / c) (Gemma 3)

    @property
    def key(self) -> str:
        """The family's name in the manifest and in built-in model names (`tiny-random-<key>`)."""
        return self.model_types[0]

    def traits(self) -> list[str]:
        """What sets the family apart from Llama, as the manifest records it."""
        flags = ("qkv_bias", "qk_norm", "fused_projections", "norm_plus_one", "embedding_scale",
                 "rotary_per_layer_type", "logit_softcap")
        return [f for f in flags if getattr(self, f)] + ([f"sliding:{self.sliding}"] if self.sliding != "none" else [])

    def build_random(self, overrides: dict, seed: int):
        """A float32 model of this family with seeded random weights and eager attention, in eval mode."""
        import torch
        import transformers

        config = getattr(transformers, self.config_class)(**overrides, attn_implementation="eager")
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = getattr(transformers, self.model_class)(config)
        return model.float().eval()

    def attention_window(self, config, layer: int) -> int | None:
        """How many positions layer `layer` attends back over (the key j of query i is seen when i - j < window),
        or None for plain causal attention."""
        window = getattr(config, "sliding_window", None)
        if self.sliding == "all":
            return window
        if self.sliding == "layer_types" and window is not None:
            types = getattr(config, "layer_types", None) or ()
            return window if layer < len(types) and types[layer] == "sliding_attention" else None
        return None

    def rotary_key(self, config, layer: int) -> str | None:
        """Which rotary table layer `layer` takes: its layer type (Gemma 3), or None (one table for all)."""
        return config.layer_types[layer] if self.rotary_per_layer_type else None

    def position_embeddings(self, rotary_emb, x, position_ids, key: str | None):
        """(cos, sin) of rotary table `key` (`rotary_key`) for positions `position_ids` (B, S)."""
        return rotary_emb(x, position_ids) if key is None else rotary_emb(x, position_ids, key)

    def final_softcap(self, config) -> float | None:
        """c of the logit soft-capping c·tanh(logits / c) after the LM head, or None."""
        return getattr(config, "final_logit_softcapping", None) if self.logit_softcap else None

    def check_lora_targets(self, targets: tuple[str, ...]) -> None:
        """Raise ZLError unless every target is one of the family's linear layers."""
        valid = ",".join(self.lora_targets)
        if not targets:
            raise ZLError(f"--lora-targets is empty; name at least one of {self.name}'s projections: {valid}.")
        unknown = [t for t in targets if t not in self.lora_targets]
        if unknown:
            what = "is not a projection" if len(unknown) == 1 else "are not projections"
            raise ZLError(f"--lora-targets {','.join(targets)}: {','.join(unknown)} {what} of {self.name} models "
                          f"(model_type {self.key}); choose from {valid}.")

    def rebuild_buffers(self, model) -> None:
        """Recompute the buffers a checkpoint does not store, after the model was built on the meta device: the
        rotary tables, and Gemma's embedding scale."""
        inner = model.model
        inner.rotary_emb = type(inner.rotary_emb)(config=model.config)
        if self.embedding_scale:
            import torch

            emb = inner.embed_tokens
            emb.embed_scale = torch.tensor(float(emb.scalar_embed_scale))


LLAMA = ModelFamily(
    "Llama", ("llama",), "LlamaConfig", "LlamaForCausalLM", "TinyLlama, SmolLM2, Llama-3.2", _SEPARATE,
    gguf_arch="llama",
    tiny=dict(_TINY, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False),
)
QWEN2 = ModelFamily(
    "Qwen2", ("qwen2",), "Qwen2Config", "Qwen2ForCausalLM", "Qwen2-0.5B, Qwen2.5-0.5B-Instruct", _SEPARATE,
    gguf_arch="qwen2",
    tiny=dict(_TINY, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True),  # Qwen2.5-0.5B ties
    qkv_bias=True, sliding="layer_types",
)
QWEN3 = ModelFamily(
    "Qwen3", ("qwen3",), "Qwen3Config", "Qwen3ForCausalLM", "Qwen3-0.6B", _SEPARATE,
    gguf_arch="qwen3",
    tiny=dict(_TINY, head_dim=24, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True),
    qk_norm=True, sliding="layer_types",
)
PHI3 = ModelFamily(
    "Phi-3", ("phi3",), "Phi3Config", "Phi3ForCausalLM", "Phi-3-mini, Phi-3.5-mini, Phi-4-mini",
    ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), gguf_arch="phi3",
    # Phi-3-mini-4k attends over a 2047-position window on every layer; 6 here, so a test sequence crosses it.
    tiny=dict(_TINY, rms_norm_eps=1e-5, sliding_window=6, tie_word_embeddings=False, pad_token_id=0,
              bos_token_id=1, eos_token_id=2),
    fused_projections=True, sliding="all",
)
GEMMA3 = ModelFamily(
    "Gemma 3", ("gemma3_text",), "Gemma3TextConfig", "Gemma3ForCausalLM", "Gemma 3 270M, Gemma 3 1B", _SEPARATE,
    gguf_arch="gemma3",
    # Gemma 3 270M: 5 local layers (window 512, θ 10k) per global one (θ 1M), head_dim 256 = query_pre_attn_scalar,
    # no soft-capping. Here: local and global alternate (both in every stage of a 2-stage split), a 4-position
    # window, a query scale other than head_dim and soft-capping strong enough to change the numbers.
    tiny=dict(_TINY, head_dim=16, query_pre_attn_scalar=24, sliding_window=4, rms_norm_eps=1e-6,
              layer_types=["sliding_attention", "full_attention"] * 2, tie_word_embeddings=True,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
              final_logit_softcapping=3.0, attn_logit_softcapping=5.0),
    qk_norm=True, norm_plus_one=True, embedding_scale=True, sliding="layer_types", rotary_per_layer_type=True,
    logit_softcap=True,
)
FAMILIES = (LLAMA, QWEN2, QWEN3, PHI3, GEMMA3)
SUPPORTED_MODEL_TYPES = tuple(t for f in FAMILIES for t in f.model_types)
# Every name --lora-targets may take in some family (the check before a model is loaded).
ALL_LORA_TARGETS = tuple(dict.fromkeys(t for f in FAMILIES for t in f.lora_targets))


def supported() -> str:
    """The supported families for messages: "Llama (llama), Qwen2 (qwen2), ..."."""
    return ", ".join(f"{f.name} ({'/'.join(f.model_types)})" for f in FAMILIES)


def family_of(model_type: str, spec: str | None = None) -> ModelFamily:
    """The family of a config's `model_type`.

    Raises:
        ZLError: an architecture zl does not split (`spec`: the --model value, for the message).
    """
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    where = f"--model {spec}: " if spec else ""
    raise ZLError(f"{where}architecture {model_type!r} is not supported; zl splits these families (model_type): "
                  f"{supported()}.")


def family_of_gguf(architecture: str, spec: str) -> ModelFamily:
    """The family of a GGUF file's `general.architecture` (llama.cpp's names: gemma3, not gemma3_text).

    Raises:
        ZLError: an architecture zl does not split (`spec`: the --model value, for the message).
    """
    for family in FAMILIES:
        if architecture == family.gguf_arch:
            return family
    names = ", ".join(f"{f.name} ({f.gguf_arch})" for f in FAMILIES)
    raise ZLError(f"--model {spec}: a GGUF of architecture {architecture!r}, which zl does not split; use a GGUF of "
                  f"one of these families (general.architecture): {names}.")


def family_of_model(model) -> ModelFamily:
    """The family of a Hugging Face causal LM, PEFT-wrapped or not."""
    return family_of(causal_lm(model).config.model_type)


def causal_lm(model):
    """The `*ForCausalLM` inside a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def check_lora_names(targets: tuple[str, ...]) -> None:
    """The check of --lora-targets before the model (and so its family) is known: names of some family."""
    if not targets:
        raise ZLError("--lora-targets is empty; name at least one projection, e.g. q_proj,v_proj (Phi-3: qkv_proj).")
    unknown = [t for t in targets if t not in ALL_LORA_TARGETS]
    if unknown:
        per_family = "; ".join(f"{f.name}: {','.join(f.lora_targets)}" for f in FAMILIES if f.lora_targets != _SEPARATE)
        what = "is not a projection" if len(unknown) == 1 else "are not projections"
        raise ZLError(f"--lora-targets {','.join(targets)}: {','.join(unknown)} {what} of any supported model; "
                      f"choose from {','.join(_SEPARATE)} ({per_family}).")
