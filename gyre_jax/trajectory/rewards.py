"""Rewards and advantages over the valid rollouts of one step (or one group of it).

Rules (docs/design.md, invariant 4, "failures are not zeros"):
  * ``completed`` and ``timeout`` rollouts are valid. A timed-out rollout carries
    the partial-credit score the grader gave its workspace; it is not a zero.
  * ``infra_error`` and ``verifier_error`` rollouts are excluded from training and
    from every statistic of the estimator (group or step mean, std). They are counted
    per class and logged, never trained as reward 0.
  * A group is the rollouts of one task in one step, sampled together: the
    records' ``group_id`` (every rollout of a group must share its ``task_id``;
    a mix is an error).
  * The advantage is the registered estimator's (``gyre_jax.losses.advantages``:
    grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline), run on the valid
    rollouts' rewards in float64; a group with no valid variance gets advantage
    exactly 0 under the group estimators, never NaN.
  * Overlong shaping (DAPO, Yu et al. 2025, eq. 13), when ``overlong_max_tokens`` is
    set: with ``L`` = a rollout's generated tokens (over all its calls), ``Lmax`` and
    the buffer ``Lc``, the reward gets ``0`` for ``L <= Lmax - Lc``, ``((Lmax - Lc) - L)
    / Lc * penalty`` inside the buffer, ``-penalty`` beyond ``Lmax``. Scores stay the
    grader's (``scores``); the shaped values are ``rewards``.

Host-side numpy, float64 inside, float32 out.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Sequence

import numpy as np

from gyre_jax.losses import ADVANTAGE_ESTIMATORS
from gyre_jax.registry import options_field, resolve_options
from gyre_jax.trajectory.vocab import (
    FAILURE_STATUSES,
    SCORED_STATUSES,
    STATUS_INFRA_ERROR,
    STATUS_VERIFIER_ERROR,
    STATUSES,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdvantageConfig:
    advantage: str = "grpo"  # an ADVANTAGE_ESTIMATORS name
    advantage_options: Any = options_field(ADVANTAGE_ESTIMATORS, "advantage")  # its config (None: the paper's)
    # Multiplies negative advantages (1: as the estimator gives them; 0: only better-than-baseline
    # rollouts are reinforced).
    negative_advantage_scale: float = 1.0
    overlong_max_tokens: int = 0  # DAPO's Lmax: a rollout's generated tokens; 0 = no overlong shaping
    overlong_buffer_tokens: int = 0  # DAPO's Lc: the soft-penalty band below Lmax
    overlong_penalty: float = 1.0  # the penalty at Lmax (and beyond)

    def __post_init__(self):
        resolve_options(self)
        if not (self.negative_advantage_scale >= 0 and math.isfinite(self.negative_advantage_scale)):
            raise ValueError(f"AdvantageConfig.negative_advantage_scale={self.negative_advantage_scale!r} must be "
                             "finite and >= 0")
        for name in ("overlong_max_tokens", "overlong_buffer_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"AdvantageConfig.{name}={v!r} must be an int >= 0")
        if self.overlong_max_tokens and not 0 < self.overlong_buffer_tokens <= self.overlong_max_tokens:
            raise ValueError(f"AdvantageConfig.overlong_buffer_tokens={self.overlong_buffer_tokens} must be in "
                             f"[1, overlong_max_tokens={self.overlong_max_tokens}] when overlong shaping is on")
        if not (self.overlong_penalty >= 0 and math.isfinite(self.overlong_penalty)):
            raise ValueError(f"AdvantageConfig.overlong_penalty={self.overlong_penalty!r} must be finite and >= 0")

    @property
    def estimator(self):
        """The advantage estimator's registry entry (``entry`` would be the policy loss's on the train config)."""
        return ADVANTAGE_ESTIMATORS.get(self.advantage)

    @property
    def overlong(self) -> bool:
        return self.overlong_max_tokens > 0


def overlong_penalty(lengths, config: AdvantageConfig) -> np.ndarray:
    """DAPO's soft overlong punishment per rollout (module docstring); 0 when shaping is off."""
    n = np.asarray(lengths, np.float64)
    if not config.overlong:
        return np.zeros(n.shape)
    lmax, lc = config.overlong_max_tokens, config.overlong_buffer_tokens
    soft = ((lmax - lc) - n) / lc
    return config.overlong_penalty * np.where(n <= lmax - lc, 0.0, np.where(n <= lmax, soft, -1.0))


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """Per rollout, in the order given. Excluded rollouts have valid=False, advantage 0."""

    rollout_ids: tuple  # ids as given
    group_keys: tuple  # group of each rollout
    scores: np.ndarray  # float32[n]: the graders' scores; NaN for excluded rollouts (no score is trained)
    rewards: np.ndarray  # float32[n]: scores + overlong shaping (= scores without it); NaN where excluded
    valid: np.ndarray  # bool[n]: trained on (completed or timeout)
    advantages: np.ndarray  # float32[n]; 0 where not valid
    counts: dict  # status -> number of rollouts (every status in STATUSES present)
    num_groups: int
    zero_variance_groups: int  # groups with >= 1 valid rollout but no variance
    empty_groups: int  # groups whose every rollout failed
    metrics: dict = dataclasses.field(default_factory=dict)  # the estimator's (name -> number)

    @property
    def num_valid(self) -> int:
        return int(self.valid.sum())

    @property
    def excluded(self) -> dict:
        """Failure class -> count (what was kept out of training and statistics)."""
        return {s: self.counts[s] for s in FAILURE_STATUSES}


def _field(outcome: Any, name: str, i: int):
    try:
        return getattr(outcome, name)
    except AttributeError:
        raise TypeError(f"compute_advantages: outcome #{i} ({type(outcome).__name__}) has no field {name!r}") from None


def compute_advantages(
    outcomes: Sequence[Any],
    config: AdvantageConfig = AdvantageConfig(),
    *,
    group_field: str = "group_id",
    lengths: Sequence[int] | None = None,
) -> RewardResult:
    """Advantages (``config.advantage``) for the finished rollouts of ONE step, or of its groups.

    ``outcomes``: objects with ``rollout_id``, ``task_id``, ``status``, ``score``
    and the group field (``group_id`` by default; pass ``group_field="task_id"``
    to pool every rollout of a task in the step), e.g. ``records.RolloutOutcome``.
    A valid rollout must have a finite score in [0, 1]; a failed one may have any
    score (it is ignored). ``lengths``: each rollout's generated tokens, needed by
    overlong shaping. A ``step``-scoped estimator normalises over exactly these outcomes.
    """
    n = len(outcomes)
    rids, groups, statuses, scores = _read_outcomes(outcomes, group_field)
    valid = np.array([s in SCORED_STATUSES for s in statuses], bool)
    rewards = scores.copy()
    if config.overlong:
        if lengths is None or len(lengths) != n:
            raise ValueError(f"compute_advantages: overlong shaping needs one length per outcome; got "
                             f"{None if lengths is None else len(lengths)} for {n}")
        rewards = np.where(valid, scores + overlong_penalty(lengths, config), np.nan)
    adv, num_groups, metrics = _estimate(groups, rewards, valid, config)
    counts = {s: 0 for s in STATUSES}
    for s in statuses:
        counts[s] += 1
    empty = int(metrics.get("empty_groups", 0))
    if counts[STATUS_INFRA_ERROR] or counts[STATUS_VERIFIER_ERROR]:
        log.info(
            "rewards: excluded %d infra_error and %d verifier_error rollouts of %d "
            "(not trained, not in group statistics); %d groups had no valid rollout",
            counts[STATUS_INFRA_ERROR], counts[STATUS_VERIFIER_ERROR], n, empty,
        )
    return RewardResult(
        rollout_ids=tuple(rids),
        group_keys=tuple(groups),
        scores=scores.astype(np.float32),
        rewards=rewards.astype(np.float32),
        valid=valid,
        advantages=adv.astype(np.float32),
        counts=counts,
        num_groups=num_groups,
        zero_variance_groups=int(metrics.get("no_variance_groups", 0)),
        empty_groups=empty,
        metrics=metrics,
    )


def _read_outcomes(outcomes: Sequence[Any], group_field: str) -> tuple[list, list, list, np.ndarray]:
    """(rollout ids, group keys, statuses, scores: NaN where not scored), each outcome checked:
    ids unique, statuses known, scores finite in [0, 1], one task per group."""
    rids, groups, statuses = [], [], []
    scores = np.full(len(outcomes), np.nan, np.float64)
    seen = set()
    group_task: dict = {}
    for i, o in enumerate(outcomes):
        rid = _field(o, "rollout_id", i)
        status = _field(o, "status", i)
        if rid in seen:
            raise ValueError(f"compute_advantages: rollout_id {rid!r} appears twice (outcome #{i})")
        seen.add(rid)
        if status not in STATUSES:
            raise ValueError(f"compute_advantages: rollout {rid!r} has unknown status {status!r}; known: {STATUSES}")
        if status in SCORED_STATUSES:
            scores[i] = _checked_score(_field(o, "score", i), rid, status)
        g, task = _field(o, group_field, i), _field(o, "task_id", i)
        if group_task.setdefault(g, task) != task:
            raise ValueError(
                f"compute_advantages: group {g!r} mixes tasks {group_task[g]!r} and {task!r} "
                f"(rollout {rid!r}); a group is one task's rollouts"
            )
        rids.append(rid)
        groups.append(g)
        statuses.append(status)
    return rids, groups, statuses, scores


def _checked_score(s: Any, rid: str, status: str) -> float:
    try:
        s = float(s)
    except (TypeError, ValueError):
        raise ValueError(f"compute_advantages: rollout {rid!r} ({status}) has non-numeric score {s!r}") from None
    if not (0.0 <= s <= 1.0):  # also rejects NaN
        raise ValueError(f"compute_advantages: rollout {rid!r} ({status}) has score {s!r} outside [0, 1]")
    return s


def _estimate(groups: list, rewards: np.ndarray, valid: np.ndarray,
              config: AdvantageConfig) -> tuple[np.ndarray, int, dict[str, float]]:
    """(advantage per rollout: 0 where not valid, number of groups, the estimator's metrics). Groups
    are laid out [G, N] (slots in the order given), padding and failures not valid."""
    n = len(groups)
    order: dict = {}
    gidx = np.array([order.setdefault(g, len(order)) for g in groups], np.int64) if n else np.zeros(0, np.int64)
    num_groups = len(order)
    slot = np.zeros(n, np.int64)
    sizes = np.zeros(num_groups, np.int64)
    for i, g in enumerate(gidx):
        slot[i], sizes[g] = sizes[g], sizes[g] + 1
    width = int(sizes.max()) if num_groups else 0
    r_GxN = np.zeros((num_groups, width), np.float64)
    v_GxN = np.zeros((num_groups, width), bool)
    r_GxN[gidx, slot] = np.where(valid, rewards, 0.0)
    v_GxN[gidx, slot] = valid
    adv_GxN, m = config.estimator.fn(r_GxN, v_GxN, config.advantage_options) if num_groups else (r_GxN, {})
    adv = np.where(valid, np.asarray(adv_GxN, np.float64)[gidx, slot], 0.0) if n else np.zeros(0)
    if config.negative_advantage_scale != 1.0:
        adv = np.where(adv < 0, adv * config.negative_advantage_scale, adv)
    return adv, num_groups, {k: float(v) for k, v in m.items()}


def has_signal(outcomes: Sequence[Any], config: AdvantageConfig, lengths: Sequence[int] | None = None) -> bool:
    """Whether a group's valid rollouts' rewards differ (DAPO's dynamic sampling keeps only those).

    Equal rewards (all right or all wrong, or one valid rollout) give a group baseline
    nothing to compare: every advantage is 0 and the group carries no gradient.
    """
    shaping = {f.name: getattr(config, f.name) for f in dataclasses.fields(AdvantageConfig) if f.name.startswith("overlong_")}
    res = compute_advantages(outcomes, AdvantageConfig(advantage="dr_grpo", **shaping), lengths=lengths)
    r = res.rewards[res.valid].astype(np.float64)
    return r.size >= 2 and bool(np.ptp(r) > 0)
