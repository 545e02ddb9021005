"""The packed-row loss equals an independent float64 per-path reference, loss and gradient.

Rollouts are trees of TreeNodes (a retry, a nested branch, a compaction with a
new context, a sub-agent with its own root, random trees). The "model" is any
function of the exact context: logits = f(context tokens). The packed side finds
each position's context through the tree attention mask; the reference walks
root-to-leaf paths of the TreeNodes, counts each trainable token once by its
(rollout, node, offset), and computes the clipped-ratio loss, KL and entropy
terms and their analytic gradient in float64 with plain loops.
"""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gyre_jax.losses import (
    PolicyLossConfig,
    combine_metrics,
    loss_from_hidden,
    loss_from_logits,
    rollout_token_mean_weights,
)
from gyre_jax.trajectory.node import TreeNode
from gyre_jax.trajectory.serialize import pack_rows, serialize_tree, tree_attention_mask_np

V = 48  # vocab
ROW_LEN = 48
LOGIT_SCALE = 0.6
ADVANTAGES = (1.3, -0.7, 0.4, -1.1)


# ----------------------------------------------------------------------------- data


def _span(rng, n, trainable, **meta):
    trainable = np.broadcast_to(np.asarray(trainable, bool), (n,)).copy()
    lp = (-np.log(V) + 0.5 * rng.standard_normal(n)).astype(np.float32)
    return TreeNode(
        tokens=rng.integers(1, V, n), trainable=trainable, logprobs=np.where(trainable, lp, 0.0), **meta
    )


def _random_tree(rng, max_depth=2, max_tokens=40):
    while True:
        def make(depth):
            n = int(rng.integers(1, 6))
            node = _span(rng, n, rng.random(n) < 0.7)
            if depth < max_depth:
                k = int(rng.choice([0, 1, 2, 3], p=[0.2, 0.4, 0.3, 0.1]))
                node.children = [make(depth + 1) for _ in range(k)]
            return node

        root = make(0)
        if root.num_tokens() <= max_tokens:
            return root


def make_rollouts(seed=0):
    """Four rollouts, each a list of tree roots (a new context is a new root)."""
    rng = np.random.default_rng(seed)
    # Rollout 0: a retry (two outputs for one prompt), one of them branching again
    # (nested), then a compaction: a summary context with its own continuation.
    retry_a = _span(rng, 4, True, children=[_span(rng, 3, False, children=[_span(rng, 3, True)])])
    retry_b = _span(
        rng, 4, True,
        children=[_span(rng, 2, False, children=[_span(rng, 2, True), _span(rng, 3, [True, False, True])])],
    )
    main0 = _span(rng, 5, False, children=[retry_a, retry_b])
    compact0 = _span(rng, 4, False, role="summary", children=[_span(rng, 5, True, role="summary")])
    # Rollout 1: main agent and a sub-agent with its own root.
    main1 = _span(rng, 4, False, children=[_span(rng, 3, True, children=[_span(rng, 2, False, children=[_span(rng, 4, True)])])])
    sub1 = _span(rng, 3, False, role="subagent", children=[_span(rng, 5, True, role="subagent")])
    return [[main0, compact0], [main1, sub1], [_random_tree(rng)], [_random_tree(rng), _random_tree(rng)]]


def _ctx_logits(ctx):
    rng = np.random.default_rng([7, len(ctx), *ctx])
    return (LOGIT_SCALE * rng.standard_normal(V)).astype(np.float32)


def _ref_logp(ctx, target):
    rng = np.random.default_rng([11, len(ctx), *ctx, target])
    return np.float32(-np.log(V) + 0.5 * rng.standard_normal())


def pack(rollouts):
    """Serialize, first-fit into rows; per-position context from the attention mask."""
    placed, rows, fill = [], [], []
    for r, roots in enumerate(rollouts):
        for root in roots:
            st = serialize_tree(root)
            assert len(st) <= ROW_LEN
            row = next((i for i, f in enumerate(fill) if f + len(st) <= ROW_LEN), None)
            if row is None:
                rows.append([]), fill.append(0)
                row = len(rows) - 1
            placed.append((row, fill[row], len(st), r))
            rows[row].append(st)
            fill[row] += len(st)
    packed = pack_rows(rows, ROW_LEN)
    b = len(rows)
    rollout_ids = np.full((b, ROW_LEN), -1, np.int32)
    for row, start, n, r in placed:
        rollout_ids[row, start : start + n] = r
    packed.advantages[:] = np.where(rollout_ids >= 0, np.asarray(ADVANTAGES, np.float32)[rollout_ids], 0.0)
    packed.loss_weights[:] = rollout_token_mean_weights(packed.loss_mask, rollout_ids, len(rollouts))
    mask = tree_attention_mask_np(packed.segment_ids, packed.subtree_end)
    contexts = [[tuple(int(t) for t in packed.tokens[i, mask[i, j]]) for j in range(ROW_LEN)] for i in range(b)]
    logits = np.zeros((b, ROW_LEN, V), np.float32)
    ref = np.zeros((b, ROW_LEN), np.float32)
    for i in range(b):
        for j in range(ROW_LEN):
            logits[i, j] = _ctx_logits(contexts[i][j])
            if packed.loss_mask[i, j]:
                ref[i, j] = _ref_logp(contexts[i][j], int(packed.targets[i, j]))
    return packed, rollout_ids, contexts, logits, ref


# ----------------------------------------------------------------------------- reference


def reference(rollouts, cfg: PolicyLossConfig):
    """float64, plain loops over rollouts and root-to-leaf paths."""
    targets = {}  # (rollout, node id, offset) -> (context, target, behavior logp)
    for r, roots in enumerate(rollouts):
        for root in roots:
            for path in root.root_to_leaf_paths():
                toks, where = [], []
                for node in path:
                    for k in range(node.tokens.shape[0]):
                        toks.append(int(node.tokens[k]))
                        where.append((node, k))
                for k in range(1, len(toks)):
                    node, off = where[k]
                    if node.trainable[off]:
                        key = (r, id(node), off)  # counted once, however many paths share it
                        targets.setdefault(key, (tuple(toks[:k]), toks[k], float(node.logprobs[off])))
    num_r = len(rollouts)
    n_r = np.zeros(num_r)
    for r, _, _ in targets:
        n_r[r] += 1
    loss, grads = 0.0, {}
    m = dict(pg_loss=0.0, approx_kl=0.0, clip_frac_low=0.0, clip_frac_high=0.0, clip_frac_dual=0.0,
             clamp_frac=0.0, ratio_mean=0.0, kl_ref=0.0, entropy=0.0, weight_sum=0.0, ratio_min=np.inf,
             ratio_max=-np.inf)
    for (r, _, _), (ctx, t, mu) in targets.items():
        x = _ctx_logits(ctx).astype(np.float64)
        lse = np.log(np.sum(np.exp(x - x.max()))) + x.max()
        logp_v = x - lse
        p = np.exp(logp_v)
        ent = -np.sum(p * logp_v)
        logp = logp_v[t]
        a = ADVANTAGES[r]
        w = 1.0 / (n_r[r] * num_r)
        clamped = abs(logp - mu) > cfg.log_ratio_clamp
        u = min(max(logp - mu, -cfg.log_ratio_clamp), cfg.log_ratio_clamp)
        ratio = np.exp(u)
        clipped = min(max(ratio, 1 - cfg.loss_options.eps_low), 1 + cfg.loss_options.eps_high)
        pg = -min(ratio * a, clipped * a)
        clip_low = a < 0 and ratio < 1 - cfg.loss_options.eps_low
        clip_high = a > 0 and ratio > 1 + cfg.loss_options.eps_high
        clip_dual = bool(cfg.loss_options.clip_c) and a < 0 and ratio > cfg.loss_options.clip_c
        if clip_dual:
            pg = -cfg.loss_options.clip_c * a
        dpg = 0.0 if (clip_low or clip_high or clip_dual or clamped) else -a * ratio
        ref = float(_ref_logp(ctx, t))
        d = ref - logp
        kl, dkl = {
            "k1": (logp - ref, 1.0),
            "k2": (0.5 * d * d, -d),
            "k3": (np.exp(d) - 1 - d, 1.0 - np.exp(d)),
        }[cfg.kl_estimator]
        loss += w * (pg + cfg.kl_coef * kl - cfg.entropy_coef * ent)
        onehot = np.zeros(V)
        onehot[t] = 1.0
        dlogp_dx = onehot - p
        dent_dx = -p * (logp_v + ent)
        g = w * ((dpg + cfg.kl_coef * dkl) * dlogp_dx - cfg.entropy_coef * dent_dx)
        grads[(r, ctx)] = grads.get((r, ctx), 0.0) + g
        m["pg_loss"] += w * pg
        m["approx_kl"] += w * (ratio - 1 - u)
        m["clip_frac_low"] += w * clip_low
        m["clip_frac_high"] += w * clip_high
        m["clip_frac_dual"] += w * clip_dual
        m["clamp_frac"] += w * clamped
        m["ratio_mean"] += w * ratio
        m["kl_ref"] += w * kl
        m["entropy"] += w * ent
        m["weight_sum"] += w
        m["ratio_min"] = min(m["ratio_min"], ratio)
        m["ratio_max"] = max(m["ratio_max"], ratio)
    m["num_tokens"] = float(len(targets))
    m["clip_frac"] = m["clip_frac_low"] + m["clip_frac_high"] + m["clip_frac_dual"]
    m["loss"] = loss
    return loss, grads, m


# ----------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def data():
    rollouts = make_rollouts()
    return (rollouts, *pack(rollouts))


@functools.lru_cache(maxsize=None)
def _loss_and_grad(cfg):
    def f(logits, batch, ref):
        return loss_from_logits(logits, batch, cfg, ref_logprobs_BxL=ref, vocab_chunk_size=20)

    return jax.jit(jax.value_and_grad(f, has_aux=True))


CONFIGS = [
    PolicyLossConfig.create(),
    PolicyLossConfig.create(kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01),
    PolicyLossConfig.create(eps_low=0.1, eps_high=0.5, kl_coef=0.3, kl_estimator="k2", entropy_coef=0.02),
    PolicyLossConfig.create(eps_low=0.3, eps_high=0.3, kl_coef=0.05, kl_estimator="k1"),
    # Dual clip at r > 2 (the data has A < 0 tokens there), and a clamp of |log r| <= 1
    # that acts on the branches the clip leaves open (A > 0, r < 1/e; A < 0, r > e).
    PolicyLossConfig.create(clip_c=2.0, kl_coef=0.1, entropy_coef=0.01),
    PolicyLossConfig.create(log_ratio_clamp=1.0, kl_coef=0.1),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["plain", "k3+ent", "k2+ent", "k1", "dual_clip", "clamp"])
def test_loss_grad_metrics_match_float64_reference(data, cfg):
    rollouts, packed, rollout_ids, contexts, logits, ref = data
    (loss, metrics), grad = _loss_and_grad(cfg)(logits, packed.as_dict(), ref)
    ref_loss, ref_grads, ref_m = reference(rollouts, cfg)

    # The data must exercise every branch of the clipped surrogate.
    assert ref_m["clip_frac_low"] > 0.03 and ref_m["clip_frac_high"] > 0.03
    assert ref_m["clip_frac"] < 0.8
    assert (ref_m["clip_frac_dual"] > 0.02) == bool(cfg.loss_options.clip_c)
    assert (ref_m["clamp_frac"] > 0.02) == (cfg.log_ratio_clamp < 20)

    np.testing.assert_allclose(float(loss), ref_loss, rtol=2e-6, atol=1e-7)
    for k, v in ref_m.items():
        np.testing.assert_allclose(float(metrics[k]), v, rtol=2e-6, atol=1e-7, err_msg=k)
    assert float(metrics["weight_outside_mask"]) == 0.0

    grad = np.asarray(grad, np.float64)
    got = {}
    for i in range(grad.shape[0]):
        for j in range(grad.shape[1]):
            if packed.loss_mask[i, j]:
                key = (int(rollout_ids[i, j]), contexts[i][j])
                got[key] = got.get(key, 0.0) + grad[i, j]
            else:  # no loss there, so exactly no gradient
                assert not grad[i, j].any(), (i, j)
    assert got.keys() == ref_grads.keys()
    scale = max(np.abs(g).max() for g in ref_grads.values())
    for key, g in ref_grads.items():
        np.testing.assert_allclose(got[key], g, rtol=0, atol=1e-5 * scale, err_msg=str(key[0]))


def test_reference_counts_shared_tokens_once(data):
    # The trees share prefixes: expanding every path would count more targets.
    rollouts, packed, *_ = data
    _, _, m = reference(rollouts, PolicyLossConfig.create())
    per_path = sum(
        sum(int(n.trainable.sum()) for n in path) - int(path[0].trainable[0])
        for roots in rollouts
        for root in roots
        for path in root.root_to_leaf_paths()
    )
    assert m["num_tokens"] == packed.loss_mask.sum() < per_path


# ----------------------------------------------------------------------------- micro-batches


D = 8


def _params(seed=1):
    rng = np.random.default_rng(seed)
    return {
        "embed_VxD": jnp.asarray(rng.standard_normal((V, D)), jnp.float32),
        "pos_PxD": jnp.asarray(0.3 * rng.standard_normal((ROW_LEN, D)), jnp.float32),
        "unembed_DxV": jnp.asarray(0.5 * rng.standard_normal((D, V)), jnp.float32),
    }


def _hidden(params, batch):
    return jnp.tanh(params["embed_VxD"][batch["tokens"]] + params["pos_PxD"][batch["positions"]])


CFG_MB = PolicyLossConfig.create(kl_coef=0.1, entropy_coef=0.01)


@jax.jit
def _grad_logits_path(params, batch, ref):
    def f(p):
        logits = _hidden(p, batch) @ p["unembed_DxV"]
        return loss_from_logits(logits, batch, CFG_MB, ref_logprobs_BxL=ref)

    return jax.value_and_grad(f, has_aux=True)(params)


@jax.jit
def _grad_hidden_path(params, batch, ref):
    def f(p):
        return loss_from_hidden(_hidden(p, batch), p["unembed_DxV"], batch, CFG_MB, chunk_size=24, ref_logprobs_BxL=ref)

    return jax.value_and_grad(f, has_aux=True)(params)


@pytest.mark.parametrize("path", ["logits", "chunked_hidden"])
def test_micro_batches_sum_to_the_full_step(data, path):
    _, packed, _, _, _, ref = data
    fn = _grad_logits_path if path == "logits" else _grad_hidden_path
    params = _params()
    batch = {k: jnp.asarray(v) for k, v in packed.as_dict().items()}
    (loss, metrics), grads = fn(params, batch, ref)
    b = packed.tokens.shape[0]
    assert b >= 3
    order = np.random.default_rng(0).permutation(b)  # any split, any order
    acc_loss, acc_m, acc_g = 0.0, None, None
    for i in order:
        mb = {k: v[i : i + 1] for k, v in batch.items()}
        (l, m), g = fn(params, mb, ref[i : i + 1])
        acc_loss += l
        acc_m = m if acc_m is None else combine_metrics(acc_m, m)
        acc_g = g if acc_g is None else jax.tree.map(jnp.add, acc_g, g)
    np.testing.assert_allclose(acc_loss, loss, rtol=1e-6)
    chex.assert_trees_all_close(acc_m, metrics, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(metrics["weight_sum"]), 1.0, rtol=1e-6)
    for k in grads:
        scale = float(jnp.abs(grads[k]).max())
        assert scale > 0
        np.testing.assert_allclose(acc_g[k], grads[k], rtol=0, atol=1e-5 * scale, err_msg=k)


def test_chunked_hidden_path_equals_logits_path(data):
    _, packed, _, _, _, ref = data
    params = _params(2)
    batch = {k: jnp.asarray(v) for k, v in packed.as_dict().items()}
    (l1, m1), g1 = _grad_logits_path(params, batch, ref)
    (l2, m2), g2 = _grad_hidden_path(params, batch, ref)
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
    chex.assert_trees_all_close(m2, m1, rtol=1e-5, atol=1e-7)
    for k in g1:
        np.testing.assert_allclose(g2[k], g1[k], rtol=0, atol=1e-5 * float(jnp.abs(g1[k]).max()), err_msg=k)
