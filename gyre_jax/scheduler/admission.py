"""Admission: which groups join the open step, how many new groups may launch, and when to
publish. Staleness is bounded here, never by discarding (design invariant 5):

* ``Launch`` only admits groups that can still be trained within the bound,
  counting every group already admitted and not yet assigned to a step;
* ``TakeGroups`` fills the open step oldest-version first and *reserves* room for
  groups that must be trained by some step soon; if such a group is still
  running, the step waits for it. Finished groups are never dropped.

Both rules keep one invariant: for every step ``w`` from the open one on, the
unassigned groups of version ``<= w - S`` fit in the positions left in steps up to
``w``. That invariant is what makes ``staleness <= S`` hold for every rollout.
"""
from __future__ import annotations

import bisect
import math

from gyre_jax.scheduler.policy_config import PolicyConfig
from gyre_jax.scheduler.state import NOMINAL, ClusterState, StepSizes


def resume_step_sizes(versions, steps_done: int, config: PolicyConfig) -> StepSizes:
    """Step sizes after a resume at ``steps_done`` with unassigned groups of ``versions``
    (finished and re-running), so that each trains within the bound: the smallest ``e`` such
    that steps u..u+S at ``G + e`` groups each hold, for every w in that range, the groups due by w
    (version <= w - S; every group for the run's last step). NOMINAL when G per step does.

    A resumed group is dated at most u, so due by u + S at the latest: the steps left hold every
    group, also after a stop inside oversized steps (whose lost lineage launched for the extra
    positions)."""
    G, S, N, u = config.groups_per_step, config.effective_staleness, config.total_steps, steps_done
    last = min(N - 1, u + S)
    if u > last:
        return NOMINAL
    vs = sorted(versions)
    e = 0
    for w in range(u, last + 1):
        must = len(vs) if w == N - 1 else bisect.bisect_right(vs, w - S)
        e = max(e, -(-must // (w - u + 1)) - G)
    if vs and vs[-1] > u:
        raise ValueError(f"resume_step_sizes: a group of version {vs[-1]} after a resume at step {u} "
                         "(resumed groups are dated by the restored version at the latest)")
    return NOMINAL if e <= 0 else StepSizes(u, (G + e,) * (last - u + 1))


def step_groups(state: ClusterState, config: PolicyConfig, step: int) -> int:
    """Groups step ``step`` holds (``StepSizes``; G but after a rewind past the bound)."""
    return state.step_sizes.of(step, config.groups_per_step)


def _positions(state: ClusterState, config: PolicyConfig, u: int, w: int) -> int:
    """Positions of steps u..w (the open step's untaken ones when u is the open step)."""
    return sum(step_groups(state, config, x) for x in range(u, w + 1))


def takeable_groups(state: ClusterState, config: PolicyConfig) -> int:
    """How many ready groups the open step may take now (oldest version first).

    A group of version v <= u - S must be trained in step u: always take it. Another
    group is taken only if, afterwards, for every step w in [u, u + S] that it is not due by
    (v > w - S), the unassigned groups of version <= w - S still fit in the positions left up
    to w (a group due by w takes a position one of those would: w is no worse off). Ready groups are
    handled a version at a time (the buffer is sorted by version), so a tick costs
    O(versions x S), not O(ready groups).
    """
    if state.update_in_progress or state.steps_done >= config.total_steps:
        return 0
    u, S, N = state.steps_done, config.effective_staleness, config.total_steps
    ready = state.ready_groups
    slots_left = step_groups(state, config, u) - state.open_step_taken
    if not config.streaming and len(ready) < slots_left:
        return 0  # without streaming a step starts only with its whole batch
    runs: list[tuple[int, int]] = []  # (version, count) of the ready buffer, oldest first
    i = 0
    while i < len(ready):
        v = ready[i].version
        j = bisect.bisect_right(ready, v, lo=i, key=lambda g: g.version)
        runs.append((v, j - i))
        i = j
    rest: dict[int, int] = dict(runs)  # unassigned groups by version (ready or running)
    for v, c in state.running_groups:
        rest[v] = rest.get(v, 0) + c
    n = 0
    for v, count in runs:
        room = min(count, slots_left - n)
        if v > u - S:
            for w in range(u, min(N - 1, u + S) + 1):
                # A group due by w (v <= w - S) takes a position one of step w's `must` groups would: w's
                # overdue count stays as it is, so it is never refused for w. (Refusing when w was already
                # over, which only a resume that rewound past the bound leaves, stalled the run: at step 0
                # no group is old enough to be a must-take, so nothing was taken or launched, ever.)
                if v > w - S:  # taking j of these keeps `must` and removes j positions
                    must = sum(c for vv, c in rest.items() if vv <= w - S)
                    room = min(room, slots_left - n + _positions(state, config, u + 1, w) - must)
            room = max(room, 0)
        n += room
        rest[v] -= room
        if room < count or n == slots_left:
            break
    if not config.streaming and n < slots_left:
        return 0
    return n


def launch_allowance(state: ClusterState, config: PolicyConfig, taken_now: int) -> int:
    """Groups that may be admitted now at the published version (after taking `taken_now`)."""
    G, S, N = config.groups_per_step, config.effective_staleness, config.total_steps
    u, taken = state.steps_done, state.open_step_taken + taken_now
    if taken == step_groups(state, config, u) or state.update_in_progress:
        u, taken = u + 1, 0  # the open step is closed; the next one has all its positions
    unassigned = sum(n for _, n in state.running_groups) + len(state.ready_groups) - taken_now
    w = min(state.published_version + S, N - 1)
    by_bound = _positions(state, config, u, w) - taken - unassigned
    # Pace to serving capacity too: agents beyond what the serving cells can hold only
    # queue, slowing every running agent toward its deadline. Colocate generates its
    # batch at once by definition (a late-launched group would hold the whole step).
    by_capacity = by_bound
    if not config.strategy.colocated:
        by_capacity = (max_running_rollouts(state, config) - state.running_rollouts) // config.group_size
        if state.running_rollouts == 0:
            by_capacity = max(by_capacity, 1)
    return max(0, min(by_bound, by_capacity, G * N + state.step_sizes.extra(G) - state.launched_groups))


def max_running_rollouts(state: ClusterState, config: PolicyConfig) -> int:
    """Agents the cells that may serve in this mode can hold at the reserve's slots each
    (the mode's ``serving_capacity``)."""
    return config.strategy.serving_capacity(state, config)


def serving_cells_needed(running_rollouts: int, slots_per_cell: int, reserve: float) -> int:
    """Cells that keep a slot for the next call of every running agent, scaled by the
    reserve. Deliberately not the instantaneous call count: that changes on every call,
    and a role switch costs seconds, so following it would thrash."""
    return math.ceil(running_rollouts * reserve / slots_per_cell - 1e-9)


def publication_due(state: ClusterState, config: PolicyConfig) -> bool:
    """Every ``updates_per_publication`` updates (one-step: every update)."""
    if state.publish_in_progress:
        return False
    return state.steps_done - state.published_version >= config.updates_per_publication
