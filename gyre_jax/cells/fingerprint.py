"""A hash of a params pytree, computed where the params live: equal params, equal hash, bit for bit.

``params_hash(params) -> str`` (16 hex digits) names a policy version in metrics.jsonl, so a
resumed run's replayed versions can be checked against the crashed run's (docs/design.md, "The
resume protocol") without copying the model to the host: each leaf's bits (as unsigned ints of
its width) are summed on its devices in uint32, weighted by odd multipliers of the element's
index, in two independent lanes. Integer sums do not depend on order, so the hash does not depend
on the sharding, the device count or the reduction tree; any single changed element changes a
lane (an odd weight times a nonzero difference is nonzero mod 2**32). The lanes of every leaf,
with the tree's paths, shapes and dtypes, are then hashed with SHA-256 on the host (a few bytes).
Not a cryptographic hash of the params: a fingerprint for "same or not".
"""
from __future__ import annotations

import hashlib
import struct

import jax
import jax.numpy as jnp
import numpy as np

_M1, _A1 = np.uint32(0x9E3779B1), np.uint32(0x7F4A7C15)
_M2, _A2 = np.uint32(0x85EBCA77), np.uint32(0xC2B2AE3D)
_UINT_OF_WIDTH = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _bits_u32(x: jax.Array) -> jax.Array:
    """The leaf's bits as uint32 (each 8-byte element as two)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    width = jnp.dtype(x.dtype).itemsize
    if width == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)  # [..., 2]
    return jax.lax.bitcast_convert_type(x, _UINT_OF_WIDTH[width]).astype(jnp.uint32)


def _lanes(x: jax.Array) -> jax.Array:
    u = _bits_u32(x).reshape(-1)
    i = jnp.arange(u.shape[0], dtype=jnp.uint32)
    w1 = (i * _M1 + _A1) | np.uint32(1)
    w2 = (i * _M2 + _A2) | np.uint32(1)
    rot = (u << np.uint32(13)) | (u >> np.uint32(19))
    return jnp.stack([jnp.sum(u * w1, dtype=jnp.uint32), jnp.sum((rot ^ i) * w2, dtype=jnp.uint32)])


@jax.jit
def _all_lanes(leaves):
    return [_lanes(x) for x in leaves]


def params_hash(params) -> str:
    """16 hex digits naming ``params`` exactly (module docstring). Blocks until the params are computed."""
    paths_leaves = jax.tree_util.tree_leaves_with_path(params)
    leaves = [leaf for _, leaf in paths_leaves]
    lanes = jax.device_get(_all_lanes(leaves))
    h = hashlib.sha256()
    for (path, leaf), lane in zip(paths_leaves, lanes):
        h.update(jax.tree_util.keystr(path).encode())
        h.update(f"{tuple(leaf.shape)}{jnp.dtype(leaf.dtype).name}".encode())
        h.update(struct.pack("<2I", *(int(v) for v in np.asarray(lane))))
    return h.hexdigest()[:16]
