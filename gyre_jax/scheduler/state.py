"""What the policy decides on and what it returns: the cluster's state, the costs measured so
far, and the actions.

Vocabulary. A *group* is the ``group_size`` rollouts of one task (the unit of
advantage baselines, so the unit that can be trained). Step ``u`` trains exactly
``groups_per_step`` groups (more only after a resume past the bound: ``StepSizes``) and turns
policy version ``u`` into ``u + 1``. A group launched while version ``v`` is published has
version ``v``; trained in step ``u`` its staleness is ``u - v``.

Everything here is an immutable value (the controller builds a ``ClusterState`` per tick; the
RL loop's step report reads the last one from another thread).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Union

from gyre_jax.scheduler.vocab import OUT, SERVING_ROLES, TO_ROLLOUT, TO_TRAIN, TRAINING_ROLES


@dataclasses.dataclass(frozen=True, kw_only=True)
class Measured:
    """What the controller measured online (``scheduler.estimates``); None = not yet
    measured, so the policy uses the config's prior."""

    call_share: float | None = None  # model calls (running + queued) per running agent: the serve_reserve
    serve_s_per_rollout: float | None = None  # serving cell-seconds (slot-seconds / slots) per finished rollout
    work_s_per_rollout: float | None = None  # training cell-seconds per rollout
    switch_round_trip_s: float | None = None  # rollout -> train + train -> rollout, seconds
    # Each direction alone (a switch can be dear one way and cheap the other: loading the
    # training layout from remote storage, dropping it to serve), seconds.
    switch_to_train_s: float | None = None
    switch_to_rollout_s: float | None = None
    update_s: float | None = None  # the core's optimizer update, seconds
    # A lower bound on the round trip known before it is measured: the longest a switch now in
    # progress has taken so far (a 10-minute switch must not be taken for free while the first
    # one is still under way), or the one direction timed so far. (The name is the metric's,
    # sched/switch_in_flight_s.)
    switch_in_flight_s: float | None = None
    # Not a cost: the fixed split (training cells, core included) a pilot found fastest on its own
    # rollouts (simulator.pilot_split), where the step model's split is the pilot's guess. Given
    # in priors only (the controller never measures it); elastic starts there when a switch
    # outlasts a step (costs.priors_split).
    pilot_split: int | None = None
    # The weight move inside a switch, as the run that measured these costs made it: the bytes one
    # switch moves (the params; a LoRA run's adapters) and its seconds. A run that moves other bytes
    # takes these costs with the move rescaled (costs.for_move_bytes): a full-weights pilot's switch
    # times say little about a LoRA run's, whose switches move ~1% of the bytes.
    move_bytes: float | None = None
    move_s: float | None = None


NOT_MEASURED = Measured()


@dataclasses.dataclass(frozen=True, kw_only=True)
class CellView:
    id: int
    role: str  # one of vocab.CELL_ROLES; 'to_*' while a switch is in progress
    is_core: bool  # holds params + optimizer state; pinned to training outside colocate
    slots: int  # concurrent model calls the cell serves in rollout role
    active_calls: int  # calls running on it now


@dataclasses.dataclass(frozen=True)
class StepSizes:
    """Groups per step where a step holds more than ``groups_per_step``: steps ``first``,
    ``first + 1``, ... hold ``groups[0]``, ``groups[1]``, ... (every other step holds G).

    Only a resume that rewound past the staleness bound sets it (``admission.resume_step_sizes``): the
    rewound groups are all dated by the restored version, so more of them are due by steps
    u0..u0+S than those steps hold at G each, and extra steps would not help (staleness counts
    updates). Oversized steps train them in time; the rollout-first mean keeps an update's scale."""

    first: int = 0
    groups: tuple[int, ...] = ()

    def of(self, step: int, G: int) -> int:
        i = step - self.first
        return self.groups[i] if 0 <= i < len(self.groups) else G

    def extra(self, G: int) -> int:
        """Groups over G x steps: what the launch cap adds so the steps after them still fill."""
        return sum(n - G for n in self.groups)


NOMINAL = StepSizes()


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReadyGroup:
    version: int  # policy version the group was launched under
    work_s: float  # training work, cell-seconds


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterState:
    cells: tuple[CellView, ...]
    queued_calls: int  # calls waiting for a slot at the proxy
    running_rollouts: int  # admitted rollouts not finished
    running_groups: tuple[tuple[int, int], ...]  # (version, groups) with a rollout still running
    ready_groups: tuple[ReadyGroup, ...]  # finished, not assigned to a step; oldest version first
    launched_groups: int  # groups admitted since the start
    steps_done: int  # optimizer updates applied (= newest trained version)
    open_step_taken: int  # groups assigned to step `steps_done`
    pending_work_s: float  # assigned training work not yet computed (cell-seconds)
    update_in_progress: bool  # the core is applying step `steps_done`'s update
    published_version: int  # version the rollout cells serve
    publish_in_progress: bool
    measured: Measured = NOT_MEASURED
    ready_work_s: float | None = None  # sum of ready_groups' work_s when the trainer keeps it (else summed here)
    step_sizes: StepSizes = NOMINAL  # steps that hold more than G groups (a resume past the bound)


@dataclasses.dataclass(frozen=True)
class Publish:
    version: int


@dataclasses.dataclass(frozen=True)
class TakeGroups:
    n: int  # the n oldest-version ready groups (FIFO within a version) join the open step


@dataclasses.dataclass(frozen=True)
class Launch:
    n_groups: int
    version: int


@dataclasses.dataclass(frozen=True)
class ToTrain:
    cell: int  # drain from routing, then switch


@dataclasses.dataclass(frozen=True)
class ToRollout:
    cell: int  # switch, then admit to routing when done


Action = Union[Publish, TakeGroups, Launch, ToTrain, ToRollout]


class Census(NamedTuple):
    live: int  # cells not out of service, core included
    training: int  # cells training or switching to it, core included
    sats: int  # live satellites
    sat_slots: int  # their slots
    serving: int  # live satellites serving or switching to it
    slots: int  # slots of one satellite (cells are alike)
    to_train: int  # cells switching to training now
    to_rollout: int  # cells switching to rollout now


# (cells tuple, its census): a controller passes the same tuple until a cell changes. One tuple,
# swapped whole, so a reader on another thread (the RL loop's step report) never pairs one
# cells tuple with another's census.
_census_cache: tuple = (None, None)


def census(cells: tuple[CellView, ...]) -> Census:
    """One pass over the cells (cached while the controller passes the same tuple)."""
    global _census_cache
    cached_cells, cached = _census_cache
    if cached_cells is cells:
        return cached
    live = training = sats = sat_slots = serving = slots = to_train = to_rollout = 0
    for c in cells:
        r = c.role
        if r == OUT:
            continue
        live += 1
        if r in TRAINING_ROLES:
            training += 1
            to_train += r == TO_TRAIN
        to_rollout += r == TO_ROLLOUT
        if not c.is_core:
            sats += 1
            sat_slots += c.slots
            slots = slots or c.slots
            if r in SERVING_ROLES:
                serving += 1
    out = Census(live, training, sats, sat_slots, serving, slots, to_train, to_rollout)
    _census_cache = (cells, out)
    return out

