"""Unit tests of gyre_jax.losses: log-probs, entropy, chunking, memory, masking, extreme log-ratios,
dual clip, weights, import cost."""
import functools
import os
import pathlib
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gyre_jax.losses as L

F32 = jnp.float32


def _np_logsoftmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))


# ----------------------------------------------------------------------------- logprobs / entropy


@jax.jit
def _lp_ent_grads(x, t, c_lp, c_ent):
    def f(x):
        lp, ent = L.token_logprobs_and_entropy(x, t, vocab_chunk_size=7)
        return jnp.sum(c_lp * lp) + jnp.sum(c_ent * ent), (lp, ent)

    return jax.grad(f, has_aux=True)(x)


@jax.jit
def _single_entry_points(x, t):
    return L.token_logprobs(x, t, vocab_chunk_size=7), L.token_entropy(x, vocab_chunk_size=None)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_logprobs_entropy_and_grads_match_float64(dtype):
    rng = np.random.default_rng(0)
    b, l, v = 2, 5, 30  # 30 = 4 chunks of 7 + a remainder of 2
    x = jnp.asarray(2.0 * rng.standard_normal((b, l, v)), dtype)
    t = jnp.asarray(rng.integers(0, v, (b, l)), jnp.int32)
    c_lp = jnp.asarray(rng.standard_normal((b, l)), F32)
    c_ent = jnp.asarray(rng.standard_normal((b, l)), F32)
    g, (lp, ent) = _lp_ent_grads(x, t, c_lp, c_ent)
    assert lp.dtype == ent.dtype == F32 and g.dtype == dtype

    xs = np.asarray(x.astype(F32), np.float64)  # the exact values the function saw
    ls = _np_logsoftmax(xs)
    p = np.exp(ls)
    tt = np.asarray(t)
    ref_lp = np.take_along_axis(ls, tt[..., None], -1)[..., 0]
    ref_ent = -(p * ls).sum(-1)
    # Internal math is float32 for every input dtype: errors are f32 rounding only.
    np.testing.assert_allclose(lp, ref_lp, rtol=0, atol=2e-6)
    np.testing.assert_allclose(ent, ref_ent, rtol=0, atol=2e-6)
    onehot = np.eye(v)[tt]
    ref_g = np.asarray(c_lp)[..., None] * (onehot - p) + np.asarray(c_ent)[..., None] * (-p * (ls + ref_ent[..., None]))
    # The gradient is rounded once, to the logits' dtype.
    tol = 2e-6 if dtype == jnp.float32 else 2.0 ** -8
    np.testing.assert_allclose(np.asarray(g.astype(F32)), ref_g, rtol=tol, atol=1e-6)

    # The single-function entry points agree with the combined one.
    lp1, ent1 = _single_entry_points(x, t)
    np.testing.assert_array_equal(lp1, lp)
    np.testing.assert_allclose(ent1, ent, rtol=0, atol=2e-6)


def test_input_errors_name_the_problem():
    x = jnp.zeros((2, 3, 5))
    # Shape and dtype contracts are chex assertions naming the argument.
    with pytest.raises(AssertionError, match="token_logprobs: targets must have the logits' shape"):
        L.token_logprobs(x, jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(AssertionError, match="integer token ids"):
        L.token_logprobs(x, jnp.zeros((2, 3), F32))
    with pytest.raises(AssertionError, match="token_entropy: logits must be floating point"):
        L.token_entropy(jnp.zeros((2, 3, 5), jnp.int32))
    with pytest.raises(AssertionError, match="chunked_token_logprobs: hidden must be"):
        L.chunked_token_logprobs(jnp.zeros((3, 4)), jnp.zeros((4, 5)), jnp.zeros((3,), jnp.int32), chunk_size=2)
    with pytest.raises(ValueError, match="vocab_chunk_size"):
        L.token_logprobs(x, jnp.zeros((2, 3), jnp.int32), vocab_chunk_size=0)
    h = jnp.zeros((2, 3, 4))
    with pytest.raises(ValueError, match="cannot tell the layout"):
        L.chunked_token_logprobs(h, jnp.zeros((4, 4)), jnp.zeros((2, 3), jnp.int32), chunk_size=2)
    with pytest.raises(ValueError, match="does not match"):
        L.chunked_token_logprobs(h, jnp.zeros((5, 7)), jnp.zeros((2, 3), jnp.int32), chunk_size=2, layout="DxV")


@pytest.mark.parametrize("layout", ["DxV", "VxD"])
def test_chunked_equals_plain_values_and_grads(layout):
    rng = np.random.default_rng(1)
    b, l, d, v = 2, 11, 6, 17  # chunk 4 does not divide 11
    h = jnp.asarray(rng.standard_normal((b, l, d)), F32)
    w_dxv = jnp.asarray(rng.standard_normal((d, v)), F32)
    w = w_dxv if layout == "DxV" else w_dxv.T
    t = jnp.asarray(rng.integers(0, v, (b, l)), jnp.int32)
    c = jnp.asarray(rng.standard_normal((2, b, l)), F32)

    def plain(h, w):
        lp, ent = L.token_logprobs_and_entropy(h @ (w if layout == "DxV" else w.T), t)
        return jnp.sum(c[0] * lp + c[1] * ent)

    def chunked(h, w):
        lp, ent = L.chunked_token_logprobs(h, w, t, chunk_size=4, layout=None, with_entropy=True)
        return jnp.sum(c[0] * lp + c[1] * ent)

    v1, g1 = jax.jit(jax.value_and_grad(plain, argnums=(0, 1)))(h, w)
    v2, g2 = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1)))(h, w)
    np.testing.assert_allclose(v2, v1, rtol=1e-6)
    for a, e in zip(g2, g1):
        np.testing.assert_allclose(a, e, rtol=0, atol=2e-6 * float(jnp.abs(e).max()))
    lp_only = jax.jit(lambda h, w: L.chunked_token_logprobs(h, w, t, chunk_size=100))(h, w)
    np.testing.assert_allclose(lp_only, jax.jit(L.token_logprobs)(h @ w_dxv, t), rtol=0, atol=2e-6)


# ----------------------------------------------------------------------------- memory


def _temp_bytes(fn, *shapes):
    return jax.jit(fn).lower(*shapes).compile().memory_analysis().temp_size_in_bytes


def test_no_float32_copy_of_the_logits():
    """XLA's compiled memory analysis: the float32 working set is one vocab chunk.

    A naive ``log_softmax(logits.astype(f32))`` needs a full f32 copy as a
    temporary (checked too, so this test can tell the difference).
    """
    b, l, v, chunk = 2, 32, 4 * 2048, 2048
    f32_copy = b * l * v * 4
    chunk_f32 = b * l * chunk * 4
    S = jax.ShapeDtypeStruct
    x16, t = S((b, l, v), jnp.bfloat16), S((b, l), jnp.int32)
    batch = {k: S((b, l), d) for k, d in [("targets", jnp.int32), ("loss_mask", bool),
             ("behavior_logprobs", F32), ("advantages", F32), ("loss_weights", F32)]}

    def naive(x, t):
        return jnp.take_along_axis(jax.nn.log_softmax(x.astype(F32)), t[..., None], -1)[..., 0]

    assert _temp_bytes(naive, x16, t) >= f32_copy

    # A whole training loss with entropy in it, forward and backward, bf16 logits.
    cfg = L.PolicyLossConfig.create(entropy_coef=0.01)
    step = jax.value_and_grad(lambda x, bt: L.loss_from_logits(x, bt, cfg, vocab_chunk_size=chunk), has_aux=True)
    step_temp = _temp_bytes(step, x16, batch)
    assert step_temp <= chunk_f32 + 64 * 1024, (step_temp, chunk_f32)

    # Forward only, float32 logits: one chunk of f32 temporaries, no copy.
    fwd32 = _temp_bytes(lambda x, t: L.token_logprobs_and_entropy(x, t, vocab_chunk_size=chunk), S((b, l, v), F32), t)
    assert fwd32 <= chunk_f32 + 64 * 1024, (fwd32, chunk_f32)

    # From hidden states: forward and backward hold O(chunk) logits, not [B, L, V].
    lq, d, c = 128, 16, 16
    h, w, tq = S((b, lq, d), F32), S((d, v), F32), S((b, lq), jnp.int32)
    chunked = jax.grad(lambda h, w, t: L.chunked_token_logprobs(h, w, t, chunk_size=c).sum(), argnums=(0, 1))
    chunked_temp = _temp_bytes(chunked, h, w, tq)
    assert chunked_temp <= 5 * (b * c * v * 4) + 64 * 1024 < b * lq * v * 4, (chunked_temp, b * lq * v * 4)


# ----------------------------------------------------------------------------- policy loss


def _pg_inputs(rng, shape):
    logp = -np.abs(rng.standard_normal(shape)).astype(np.float32) - 1.0
    return dict(
        logp_BxT=jnp.asarray(logp),
        behavior_logp_BxT=jnp.asarray(logp + 0.4 * rng.standard_normal(shape).astype(np.float32)),
        advantages_BxT=jnp.asarray(rng.standard_normal(shape).astype(np.float32)),
        weights_BxT=jnp.asarray((rng.random(shape) < 0.7) * rng.random(shape).astype(np.float32)),
        ref_logp_BxT=jnp.asarray(logp + 0.2 * rng.standard_normal(shape).astype(np.float32)),
        entropy_BxT=jnp.asarray(rng.random(shape).astype(np.float32)),
    )


PG_KW = dict(eps_low=0.2, eps_high=0.28, kl_coef=0.1, entropy_coef=0.01)


def test_vmap_and_jit_equal_a_loop():
    rng = np.random.default_rng(3)
    inp = _pg_inputs(rng, (4, 3, 9))  # 4 stacked micro-batches of [3, 9]

    def one(a):
        def f(lp):
            return L.policy_gradient_loss(lp, a["behavior_logp_BxT"], a["advantages_BxT"], a["weights_BxT"],
                                          ref_logp_BxT=a["ref_logp_BxT"], entropy_BxT=a["entropy_BxT"], **PG_KW)

        return jax.value_and_grad(f, has_aux=True)(a["logp_BxT"])

    (loss_v, m_v), g_v = jax.jit(jax.vmap(one))(inp)
    one_jit = jax.jit(one)
    for i in range(4):
        (loss, m), g = one_jit({k: v[i] for k, v in inp.items()})
        np.testing.assert_allclose(loss_v[i], loss, rtol=1e-6)
        np.testing.assert_allclose(g_v[i], g, rtol=1e-6, atol=1e-8)
        chex.assert_trees_all_close(jax.tree.map(lambda x: x[i], m_v), m, rtol=1e-6)
    # vmap of the vocab-chunked log-probs over an extra leading axis.
    x = jnp.asarray(rng.standard_normal((3, 2, 4, 19)), F32)
    t = jnp.asarray(rng.integers(0, 19, (3, 2, 4)), jnp.int32)
    lp_v = jax.jit(jax.vmap(lambda x, t: L.token_logprobs(x, t, vocab_chunk_size=5)))(x, t)
    lp = jax.jit(lambda x, t: L.token_logprobs(x, t, vocab_chunk_size=None))(x, t)
    np.testing.assert_allclose(lp_v, lp, rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_garbage_at_masked_positions_leaks_nothing(dtype):
    """-inf / +inf / NaN / huge logits and NaN inputs where the weight is 0."""
    rng = np.random.default_rng(4)
    b, l, v = 2, 6, 13
    logits = rng.standard_normal((b, l, v)).astype(np.float32)
    batch = {
        "targets": rng.integers(0, v, (b, l)).astype(np.int32),
        "loss_mask": np.ones((b, l), bool),
        "behavior_logprobs": (-2.0 - rng.random((b, l))).astype(np.float32),
        "advantages": rng.standard_normal((b, l)).astype(np.float32),
        "loss_weights": np.full((b, l), 1.0 / (b * l), np.float32),
    }
    ref = (-2.0 - rng.random((b, l))).astype(np.float32)
    masked = [(0, 1), (0, 5), (1, 0), (1, 2), (1, 3)]
    dirty_logits, dirty_batch, dirty_ref = logits.copy(), {k: x.copy() for k, x in batch.items()}, ref.copy()
    for (i, j), junk in zip(masked, [-np.inf, np.inf, np.nan, 3e38, -3e38]):
        batch["loss_mask"][i, j] = dirty_batch["loss_mask"][i, j] = False
        batch["loss_weights"][i, j] = dirty_batch["loss_weights"][i, j] = 0.0
        dirty_logits[i, j] = junk
        dirty_logits[i, j, 0] = 0.0 if np.isnan(junk) else dirty_logits[i, j, 0]  # mixed rows too
        dirty_batch["behavior_logprobs"][i, j] = -np.inf
        dirty_batch["advantages"][i, j] = np.nan
        dirty_ref[i, j] = np.nan
    cfg = L.PolicyLossConfig.create(kl_coef=0.2, entropy_coef=0.05)
    f = jax.jit(jax.value_and_grad(lambda x, bt, r: L.loss_from_logits(x, bt, cfg, ref_logprobs_BxL=r, vocab_chunk_size=4),
                                   has_aux=True))
    (loss_d, m_d), g_d = f(jnp.asarray(dirty_logits, dtype), dirty_batch, dirty_ref)
    (loss_c, m_c), g_c = f(jnp.asarray(logits, dtype), batch, ref)
    assert np.isfinite(float(loss_d)) and not any(np.isnan(float(x)) for x in m_d.values())
    g_d = np.asarray(g_d.astype(F32))
    assert np.isfinite(g_d).all()
    for i, j in masked:
        assert not g_d[i, j].any()
    # The garbage changes nothing at all.
    assert float(loss_d) == float(loss_c)
    np.testing.assert_array_equal(g_d, np.asarray(g_c.astype(F32)))
    chex.assert_trees_all_equal(m_d, m_c)
    # A weight outside loss_mask is an upstream bug: not trained on, but reported.
    dirty_batch["loss_weights"][0, 1] = 0.25
    (loss_w, m_w), _ = f(jnp.asarray(dirty_logits, dtype), dirty_batch, dirty_ref)
    assert float(loss_w) == float(loss_c) and float(m_w["weight_outside_mask"]) == 0.25


def test_metric_helpers_and_config_validation():
    rng = np.random.default_rng(5)
    a, b = _pg_inputs(rng, (2, 7)), _pg_inputs(rng, (2, 7))
    both = {k: jnp.concatenate([a[k], b[k]]) for k in a}
    pg = jax.jit(lambda kw: L.policy_gradient_loss(**kw, **PG_KW)[1])
    ma, mb, m = pg(a), pg(b), pg(both)
    assert set(m) <= set(L.METRIC_REDUCTIONS)
    comb = jax.jit(L.combine_metrics)(ma, mb)
    chex.assert_trees_all_close(comb, m, rtol=1e-6)
    means = jax.jit(L.mean_metrics)(m)
    w = np.asarray(both["weights_BxT"])
    np.testing.assert_allclose(means["entropy"], (w * np.asarray(both["entropy_BxT"])).sum() / w.sum(), rtol=1e-6)
    assert means["ratio_max"] == m["ratio_max"]

    for bad, err in [(dict(eps_low=1.0), ValueError), (dict(eps_high=-0.1), ValueError),
                     (dict(kl_coef=float("nan")), ValueError), (dict(kl_estimator="k9"), LookupError)]:
        with pytest.raises(err):
            L.PolicyLossConfig.create(**bad)
    with pytest.raises(ValueError, match="needs ref_logp_BxT"):
        L.policy_gradient_loss(a["logp_BxT"], a["behavior_logp_BxT"], a["advantages_BxT"], a["weights_BxT"], kl_coef=0.1)
    with pytest.raises(AssertionError, match="advantages_BxT must have the shape of logp_BxT"):
        L.policy_gradient_loss(a["logp_BxT"], a["behavior_logp_BxT"], a["advantages_BxT"][:1], a["weights_BxT"])
    with pytest.raises(AssertionError, match=r"loss_from_logits: batch\['advantages'\] must be \[B, L\]"):
        batch = {k: np.zeros((1, 2), np.int32 if k == "targets" else F32) for k in L.BATCH_KEYS}
        batch["advantages"] = np.zeros((1, 3), F32)
        L.loss_from_logits(jnp.zeros((1, 2, 3)), batch)
    with pytest.raises(LookupError, match="known: \\['k1', 'k2', 'k3'\\]"):
        L.get_kl_estimator("k4")
    with pytest.raises(KeyError, match="missing \\[.*'advantages'"):
        L.loss_from_logits(jnp.zeros((1, 2, 3)), {"targets": np.zeros((1, 2), np.int32)})


# ----------------------------------------------------------------------------- extreme log-ratios, dual clip


def _np_pg(logp, mu, adv, w, cfg):
    """float64 reference of the documented per-token math: (loss, d loss / d logp, metrics).

    Elementwise, so the gradient is the analytic one of each branch.
    """
    logp, mu, adv, w = (np.asarray(x, np.float64) for x in (logp, mu, adv, w))
    x = logp - mu
    c, clip_c = cfg.log_ratio_clamp, cfg.loss_options.clip_c
    u = np.clip(x, -c, c)
    r = np.exp(u)
    pg = -np.minimum(r * adv, np.clip(r, 1 - cfg.loss_options.eps_low, 1 + cfg.loss_options.eps_high) * adv)
    low = (adv < 0) & (r < 1 - cfg.loss_options.eps_low)
    high = (adv > 0) & (r > 1 + cfg.loss_options.eps_high)
    dual = (adv < 0) & (r > clip_c) if clip_c else np.zeros(x.shape, bool)
    pg = np.where(dual, -(clip_c or 0.0) * adv, pg)
    clamped = np.abs(x) > c
    g = np.where(low | high | dual | clamped, 0.0, -adv * r)
    m = dict(pg_loss=np.sum(w * pg), clip_frac_low=np.sum(w * low), clip_frac_high=np.sum(w * high),
             clip_frac_dual=np.sum(w * dual), clip_frac=np.sum(w * (low | high | dual)),
             clamp_frac=np.sum(w * clamped), ratio_mean=np.sum(w * r), ratio_max=r.max(), ratio_min=r.min(),
             approx_kl=np.sum(w * (r - 1 - u)))
    return np.sum(w * pg), w * g, m


def _kw(cfg):
    """policy_gradient_loss's keywords for a ppo_clip PolicyLossConfig."""
    o = cfg.loss_options
    return dict(eps_low=o.eps_low, eps_high=o.eps_high, clip_c=o.clip_c, kl_coef=cfg.kl_coef,
                kl_estimator=cfg.kl_estimator, entropy_coef=cfg.entropy_coef, log_ratio_clamp=cfg.log_ratio_clamp)


@functools.lru_cache(maxsize=None)
def _pg_value_and_grad(cfg):
    def f(logp, mu, adv, w):
        return L.policy_gradient_loss(logp, mu, adv, w, **_kw(cfg))

    return jax.jit(jax.value_and_grad(f, has_aux=True))


EXTREME_LOG_RATIOS = (89.0, -89.0, 1e4, -1e4, np.inf, -np.inf)


@pytest.mark.parametrize("clip_c", [None, 3.0], ids=["default", "dual_clip"])
def test_extreme_log_ratios_keep_loss_and_gradient_finite(clip_c):
    """Any log-ratio, any sign of A: finite loss and gradient, equal to the float64 reference.

    logp - mu is +-89 (exp overflows float32), +-1e4, and +-inf from a behavior
    log-prob of -inf (the sampler's record) or a current log-prob of -inf.
    """
    cfg = L.PolicyLossConfig.create(clip_c=clip_c)
    rows = []
    for x in EXTREME_LOG_RATIOS:
        for a in (1.0, 0.0, -1.0):
            if np.isinf(x):
                logp, mu = (-1.0, -np.inf) if x > 0 else (-np.inf, -1.0)
            else:
                logp, mu = (-1.0, -1.0 - x) if x > 0 else (-1.0 + x, -1.0)
            rows.append((logp, mu, a))
    logp, mu, adv = (np.asarray(c, np.float32) for c in zip(*rows))
    w = np.full(logp.shape, 1.0 / logp.size, np.float32)
    for i in range(logp.size):  # each token alone: nothing hides behind another token's value
        one = [z[i : i + 1] for z in (logp, mu, adv, w)]
        (loss, m), g = _pg_value_and_grad(cfg)(*one)
        assert np.isfinite(float(loss)) and np.isfinite(np.asarray(g)).all(), rows[i]
        assert all(np.isfinite(float(v)) for v in m.values()), (rows[i], m)
    (loss, m), g = _pg_value_and_grad(cfg)(logp, mu, adv, w)
    ref_loss, ref_g, ref_m = _np_pg(logp, mu, adv, w, cfg)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g), ref_g, rtol=1e-6, atol=0)
    assert float(m["clamp_frac"]) == pytest.approx(1.0)  # every token is outside +-20
    for k, v in ref_m.items():
        np.testing.assert_allclose(float(m[k]), v, rtol=1e-6, atol=1e-12, err_msg=k)
    # A < 0 at log r = +89: the clamp caps the loss at e^20 |A| w; dual clip at c |A| w.
    i = rows.index((-1.0, -90.0, -1.0))
    (loss_i, _), _ = _pg_value_and_grad(cfg)(*[z[i : i + 1] for z in (logp, mu, adv, w)])
    cap = clip_c if clip_c else np.exp(20.0)
    np.testing.assert_allclose(float(loss_i), cap * float(w[i]), rtol=1e-6)


def _grid(rng, n, lo, hi):
    """Values on a 2^-10 grid: logp - mu is then exact in float32, like the reference's."""
    return np.round(rng.uniform(lo, hi, n) * 1024) / 1024


@pytest.mark.parametrize(
    "cfg",
    [L.PolicyLossConfig.create(), L.PolicyLossConfig.create(log_ratio_clamp=2.0), L.PolicyLossConfig.create(clip_c=3.0),
     L.PolicyLossConfig.create(eps_low=0.1, eps_high=0.5, log_ratio_clamp=1.5, clip_c=2.5)],
    ids=["default", "clamp2", "dual3", "clamp1.5+dual2.5"],
)
def test_policy_loss_and_gradient_match_float64_reference(cfg):
    """Loss, d loss / d logp and metrics against ``_np_pg``, every branch exercised."""
    rng = np.random.default_rng(6)
    n = 512
    mu = _grid(rng, n, -8.0, -0.5)
    x = np.concatenate([_grid(rng, n - 8, -4.0, 4.0), [30.0, -30.0, 25.5, -25.5, 60.0, -60.0, 19.5, -19.5]])
    adv = rng.choice([-1.5, -0.5, 0.0, 0.7, 1.25], n)
    w = np.where(rng.random(n) < 0.9, _grid(rng, n, 0.0, 1.0) / n, 0.0)
    # Stay away from the kinks (the clip, the dual clip, the clamp): one-sided there.
    kinks = [np.log(1 - cfg.loss_options.eps_low), np.log(1 + cfg.loss_options.eps_high), cfg.log_ratio_clamp, -cfg.log_ratio_clamp]
    kinks += [np.log(cfg.loss_options.clip_c)] if cfg.loss_options.clip_c else []
    keep = np.all(np.abs(x[:, None] - np.asarray(kinks)[None]) > 1e-3, axis=1)
    x, mu, adv, w = x[keep], mu[keep], adv[keep], w[keep]
    logp, mu, adv, w = (z.astype(np.float32) for z in (mu + x, mu, adv, w))
    np.testing.assert_array_equal(logp.astype(np.float64) - mu, x)  # the log-ratios are exact in float32

    (loss, m), g = _pg_value_and_grad(cfg)(logp, mu, adv, w)
    active = w != 0
    ref_loss, ref_g, ref_m = _np_pg(logp[active], mu[active], adv[active], w[active], cfg)
    # A float32 sum of terms of both signs: tolerance relative to the sum of their magnitudes
    # (|pg| <= |A| max(r, 1 + eps_high) per token).
    r = np.exp(np.clip(x, -cfg.log_ratio_clamp, cfg.log_ratio_clamp))
    magnitude = float(np.sum(np.abs(w * adv) * np.maximum(r, 1 + cfg.loss_options.eps_high)))
    np.testing.assert_allclose(float(loss), ref_loss, rtol=0, atol=1e-6 * magnitude)
    g = np.asarray(g)
    assert not g[~active].any()
    np.testing.assert_allclose(g[active], ref_g, rtol=2e-6, atol=0)
    for k, v in ref_m.items():
        atol = 1e-6 * magnitude if k == "pg_loss" else 1e-12
        np.testing.assert_allclose(float(m[k]), v, rtol=2e-6, atol=atol, err_msg=k)
    # Every branch is present in the data.
    assert ref_m["clip_frac_low"] > 0 and ref_m["clip_frac_high"] > 0 and ref_m["clamp_frac"] > 0
    assert (ref_m["clip_frac_dual"] > 0) == bool(cfg.loss_options.clip_c)
    assert (ref_g != 0).sum() > n // 8  # and the unclipped branch, with a gradient


def test_dual_clip_bounds_the_negative_advantage_loss():
    c = 3.0
    log_r = np.linspace(-25.0, 25.0, 2001).astype(np.float32)
    for a in (-0.1, -1.0, -7.0):
        adv = np.full_like(log_r, a)
        w = np.ones_like(log_r)
        per_token = jax.jit(jax.vmap(lambda lr, a, w: L.policy_gradient_loss(
            lr[None], jnp.zeros(1), a[None], w[None], clip_c=c)[0]))(log_r, adv, w)
        per_token = np.asarray(per_token)
        assert (per_token <= -c * a * (1 + 1e-6)).all()
        np.testing.assert_allclose(per_token[np.exp(log_r) > c * 1.001], -c * a, rtol=1e-6)
        # Below c it is the plain clipped surrogate.
        plain = np.asarray(jax.jit(jax.vmap(lambda lr, a, w: L.policy_gradient_loss(
            lr[None], jnp.zeros(1), a[None], w[None])[0]))(log_r, adv, w))
        below = np.exp(log_r) < c * 0.999
        np.testing.assert_array_equal(per_token[below], plain[below])
        assert plain.max() > 1e8 * abs(a)  # without it, only the clamp bounds the loss


def test_config_fields_reach_the_loss():
    """A ppo_clip PolicyLossConfig and policy_gradient_loss with the same keywords compute the same."""
    cfg = L.PolicyLossConfig.create(clip_c=2.5, log_ratio_clamp=4.0, eps_low=0.1)
    kw = _kw(cfg)
    assert kw["clip_c"] == 2.5 and kw["log_ratio_clamp"] == 4.0 and kw["eps_low"] == 0.1
    # loss_from_logits with the config equals policy_gradient_loss with those keywords.
    rng = np.random.default_rng(7)
    b, l, v = 2, 9, 11
    logits = jnp.asarray(3.0 * rng.standard_normal((b, l, v)), F32)
    batch = {
        "targets": rng.integers(0, v, (b, l)).astype(np.int32),
        "loss_mask": np.ones((b, l), bool),
        "behavior_logprobs": (-2.0 - 6.0 * rng.random((b, l))).astype(np.float32),
        "advantages": rng.choice([-1.0, 1.0], (b, l)).astype(np.float32),
        "loss_weights": np.full((b, l), 1.0 / (b * l), np.float32),
    }
    loss, m = jax.jit(lambda x: L.loss_from_logits(x, batch, cfg))(logits)
    logp = L.token_logprobs(logits, jnp.asarray(batch["targets"]))
    loss2, m2 = L.policy_gradient_loss(logp, batch["behavior_logprobs"], batch["advantages"],
                                       batch["loss_weights"], **kw)
    np.testing.assert_allclose(loss, loss2, rtol=1e-6)
    assert float(m["clip_frac_dual"]) > 0 and float(m["clamp_frac"]) > 0
    chex.assert_trees_all_close(m2, {k: m[k] for k in m2}, rtol=1e-6)
    # A micro-batch's metrics combine like the others.
    assert {"clip_frac_dual", "clamp_frac"} <= set(m) <= set(L.METRIC_REDUCTIONS)

    for bad, match in [(dict(clip_c=1.0), "clip_c"), (dict(clip_c=0.5), "clip_c"), (dict(clip_c=float("inf")), "clip_c"),
                       (dict(log_ratio_clamp=0.0), "log_ratio_clamp"), (dict(log_ratio_clamp=81.0), "log_ratio_clamp"),
                       (dict(log_ratio_clamp=None), "log_ratio_clamp"),
                       (dict(log_ratio_clamp=0.23), r"must exceed \|log\(1 \+ eps_high\)\|"),
                       (dict(eps_low=0.9, log_ratio_clamp=2.0), r"must exceed \|log\(1 - eps_low\)\|"),
                       (dict(clip_c=1e9), r"must exceed \|log\(clip_c\)\|")]:
        with pytest.raises(ValueError, match=match):
            L.PolicyLossConfig.create(**bad)
    assert L.PolicyLossConfig.create(clip_c=0).loss_options.clip_c == 0  # 0 = off, like None
    with pytest.raises(ValueError, match="policy_gradient_loss: clip_c"):
        L.policy_gradient_loss(logp, logp, logp, logp, clip_c=1.0)


def test_end_to_end_extreme_logits_stay_finite():
    """Through loss_from_logits: target logits 1e4 below the rest, behavior log-probs of -1e4."""
    rng = np.random.default_rng(8)
    b, l, v = 3, 6, 7
    logits = rng.standard_normal((b, l, v)).astype(np.float32)
    targets = rng.integers(0, v, (b, l)).astype(np.int32)
    np.put_along_axis(logits[0], targets[0][:, None], -1e4, axis=-1)  # logp ~ -1e4: log r ~ -1e4
    behavior = np.full((b, l), -1.0, np.float32)
    behavior[1] = -1e4  # log r ~ +1e4
    behavior[2] = -np.inf
    batch = {"targets": targets, "loss_mask": np.ones((b, l), bool), "behavior_logprobs": behavior,
             "advantages": np.tile(np.array([1.0, 0.0, -1.0], np.float32), (b, 2)),
             "loss_weights": np.full((b, l), 1.0 / (b * l), np.float32)}
    for cfg in (L.PolicyLossConfig.create(), L.PolicyLossConfig.create(clip_c=3.0, entropy_coef=0.01)):
        f = jax.jit(jax.value_and_grad(lambda x: L.loss_from_logits(x, batch, cfg), has_aux=True))
        (loss, m), g = f(jnp.asarray(logits))
        assert np.isfinite(float(loss)) and np.isfinite(np.asarray(g)).all()
        assert all(np.isfinite(float(x)) for x in m.values()), m
        assert float(m["clamp_frac"]) == pytest.approx(1.0, rel=1e-6)


def test_out_of_range_targets_are_nan_and_harmless_when_masked():
    """Ids < 0 or >= V: NaN log-prob (no wrap-around), a NaN gradient row only where trained on."""
    rng = np.random.default_rng(9)
    b, l, v = 2, 5, 6
    x = jnp.asarray(rng.standard_normal((b, l, v)), F32)
    t = np.asarray(rng.integers(0, v, (b, l)), np.int32)
    bad = [(0, 1, -1), (0, 3, v), (1, 0, -v), (1, 4, 3 * v)]
    for i, j, tid in bad:
        t[i, j] = tid
    ok = np.ones((b, l), bool)
    for i, j, _ in bad:
        ok[i, j] = False
    ref = np.take_along_axis(_np_logsoftmax(x), np.where(ok, t, 0)[..., None], -1)[..., 0]
    cot = jnp.asarray(np.where(ok | (np.arange(l)[None] == 1), 1.0, 0.0), F32)  # (0, 1) is trained on

    @jax.jit
    def run(x):
        lps = (L.token_logprobs(x, t, vocab_chunk_size=4), L.token_logprobs_and_entropy(x, t)[0],
               L.chunked_token_logprobs(x.astype(F32), jnp.eye(v), t, chunk_size=2, layout="DxV"))
        return lps, jax.grad(lambda x: jnp.sum(cot * L.token_logprobs(x, t)))(x)

    for dtype in (F32, jnp.bfloat16):
        lps, g = run(x.astype(dtype))
        for lp in lps:
            lp = np.asarray(lp)
            assert np.isnan(lp[~ok]).all() and np.isfinite(lp[ok]).all()
            np.testing.assert_allclose(lp[ok], ref[ok], atol=2e-6 if dtype == F32 else 0.05)
        # The gradient row is NaN where the cotangent is non-zero, exactly 0 where it is zero.
        g = np.asarray(g.astype(F32))
        assert np.isnan(g[0, 1]).all()
        for i, j, _ in bad[1:]:
            assert not g[i, j].any()
        assert np.isfinite(g[ok]).all()
    # Through the loss: out-of-range ids at weight 0 change nothing.
    batch = {"targets": t, "loss_mask": ok, "behavior_logprobs": np.full((b, l), -2.0, np.float32),
             "advantages": np.ones((b, l), np.float32), "loss_weights": np.where(ok, 0.1, 0.0).astype(np.float32)}
    clean = dict(batch, targets=np.where(ok, t, 0).astype(np.int32))
    f = jax.jit(jax.value_and_grad(lambda x, bt: L.loss_from_logits(x, bt)[0]))
    (l1, g1), (l2, g2) = f(x, batch), f(x, clean)
    assert float(l1) == float(l2) and np.isfinite(float(l1))
    np.testing.assert_array_equal(np.asarray(g1), np.asarray(g2))


# ----------------------------------------------------------------------------- weights


def test_rollout_token_mean_weights_rule_and_micro_batches():
    mask = np.array([[1, 1, 0, 1, 1, 0], [1, 0, 1, 1, 1, 1]], bool)
    ids = np.array([[0, 0, -1, 1, 1, -1], [2, -1, 2, 2, 0, 0]], np.int32)
    w = L.rollout_token_mean_weights(mask, ids, 3)
    # N = (4, 2, 3) trainable tokens per rollout, R = 3.
    expect = np.array([[1 / 12, 1 / 12, 0, 1 / 6, 1 / 6, 0], [1 / 9, 0, 1 / 9, 1 / 9, 1 / 12, 1 / 12]], np.float32)
    np.testing.assert_allclose(w, expect, rtol=1e-7)
    assert w.dtype == np.float32 and abs(w.sum() - 1) < 1e-6
    # jnp inputs: same numbers, traceable.
    wj = jax.jit(lambda m, i: L.rollout_token_mean_weights(m, i, 3))(jnp.asarray(mask), jnp.asarray(ids))
    np.testing.assert_allclose(wj, expect, rtol=1e-6)
    # A micro-batch (row 1 only) with the step's counts gets the step's weights.
    counts = np.array([4, 2, 3])
    np.testing.assert_allclose(
        L.rollout_token_mean_weights(mask[1:], ids[1:], 3, rollout_token_counts=counts), expect[1:], rtol=1e-7
    )
    np.testing.assert_allclose(
        L.rollout_token_mean_weights(jnp.asarray(mask[1:]), jnp.asarray(ids[1:]), 3, rollout_token_counts=counts),
        expect[1:], rtol=1e-6,
    )
    # token_mean and sequence_mean.
    np.testing.assert_allclose(L.token_mean_weights(mask), mask / 9.0, rtol=1e-7)
    np.testing.assert_allclose(L.token_mean_weights(mask[:1], total_tokens=9), mask[:1] / 9.0, rtol=1e-7)
    np.testing.assert_allclose(L.token_mean_weights(jnp.asarray(mask)), mask / 9.0, rtol=1e-6)
    np.testing.assert_array_equal(L.sequence_mean_weights(mask, ids, 3), w)
    w_tok, units = L.build_loss_weights("token_mean", mask, ids, 3)
    assert w_tok.sum() == pytest.approx(1.0) and units == 9
    w_rtm, units = L.build_loss_weights("rollout_token_mean", mask, ids, 3)
    np.testing.assert_allclose(w_rtm, expect, rtol=1e-7)
    assert units == 3


def test_weight_builder_errors():
    mask = np.array([[1, 1, 0]], bool)
    with pytest.raises(ValueError, match=r"id 5 at index \(0, 1\)"):
        L.rollout_token_mean_weights(mask, np.array([[0, 5, 9]]), 2)
    with pytest.raises(ValueError, match="num_groups must be a positive int"):
        L.rollout_token_mean_weights(mask, np.array([[0, 0, 0]]), 0)
    with pytest.raises(ValueError, match="group 0 has 2 trainable tokens here but its step count is 1"):
        L.rollout_token_mean_weights(mask, np.array([[0, 0, 0]]), 1, rollout_token_counts=np.array([1]))
    with pytest.raises(ValueError, match="less than the 2 trainable tokens"):
        L.token_mean_weights(mask, total_tokens=1)
    with pytest.raises(LookupError, match=r"unknown weight builder 'path_mean'; known: \['constant', "
                                          r"'rollout_token_mean', 'token_mean'\]"):
        L.get_weight_builder("path_mean")


# ----------------------------------------------------------------------------- import cost


def test_import_stays_light():
    code = textwrap.dedent(
        """
        import sys, time
        t = time.perf_counter()
        import gyre_jax.losses
        dt = time.perf_counter() - t
        heavy = sorted({m.split('.')[0] for m in sys.modules} & {'jetstream', 'tensorflow', 'grain', 'orbax', 'flax', 'seqio'})
        print(f"{dt:.3f}", ",".join(heavy))
        """
    )
    root = pathlib.Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         cwd=root, env=env)
    dt, heavy = out.stdout.split("\n")[0].split(" ")
    print(f"import gyre_jax.losses: {float(dt):.2f} s")
    assert heavy == "", f"import gyre_jax.losses pulled in {heavy}"


def _run_example(block, where, capsys):
    exec(compile(textwrap.dedent(block), where, "exec"), {})
    loss, summed, grad_diff, clip_frac = (float(x) for x in capsys.readouterr().out.split())
    assert np.isfinite(loss) and loss == pytest.approx(summed, rel=1e-6, abs=1e-7)  # micro-batches add up
    assert grad_diff < 1e-6 and 0.0 <= clip_frac <= 1.0


def test_module_docstring_example_runs(capsys):
    doc = L.__doc__
    block = doc.split("Use the losses in your own project::\n", 1)[1].split("\nMetrics are weighted sums", 1)[0]
    _run_example(block, "gyre_jax.losses docstring", capsys)


def test_readme_example_runs_and_lists_every_registered_entry(capsys):
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Using the losses in your own project", 1)[1].split("\n## ", 1)[0]
    _run_example(section.split("```python\n", 1)[1].split("```", 1)[0], "README.md", capsys)
    for reg in (L.POLICY_LOSSES, L.MISMATCH_CORRECTIONS, L.ADVANTAGE_ESTIMATORS, L.WEIGHT_BUILDERS):
        for name, summary, paper in reg.describe():
            assert f"* `{name}`: {summary}. {paper}." in section, name
