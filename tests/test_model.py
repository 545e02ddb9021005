"""Model basics: config validation, logical axes, and the forward pass against a
float64 numpy reference written from the Llama equations (no flax, no jax)."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from gyre_jax.model import (
    ModelConfig,
    Transformer,
    init_boxed,
    init_params,
    model_config_tiny,
    param_logical_axes,
    tree_attention_mask,
)
from gyre_jax.trajectory.serialize import tree_attention_mask_np

LOGICAL_NAMES = {"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers"}


@functools.lru_cache(maxsize=None)
def _model(tie: bool):
    cfg = model_config_tiny(tie_embeddings=tie)
    params = init_params(cfg, jax.random.key(1))
    fwd = jax.jit(Transformer(cfg).apply)
    return cfg, params, fwd


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def model(request):
    return _model(request.param)


def np_reference_logits(cfg: ModelConfig, params, tokens, positions, mask):
    """float64 numpy forward pass of one row with an explicit [L, L] mask."""
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), params["params"])

    def rms(x, scale):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * scale

    def rope(x):  # x [L, n, h]
        h = x.shape[-1]
        inv = 1.0 / cfg.rope_theta ** (np.arange(0, h, 2) / h)
        ang = positions[:, None].astype(np.float64) * inv  # [L, h/2]
        c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
        x1, x2 = x[..., : h // 2], x[..., h // 2 :]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    x = p["embed"][tokens]
    g = cfg.n_heads // cfg.n_kv_heads
    for layer in range(cfg.n_layers):
        lp = jax.tree.map(lambda a: a[layer], p["layers"])
        hN = rms(x, lp["attn_norm"]["scale"])
        q = rope(np.einsum("ld,dnh->lnh", hN, lp["attn"]["q"]))
        k = rope(np.einsum("ld,dkh->lkh", hN, lp["attn"]["k"]))
        v = np.einsum("ld,dkh->lkh", hN, lp["attn"]["v"])
        out = np.zeros_like(q)
        for head in range(cfg.n_heads):
            kv = head // g
            sc = q[:, head] @ k[:, kv].T / np.sqrt(cfg.head_dim)
            sc = np.where(mask, sc, -np.inf)
            pr = np.exp(sc - sc.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            out[:, head] = pr @ v[:, kv]
        x = x + np.einsum("lnh,nhd->ld", out, lp["attn"]["o"])
        hN = rms(x, lp["mlp_norm"]["scale"])
        a = hN @ lp["mlp"]["gate"]
        x = x + ((a / (1 + np.exp(-a))) * (hN @ lp["mlp"]["up"])) @ lp["mlp"]["down"]
    x = rms(x, p["final_norm"]["scale"])
    unembed = p["embed"].T if cfg.tie_embeddings else p["unembed"]
    return x @ unembed


def test_config_validates():
    with pytest.raises(ValueError, match="n_kv_heads"):
        model_config_tiny(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="dtype"):
        model_config_tiny(dtype="float64x")
    with pytest.raises(ValueError, match="d_model"):
        model_config_tiny(d_model=0)
    with pytest.raises(ValueError, match="head_dim"):
        model_config_tiny(head_dim=7)
    with pytest.raises(TypeError):
        ModelConfig(64, 32, 2, 4, 2, 8, 64)  # kw_only
    cfg = model_config_tiny()
    with pytest.raises(Exception):
        cfg.d_model = 3  # frozen


@pytest.mark.parametrize("tie", [True, False])
def test_every_param_has_logical_axes(tie):
    cfg = model_config_tiny(tie_embeddings=tie)
    boxed = jax.eval_shape(lambda k: init_boxed(cfg, k), jax.random.key(0))
    leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    assert leaves and all(isinstance(x, nn.Partitioned) for x in leaves)
    for leaf in leaves:
        assert len(leaf.names) == leaf.value.ndim
        assert set(leaf.names) <= LOGICAL_NAMES
    specs = param_logical_axes(cfg)
    plain = jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))
    assert jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)) == (
        jax.tree.structure(plain)
    )
    assert specs["params"]["layers"]["attn"]["q"] == jax.sharding.PartitionSpec("layers", "embed", "heads", "head_dim")
    assert ("unembed" in specs["params"]) == (not tie)


def test_mask_matches_numpy_reference():
    rng = np.random.default_rng(0)
    seg = np.sort(rng.integers(0, 3, (2, 12)), axis=1).astype(np.int32)
    sub = np.minimum(np.arange(12)[None] + rng.integers(1, 6, (2, 12)), 12).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(tree_attention_mask(jnp.asarray(seg), jnp.asarray(sub))),
                                  tree_attention_mask_np(seg, sub))


def test_forward_matches_float64_reference(model):
    cfg, params, fwd = model
    rng = np.random.default_rng(0)
    L = 12
    tokens = rng.integers(0, cfg.vocab_size, (1, L)).astype(np.int32)
    # Non-contiguous positions and a branching mask exercise RoPE and the tree rule.
    positions = np.array([[0, 1, 2, 3, 4, 3, 4, 5, 0, 1, 2, 2]], np.int32)
    seg = np.array([[1] * 8 + [2] * 4], np.int32)
    sub = np.array([[8, 8, 8, 5, 5, 8, 8, 8, 12, 12, 11, 12]], np.int32)
    logits = np.asarray(fwd(params, tokens, positions, seg, sub))
    ref = np_reference_logits(cfg, params, tokens[0], positions[0], tree_attention_mask_np(seg[0], sub[0]))
    np.testing.assert_allclose(logits[0], ref, atol=2e-5, rtol=0)


def test_return_hidden_gives_logits(model):
    cfg, params, fwd = model
    L = 6
    args = (jnp.arange(L)[None] % cfg.vocab_size, jnp.arange(L)[None], jnp.ones((1, L), jnp.int32), jnp.full((1, L), L))
    logits = fwd(params, *args)
    hidden, unembed = jax.jit(lambda p, *a: Transformer(cfg).apply(p, *a, return_hidden=True))(params, *args)
    assert hidden.shape == (1, L, cfg.d_model) and unembed.shape == (cfg.d_model, cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(hidden @ unembed), np.asarray(logits), atol=1e-5)


def test_logits_temperature_is_the_policy_both_ways(model):
    """logits_temperature=T: the full logits and the hidden @ unembed of the chunked loss are both the
    float64 reference's logits / T (the policy the engines sample at temperature 1 and training scores)."""
    cfg, params, _ = model
    hot = cfg.replace(logits_temperature=0.625)
    L = 6
    tokens = (np.arange(L, dtype=np.int32) * 7 % cfg.vocab_size)[None]
    args = (tokens, np.arange(L, dtype=np.int32)[None], np.ones((1, L), np.int32), np.full((1, L), L, np.int32))
    ref = np_reference_logits(cfg, params, tokens[0], args[1][0], tree_attention_mask_np(args[2][0], args[3][0]))
    logits = jax.jit(Transformer(hot).apply)(params, *args)
    hidden, unembed = jax.jit(lambda p, *a: Transformer(hot).apply(p, *a, return_hidden=True))(params, *args)
    np.testing.assert_allclose(np.asarray(logits)[0], ref / 0.625, atol=4e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(hidden @ unembed)[0], ref / 0.625, atol=4e-5, rtol=0)
    with pytest.raises(ValueError, match="logits_temperature must be > 0"):
        cfg.replace(logits_temperature=0.0)


@pytest.mark.slow  # ~12 s of compiles
def test_bfloat16_and_remat():
    cfg, params, fwd = _model(True)
    L = 8
    args = (jnp.arange(L)[None] + 3, jnp.arange(L)[None], jnp.ones((1, L), jnp.int32), jnp.full((1, L), L))
    l32 = fwd(params, *args)
    l16 = jax.jit(Transformer(cfg.replace(dtype="bfloat16")).apply)(params, *args)
    assert l16.dtype == jnp.float32 and np.isfinite(np.asarray(l16)).all()
    assert float(jnp.abs(l16 - l32).max()) < 0.1
    # Stored params follow param_dtype (checked abstractly: no extra compile).
    bf = jax.eval_shape(lambda k: init_params(cfg.replace(param_dtype="bfloat16"), k), jax.random.key(0))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(bf))
    # Rematerialisation changes memory, not math.
    def grads(c):
        return jax.jit(jax.grad(lambda p: jnp.sum(Transformer(c).apply(p, *args) ** 2)))(params)

    chex.assert_trees_all_close(grads(cfg.replace(remat=True, attention_impl="dense")),
                                grads(cfg.replace(attention_impl="dense")), rtol=1e-5, atol=1e-6)
    # Blockwise: XLA fuses the recomputed tiles differently, so float32 sums reassociate;
    # gradient entries here are O(5), so atol 1e-5 is ~2e-6 of the leaf's scale.
    chex.assert_trees_all_close(grads(cfg.replace(remat=True)), grads(cfg), rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_named(model):
    """Shape and dtype contracts of the forward pass (chex, at trace time) name the argument."""
    cfg, params, fwd = model
    t = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(AssertionError, match="Transformer: tokens must be"):
        fwd(params, t[0], t[0], t[0], t[0])
    with pytest.raises(AssertionError, match="Transformer: subtree_end must be"):
        fwd(params, t, t, t, t[:, :3])
    with pytest.raises(AssertionError, match="Transformer: positions must be integers"):
        fwd(params, t, t.astype(jnp.float32), t, t)
