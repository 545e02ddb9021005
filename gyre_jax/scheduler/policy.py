"""The role policy: ONE pure function from cluster state to actions.

``decide(state, config) -> tuple[Action, ...]`` is called by the controller, both
when it drives real cells and when the simulator drives simulated ones, so the two
cannot disagree (design invariant 6). It reads no clock and keeps no memory: every
input is in ``ClusterState``.

The policy is four modules, each importing only those before it:
  state          what it decides on and returns (ClusterState, Measured, the actions);
  policy_config  PolicyConfig and the Mode interface it holds (with the mode registry);
  costs          the costs it takes (measured, else priors), the step model, the split, switch prices;
  admission      which groups join the open step, how many launch (the staleness bound), publication;
then ``modes`` (the built-in modes) and this module, which puts them together. The names
other code uses are importable from here, as before the split.

Modes (baselines and ablations use the same machinery; each is a strategy object in
``scheduler.modes`` that this module asks for its roles, capacity and switches):
  colocate           one pool, all cells switch together; generate a batch, then
                     train it (staleness 0 by construction: rollouts of step u start
                     only after version u is published).
  async              fixed split: the first ``async_train_cells`` cells train, the
                     rest serve; training waits for a whole batch.
  async_stream       async with streaming: groups enter the step as they finish.
  elastic_no_stream  cells switch roles; training waits for a whole batch.
  elastic            cells switch roles and groups stream into the step (QwenGyre).
"""
from __future__ import annotations

from gyre_jax.scheduler.admission import (
    launch_allowance,
    max_running_rollouts,
    publication_due,
    resume_step_sizes,
    serving_cells_needed,
    step_groups,
    takeable_groups,
)
from gyre_jax.scheduler.costs import (
    best_split,
    costs,
    filled,
    priors_apply,
    priors_split,
    round_trip_outlasts_step,
    serve_reserve,
    step_costs,
    switch_cost_s,
    train_cells_target,
)
from gyre_jax.scheduler.policy_config import DEFAULT_MIN_WORK_PER_SWITCH_S, DEFAULT_SERVE_RESERVE, PolicyConfig
from gyre_jax.scheduler.state import (
    NOMINAL,
    NOT_MEASURED,
    Action,
    CellView,
    Census,
    ClusterState,
    Launch,
    Measured,
    Publish,
    ReadyGroup,
    StepSizes,
    TakeGroups,
    ToRollout,
    ToTrain,
    census,
)
from gyre_jax.scheduler.vocab import MODES

# What callers import from the policy (the modules above own them).
__all__ = [
    "DEFAULT_MIN_WORK_PER_SWITCH_S", "DEFAULT_SERVE_RESERVE", "MODES", "NOMINAL", "NOT_MEASURED", "Action",
    "CellView", "Census", "ClusterState", "Launch", "Measured", "PolicyConfig", "Publish", "ReadyGroup", "StepSizes",
    "TakeGroups", "ToRollout", "ToTrain", "best_split", "census", "costs", "decide", "filled", "initial_roles",
    "launch_allowance", "max_running_rollouts", "priors_apply", "priors_split", "publication_due",
    "resume_step_sizes", "round_trip_outlasts_step", "serve_reserve", "serving_cells_needed", "step_costs",
    "step_groups", "switch_cost_s", "takeable_groups", "train_cells_target",
]


def initial_roles(config: PolicyConfig, n_cells: int) -> tuple[str, ...]:
    """Layout the cluster starts in (no switch paid), the mode's. Cell 0 is the core."""
    mode = config.strategy
    if n_cells < mode.min_cells:
        raise ValueError(f"mode {config.mode!r} needs >= {mode.min_cells} cells (a core and a satellite); "
                         f"got {n_cells}")
    return mode.initial_roles(config, n_cells)


def decide(state: ClusterState, config: PolicyConfig) -> tuple[Action, ...]:
    """The policy. Pure: same state and config, same actions, in this order:
    publish, take groups, launch, role switches (the mode's)."""
    acts: list[Action] = []
    if state.steps_done >= config.total_steps:
        return ()
    if publication_due(state, config):
        acts.append(Publish(state.steps_done))
    n_take = takeable_groups(state, config)
    if n_take:
        acts.append(TakeGroups(n_take))
    n_launch = launch_allowance(state, config, n_take)
    if n_launch:
        acts.append(Launch(n_launch, state.published_version))
    taken = state.open_step_taken + n_take
    running = state.running_rollouts + n_launch * config.group_size
    # Training work coming: assigned and not computed, finished and waiting, and what the
    # running agents will hand in (measured work per rollout), not only the open step's.
    a_t = costs(state, config).work_s_per_rollout or 0.0
    ready_s = state.ready_work_s if state.ready_work_s is not None else sum(g.work_s for g in state.ready_groups)
    available_s = state.pending_work_s + ready_s
    acts.extend(config.strategy.roles(state, config, taken=taken, work_s=available_s + a_t * running,
                                      available_s=available_s, running=running))
    return tuple(acts)
