"""The role policy: ONE pure function from cluster state to actions.

``decide(state, config) -> tuple[Action, ...]`` is called by the controller, both
when it drives real cells and when the simulator drives simulated ones, so the two
cannot disagree (design invariant 6). It reads no clock and keeps no memory: every
input is in ``ClusterState``.

Vocabulary. A *group* is the ``group_size`` rollouts of one task (the unit of
advantage baselines, so the unit that can be trained). Step ``u`` trains exactly
``groups_per_step`` groups (more only after a resume past the bound: ``StepSizes``) and turns
policy version ``u`` into ``u + 1``. A group
launched while version ``v`` is published has version ``v``; trained in step
``u`` its staleness is ``u - v``.

Staleness is bounded by admission, never by discarding (design invariant 5):

* ``Launch`` only admits groups that can still be trained within the bound,
  counting every group already admitted and not yet assigned to a step;
* ``TakeGroups`` fills the open step oldest-version first and *reserves* room for
  groups that must be trained by some step soon; if such a group is still
  running, the step waits for it. Finished groups are never dropped.

Both rules keep one invariant: for every step ``w`` from the open one on, the
unassigned groups of version ``<= w - S`` fit in the positions left in steps up to
``w``. That invariant is what makes ``staleness <= S`` hold for every rollout.

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

import bisect
import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Any, NamedTuple, Union

from gyre_jax.registry import Registry, options_field, resolve_options

from gyre_jax.scheduler.vocab import MODES  # noqa: F401 - the built-in modes' names, for callers of the policy
from gyre_jax.scheduler.vocab import OUT, SERVING_ROLES, TRAINING_ROLES

if TYPE_CHECKING:
    from gyre_jax.scheduler.modes import Mode


# The priors' defaults: one source for the simulator (PolicyConfig), the RL loop
# (rl/config.py) and configs/*.py. PolicyConfig's comments say where each comes from.
DEFAULT_SERVE_RESERVE = 1.0
DEFAULT_MIN_WORK_PER_SWITCH_S = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Measured:
    """What the controller measured online (``scheduler.estimates``); None = not yet
    measured, so the policy uses the config's prior."""

    call_share: float | None = None  # model calls (running + queued) per running agent: the serve_reserve
    serve_s_per_rollout: float | None = None  # serving cell-seconds (slot-seconds / slots) per finished rollout
    work_s_per_rollout: float | None = None  # training cell-seconds per rollout
    switch_round_trip_s: float | None = None  # rollout -> train + train -> rollout, seconds
    update_s: float | None = None  # the core's optimizer update, seconds
    # A lower bound on the round trip known before it is measured: the longest a switch now in
    # progress has taken so far (a 10-minute switch must not be taken for free while the first
    # one is still under way), or the one direction timed so far. (The name is the metric's,
    # sched/switch_in_flight_s.)
    switch_in_flight_s: float | None = None


NOT_MEASURED = Measured()


def _modes() -> Registry:
    from gyre_jax.scheduler.modes import SCHEDULING_MODES  # modes builds on this module: looked up when used

    return SCHEDULING_MODES


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyConfig:
    mode: str  # a registered mode's name (scheduler.modes; the built-in ones: vocab.MODES)
    total_steps: int  # optimizer steps of the run (N)
    groups_per_step: int  # groups trained per step (G)
    group_size: int  # rollouts per group
    staleness_bound: int = 2  # S: max optimizer updates between a rollout's version and its step
    async_train_cells: int = 0  # async modes: cells 0..k-1 (core = 0) train; 0 = balanced split chosen by the simulator
    # Priors, used only until the controller has measured the real value (scheduler.estimates;
    # the same code in the simulator and the RL loop):
    # * serve_reserve: slots kept per running agent. Measured: model calls (running + queued)
    #   per running agent, time-weighted. Prior 1.0 = a slot for every agent's next call, the
    #   only value that cannot queue a call whatever the workload.
    serve_reserve: float = DEFAULT_SERVE_RESERVE
    # * min_work_per_switch_s: what a role switch costs, as cell-seconds of work each training
    #   cell must have coming before one more cell moves to training. Measured: the round trip
    #   (rollout -> train + train -> rollout) the controller timed. Prior 0: the cost is unknown
    #   until a cell has switched once, and a higher prior would keep a small cluster (the demo's
    #   switches take about a second) from ever switching, so from ever measuring it.
    min_work_per_switch_s: float = DEFAULT_MIN_WORK_PER_SWITCH_S
    # * priors: the costs expected before the run (a pilot measurement, or the simulator's
    #   first step), each used until the controller has measured it, and only when they say a
    #   switch round trip outlasts a step (priors_apply): then elastic starts at the split it
    #   would move to (a switch it need not pay). Otherwise, or unset: the behaviour above
    #   (core alone until measured).
    priors: Measured = NOT_MEASURED
    # k: optimizer updates per weight publication. 1 = one-step mode; k >= 2 = multi-step
    # mode: k updates train on rollouts of one published version before the next publication.
    updates_per_publication: int = 1
    # Async baselines only: the split per optimizer step (an oracle that knows each step's
    # rollouts; the benchmark's per-step async). Empty = async_train_cells for every step.
    async_split_by_step: tuple[int, ...] = ()
    # The mode's own options (its registration's config; ``--config.scheduler.mode_options.NAME.OPTION=v``),
    # read by its decisions as ``config.mode_options``; None: its defaults.
    mode_options: Any = options_field(_modes, "mode")
    # The mode's strategy object (scheduler.modes), looked up once in __post_init__: the
    # policy asks it on every tick. Equality, hashing and replace() go by the name.
    strategy: Mode = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        # Imported here: scheduler.modes builds on this module's helpers.
        from gyre_jax.scheduler.modes import get_mode, mode_names

        try:
            object.__setattr__(self, "strategy", get_mode(self.mode))
        except LookupError:
            raise ValueError(f"PolicyConfig.mode={self.mode!r}; known modes: {mode_names()}") from None
        resolve_options(self)
        if self.async_train_cells < 0:
            raise ValueError(f"PolicyConfig.async_train_cells={self.async_train_cells} must be >= 0")
        for name in ("total_steps", "groups_per_step", "group_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"PolicyConfig.{name}={getattr(self, name)} must be >= 1")
        if self.staleness_bound < 0:
            raise ValueError(f"PolicyConfig.staleness_bound={self.staleness_bound} must be >= 0")
        if not 0 < self.serve_reserve <= 1:
            raise ValueError(f"PolicyConfig.serve_reserve={self.serve_reserve} must be in (0, 1]")
        k = self.updates_per_publication
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"PolicyConfig.updates_per_publication={k!r} must be an int >= 1")
        if k > 1 and self.strategy.colocated:
            raise ValueError(f"PolicyConfig.updates_per_publication={k}: {self.mode} is on-policy (one update per "
                             "publication by construction); multi-step needs an overlapping mode")
        if k > 1 and self.staleness_bound < k - 1:
            # Groups admitted at the published version p may train up to step p + S; the
            # steps after that until the next publication (p + k) could never be filled.
            raise ValueError(f"PolicyConfig.staleness_bound={self.staleness_bound} must be >= updates_per_publication "
                             f"- 1 = {k - 1}: k updates train on rollouts of one published version")
        if self.min_work_per_switch_s < 0:
            raise ValueError(f"PolicyConfig.min_work_per_switch_s={self.min_work_per_switch_s} must be >= 0")
        if any(k < 1 for k in self.async_split_by_step):
            raise ValueError(f"PolicyConfig.async_split_by_step={self.async_split_by_step}: every split must be >= 1")

    def async_split(self, step: int) -> int:
        """Training cells of the async modes at optimizer step `step`."""
        sched = self.async_split_by_step
        return sched[min(step, len(sched) - 1)] if sched else self.async_train_cells

    @property
    def streaming(self) -> bool:
        return self.strategy.streams

    @property
    def effective_staleness(self) -> int:
        # Colocate cannot overlap generation with training, so it is on-policy.
        return 0 if self.strategy.colocated else self.staleness_bound


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

    Only a resume that rewound past the staleness bound sets it (``resume_step_sizes``): the
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


def initial_roles(config: PolicyConfig, n_cells: int) -> tuple[str, ...]:
    """Layout the cluster starts in (no switch paid), the mode's. Cell 0 is the core."""
    mode = config.strategy
    if n_cells < mode.min_cells:
        raise ValueError(f"mode {config.mode!r} needs >= {mode.min_cells} cells (a core and a satellite); "
                         f"got {n_cells}")
    return mode.initial_roles(config, n_cells)


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


class Census(NamedTuple):
    live: int  # cells not out of service, core included
    training: int  # cells training or switching to it, core included
    sats: int  # live satellites
    sat_slots: int  # their slots
    serving: int  # live satellites serving or switching to it
    slots: int  # slots of one satellite (cells are alike)


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
    live = training = sats = sat_slots = serving = slots = 0
    for c in cells:
        r = c.role
        if r == OUT:
            continue
        live += 1
        if r in TRAINING_ROLES:
            training += 1
        if not c.is_core:
            sats += 1
            sat_slots += c.slots
            slots = slots or c.slots
            if r in SERVING_ROLES:
                serving += 1
    out = Census(live, training, sats, sat_slots, serving, slots)
    _census_cache = (cells, out)
    return out


def max_running_rollouts(state: ClusterState, config: PolicyConfig) -> int:
    """Agents the cells that may serve in this mode can hold at the reserve's slots each
    (the mode's ``serving_capacity``)."""
    return config.strategy.serving_capacity(state, config)


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


@functools.lru_cache(maxsize=64)
def priors_split(config: PolicyConfig, n_cells: int) -> int | None:
    """The split (training cells, core included) elastic starts at on its priors, or None when
    they do not apply: only when a switch round trip outlasts a step at the split they give.
    Then a first move is a commitment and the priors must make it. With cheaper switches a
    wrong move is undone within a step, and the first step runs fastest with every satellite
    serving (there is no training work yet): the core alone until the costs are measured, as
    without priors."""
    p = config.priors
    sc = step_costs(p, config)
    if sc is None or n_cells < 3:
        return None
    rt = config.min_work_per_switch_s if p.switch_round_trip_s is None else p.switch_round_trip_s
    k = best_split(n_cells, *sc, rt)
    return k if rt >= _step_model(n_cells, *sc)(k) else None


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


def train_cells_target(state: ClusterState, config: PolicyConfig) -> int:
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

    A move must pay for itself (issue 26): the cells training now stay the target unless
    the time the better split saves over the steps left exceeds a switch round trip. With
    switches that cost more than the steps they would speed up, elastic keeps its split:
    the best fixed split, when it started there (``initial_roles``)."""
    sc = step_costs(costs(state, config), config)
    n = census(state.cells).live
    if sc is None or n < 3:
        return 1
    step_s = _step_model(n, *sc)
    best = best_split(n, *sc, switch_cost_s(state, config))
    # Hysteresis: estimates are noisy (3%), and a move costs a switch round trip, paid back
    # only by the time it saves on the steps left.
    now = min(n - 1, max(1, census(state.cells).training))
    gain_s = (step_s(now) - step_s(best)) * max(0, config.total_steps - state.steps_done)
    if step_s(now) <= 1.03 * step_s(best) or gain_s <= switch_cost_s(state, config):
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
