"""Paged KV cache: decode equals the contiguous cache (same greedy tokens, logits within 1e-5),
prefix pages shared between slots, and the Pallas kernels equal the plain paged attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gyre_jax.model import decode as dec
from gyre_jax.model import init_params, model_config_tiny, paged

ATOL = 1e-5
G, M = 4, 24  # page size, max tokens per slot (6 pages)


@pytest.fixture(scope="module")
def m():
    cfg = model_config_tiny()
    params = init_params(cfg, jax.random.key(3))
    return dict(
        cfg=cfg, params=params,
        prefill=jax.jit(dec.prefill, static_argnums=1),
        step=jax.jit(dec.decode_step, static_argnums=1),
        pstep=jax.jit(dec.paged_decode_step, static_argnums=1),
        insert=jax.jit(dec.insert),
        pinsert=jax.jit(dec.insert_paged),
    )


def _prefill(m, prompt):
    padded = np.zeros(8, np.int32)
    padded[: len(prompt)] = prompt
    return m["prefill"](m["params"], m["cfg"], jnp.asarray(padded), true_length=len(prompt))


def test_paged_decode_equals_contiguous(m):
    """Slots 0 and 2 decode on scattered, non-adjacent pages; slot 2 shares slot 0's first
    full page (a common prefix), written once; slot 1 stays empty and writes only trash."""
    cfg, params = m["cfg"], m["params"]
    rng = np.random.default_rng(0)
    common = rng.integers(1, cfg.vocab_size, 4)
    prompts = {0: np.concatenate([common, rng.integers(1, cfg.vocab_size, 1)]),
               2: np.concatenate([common, rng.integers(1, cfg.vocab_size, 3)])}
    cache = dec.init_cache(cfg, 3, M)
    pcache = dec.init_paged_cache(cfg, 3, num_pages=16, page_size=G, max_len=M)
    table = np.zeros((3, M // G), np.int32)
    table[0] = [7, 3, 12, 5, 9, 14]
    table[2] = [7, 11, 2, 15, 4, 8]  # page 7 (tokens 0..3 = the common prefix) is shared
    pcache = dec.set_page_rows(pcache, table)
    next_tok = np.zeros(3, np.int32)
    for s, prompt in prompts.items():
        logits, kv = _prefill(m, prompt)
        cache = m["insert"](cache, kv, s, length=len(prompt))
        if s == 2:  # the shared page already holds the prefix: its entries must not be written
            # (NaN here would reach both slots' logits if they were)
            kv = dec.KV(k=kv.k.at[:, :G].set(jnp.nan), v=kv.v.at[:, :G].set(jnp.nan))
        pcache = m["pinsert"](pcache, kv, s, length=len(prompt), shared=G if s == 2 else 0)
        next_tok[s] = int(np.argmax(np.asarray(logits)))
    active = jnp.asarray([True, False, True])
    for _ in range(12):  # crosses page boundaries in both slots
        logits, cache = m["step"](params, cfg, jnp.asarray(next_tok), cache, active)
        plogits, pcache = m["pstep"](params, cfg, jnp.asarray(next_tok), pcache, active)
        for s in prompts:
            np.testing.assert_allclose(np.asarray(plogits[s]), np.asarray(logits[s]), atol=ATOL, rtol=0)
            assert int(np.argmax(np.asarray(plogits[s]))) == int(np.argmax(np.asarray(logits[s])))
            next_tok[s] = int(np.argmax(np.asarray(logits[s])))
    assert np.asarray(pcache.lengths).tolist() == np.asarray(cache.lengths).tolist() == [17, 0, 19]
    # The slot's pages hold the contiguous cache's entries (export = gather of its pages; layer 1
    # differs by float rounding only, ~6e-7, from attention summed in another order).
    for s, n in ((0, 17), (2, 19)):
        got = dec.paged_slot_kv(pcache, s, n)
        np.testing.assert_allclose(np.asarray(got.k), np.asarray(dec.slot_kv(cache, s).k[:, :n]), atol=ATOL, rtol=0)
        np.testing.assert_allclose(np.asarray(got.v), np.asarray(dec.slot_kv(cache, s).v[:, :n]), atol=ATOL, rtol=0)


def _pool(seed, b=3, k=2, n=8, h=16, np_=20, pps=4):
    r = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(r[0], (b, n, h))
    kp = jax.random.normal(r[1], (k, np_, G, h))
    vp = jax.random.normal(r[2], (k, np_, G, h))
    table = (1 + jax.random.permutation(r[3], np_ - 1)[: b * pps]).reshape(b, pps).astype(jnp.int32)
    lengths = jnp.asarray([5, pps * G, 1], jnp.int32)[:b]
    return q, kp, vp, table, lengths


def test_pallas_gpu_kernel_interpreted_equals_plain():
    q, kp, vp, table, lengths = _pool(1)
    ref = paged.paged_attention(q, kp, vp, table, lengths, impl="xla")
    dense = paged.paged_attention(q, kp, vp, table, lengths, impl="xla", blockwise=False)
    got = paged.paged_attention(q, kp, vp, table, lengths, impl="pallas_interpret")
    np.testing.assert_allclose(np.asarray(dense), np.asarray(ref), atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=ATOL, rtol=0)


def test_pallas_tpu_kernel_interpreted_equals_plain_on_bf16_pages():
    """The TPU kernel casts k/v to bfloat16 inside, so it is compared on bf16-exact pages."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged

    q, kp, vp, table, lengths = _pool(2)
    kp, vp = (x.astype(jnp.bfloat16).astype(jnp.float32) for x in (kp, vp))
    ref = paged.paged_attention(q, kp, vp, table, lengths, impl="xla")
    with pltpu.force_tpu_interpret_mode():
        got = tpu_paged(q * q.shape[-1] ** -0.5, kp, vp, lengths, table, pages_per_compute_block=2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=ATOL, rtol=0)


def test_bad_input_is_named():
    q, kp, vp, table, lengths = _pool(3)
    with pytest.raises(ValueError, match="impl must be one of"):
        paged.paged_attention(q, kp, vp, table, lengths, impl="cuda")
    with pytest.raises(ValueError, match="needs a GPU or TPU"):
        paged.paged_attention(q, kp, vp, table, lengths, impl="pallas")
    with pytest.raises(ValueError, match="max_len a positive multiple of page_size"):
        dec.init_paged_cache(model_config_tiny(), 2, num_pages=8, page_size=4, max_len=10)
