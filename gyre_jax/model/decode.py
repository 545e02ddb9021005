"""Functional KV-cache decoding: the device half of a JetStream-style engine.

Shapes: Y layers, S cache slots (concurrent sequences), M max cache length per
slot, K k/v heads, H head_dim, T prompt tokens, P prefix buffer length, V vocab.

    cache = init_cache(cfg, batch_slots=S, max_len=M)        # KVCache, all slots empty
    logits_V, kv = prefill(params, cfg, prompt_T)            # kv.k, kv.v: [Y, T, K, H]
    cache = insert(cache, kv, slot=3)                        # slot 3 holds T tokens
    logits_SxV, cache = decode_step(params, cfg, tokens_S, cache)  # one token per slot

Prefix reuse: ``prefill(..., prefix=kv_of_prefix, start_pos=p)`` computes only
the new tokens, attending to the first ``p`` entries of ``prefix`` (a buffer of
any static length P >= p, e.g. ``slot_kv(cache, slot)``); positions of the new
tokens start at p. Insert the prefix and the new tokens (``start=p``) to decode.

All functions are pure and jittable with static shapes; ``config`` is hashable,
so ``jax.jit(decode_step, static_argnums=1, donate_argnames="cache")`` works.
Position of a token = its index in its slot (one sequence per slot).

Layout: a cache holds one k and one v array per layer (tuples of Y arrays), so a decode step
reads and writes each layer's buffer in place; ``prefill`` and ``KV`` blocks keep the stacked
[Y, T, K, H] form. Every function takes params as ``init_params`` gives them or as
``unrolled.split_params(config, params)`` (what a server holds: a decode step over stacked
params splits them on every call, a copy of the weights per call; unrolled.py says why).

Paged cache (paged.py): the same decode over a pool of fixed-size pages, where a slot
holds only the pages its tokens fill (the host hands them out; serving/pages.py):

    cache = init_paged_cache(cfg, batch_slots=S, num_pages=NP, page_size=G, max_len=M)
    cache = set_page_rows(cache, table_SxPPS)                # the host's page tables
    cache = insert_paged(cache, kv, slot=3, length=T)        # scatter into slot 3's pages
    logits_SxV, cache = paged_decode_step(params, cfg, tokens_S, cache)  # equals decode_step
"""
from __future__ import annotations

import functools
from typing import cast

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from gyre_jax.model.config import ModelConfig
from gyre_jax.model.paged import PagedMask, gather_pages, page_slots  # noqa: F401 - gather_pages re-exported
from gyre_jax.model.transformer import Transformer, cache_mask
from gyre_jax.model.unrolled import LayerParams, forward_layers, split_params


@flax.struct.dataclass
class KV:
    """Keys and values of a run of tokens, all layers: k, v [Y, T, K, H]."""

    k: jax.Array
    v: jax.Array


@flax.struct.dataclass
class KVCache:
    k: tuple  # Y arrays [S, M, K, H], one per layer
    v: tuple  # Y arrays [S, M, K, H]
    lengths: jax.Array  # int32[S]: tokens held per slot = position of the slot's next token

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[0]


def init_cache(config: ModelConfig, batch_slots: int, max_len: int | None = None, dtype=None) -> KVCache:
    """Empty cache of ``batch_slots`` slots, each ``max_len`` (default config.max_seq_len) long."""
    m = config.max_seq_len if max_len is None else max_len
    if batch_slots <= 0 or m <= 0:
        raise ValueError(f"init_cache: batch_slots ({batch_slots}) and max_len ({m}) must be positive")
    shape = (batch_slots, m, config.n_kv_heads, config.head_dim)
    dt = config.jnp_dtype if dtype is None else dtype
    zeros = tuple(jnp.zeros(shape, dt) for _ in range(config.n_layers))
    return KVCache(k=zeros, v=tuple(jnp.zeros(shape, dt) for _ in range(config.n_layers)),
                   lengths=jnp.zeros((batch_slots,), jnp.int32))


def _with_cache(config: ModelConfig, params, tokens_BxT, positions_BxT, mask, k, v, cache_index_B,
                routing_BxTxR=None, adapter_BxT=None):
    """``Transformer.with_cache`` for any params form and k/v either per-layer tuples (a cache: the
    unrolled forward) or stacked [Y, B, P, K, H] (a prefill buffer: returned stacked).
    ``routing_BxTxR``: recorded experts to replay (``forward_layers``; the stacked form needs params
    split per layer or splits them). ``adapter_BxT``: several LoRA adapters: each token's (model/lora.py)."""
    if isinstance(k, tuple):
        lp = params if isinstance(params, LayerParams) else split_params(config, params)
        return forward_layers(config, lp, tokens_BxT, positions_BxT, mask, k, v, cache_index_B,
                              routing_BxTxR=routing_BxTxR, adapter_BxT=adapter_BxT)
    if isinstance(params, LayerParams) or routing_BxTxR is not None:
        lp = params if isinstance(params, LayerParams) else split_params(config, params)
        y = config.n_layers
        logits, (ks, vs) = forward_layers(config, lp, tokens_BxT, positions_BxT, mask,
                                          tuple(k[i] for i in range(y)), tuple(v[i] for i in range(y)), cache_index_B,
                                          routing_BxTxR=routing_BxTxR, adapter_BxT=adapter_BxT)
        return logits, (jnp.stack(ks), jnp.stack(vs))
    out = Transformer(config).apply(params, tokens_BxT, positions_BxT, mask, k, v, cache_index_B, adapter_BxT,
                                    method=Transformer.with_cache)
    return cast(tuple[jax.Array, tuple[jax.Array, jax.Array]], out)  # no mutable collections (flax types apply() loosely)


def _decode_apply(config: ModelConfig, params, with_routing: bool, tokens_BxT, positions_BxT, mask, k: tuple,
                  v: tuple, cache_index_B, adapter_BxT=None):
    """``with_cache`` for one token per slot over a per-layer cache: (logits, (k, v), routing_SxR int32 or None).

    ``with_routing`` (an MoE model): also the experts every MoE layer chose for each slot's
    token, [S, MoE layers x top-k] in layer order: what the engine records for routing replay."""
    if not with_routing:
        return (*_with_cache(config, params, tokens_BxT, positions_BxT, mask, k, v, cache_index_B,
                             adapter_BxT=adapter_BxT), None)
    lp = params if isinstance(params, LayerParams) else split_params(config, params)
    return forward_layers(config, lp, tokens_BxT, positions_BxT, mask, k, v, cache_index_B, with_routing=True,
                          adapter_BxT=adapter_BxT)


def prefill(params, config: ModelConfig, tokens_T, *, prefix: KV | None = None, start_pos=None, true_length=None,
            routing_TxR=None, adapter=None):
    """Run T new tokens (one sequence), after an optional cached prefix.

    Args:
      tokens_T: int32[T]; entries at index >= ``true_length`` are padding.
      prefix: KV [Y, P, K, H] of earlier tokens; only the first ``start_pos`` count.
      start_pos: position of tokens_T[0]; defaults to P (0 without a prefix).
      true_length: how many of the T tokens are real (default T).
      routing_TxR: an MoE model's recorded experts per token (-1: route live), replayed where
        ``config.routing_replay`` (a moved call's cache recomputed as decode computed it).
      adapter: several LoRA adapters (model/lora.py): the one this sequence runs with (default 0).
    Returns:
      (logits_V float32 at the last real token, KV [Y, T, K, H] of the new tokens).
    """
    chex.assert_rank(tokens_T, 1, custom_message="prefill: tokens_T must be [T] (one sequence)")
    (t,) = tokens_T.shape
    if prefix is not None:
        kv_shape = (config.n_layers, None, config.n_kv_heads, config.head_dim)
        chex.assert_shape([prefix.k, prefix.v], kv_shape, custom_message="prefill: prefix k/v must be [Y, P, K, H]")
    p = 0 if prefix is None else prefix.k.shape[1]
    if prefix is None and start_pos is not None and _concrete_nonzero(start_pos):
        raise ValueError(f"prefill: start_pos={start_pos} needs a prefix holding that many tokens' k/v")
    if isinstance(start_pos, int) and start_pos > p:
        raise ValueError(f"prefill: start_pos={start_pos} exceeds the prefix buffer length {p}")
    start = jnp.asarray(p if start_pos is None else start_pos, jnp.int32)
    n = jnp.asarray(t if true_length is None else true_length, jnp.int32)
    dt = config.jnp_dtype if prefix is None else prefix.k.dtype
    pad = jnp.zeros((config.n_layers, t, config.n_kv_heads, config.head_dim), dt)
    k_buf = pad if prefix is None else jnp.concatenate([prefix.k, pad], axis=1)
    v_buf = pad if prefix is None else jnp.concatenate([prefix.v, pad], axis=1)
    positions_T = start + jnp.arange(t, dtype=jnp.int32)
    # Query t sees every buffer entry up to its own position (prefix then causal); blockwise
    # by default, so a long prompt never forms a [T, P+T] mask or scores.
    logits, (k, v) = _with_cache(config,
        params,
        tokens_T[None],
        positions_T[None],
        cache_mask(config, positions_T[None], p + t),
        k_buf[:, None],
        v_buf[:, None],
        start[None],
        None if routing_TxR is None else routing_TxR[None],
        None if adapter is None else jnp.full((1, t), adapter, jnp.int32),
    )
    kv_shape = (config.n_layers, t, config.n_kv_heads, config.head_dim)
    new_k = jax.lax.dynamic_slice(k[:, 0], (0, start, 0, 0), kv_shape)
    new_v = jax.lax.dynamic_slice(v[:, 0], (0, start, 0, 0), kv_shape)
    return logits[0, n - 1], KV(k=new_k, v=new_v)


def prefill_into(params, config: ModelConfig, tokens_T, buf: KV, start, true_length=None, routing_TxR=None,
                 adapter=None):
    """Run T new tokens into a KV buffer [Y, P, K, H] whose first ``start`` entries hold the context.

    Their k/v are written at buf[:, start : start+T] and each attends to buffer entries
    up to its own position (blockwise by default: no [T, P] mask). One compile per
    (T, P): a long prompt is prefilled chunk after chunk into one buffer (chunked
    prefill). The caller keeps start + T <= P (a write past the end would be clamped).
    ``routing_TxR``: as ``prefill``'s.

    Returns (logits_V float32 at the last real token, the updated buffer).
    """
    chex.assert_rank(tokens_T, 1, custom_message="prefill_into: tokens_T must be [T] (one sequence)")
    (t,) = tokens_T.shape
    p = buf.k.shape[1]
    if t > p:
        raise ValueError(f"prefill_into: {t} tokens do not fit a buffer of {p}")
    if isinstance(start, int) and start + t > p:
        raise ValueError(f"prefill_into: {t} tokens at start={start} overflow the buffer of {p}")
    start = jnp.asarray(start, jnp.int32)
    n = jnp.asarray(t if true_length is None else true_length, jnp.int32)
    positions_T = start + jnp.arange(t, dtype=jnp.int32)
    logits, (k, v) = _with_cache(config,
        params, tokens_T[None], positions_T[None], cache_mask(config, positions_T[None], p),
        buf.k[:, None], buf.v[:, None], start[None], None if routing_TxR is None else routing_TxR[None],
        None if adapter is None else jnp.full((1, t), adapter, jnp.int32),
    )
    return logits[0, n - 1], KV(k=k[:, 0], v=v[:, 0])


def chunk_starts(n: int, chunk: int, buf_len: int, first: int = 0) -> list[tuple[int, int]]:
    """(start, real tokens) of each chunk that prefills tokens first..n-1 into a buffer of buf_len.

    Every chunk is ``chunk`` long (one compile); where the buffer is not a multiple of
    ``chunk`` the last chunk starts earlier and recomputes a few tokens (same k/v).
    """
    if n > buf_len:
        raise ValueError(f"chunk_starts: {n} tokens do not fit a buffer of {buf_len}")
    if chunk > buf_len:
        raise ValueError(f"chunk_starts: chunk {chunk} is longer than the buffer of {buf_len}")
    out, s = [], first
    while s < n:
        start = min(s, buf_len - chunk)
        out.append((start, min(n, s + chunk) - start))
        s += chunk
    return out


def prefill_chunked(params, config: ModelConfig, tokens_T, *, cache_len: int, chunk: int):
    """Prefill a long prompt chunk by chunk into slot 0 of a fresh one-slot cache of ``cache_len``.

    Returns (KVCache holding the prompt, logits_V at its last token). Memory is one
    chunk's activations plus the cache; attention is blockwise against the cache.
    """
    toks = np.asarray(tokens_T, np.int32)
    n = int(toks.shape[0])
    if n + 1 > cache_len:
        raise ValueError(f"prefill_chunked: a {n}-token prompt (+1 to decode) does not fit cache_len={cache_len}")
    step = _prefill_into_jit()
    shape = (config.n_layers, cache_len, config.n_kv_heads, config.head_dim)
    buf = KV(k=jnp.zeros(shape, config.jnp_dtype), v=jnp.zeros(shape, config.jnp_dtype))
    logits = None
    for start, real in chunk_starts(n, chunk, cache_len):
        padded = np.zeros((chunk,), np.int32)
        padded[:real] = toks[start: start + real]
        logits, buf = step(params, config, jnp.asarray(padded), buf, np.int32(start), np.int32(real))
    y = config.n_layers
    cache = KVCache(k=tuple(buf.k[i][None] for i in range(y)), v=tuple(buf.v[i][None] for i in range(y)),
                    lengths=jnp.full((1,), n, jnp.int32))
    return cache, logits


@functools.lru_cache(maxsize=None)
def _prefill_into_jit():
    return jax.jit(prefill_into, static_argnums=1, donate_argnames="buf")


def insert(cache: KVCache, kv: KV, slot, *, start=0, length=None) -> KVCache:
    """Copy ``kv`` into ``slot`` at cache index ``start``; the slot then holds start+length tokens.

    ``length`` (default T) is how many of kv's T entries are real; padding
    beyond it is written but masked, and overwritten by later decode steps.
    """
    y = len(cache.k)
    _, _, k_heads, head_dim = cache.k[0].shape
    chex.assert_shape([kv.k, kv.v], (y, None, k_heads, head_dim), custom_message="insert: kv must be [Y, T, K, H]")
    t = kv.k.shape[1]
    if isinstance(start, int) and start + t > cache.max_len:
        raise ValueError(f"insert: {t} tokens at start={start} overflow the cache's max_len={cache.max_len}")
    idx = (slot, start, 0, 0)
    k = tuple(jax.lax.dynamic_update_slice(c, kv.k[i][None].astype(c.dtype), idx) for i, c in enumerate(cache.k))
    v = tuple(jax.lax.dynamic_update_slice(c, kv.v[i][None].astype(c.dtype), idx) for i, c in enumerate(cache.v))
    n = t if length is None else length
    lengths = cache.lengths.at[slot].set(jnp.asarray(start, jnp.int32) + jnp.asarray(n, jnp.int32))
    return KVCache(k=k, v=v, lengths=lengths)


def slot_kv(cache: KVCache, slot) -> KV:
    """The whole buffer of one slot (KV [Y, M, K, H]); its first cache.lengths[slot] entries are valid."""
    return KV(k=jnp.stack([c[slot] for c in cache.k]), v=jnp.stack([c[slot] for c in cache.v]))


def decode_step(params, config: ModelConfig, tokens_S, cache: KVCache, active_S=None, *, with_routing=False,
                adapter_S=None):
    """One token for every slot: logits of the next token and the updated cache.

    Slot s's token sits at position ``cache.lengths[s]``; its k/v is written
    there and the slot's length grows by one where ``active_S`` (default all).
    The caller keeps ``lengths < max_len`` for every slot (a full slot's write
    would be clamped onto its last valid entry). Inactive slots compute a token
    that is never kept, at static shape.

    Returns (logits_SxV float32, cache), and with ``with_routing`` (an MoE model) a third
    value: routing_SxR int32, the experts each slot's token was routed to (``_decode_apply``).
    ``adapter_S``: several LoRA adapters: each slot's (model/lora.py).
    """
    chex.assert_shape(tokens_S, (cache.num_slots,), custom_message="decode_step: tokens_S must be [S], one per slot")
    if active_S is not None:
        chex.assert_shape(active_S, (cache.num_slots,), custom_message="decode_step: active_S must be [S]")
    m = cache.max_len
    pos_S = cache.lengths
    mask_Sx1xM = (jnp.arange(m, dtype=jnp.int32)[None, :] <= pos_S[:, None])[:, None, :]
    logits, (k, v), routing = _decode_apply(config, params, with_routing,
        tokens_S[:, None],
        pos_S[:, None],
        mask_Sx1xM,
        cache.k,
        cache.v,
        pos_S,
        None if adapter_S is None else adapter_S[:, None],
    )
    if active_S is None:
        lengths = pos_S + 1
    else:
        # An inactive slot's k/v still lands at index lengths[s], just past its
        # valid entries: masked now and overwritten by its next real token, so
        # no full-cache select is needed.
        lengths = pos_S + active_S.astype(jnp.int32)
    out = logits[:, 0], KVCache(k=k, v=v, lengths=lengths)
    return (*out, routing) if with_routing else out


class PagedKVCache(flax.struct.PyTreeNode):  # PyTreeNode: flax.struct.dataclass with a typed replace()
    """A pool of k/v pages shared by S slots; slot s's token p is at page_table[s, p // G], row p % G."""

    k: tuple  # Y pools [K, NP, G, H], one per layer
    v: tuple  # Y pools [K, NP, G, H]
    page_table: jax.Array  # int32[S, PPS]; 0 = the trash page (unallocated)
    lengths: jax.Array  # int32[S]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[1]

    @property
    def max_len(self) -> int:
        return self.page_table.shape[1] * self.page_size

    @property
    def num_slots(self) -> int:
        return self.page_table.shape[0]


def init_paged_cache(config: ModelConfig, batch_slots: int, num_pages: int, page_size: int, max_len: int,
                     dtype=None) -> PagedKVCache:
    """Empty pool of ``num_pages`` pages (page 0 is the trash page) for ``batch_slots`` slots of up to
    ``max_len`` tokens (a multiple of ``page_size``)."""
    if batch_slots <= 0 or num_pages < 2 or page_size <= 0 or max_len <= 0 or max_len % page_size:
        raise ValueError(f"init_paged_cache: need batch_slots > 0, num_pages >= 2 (page 0 is trash), page_size > 0 "
                         f"and max_len a positive multiple of page_size; got {batch_slots}, {num_pages}, "
                         f"{page_size}, {max_len}")
    shape = (config.n_kv_heads, num_pages, page_size, config.head_dim)
    dt = config.jnp_dtype if dtype is None else dtype
    y = config.n_layers
    return PagedKVCache(k=tuple(jnp.zeros(shape, dt) for _ in range(y)), v=tuple(jnp.zeros(shape, dt) for _ in range(y)),
                        page_table=jnp.zeros((batch_slots, max_len // page_size), jnp.int32),
                        lengths=jnp.zeros((batch_slots,), jnp.int32))


def set_page_rows(cache: PagedKVCache, table_SxP) -> PagedKVCache:
    """Replace every slot's page table (the host's copy is the truth; serving/pages.py)."""
    chex.assert_shape(table_SxP, cache.page_table.shape, custom_message="set_page_rows: table must be [S, PPS]")
    return cache.replace(page_table=jnp.asarray(table_SxP, jnp.int32))


def insert_paged(cache: PagedKVCache, kv: KV, slot, *, start=0, length=None, shared=0) -> PagedKVCache:
    """Scatter ``kv`` [Y, T, K, H] (tokens start..start+T-1) into ``slot``'s pages; the slot then
    holds start+length tokens. Tokens before ``shared`` sit on pages other calls share (a prefix):
    they are not written. Entries past the slot's pages go to the trash page."""
    y = len(cache.k)
    kh, _, _, hd = cache.k[0].shape
    chex.assert_shape([kv.k, kv.v], (y, None, kh, hd), custom_message="insert_paged: kv must be [Y, T, K, H]")
    t = kv.k.shape[1]
    pos_1xT = jnp.asarray(start, jnp.int32) + jnp.arange(t, dtype=jnp.int32)[None]
    row_1xP = jax.lax.dynamic_slice_in_dim(cache.page_table, slot, 1, axis=0)
    page_1xT, off_1xT = page_slots(row_1xP, pos_1xT, cache.page_size, jnp.asarray(shared, jnp.int32)[None])

    def scatter(pool_KxPxGxH, new_TxKxH):
        return pool_KxPxGxH.at[:, page_1xT[0], off_1xT[0]].set(jnp.transpose(new_TxKxH, (1, 0, 2)).astype(pool_KxPxGxH.dtype))

    k = tuple(scatter(c, kv.k[i]) for i, c in enumerate(cache.k))
    v = tuple(scatter(c, kv.v[i]) for i, c in enumerate(cache.v))
    n = t if length is None else length
    lengths = cache.lengths.at[slot].set(jnp.asarray(start, jnp.int32) + jnp.asarray(n, jnp.int32))
    return cache.replace(k=k, v=v, lengths=lengths)


def paged_slot_kv(cache: PagedKVCache, slot, length: int) -> KV:
    """The first ``length`` (static) entries of a slot as a contiguous KV [Y, length, K, H]: what a
    call moving to another cell carries (its pages' contents, nothing past them)."""
    pps = -(-length // cache.page_size)
    row_1xP = jax.lax.dynamic_slice(cache.page_table, (slot, 0), (1, pps))
    return KV(k=jnp.stack([gather_pages(c, row_1xP)[0, :length] for c in cache.k]),
              v=jnp.stack([gather_pages(c, row_1xP)[0, :length] for c in cache.v]))


def paged_decode_step(params, config: ModelConfig, tokens_S, cache: PagedKVCache, active_S=None, *,
                      with_routing=False, adapter_S=None):
    """``decode_step`` over a paged cache (same contract, same result): slot s's token sits at
    position lengths[s], its k/v lands on the page holding that position (the trash page if
    the host gave the slot none there). The kernel is config.attention_kernel ("xla" gathers
    the pages and attends like the contiguous cache; "pallas" runs JAX's paged kernel)."""
    chex.assert_shape(tokens_S, (cache.num_slots,), custom_message="paged_decode_step: tokens_S must be [S]")
    if active_S is not None:
        chex.assert_shape(active_S, (cache.num_slots,), custom_message="paged_decode_step: active_S must be [S]")
    pos_S = cache.lengths
    mask = PagedMask(cache.page_table, impl=config.attention_kernel, block_q=config.attention_block_q,
                     block_k=config.attention_block_k, blockwise=config.attention_impl == "blockwise")
    logits, (k, v), routing = _decode_apply(config, params, with_routing, tokens_S[:, None], pos_S[:, None], mask,
                                            cache.k, cache.v, pos_S, None if adapter_S is None else adapter_S[:, None])
    lengths = pos_S + 1 if active_S is None else pos_S + active_S.astype(jnp.int32)
    out = logits[:, 0], cache.replace(k=k, v=v, lengths=lengths)
    return (*out, routing) if with_routing else out


def _concrete_nonzero(x) -> bool:
    """True if x is a known nonzero value (a traced value cannot be checked here)."""
    try:
        return int(x) != 0
    except (TypeError, jax.errors.ConcretizationTypeError):
        return False
