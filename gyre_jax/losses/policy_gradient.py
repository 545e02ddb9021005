"""Clipped-ratio policy-gradient loss on per-token arrays, with KL and entropy terms.

All inputs are [B, T] (any matching shape works). Per token, with ``A`` the
advantage, ``w`` the loss weight, ``mu`` the behavior log-prob (the sampler's)
and ``logp`` the current policy's:

    r      = exp(logp - mu)                                  importance ratio
    pg     = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)  PPO / DAPO clip-higher
    kl     = k(logp, ref_logp)                               KL(pi || ref) estimator
    l      = pg + kl_coef * kl - entropy_coef * H
    loss   = sum_t w_t l_t

The weights carry the whole aggregation (see ``weights.py``): they are already
normalised over the *global* step, so the loss of a micro-batch is its exact
share, and summing micro-batch losses (and gradients) gives the step's.

KL estimators (Schulman, "Approximating KL divergence"), with
``d = ref_logp - logp``: ``k1 = -d``; ``k2 = d^2 / 2``; ``k3 = exp(d) - 1 - d``
(unbiased, non-negative, low variance). They assume samples from the current
policy; with off-policy samples they are the usual GRPO approximation.

Gradient with respect to ``logp`` (what reaches the logits through
``token_logprobs``): ``-A r`` where the unclipped branch is active, 0 where the
clip is active (``A > 0, r > 1 + eps_high`` or ``A < 0, r < 1 - eps_low``),
plus ``kl_coef * dk/dlogp``. ``mu``, ``ref_logp`` and ``A`` get no gradient.

Masking: tokens with weight 0 are replaced by safe constants *before* any
arithmetic, so garbage there (NaN, +-inf) reaches neither the loss nor any
gradient. Ratios are not clamped at weighted tokens: an overflowing ``r`` there
is a real problem upstream and shows up in ``ratio_max``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp


def kl_k1(logp, ref_logp):
    """k1 = logp - ref_logp (unbiased, can be negative)."""
    return logp - ref_logp


def kl_k2(logp, ref_logp):
    """k2 = (logp - ref_logp)^2 / 2 (biased, non-negative)."""
    return 0.5 * jnp.square(logp - ref_logp)


def kl_k3(logp, ref_logp):
    """k3 = exp(d) - 1 - d with d = ref_logp - logp (unbiased, non-negative)."""
    d = ref_logp - logp
    return jnp.expm1(d) - d


KL_ESTIMATORS: dict[str, Callable] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def get_kl_estimator(name: str) -> Callable:
    try:
        return KL_ESTIMATORS[name]
    except KeyError:
        raise LookupError(f"unknown kl_estimator {name!r}; known: {sorted(KL_ESTIMATORS)}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyLossConfig:
    """Hyper-parameters of ``policy_gradient_loss`` (hashable: usable as a jit static)."""

    eps_low: float = 0.2  # ratio clipped below at 1 - eps_low (when A < 0)
    eps_high: float = 0.28  # ratio clipped above at 1 + eps_high (when A > 0); DAPO clip-higher
    kl_coef: float = 0.0  # weight of the KL-to-reference term (needs reference log-probs)
    kl_estimator: str = "k3"  # one of KL_ESTIMATORS
    entropy_coef: float = 0.0  # weight of the entropy bonus (subtracted from the loss)
    entropy_metric: bool = True  # report the weighted entropy even when entropy_coef == 0

    def __post_init__(self):
        for name in ("eps_low", "eps_high", "kl_coef", "entropy_coef"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
                raise ValueError(f"PolicyLossConfig.{name} must be a finite number, got {v!r}")
        if not 0.0 <= self.eps_low < 1.0:
            raise ValueError(f"PolicyLossConfig.eps_low must be in [0, 1), got {self.eps_low}")
        if self.eps_high < 0.0:
            raise ValueError(f"PolicyLossConfig.eps_high must be >= 0, got {self.eps_high}")
        if self.kl_coef < 0.0:
            raise ValueError(f"PolicyLossConfig.kl_coef must be >= 0, got {self.kl_coef}")
        get_kl_estimator(self.kl_estimator)

    def loss_kwargs(self) -> dict:
        return dict(
            eps_low=self.eps_low,
            eps_high=self.eps_high,
            kl_coef=self.kl_coef,
            kl_estimator=self.kl_estimator,
            entropy_coef=self.entropy_coef,
        )


# How each metric combines across micro-batches of one step. "sum" metrics are
# sum(w * x): with the step's weights summing to 1 their total is the step's
# weighted mean.
METRIC_REDUCTIONS = {
    "loss": "sum",
    "pg_loss": "sum",
    "kl_ref": "sum",
    "entropy": "sum",
    "approx_kl": "sum",
    "clip_frac": "sum",
    "clip_frac_low": "sum",
    "clip_frac_high": "sum",
    "ratio_mean": "sum",
    "ratio_min": "min",
    "ratio_max": "max",
    "weight_sum": "sum",
    "num_tokens": "sum",
    "weight_outside_mask": "sum",
}
_NOT_MEANS = ("weight_sum", "num_tokens", "weight_outside_mask", "ratio_min", "ratio_max")


def combine_metrics(a: dict, b: dict) -> dict:
    """Merge two micro-batches' metrics of one step (jittable, associative)."""
    if a.keys() != b.keys():
        raise ValueError(f"combine_metrics: different metric keys {sorted(a)} vs {sorted(b)}")
    ops = {"sum": jnp.add, "min": jnp.minimum, "max": jnp.maximum}
    return {k: ops[METRIC_REDUCTIONS[k]](a[k], b[k]) for k in a}


def mean_metrics(m: dict) -> dict:
    """Turn summed metrics into weighted means over the tokens they cover.

    For a whole step (weights summing to 1) this changes nothing; for one
    micro-batch it gives that micro-batch's own means.
    """
    ws = m["weight_sum"]
    safe = jnp.where(ws != 0, ws, 1.0)
    return {k: (v if k in _NOT_MEANS else v / safe) for k, v in m.items()}


def policy_gradient_loss(
    logp_BxT: jax.Array,
    behavior_logp_BxT: jax.Array,
    advantages_BxT: jax.Array,
    weights_BxT: jax.Array,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    ref_logp_BxT: jax.Array | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_BxT: jax.Array | None = None,
    entropy_coef: float = 0.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``(loss, metrics)``; the math is in the module docstring.

    The coefficients and ``kl_estimator`` are Python values fixed at trace time
    (close over them or pass a ``PolicyLossConfig``); arrays may be traced.

    Metrics (float32 scalars; see ``METRIC_REDUCTIONS`` to combine micro-batches):
      ``loss``, ``pg_loss``: weighted sums of the total / policy-gradient term.
      ``approx_kl``: k3 estimate of KL(behavior || current), ``sum w (r - 1 - log r)``.
      ``clip_frac_low`` / ``clip_frac_high`` / ``clip_frac``: weight share of
        tokens whose gradient the clip removes (``A < 0, r < 1 - eps_low`` /
        ``A > 0, r > 1 + eps_high`` / either).
      ``ratio_mean`` (weighted), ``ratio_min``, ``ratio_max`` (over tokens with
        weight != 0; +inf / -inf when there are none).
      ``kl_ref`` (with ``ref_logp_BxT``), ``entropy`` (with ``entropy_BxT``): weighted sums.
      ``weight_sum``, ``num_tokens``: total weight, count of weighted tokens.
    """
    shape = logp_BxT.shape
    named = {
        "behavior_logp_BxT": behavior_logp_BxT,
        "advantages_BxT": advantages_BxT,
        "weights_BxT": weights_BxT,
        "ref_logp_BxT": ref_logp_BxT,
        "entropy_BxT": entropy_BxT,
    }
    for name, x in named.items():
        if x is not None and x.shape != shape:
            raise ValueError(f"policy_gradient_loss: {name} has shape {x.shape}, logp_BxT has {shape}")
    if kl_coef != 0.0 and ref_logp_BxT is None:
        raise ValueError("policy_gradient_loss: kl_coef != 0 needs ref_logp_BxT")
    if entropy_coef != 0.0 and entropy_BxT is None:
        raise ValueError("policy_gradient_loss: entropy_coef != 0 needs entropy_BxT")
    kl_fn = get_kl_estimator(kl_estimator)

    f32 = jnp.float32
    active = weights_BxT != 0
    w = jnp.where(active, weights_BxT, 0.0).astype(f32)

    def safe(x, fill=0.0):
        return jnp.where(active, x.astype(f32), fill)

    sg = jax.lax.stop_gradient
    logp = safe(logp_BxT)
    mu = sg(safe(behavior_logp_BxT))
    adv = sg(safe(advantages_BxT))
    log_ratio = logp - mu
    ratio = jnp.exp(log_ratio)
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    pg = -jnp.minimum(ratio * adv, clipped * adv)
    per_token = pg
    metrics = {}
    if ref_logp_BxT is not None:
        kl = kl_fn(logp, sg(safe(ref_logp_BxT)))
        per_token = per_token + kl_coef * kl
        metrics["kl_ref"] = jnp.sum(w * kl)
    if entropy_BxT is not None:
        ent = safe(entropy_BxT)
        per_token = per_token - entropy_coef * ent
        metrics["entropy"] = jnp.sum(w * sg(ent))
    loss = jnp.sum(w * per_token)

    r = sg(ratio)
    low = active & (adv < 0) & (r < 1.0 - eps_low)
    high = active & (adv > 0) & (r > 1.0 + eps_high)
    metrics.update(
        loss=sg(loss),
        pg_loss=sg(jnp.sum(w * pg)),
        approx_kl=jnp.sum(w * (r - 1.0 - sg(log_ratio))),
        clip_frac_low=jnp.sum(jnp.where(low, w, 0.0)),
        clip_frac_high=jnp.sum(jnp.where(high, w, 0.0)),
        clip_frac=jnp.sum(jnp.where(low | high, w, 0.0)),
        ratio_mean=jnp.sum(w * r),
        ratio_min=jnp.min(jnp.where(active, r, jnp.inf)),
        ratio_max=jnp.max(jnp.where(active, r, -jnp.inf)),
        weight_sum=jnp.sum(w),
        num_tokens=jnp.sum(active).astype(f32),
    )
    return loss, metrics
