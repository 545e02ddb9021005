"""What crosses threads about a step: frozen dataclasses, passed through queues.

The processor thread hands each finished step's data to the trainer thread as a
``StepInput``; the trainer thread hands each applied update to the loop as a
``StepDone`` (``TrainerAdapter.done``, a queue); the loop turns it into a
``StepRecord`` (``rl.report``) for metrics.jsonl. None of them is mutated after it is
made, so a reader on another thread never sees half of one.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Any, Mapping, Sequence

from gyre_jax.cells.elastic import StepReport
from gyre_jax.trajectory.processor import StepStats

# StepStats' counters that add up over a step's chunks (one chunk per group when streaming).
SUMMED = ("rollouts", "trained_rollouts", "packed_tokens", "expanded_tokens", "trainable_targets", "paths_total",
          "paths_selected", "trainable_unique", "trainable_selected", "trainable_dropped", "rollouts_truncated",
          "branching_rollouts", "branch_points", "compaction_calls", "subagent_calls", "retried_calls")


def _frozen_map(d: Mapping) -> Mapping:
    return types.MappingProxyType(dict(d))


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepTotals:
    """One step's tree and packing numbers, summed over the StepStats of its chunks."""

    rollouts: int
    trained_rollouts: int
    packed_tokens: int
    expanded_tokens: int
    trainable_targets: int
    paths_total: int
    paths_selected: int
    trainable_unique: int
    trainable_selected: int
    trainable_dropped: int
    rollouts_truncated: int
    branching_rollouts: int
    branch_points: int
    compaction_calls: int
    subagent_calls: int
    retried_calls: int
    failures: Mapping[str, int]  # failure class -> rollouts
    dedup_factor: float  # tokens every selected path would cost alone / tokens packed
    max_dropped_fraction: float
    max_dropped_rollout: str | None
    advantage_metrics: Mapping[str, float]  # the estimator's counts

    @classmethod
    def merge(cls, stats: Sequence[StepStats]) -> "StepTotals":
        sums = {k: int(sum(getattr(s, k) for s in stats)) for k in SUMMED}
        failures: dict[str, int] = {}
        adv: dict[str, float] = {}
        for s in stats:
            for k, v in s.failures.items():
                failures[k] = failures.get(k, 0) + v
            for k, v in s.advantage_metrics.items():
                adv[k] = adv.get(k, 0.0) + v
        worst = max(stats, key=lambda s: s.max_dropped_fraction, default=None)
        packed = sums["packed_tokens"]
        return cls(**sums, failures=_frozen_map(failures), advantage_metrics=_frozen_map(adv),
                   dedup_factor=sums["expanded_tokens"] / packed if packed else 0.0,
                   max_dropped_fraction=worst.max_dropped_fraction if worst is not None else 0.0,
                   max_dropped_rollout=worst.max_dropped_rollout if worst is not None else None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepInput:
    """What the processor learned about a step, handed to the trainer thread at the step's end."""

    step: int
    groups: tuple  # rl.launcher.Group, in the order the step took them
    outcomes: tuple  # RolloutOutcome of every rollout, in packing order
    stats: tuple[StepStats, ...]  # one per chunk
    rows: int
    process_s: float
    grad_scale: float  # nominal / actual normaliser (streamed groups), else 1
    score: Mapping[str, float]  # the per-step pass (cells.score), summed over chunks
    size: int = 0  # the groups the step holds (its nominal normaliser when streamed)
    streamed: bool = False  # fed a group at a time (else one whole-step chunk)
    redated: Mapping[str, int] = dataclasses.field(default_factory=dict)  # rollout -> version its late tokens count as

    def record(self) -> dict:
        """What the store keeps of the step with its rollouts (``TrajectoryStore.mark_step``): enough to replay
        it bit for bit after a rewind (``rl.replay``): the groups in the order taken, its size and mode, and
        which rollouts' late tokens were re-dated to which version."""
        return {"groups": [{"id": g.group_id, "version": int(g.version), "rollouts": list(g.rollout_ids)}
                           for g in self.groups],
                "size": int(self.size), "streamed": bool(self.streamed),
                "redated": {r: int(v) for r, v in self.redated.items()}}


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepDone:
    """One applied update, from the trainer thread to the loop (``TrainerAdapter.done``)."""

    step: int  # the data step; the update made policy ``version = step + 1``
    version: int
    params: Any  # the new version's params (the copy ``latest_params()`` hands out): evaluated when due
    groups: tuple[str, ...]
    group_versions: tuple[int, ...]
    rollouts: int
    report: StepReport
    totals: StepTotals
    scores: tuple[float, ...]  # of the trained (non-failed) rollouts
    rows: int
    micro_batches: int
    process_s: float
    step_s: float
    cells_used: tuple[int, ...]
    row_chunks: int
    after_last_group_s: float  # from the step's last group to its update
    score: Mapping[str, float]
    dropped_groups: int  # dynamic sampling's drops since the previous step
    extra_groups: int = 0  # groups over groups_per_step (an oversized step after a rewind past the bound)
    params_hash: str = ""  # the new version's params (cells.fingerprint): equal params, equal hash
    replayed: bool = False  # a step a resume trained again from its record (rl.replay), not a new one
    outcomes: tuple = ()  # RolloutOutcome of every rollout of the step (statuses, reasons, the graders' audit)


@dataclasses.dataclass(frozen=True)
class TrainerSnapshot:
    """What a checkpoint saves of the trainer, taken on the trainer thread between steps."""

    state: Any  # cells.TrainState
    buffered_rollouts: tuple[str, ...]
    data_iterator: Any  # the grain iterator, positioned at the next step's start
