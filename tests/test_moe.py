"""Mixture of experts (model/moe.py): grouped-matmul experts equal the dense reference and a
per-token numpy reference; tree-packed forward and grads; KV-cache decode; HF's aux loss."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gyre_jax.model import Transformer, init_params, model_config_tiny, moe
from gyre_jax.model import decode as dec
from gyre_jax.model.transformer import moe_stats

ATOL = 1e-5
E, K, F = 4, 2, 16


def moe_config(**over):
    base = dict(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=F)
    base.update(over)
    return model_config_tiny(**base)


def tree_row():
    """Two packed trees and padding: tree 1 is a 4-token prefix with two 3-token branches, tree 2 a 5-token path."""
    L = 20
    seg = np.zeros(L, np.int32)
    pos = np.zeros(L, np.int32)
    end = np.arange(1, L + 1, dtype=np.int32)
    seg[:10], pos[:4], end[:4] = 1, np.arange(4), 10  # prefix: seen by both branches
    pos[4:7], end[4:7] = 4 + np.arange(3), 7  # branch A
    pos[7:10], end[7:10] = 4 + np.arange(3), 10  # branch B (same positions as A)
    seg[10:15], pos[10:15], end[10:15] = 2, np.arange(5), 15
    toks = np.random.default_rng(0).integers(1, 128, (2, L)).astype(np.int32)
    return toks, np.stack([pos, pos]), np.stack([seg, seg]), np.stack([end, end])


def numpy_moe(x_NxD, p, k, norm):
    """Per token: softmax router, top k, weighted SwiGLU experts (HF's Qwen3MoeSparseMoeBlock, in numpy)."""
    x = np.asarray(x_NxD, np.float64)
    logits = x @ np.asarray(p["router"], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        top = np.argsort(-probs[n], kind="stable")[:k]
        w = probs[n, top] / (probs[n, top].sum() if norm else 1.0)
        for e, we in zip(top, w):
            g = x[n] @ np.asarray(p["gate"][e], np.float64)
            h = g / (1 + np.exp(-g)) * (x[n] @ np.asarray(p["up"][e], np.float64))
            out[n] += we * (h @ np.asarray(p["down"][e], np.float64))
    return out


@pytest.mark.parametrize("norm", [True, False])
def test_experts_equal_per_token_reference(norm):
    cfg = moe_config(norm_topk_prob=norm)
    x = jax.random.normal(jax.random.key(1), (2, 6, cfg.d_model))
    block = moe.MoE(cfg)
    variables = nn.unbox(block.init(jax.random.key(2), x))
    p = jax.tree.map(np.asarray, variables["params"])
    want = numpy_moe(np.asarray(x).reshape(12, -1), p, K, norm)
    for impl in ("ragged", "dense"):
        y, stats = moe.MoE(cfg.replace(moe_impl=impl)).apply(variables, x)
        np.testing.assert_allclose(np.asarray(y).reshape(12, -1), want, atol=ATOL, rtol=0, err_msg=impl)
        assert float(stats.tokens) == 12 and float(stats.count_E.sum()) == 12 * K


@pytest.fixture(scope="module")
def packed():
    cfg = moe_config(mlp_only_layers=(0,))  # layer 0 dense, layer 1 MoE: two stacks
    params = init_params(cfg, jax.random.key(3))
    return cfg, params, tree_row()


def _loss(cfg):
    model = Transformer(cfg)

    def f(params, toks, pos, seg, end):
        logits, inter = model.apply(params, toks, pos, seg, end, mutable=["intermediates"])
        logp = jax.nn.log_softmax(logits)
        tgt = jnp.roll(toks, -1, axis=1)
        nll = -jnp.take_along_axis(logp, tgt[..., None], -1)[..., 0] * (seg > 0)
        return jnp.sum(nll) / jnp.sum(seg > 0) + moe.load_balancing_loss(moe_stats(inter), cfg.num_experts)

    return jax.jit(jax.value_and_grad(f))


def test_ragged_forward_and_grads_equal_dense_reference_in_packed_rows(packed):
    cfg, params, row = packed
    assert [r[0] for r in cfg.layer_runs()] == ["layers_0", "layers_1"]
    loss_r, g_r = _loss(cfg)(params, *row)
    loss_d, g_d = _loss(cfg.replace(moe_impl="dense"))(params, *row)
    np.testing.assert_allclose(float(loss_r), float(loss_d), atol=ATOL, rtol=0)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_r), jax.tree.leaves(g_d)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=ATOL, rtol=0,
                                   err_msg=jax.tree_util.keystr(path))
    router_grad = g_r["params"]["layers_1"]["moe"]["router"]
    assert float(jnp.abs(router_grad).max()) > 0  # the router trains (through weights and the aux loss)


def test_packed_logprobs_equal_each_path_alone(packed):
    """Exact context with MoE: a branch's logits in the packed row equal running its path alone."""
    cfg, params, (toks, pos, seg, end) = packed
    fwd = jax.jit(Transformer(cfg).apply)
    full = np.asarray(fwd(params, toks, pos, seg, end))
    path_b = np.concatenate([np.arange(4), np.arange(7, 10)])  # prefix + branch B
    n = len(path_b)
    alone = np.asarray(fwd(params, toks[:, path_b], np.tile(np.arange(n, dtype=np.int32), (2, 1)),
                           np.ones((2, n), np.int32), np.full((2, n), n, np.int32)))
    np.testing.assert_allclose(full[:, path_b], alone, atol=ATOL, rtol=0)


def test_decode_with_moe_equals_full_forward(packed):
    cfg, params, _ = packed
    seq = np.random.default_rng(5).integers(1, cfg.vocab_size, 9).astype(np.int32)
    n = len(seq)
    ref = np.asarray(jax.jit(Transformer(cfg).apply)(
        params, seq[None], np.arange(n, dtype=np.int32)[None], np.ones((1, n), np.int32),
        np.full((1, n), n, np.int32)))[0]
    logits, kv = dec.prefill(params, cfg, jnp.asarray(seq[:5]))
    np.testing.assert_allclose(np.asarray(logits), ref[4], atol=ATOL, rtol=0)
    cache = dec.insert(dec.init_cache(cfg, 2, 16), kv, 1)
    step = jax.jit(dec.decode_step, static_argnums=1)
    for t in range(5, n):
        logits, cache = step(params, cfg, jnp.asarray([0, seq[t]], jnp.int32), cache, jnp.asarray([False, True]))
        np.testing.assert_allclose(np.asarray(logits[1]), ref[t], atol=ATOL, rtol=0)


def test_load_balancing_loss_matches_hf_formula():
    """HF's load_balancing_loss_func over the layers' concatenated router probabilities, in numpy."""
    rng = np.random.default_rng(0)
    y, n = 3, 10
    probs = rng.dirichlet(np.ones(E), size=(y, n))
    valid = rng.random(n) > 0.3
    top = np.argsort(-probs, axis=-1, kind="stable")[..., :K]
    stats = moe.MoEStats(
        count_E=jnp.asarray([(np.eye(E)[top[i]].sum(1) * valid[:, None]).sum(0) for i in range(y)], jnp.float32),
        prob_E=jnp.asarray((probs * valid[None, :, None]).sum(1), jnp.float32),
        tokens=jnp.full((y,), valid.sum(), jnp.float32))
    flat_p = probs[:, valid].reshape(-1, E)  # HF: concatenate layers, keep real tokens, means over all
    flat_mask = np.eye(E)[top[:, valid].reshape(-1, K)]  # [Y*n, K, E]
    want = E * np.sum(flat_mask.mean(0) * flat_p.mean(0)[None])
    np.testing.assert_allclose(float(moe.load_balancing_loss(stats, E)), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(moe.expert_load(stats)).sum(-1), 1.0, rtol=1e-6)


def test_dense_model_keeps_its_param_tree():
    cfg = model_config_tiny()
    assert cfg.layer_runs() == (("layers", 0, cfg.n_layers, False),)
    abstract = jax.eval_shape(init_params, cfg, jax.random.key(0))["params"]
    assert set(abstract) == {"embed", "final_norm", "layers"}
    assert set(abstract["layers"]) == {"attn", "attn_norm", "mlp", "mlp_norm"}


def test_moe_config_errors_name_the_field():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        moe_config(num_experts_per_tok=5)
    with pytest.raises(ValueError, match="mlp_only_layers"):
        moe_config(mlp_only_layers=(7,))
    with pytest.raises(ValueError, match="moe_impl"):
        moe_config(moe_impl="sparse")


def test_policy_loss_adds_the_weighted_aux_loss_and_reports_load():
    from gyre_jax.cells.loss import policy_loss_fn
    from tests.test_long_context import _policy_batch

    cfg = moe_config()
    params = init_params(cfg, jax.random.key(4))
    mb = _policy_batch(32, 2, seed=1)
    (l0, m0), (l1, m1) = (jax.jit(policy_loss_fn(cfg.replace(router_aux_loss_coef=c)))(params, mb) for c in (0.0, 0.5))
    assert float(m0["moe_aux_loss"]) > 0 and 1.0 <= float(m0["moe_max_load"]) <= E
    np.testing.assert_allclose(float(l1) - float(l0), 0.5 * float(m0["moe_aux_loss"]), rtol=1e-5)
    share = float(m0["weight_sum"])
    assert 0 < share  # the aux term is weighted by the micro-batch's share of the step
    dense_metrics = jax.jit(policy_loss_fn(model_config_tiny()))(init_params(model_config_tiny(), jax.random.key(4)),
                                                                 mb)[1]
    assert "moe_aux_loss" not in dense_metrics
