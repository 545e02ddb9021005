"""Softmax attention, the one function every attention path ends in: over a dense mask, or
over a structured one (``TreeMask`` / ``CacheMask``, tree_attention.py: blockwise, and across
a context-parallel mesh axis when the mask names one).

Its own module, below attention.py, paged.py and context_parallel.py, so that each of them
can call it without importing another.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from gyre_jax.model.context_parallel import context_parallel_tree_attention
from gyre_jax.model.tree_attention import CacheMask, TreeMask, causal_cache_attention, packed_tree_attention


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


def attend_structured(q, k, v, mask):
    """Blockwise attention for a TreeMask or CacheMask (``attend`` dispatches here)."""
    blocks = dict(block_q=mask.block_q, block_k=mask.block_k, impl=mask.impl)
    if isinstance(mask, TreeMask) and mask.context_axis is not None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or mask.context_axis not in mesh.axis_names:
            raise ValueError(f"context_axis={mask.context_axis!r}: run the model under jax.set_mesh(mesh) with a "
                             f"mesh that has that axis (current mesh axes: {mesh.axis_names})")
        return context_parallel_tree_attention(q, k, v, mask.segment_ids, mask.subtree_end, mesh=mesh,
                                               axis=mask.context_axis, **blocks)
    if isinstance(mask, TreeMask):
        return packed_tree_attention(q, k, v, mask.segment_ids, mask.subtree_end, **blocks)
    return causal_cache_attention(q, k, v, mask.q_index, **blocks)
