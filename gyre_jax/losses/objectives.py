"""The registered policy losses: per-token surrogate terms on [B, T] arrays.

Each is ``fn(x: PolicyInputs, config) -> (pg_BxT, metrics)``: ``pg`` is the
per-token policy term (``policy_loss`` multiplies it by a mismatch correction, adds
KL and entropy and takes ``sum(w * .)``), ``metrics`` are weighted sums (``sum(w *
.)``) or min/max over active tokens, as the entry declares. Notation, per token:
``logp`` the current policy's log-prob, ``old`` the ratio's base (the engine's
behaviour log-prob, or the trainer's at the behaviour version when a mismatch
correction is on), ``A`` the advantage, ``C`` = ``log_ratio_clamp``, ``sg`` stop-gradient.

* ``ppo_clip`` (Schulman et al. 2017, PPO; DAPO's clip-higher; Ye et al. 2020's dual clip)::

      r = exp(clip(logp - old, -C, C));  pg = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
      dual clip (clip_c = c > 1): pg = min(pg, -c A) where A < 0

* ``gspo`` (Zheng et al. 2025, GSPO): the sequence ratio is the length-normalised
  geometric mean ``s_i = exp(mean_{t in i}(logp_t - old_t))``, clipped per sequence;
  the token form ``s_i,t = sg(s_i) * exp(logp_t - sg(logp_t))`` has the value ``s_i``
  and the gradient ``s_i grad logp_t``, so with token weights uniform within a
  sequence (``1 / (|y_i| G)``) the sum is the paper's ``1/G sum_i min(s_i A_i,
  clip(s_i) A_i)`` and its gradient. The per-sequence mean comes precomputed
  (``seq_log_ratio``: the RL loop's per-step pass) or from ``sequence_ids`` in the batch.
* ``cispo`` (MiniMax 2025, MiniMax-M1): ``pg = -sg(clip(r, 1 - eps_low, 1 + eps_high)) A logp``:
  every token keeps a gradient, only its IS weight is bounded.
* ``decoupled_ppo`` (Hilton et al. 2021; AReaL, Fu et al. 2025): three policies. The
  clip is on ``r = pi_theta / pi_prox`` (the proximal policy: the trainer's params at
  the step's start, recomputed on the step's rows), and the token is weighted by
  ``b = sg(pi_prox / pi_behav)``; tokens with ``b > behavior_cap`` get weight 0 (AReaL).
  The RL loop applies one optimizer update per step, so at the gradient ``pi_theta =
  pi_prox`` (r = 1, the clip never acts) and the objective is the behaviour-weighted
  policy gradient ``-b A grad logp``: AReaL's with one mini-batch per step.
* ``reinforce`` (Williams 1992 with IS weights; truncation as IMPALA's, Espeholt et al. 2018):
  ``pg = -sg(min(r, is_cap)) A logp`` (``is_cap`` None: the plain IS weight ``r``).
* ``nll`` (maximum likelihood, the SFT objective): ``pg = -logp``; no advantage, no ratio.

Every ratio is ``exp`` of a log-ratio clamped to ``[-C, C]`` (``policy_gradient``'s
module docstring says why), and a token whose log-ratio is outside the clamp gets no
gradient through it: loss and gradient stay finite for any log-ratio.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gyre_jax.losses.numerics import check_number, k3_of_log_ratio
from gyre_jax.losses.registry import POLICY_LOSSES

sg = jax.lax.stop_gradient


class PolicyInputs(NamedTuple):
    """What a policy loss sees; every array [B, T] float32, masked (0 where ``active`` is False)."""

    logp: jax.Array  # current policy (gradient flows)
    old_logp: jax.Array  # the ratio's base, stop-gradient
    advantages: jax.Array  # stop-gradient
    weights: jax.Array  # aggregation weights, 0 outside the loss
    active: jax.Array  # bool: weights != 0
    log_ratio_clamp: float
    prox_logp: jax.Array | None = None  # decoupled_ppo: the proximal policy's, stop-gradient
    seq_log_ratio: jax.Array | None = None  # gspo: per token, its sequence's mean of sg(logp - old)


def _share(mask, x: PolicyInputs):
    return jnp.sum(jnp.where(mask & x.active, x.weights, 0.0))


def _ratio_stats(r, x: PolicyInputs) -> dict:
    """Weighted mean and the min/max over active tokens of a ratio (stop-gradient)."""
    r = sg(r)
    return dict(ratio_mean=jnp.sum(x.weights * r), ratio_min=jnp.min(jnp.where(x.active, r, jnp.inf)),
                ratio_max=jnp.max(jnp.where(x.active, r, -jnp.inf)))


def _clamped(log_ratio, x: PolicyInputs):
    """(u, r, outside): the clamped log-ratio, its exp, and where the clamp acts (no gradient there)."""
    c = x.log_ratio_clamp
    u = jnp.clip(log_ratio, -c, c)
    return u, jnp.exp(u), jnp.abs(sg(log_ratio)) > c


def _clip_metrics(low, high, dual, outside, x) -> dict:
    return dict(clip_frac_low=_share(low, x), clip_frac_high=_share(high, x), clip_frac_dual=_share(dual, x),
                clip_frac=_share(low | high | dual, x), clamp_frac=_share(outside, x))


def clipped_surrogate(log_ratio, x: PolicyInputs, eps_low, eps_high, clip_c):
    """``-min(r A, clip(r) A)`` with the optional dual clip; (pg, metrics). ``log_ratio`` carries the gradient."""
    adv = x.advantages
    u, r, outside = _clamped(log_ratio, x)
    pg = -jnp.minimum(r * adv, jnp.clip(r, 1.0 - eps_low, 1.0 + eps_high) * adv)
    if clip_c:
        pg = jnp.where(adv < 0, jnp.minimum(pg, -clip_c * adv), pg)  # -c A is a constant: no gradient there
    rs = sg(r)
    low = (adv < 0) & (rs < 1.0 - eps_low)
    high = (adv > 0) & (rs > 1.0 + eps_high)
    dual = (adv < 0) & (rs > clip_c) if clip_c else jnp.zeros_like(x.active)
    m = _clip_metrics(low, high, dual, outside, x)
    m.update(_ratio_stats(r, x), approx_kl=jnp.sum(x.weights * (rs - 1.0 - sg(u))))
    return pg, m


def _given(value: jax.Array | None, name: str) -> jax.Array:
    """An optional PolicyInputs field the loss's registration asks for (the loss function fills it)."""
    if value is None:
        raise ValueError(f"PolicyInputs.{name} is None, but this loss's registration needs it")
    return value


def _check_clip(where, eps_low, eps_high, clip_c):
    check_number(where, "eps_low", eps_low, lo=0.0, hi=1.0, hi_open=True)
    check_number(where, "eps_high", eps_high, lo=0.0)
    if clip_c is not None and clip_c != 0:
        check_number(where, "clip_c", clip_c, lo=1.0, lo_open=True)


def _clamp_leaves_inside(where, clamp, *bounds):
    """The clamp must leave every threshold of the clip strictly inside (e^-C, e^C), so it only
    limits how large r gets, never which branch a token is on."""
    import math

    hi = math.exp(clamp)
    for name, b in bounds:
        if b is not None and b > 0 and not 1.0 / hi < b < hi:
            raise ValueError(f"{where}log_ratio_clamp={clamp} must exceed |log({name})| = {abs(math.log(b)):.4g}")


_CLIP_METRICS = dict(clip_frac="mean", clip_frac_low="mean", clip_frac_high="mean", clip_frac_dual="mean",
                     clamp_frac="mean", ratio_mean="mean", ratio_min="min", ratio_max="max", approx_kl="mean")


# ----------------------------------------------------------------------------- ppo_clip


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClipConfig:
    eps_low: float = 0.2  # r clipped below at 1 - eps_low (A < 0)
    eps_high: float = 0.28  # r clipped above at 1 + eps_high (A > 0); DAPO's clip-higher
    clip_c: float | None = None  # dual clip: the A < 0 loss is at most -clip_c * A (> 1); None or 0 = off

    def __post_init__(self):
        _check_clip(f"{type(self).__name__}.", self.eps_low, self.eps_high, self.clip_c)

    def check_clamp(self, clamp, where):
        _clamp_leaves_inside(where, clamp, ("1 - eps_low", 1.0 - self.eps_low), ("1 + eps_high", 1.0 + self.eps_high),
                             ("clip_c", self.clip_c or None))


@POLICY_LOSSES.register(
    "ppo_clip", config=ClipConfig, metrics=_CLIP_METRICS, inputs=("behavior_logprobs", "advantages"),
    summary="clipped importance ratio per token, asymmetric clip-higher, optional dual clip",
    paper="Schulman et al. 2017 (PPO); Yu et al. 2025 (DAPO clip-higher); Ye et al. 2020 (dual clip)")
def ppo_clip(x: PolicyInputs, cfg: ClipConfig):
    return clipped_surrogate(x.logp - x.old_logp, x, cfg.eps_low, cfg.eps_high, cfg.clip_c)


# ----------------------------------------------------------------------------- gspo


@dataclasses.dataclass(frozen=True, kw_only=True)
class GSPOConfig:
    eps_low: float = 3e-4  # the paper's sequence-ratio clip range (3e-4, 4e-4)
    eps_high: float = 4e-4

    def __post_init__(self):
        _check_clip("GSPOConfig.", self.eps_low, self.eps_high, None)

    def check_clamp(self, clamp, where):
        _clamp_leaves_inside(where, clamp, ("1 - eps_low", 1.0 - self.eps_low), ("1 + eps_high", 1.0 + self.eps_high))


@POLICY_LOSSES.register(
    "gspo", config=GSPOConfig, metrics=_CLIP_METRICS, inputs=("behavior_logprobs", "advantages"),
    sequence_stat="seq_log_ratio",
    summary="sequence-level ratio (length-normalised geometric mean of token ratios), clipped per sequence",
    paper="Zheng et al. 2025, Group Sequence Policy Optimization (GSPO)")
def gspo(x: PolicyInputs, cfg: GSPOConfig):
    c = x.log_ratio_clamp
    seq = sg(_given(x.seq_log_ratio, "seq_log_ratio"))
    outside = jnp.abs(seq) > c
    # value: the sequence's clamped log-ratio; gradient: d logp_t (none where the clamp acts)
    tok = jnp.where(outside, 0.0, x.logp - sg(x.logp))
    s = jnp.exp(jnp.clip(seq, -c, c) + tok)
    adv = x.advantages
    pg = -jnp.minimum(s * adv, jnp.clip(s, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * adv)
    ss = sg(s)
    low = (adv < 0) & (ss < 1.0 - cfg.eps_low)
    high = (adv > 0) & (ss > 1.0 + cfg.eps_high)
    m = _clip_metrics(low, high, jnp.zeros_like(x.active), outside, x)
    m.update(_ratio_stats(s, x), approx_kl=jnp.sum(x.weights * k3_of_log_ratio(sg(x.logp - x.old_logp), c)))
    return pg, m


# ----------------------------------------------------------------------------- cispo


@dataclasses.dataclass(frozen=True, kw_only=True)
class CISPOConfig:
    eps_low: float = 1.0  # IS weight clipped below at 1 - eps_low: 1.0 = no lower bound (MiniMax-M1)
    eps_high: float = 3.0  # and above at 1 + eps_high (4.0, as Tinker's default)

    def __post_init__(self):
        check_number("CISPOConfig.", "eps_low", self.eps_low, lo=0.0, hi=1.0)
        check_number("CISPOConfig.", "eps_high", self.eps_high, lo=0.0)


@POLICY_LOSSES.register(
    "cispo", config=CISPOConfig, metrics=_CLIP_METRICS, inputs=("behavior_logprobs", "advantages"),
    summary="REINFORCE with a clipped, stop-gradient IS weight: every token keeps its gradient",
    paper="MiniMax 2025, MiniMax-M1 (CISPO)")
def cispo(x: PolicyInputs, cfg: CISPOConfig):
    u, r, outside = _clamped(sg(x.logp - x.old_logp), x)
    lo, hi = 1.0 - cfg.eps_low, 1.0 + cfg.eps_high
    w_is = jnp.clip(r, lo, hi)
    pg = -w_is * x.advantages * x.logp
    m = _clip_metrics(r < lo, r > hi, jnp.zeros_like(x.active), outside, x)
    m.update(_ratio_stats(r, x), approx_kl=jnp.sum(x.weights * (r - 1.0 - u)))
    return pg, m


# ----------------------------------------------------------------------------- decoupled_ppo


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoupledConfig(ClipConfig):
    # tokens whose behaviour weight pi_prox / pi_behav exceeds this get weight 0 (AReaL's
    # behav_imp_weight_cap, > 1); None or 0 = keep every token
    behavior_cap: float | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.behavior_cap is not None and self.behavior_cap != 0:
            check_number("DecoupledConfig.", "behavior_cap", self.behavior_cap, lo=1.0, lo_open=True)


@POLICY_LOSSES.register(
    "decoupled_ppo", config=DecoupledConfig,
    metrics={**_CLIP_METRICS, "behavior_weight_mean": "mean", "behavior_weight_max": "max",
             "behavior_cap_frac": "mean", "behavior_kl": "mean"},
    inputs=("behavior_logprobs", "advantages", "prox_logprobs"),
    summary="PPO clip against the proximal policy (the step's params), weighted by pi_prox / pi_behav",
    paper="Hilton et al. 2021 (batch size-invariant PPO); Fu et al. 2025 (AReaL, decoupled PPO)")
def decoupled_ppo(x: PolicyInputs, cfg: DecoupledConfig):
    prox = sg(_given(x.prox_logp, "prox_logp"))
    pg, m = clipped_surrogate(x.logp - prox, x, cfg.eps_low, cfg.eps_high, cfg.clip_c)
    lb = prox - x.old_logp
    b = jnp.exp(jnp.clip(lb, -x.log_ratio_clamp, x.log_ratio_clamp))
    over = (lb > jnp.log(cfg.behavior_cap)) if cfg.behavior_cap else jnp.zeros_like(x.active)
    b = jnp.where(over, 0.0, b)
    m.update(behavior_weight_mean=jnp.sum(x.weights * b),
             behavior_weight_max=jnp.max(jnp.where(x.active, b, -jnp.inf)),
             behavior_cap_frac=_share(over, x),
             behavior_kl=jnp.sum(x.weights * k3_of_log_ratio(lb, x.log_ratio_clamp)))
    return pg * b, m


# ----------------------------------------------------------------------------- reinforce


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReinforceConfig:
    is_cap: float | None = None  # truncate the IS weight at this (> 0); None or 0 = the plain weight

    def __post_init__(self):
        if self.is_cap is not None and self.is_cap != 0:
            check_number("ReinforceConfig.", "is_cap", self.is_cap, lo=0.0, lo_open=True)


@POLICY_LOSSES.register(
    "reinforce", config=ReinforceConfig,
    metrics={"ratio_mean": "mean", "ratio_min": "min", "ratio_max": "max", "clamp_frac": "mean",
             "approx_kl": "mean", "is_truncated_frac": "mean"},
    inputs=("behavior_logprobs", "advantages"),
    summary="REINFORCE with per-token importance weights, optionally truncated",
    paper="Williams 1992 (REINFORCE); Espeholt et al. 2018 (IMPALA, truncated IS weights)")
def reinforce(x: PolicyInputs, cfg: ReinforceConfig):
    u, r, outside = _clamped(sg(x.logp - x.old_logp), x)
    cut = (r > cfg.is_cap) if cfg.is_cap else jnp.zeros_like(x.active)
    w_is = jnp.minimum(r, cfg.is_cap) if cfg.is_cap else r
    m = dict(_ratio_stats(r, x), clamp_frac=_share(outside, x), approx_kl=jnp.sum(x.weights * (r - 1.0 - u)),
             is_truncated_frac=_share(cut, x))
    return -w_is * x.advantages * x.logp, m


# ----------------------------------------------------------------------------- nll


@dataclasses.dataclass(frozen=True)
class NLLConfig:
    """No hyper-parameters."""


@POLICY_LOSSES.register(
    "nll", config=NLLConfig, metrics={}, inputs=(),
    summary="negative log-likelihood of the targets (supervised fine-tuning)",
    paper="Maximum likelihood; the loop's SFT warm start")
def nll(x: PolicyInputs, cfg: NLLConfig):
    return -x.logp, {}
