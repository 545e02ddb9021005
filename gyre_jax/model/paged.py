"""Paged KV cache: fixed-size pages, a page table per sequence, attention by gather.

Shapes: Y layers, K k/v heads, NP pages in the pool, G tokens per page, H head_dim,
B (or S) sequences, PPS page-table entries per sequence (max_len = PPS * G), N query heads.

Pages are laid out [K, NP, G, H] per layer, the layout of JAX's Pallas paged-attention
kernels (``jax.experimental.pallas.ops.{gpu,tpu}``), so they read the pool in place.
Token ``p`` of sequence ``b`` lives at page ``page_table[b, p // G]``, row ``p % G``.
Page 0 is the trash page: never handed to a sequence, the target of every write a
sequence may not make (an unallocated table entry is 0, so a finished or empty slot's
dummy decode write lands there and nowhere that anyone reads unmasked).

``paged_attention`` runs one query per sequence over its first ``lengths[b]`` tokens:
  * "xla" (CPU, tests): gather the sequence's pages into a contiguous buffer and run the
    very same ``attend`` a contiguous cache runs, so decode equals today's cache;
  * "pallas" on GPU / TPU: JAX's Pallas paged-attention kernel (reads only live pages);
  * "pallas_interpret": the GPU kernel in Pallas interpret mode (runs on CPU; tests).
The TPU kernel casts k/v to bfloat16 inside (its ``_maybe_dequantize``), so it equals
the plain version only on bfloat16-exact pages; tests check it that way.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from gyre_jax.model.attend import attend
from gyre_jax.model.tree_attention import CacheMask

TRASH_PAGE = 0
PAGED_IMPLS = ("xla", "pallas", "pallas_interpret")


@flax.struct.dataclass
class PagedMask:
    """What a paged decode step passes as ``mask``: where each sequence's tokens live.

    The new token of sequence b sits at ``cache_index[b]`` and sees tokens 0..cache_index[b].
    """

    page_table: jax.Array  # int32[B, PPS]
    impl: str = flax.struct.field(pytree_node=False, default="xla")  # one of PAGED_IMPLS
    block_q: int = flax.struct.field(pytree_node=False, default=512)  # the "xla" path's blockwise tiles
    block_k: int = flax.struct.field(pytree_node=False, default=512)
    blockwise: bool = flax.struct.field(pytree_node=False, default=True)  # False: dense mask (attention_impl)


def page_slots(page_table_BxP, pos_BxT, page_size: int, writable_from_B=None):
    """(page, row) of each token position; positions before ``writable_from`` (shared pages)
    or past the table go to the trash page."""
    pps = page_table_BxP.shape[1]
    idx_BxT = pos_BxT // page_size
    page_BxT = jnp.take_along_axis(page_table_BxP, jnp.clip(idx_BxT, 0, pps - 1), axis=1)
    ok_BxT = idx_BxT < pps
    if writable_from_B is not None:
        ok_BxT = ok_BxT & (pos_BxT >= writable_from_B[:, None])
    return jnp.where(ok_BxT, page_BxT, TRASH_PAGE), pos_BxT % page_size


def write_pages(pages_KxPxGxH, new_BxTxKxH, page_BxT, row_BxT):
    """Scatter each sequence's T new k (or v) rows into their pages."""
    vals_KxBxTxH = jnp.transpose(new_BxTxKxH, (2, 0, 1, 3)).astype(pages_KxPxGxH.dtype)
    return pages_KxPxGxH.at[:, page_BxT, row_BxT].set(vals_KxBxTxH)


def gather_pages(pages_KxPxGxH, page_table_BxP):
    """The contiguous [B, PPS * G, K, H] view of each sequence's pages (a copy)."""
    k, _, g, h = pages_KxPxGxH.shape
    b, pps = page_table_BxP.shape
    x_KxBxPxGxH = pages_KxPxGxH[:, page_table_BxP]
    return jnp.transpose(x_KxBxPxGxH, (1, 2, 3, 0, 4)).reshape(b, pps * g, k, h)


def paged_attention(q_BxNxH, k_pages_KxPxGxH, v_pages_KxPxGxH, page_table_BxP, lengths_B, *, impl: str = "xla",
                    block_q: int = 512, block_k: int = 512, blockwise: bool = True):
    """Softmax attention of one query per sequence over its first ``lengths[b]`` tokens
    (float32 softmax, GQA, scaled by H**-0.5 like ``attention.attend``). Returns [B, N, H].
    Every sequence needs lengths >= 1 (a decode step always sees its own token)."""
    if impl not in PAGED_IMPLS:
        raise ValueError(f"paged_attention: impl must be one of {PAGED_IMPLS}, got {impl!r}")
    b, n, h = q_BxNxH.shape
    if impl == "xla":
        k_BxSxKxH = gather_pages(k_pages_KxPxGxH, page_table_BxP)
        v_BxSxKxH = gather_pages(v_pages_KxPxGxH, page_table_BxP)
        s = k_BxSxKxH.shape[1]
        q_index_Bx1 = (lengths_B - 1)[:, None].astype(jnp.int32)
        if blockwise:
            mask = CacheMask(q_index_Bx1, block_q=block_q, block_k=block_k)
        else:
            mask = jnp.arange(s, dtype=jnp.int32)[None, None, :] <= q_index_Bx1[:, :, None]
        return attend(q_BxNxH[:, None], k_BxSxKxH.astype(q_BxNxH.dtype), v_BxSxKxH.astype(q_BxNxH.dtype), mask)[:, 0]
    # The kernels take q pre-scaled (neither scales the logits) and attend to index < length.
    q = (q_BxNxH.astype(jnp.float32) * (h**-0.5)).astype(q_BxNxH.dtype)
    pps = page_table_BxP.shape[1]
    platform = jax.default_backend()
    if impl == "pallas" and platform == "tpu":
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged

        return tpu_paged(q, k_pages_KxPxGxH, v_pages_KxPxGxH, lengths_B.astype(jnp.int32), page_table_BxP,
                         pages_per_compute_block=_largest_divisor(pps, 8))
    if impl == "pallas" and platform != "gpu":
        raise ValueError(f"paged_attention: impl='pallas' needs a GPU or TPU backend, this is {platform!r} "
                         f"(use 'xla', or 'pallas_interpret' to run the GPU kernel interpreted)")
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as gpu_paged

    k_splits = _largest_divisor(pps, 16)
    return gpu_paged(q, k_pages_KxPxGxH, v_pages_KxPxGxH, page_table_BxP, lengths_B.astype(jnp.int32),
                     k_splits=k_splits, pages_per_compute_block=_largest_divisor(pps // k_splits, 8),
                     interpret=impl == "pallas_interpret")


def _largest_divisor(n: int, at_most: int) -> int:
    """Largest power of two <= at_most dividing n (the kernels' block counts must divide)."""
    d = 1
    while d * 2 <= at_most and n % (d * 2) == 0:
        d *= 2
    return d
