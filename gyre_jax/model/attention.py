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

from gyre_jax.model.attend import attend
from gyre_jax.model.config import ModelConfig
from gyre_jax.model.layers import RMSNorm, dense_param, project, rope, rope_inv_freq
from gyre_jax.model.lora import adapter_weights as lora_adapter
from gyre_jax.model.lora import delta as lora_delta
from gyre_jax.model.paged import PagedMask, page_slots, paged_attention, write_pages


def tree_attention_mask(segment_ids_BxL, subtree_end_BxL):
    """Boolean [B, L(query), L(key)] mask of the tree rule above."""
    L = segment_ids_BxL.shape[-1]
    i = jnp.arange(L, dtype=jnp.int32)[:, None]
    j = jnp.arange(L, dtype=jnp.int32)[None, :]
    same = segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :]
    return same & (j <= i) & (i < subtree_end_BxL[:, None, :])


def attend_one_query(q_Bx1xNxH, k_YxBxSxKxH, v_YxBxSxKxH, layer, mask_Bx1xS):
    """``attend`` for one query per row against layer ``layer`` of a stacked [Y, B, S, K, H] cache.

    The decode step's attention. Both products are dots batched over rows only, on the
    cache in its own layout viewed as [B, S, K*H]: the query enters as a block-diagonal
    [K*H, K*G] matrix (zeros off the diagonal blocks; K times the flops of the useful
    products, which decode can afford: it is bound by reading the cache). A dot batched
    over (row, kv head) as ``attend`` writes it makes XLA transpose every layer's cache to
    [B, K, S, H] first, a copy of the whole cache per step (on CPU most of a 32-slot step).
    Same math as ``attend``: float32 scores and softmax, masked entries excluded, and the
    zero blocks add exact zeros.
    """
    b, _, n, h = q_Bx1xNxH.shape
    s, kv = k_YxBxSxKxH.shape[2], k_YxBxSxKxH.shape[3]
    g = n // kv
    dt = k_YxBxSxKxH.dtype
    k_BxSxKH = jax.lax.dynamic_index_in_dim(k_YxBxSxKxH, layer, keepdims=False).reshape(b, s, kv * h)
    v_BxSxKH = jax.lax.dynamic_index_in_dim(v_YxBxSxKxH, layer, keepdims=False).reshape(b, s, kv * h)
    eye_KxK = jnp.eye(kv, dtype=dt)
    q_BxKxGxH = q_Bx1xNxH.reshape(b, kv, g, h).astype(dt)
    q_BxKHxKG = jnp.einsum("bkgh,kj->bkhjg", q_BxKxGxH, eye_KxK).reshape(b, kv * h, kv * g)
    scores_BxSxKG = jnp.einsum("bsx,bxy->bsy", k_BxSxKH, q_BxKHxKG, preferred_element_type=jnp.float32) * (h**-0.5)
    scores_BxSxKG = jnp.where(mask_Bx1xS[:, 0, :, None], scores_BxSxKG, jnp.finfo(jnp.float32).min)
    probs_BxSxKG = jax.nn.softmax(scores_BxSxKG, axis=1).astype(dt)
    out_BxKGxKH = jnp.einsum("bsy,bsx->byx", probs_BxSxKG, v_BxSxKH, preferred_element_type=jnp.float32)
    out_BxKxGxH = jnp.einsum("bkgjh,kj->bkgh", out_BxKGxKH.reshape(b, kv, g, kv, h), eye_KxK.astype(jnp.float32))
    return out_BxKxGxH.reshape(b, 1, n, h).astype(q_Bx1xNxH.dtype)


def write_one_row(cache_YxBxSxKxH, new_Bx1xKxH, layer, index_B):
    """Write each row's one new entry at [layer, b, index[b]] of a stacked cache, in place.

    A scatter into the buffer the layer scan carries (no per-layer slice, no new stacked
    buffer); an index past the end is clamped onto the last entry, as dynamic_update_slice does.
    """
    _, b, s, _, _ = cache_YxBxSxKxH.shape
    idx_B = jnp.clip(index_B, 0, s - 1)
    return cache_YxBxSxKxH.at[layer, jnp.arange(b), idx_B].set(new_Bx1xKxH[:, 0].astype(cache_YxBxSxKxH.dtype),
                                                                unique_indices=True, mode="promise_in_bounds")


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
    ``cache=(k_YxBxSxKxH, v_YxBxSxKxH, layer)`` (one token per row, a dense mask) is
    the decode step's form: the whole stacked cache, updated in place at ``layer``.
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, x_BxTxD, positions_BxT, mask, cache=None, cache_index_B=None, lora_in=None):
        cfg = self.config
        dt = cfg.jnp_dtype
        d, n, kv, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

        wq_DxNxH = dense_param(self, "q", (d, n, h), ("embed", "heads", "head_dim"), d)
        wk_DxKxH = dense_param(self, "k", (d, kv, h), ("embed", "kv_heads", "head_dim"), d)
        wv_DxKxH = dense_param(self, "v", (d, kv, h), ("embed", "kv_heads", "head_dim"), d)
        wo_NxHxD = dense_param(self, "o", (n, h, d), ("heads", "head_dim", "embed"), n * h)

        x = x_BxTxD.astype(dt)
        q = project(self, "q", x, wq_DxNxH, "btd,dnh->btnh", 1, (d,), ("embed",), (n, h), ("heads", "head_dim"), lora_in)
        k = project(self, "k", x, wk_DxKxH, "btd,dkh->btkh", 1, (d,), ("embed",), (kv, h), ("kv_heads", "head_dim"),
                    lora_in)
        v = project(self, "v", x, wv_DxKxH, "btd,dkh->btkh", 1, (d,), ("embed",), (kv, h), ("kv_heads", "head_dim"),
                    lora_in)
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

        out, new_cache = _attend_cached(q, k, v, mask, cache, cache_index_B, dt)
        # One [N*H] contraction: as "btnh,nhd" XLA may contract h-major and copy the weight
        # transposed every call (each layer's o at every decode step).
        b, t = out.shape[:2]
        y = jnp.einsum("btx,xd->btd", out.reshape(b, t, n * h), wo_NxHxD.reshape(n * h, d))
        ab = lora_adapter(self, "o", (n, h), ("heads", "head_dim"), (d,), ("embed",))
        if ab is not None:
            y = y + lora_delta(self, out, ab, lora_in, 2).astype(y.dtype)
        return y, new_cache


def _attend_cached(q, k, v, mask, cache, cache_index_B, dt):
    """(attention output, the updated cache) for the cache forms ``Attention`` takes (its docstring):
    none, pages [K, NP, G, H] (a decode token per row), the stacked decode cache, or rows to write."""
    if cache is None:
        return attend(q, k, v, mask), None
    if isinstance(mask, PagedMask):  # one decode token per row, k/v pages [K, NP, G, H]
        k_pages, v_pages = cache
        pos_BxT = cache_index_B[:, None] + jnp.arange(k.shape[1], dtype=jnp.int32)[None]
        page_BxT, row_BxT = page_slots(mask.page_table, pos_BxT, k_pages.shape[2])
        k_pages = write_pages(k_pages, k, page_BxT, row_BxT)
        v_pages = write_pages(v_pages, v, page_BxT, row_BxT)
        out = paged_attention(q[:, 0], k_pages, v_pages, mask.page_table, cache_index_B + 1, impl=mask.impl,
                              block_q=mask.block_q, block_k=mask.block_k, blockwise=mask.blockwise)[:, None]
        return out, (k_pages, v_pages)
    if len(cache) == 3:  # decode: the stacked cache, carried through the layer scan
        k_all, v_all, layer = cache
        k_all = write_one_row(k_all, k, layer, cache_index_B)
        v_all = write_one_row(v_all, v, layer, cache_index_B)
        return attend_one_query(q, k_all, v_all, layer, mask).astype(dt), (k_all, v_all)
    k_cache, v_cache = cache
    k_all = _write_rows(k_cache, k, cache_index_B)
    v_all = _write_rows(v_cache, v, cache_index_B)
    return attend(q, k_all.astype(dt), v_all.astype(dt), mask), (k_all, v_all)
