"""KV-cache decoding equals re-running the full forward pass (float32, tight)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gyre_jax.model import Transformer, init_params, model_config_tiny
from gyre_jax.model import decode as dec
from gyre_jax.model.unrolled import split_params

ATOL = 1e-5


@pytest.fixture(scope="module")
def m():
    cfg = model_config_tiny()  # same config as test_model.py: init compiles once per run
    params = init_params(cfg, jax.random.key(3))
    fwd = jax.jit(Transformer(cfg).apply)
    prefill = jax.jit(dec.prefill, static_argnums=1)
    step = jax.jit(dec.decode_step, static_argnums=1)
    insert = jax.jit(dec.insert)
    return cfg, params, fwd, prefill, step, insert


REF_LEN = 24  # one compiled reference shape for every sequence length


def full_logits(fwd, params, seq):
    """Reference: the whole sequence through the plain forward pass (causal), padded
    to REF_LEN with segment-0 padding that no real token can see."""
    n = len(seq)
    x = np.zeros((1, REF_LEN), np.int32)
    x[0, :n] = seq
    seg = (np.arange(REF_LEN) < n).astype(np.int32)[None]
    sub = np.where(seg > 0, REF_LEN, np.arange(1, REF_LEN + 1)).astype(np.int32)
    pos = np.arange(REF_LEN, dtype=np.int32)[None]
    return np.asarray(fwd(params, x, pos, seg, sub)[0, :n])


def test_greedy_decode_matches_full_forward(m):
    cfg, params, fwd, prefill, step, insert = m
    rng = np.random.default_rng(0)
    slots, max_len, n_new = 3, 24, 8
    cache = dec.init_cache(cfg, slots, max_len)
    # Slot 1 stays empty (inactive); slots 0 and 2 hold prompts of different lengths,
    # the second padded to a bucket of 8 with true_length.
    prompts = {0: rng.integers(1, cfg.vocab_size, 5), 2: rng.integers(1, cfg.vocab_size, 7)}
    seqs, next_tok = {}, np.zeros(slots, np.int32)
    for s, prompt in prompts.items():
        padded = np.zeros(8, np.int32)
        padded[: len(prompt)] = prompt
        logits, kv = prefill(params, cfg, jnp.asarray(padded), true_length=len(prompt))
        ref = full_logits(fwd, params, prompt)
        np.testing.assert_allclose(np.asarray(logits), ref[-1], atol=ATOL, rtol=0)
        cache = insert(cache, kv, s, length=len(prompt))
        seqs[s] = list(prompt)
        next_tok[s] = int(np.argmax(np.asarray(logits)))
    assert np.asarray(cache.lengths).tolist() == [5, 0, 7]
    active = jnp.asarray([True, False, True])
    for _ in range(n_new):
        logits, cache = step(params, cfg, jnp.asarray(next_tok), cache, active)
        for s in prompts:
            seqs[s].append(int(next_tok[s]))
            ref = full_logits(fwd, params, seqs[s])
            np.testing.assert_allclose(np.asarray(logits[s]), ref[-1], atol=ATOL, rtol=0)
            next_tok[s] = int(np.argmax(np.asarray(logits[s])))
    assert np.asarray(cache.lengths).tolist() == [5 + n_new, 0, 7 + n_new]


def test_prefill_with_prefix_equals_whole_prompt(m):
    cfg, params, fwd, prefill, step, insert = m
    rng = np.random.default_rng(1)
    prompt = jnp.asarray(rng.integers(1, cfg.vocab_size, 11), jnp.int32)
    whole_logits, whole_kv = prefill(params, cfg, prompt)
    pre_logits, pre_kv = prefill(params, cfg, prompt[:6])
    tail_logits, tail_kv = prefill(params, cfg, prompt[6:], prefix=pre_kv)
    np.testing.assert_allclose(np.asarray(tail_logits), np.asarray(whole_logits), atol=ATOL, rtol=0)
    head, tail = (jax.tree.map(lambda x: x[:, sl], whole_kv) for sl in (slice(None, 6), slice(6, None)))
    chex.assert_trees_all_close(tail_kv, tail, atol=ATOL, rtol=0)  # KV is a pytree: k and v
    chex.assert_trees_all_close(pre_kv, head, atol=ATOL, rtol=0)

    # Prefix read back from a cache slot (a padded buffer of max_len) with a traced start.
    cache = insert(dec.init_cache(cfg, 2, 16), pre_kv, 1)
    buf = dec.slot_kv(cache, 1)
    logits2, kv2 = prefill(params, cfg, prompt[6:], prefix=buf, start_pos=cache.lengths[1])
    np.testing.assert_allclose(np.asarray(logits2), np.asarray(whole_logits), atol=ATOL, rtol=0)
    chex.assert_trees_all_close(kv2, tail, atol=ATOL, rtol=0)
    # ...and decoding from there equals decoding after the whole prompt.
    cache = insert(cache, kv2, 1, start=6)
    tok = jnp.asarray([0, int(np.argmax(np.asarray(whole_logits)))], jnp.int32)
    logits3, _ = step(params, cfg, tok, cache)
    ref = full_logits(fwd, params, list(np.asarray(prompt)) + [int(tok[1])])
    np.testing.assert_allclose(np.asarray(logits3[1]), ref[-1], atol=ATOL, rtol=0)


def test_bad_input_is_named():
    cfg = model_config_tiny()
    with pytest.raises(ValueError, match="max_len"):
        dec.init_cache(cfg, 2, 0)
    cache = dec.init_cache(cfg, 1, 4)
    kv = dec.KV(k=jnp.zeros((cfg.n_layers, 3, cfg.n_kv_heads, cfg.head_dim)), v=jnp.zeros((cfg.n_layers, 3, cfg.n_kv_heads, cfg.head_dim)))
    with pytest.raises(ValueError, match="overflow"):
        dec.insert(cache, kv, 0, start=2)
    with pytest.raises(ValueError, match="start_pos"):
        dec.prefill(None, cfg, jnp.zeros(3, jnp.int32), start_pos=2)
    # Shape contracts (chex) name the argument.
    with pytest.raises(AssertionError, match="prefill: tokens_T must be"):
        dec.prefill(None, cfg, jnp.zeros((1, 3), jnp.int32))
    with pytest.raises(AssertionError, match=r"insert: kv must be \[Y, T, K, H\]"):
        dec.insert(cache, dec.KV(k=kv.k[:, :, :1], v=kv.v[:, :, :1]), 0)
    with pytest.raises(AssertionError, match="decode_step: tokens_S must be"):
        dec.decode_step(None, cfg, jnp.zeros(2, jnp.int32), cache)
    with pytest.raises(ValueError, match=r"split_params: params lack the layer stacks \['layers'\]"):
        split_params(cfg, {"params": {"embed": jnp.zeros((4, 4))}})


def test_decode_step_updates_the_cache_in_place():
    """The decode step writes each layer's new k/v into the donated cache where it lies and reads
    each layer's buffer and weights where they lie: with per-layer params (split_params) its
    temporaries stay below one layer's k/v. Stacked arrays made XLA copy every layer's k/v and
    weights out before the dots (temporaries of a layer's k/v and more), and scanning over the
    cache's layers built a new stacked cache every token (above the cache's own size)."""
    cfg = model_config_tiny(n_layers=4, max_seq_len=512)
    params = split_params(cfg, init_params(cfg, jax.random.key(0)))
    cache = dec.init_cache(cfg, 4, 512)
    step = jax.jit(lambda p, t, c: dec.decode_step(p, cfg, t, c), donate_argnums=2)
    mem = step.lower(params, jnp.ones((4,), jnp.int32), cache).compile().memory_analysis()
    layer_kv_bytes = cache.k[0].nbytes + cache.v[0].nbytes
    assert mem.temp_size_in_bytes < layer_kv_bytes / 2, (mem.temp_size_in_bytes, layer_kv_bytes)
    assert mem.alias_size_in_bytes >= sum(c.nbytes for c in cache.k + cache.v)  # the cache is updated in place


def test_decode_step_copies_no_weight():
    """A decode step reads every weight where it lies. Through ``embedding.T`` (the tied
    unembedding) and a two-axis (heads, head_dim) contraction of the o projection, XLA:CPU
    copied the whole embedding table transposed and every layer's o weight, every token: at one
    slot of the ~100M model that made our decode 0.76x Tunix's tokens/s (tools/bench_roofline.py)."""
    cfg = model_config_tiny(vocab_size=256, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, max_seq_len=96)
    params = split_params(cfg, init_params(cfg, jax.random.key(0)))
    cache = dec.init_cache(cfg, 1, 96)
    step = jax.jit(lambda p, t, c: dec.decode_step(p, cfg, t, c), donate_argnums=2)
    hlo = step.lower(params, jnp.ones((1,), jnp.int32), cache).compile().as_text()
    weight_sizes = {x.size for x in jax.tree.leaves(params) if x.ndim >= 2}
    copies = [ln.strip() for ln in hlo.splitlines() if " copy(" in ln and " = " in ln]
    sizes = [int(np.prod([int(d) for d in ln.split("[", 1)[1].split("]", 1)[0].split(",") if d])) for ln in copies]
    copied = [ln[:120] for ln, n in zip(copies, sizes) if n in weight_sizes]
    assert not copied, copied
