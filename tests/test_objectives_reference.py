"""Every registered objective, mismatch correction, advantage estimator and weight builder
against an independent float64 reference written from its paper's formula.

Per configuration: loss and d loss / d logp to 1e-6 against the reference (plain loops
over sequences, not our code), its metrics, finiteness at log-ratios of +-89 and +-1000
in every input, empty masks and all-masked rows (garbage there changes nothing), and
split invariance: the sum over one-row micro-batches (with the per-sequence statistics
precomputed, as the RL loop's per-step pass does) equals the whole batch (statistics
from ``sequence_ids`` in the batch).
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gyre_jax.losses as L

B, T = 4, 16
ADVS = (1.25, -0.5, 0.7, -1.5, 0.0, 1.0)


def _grid(rng, shape, lo, hi):
    """Values on a 2^-10 grid, so differences of them are exact in float32 like the reference's."""
    return np.round(rng.uniform(lo, hi, shape) * 1024) / 1024


def make_batch(seed=0):
    """Rows of 2-3 sequences (then padding); ~85% of a sequence's tokens trainable."""
    rng = np.random.default_rng(seed)
    seq = np.full((B, T), -1, np.int64)
    sid = 0
    for b in range(B):
        t = 0
        for _ in range(int(rng.integers(2, 4))):
            n = int(rng.integers(3, 6))
            if t + n > T:
                break
            seq[b, t : t + n] = sid
            sid, t = sid + 1, t + n
    active = (seq >= 0) & (rng.random((B, T)) < 0.85)
    for s in range(sid):  # every sequence keeps at least one trainable token
        if not active[seq == s].any():
            active[np.argwhere(seq == s)[0][0], np.argwhere(seq == s)[0][1]] = True
    logp = _grid(rng, (B, T), -6.0, -0.2)
    d = {
        "logp": logp,
        "behavior_logprobs": logp - _grid(rng, (B, T), -0.6, 0.6),  # engine
        "advantages": np.where(seq >= 0, np.asarray(ADVS)[np.maximum(seq, 0) % len(ADVS)], 0.0),
        "sequence_ids": np.maximum(seq, 0).astype(np.int32),
        "loss_mask": active,
    }
    d["trainer_logprobs"] = d["behavior_logprobs"] + _grid(rng, (B, T), -0.7, 0.7)  # trainer at the behaviour version
    d["prox_logprobs"] = logp - _grid(rng, (B, T), -0.4, 0.4)  # the step's params: near the current
    d["ref_logprobs"] = logp + _grid(rng, (B, T), -1.0, 1.0)
    num_seq = sid
    n_i = np.bincount(seq[active], minlength=num_seq)
    d["loss_weights"] = np.where(active, 1.0 / (n_i[np.maximum(seq, 0)] * num_seq), 0.0)  # 1 / (|y_i| G)
    return d, seq, num_seq


# ----------------------------------------------------------------------------- references (float64, loops)


def _ppo(r, a, eps_low, eps_high, clip_c=None):
    """(-min(r A, clip(r) A) with the dual clip, its derivative in r)."""
    clipped = min(max(r, 1 - eps_low), 1 + eps_high)
    unclipped = r * a <= clipped * a
    v, dv = (-r * a, -a) if unclipped else (-clipped * a, 0.0)
    if clip_c and a < 0 and -clip_c * a < v:
        v, dv = -clip_c * a, 0.0
    return v, dv


def reference(cfg, d, seq, num_seq):
    """(loss, d loss / d logp per token, metrics) from the papers' formulas."""
    o = cfg.loss_options
    f = {k: np.asarray(v, np.float64) for k, v in d.items()}
    act = d["loss_mask"]
    w = f["loss_weights"]
    loss, g, m = 0.0, np.zeros((B, T)), {}
    toks = [(b, t) for b in range(B) for t in range(T) if act[b, t]]
    corr = {k: 1.0 for k in toks}
    base = f["behavior_logprobs"]
    if cfg.mismatch != "off":  # rho = pi_train / pi_infer, per token or its sequence's product
        mc = cfg.mismatch_options
        rho = {k: math.exp(f["trainer_logprobs"][k] - f["behavior_logprobs"][k]) for k in toks}
        seq_rho = {s: math.prod(rho[k] for k in toks if seq[k] == s) for s in range(num_seq)}
        x = {k: (seq_rho[seq[k]] if cfg.mismatch.endswith("_seq") else rho[k]) for k in toks}
        if cfg.mismatch.startswith("tis"):
            corr = {k: min(x[k], mc.mismatch_cap) for k in toks}
            m["mismatch_frac_truncated"] = sum(w[k] for k in toks if x[k] > mc.mismatch_cap)
        elif cfg.mismatch in ("mis", "mis_seq", "icepop"):
            keep = {k: mc.mismatch_low <= x[k] <= mc.mismatch_high for k in toks}
            corr = {k: x[k] if keep[k] else 0.0 for k in toks}
            m["mismatch_frac_masked"] = sum(w[k] for k in toks if not keep[k])
        m["mismatch_kl"] = sum(w[k] * (rho[k] - 1 - math.log(rho[k])) for k in toks)
        m["mismatch_k1"] = sum(w[k] * -math.log(rho[k]) for k in toks)
        m["mismatch_weight_mean"] = sum(w[k] * corr[k] for k in toks)
        base = f["trainer_logprobs"]
    pg = {}
    if cfg.loss == "gspo":  # Zheng et al. 2025: s_i = (pi / pi_old)^(1/|y_i|), 1/G sum_i min(s_i A_i, clip(s_i) A_i)
        for s in range(num_seq):
            ks = [k for k in toks if seq[k] == s]
            si = math.exp(sum(f["logp"][k] - base[k] for k in ks) / len(ks))
            v, dv = _ppo(si, f["advantages"][ks[0]], o.eps_low, o.eps_high)
            loss += v / num_seq
            for k in ks:  # d s_i / d logp_t = s_i / |y_i|
                g[k] += dv * si / len(ks) / num_seq
                pg[k] = v
    else:
        for k in toks:
            a, lp = f["advantages"][k], f["logp"][k]
            if cfg.loss == "ppo_clip":
                r = math.exp(lp - base[k])
                v, dv = _ppo(r, a, o.eps_low, o.eps_high, o.clip_c)
                v, dlp = v, dv * r
            elif cfg.loss == "decoupled_ppo":  # AReaL: clip vs pi_prox, weight pi_prox / pi_behav (0 above the cap)
                r = math.exp(lp - f["prox_logprobs"][k])
                bw = math.exp(f["prox_logprobs"][k] - base[k])
                bw = 0.0 if (o.behavior_cap and bw > o.behavior_cap) else bw
                v, dv = _ppo(r, a, o.eps_low, o.eps_high, o.clip_c)
                v, dlp = bw * v, bw * dv * r
            elif cfg.loss == "cispo":  # MiniMax-M1: sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi
                rh = min(max(math.exp(lp - base[k]), 1 - o.eps_low), 1 + o.eps_high)
                v, dlp = -rh * a * lp, -rh * a
            elif cfg.loss == "reinforce":
                r = math.exp(lp - base[k])
                rw = min(r, o.is_cap) if o.is_cap else r
                v, dlp = -rw * a * lp, -rw * a
            elif cfg.loss == "nll":
                v, dlp = -lp, -1.0
            pg[k] = v
            loss += w[k] * corr[k] * v
            g[k] += w[k] * corr[k] * dlp
    if cfg.loss == "gspo" and cfg.mismatch != "off":
        raise NotImplementedError("the reference combines corrections with token-level objectives")
    if cfg.kl_coef:  # k3 = exp(d) - 1 - d, d = ref - logp (Schulman 2020)
        for k in toks:
            dd = f["ref_logprobs"][k] - f["logp"][k]
            loss += w[k] * cfg.kl_coef * (math.exp(dd) - 1 - dd)
            g[k] += w[k] * cfg.kl_coef * (1 - math.exp(dd))
    m["pg_loss"] = sum(w[k] * corr[k] * pg[k] for k in toks) if cfg.loss != "gspo" else loss
    m["weight_sum"] = sum(w[k] for k in toks)
    m["num_tokens"] = float(len(toks))
    return loss, g, m


# ----------------------------------------------------------------------------- the configurations

C = L.PolicyLossConfig.create
CONFIGS = {
    "ppo_clip": C(loss="ppo_clip", eps_low=0.1, eps_high=0.15, clip_c=1.6),
    "gspo": C(loss="gspo", eps_low=0.05, eps_high=0.08),
    "cispo": C(loss="cispo", eps_low=0.3, eps_high=0.2),
    "decoupled_ppo": C(loss="decoupled_ppo", eps_low=0.1, eps_high=0.15, behavior_cap=1.5),
    "reinforce": C(loss="reinforce", is_cap=1.2),
    "reinforce_plain": C(loss="reinforce"),
    "nll": C(loss="nll", entropy_metric=False),
    "tis": C(loss="ppo_clip", mismatch="tis", mismatch_cap=1.3),
    "tis_seq": C(loss="ppo_clip", mismatch="tis_seq", mismatch_cap=1.5),
    "mis": C(loss="ppo_clip", mismatch="mis", mismatch_low=0.7, mismatch_high=1.4),
    "mis_seq": C(loss="ppo_clip", mismatch="mis_seq", mismatch_high=2.0),
    "icepop": C(loss="ppo_clip", mismatch="icepop", mismatch_low=0.6, mismatch_high=1.5),
    "measure+kl": C(loss="decoupled_ppo", mismatch="measure", kl_coef=0.05),
}
KEYS = ("logp", "behavior_logprobs", "advantages", "trainer_logprobs", "prox_logprobs", "ref_logprobs",
        "loss_weights", "loss_mask")


@functools.lru_cache(maxsize=None)
def _fn(name, precomputed):
    """(loss, metrics), d loss / d logp; sequence statistics in-batch or precomputed. Eager: on these
    tiny shapes one compile per configuration would cost more than the whole test
    (``test_jit_equals_eager`` checks the jitted path)."""
    cfg = CONFIGS[name]

    def f(logp, batch):
        return L.policy_loss(logp, jnp.where(batch["loss_mask"], batch["loss_weights"], 0.0), batch, cfg)

    return jax.value_and_grad(f, has_aux=True)


def _device(d, *, precomputed=False, rows=None):
    """The batch as the loss sees it; ``precomputed``: per-sequence statistics as the loop's
    per-step pass writes them (float64 on the host) instead of ``sequence_ids``;
    ``rows``: zero the weights of every other row (a one-row micro-batch of the same shape)."""
    out = {k: jnp.asarray(d[k], jnp.float32) for k in KEYS if k not in ("logp", "loss_mask")}
    out["loss_mask"] = jnp.asarray(d["loss_mask"])
    if rows is not None:
        keep = np.isin(np.arange(B), rows)[:, None]
        out["loss_mask"] = jnp.asarray(d["loss_mask"] & keep)
    if precomputed:
        act, sid = d["loss_mask"], d["sequence_ids"]
        f = {k: np.asarray(d[k], np.float64) for k in KEYS[:4]}
        mis = f["trainer_logprobs"] - f["behavior_logprobs"]
        base = f["trainer_logprobs"] if d.get("_base_trainer") else f["behavior_logprobs"]
        ratio = f["logp"] - base
        n = np.bincount(sid[act], minlength=B * T)
        s_ratio = np.bincount(sid[act], weights=ratio[act], minlength=B * T) / np.maximum(n, 1)
        s_mis = np.bincount(sid[act], weights=mis[act], minlength=B * T)
        out["seq_log_ratio"] = jnp.asarray(s_ratio[sid], jnp.float32)
        out["seq_log_mismatch"] = jnp.asarray(s_mis[sid], jnp.float32)
    else:
        out["sequence_ids"] = jnp.asarray(d["sequence_ids"])
    return out


@pytest.fixture(scope="module")
def data():
    return make_batch(0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_objective_matches_float64_reference_and_splits(name, data):
    d, seq, num_seq = data
    cfg = CONFIGS[name]
    d = dict(d, _base_trainer=cfg.mismatch != "off")
    logp = jnp.asarray(d["logp"], jnp.float32)
    (loss, m), g = _fn(name, False)(logp, _device(d))
    ref_loss, ref_g, ref_m = reference(cfg, d, seq, num_seq)
    scale = float(np.sum(np.abs(d["loss_weights"]))) * 8.0  # |per-token terms| <= ~8 here
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-6, atol=1e-6 * scale)
    np.testing.assert_allclose(np.asarray(g, np.float64), ref_g, rtol=1e-5, atol=1e-6 * np.abs(ref_g).max())
    assert not np.asarray(g)[~d["loss_mask"]].any()
    for k, v in ref_m.items():
        np.testing.assert_allclose(float(m[k]), v, rtol=1e-5, atol=1e-7, err_msg=k)
    assert set(m) == cfg.metric_names() | ({"kl_ref"} if cfg.kl_coef else set()), sorted(m)
    # The data reaches the branches that make each entry what it is.
    if "clip_frac" in m and cfg.loss != "cispo":
        assert 0 < float(m["clip_frac"]) < 0.9, float(m["clip_frac"])
    for k in ("mismatch_frac_truncated", "mismatch_frac_masked", "behavior_cap_frac", "is_truncated_frac"):
        knob = {"is_truncated_frac": "is_cap", "behavior_cap_frac": "behavior_cap"}.get(k)
        if k in m and (knob is None or getattr(cfg.loss_options, knob)):
            assert 0 < float(m[k]) < 0.9, (k, float(m[k]))

    # Split invariance: one-row micro-batches with precomputed sequence statistics add up.
    (loss_p, m_p), g_p = _fn(name, True)(logp, _device(d, precomputed=True))
    np.testing.assert_allclose(float(loss_p), float(loss), rtol=1e-6, atol=1e-7)
    acc_l, acc_m, acc_g = 0.0, None, 0.0
    for r in np.random.default_rng(1).permutation(B):
        (lr, mr), gr = _fn(name, True)(logp, _device(d, precomputed=True, rows=[r]))
        acc_l, acc_g = acc_l + float(lr), acc_g + np.asarray(gr)
        acc_m = mr if acc_m is None else L.combine_metrics(acc_m, mr)
    np.testing.assert_allclose(acc_l, float(loss), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(acc_g, np.asarray(g), rtol=1e-6, atol=1e-7)
    for k in m:
        np.testing.assert_allclose(float(acc_m[k]), float(m[k]), rtol=1e-5, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_extreme_log_ratios_empty_masks_and_masked_rows(name, data):
    """+-89 and +-1000 in every log-ratio the entry reads: finite loss, gradient and mean metrics.
    No trainable token: loss and gradient exactly 0. A fully masked row of NaN/inf garbage: no effect."""
    d, _, _ = data
    rng = np.random.default_rng(2)
    ext = rng.choice([89.0, -89.0, 1000.0, -1000.0], (B, T))
    bad = dict(d)
    for k in ("behavior_logprobs", "trainer_logprobs", "prox_logprobs", "ref_logprobs"):
        bad[k] = d["logp"] - rng.permutation(ext.ravel()).reshape(B, T)
    logp = jnp.asarray(d["logp"], jnp.float32)
    for precomputed in (False, True):
        (loss, m), g = _fn(name, precomputed)(logp, _device(bad, precomputed=precomputed))
        assert np.isfinite(float(loss)) and np.isfinite(np.asarray(g)).all(), (name, float(loss))
        for k, v in m.items():
            if L.METRIC_REDUCTIONS[k] == "sum":
                assert np.isfinite(float(v)), (k, float(v))

    empty = _device(d)
    empty["loss_mask"] = jnp.zeros((B, T), bool)
    (loss, m), g = _fn(name, False)(logp, empty)
    assert float(loss) == 0.0 and not np.asarray(g).any()
    assert all(float(v) == 0.0 for k, v in m.items() if L.METRIC_REDUCTIONS[k] == "sum")
    assert all(float(v) == np.inf for k, v in m.items() if L.METRIC_REDUCTIONS[k] == "min")

    # Row 0 masked entirely, its inputs garbage: the same as the clean batch with row 0 masked.
    clean = _device(d)
    clean["loss_mask"] = clean["loss_mask"].at[0].set(False)
    dirty = dict(clean)
    for k in ("behavior_logprobs", "trainer_logprobs", "prox_logprobs", "ref_logprobs", "advantages"):
        dirty[k] = clean[k].at[0].set(jnp.asarray([np.nan, np.inf, -np.inf, 1e30] * (T // 4), jnp.float32))
    dirty_logp = logp.at[0].set(jnp.nan)
    (l1, m1), g1 = _fn(name, False)(logp, clean)
    (l2, m2), g2 = _fn(name, False)(dirty_logp, dirty)
    assert float(l1) == float(l2)
    np.testing.assert_array_equal(np.asarray(g1)[1:], np.asarray(g2)[1:])
    assert not np.asarray(g2)[0].any()
    for k in m1:
        assert float(m1[k]) == float(m2[k]), k


def test_jit_equals_eager(data):
    d, _, _ = data
    logp = jnp.asarray(d["logp"], jnp.float32)
    for name in ("gspo", "measure+kl", "tis_seq"):
        batch = _device(d)
        (l1, m1), g1 = _fn(name, False)(logp, batch)
        (l2, m2), g2 = jax.jit(_fn(name, False))(logp, batch)
        np.testing.assert_allclose(float(l2), float(l1), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(g2), np.asarray(g1), rtol=1e-6, atol=1e-9)
        for k in m1:
            np.testing.assert_allclose(float(m2[k]), float(m1[k]), rtol=1e-5, atol=1e-9, err_msg=k)


def test_kl_estimators_overflow_safe():
    """k1/k2/k3 equal their textbook forms for |d| <= 20, stay finite (value and gradient) at +-89, +-1000."""
    d = np.array([-1000.0, -89.0, -20.0, -3.0, -0.5, 0.0, 0.7, 5.0, 19.5, 89.0, 1000.0])
    logp = np.full_like(d, -2.0)
    ref = logp + d
    for name, textbook in (("k1", lambda x: -x), ("k2", lambda x: 0.5 * x * x),
                           ("k3", lambda x: np.exp(x) - 1 - x)):
        fn = L.get_kl_estimator(name)
        v, gr = jax.vmap(jax.value_and_grad(fn))(jnp.asarray(logp, jnp.float32), jnp.asarray(ref, jnp.float32))
        v, gr = np.asarray(v), np.asarray(gr)
        assert np.isfinite(v).all() and np.isfinite(gr).all(), name
        inside = np.abs(d) <= 20
        with np.errstate(over="ignore"):
            np.testing.assert_allclose(v[inside], textbook(d[inside]), rtol=1e-6, atol=1e-6, err_msg=name)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"clip_c does not apply to loss 'gspo' \(its options: \['eps_high', 'eps_low'\]\)"):
        C(loss="gspo", clip_c=2.0)
    with pytest.raises(ValueError, match=r"mismatch_low does not apply to mismatch 'tis' \(its options: \['mismatch_cap'\]\)"):
        C(mismatch="tis", mismatch_low=0.5)
    with pytest.raises(ValueError, match="mismatch_cap is set but mismatch is off"):
        C(mismatch_cap=2.0)
    with pytest.raises(LookupError, match=r"unknown policy loss 'ppo2'; known: \['cispo', 'decoupled_ppo', 'gspo', "):
        C(loss="ppo2")
    with pytest.raises(LookupError, match=r"unknown mismatch correction 'tls'; known: \['icepop', 'measure', 'mis'"):
        C(mismatch="tls")
    with pytest.raises(ValueError, match=r"MaskConfig.mismatch_low=2.0 must be < mismatch_high=2.0"):
        C(mismatch="mis", mismatch_low=2.0)
    with pytest.raises(ValueError, match="behavior_cap must be a finite number in \\(1"):
        C(loss="decoupled_ppo", behavior_cap=0.5)
    with pytest.raises(ValueError, match="reads no behaviour log-probs"):
        C(loss="nll", mismatch="tis")
    with pytest.raises(KeyError, match=r"'seq_log_ratio' \(precomputed per token\) or 'sequence_ids'"):
        d, _, _ = make_batch(0)
        batch = {k: jnp.asarray(d[k], jnp.float32) for k in ("behavior_logprobs", "advantages")}
        L.policy_loss(jnp.asarray(d["logp"], jnp.float32), jnp.asarray(d["loss_weights"], jnp.float32), batch,
                      CONFIGS["gspo"])
    with pytest.raises(KeyError, match=r"needs \['prox_logprobs'\]"):
        batch = {k: jnp.zeros((2, 3)) for k in ("behavior_logprobs", "advantages")}
        L.policy_loss(jnp.zeros((2, 3)), jnp.ones((2, 3)), batch, CONFIGS["decoupled_ppo"])


# ----------------------------------------------------------------------------- advantages


def _ref_advantages(name, groups, eps=1e-6):
    """Per group, per slot; None = not valid. From the papers, with plain Python statistics."""
    valid = [[s for s in g if s is not None] for g in groups]

    def mean(x):
        return sum(x) / len(x)

    def pstd(x):
        m = mean(x)
        return math.sqrt(sum((v - m) ** 2 for v in x) / len(x))

    out = []
    if name in ("reinforce_pp", "reinforce_pp_baseline"):
        if name == "reinforce_pp":
            vals = {(i, j): s for i, g in enumerate(groups) for j, s in enumerate(g) if s is not None}
        else:  # group mean subtracted (0 for a group without variance), then the step's normalisation
            vals = {}
            for i, g in enumerate(groups):
                v = valid[i]
                for j, s in enumerate(g):
                    if s is not None:
                        vals[(i, j)] = (s - mean(v)) if len(v) >= 2 and max(v) > min(v) else 0.0
        xs = list(vals.values())
        spread = len(xs) >= 2 and max(xs) > min(xs)
        mu, sd = (mean(xs), pstd(xs)) if xs else (0.0, 0.0)
        return [[((vals[(i, j)] - mu) / (sd + eps) if spread else 0.0) if s is not None else 0.0
                 for j, s in enumerate(g)] for i, g in enumerate(groups)]
    for g, v in zip(groups, valid):
        signal = len(v) >= 2 and max(v) > min(v)
        row = []
        for s in g:
            if s is None or not signal:
                row.append(0.0)
            elif name == "grpo":
                row.append((s - mean(v)) / (pstd(v) + eps))
            elif name == "dr_grpo":
                row.append(s - mean(v))
            elif name == "rloo":
                others = list(v)
                others.remove(s)
                row.append(s - mean(others))
        out.append(row)
    return out


@pytest.mark.parametrize("name", L.ADVANTAGE_ESTIMATORS.names())
def test_advantage_estimators_match_the_papers(name):
    rng = np.random.default_rng(3)
    groups = [[float(x) for x in rng.choice([0.0, 0.25, 0.5, 1.0], 5)] for _ in range(5)]
    groups[1][2] = groups[1][4] = None  # failures: out of the statistics
    groups.append([0.5, None, 0.5, 0.5, None])  # equal scores: no signal
    groups.append([0.75, None, None, None, None])  # one valid rollout
    groups.append([None] * 5)  # every rollout failed
    scores = np.array([[0.0 if s is None else s for s in g] for g in groups])
    valid = np.array([[s is not None for s in g] for g in groups])
    entry = L.ADVANTAGE_ESTIMATORS.get(name)
    adv, m = entry.fn(scores, valid, entry.config())
    ref = np.array(_ref_advantages(name, groups))
    np.testing.assert_allclose(adv, ref, rtol=1e-6, atol=1e-12)
    assert adv.dtype == np.float64 and int(m["empty_groups"]) == 1 and int(m["no_variance_groups"]) == 2
    if entry.scope == "group":
        assert not adv[-3:].any()
    # jnp in: traceable, float32, the same numbers.
    adv_j, _ = jax.jit(lambda s, v: entry.fn(s, v, entry.config()))(jnp.asarray(scores, jnp.float32),
                                                                     jnp.asarray(valid))
    np.testing.assert_allclose(np.asarray(adv_j), ref, rtol=1e-5, atol=1e-6)


def test_weight_builders_match_their_formulas():
    d, seq, num_seq = make_batch(1)
    mask = d["loss_mask"]
    ids = np.maximum(seq, 0)
    n_i = np.bincount(ids[mask], minlength=num_seq)
    expect = {
        "rollout_token_mean": np.where(mask, 1.0 / (n_i[ids] * num_seq), 0.0),  # 1 / (N_r R)
        "token_mean": mask / mask.sum(),  # DAPO: 1 / N
        "constant": mask / (64.0 * num_seq),  # Dr. GRPO: 1 / (C R)
    }
    for name, want in expect.items():
        cfg = L.ConstantConfig(weights_normalizer=64) if name == "constant" else None
        w, units = L.build_loss_weights(name, mask, ids, num_seq, config=cfg)
        np.testing.assert_allclose(w, want, rtol=1e-6, atol=0)
        # a row at a time, with the step's counts and normaliser: the step's weights
        counts = n_i
        for b in range(B):
            wb, _ = L.build_loss_weights(name, mask[b : b + 1], ids[b : b + 1], num_seq, rollout_token_counts=counts,
                                         config=cfg, normalizer=units)
            np.testing.assert_allclose(wb, want[b : b + 1], rtol=1e-6, atol=0)
        wj, _ = jax.jit(lambda m, i: L.build_loss_weights(name, m, i, num_seq, config=cfg, normalizer=units))(
            jnp.asarray(mask), jnp.asarray(ids))
        np.testing.assert_allclose(np.asarray(wj), want, rtol=1e-6, atol=0)
