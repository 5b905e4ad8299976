"""The inference program's KV cache written in place: ExecuTorch's `llama::update_cache` and `llama::custom_sdpa`.

transformers' static cache (`TorchExportableModuleForDecoderOnlyLM`) writes each token with `index_copy_` into a
(B, H, S, D) buffer. Exported, that is a functional `index_copy` (a new tensor the size of the whole cache) and a
copy back into the mutable buffer, per layer, K and V, per token: at 512 positions SmolLM2-135M moves about 47 MiB
a token to write 45 KiB, and its eager attention then multiplies over all 512 positions, filled or not. The
decoder here keeps the caches in ExecuTorch's (B, S, H, D) layout and uses the two ops of ExecuTorch's own LLM
export (examples/models/llama, optimum-executorch's `custom_sdpa` + custom KV cache):

- `update_cache(value (B, S, H, D), cache, start_pos)` writes the S new positions into the cache buffer in place;
- `custom_sdpa(q (B, S, Hq, D), k_cache, v_cache, start_pos, None, 0, is_causal=True, scale)` attends causally over
  positions [0, start_pos + S) only (grouped-query heads included).

Both kernels ship in ExecuTorch's pip wheel (`executorch.extension.llm.custom_ops`, which the program runner
imports) and in runtimes built with -DEXECUTORCH_BUILD_KERNELS_LLM=ON (the LLM runners: `llama_main`, the Android
LLM demo's library). The decoder is exact against the model's own forward (tests/test_export_model.py); a model
whose attention the ops cannot express (a sliding window shorter than the cache, logit soft-capping) keeps
transformers' static cache (`cache_ops_refusal`).

The cache position comes from the program's `cache_position` input (as `position_ids`), not from a counter in the
program: a runner may rewind (drop a reply) by passing earlier positions, as ExecuTorch's runners do.
"""

from __future__ import annotations

import torch

ATTENTION = "zl_cache_ops"  # the name the attention function and its (absent) mask are registered under


def cache_ops_refusal(model: torch.nn.Module, max_seq_len: int) -> str | None:
    """Why `model`'s attention cannot run on the in-place ops with a cache of `max_seq_len` positions, or None.

    custom_sdpa attends causally over every cached position: a layer whose window (`ModelFamily.attention_window`)
    is at least the cache attends over all of them too (key j of query i is seen when i - j < window, and
    i - j < max_seq_len), a shorter one would not. It has no logit soft-capping."""
    from zl_export.model_family import family_of_model

    config = model.config.get_text_config()
    family = family_of_model(model)
    windows = {family.attention_window(config, layer) for layer in range(config.num_hidden_layers)} - {None}
    if windows and min(windows) < max_seq_len:
        return (f"its layers attend over a sliding window of {min(windows)} positions, shorter than the cache of "
                f"{max_seq_len}")
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap:
        return f"its attention soft-caps logits (attn_logit_softcapping {softcap})"
    return None


class InPlaceCacheDecoder(torch.nn.Module):
    """`forward(input_ids (1, S), cache_position (S,)) -> logits (1, S, V)`, with `model`'s K and V caches as
    buffers `key_cache_i`, `value_cache_i` (1, max_seq_len, kv heads, head dim), updated in place.

    Switches `model`'s attention to the ops while it exists; `restore()` switches it back (the export calls it)."""

    def __init__(self, model: torch.nn.Module, max_seq_len: int):
        super().__init__()
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.cache_utils import StaticCache

        _load_ops()
        AttentionInterface.register(ATTENTION, _custom_sdpa)
        AttentionMaskInterface.register(ATTENTION, _no_mask)  # custom_sdpa builds the causal mask itself
        config = model.config.get_text_config()
        heads = config.num_key_value_heads or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        for i in range(config.num_hidden_layers):
            for kind in ("key", "value"):
                self.register_buffer(f"{kind}_cache_{i}", torch.zeros(1, max_seq_len, heads, head_dim, dtype=model.dtype),
                                     persistent=False)
        self.model = model
        self._attention = model.config._attn_implementation
        model.config._attn_implementation = ATTENTION
        owner = self

        class _Cache(StaticCache):
            """transformers' cache interface (mask sizes, layer count) over the decoder's buffers."""

            def update(self, key_states, value_states, layer_idx, *args, **kwargs):
                start = _start_pos(kwargs.get("kwargs") or kwargs)
                keys, values = owner.get_buffer(f"key_cache_{layer_idx}"), owner.get_buffer(f"value_cache_{layer_idx}")
                torch.ops.llama.update_cache(key_states.transpose(1, 2), keys, start)
                torch.ops.llama.update_cache(value_states.transpose(1, 2), values, start)
                return keys, values

        self.cache = _Cache(config=config, max_cache_len=max_seq_len)

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids, position_ids=cache_position.unsqueeze(0), past_key_values=self.cache,
                         use_cache=True)
        return out.logits

    def restore(self) -> None:
        """`model`'s own attention back (the decoder is spent)."""
        self.model.config._attn_implementation = self._attention


def _load_ops() -> None:
    """Register llama::update_cache / custom_sdpa: their meta functions for export, their kernels for the runtime."""
    from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401


def _start_pos(kwargs: dict):
    """The first cache position of this call: position_ids[0][0] (a symbolic int when exporting)."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None:  # a family whose layers do not hand position_ids on: an error, not a wrong cache
        raise RuntimeError("in-place KV cache: the attention layer got no position_ids; this family needs the "
                           "static cache (zl_export/kv_cache.py: cache_ops_refusal)")
    start = position_ids[0][0].item()
    torch._check(start >= 0)
    return start


def _custom_sdpa(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers' attention interface: query (B, Hq, S, D), key/value the (B, S_max, Hkv, D) caches; returns
    (B, S, Hq, D) as every attention function does."""
    out = torch.ops.llama.custom_sdpa(query.transpose(1, 2), key, value, _start_pos(kwargs), None, 0.0, True, scaling)
    return out, None


def _no_mask(*args, **kwargs):
    return None
