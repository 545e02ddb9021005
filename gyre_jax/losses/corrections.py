"""Train-inference mismatch corrections: a stop-gradient weight per token on the policy term.

The inference engine and the trainer compute different log-probs for the same
params (kernels, precision, batch shapes). With ``rho_t = pi_train(y_t) /
pi_infer(y_t)``, the trainer's log-prob at the *behaviour* version (the params that
sampled the token, recomputed on the packed rows) over the engine's recorded one,
a correction multiplies each token's policy term by ``sg(w_t)``, and the policy
loss then takes its ratio against the trainer's behaviour log-prob instead of the
engine's (verl's convention). Sequence-level variants use ``rho_seq = prod_t rho_t``
over the sequence (the RL loop: the rollout), applied to all its tokens.

* ``measure``: ``w = 1``; only the metrics (the cost: the behaviour-version pass).
* ``tis`` / ``tis_seq`` (Yao et al. 2025): truncated IS, ``w = min(rho, cap)``.
* ``mis`` / ``mis_seq`` (Liu, Li et al. 2025): masked IS, ``w = rho`` where ``low <= rho <=
  high``, else 0 (the token / the whole sequence drops out; the step's normaliser stays).
* ``icepop`` (Ling Team 2025): token-level two-sided masking, ``w = rho`` in ``[0.5, 5]``, else 0.

Every weight is computed in log space (``exp(min(log rho, log cap))``; a masked token
never reaches ``exp``), so it is finite for any log-ratio, ``+-inf`` included.

Per-step metrics of the mismatch, whatever the correction (weighted means over the
step's tokens; min/max over them): ``mismatch_kl`` (k3 estimate of KL(pi_infer ||
pi_train) on the engine's samples), ``mismatch_k1`` (mean ``log pi_infer - log
pi_train``), ``mismatch_ratio_min/max`` (token ``rho``), ``mismatch_weight_mean``, and
the share each correction truncated or masked.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gyre_jax.losses.numerics import check_number, k3_of_log_ratio
from gyre_jax.losses.registry import MISMATCH_CORRECTIONS, declare_metrics

MISMATCH_METRICS = dict(mismatch_kl="mean", mismatch_k1="mean", mismatch_ratio_min="min", mismatch_ratio_max="max",
                        mismatch_weight_mean="mean")
declare_metrics(MISMATCH_METRICS, "mismatch metrics")


class MismatchInputs(NamedTuple):
    log_rho: jax.Array  # per token: log pi_train(behaviour version) - log pi_infer; 0 where inactive
    seq_log_rho: jax.Array | None  # per token: the sum of log_rho over its sequence (sequence-level entries)
    weights: jax.Array
    active: jax.Array
    log_ratio_clamp: float


def mismatch_metrics(x: MismatchInputs, w_corr) -> dict:
    """The shared per-step metrics (module docstring)."""
    c = x.log_ratio_clamp
    r = jnp.exp(jnp.clip(x.log_rho, -c, c))
    return dict(mismatch_kl=jnp.sum(x.weights * k3_of_log_ratio(x.log_rho, c)),
                mismatch_k1=jnp.sum(x.weights * -x.log_rho),
                mismatch_ratio_min=jnp.min(jnp.where(x.active, r, jnp.inf)),
                mismatch_ratio_max=jnp.max(jnp.where(x.active, r, -jnp.inf)),
                mismatch_weight_mean=jnp.sum(x.weights * w_corr))


def _share(mask, x):
    return jnp.sum(jnp.where(mask & x.active, x.weights, 0.0))


def _log(v: float) -> float:
    return -math.inf if v == 0 else math.log(v)


@dataclasses.dataclass(frozen=True)
class MeasureConfig:
    """No hyper-parameters."""


@MISMATCH_CORRECTIONS.register(
    "measure", config=MeasureConfig, metrics={}, level="token",
    summary="no correction: report the mismatch metrics only",
    paper="(diagnostics of Yao et al. 2025 / Liu, Li et al. 2025)")
def measure(x: MismatchInputs, cfg: MeasureConfig):
    return jnp.ones_like(x.log_rho), {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TISConfig:
    mismatch_cap: float = 2.0  # C: the weight is min(rho, C)

    def __post_init__(self):
        check_number(f"{type(self).__name__}.", "mismatch_cap", self.mismatch_cap, lo=0.0, lo_open=True)


def _truncated(log_rho, x, cfg):
    cut = log_rho > math.log(cfg.mismatch_cap)
    return jnp.exp(jnp.minimum(log_rho, math.log(cfg.mismatch_cap))), {"mismatch_frac_truncated": _share(cut, x)}


@MISMATCH_CORRECTIONS.register(
    "tis", config=TISConfig, metrics={"mismatch_frac_truncated": "mean"}, level="token",
    summary="truncated IS per token: w = min(rho_t, cap)",
    paper="Yao et al. 2025, Your Efficient RL Framework Secretly Brings You Off-Policy RL Training (TIS)")
def tis(x: MismatchInputs, cfg: TISConfig):
    return _truncated(x.log_rho, x, cfg)


@MISMATCH_CORRECTIONS.register(
    "tis_seq", config=TISConfig, metrics={"mismatch_frac_truncated": "mean"}, level="sequence",
    summary="truncated IS per sequence: w = min(prod_t rho_t, cap) on all its tokens",
    paper="Yao et al. 2025 (TIS); sequence level as Liu, Li et al. 2025")
def tis_seq(x: MismatchInputs, cfg: TISConfig):
    return _truncated(x.seq_log_rho, x, cfg)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MaskConfig:
    mismatch_low: float = 0.0  # keep tokens (sequences) with low <= rho <= high; 0 = no lower bound
    mismatch_high: float = 2.0

    def __post_init__(self):
        where = f"{type(self).__name__}."
        check_number(where, "mismatch_low", self.mismatch_low, lo=0.0)
        check_number(where, "mismatch_high", self.mismatch_high, lo=0.0, lo_open=True)
        if not self.mismatch_low < self.mismatch_high:
            raise ValueError(f"{where}mismatch_low={self.mismatch_low} must be < mismatch_high={self.mismatch_high}")


def _masked(log_rho, x, cfg):
    keep = (log_rho >= _log(cfg.mismatch_low)) & (log_rho <= math.log(cfg.mismatch_high))
    w = jnp.exp(jnp.where(keep, log_rho, -jnp.inf))  # a dropped token never reaches exp's overflow
    return w, {"mismatch_frac_masked": _share(~keep, x)}


@MISMATCH_CORRECTIONS.register(
    "mis", config=MaskConfig, metrics={"mismatch_frac_masked": "mean"}, level="token",
    summary="masked IS per token: w = rho_t inside [low, high], else the token is dropped",
    paper="Liu, Li et al. 2025, When Speed Kills Stability: Demystifying RL Collapse from the "
          "Training-Inference Mismatch (MIS)")
def mis(x: MismatchInputs, cfg: MaskConfig):
    return _masked(x.log_rho, x, cfg)


@MISMATCH_CORRECTIONS.register(
    "mis_seq", config=MaskConfig, metrics={"mismatch_frac_masked": "mean"}, level="sequence",
    summary="masked IS per sequence: w = prod_t rho_t inside [low, high], else the sequence is dropped",
    paper="Liu, Li et al. 2025 (sequence-level MIS)")
def mis_seq(x: MismatchInputs, cfg: MaskConfig):
    return _masked(x.seq_log_rho, x, cfg)


@dataclasses.dataclass(frozen=True, kw_only=True)
class IcePopConfig(MaskConfig):
    mismatch_low: float = 0.5  # the paper's alpha, beta
    mismatch_high: float = 5.0


@MISMATCH_CORRECTIONS.register(
    "icepop", config=IcePopConfig, metrics={"mismatch_frac_masked": "mean"}, level="token",
    summary="IcePop: token-level two-sided masking, w = rho_t inside [0.5, 5], else 0",
    paper="Ling Team 2025, Every Step Evolves: Scaling RL for Trillion-Scale Thinking Model (IcePop)")
def icepop(x: MismatchInputs, cfg: IcePopConfig):
    return _masked(x.log_rho, x, cfg)
