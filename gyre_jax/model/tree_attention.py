"""Blockwise tree attention: online softmax over KV tiles, tiles the tree masks skipped.

Rule (docs/design.md, "Tree packing"), generalised to queries against any key buffer:

    query t sees key j  iff  q_segment[t] == k_segment[j]  and  j <= q_index[t] < k_end[j]

A packed training row is ``q_index = arange(L)``, ``q_segment = k_segment = segment_ids``,
``k_end = subtree_end``; a linear KV-cache slot is one segment with ``k_end = S`` and
``q_index`` = the query's cache index (causal). The [T, S] mask and the [N, T, S] scores
are never formed: the mask of one (q-tile, k-tile) pair is computed inside the tile
from O(tile) metadata, and the inner loop runs only over the k-tiles a q-tile can see.

Tile visibility is exact for DFS-packed rows: a key j is seen by the query interval
[j, k_end[j]), and the keys of a tile are consecutive, so the union of their intervals is
the single interval [tile start, max k_end) (each interval contains its own j). A q-tile
sees the k-tile iff its [min q_index, max q_index] meets that interval (and the segment
ranges overlap); with contiguous queries that is iff some pair in the tile is visible,
so the tiles skipped are exactly the tiles the tree masks (``masked_tile_fraction``).

Backward is FlashAttention-2 style: the forward keeps only the output and the per-query
log-sum-exp; the backward recomputes each visible tile's probabilities, accumulates dq
per q-tile and adds dk/dv into full-length buffers (in place inside the loop).

A query that sees no key (only the padding added here to fill the last tile) gets
output 0 and no gradient.
"""
from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_BLOCK = 512
_NEG_INF = -jnp.inf


def _pad_to(x, n, axis, mode="edge", value=0):
    pad = n - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    if mode == "edge":
        return jnp.pad(x, widths, mode="edge")
    return jnp.pad(x, widths, constant_values=value)


def _round_up(n, m):
    return -(-n // m) * m


def tile_visibility(q_index_BxT, q_segment_BxT, k_segment_BxS, k_end_BxS, block_q, block_k):
    """Bool [B, T/block_q, S/block_k]: may any query of the q-tile see any key of the k-tile.

    Inputs are already padded to whole tiles (padded keys have k_end 0, so they widen nothing).
    """
    b, t = q_index_BxT.shape
    s = k_end_BxS.shape[1]
    tq, tk = t // block_q, s // block_k
    qi = q_index_BxT.reshape(b, tq, block_q)
    qs = q_segment_BxT.reshape(b, tq, block_q)
    ke = k_end_BxS.reshape(b, tk, block_k)
    ks = k_segment_BxS.reshape(b, tk, block_k)
    real_k = ke > jnp.arange(s, dtype=ke.dtype).reshape(1, tk, block_k)  # a key seen by nobody widens nothing
    big = jnp.iinfo(jnp.int32).max
    k_start = jnp.arange(tk, dtype=jnp.int32) * block_k
    k_end_max = ke.max(-1)
    ks_min = jnp.where(real_k, ks, big).min(-1)
    ks_max = jnp.where(real_k, ks, -big).max(-1)
    vis = (
        (qi.max(-1)[:, :, None] >= k_start[None, None, :])
        & (qi.min(-1)[:, :, None] < k_end_max[:, None, :])
        & (qs.max(-1)[:, :, None] >= ks_min[:, None, :])
        & (qs.min(-1)[:, :, None] <= ks_max[:, None, :])
    )
    return vis


def _tile_lists(vis_BxQxK):
    """Per q-tile: the visible k-tile indices first (ascending), and how many there are."""
    order = jnp.argsort(~vis_BxQxK, axis=-1, stable=True).astype(jnp.int32)
    return order, vis_BxQxK.sum(-1).astype(jnp.int32)


def _tile_mask(qi_q, qs_q, ks_s, ke_s, k0, block_k):
    j = k0 + jnp.arange(block_k, dtype=jnp.int32)
    return (qs_q[:, None] == ks_s[None, :]) & (j[None, :] <= qi_q[:, None]) & (qi_q[:, None] < ke_s[None, :])


def _prepare(q, k, v, q_index, q_segment, k_segment, k_end, block_q, block_k):
    """Pad to whole tiles; queries by edge copy (outputs dropped), keys as never-visible."""
    t, s = q.shape[1], k.shape[1]
    bq, bk = min(block_q, t), min(block_k, s)
    tp, sp = _round_up(t, bq), _round_up(s, bk)
    q = _pad_to(q, tp, 1, mode="const")
    q_index = _pad_to(q_index.astype(jnp.int32), tp, 1)
    q_segment = _pad_to(q_segment.astype(jnp.int32), tp, 1)
    k = _pad_to(k, sp, 1, mode="const")
    v = _pad_to(v, sp, 1, mode="const")
    k_segment = _pad_to(k_segment.astype(jnp.int32), sp, 1, mode="const", value=-1)
    k_end = _pad_to(k_end.astype(jnp.int32), sp, 1, mode="const", value=0)
    return q, k, v, q_index, q_segment, k_segment, k_end, bq, bk


def _forward(q, k, v, q_index, q_segment, k_segment, k_end, bq, bk):
    """Padded inputs -> (out [B,T,N,H] in q's dtype, lse [B,T,K,G] f32), tile lists."""
    b, t, n, h = q.shape
    kv = k.shape[2]
    g = n // kv
    tq = t // bq
    scale = h**-0.5
    order, count = _tile_lists(tile_visibility(q_index, q_segment, k_segment, k_end, bq, bk))

    def one_q_tile(idx):
        bi, qt = idx // tq, idx % tq
        q0 = qt * bq
        q_t = jax.lax.dynamic_slice_in_dim(q[bi], q0, bq, 0).reshape(bq, kv, g, h)
        qi = jax.lax.dynamic_slice_in_dim(q_index[bi], q0, bq, 0)
        qs = jax.lax.dynamic_slice_in_dim(q_segment[bi], q0, bq, 0)

        def body(c, carry):
            m, l, acc = carry
            k0 = order[bi, qt, c] * bk
            k_t = jax.lax.dynamic_slice_in_dim(k[bi], k0, bk, 0)
            v_t = jax.lax.dynamic_slice_in_dim(v[bi], k0, bk, 0)
            mask = _tile_mask(
                qi, qs, jax.lax.dynamic_slice_in_dim(k_segment[bi], k0, bk, 0),
                jax.lax.dynamic_slice_in_dim(k_end[bi], k0, bk, 0), k0, bk,
            )
            s = jnp.einsum("qkgh,skh->kgqs", q_t, k_t, preferred_element_type=jnp.float32) * scale
            s = jnp.where(mask, s, _NEG_INF)
            m_new = jnp.maximum(m, s.max(-1))
            m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
            p = jnp.exp(s - m_safe[..., None])
            corr = jnp.exp(m - m_safe)
            l = l * corr + p.sum(-1)
            pv = jnp.einsum("kgqs,skh->kgqh", p.astype(v_t.dtype), v_t, preferred_element_type=jnp.float32)
            return m_new, l, acc * corr[..., None] + pv

        init = (
            jnp.full((kv, g, bq), _NEG_INF, jnp.float32),
            jnp.zeros((kv, g, bq), jnp.float32),
            jnp.zeros((kv, g, bq, h), jnp.float32),
        )
        m, l, acc = jax.lax.fori_loop(0, count[bi, qt], body, init)
        seen = l > 0
        out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
        # [K,G,bq,H] -> [bq,N,H]; lse [K,G,bq] -> [bq,K,G]
        return out.transpose(2, 0, 1, 3).reshape(bq, n, h).astype(q.dtype), lse.transpose(2, 0, 1)

    out, lse = jax.lax.map(one_q_tile, jnp.arange(b * tq, dtype=jnp.int32))
    return out.reshape(b, t, n, h), lse.reshape(b, t, kv, g), (order, count)


def _backward(q, k, v, q_index, q_segment, k_segment, k_end, bq, bk, out, lse, tiles, d_out):
    b, t, n, h = q.shape
    s_len, kv = k.shape[1], k.shape[2]
    g = n // kv
    tq = t // bq
    scale = h**-0.5
    order, count = tiles
    delta = jnp.einsum("btnh,btnh->btn", d_out.astype(jnp.float32), out.astype(jnp.float32)).reshape(b, t, kv, g)

    def one_q_tile(carry, idx):
        dk_full, dv_full = carry
        bi, qt = idx // tq, idx % tq
        q0 = qt * bq

        def sl(x, size=bq, start=q0):
            return jax.lax.dynamic_slice_in_dim(x[bi], start, size, 0)

        q_t = sl(q).reshape(bq, kv, g, h)
        do_t = sl(d_out).reshape(bq, kv, g, h)
        lse_t = sl(lse).transpose(1, 2, 0)  # [K,G,bq]
        dl_t = sl(delta).transpose(1, 2, 0)
        qi, qs = sl(q_index), sl(q_segment)

        def body(c, inner):
            dq, dk_full, dv_full = inner
            k0 = order[bi, qt, c] * bk
            k_t, v_t = sl(k, bk, k0), sl(v, bk, k0)
            mask = _tile_mask(qi, qs, sl(k_segment, bk, k0), sl(k_end, bk, k0), k0, bk)
            s = jnp.einsum("qkgh,skh->kgqs", q_t, k_t, preferred_element_type=jnp.float32) * scale
            p = jnp.where(mask, jnp.exp(s - lse_t[..., None]), 0.0)
            dv_t = jnp.einsum("kgqs,qkgh->skh", p.astype(do_t.dtype), do_t, preferred_element_type=jnp.float32)
            dp = jnp.einsum("qkgh,skh->kgqs", do_t, v_t, preferred_element_type=jnp.float32)
            ds = p * (dp - dl_t[..., None]) * scale
            dq = dq + jnp.einsum("kgqs,skh->qkgh", ds.astype(k_t.dtype), k_t, preferred_element_type=jnp.float32)
            dk_t = jnp.einsum("kgqs,qkgh->skh", ds.astype(q_t.dtype), q_t, preferred_element_type=jnp.float32)
            at = (bi, k0, 0, 0)
            dk_full = jax.lax.dynamic_update_slice(
                dk_full, (jax.lax.dynamic_slice(dk_full, at, (1, bk, kv, h))[0] + dk_t)[None], at
            )
            dv_full = jax.lax.dynamic_update_slice(
                dv_full, (jax.lax.dynamic_slice(dv_full, at, (1, bk, kv, h))[0] + dv_t)[None], at
            )
            return dq, dk_full, dv_full

        dq0 = jnp.zeros((bq, kv, g, h), jnp.float32)
        dq, dk_full, dv_full = jax.lax.fori_loop(0, count[bi, qt], body, (dq0, dk_full, dv_full))
        return (dk_full, dv_full), dq.reshape(bq, n, h)

    zeros = jnp.zeros((b, s_len, kv, h), jnp.float32)
    (dk, dv), dq = jax.lax.scan(one_q_tile, (zeros, zeros), jnp.arange(b * tq, dtype=jnp.int32))
    return dq.reshape(b, t, n, h).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


IMPLS = ("xla", "pallas", "pallas_interpret")  # pallas_interpret: the Pallas kernel run by the interpreter (CPU)


def _forward_any(q, k, v, q_index, q_segment, k_segment, k_end, bq, bk, impl):
    if impl == "xla":
        return _forward(q, k, v, q_index, q_segment, k_segment, k_end, bq, bk)
    from gyre_jax.model.tree_attention_pallas import pallas_forward  # pallas only when asked for

    tiles = _tile_lists(tile_visibility(q_index, q_segment, k_segment, k_end, bq, bk))
    out, lse = pallas_forward(q, k, v, q_index, q_segment, k_segment, k_end, *tiles, bq=bq, bk=bk,
                              interpret=impl == "pallas_interpret")
    return out, lse, tiles


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _tree_attention_padded(q, k, v, q_index, q_segment, k_segment, k_end, bq, bk, impl):
    out, _, _ = _forward_any(q, k, v, q_index, q_segment, k_segment, k_end, bq, bk, impl)
    return out


def _fwd(q, k, v, q_index, q_segment, k_segment, k_end, bq, bk, impl):
    out, lse, tiles = _forward_any(q, k, v, q_index, q_segment, k_segment, k_end, bq, bk, impl)
    return out, (q, k, v, q_index, q_segment, k_segment, k_end, out, lse, tiles)


def _bwd(bq, bk, impl, res, d_out):
    q, k, v, q_index, q_segment, k_segment, k_end, out, lse, tiles = res
    dq, dk, dv = _backward(q, k, v, q_index, q_segment, k_segment, k_end, bq, bk, out, lse, tiles, d_out)
    return dq, dk, dv, None, None, None, None


_tree_attention_padded.defvjp(_fwd, _bwd)


def tree_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, q_index_BxT, q_segment_BxT, k_segment_BxS, k_end_BxS,
                   *, block_q: int = DEFAULT_BLOCK, block_k: int = DEFAULT_BLOCK, impl: str = "xla"):
    """GQA attention under the tree rule above, blockwise; returns [B, T, N, H] in q's dtype.

    Differentiable in q, k, v (custom VJP with recompute); the integer metadata is not.
    ``impl``: "xla" (pure JAX, the reference path), "pallas" (tree_attention_pallas.py's
    forward kernel; the backward is the same recompute), "pallas_interpret" (that kernel
    in Pallas interpret mode, on CPU).
    """
    if impl not in IMPLS:
        raise ValueError(f"tree_attention: impl must be one of {IMPLS}, got {impl!r}")
    b, t, n, h = q_BxTxNxH.shape
    if n % k_BxSxKxH.shape[2]:
        raise ValueError(f"tree_attention: {n} query heads is not a multiple of {k_BxSxKxH.shape[2]} k/v heads")
    if block_q <= 0 or block_k <= 0:
        raise ValueError(f"tree_attention: block sizes must be positive, got block_q={block_q} block_k={block_k}")
    args = _prepare(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, q_index_BxT, q_segment_BxT, k_segment_BxS, k_end_BxS,
                    block_q, block_k)
    return _tree_attention_padded(*args, impl)[:, :t]


def packed_tree_attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, segment_ids_BxL, subtree_end_BxL, **blocks):
    """Self-attention of packed tree rows (training/scoring): the rule of ``tree_attention_mask``."""
    b, length = segment_ids_BxL.shape
    q_index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    return tree_attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, q_index, segment_ids_BxL, segment_ids_BxL,
                          subtree_end_BxL, **blocks)


def causal_cache_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, q_index_BxT, **blocks):
    """Queries against a linear KV cache: query t sees cache entries 0..q_index[t] (prefill, decode)."""
    b, s = k_BxSxKxH.shape[:2]
    ones_q = jnp.ones(q_index_BxT.shape, jnp.int32)
    ones_k = jnp.ones((b, s), jnp.int32)
    return tree_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, q_index_BxT, ones_q, ones_k,
                          jnp.full((b, s), s, jnp.int32), **blocks)


def tile_fractions_np(segment_ids_L, subtree_end_L, block_q, block_k):
    """Host-side (numpy) tile statistics of one packed row, from O(L) metadata only.

    Returns (skipped, masked): the fraction of (q-tile, k-tile) pairs the visibility
    table skips, and the fraction whose exact tree mask is all False (computed per
    tile pair via each key's query interval, never an [L, L] mask).
    """
    seg = np.asarray(segment_ids_L, np.int64)
    end = np.asarray(subtree_end_L, np.int64)
    length = len(seg)
    lq, lk = _round_up(length, block_q), _round_up(length, block_k)
    vis = np.asarray(tile_visibility(
        jnp.asarray(np.pad(np.arange(length), (0, lq - length), mode="edge"), jnp.int32)[None],
        jnp.asarray(np.pad(seg, (0, lq - length), mode="edge"), jnp.int32)[None],
        jnp.asarray(np.pad(seg, (0, lk - length), constant_values=-1), jnp.int32)[None],
        jnp.asarray(np.pad(end, (0, lk - length)), jnp.int32)[None],
        block_q, block_k,
    ))[0]
    tq, tk = lq // block_q, lk // block_k
    # Exact: key j is seen by queries [j, end_j) of its own segment; mark every q-tile those cover.
    any_visible = np.zeros((tq, tk), bool)
    j = np.arange(length)
    lo_tile = j // block_q
    hi_tile = (np.minimum(end, length) - 1) // block_q  # end_j > j always for real keys
    for kt in range(tk):
        sl = slice(kt * block_k, min((kt + 1) * block_k, length))
        diff = np.zeros(tq + 1, np.int64)
        np.add.at(diff, lo_tile[sl], 1)
        np.add.at(diff, hi_tile[sl] + 1, -1)
        any_visible[:, kt] = np.cumsum(diff)[:tq] > 0
    return float(1.0 - vis.mean()), float(1.0 - any_visible.mean())


@flax.struct.dataclass
class TreeMask:
    """The tree rule of packed rows as O(L) metadata: what ``attend`` takes instead of a dense mask."""

    segment_ids: jax.Array  # int32[B, L]
    subtree_end: jax.Array  # int32[B, L]
    block_q: int = flax.struct.field(pytree_node=False, default=DEFAULT_BLOCK)
    block_k: int = flax.struct.field(pytree_node=False, default=DEFAULT_BLOCK)
    impl: str = flax.struct.field(pytree_node=False, default="xla")  # one of IMPLS
    # Context parallelism: the rows' sequence axis is split over this axis of the mesh set
    # with ``jax.set_mesh`` (context_parallel.py); None = one device holds whole rows.
    context_axis: str | None = flax.struct.field(pytree_node=False, default=None)


@flax.struct.dataclass
class CacheMask:
    """Queries against a linear KV cache: query t sees entries 0..q_index[t] (O(T) metadata)."""

    q_index: jax.Array  # int32[B, T]: each query's own cache index
    block_q: int = flax.struct.field(pytree_node=False, default=DEFAULT_BLOCK)
    block_k: int = flax.struct.field(pytree_node=False, default=DEFAULT_BLOCK)
    impl: str = flax.struct.field(pytree_node=False, default="xla")  # one of IMPLS
