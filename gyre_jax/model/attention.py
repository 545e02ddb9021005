"""Grouped-query attention over a packed prefix-sharing tree, or over a KV cache.

Tree mask (docs/design.md, "Tree packing"): query i attends key j iff

    segment[i] == segment[j]  and  j <= i < subtree_end[j]

A plain causal sequence is segment = 1, subtree_end = L. ``attend`` takes the
mask either dense ([B, T, S] booleans: the reference, O(L^2)) or as O(L) metadata
(``TreeMask`` / ``CacheMask`` from tree_attention.py: blockwise, tiles the tree
masks skipped, never an [L, L] array); config.attention_impl picks which.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from gyre_jax.model.config import ModelConfig
from gyre_jax.model.layers import RMSNorm, dense_init, rope, rope_inv_freq
from gyre_jax.model.paged import PagedMask, page_slots, paged_attention, write_pages
from gyre_jax.model.tree_attention import CacheMask, TreeMask, attend_structured


def tree_attention_mask(segment_ids_BxL, subtree_end_BxL):
    """Boolean [B, L(query), L(key)] mask of the tree rule above."""
    L = segment_ids_BxL.shape[-1]
    i = jnp.arange(L, dtype=jnp.int32)[:, None]
    j = jnp.arange(L, dtype=jnp.int32)[None, :]
    same = segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :]
    return same & (j <= i) & (i < subtree_end_BxL[:, None, :])


def attend(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask_BxTxS):
    """Softmax attention with GQA (N query heads share K k/v heads); float32 softmax.

    ``mask_BxTxS``: dense booleans, or a TreeMask/CacheMask (blockwise path, same result).
    Every query row must have at least one visible key (the tree rule always
    includes the token itself), so no row is all -inf.
    """
    if isinstance(mask_BxTxS, (TreeMask, CacheMask)):
        return attend_structured(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask_BxTxS)
    b, t, n, h = q_BxTxNxH.shape
    kv = k_BxSxKxH.shape[2]
    q_BxTxKxGxH = q_BxTxNxH.reshape(b, t, kv, n // kv, h)
    scores = jnp.einsum(
        "btkgh,bskh->bkgts", q_BxTxKxGxH, k_BxSxKxH, preferred_element_type=jnp.float32
    ) * (h**-0.5)
    scores = jnp.where(mask_BxTxS[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BxSxKxH.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v_BxSxKxH)
    return out.reshape(b, t, n, h)


def _write_rows(cache_BxSxKxH, new_BxTxKxH, index_B):
    """Write each batch row's T new entries at its own offset (a KV-cache slot update)."""
    return jax.vmap(lambda c, x, i: jax.lax.dynamic_update_slice(c, x.astype(c.dtype), (i, 0, 0)))(
        cache_BxSxKxH, new_BxTxKxH, index_B
    )


class Attention(nn.Module):
    """q/k/v/o projections, RoPE at the given positions, GQA attention.

    Without a cache, keys are the T tokens themselves and ``mask`` is [B, T, T].
    With ``cache=(k_BxSxKxH, v_BxSxKxH)`` and ``cache_index_B``, the new keys are
    first written into the cache at ``cache_index`` (per row), attention runs over
    the whole updated cache with ``mask`` [B, T, S], and the updated cache is
    returned: one code path serves prefill-with-prefix and decode. With a ``PagedMask``
    the cache is a pool of pages (paged.py) and T must be 1 (a decode step).
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, x_BxTxD, positions_BxT, mask, cache=None, cache_index_B=None):
        cfg = self.config
        dt = cfg.jnp_dtype
        d, n, kv, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

        def w(name, shape, axes, fan_in):
            return self.param(
                name, nn.with_logical_partitioning(dense_init(fan_in), axes), shape, cfg.jnp_param_dtype
            ).astype(dt)

        wq_DxNxH = w("q", (d, n, h), ("embed", "heads", "head_dim"), d)
        wk_DxKxH = w("k", (d, kv, h), ("embed", "kv_heads", "head_dim"), d)
        wv_DxKxH = w("v", (d, kv, h), ("embed", "kv_heads", "head_dim"), d)
        wo_NxHxD = w("o", (n, h, d), ("heads", "head_dim", "embed"), n * h)

        x = x_BxTxD.astype(dt)
        q = jnp.einsum("btd,dnh->btnh", x, wq_DxNxH)
        k = jnp.einsum("btd,dkh->btkh", x, wk_DxKxH)
        v = jnp.einsum("btd,dkh->btkh", x, wv_DxKxH)
        if cfg.qkv_bias:  # Qwen2: biased q/k/v projections (zero-init; checkpoints overwrite)
            def b(name, shape, axes):
                return self.param(
                    name, nn.with_logical_partitioning(nn.initializers.zeros, axes), shape, cfg.jnp_param_dtype
                ).astype(dt)

            q = q + b("q_bias", (n, h), ("heads", "head_dim"))
            k = k + b("k_bias", (kv, h), ("kv_heads", "head_dim"))
            v = v + b("v_bias", (kv, h), ("kv_heads", "head_dim"))
        if cfg.qk_norm:  # Qwen3: per-head RMSNorm of q and k, before RoPE
            q = RMSNorm(cfg, head_dim=True, name="q_norm")(q)
            k = RMSNorm(cfg, head_dim=True, name="k_norm")(k)
        inv_freq_F = None if cfg.rope_scaling == "none" else rope_inv_freq(cfg)
        q = rope(q, positions_BxT, cfg.rope_theta, inv_freq_F=inv_freq_F)
        k = rope(k, positions_BxT, cfg.rope_theta, inv_freq_F=inv_freq_F)

        if cache is None:
            out = attend(q, k, v, mask)
            new_cache = None
        elif isinstance(mask, PagedMask):  # one decode token per row, k/v pages [K, NP, G, H]
            k_pages, v_pages = cache
            pos_BxT = cache_index_B[:, None] + jnp.arange(x.shape[1], dtype=jnp.int32)[None]
            page_BxT, row_BxT = page_slots(mask.page_table, pos_BxT, k_pages.shape[2])
            k_pages = write_pages(k_pages, k, page_BxT, row_BxT)
            v_pages = write_pages(v_pages, v, page_BxT, row_BxT)
            out = paged_attention(q[:, 0], k_pages, v_pages, mask.page_table, cache_index_B + 1, impl=mask.impl,
                                  block_q=mask.block_q, block_k=mask.block_k, blockwise=mask.blockwise)[:, None]
            new_cache = (k_pages, v_pages)
        else:
            k_cache, v_cache = cache
            k_all = _write_rows(k_cache, k, cache_index_B)
            v_all = _write_rows(v_cache, v, cache_index_B)
            out = attend(q, k_all.astype(dt), v_all.astype(dt), mask)
            new_cache = (k_all, v_all)
        y = jnp.einsum("btnh,nhd->btd", out, wo_NxHxD)
        return y, new_cache
