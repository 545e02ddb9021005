"""What the launcher and the trainer share about rollout groups, defined once.

A ``Group`` is ``group_size`` rollouts of one task (ids ``<group>-<k>``), handed by the
launcher's harness thread to the trainer's group queue when every rollout has an outcome.
``WorkEstimate`` is the measured training cost of a row: the step runner updates it after
every step, the launcher prices a finished group with it and the group queue reports the
work still queued. ``lineage_version`` / ``lineage_calls`` date a resumed rollout's tokens
the way the staleness bound must count them (docs/design.md, "The resume protocol").
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Mapping

NO_SIGNAL = "no_signal"  # the store's drop reason for DAPO's dynamic sampling


@dataclasses.dataclass
class Group:
    group_id: str
    version: int  # published policy version when it was admitted (the oldest, for a resumed group)
    rollout_ids: list[str]  # every rollout with an outcome, failures included
    work_s: float  # estimated training cell-seconds


def lineage_version(version: int, restored_step: int) -> int:
    """The version a resumed token counts as: one sampled after the restored checkpoint (by a policy the
    stop lost) counts as sampled by the restored policy, the newest this lineage has."""
    return min(version, restored_step)


def lineage_calls(calls, restored_step: int) -> list:
    """A restored rollout's call records with their versions as ``lineage_version`` counts them."""
    return [c if c.policy_version <= restored_step
            else dataclasses.replace(c, policy_version=lineage_version(c.policy_version, restored_step)) for c in calls]


def redated_calls(calls, redate: Mapping[str, int], rollout_id: str) -> tuple[list, bool]:
    """(``rollout_id``'s calls as the trainer reads them, whether any was re-dated): a rollout restored at a
    resume (``redate``: rollout id -> the version the lineage reached) counts tokens of lost versions as that."""
    r = redate.get(rollout_id)
    if r is None:
        return list(calls), False
    return lineage_calls(calls, r), any(c.policy_version > r for c in calls)


class WorkEstimate:
    """The measured training cell-seconds per packed row (an exponential average), under a lock: written by
    the step runner after each step, read by the launcher (a group's price) and the group queue."""

    def __init__(self, work_s_per_row: float):
        self._lock = threading.Lock()
        self._per_row = float(work_s_per_row)

    @property
    def per_row(self) -> float:
        with self._lock:
            return self._per_row

    def measured(self, per_row: float) -> None:
        with self._lock:
            self._per_row = 0.7 * self._per_row + 0.3 * per_row

    def work_s(self, tokens: int, row_len: int) -> float:
        """The training time of a group of ``tokens`` tokens (rows of ``row_len``)."""
        return self.per_row * max(1.0, tokens / row_len)
