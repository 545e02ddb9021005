"""Advantage estimators: one advantage per rollout from the scores of a step's groups.

``fn(scores_GxN, valid_GxN, config) -> (adv_GxN, metrics)``: G groups (one task's
rollouts each) padded to N slots; ``valid`` marks the rollouts that are trained
(completed or timed out with partial credit); every other slot (padding, infra or
verifier failures) gets advantage 0 and never enters a statistic. numpy in (the
trajectory processor: float64), numpy out; jax arrays in, traceable. With ``r`` the
scores of a group's valid rollouts, ``n = |r|``:

* ``grpo`` (Shao et al. 2024): ``A = (r - mean(r)) / (std(r) + eps)`` (population std).
* ``dr_grpo`` (Liu et al. 2025): ``A = r - mean(r)``; pair it with the ``constant`` weights.
* ``rloo`` (Kool et al. 2019; Ahmadian et al. 2024): ``A_i = r_i - mean_{j != i}(r_j)``.
* ``reinforce_pp`` (Hu 2025): no group baseline; ``A = (r - mean_B(r)) / (std_B(r) + eps)``
  over every valid rollout of the step.
* ``reinforce_pp_baseline`` (Hu 2025, REINFORCE++-baseline): ``a = r - mean(r)`` in the
  group, then ``A = (a - mean_B(a)) / (std_B(a) + eps)`` over the step.

A group with no variance (one valid rollout, or equal scores) gets exactly 0 under the
group estimators, never NaN; the step estimators give 0 only when the whole step has
none. ``scope``: ``group`` estimators need only their group, so a trainer may process
groups as they finish; ``step`` estimators need every group of the step first.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from gyre_jax.losses.numerics import check_number
from gyre_jax.losses.registry import ADVANTAGE_ESTIMATORS, NoConfig

_METRICS = {"no_variance_groups": "count", "empty_groups": "count"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class NormConfig:
    advantage_eps: float = 1e-6  # added to the std

    def __post_init__(self):
        check_number(f"{type(self).__name__}.", "advantage_eps", self.advantage_eps, lo=0.0)


def _xp(*xs):
    return jnp if any(isinstance(x, jax.Array) for x in xs) else np


def _groups(scores, valid):
    """(xp, valid, n, centred, std, spread): per-group statistics over the valid slots."""
    xp = _xp(scores, valid)
    v = xp.asarray(valid).astype(bool)
    s = xp.where(v, xp.asarray(scores), 0.0)
    n = v.sum(axis=-1, keepdims=True)
    mean = s.sum(axis=-1, keepdims=True) / xp.maximum(n, 1)
    c = xp.where(v, s - mean, 0.0)
    std = xp.sqrt((c * c).sum(axis=-1, keepdims=True) / xp.maximum(n, 1))
    hi = xp.max(xp.where(v, s, -xp.inf), axis=-1, keepdims=True)
    lo = xp.min(xp.where(v, s, xp.inf), axis=-1, keepdims=True)
    spread = (n >= 2) & (hi > lo)  # equal scores: exactly no signal (r - mean can be 1 ulp off)
    return xp, v, n, c, std, spread


def _metrics(xp, n, spread):
    return {"no_variance_groups": xp.sum((n[:, 0] >= 1) & ~spread[:, 0]), "empty_groups": xp.sum(n[:, 0] == 0)}


def _batch_norm(xp, x, v, eps):
    """(x - mean) / (std + eps) over every valid slot; 0 where not valid or when nothing varies."""
    m = v.sum()
    xs = xp.where(v, x, 0.0)
    mean = xs.sum() / xp.maximum(m, 1)
    c = xp.where(v, xs - mean, 0.0)
    std = xp.sqrt((c * c).sum() / xp.maximum(m, 1))
    hi, lo = xp.max(xp.where(v, xs, -xp.inf)), xp.min(xp.where(v, xs, xp.inf))
    spread = (m >= 2) & (hi > lo)
    return xp.where(v & spread, c / xp.where(spread, std + eps, 1.0), 0.0)  # no 0 / 0 in the branch not taken


@ADVANTAGE_ESTIMATORS.register(
    "grpo", config=NormConfig, metrics=_METRICS, scope="group",
    summary="group-normalised: (r - group mean) / (group std + eps)",
    paper="Shao et al. 2024, DeepSeekMath (GRPO)")
def grpo(scores_GxN, valid_GxN, cfg: NormConfig):
    xp, v, n, c, std, spread = _groups(scores_GxN, valid_GxN)
    return xp.where(v & spread, c / xp.where(spread, std + cfg.advantage_eps, 1.0), 0.0), _metrics(xp, n, spread)


@ADVANTAGE_ESTIMATORS.register(
    "dr_grpo", config=NoConfig, metrics=_METRICS, scope="group",
    summary="group mean baseline, no std division (pair with weights=constant)",
    paper="Liu et al. 2025, Understanding R1-Zero-Like Training: A Critical Perspective (Dr. GRPO)")
def dr_grpo(scores_GxN, valid_GxN, cfg: NoConfig):
    xp, v, n, c, std, spread = _groups(scores_GxN, valid_GxN)
    return xp.where(v & spread, c, 0.0), _metrics(xp, n, spread)


@ADVANTAGE_ESTIMATORS.register(
    "rloo", config=NoConfig, metrics=_METRICS, scope="group",
    summary="leave-one-out baseline: r_i - mean of the group's other rollouts",
    paper="Kool et al. 2019 (Buy 4 REINFORCE samples); Ahmadian et al. 2024 (Back to Basics, RLOO)")
def rloo(scores_GxN, valid_GxN, cfg: NoConfig):
    xp, v, n, c, std, spread = _groups(scores_GxN, valid_GxN)
    # r_i - (S - r_i) / (n - 1) = n / (n - 1) * (r_i - mean)
    return xp.where(v & spread, c * n / xp.maximum(n - 1, 1), 0.0), _metrics(xp, n, spread)


@ADVANTAGE_ESTIMATORS.register(
    "reinforce_pp", config=NormConfig, metrics=_METRICS, scope="step",
    summary="no group baseline: scores normalised by the step's mean and std",
    paper="Hu 2025, REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models")
def reinforce_pp(scores_GxN, valid_GxN, cfg: NormConfig):
    xp, v, n, c, std, spread = _groups(scores_GxN, valid_GxN)
    return _batch_norm(xp, xp.asarray(scores_GxN), v, cfg.advantage_eps), _metrics(xp, n, spread)


@ADVANTAGE_ESTIMATORS.register(
    "reinforce_pp_baseline", config=NormConfig, metrics=_METRICS, scope="step",
    summary="group mean subtracted, then normalised by the step's std (REINFORCE++-baseline)",
    paper="Hu 2025, REINFORCE++ (the -baseline variant)")
def reinforce_pp_baseline(scores_GxN, valid_GxN, cfg: NormConfig):
    xp, v, n, c, std, spread = _groups(scores_GxN, valid_GxN)
    return _batch_norm(xp, xp.where(spread, c, 0.0), v, cfg.advantage_eps), _metrics(xp, n, spread)
