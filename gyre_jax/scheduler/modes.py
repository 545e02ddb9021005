"""Scheduling modes: one strategy object per mode, registered by name.

A mode says how the cluster is run: the roles the cells start in, which cells may ever
serve (each gets an engine), whether finished groups stream into the open step, how many
agents the serving cells can hold, and which role switches to make on each tick. The
policy (``scheduler.policy``), the simulator, the RL loop (``rl.config``, ``rl.build``),
the memory planner and the pods ask the object ``get_mode(name)`` returns; none of them
compares mode names. The names are plain strings (``scheduler.vocab``): they appear
unchanged in configs, JSON logs and plots.

Registered here (``scheduler.policy``'s docstring says what each does): colocate, async,
async_stream, elastic_no_stream, elastic. To add a mode, subclass ``Mode`` (or one of the
classes below) in this file and ``register_mode`` an instance (its own options: ``config=``, a frozen
dataclass); a test may register its own. ``SCHEDULING_MODES`` is a ``gyre_jax.registry.Registry``.
"""
from __future__ import annotations

import dataclasses
import math

from gyre_jax.scheduler import admission, costs

# The interface and the registry live beside PolicyConfig (which holds a mode); re-exported here,
# where modes are defined and registered.
from gyre_jax.scheduler.policy_config import (
    SCHEDULING_MODES,
    Mode,
    PolicyConfig,
    get_mode,
    mode_names,
    register_mode,
    unregister_mode,
)
from gyre_jax.scheduler.state import Action, ClusterState, ToRollout, ToTrain, census
from gyre_jax.scheduler.vocab import ASYNC, ASYNC_STREAM, COLOCATE, ELASTIC, ELASTIC_NO_STREAM, OUT, ROLLOUT, TRAIN

__all__ = ["BUILTIN", "SCHEDULING_MODES", "Colocate", "Elastic", "FixedSplit", "Mode", "get_mode", "mode_names", "register_mode",
           "unregister_mode"]


def _capacity(cells, state: ClusterState, config: PolicyConfig) -> int:
    return math.floor(sum(c.slots for c in cells) / costs.serve_reserve(state, config) + 1e-9)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Colocate(Mode):
    """One pool: every cell generates the step's batch, then every cell trains it."""

    colocated: bool = True

    def initial_roles(self, config, n_cells):
        return (ROLLOUT,) * n_cells

    def serving_cells(self, n_cells, async_train_cells):
        return range(n_cells)

    def serving_capacity(self, state, config):
        return _capacity([c for c in state.cells if c.role != OUT], state, config)

    def roles(self, state, config, *, taken, work_s, available_s, running):
        if taken == admission.step_groups(state, config, state.steps_done) or state.update_in_progress:
            return [ToTrain(c.id) for c in state.cells if c.role == ROLLOUT]
        return [ToRollout(c.id) for c in state.cells if c.role == TRAIN]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FixedSplit(Mode):
    """The async baselines: cells 0..k-1 train (k = async_train_cells, or the per-step
    schedule's), the rest serve."""

    fixed_split: bool = True

    def initial_roles(self, config, n_cells):
        for k in (config.async_train_cells,) + config.async_split_by_step:
            if not 1 <= k < n_cells:
                raise ValueError(f"async_train_cells={k} must be in [1, {n_cells - 1}] for {n_cells} cells")
        k = config.async_split(0)
        return (TRAIN,) * k + (ROLLOUT,) * (n_cells - k)

    def serving_cells(self, n_cells, async_train_cells):
        return range(async_train_cells, n_cells)

    def serving_capacity(self, state, config):
        k = config.async_split(state.steps_done)
        return _capacity([c for c in state.cells if c.id >= k and c.role != OUT], state, config)

    def roles(self, state, config, *, taken, work_s, available_s, running):
        out: list[Action] = []
        k = config.async_split(state.steps_done)
        for c in state.cells:
            want_train = c.id < k
            if want_train and c.role == ROLLOUT:
                out.append(ToTrain(c.id))
            elif not want_train and c.role == TRAIN:
                out.append(ToRollout(c.id))
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class Elastic(Mode):
    """The core trains; satellites serve first and train when the work coming pays for the switch."""

    switches_satellites: bool = True

    def initial_roles(self, config, n_cells):
        # The core alone until the costs are measured; with priors that say switches cost
        # more than a step, the split the policy would move to at once (admission serves only
        # its n - k cells), without paying a switch.
        k = costs.priors_split(config, n_cells) or 1
        return (TRAIN,) * k + (ROLLOUT,) * (n_cells - k)

    def serving_cells(self, n_cells, async_train_cells):
        return range(1, n_cells)

    def serving_capacity(self, state, config):
        # The cells the steady-state split leaves to serving (train_cells_target): admitting
        # more agents would only take cells from training that the work coming needs.
        cen = census(state.cells)
        extra = costs.train_cells_target(state, config) - 1
        keep = max(1, cen.sats - extra) if cen.sats else 0
        return math.floor(keep * cen.slots / costs.serve_reserve(state, config) + 1e-9)

    def roles(self, state, config, *, taken, work_s, available_s, running):
        # Serving first (keep a slot for every running agent; admission keeps that need within
        # the steady-state split), spare cells train when the work coming pays for the switch.
        cells = state.cells
        cen = census(cells)
        if not cen.sats:
            return []
        need = min(cen.sats, admission.serving_cells_needed(running, cen.slots, costs.serve_reserve(state, config)))
        if need > cen.serving:
            n_back = need - cen.serving
            if costs.round_trip_outlasts_step(state, config):
                # A switch must pay for itself (issue 26): a cell sent back below the split
                # arrives after the calls it was sent for (a burst, or a noisy first call share:
                # every agent starts in a model call) and must later pay to come back. Only
                # cells lent beyond the split return; the others' calls wait for a slot, and
                # admission (serving_capacity) holds the agents to the split's serving cells.
                n_back = min(n_back, max(0, cen.training - costs.train_cells_target(state, config)))
            if not costs.switch_costs(state, config).known_to_rollout:
                n_back = min(n_back, 1 - cen.to_rollout)  # a probe: one switch until its cost is known
            back = sorted((c for c in cells if not c.is_core and c.role == TRAIN), key=lambda c: c.id)
            return [ToRollout(c.id) for c in back[:n_back]]
        limit = cen.serving - need
        if limit <= 0 or work_s <= 0:
            return []
        n_train = cen.training
        cost = max(costs.switch_cost_s(state, config), 1e-9)
        # Up to the steady-state split, the work coming (running agents' included) decides:
        # largest k with work / (n_train + k) >= cost. Beyond it (the tail: the staleness bound
        # holds admission back, agents finish, serving cells idle), only work already there
        # does: a cell moved for work that has not arrived waits, then is pulled back.
        # A lent cell must be back before the work it was lent for would have been done
        # without it (issue 46: a 600 s switch lent for a 40 s step's work never arrived).
        target = costs.train_cells_target(state, config)
        k = min(limit, max(0, target - n_train), max(0, math.floor(work_s / cost) - n_train))
        lend = min(limit - k, max(0, math.floor(available_s / cost) - n_train - k))
        if lend > 0 and not costs.switch_costs(state, config).known_to_rollout \
                and state.steps_done < config.total_steps - 1:
            # The way back is unmeasured (and the run goes on after this step, so it may be needed): a
            # lend that would not pay kept to the run's end is a probe of it, one cell beyond the split
            # at a time, and only where losing that cell for the rest of the run costs at most 2% (on a
            # few cells it does not: no probe).
            if costs.kept_lend_pays(state, config, n_train + k, lend):
                k, lend = k + lend, 0
            elif costs.probe_within_margin(state, config, n_train + k):
                lend = min(lend, max(0, 1 - max(0, n_train - target)))
            else:
                lend = 0
        if lend > 0 and costs.lending_pays(state, config, available_s, n_train + k, lend):
            k += lend
        if not costs.switch_costs(state, config).known_to_train:
            k = min(k, 1 - cen.to_train)  # a probe: one switch until its cost is known
        if k <= 0:
            return []
        spare = sorted((c for c in cells if not c.is_core and c.role == ROLLOUT), key=lambda c: (c.active_calls, -c.id))
        return [ToTrain(c.id) for c in spare[:k]]


BUILTIN = (
    Colocate(name=COLOCATE, streams=False),
    FixedSplit(name=ASYNC, streams=False),
    FixedSplit(name=ASYNC_STREAM, streams=True),
    Elastic(name=ELASTIC_NO_STREAM, streams=False),
    Elastic(name=ELASTIC, streams=True, across_processes=True),
)
_SUMMARIES = {
    COLOCATE: "every cell generates the step's batch, then every cell trains it (on-policy)",
    ASYNC: "a fixed split: cells 0..k-1 train, the rest serve; a step starts with its whole batch",
    ASYNC_STREAM: "the fixed split, finished groups streaming into the open step",
    ELASTIC_NO_STREAM: "the core trains, satellites switch between serving and training; whole batches",
    ELASTIC: "the core trains, satellites switch when the work coming pays for the switch; groups stream",
}
for _m in BUILTIN:
    register_mode(_m, summary=_SUMMARIES[_m.name])
