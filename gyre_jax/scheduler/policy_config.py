"""The policy's configuration, and the interface of the scheduling mode it names.

``PolicyConfig`` is what a run fixes (steps, batch, staleness bound, the mode, the priors);
``Mode`` is what a mode answers (its traits and its decisions). They live together because
each names the other: a config holds its mode object, a mode decides on a config. The
built-in modes (``scheduler.modes``) subclass ``Mode`` and ``register_mode`` themselves; a
``PolicyConfig`` looks its mode up by name when it is built.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from gyre_jax.registry import NoConfig, Registry, options_field, resolve_options
from gyre_jax.scheduler.state import NOT_MEASURED, Action, ClusterState, Measured
from gyre_jax.scheduler.vocab import MODES

# The priors' defaults: one source for the simulator (PolicyConfig), the RL loop
# (rl/config.py) and configs/*.py. PolicyConfig's comments say where each comes from.
DEFAULT_SERVE_RESERVE = 1.0
DEFAULT_MIN_WORK_PER_SWITCH_S = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mode:
    """One scheduling mode: its traits (fields) and its decisions (methods)."""

    name: str
    # Finished groups enter the open step one by one; False: a step starts only with its whole batch.
    streams: bool
    # Rollout and training take turns on the same cells (all switch together). So: on-policy
    # (staleness 0), new weights load with the switch back (no broadcast), one cell is enough,
    # and admission is not paced to serving capacity (a late group would hold the whole step).
    colocated: bool = False
    # PolicyConfig.async_train_cells (or its per-step schedule) train, the rest serve, never switching.
    fixed_split: bool = False
    # Satellites move between serving and training, each keeping its engine (the planner
    # budgets a satellite for both).
    switches_satellites: bool = False
    # Runs as the rl job across processes (gyre_jax.pods: cell k on process k).
    across_processes: bool = False

    @property
    def min_cells(self) -> int:
        """A mode that overlaps serving and training needs a core and a satellite."""
        return 1 if self.colocated else 2

    def initial_roles(self, config: PolicyConfig, n_cells: int) -> tuple[str, ...]:
        """The layout the cluster starts in (no switch paid). Cell 0 is the core."""
        raise NotImplementedError

    def serving_cells(self, n_cells: int, async_train_cells: int) -> range:
        """Cells that may ever serve (the RL loop puts an engine on each)."""
        raise NotImplementedError

    def serving_capacity(self, state: ClusterState, config: PolicyConfig) -> int:
        """Agents the cells that may serve can hold, at the reserve's slots each."""
        raise NotImplementedError

    def roles(self, state: ClusterState, config: PolicyConfig, *, taken: int, work_s: float, available_s: float,
              running: int) -> list[Action]:
        """This tick's role switches (after `taken` groups joined the open step and with
        `running` agents); `work_s` is the training work coming, `available_s` the part
        already there."""
        raise NotImplementedError


# The one registry type (gyre_jax.registry); ``vocab.MODES`` is the built-in modes' names.
SCHEDULING_MODES = Registry("scheduling mode", "scheduler.mode")


def register_mode(mode: Mode, *, config: type = NoConfig, summary: str = "") -> Mode:
    """Make ``mode`` available by its name (configs, PolicyConfig.mode, the simulator's CLI); ``config``: the
    frozen dataclass of its own options (``--config.scheduler.mode_options.NAME.OPTION=v``; the policy
    hands the chosen mode's to its decisions as ``config.mode_options``)."""
    return SCHEDULING_MODES.register(mode.name, config=config,
                                     summary=summary or (type(mode).__doc__ or "").split("\n")[0])(mode)


def unregister_mode(name: str) -> None:
    """Remove a mode a test registered (the built-in ones stay)."""
    if name in MODES:
        raise ValueError(f"scheduling mode {name!r} is built in")
    SCHEDULING_MODES.unregister(name)


def get_mode(name: str) -> Mode:
    return SCHEDULING_MODES.get(name).obj


def mode_names() -> list[str]:
    return SCHEDULING_MODES.names()


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
    mode_options: Any = options_field(SCHEDULING_MODES, "mode")
    # The mode's strategy object (registered by scheduler.modes), looked up once in __post_init__: the
    # policy asks it on every tick. Equality, hashing and replace() go by the name.
    strategy: Mode = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
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

    def __hash__(self) -> int:
        # The dataclass's own hash, computed once: the policy's caches (priors_split) key on the config
        # several times a tick, and hashing every field each time was a tenth of a large simulation's ticks.
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.compare))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:
        # (a string's hash differs between processes: a copy sent to another one computes its own)
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

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

