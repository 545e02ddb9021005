"""Blockwise tree attention = dense reference = float64 per-path numpy, forward and gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gyre_jax.model.attention import attend, tree_attention_mask
from gyre_jax.model.tree_attention import (
    causal_cache_attention,
    packed_tree_attention,
    tile_fractions_np,
    tile_visibility,
)
from gyre_jax.trajectory.serialize import pack_rows, serialize_tree, tree_attention_mask_np
from tests.test_serialize import random_tree

TOL = 1e-5
N_HEADS, K_HEADS, HEAD_DIM = 4, 2, 8


def random_rows(seed, row_len=150, batch=2):
    """Rows of several random trees (branches inside outputs; extra trees = sub-agent roots) + padding."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(batch):
        trees, used = [], 0
        while True:
            t = serialize_tree(random_tree(rng, max_depth=4))
            if used + len(t) > row_len - 5:
                break
            trees.append(t)
            used += len(t)
        rows.append(trees)
    packed = pack_rows(rows, row_len)
    assert packed.segment_ids.max() >= 2  # several trees per row
    return packed.segment_ids, packed.subtree_end


def qkv(seed, b, t, s):
    r = np.random.default_rng(seed)
    q = r.standard_normal((b, t, N_HEADS, HEAD_DIM))
    k = r.standard_normal((b, s, K_HEADS, HEAD_DIM))
    v = r.standard_normal((b, s, K_HEADS, HEAD_DIM))
    d_out = r.standard_normal((b, t, N_HEADS, HEAD_DIM))
    return q, k, v, d_out


def np_reference(q, k, v, mask, d_out):
    """float64, one query at a time over exactly its visible keys: (out, dq, dk, dv) of sum(out * d_out)."""
    b, t, n, h = q.shape
    g = n // k.shape[2]
    out, dq = np.zeros_like(q), np.zeros_like(q)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    for bi in range(b):
        for i in range(t):
            js = np.flatnonzero(mask[bi, i])
            for hd in range(n):
                kh = hd // g
                kk, vv = k[bi, js, kh], v[bi, js, kh]
                s = kk @ q[bi, i, hd] / np.sqrt(h)
                p = np.exp(s - s.max())
                p /= p.sum()
                out[bi, i, hd] = p @ vv
                do = d_out[bi, i, hd]
                dp = vv @ do
                ds = p * (dp - p @ dp) / np.sqrt(h)
                dq[bi, i, hd] = ds @ kk
                dk[bi, js, kh] += ds[:, None] * q[bi, i, hd][None]
                dv[bi, js, kh] += p[:, None] * do[None]
    return out, dq, dk, dv


def _value_and_grads(fn, q, k, v, d_out):
    def loss(q, k, v):
        o = fn(q, k, v)
        return jnp.sum(o * d_out), o

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return [np.asarray(x) for x in (out, *grads)]


@pytest.mark.parametrize("block_q,block_k", [(16, 32), pytest.param(32, 16, marks=pytest.mark.slow)])
def test_blockwise_equals_dense_and_float64_on_random_trees(block_q, block_k):
    seg, sub = random_rows(0)
    b, length = seg.shape
    q, k, v, d_out = qkv(1, b, length, length)
    mask = tree_attention_mask_np(seg, sub)
    ref = np_reference(q, k, v, mask, d_out)
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v, d_out)]
    seg_j, sub_j = jnp.asarray(seg), jnp.asarray(sub)

    blockwise = jax.jit(lambda q, k, v: packed_tree_attention(q, k, v, seg_j, sub_j, block_q=block_q,
                                                              block_k=block_k))
    dense = jax.jit(lambda q, k, v: attend(q, k, v, tree_attention_mask(seg_j, sub_j)))
    got = _value_and_grads(blockwise, *f32)
    want = _value_and_grads(dense, *f32)
    for name, g, w, r in zip(("out", "dq", "dk", "dv"), got, want, ref):
        np.testing.assert_allclose(g, r, atol=TOL, rtol=TOL, err_msg=f"{name} vs float64")
        np.testing.assert_allclose(g, w, atol=TOL, rtol=TOL, err_msg=f"{name} vs dense")


def test_cache_attention_equals_dense_prefix_mask():
    """Prefill with a prefix / decode: queries at cache index start+t see entries 0..start+t."""
    b, t, s = 2, 24, 80
    q, k, v, d_out = qkv(2, b, t, s)
    q_index = np.stack([np.arange(t) + 10, np.arange(t) + 50]).astype(np.int32)  # two slots, two fills
    mask = np.arange(s)[None, None, :] <= q_index[:, :, None]
    ref = np_reference(q, k, v, mask, d_out)
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v, d_out)]
    got = _value_and_grads(
        jax.jit(lambda q, k, v: causal_cache_attention(q, k, v, jnp.asarray(q_index), block_q=8, block_k=16)), *f32
    )
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
        np.testing.assert_allclose(g, r, atol=TOL, rtol=TOL, err_msg=name)


def test_skipped_tiles_are_exactly_the_masked_tiles():
    seg, sub = random_rows(3, row_len=256, batch=1)
    block = 16
    skipped, masked = tile_fractions_np(seg[0], sub[0], block, block)
    mask = tree_attention_mask_np(seg[0], sub[0])
    tiles_masked = ~mask.reshape(16, block, 16, block).any(axis=(1, 3))
    assert masked == pytest.approx(tiles_masked.mean())
    assert skipped == pytest.approx(masked)
    assert 0.3 < skipped < 1.0  # causal alone masks ~47% of 16x16 tiles; trees mask more
    vis = np.asarray(tile_visibility(jnp.arange(256)[None], jnp.asarray(seg), jnp.asarray(seg),
                                     jnp.asarray(sub), block, block))[0]
    np.testing.assert_array_equal(vis, ~tiles_masked)


def test_pallas_kernel_in_interpret_mode_equals_reference():
    """The Pallas forward kernel (run by the Pallas interpreter on CPU) = the pure-JAX path, with gradients."""
    seg, sub = random_rows(7, row_len=80, batch=2)
    b, length = seg.shape
    f32 = [jnp.asarray(x, jnp.float32) for x in qkv(8, b, length, length)]
    seg_j, sub_j = jnp.asarray(seg), jnp.asarray(sub)

    def fn(impl):
        return jax.jit(lambda q, k, v: packed_tree_attention(q, k, v, seg_j, sub_j, block_q=16, block_k=32,
                                                             impl=impl))

    got = _value_and_grads(fn("pallas_interpret"), *f32)
    want = _value_and_grads(fn("xla"), *f32)
    ref = np_reference(*(np.asarray(x, np.float64) for x in f32[:3]), tree_attention_mask_np(seg, sub),
                       np.asarray(f32[3], np.float64))
    for name, g, w, r in zip(("out", "dq", "dk", "dv"), got, want, ref):
        np.testing.assert_allclose(g, w, atol=TOL, rtol=TOL, err_msg=f"{name} vs xla")
        np.testing.assert_allclose(g, r, atol=TOL, rtol=TOL, err_msg=f"{name} vs float64")
