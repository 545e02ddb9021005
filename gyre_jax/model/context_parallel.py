"""Context parallelism: one packed row spread over a mesh axis along its sequence.

Each device holds L/P consecutive tokens of every row (queries, keys, values and the
tree metadata). Inside ``shard_map`` every device all-gathers the keys, values and key
metadata (O(L) per device: k/v are [L, K, H], far smaller than activations of a
[L, L] score) and runs the blockwise tree attention of its own queries against the
whole row, with their global indices; tile skipping is unchanged (a device's q-tiles
see only the k-tiles the tree lets them). The backward of the all-gather is a
reduce-scatter, so dk/dv land back on the device that owns each key.

Exact: every query sees exactly the keys it sees on one device, in the same tile
order, so results equal the single-device blockwise attention.

In the model: ModelConfig.context_parallel_axis names the mesh axis; run the step under
``jax.set_mesh(mesh)`` with the rows' [B, L] inputs sharded along L on that axis.

Balance: with a DFS row, later shards see more keys (causal-like); a zig-zag layout
would even that out and is not done here.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gyre_jax.model.tree_attention import DEFAULT_BLOCK, tree_attention


def context_parallel_tree_attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, segment_ids_BxL, subtree_end_BxL, *,
                                    mesh, axis: str, batch_axes=None, block_q: int = DEFAULT_BLOCK,
                                    block_k: int = DEFAULT_BLOCK, impl: str = "xla"):
    """Packed-row tree attention with the sequence axis split over ``mesh`` axis ``axis``.

    ``batch_axes``: mesh axes the rows (B) are split over, or None. L must be a multiple
    of the axis size. Returns [B, L, N, H], sequence-sharded like q.
    """
    n_shards = mesh.shape[axis]
    length = segment_ids_BxL.shape[1]
    if length % n_shards:
        raise ValueError(f"context_parallel_tree_attention: row length {length} is not a multiple of the "
                         f"{n_shards} devices of mesh axis {axis!r}")
    seq4 = P(batch_axes, axis, None, None)
    seq2 = P(batch_axes, axis)

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(seq4, seq4, seq4, seq2, seq2), out_specs=seq4,
                       check_vma=False)
    def local(q, k, v, seg, end):
        shard_len = q.shape[1]
        offset = jax.lax.axis_index(axis) * shard_len
        k_all = jax.lax.all_gather(k, axis, axis=1, tiled=True)
        v_all = jax.lax.all_gather(v, axis, axis=1, tiled=True)
        seg_all = jax.lax.all_gather(seg, axis, axis=1, tiled=True)
        end_all = jax.lax.all_gather(end, axis, axis=1, tiled=True)
        q_index = jnp.broadcast_to(offset + jnp.arange(shard_len, dtype=jnp.int32), seg.shape)
        return tree_attention(q, k_all, v_all, q_index, seg, seg_all, end_all, block_q=block_q, block_k=block_k,
                              impl=impl)

    return local(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, segment_ids_BxL.astype(jnp.int32),
                 subtree_end_BxL.astype(jnp.int32))
