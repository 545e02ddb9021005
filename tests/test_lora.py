"""LoRA (model/lora.py): the adapted model equals the dense model with merged weights, forward and
backward, against a float64 numpy merge and chain rule; several adapters over one base; dropout that
does not depend on the micro-batch; decode with adapters; the per-adapter optimizer."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from gyre_jax.cells.train_state import per_adapter
from gyre_jax.model import Transformer, init_params, model_config_tiny
from gyre_jax.model import decode as dec
from gyre_jax.model import lora as L
from tests.test_moe import moe_config, tree_row

TOL = 1e-5


def _random_adapter(cfg, seed):
    """An adapter with nonzero A and B (a fresh one has B = 0: the base exactly, so nothing to check)."""
    a = L.init_adapter(cfg, jax.random.key(seed))
    leaves, treedef = jax.tree.flatten(a)
    keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
    return jax.tree.unflatten(treedef, [x + 0.2 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def _numpy_merge(cfg, base, adapter):
    """W + scale_layer * A @ B per adapted projection, in float64 numpy: the reference merge."""
    scale = cfg.lora.layer_scale(cfg.n_layers).astype(np.float64)
    starts = {name: start for name, start, _, _ in cfg.layer_runs()}
    out = jax.tree.map(lambda x: np.asarray(x, np.float64), base)
    for stack, mods in adapter["lora"].items():
        for mod, names in mods.items():
            for key in names:
                if not key.endswith("_lora_a"):
                    continue
                name = key[:-len("_lora_a")]
                a = np.asarray(names[key], np.float64)
                b = np.asarray(names[name + "_lora_b"], np.float64)
                w = out["params"][stack][mod][name]
                lead = 2 if mod == "moe" else 1
                for y in range(w.shape[0]):
                    s = scale[starts[stack] + y]
                    if lead == 1:
                        d = a[y].reshape(-1, a.shape[-1]) @ b[y].reshape(b.shape[1], -1)
                    else:
                        d = np.stack([a[y, e].reshape(-1, a.shape[-1]) @ b[y, e].reshape(b.shape[2], -1)
                                      for e in range(a.shape[1])])
                    w[y] = w[y] + s * d.reshape(w[y].shape)
    return out


def _close_normwise(got, want, what):
    """max |got - want| <= TOL x max |want|: float32's accuracy for a gradient summed over a whole
    micro-batch (elementwise, an entry that cancels to near zero carries the sum's rounding)."""
    err = float(np.max(np.abs(np.asarray(got, np.float64) - want)))
    scale = float(np.max(np.abs(want)))
    assert err <= TOL * scale, f"{what}: max error {err:.3g} > {TOL} x {scale:.3g}"


def _inputs():
    return tuple(jnp.asarray(x) for x in tree_row())


@functools.lru_cache(maxsize=None)
def _grads(cfg):
    """Jitted (adapter, base, w, inputs) -> ((loss, logits), grads) of the adapted model, and the same of the
    dense model over its params: compiled once per config, shared by the tests."""
    def weighted(logits, w, seg):
        return jnp.sum(logits * w * (seg > 0)[..., None]), logits

    def lora_loss(ad, base, w, toks, pos, seg, end):
        return weighted(Transformer(cfg).apply(L.variables(cfg, base, (ad,)), toks, pos, seg, end), w, seg)

    def dense_loss(params, w, toks, pos, seg, end):
        return weighted(Transformer(cfg.replace(lora=None)).apply(params, toks, pos, seg, end), w, seg)

    return (jax.jit(jax.value_and_grad(lora_loss, has_aux=True)),
            jax.jit(jax.value_and_grad(dense_loss, has_aux=True)))


def _check_forward_backward(cfg, adapter_seed=1):
    base = init_params(cfg, jax.random.key(0))
    adapter = _random_adapter(cfg, adapter_seed)
    inputs = _inputs()
    seg = inputs[2]
    w_BxLxV = jax.random.normal(jax.random.key(9), seg.shape + (cfg.vocab_size,))
    lora_grad, dense_grad = _grads(cfg)
    (_, got), grads = lora_grad(adapter, base, w_BxLxV, *inputs)
    merged64 = _numpy_merge(cfg, base, adapter)
    merged = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), merged64)
    (_, want), dw = dense_grad(merged, w_BxLxV, *inputs)
    mask = np.asarray(seg > 0)
    np.testing.assert_allclose(np.asarray(got)[mask], np.asarray(want)[mask], atol=TOL, rtol=TOL)
    # Chain rule through W' = W + s A B in float64: dA = s dW B^T, dB = s A^T dW.
    scale = cfg.lora.layer_scale(cfg.n_layers)
    starts = {name: start for name, start, _, _ in cfg.layer_runs()}
    checked = 0
    for stack, mods in adapter["lora"].items():
        for mod, names in mods.items():
            for key in [k for k in names if k.endswith("_lora_a")]:
                name = key[:-len("_lora_a")]
                a = np.asarray(names[key], np.float64)
                b = np.asarray(names[name + "_lora_b"], np.float64)
                g = np.asarray(dw["params"][stack][mod][name], np.float64)
                ga = np.asarray(grads["lora"][stack][mod][key])
                gb = np.asarray(grads["lora"][stack][mod][name + "_lora_b"])
                lead = 2 if mod == "moe" else 1
                for y in range(a.shape[0]):
                    s = scale[starts[stack] + y]
                    if s == 0:  # a layer left out of config.lora.layers: its adapter gets exactly nothing
                        assert not np.any(ga[y]) and not np.any(gb[y]), f"{stack}/{mod}/{name} layer {y}"
                        continue
                    for e in range(a.shape[1] if lead == 2 else 1):
                        ix = (y, e) if lead == 2 else (y,)
                        a2 = a[ix].reshape(-1, a.shape[-1])
                        b2 = b[ix].reshape(b.shape[lead], -1)
                        g2 = g[ix].reshape(a2.shape[0], b2.shape[1])
                        _close_normwise(ga[ix].reshape(a2.shape), s * g2 @ b2.T, f"{stack}/{mod}/{key}[{ix}]")
                        _close_normwise(gb[ix].reshape(b2.shape), s * a2.T @ g2, f"{stack}/{mod}/{name}_lora_b[{ix}]")
                        checked += 1
    assert checked > 0
    # a fresh adapter (B = 0) is the base, bit for bit
    (_, fresh), _ = lora_grad(L.init_adapter(cfg, jax.random.key(5)), base, w_BxLxV, *inputs)
    (_, plain), _ = dense_grad(base, w_BxLxV, *inputs)
    assert np.array_equal(np.asarray(fresh), np.asarray(plain))
    return base, adapter


@pytest.mark.parametrize("over", [
    dict(lora_layers=(1,)),
    pytest.param(dict(qk_norm=True, qkv_bias=True, tie_embeddings=False), marks=pytest.mark.slow),
    pytest.param(dict(targets=("q_proj", "o_proj", "down_proj"), rslora=True), marks=pytest.mark.slow),
])
def test_lora_equals_merged_dense_forward_and_backward(over):
    over = dict(over)
    lora = L.LoraConfig(rank=4, alpha=8.0, targets=over.pop("targets", L.TARGETS), layers=over.pop("lora_layers", ()),
                        rslora=over.pop("rslora", False))
    cfg = model_config_tiny(lora=lora, **over)
    base, adapter = _check_forward_backward(cfg)
    # ours (float32 sums) equals the float64 merge too
    ours = L.merge(cfg, base, adapter)
    ref = _numpy_merge(cfg, base, adapter)
    for x, y in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(x), y, atol=TOL, rtol=0)


@pytest.mark.slow  # three MoE compiles: ~1 min on an idle 2-core host
def test_lora_on_moe_experts_equals_merged_dense():
    lora = L.LoraConfig(rank=3, alpha=6.0)
    cfg = moe_config(num_experts=4, num_experts_per_tok=2, mlp_only_layers=(0,), lora=lora)
    base, adapter = _check_forward_backward(cfg, adapter_seed=3)
    assert "moe" in adapter["lora"]["layers_1"] and "mlp" in adapter["lora"]["layers_0"]
    # the dense-experts reference computes the same adapted function as the grouped matmuls
    toks, pos, seg, end = _inputs()
    v = L.variables(cfg, base, (adapter,))
    fwd = jax.jit(lambda c, v, *x: Transformer(c).apply(v, *x), static_argnums=0)
    np.testing.assert_allclose(np.asarray(fwd(cfg, v, toks, pos, seg, end)),
                               np.asarray(fwd(cfg.replace(moe_impl="dense"), v, toks, pos, seg, end)), atol=TOL, rtol=0)


def test_several_adapters_each_token_its_own():
    """Two adapters over one base: each row computes what its adapter merged into the base computes, and an
    adapter no token uses gets exactly zero gradient."""
    cfg = model_config_tiny(lora=L.LoraConfig(rank=3, num_adapters=2))
    base = init_params(cfg, jax.random.key(0))
    ads = (_random_adapter(cfg, 1), _random_adapter(cfg, 2))
    toks, pos, seg, end = _inputs()
    which = jnp.asarray([[0] * toks.shape[1], [1] * toks.shape[1]], jnp.int32)
    got = jax.jit(lambda v, *x: Transformer(cfg).apply(v, *x[:4], adapter_BxL=x[4]))(
        L.variables(cfg, base, ads), toks, pos, seg, end, which)
    dense = jax.jit(Transformer(cfg.replace(lora=None)).apply)
    mask = np.asarray(seg[0] > 0)
    for row, ad in enumerate(ads):
        merged = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), _numpy_merge(cfg, base, ad))
        want = dense(merged, toks, pos, seg, end)
        np.testing.assert_allclose(np.asarray(got[row])[mask], np.asarray(want[row])[mask], atol=TOL, rtol=TOL)
    only0 = jnp.zeros_like(which)
    g = jax.jit(jax.grad(lambda a: jnp.sum(Transformer(cfg).apply(L.variables(cfg, base, a), toks, pos, seg, end,
                                                                  adapter_BxL=only0))))(ads)
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(g[1]))
    assert any(np.any(np.asarray(x)) for x in jax.tree.leaves(g[0]))


@pytest.mark.slow  # three compiles of a dropout step
def test_dropout_mask_is_the_rows_own():
    """A row's loss gradient is the same alone and beside another row (its mask comes from its own seed),
    and dropout changes the result only where an rng is given (training)."""
    cfg = model_config_tiny(lora=L.LoraConfig(rank=4, dropout=0.5))
    base = init_params(cfg, jax.random.key(0))
    ad = _random_adapter(cfg, 1)
    toks, pos, seg, end = _inputs()
    toks = toks.at[1].set((toks[1] + 7) % 128)  # two different rows
    model = Transformer(cfg)

    def loss(a, t, p, s, e, rng):
        kw = {"rngs": {L.DROPOUT_RNG: rng}} if rng is not None else {}
        return jnp.sum(model.apply(L.variables(cfg, base, (a,)), t, p, s, e, **kw)[..., :5])

    grad = jax.jit(jax.grad(loss))
    rng = jax.random.key(0)
    both = grad(ad, toks, pos, seg, end, rng)
    rows = [grad(ad, *(x[r:r + 1] for x in (toks, pos, seg, end)), rng) for r in range(2)]
    alone = jax.tree.map(jnp.add, *rows)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(both), jax.tree.leaves(alone)):
        _close_normwise(np.asarray(x), np.asarray(y, np.float64), jax.tree_util.keystr(path))
    f = jax.jit(loss)
    assert float(f(ad, toks, pos, seg, end, rng)) != float(f(ad, toks, pos, seg, end, None))


def test_decode_with_adapters_equals_merged_decode():
    """KV-cache decode of the adapted model (per-layer params, several adapters: one per slot) equals the
    merged dense model's decode of each slot's adapter."""
    cfg = model_config_tiny(lora=L.LoraConfig(rank=2, num_adapters=2))
    base = init_params(cfg, jax.random.key(0))
    ads = (_random_adapter(cfg, 1), _random_adapter(cfg, 2))
    from gyre_jax.model.unrolled import forward_layers, split_params

    lp = split_params(cfg, L.variables(cfg, base, ads))
    plain = cfg.replace(lora=None)
    prompt = jnp.asarray([[5, 9, 11, 3], [7, 2, 8, 1]], jnp.int32)
    pos = jnp.tile(jnp.arange(4, dtype=jnp.int32), (2, 1))
    which = jnp.asarray([[0] * 4, [1] * 4], jnp.int32)
    s = 8
    mask = jnp.arange(s)[None, None, :] <= pos[:, :, None]
    zeros = tuple(jnp.zeros((2, s, cfg.n_kv_heads, cfg.head_dim)) for _ in range(cfg.n_layers))
    fwd = jax.jit(lambda lp, *a: forward_layers(cfg, lp, *a[:6], adapter_BxT=a[6])[0])
    got = fwd(lp, prompt, pos, mask, zeros, zeros, jnp.zeros((2,), jnp.int32), which)
    for row, ad in enumerate(ads):
        merged = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), _numpy_merge(cfg, base, ad))
        want, _ = jax.jit(dec.prefill, static_argnums=1)(merged, plain, prompt[row])
        np.testing.assert_allclose(np.asarray(got[row, -1]), np.asarray(want), atol=TOL, rtol=TOL)


def test_per_adapter_optimizer():
    """One adapter: exactly the plain optimizer. Two: an adapter with a zero gradient keeps weights and state."""
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1))
    p = {"w": jnp.arange(6.0).reshape(2, 3)}
    g = {"w": jnp.ones((2, 3)) * 3.0}
    one = per_adapter(tx, 1)
    u1, s1 = one.update((g,), one.init((p,)), (p,))
    u0, s0 = tx.update(g, tx.init(p), p)
    assert np.array_equal(np.asarray(u1[0]["w"]), np.asarray(u0["w"]))
    two = per_adapter(tx, 2)
    st = two.init((p, p))
    u, st = two.update((g, g), st, (p, p))  # both train once: momentum in both
    u, st2 = two.update((g, jax.tree.map(jnp.zeros_like, g)), st, (p, p))
    assert not np.any(np.asarray(u[1]["w"]))
    for a, b in zip(jax.tree.leaves(st2[1]), jax.tree.leaves(st[1])):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert np.any(np.asarray(u[0]["w"]))
    with pytest.raises(ValueError, match="tuple of 2 adapters"):
        two.init(p)


@pytest.mark.parametrize("kw,match", [
    (dict(rank=0), "rank must be an int >= 1"),
    (dict(rank=4, targets=("qproj",)), "unknown"),
    (dict(rank=4, dropout=1.0), "dropout must be in"),
    (dict(rank=4, alpha=0), "alpha must be > 0"),
])
def test_lora_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        L.LoraConfig(**kw)


def test_lora_config_refusals_name_what_is_not_covered():
    with pytest.raises(ValueError, match="layers=.*the model has 2 layers"):
        model_config_tiny(lora=L.LoraConfig(rank=2, layers=(5,)))
    with pytest.raises(ValueError, match="dropout=0.1 on MoE experts is not covered"):
        moe_config(lora=L.LoraConfig(rank=2, dropout=0.1))
    with pytest.raises(ValueError, match="expert-parallel"):
        moe_config(lora=L.LoraConfig(rank=2, num_adapters=2), expert_parallel_axis="expert")
    moe_config(lora=L.LoraConfig(rank=2, dropout=0.1, targets=("q_proj", "v_proj")))  # attention only: fine


def test_adapter_is_small_and_config_hashable():
    cfg = model_config_tiny(lora=L.LoraConfig(rank=2))
    n = L.count_adapter_params(cfg)
    d, f, h, nh, kv, y = cfg.d_model, cfg.d_ff, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.n_layers
    r = 2
    want = y * r * ((d + nh * h) * 2 + (d + kv * h) * 2 + (d + f) * 3)
    assert n == want
    hash(cfg)
    assert dataclasses.replace(cfg.lora, rank=3) != cfg.lora
