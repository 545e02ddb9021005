"""The RL run's scheduler section (``config.scheduler``): the policy's config as a run sets it.

``SchedulerConfig`` is a ``PolicyConfig`` (what the controller, the policy and the simulator
read), with a run's defaults, its optimizer steps taken from ``config.steps``, ``priors`` given as
a file (a pilot run's ``<workdir>/<mode>/scheduler_costs.json``) and the controller's tick.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from gyre_jax.errors import ConfigError
from gyre_jax.scheduler import costs_file
from gyre_jax.scheduler.modes import get_mode, mode_names
from gyre_jax.scheduler.policy import NOT_MEASURED, PolicyConfig, filled, initial_roles
from gyre_jax.scheduler.vocab import ELASTIC
from gyre_jax.schema import check_ints, check_positive, derived, flag_via


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig(PolicyConfig):
    SECTION: ClassVar[str] = "scheduler"
    mode: str = ELASTIC  # a scheduling mode (scheduler.modes; python -m gyre_jax.plugins lists them)
    total_steps: int = derived(1, "config.steps")
    groups_per_step: int = 8  # G: groups trained per optimizer step
    group_size: int = 8  # rollouts per group (advantage baseline)
    staleness_bound: int = 1  # S: admission bound, in optimizer updates
    async_train_cells: int = 1  # async modes: cells 0..k-1 train (k >= 1)
    # A JSON of measured costs (policy.Measured's fields), e.g. a pilot run's
    # <workdir>/<mode>/scheduler_costs.json: the policy's priors. "" = none. Read when the config is.
    priors: Any = flag_via("priors_file", "")
    priors_file: str = derived("", "scheduler.priors")
    poll_s: float = 0.05  # controller tick period (it also wakes on every event)

    def __post_init__(self):
        if isinstance(self.priors, str):
            object.__setattr__(self, "priors_file", self.priors)
            object.__setattr__(self, "priors", self._read_priors(self.priors))
        if self.mode not in mode_names():
            raise ConfigError(f"config.scheduler.mode={self.mode!r}; known: {mode_names()}")
        check_ints(self, ("groups_per_step", "group_size", "staleness_bound", "updates_per_publication",
                          "async_train_cells"))
        check_positive(self, ("groups_per_step", "group_size", "updates_per_publication", "async_train_cells",
                              "serve_reserve", "poll_s"))
        check_positive(self, ("staleness_bound", "min_work_per_switch_s"), allow_zero=True)
        super().__post_init__()

    @staticmethod
    def _read_priors(path: str):
        if not path:
            return NOT_MEASURED
        try:
            return costs_file.load(path)
        except ValueError as e:
            raise ConfigError(f"config.scheduler.priors={path!r}: {e}") from None

    @property
    def multi_step(self) -> bool:
        return self.updates_per_publication > 1

    @property
    def stream_groups(self) -> bool:
        """Groups are packed and trained as they are taken (the streaming modes, as the
        simulator models them, and multi-step), not once the step's batch is whole."""
        return self.multi_step or get_mode(self.mode).streams

    def with_own_costs(self, own_costs) -> "SchedulerConfig":
        """A resumed run: what this workdir's earlier attempt measured, its priors where it measured them."""
        return self if own_costs is None else dataclasses.replace(self, priors=filled(own_costs, self.priors))

    def check_cells(self, n_cells: int, cell_size: int) -> None:
        """ConfigError if the mode's layout cannot run on ``n_cells`` cells of ``cell_size`` devices."""
        if self.strategy.fixed_split and not 1 <= self.async_train_cells < n_cells:
            raise ConfigError(f"config.scheduler.async_train_cells={self.async_train_cells} must be in "
                              f"[1, {n_cells - 1}]: {n_cells} cells of cells.cell_size={cell_size} devices, one "
                              "must serve")
        try:
            initial_roles(self, n_cells)
        except ValueError as e:
            raise ConfigError(f"config.scheduler: {e}") from None
