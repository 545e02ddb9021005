"""Rewards and group-normalized advantages over the valid rollouts of one step.

Rules (docs/design.md, invariant 4, "failures are not zeros"):
  * ``completed`` and ``timeout`` rollouts are valid. A timed-out rollout carries
    the partial-credit score the grader gave its workspace; it is not a zero.
  * ``infra_error`` and ``verifier_error`` rollouts are excluded from training and
    from their group's statistics (mean, std). They are counted per class and
    logged, never trained as reward 0.
  * A group is the rollouts of one task in one step, sampled together: the
    records' ``group_id`` (every rollout of a group must share its ``task_id``;
    a mix is an error). Advantages are normalized over
    the group's valid rollouts only:
      ``mean``:      A = r - mean(r)
      ``mean_std``:  A = (r - mean(r)) / (std(r) + eps)   (population std)
  * A group with no valid variance (a single valid rollout, or all valid scores
    equal) gets advantage exactly 0, never NaN.

Host-side numpy, float64 inside, float32 out.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Sequence

import numpy as np

from gyre_jax.trajectory.vocab import FAILURE_STATUSES, SCORED_STATUSES, STATUS_INFRA_ERROR, STATUS_VERIFIER_ERROR, STATUSES

log = logging.getLogger(__name__)

ADVANTAGE_MODES = ("mean", "mean_std")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdvantageConfig:
    mode: str = "mean_std"  # one of ADVANTAGE_MODES
    eps: float = 1e-6  # added to the std in 'mean_std'
    # Multiplies negative advantages (1: plain group-normalized; 0: only better-than-group
    # rollouts are reinforced).
    negative_scale: float = 1.0

    def __post_init__(self):
        if self.mode not in ADVANTAGE_MODES:
            raise ValueError(f"AdvantageConfig.mode={self.mode!r}; known: {ADVANTAGE_MODES}")
        if not (self.negative_scale >= 0 and math.isfinite(self.negative_scale)):
            raise ValueError(f"AdvantageConfig.negative_scale={self.negative_scale!r} must be finite and >= 0")
        if not (self.eps >= 0 and math.isfinite(self.eps)):
            raise ValueError(f"AdvantageConfig.eps={self.eps!r} must be finite and >= 0")


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """Per rollout, in the order given. Excluded rollouts have valid=False, advantage 0."""

    rollout_ids: tuple  # ids as given
    group_keys: tuple  # group of each rollout
    scores: np.ndarray  # float32[n]; NaN for excluded rollouts (no score is trained)
    valid: np.ndarray  # bool[n]: trained on (completed or timeout)
    advantages: np.ndarray  # float32[n]; 0 where not valid
    counts: dict  # status -> number of rollouts (every status in STATUSES present)
    num_groups: int
    zero_variance_groups: int  # groups with >= 1 valid rollout but no variance
    empty_groups: int  # groups whose every rollout failed

    @property
    def num_valid(self) -> int:
        return int(self.valid.sum())

    @property
    def excluded(self) -> dict:
        """Failure class -> count (what was kept out of training and statistics)."""
        return {s: self.counts[s] for s in FAILURE_STATUSES}

    def advantage_of(self) -> dict:
        return {rid: float(a) for rid, a, v in zip(self.rollout_ids, self.advantages, self.valid) if v}


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
) -> RewardResult:
    """Group-normalized advantages for the finished rollouts of ONE step.

    ``outcomes``: objects with ``rollout_id``, ``task_id``, ``status``, ``score``
    and the group field (``group_id`` by default; pass ``group_field="task_id"``
    to pool every rollout of a task in the step), e.g. ``records.RolloutOutcome``.
    A valid rollout must have a finite score in [0, 1]; a failed one may have any
    score (it is ignored).
    """
    n = len(outcomes)
    rids, groups, statuses = [], [], []
    scores = np.full(n, np.nan, np.float64)
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
            s = _field(o, "score", i)
            try:
                s = float(s)
            except (TypeError, ValueError):
                raise ValueError(f"compute_advantages: rollout {rid!r} ({status}) has non-numeric score {s!r}") from None
            if not (0.0 <= s <= 1.0):  # also rejects NaN
                raise ValueError(f"compute_advantages: rollout {rid!r} ({status}) has score {s!r} outside [0, 1]")
            scores[i] = s
        g, task = _field(o, group_field, i), _field(o, "task_id", i)
        if group_task.setdefault(g, task) != task:
            raise ValueError(
                f"compute_advantages: group {g!r} mixes tasks {group_task[g]!r} and {task!r} "
                f"(rollout {rid!r}); a group is one task's rollouts"
            )
        rids.append(rid)
        groups.append(g)
        statuses.append(status)

    valid = np.array([s in SCORED_STATUSES for s in statuses], bool)
    adv = np.zeros(n, np.float64)
    # Group membership via sorted unique keys: deterministic and O(n log n).
    order: dict = {}
    gidx = np.array([order.setdefault(g, len(order)) for g in groups], np.int64) if n else np.zeros(0, np.int64)
    num_groups = len(order)
    zero_var = empty = 0
    for g in range(num_groups):
        members = np.flatnonzero((gidx == g) & valid)
        if members.size == 0:
            empty += 1
            continue
        r = scores[members]
        if members.size == 1 or np.ptp(r) == 0.0:
            # No valid variance: exactly zero (r - mean can be 1 ulp off for equal r).
            zero_var += 1
            continue
        centered = r - r.mean()
        if config.mode == "mean_std":
            centered = centered / (r.std() + config.eps)
        if config.negative_scale != 1.0:
            centered = np.where(centered < 0, centered * config.negative_scale, centered)
        adv[members] = centered

    counts = {s: 0 for s in STATUSES}
    for s in statuses:
        counts[s] += 1
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
        valid=valid,
        advantages=adv.astype(np.float32),
        counts=counts,
        num_groups=num_groups,
        zero_variance_groups=zero_var,
        empty_groups=empty,
    )
