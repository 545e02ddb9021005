"""Pallas forward kernel of blockwise tree attention (``tree_attention(..., impl="pallas")``).

One program per (row, q-tile): it walks only the visible k-tiles of its q-tile (the
same tile list as the pure-JAX path), computing each tile's mask from the segment ids
and subtree ends inside the kernel, with an online softmax; it writes the output and
the per-query log-sum-exp, so the backward is the reference recompute backward
(tree_attention._backward). K/V of the row stay whole in the kernel's memory space and
tiles are read with dynamic slices.

Tested here on CPU in Pallas interpret mode against the pure-JAX reference. It has NOT
been compiled or run on a GPU (Triton) or TPU (Mosaic): no accelerator is available in
this environment, and those lowerings add layout rules (2-D dots, tile multiples of
8x128 on TPU) this kernel has not been checked against.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def _kernel(order_ref, count_ref, q_ref, qi_ref, qs_ref, k_ref, v_ref, ks_ref, ke_ref, o_ref, lse_ref, *,
            bk, kv, g, h, scale):
    bq = q_ref.shape[1]
    q_t = q_ref[0].reshape(bq, kv, g, h)
    qi = qi_ref[0]
    qs = qs_ref[0]

    def body(c, carry):
        m, l, acc = carry
        k0 = order_ref[0, 0, c] * bk
        k_t = k_ref[0, pl.ds(k0, bk)]
        v_t = v_ref[0, pl.ds(k0, bk)]
        ks = ks_ref[0, pl.ds(k0, bk)]
        ke = ke_ref[0, pl.ds(k0, bk)]
        j = k0 + jnp.arange(bk, dtype=jnp.int32)
        mask = (qs[:, None] == ks[None, :]) & (j[None, :] <= qi[:, None]) & (qi[:, None] < ke[None, :])
        s = jnp.einsum("qkgh,skh->kgqs", q_t, k_t, preferred_element_type=jnp.float32) * scale
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe[..., None])
        corr = jnp.exp(m - m_safe)
        pv = jnp.einsum("kgqs,skh->kgqh", p.astype(v_t.dtype), v_t, preferred_element_type=jnp.float32)
        return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

    init = (jnp.full((kv, g, bq), -jnp.inf, jnp.float32), jnp.zeros((kv, g, bq), jnp.float32),
            jnp.zeros((kv, g, bq, h), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, count_ref[0, 0], body, init)
    seen = l > 0
    safe_l = jnp.where(seen, l, 1.0)
    out = jnp.where(seen[..., None], acc / safe_l[..., None], 0.0)
    o_ref[0] = out.transpose(2, 0, 1, 3).reshape(bq, kv * g, h).astype(o_ref.dtype)
    lse_ref[0] = jnp.where(seen, m + jnp.log(safe_l), jnp.inf).transpose(2, 0, 1)


@functools.partial(jax.jit, static_argnames=("bq", "bk", "interpret"))
def pallas_forward(q, k, v, q_index, q_segment, k_segment, k_end, order, count, *, bq, bk, interpret):
    """Padded inputs (as tree_attention._prepare gives) -> (out [B,T,N,H], lse [B,T,K,G] f32)."""
    b, t, n, h = q.shape
    s_len, kv = k.shape[1], k.shape[2]
    g = n // kv
    tq, tk = t // bq, s_len // bk
    kernel = functools.partial(_kernel, bk=bk, kv=kv, g=g, h=h, scale=h**-0.5)
    row = lambda bi, qt: (bi, 0)  # noqa: E731 - whole-row blocks
    return pl.pallas_call(
        kernel,
        grid=(b, tq),
        in_specs=[
            pl.BlockSpec((1, 1, tk), lambda bi, qt: (bi, qt, 0)),  # order: visible k-tiles first
            pl.BlockSpec((1, 1), lambda bi, qt: (bi, qt)),  # count of visible k-tiles
            pl.BlockSpec((1, bq, n, h), lambda bi, qt: (bi, qt, 0, 0)),
            pl.BlockSpec((1, bq), lambda bi, qt: (bi, qt)),
            pl.BlockSpec((1, bq), lambda bi, qt: (bi, qt)),
            pl.BlockSpec((1, s_len, kv, h), lambda bi, qt: (bi, 0, 0, 0)),
            pl.BlockSpec((1, s_len, kv, h), lambda bi, qt: (bi, 0, 0, 0)),
            pl.BlockSpec((1, s_len), row),
            pl.BlockSpec((1, s_len), row),
        ],
        out_specs=[
            pl.BlockSpec((1, bq, n, h), lambda bi, qt: (bi, qt, 0, 0)),
            pl.BlockSpec((1, bq, kv, g), lambda bi, qt: (bi, qt, 0, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct((b, t, n, h), q.dtype), jax.ShapeDtypeStruct((b, t, kv, g), jnp.float32)],
        interpret=interpret,
    )(order, count, q, q_index, q_segment, k, v, k_segment, k_end)
