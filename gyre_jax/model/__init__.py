"""gyre_jax.model: a Llama/Qwen-family decoder over packed prefix-sharing trees.

    from gyre_jax.model import ModelConfig, Transformer, init_params
    params = init_params(cfg, jax.random.key(0))  # {"params": ...}
    logits_BxLxV = Transformer(cfg).apply(params, tokens, positions, segment_ids, subtree_end)

KV-cache decoding for serving: gyre_jax.model.decode (KV, KVCache, init_cache,
prefill, insert, slot_kv, decode_step), over params as a server holds them:
gyre_jax.model.unrolled.split_params (one array per layer, read where it lies).
"""
from gyre_jax.model.attention import attend, tree_attention_mask
from gyre_jax.model.config import ModelConfig, model_config_tiny
from gyre_jax.model.transformer import (
    Transformer,
    count_params,
    init_boxed,
    init_params,
    param_logical_axes,
)

__all__ = [
    "ModelConfig",
    "Transformer",
    "attend",
    "count_params",
    "init_boxed",
    "init_params",
    "model_config_tiny",
    "param_logical_axes",
    "tree_attention_mask",
]
