"""What the policy takes each cost to be, and the split the costs give.

The policy needs costs it cannot know in advance: the slots a running agent keeps busy, the
serving and training cell-seconds of a rollout, the optimizer update, and a role switch. The
controller measures them online (``scheduler.estimates``) into ``ClusterState.measured``; until
then the config's priors stand (``costs``). From them, the step model (a step of R rollouts
takes ``max(serve / serving cells, train / training cells + update)``) gives the steady-state
split (``train_cells_target``), and the switch prices say which moves pay.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

from gyre_jax.scheduler.policy_config import PolicyConfig
from gyre_jax.scheduler.state import NOT_MEASURED, ClusterState, Measured, census


def serve_reserve(state: ClusterState, config: PolicyConfig) -> float:
    """Slots kept per running agent: the measured call share, else the config's prior.
    Floored at 2% (an agent whose calls were all fast could not else be bounded)."""
    share = costs(state, config).call_share
    return config.serve_reserve if share is None else min(1.0, max(0.02, share))


def step_costs(m: Measured, config: PolicyConfig) -> tuple[float, float, float] | None:
    """(serving cell-seconds, training cell-seconds, update seconds) of one step's rollouts from
    the costs ``m``: the step model's inputs, read the same way from priors and from measurements
    (so the split a pilot's costs give and the split the same costs measured online give are
    one computation). None while either per-rollout cost is unknown."""
    if m.serve_s_per_rollout is None or m.work_s_per_rollout is None:
        return None
    R = config.groups_per_step * config.group_size
    return m.serve_s_per_rollout * R, m.work_s_per_rollout * R, m.update_s or 0.0


def model_split(m: Measured, config: PolicyConfig, n_cells: int) -> int | None:
    """The step model's split on the costs ``m`` (``best_split``), None while they are unknown."""
    sc = step_costs(m, config)
    if sc is None or n_cells < 3:
        return None
    rt = config.min_work_per_switch_s if m.switch_round_trip_s is None else m.switch_round_trip_s
    return best_split(n_cells, *sc, rt)


@functools.lru_cache(maxsize=64)
def priors_split(config: PolicyConfig, n_cells: int) -> int | None:
    """The split (training cells, core included) elastic starts at on its priors, or None when
    they do not apply: only when a switch round trip outlasts a step at the split they give.
    Then a first move is a commitment and the priors must make it. With cheaper switches a
    wrong move is undone within a step, and the first step runs fastest with every satellite
    serving (there is no training work yet): the core alone until the costs are measured, as
    without priors. Priors that do not state a switch's cost apply too (it may outlast the run).
    The split is the pilot's (``Measured.pilot_split``) when it found one, else the step model's."""
    p = config.priors
    sc, k = step_costs(p, config), model_split(p, config, n_cells)
    if sc is None or k is None:
        return None
    rt = config.min_work_per_switch_s if p.switch_round_trip_s is None else p.switch_round_trip_s
    # A switch of unknown cost may outlast the run: starting at the split costs at most the first
    # step's serving slack, starting short of it a commitment that may never be undone.
    unknown = p.switch_round_trip_s is None and p.switch_to_train_s is None and config.min_work_per_switch_s <= 0
    if not unknown and rt < _step_model(n_cells, *sc)(k):
        return None
    return min(n_cells - 1, max(1, p.pilot_split)) if p.pilot_split else k


def priors_apply(config: PolicyConfig, n_cells: int) -> bool:
    """Whether elastic runs on its priors (``priors_split``)."""
    return priors_split(config, n_cells) is not None


def costs(state: ClusterState, config: PolicyConfig) -> Measured:
    """What the policy takes each cost to be: measured, else the config's prior (priors_apply)."""
    m, p = state.measured, config.priors
    if p is NOT_MEASURED or not priors_apply(config, census(state.cells).live):
        return m
    return filled(m, p)


def filled(m: Measured, fallback: Measured) -> Measured:
    """``m`` with each cost it has not measured taken from ``fallback``: the one merge of
    measured over earlier costs (the priors here; a resumed run's own costs in estimates.py)."""
    if fallback is NOT_MEASURED:
        return m
    return Measured(**{f.name: getattr(fallback, f.name) if getattr(m, f.name) is None else getattr(m, f.name)
                       for f in dataclasses.fields(Measured)})


def for_move_bytes(m: Measured, move_bytes: float | None) -> Measured:
    """``m`` (priors, an earlier attempt's costs) for a run whose switches move ``move_bytes``: the
    weight move inside each switch rescaled by the byte ratio (what a move costs scales with what it
    moves, at the bandwidth ``m`` measured), the rest of each switch (drains, the engine's reload)
    as measured. Unchanged where ``m`` did not measure its move or the bytes are the same."""
    if move_bytes is None or m.move_bytes is None or m.move_s is None or not m.move_bytes \
            or move_bytes == m.move_bytes:
        return m
    new_s = m.move_s * move_bytes / m.move_bytes
    d = new_s - m.move_s  # one move per direction

    def less(v, k=1):
        return None if v is None else max(0.0, v + k * d)

    return dataclasses.replace(m, move_bytes=float(move_bytes), move_s=new_s,
                               switch_to_train_s=less(m.switch_to_train_s), switch_to_rollout_s=less(m.switch_to_rollout_s),
                               switch_round_trip_s=less(m.switch_round_trip_s, 2))


def switch_cost_s(state: ClusterState, config: PolicyConfig) -> float:
    """A role switch's round trip (rollout -> train + train -> rollout), seconds: measured,
    else the priors', else min_work_per_switch_s; at least as long as a switch in progress
    has taken so far."""
    m = costs(state, config)
    rt = config.min_work_per_switch_s if m.switch_round_trip_s is None else m.switch_round_trip_s
    return max(rt, state.measured.switch_in_flight_s or 0.0)


def _step_model(n: int, serve: float, train: float, upd: float):
    """Seconds of one step with k training cells (core included) of n: serving and training
    overlap, so the slower side sets the pace."""
    return lambda k: max(serve / (n - k), train / k + upd)


def best_split(n: int, serve: float, train: float, upd: float, switch_s: float = 0.0) -> int:
    """The steady-state split of the step model: the largest k that is still training-bound
    (train_cells_target says why), 1 when even the core alone is serving-bound. That lends
    the serving cells' slack to training at each step's tail, a round trip per lent cell:
    when a round trip (`switch_s`) outlasts a step, nothing can be lent in time, and the
    split is the step model's minimizer (the crossing's faster side)."""
    lo, hi = 1, n - 1  # the serving time rises with k, the training time falls: bisect the crossing
    while lo < hi:
        mid = (lo + hi) // 2
        if serve / (n - mid) >= train / mid + upd:
            hi = mid
        else:
            lo = mid + 1
    serving_bound = serve / (n - lo) >= train / lo + upd
    if not serving_bound or lo == 1:
        return lo
    step_s = _step_model(n, serve, train, upd)
    if switch_s < step_s(lo - 1):
        return lo - 1
    return lo if step_s(lo) < step_s(lo - 1) else lo - 1


class SwitchCosts(NamedTuple):
    to_train: float  # seconds a cell moving rollout -> train is in neither role
    to_rollout: float  # train -> rollout
    known_to_train: bool  # False: nothing measured or given yet (a switch that way is then a probe)
    known_to_rollout: bool


def switch_costs(state: ClusterState, config: PolicyConfig) -> SwitchCosts:
    """Each direction's switch cost: measured, else the priors' (a switch's cost is the cluster's,
    not the workload's: given priors state it even where their split does not apply), else the
    round trip (measured, given, or min_work_per_switch_s when set: an unknown share of it may be
    this direction's), else unknown: then the longest a switch now in flight has taken bounds it."""
    m, p = state.measured, config.priors
    rt = m.switch_round_trip_s if m.switch_round_trip_s is not None else p.switch_round_trip_s
    if rt is None and config.min_work_per_switch_s > 0:
        rt = config.min_work_per_switch_s
    bound = m.switch_in_flight_s or 0.0

    def leg(measured: float | None, prior: float | None) -> tuple[float, bool]:
        v = measured if measured is not None else prior
        if v is not None:
            return v, True
        return (bound, False) if rt is None else (max(rt, bound), True)

    (t, kt), (r, kr) = leg(m.switch_to_train_s, p.switch_to_train_s), leg(m.switch_to_rollout_s, p.switch_to_rollout_s)
    return SwitchCosts(t, r, kt, kr)


def steps_left(state: ClusterState, config: PolicyConfig) -> float:
    """Optimizer steps still to run, the open step counted by the share of its groups not yet taken."""
    g = state.step_sizes.of(state.steps_done, config.groups_per_step)
    return max(0.0, config.total_steps - state.steps_done - state.open_step_taken / g)


def move_pays(n: int, step: tuple[float, float, float], now: int, to: int, leg_s: float, left: float) -> bool:
    """Whether moving from ``now`` training cells to ``to`` finishes the ``left`` steps sooner than
    staying, by the step model: the moving cells neither serve nor train for ``leg_s`` (the switch's
    direction), so the steps run at the slower of both splits until they arrive, and a move whose
    cells would arrive after the run's end only slows it. 1% of the time left is the margin the
    estimates' noise needs."""
    serve, train, upd = step
    lo, hi = min(now, to), max(now, to)
    mid_s = max(serve / (n - hi), train / lo + upd)
    stay_s = left * _step_model(n, *step)(now)
    if left * mid_s <= leg_s:
        return False
    return leg_s + (left - leg_s / mid_s) * _step_model(n, *step)(to) < 0.99 * stay_s


def lending_pays(state: ClusterState, config: PolicyConfig, available_s: float, n_train: int, m: int) -> bool:
    """Whether ``m`` serving cells lent to training for the ``available_s`` cell-seconds of work already
    there (beyond the steady-state split) are back before that work would have been done without them:
    they start after the switch to training, so only the work the ``n_train`` cells have not done by
    then is shared; the time that saves must cover the switch back that the next step's agents wait
    for, beyond the update they wait for anyway (nothing waits after the last step)."""
    sw = switch_costs(state, config)
    left = available_s - n_train * sw.to_train
    if left <= 0 or n_train <= 0:
        return False
    saved = left / n_train - left / (n_train + m)
    back = 0.0 if state.steps_done >= config.total_steps - 1 else sw.to_rollout - (costs(state, config).update_s or 0.0)
    return saved > max(0.0, back)


# (state, config, target) of the last call: a tick asks for the target two or three times (admission,
# the switches), on the same immutable state. One tuple swapped whole (another thread may ask too).
_target_memo: tuple = (None, None, 0)


def train_cells_target(state: ClusterState, config: PolicyConfig) -> int:
    """``steady_split`` on this state, remembered for the next call on the same one."""
    global _target_memo
    s, c, k = _target_memo
    if s is state and c is config:
        return k
    k = steady_split(state, config)
    _target_memo = (state, config, k)
    return k


def steady_split(state: ClusterState, config: PolicyConfig) -> int:
    """Cells (core included) that training needs in steady state, from measured costs.

    A step of R rollouts costs ``a_s * R`` serving cell-seconds and ``a_t * R`` training
    cell-seconds plus the core's update U (training cells wait for it). With k training
    cells a step takes ``max(a_s R / (n - k), a_t R / k + U)``; the k that minimizes it is
    the best fixed split (what async at its best split would pick in hindsight). Elastic
    admits agents for the other n - k cells and moves cells beyond that only when the work
    coming pays for the switch. It takes the largest k that is still training-bound (the
    crossing's lower neighbour), not always the minimizer: the serving cells' slack is then
    lent to training, while on the serving-bound side the training cells' slack would idle
    (admission keeps them from serving): measured on 16 one-accelerator cells with training
    ~2x serving, 0.945 -> 1.02 of colocate. 1 (the core) until both costs are measured
    (or given as priors).

    A move must pay for itself (issues 26, 46): the cells training now stay the target unless
    the time the better split saves over the steps left exceeds a switch round trip, and the
    run's remaining steps finish sooner with the move, its cells in neither role while they
    switch (``move_pays``, the direction's own cost). With switches that cost more than the steps
    they would speed up, elastic keeps its split: the best fixed split, when it started there
    (``initial_roles``)."""
    sc = step_costs(costs(state, config), config)
    n = census(state.cells).live
    if sc is None or n < 3:
        return 1
    step_s = _step_model(n, *sc)
    best = best_split(n, *sc, switch_cost_s(state, config))
    start = priors_split(config, n)
    if start is not None and config.priors.pilot_split:
        # The pilot's split corrects the step model where the model saw what the pilot ran: it
        # stands while the costs are the priors', and moves as the model's split moves from there.
        best = min(n - 1, max(1, start + best - (model_split(config.priors, config, n) or best)))
    # Hysteresis: estimates are noisy (3%), and a move costs a switch round trip, paid back
    # only by the time it saves on the steps left.
    now = min(n - 1, max(1, census(state.cells).training))
    gain_s = (step_s(now) - step_s(best)) * max(0, config.total_steps - state.steps_done)
    if step_s(now) <= 1.03 * step_s(best) or gain_s <= switch_cost_s(state, config):
        return now
    sw = switch_costs(state, config)
    if not move_pays(n, sc, now, best, sw.to_train if best > now else sw.to_rollout, steps_left(state, config)):
        return now
    return best


def round_trip_outlasts_step(state: ClusterState, config: PolicyConfig) -> bool:
    """Whether a switch round trip takes longer than a step at the current split, by the step
    model on the costs the policy has (False while they are unknown). Then a cell moved for a
    need of this step arrives after the need is gone, and moving it back costs as much again:
    issue 26's case (600 s / 300 s switches, ~100 s steps), where elastic kept switching."""
    sc = step_costs(costs(state, config), config)
    cen = census(state.cells)
    if sc is None or cen.live < 3:
        return False
    now = min(cen.live - 1, max(1, cen.training))
    return switch_cost_s(state, config) >= _step_model(cen.live, *sc)(now)
