"""Unit tests of gyre_jax.losses: log-probs, entropy, chunking, memory, masking, weights, import cost."""
import os
import pathlib
import subprocess
import sys
import textwrap

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
    with pytest.raises(ValueError, match="targets shape"):
        L.token_logprobs(x, jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(TypeError, match="integer token ids"):
        L.token_logprobs(x, jnp.zeros((2, 3), F32))
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
    cfg = L.PolicyLossConfig(entropy_coef=0.01)
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
        for k in m:
            np.testing.assert_allclose(m_v[k][i], m[k], rtol=1e-6, err_msg=k)
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
    cfg = L.PolicyLossConfig(kl_coef=0.2, entropy_coef=0.05)
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
    for k in m_c:
        np.testing.assert_array_equal(m_d[k], m_c[k], err_msg=k)
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
    for k in m:
        np.testing.assert_allclose(comb[k], m[k], rtol=1e-6, err_msg=k)
    means = jax.jit(L.mean_metrics)(m)
    w = np.asarray(both["weights_BxT"])
    np.testing.assert_allclose(means["entropy"], (w * np.asarray(both["entropy_BxT"])).sum() / w.sum(), rtol=1e-6)
    assert means["ratio_max"] == m["ratio_max"]

    for bad, err in [(dict(eps_low=1.0), ValueError), (dict(eps_high=-0.1), ValueError),
                     (dict(kl_coef=float("nan")), ValueError), (dict(kl_estimator="k9"), LookupError)]:
        with pytest.raises(err):
            L.PolicyLossConfig(**bad)
    with pytest.raises(ValueError, match="needs ref_logp_BxT"):
        L.policy_gradient_loss(a["logp_BxT"], a["behavior_logp_BxT"], a["advantages_BxT"], a["weights_BxT"], kl_coef=0.1)
    with pytest.raises(ValueError, match="advantages_BxT has shape"):
        L.policy_gradient_loss(a["logp_BxT"], a["behavior_logp_BxT"], a["advantages_BxT"][:1], a["weights_BxT"])
    with pytest.raises(LookupError, match="known: \\['k1', 'k2', 'k3'\\]"):
        L.get_kl_estimator("k4")
    with pytest.raises(KeyError, match="missing \\[.*'advantages'"):
        L.loss_from_logits(jnp.zeros((1, 2, 3)), {"targets": np.zeros((1, 2), np.int32)})


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
    assert L.build_loss_weights("token_mean", mask).sum() == pytest.approx(1.0)


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
    with pytest.raises(LookupError, match=r"unknown loss aggregation 'path_mean'; known: \['rollout_token_mean', "
                                          r"'sequence_mean', 'token_mean'\]"):
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


def test_module_docstring_example_runs(capsys):
    doc = L.__doc__
    block = doc.split("Use the losses in your own project::\n", 1)[1].split("\nMetrics are weighted sums", 1)[0]
    exec(compile(textwrap.dedent(block), "gyre_jax.losses docstring", "exec"), {})
    loss, clip_frac, entropy = (float(x) for x in capsys.readouterr().out.split())
    assert np.isfinite(loss) and 0.0 <= clip_frac <= 1.0 and entropy > 0.0
