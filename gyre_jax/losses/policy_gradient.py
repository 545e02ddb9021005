"""Clipped-ratio policy-gradient loss on per-token arrays, with KL and entropy terms.

All inputs are [B, T] (any matching shape works). Per token, with ``A`` the
advantage, ``w`` the loss weight, ``mu`` the behavior log-prob (the sampler's),
``logp`` the current policy's, ``C`` = ``log_ratio_clamp`` and ``c`` = ``clip_c``:

    u      = clip(logp - mu, -C, C)                          clamped log-ratio
    r      = exp(u)                                          importance ratio
    pg     = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)  PPO / DAPO clip-higher
    pg     = min(pg, -c A)   where A < 0, if c is set         dual-clip
    kl     = k(logp, ref_logp)                               KL(pi || ref) estimator
    l      = pg + kl_coef * kl - entropy_coef * H
    loss   = sum_t w_t l_t

The weights carry the whole aggregation (see ``weights.py``): they are already
normalised over the *global* step, so the loss of a micro-batch is its exact
share, and summing micro-batch losses (and gradients) gives the step's.

Dual-clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep
Reinforcement Learning"; verl's ``clip_ratio_c``): for ``A < 0`` the PPO
objective ``min(r A, clip(r) A)`` is ``r A`` for every ``r > 1 - eps_low``, so
it is unbounded below as ``r`` grows; dual-clip takes ``max(that, c A)``, i.e.
the per-token loss is at most ``-c A`` and its gradient is 0 once ``r > c``.
``clip_c`` None or 0 turns it off; when set it must be > 1.

KL estimators (Schulman, "Approximating KL divergence"), with
``d = ref_logp - logp``: ``k1 = -d``; ``k2 = d^2 / 2``; ``k3 = exp(d) - 1 - d``
(unbiased, non-negative, low variance). They assume samples from the current
policy; with off-policy samples they are the usual GRPO approximation.

Gradient with respect to ``logp`` (what reaches the logits through
``token_logprobs``): ``-A r`` where the unclipped branch is active; 0 where the
clip is active (``A > 0, r > 1 + eps_high`` or ``A < 0, r < 1 - eps_low``),
where the dual clip is active (``A < 0, r > c``) and where the clamp is active
(``|logp - mu| > C``); plus ``kl_coef * dk/dlogp``. ``mu``, ``ref_logp`` and
``A`` get no gradient.

Safety by default: the log-ratio clamp. Engine and trainer far apart (stale
weights, mismatched numerics) can give ``logp - mu = 89``, and ``exp(89)``
overflows float32: without a bound the loss is NaN at ``A = 0`` (inf * 0), +inf
at ``A < 0``, and at ``A > 0`` the loss is finite but the gradient is NaN (the
clipped branch sends 0 back through ``exp(89)``). One such token poisons the
step. ``exp`` is therefore only ever evaluated on the clamped ``u``
(``log_ratio_clamp`` = 20 by default, as Tunix's GRPO and verl do), so every
branch, forward and backward, sees a ratio in ``[e^-C, e^C]``. The clamp is the
default rather than dual-clip because (a) it covers every sign of ``A`` and the
backward pass, where dual-clip only bounds the ``A < 0`` forward value, and
(b) for ``|logp - mu| <= C`` (every token of a healthy run) it changes nothing,
while dual-clip changes the objective of any ``A < 0`` token with ``r > c``
(reached in ordinary off-policy steps): an algorithm choice to opt into.

How the clamp meets the clip: with ``eps ~ 0.2`` the clip already zeroes the
gradient at ``log r > log(1 + eps_high) ~ 0.25`` for ``A > 0`` and at
``log r < log(1 - eps_low) ~ -0.22`` for ``A < 0``, far inside ``+-20``. The
clamp only acts in the directions the clip leaves open: ``A > 0`` with
``log r < -C`` (gradient ``-A r``, below ``2e-9 |A|``, becomes 0) and ``A < 0``
with ``log r > C`` (gradient 0 and loss capped at ``e^C |A| ~ 4.9e8 |A|``; add
dual-clip to cap it at ``c |A|`` and stop the gradient from ``r > c`` on).
``C`` must keep the clip's and the dual clip's thresholds inside the clamp
(validated) and is at most 80, so ``e^C`` leaves float32 headroom.

Masking: tokens with weight 0 are replaced by safe constants *before* any
arithmetic, so garbage there (NaN, +-inf) reaches neither the loss nor any
gradient. At weighted tokens an out-of-clamp log-ratio is counted in
``clamp_frac`` (and ``ratio_max`` / ``ratio_min`` reach ``e^+-C``): it is a real
problem upstream, shown, not hidden.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import chex
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


MAX_LOG_RATIO_CLAMP = 80.0  # exp(80) ~ 5.5e34: float32 headroom (exp(88.8) overflows)


def _finite_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_ratio_bounds(where: str, *, eps_low, eps_high, log_ratio_clamp, clip_c) -> None:
    """Validate the clamp and dual clip against the clip (``where`` prefixes the message).

    The clamp must leave the clip thresholds ``1 - eps_low``, ``1 + eps_high``
    and the dual clip ``c`` strictly inside ``(e^-C, e^C)``, so it never
    changes which branch a token is on, only how large ``r`` can get.
    """
    if not _finite_number(log_ratio_clamp) or not 0.0 < log_ratio_clamp <= MAX_LOG_RATIO_CLAMP:
        raise ValueError(
            f"{where}log_ratio_clamp must be a number in (0, {MAX_LOG_RATIO_CLAMP:g}], got {log_ratio_clamp!r}"
        )
    if clip_c is not None and (not _finite_number(clip_c) or (clip_c != 0 and clip_c <= 1.0)):
        raise ValueError(f"{where}clip_c (dual clip) must be None/0 (off) or a number > 1, got {clip_c!r}")
    hi = math.exp(log_ratio_clamp)
    if _finite_number(eps_high) and not 1.0 + eps_high < hi:
        raise ValueError(f"{where}log_ratio_clamp={log_ratio_clamp} must exceed log(1 + eps_high)")
    if _finite_number(eps_low) and not 1.0 - eps_low > 1.0 / hi:
        raise ValueError(f"{where}log_ratio_clamp={log_ratio_clamp} must exceed -log(1 - eps_low)")
    if clip_c and not clip_c < hi:
        raise ValueError(f"{where}clip_c={clip_c} must be < exp(log_ratio_clamp={log_ratio_clamp})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyLossConfig:
    """Hyper-parameters of ``policy_gradient_loss`` (hashable: usable as a jit static)."""

    eps_low: float = 0.2  # ratio clipped below at 1 - eps_low (when A < 0)
    eps_high: float = 0.28  # ratio clipped above at 1 + eps_high (when A > 0); DAPO clip-higher
    kl_coef: float = 0.0  # weight of the KL-to-reference term (needs reference log-probs)
    kl_estimator: str = "k3"  # one of KL_ESTIMATORS
    entropy_coef: float = 0.0  # weight of the entropy bonus (subtracted from the loss)
    entropy_metric: bool = True  # report the weighted entropy even when entropy_coef == 0
    # |logp - behavior_logp| is clamped to this before exp: loss and gradient stay
    # finite for any log-ratio (module docstring); no effect on tokens inside it.
    log_ratio_clamp: float = 20.0
    # Dual clip: for A < 0 the per-token loss is at most -clip_c * A (e.g. 3.0);
    # None or 0 = off. Must be > 1.
    clip_c: float | None = None

    def __post_init__(self):
        for name in ("eps_low", "eps_high", "kl_coef", "entropy_coef"):
            v = getattr(self, name)
            if not _finite_number(v):
                raise ValueError(f"PolicyLossConfig.{name} must be a finite number, got {v!r}")
        if not 0.0 <= self.eps_low < 1.0:
            raise ValueError(f"PolicyLossConfig.eps_low must be in [0, 1), got {self.eps_low}")
        if self.eps_high < 0.0:
            raise ValueError(f"PolicyLossConfig.eps_high must be >= 0, got {self.eps_high}")
        if self.kl_coef < 0.0:
            raise ValueError(f"PolicyLossConfig.kl_coef must be >= 0, got {self.kl_coef}")
        get_kl_estimator(self.kl_estimator)
        check_ratio_bounds(
            "PolicyLossConfig.",
            eps_low=self.eps_low,
            eps_high=self.eps_high,
            log_ratio_clamp=self.log_ratio_clamp,
            clip_c=self.clip_c,
        )

    def loss_kwargs(self) -> dict:
        """Keyword arguments of ``policy_gradient_loss`` (every field but ``entropy_metric``)."""
        return dict(
            eps_low=self.eps_low,
            eps_high=self.eps_high,
            kl_coef=self.kl_coef,
            kl_estimator=self.kl_estimator,
            entropy_coef=self.entropy_coef,
            log_ratio_clamp=self.log_ratio_clamp,
            clip_c=self.clip_c,
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
    "clip_frac_dual": "sum",
    "clamp_frac": "sum",
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
    log_ratio_clamp: float = 20.0,
    clip_c: float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``(loss, metrics)``; the math is in the module docstring.

    The coefficients and ``kl_estimator`` are Python values fixed at trace time
    (close over them or pass a ``PolicyLossConfig``); arrays may be traced.

    Metrics (float32 scalars; see ``METRIC_REDUCTIONS`` to combine micro-batches):
      ``loss``, ``pg_loss``: weighted sums of the total / policy-gradient term.
      ``approx_kl``: k3 estimate of KL(behavior || current), ``sum w (r - 1 - log r)``.
      ``clip_frac_low`` / ``clip_frac_high`` / ``clip_frac_dual`` / ``clip_frac``:
        weight share of tokens whose gradient a clip removes (``A < 0, r < 1 -
        eps_low`` / ``A > 0, r > 1 + eps_high`` / ``A < 0, r > clip_c`` / any).
      ``clamp_frac``: weight share of tokens with ``|logp - mu| > log_ratio_clamp``.
      ``ratio_mean`` (weighted), ``ratio_min``, ``ratio_max`` (over tokens with
        weight != 0; +inf / -inf when there are none), all of the clamped ``r``.
      ``kl_ref`` (with ``ref_logp_BxT``), ``entropy`` (with ``entropy_BxT``): weighted sums.
      ``weight_sum``, ``num_tokens``: total weight, count of weighted tokens.
    """
    where = "policy_gradient_loss"
    shape = logp_BxT.shape
    named = {
        "behavior_logp_BxT": behavior_logp_BxT,
        "advantages_BxT": advantages_BxT,
        "weights_BxT": weights_BxT,
        "ref_logp_BxT": ref_logp_BxT,
        "entropy_BxT": entropy_BxT,
    }
    for name, x in named.items():
        if x is not None:
            chex.assert_shape(x, shape, custom_message=f"{where}: {name} must have the shape of logp_BxT")
    if kl_coef != 0.0 and ref_logp_BxT is None:
        raise ValueError(f"{where}: kl_coef != 0 needs ref_logp_BxT")
    if entropy_coef != 0.0 and entropy_BxT is None:
        raise ValueError(f"{where}: entropy_coef != 0 needs entropy_BxT")
    check_ratio_bounds(
        f"{where}: ", eps_low=eps_low, eps_high=eps_high, log_ratio_clamp=log_ratio_clamp, clip_c=clip_c
    )
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
    # exp only ever sees the clamped value: outside the clamp the ratio is a
    # constant (gradient 0), so no branch multiplies exp(89) by 0, forward or back.
    u = jnp.clip(log_ratio, -log_ratio_clamp, log_ratio_clamp)
    ratio = jnp.exp(u)
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    pg = -jnp.minimum(ratio * adv, clipped * adv)
    if clip_c:
        # -c A is a constant: where it is the smaller, the token has no gradient.
        pg = jnp.where(adv < 0, jnp.minimum(pg, -clip_c * adv), pg)
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
    dual = active & (adv < 0) & (r > clip_c) if clip_c else jnp.zeros_like(active)
    clamped = active & (jnp.abs(sg(log_ratio)) > log_ratio_clamp)

    def share(mask):
        return jnp.sum(jnp.where(mask, w, 0.0))

    metrics.update(
        loss=sg(loss),
        pg_loss=sg(jnp.sum(w * pg)),
        approx_kl=jnp.sum(w * (r - 1.0 - sg(u))),
        clip_frac_low=share(low),
        clip_frac_high=share(high),
        clip_frac_dual=share(dual),
        clip_frac=share(low | high | dual),
        clamp_frac=share(clamped),
        ratio_mean=jnp.sum(w * r),
        ratio_min=jnp.min(jnp.where(active, r, jnp.inf)),
        ratio_max=jnp.max(jnp.where(active, r, -jnp.inf)),
        weight_sum=jnp.sum(w),
        num_tokens=jnp.sum(active).astype(f32),
    )
    return loss, metrics
