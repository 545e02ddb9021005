"""One-step and multi-step modes: how many optimizer updates per weight publication.

* one-step: every update is published before the next step's rollouts are
  admitted, so rollouts are at most one update stale at training time when the
  scheduler keeps up (and a step can use globally shuffled data).
* multi-step (k updates per publication): rollouts keep sampling the last
  published version while the core applies k updates on the rollouts that
  finish meanwhile; more overlap, more staleness (up to k updates more).

``TrainLoop`` runs elastic steps and publishes to the rollout cells when due.
It decides nothing about roles: the caller (scheduler) passes the satellites
that train this step and the cells that should receive the weights.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from gyre_jax.cells.elastic import ElasticTrainer, StepReport
from gyre_jax.cells.mesh import Cell, Role
from gyre_jax.cells.publish import Published, WeightPublisher

ONE_STEP = "one_step"
MULTI_STEP = "multi_step"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModeConfig:
    mode: str = ONE_STEP  # ONE_STEP or MULTI_STEP
    updates_per_publication: int = 1  # k; must be 1 in one-step mode, >= 2 in multi-step mode

    def __post_init__(self):
        k = self.updates_per_publication
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"ModeConfig.updates_per_publication must be an int >= 1, got {k!r}")
        if self.mode == ONE_STEP and k != 1:
            raise ValueError(f"ModeConfig: one_step mode publishes after every update; got updates_per_publication={k}")
        if self.mode == MULTI_STEP and k < 2:
            raise ValueError(f"ModeConfig: multi_step mode needs updates_per_publication >= 2, got {k}")
        if self.mode not in (ONE_STEP, MULTI_STEP):
            raise ValueError(f"ModeConfig.mode must be {ONE_STEP!r} or {MULTI_STEP!r}, got {self.mode!r}")


class TrainLoop:
    """Elastic steps + versioned publication on the mode's cadence."""

    def __init__(self, trainer: ElasticTrainer, publisher: WeightPublisher, mode: ModeConfig):
        self.trainer = trainer
        self.publisher = publisher
        self.mode = mode
        self.published_version = trainer.version  # what rollouts sample from until the next publication
        self._since_publication = 0

    def publication_due(self) -> bool:
        return self._since_publication >= self.mode.updates_per_publication

    def step(
        self,
        micro_batches: Sequence[Mapping[str, Any]],
        *,
        satellites: Sequence[Cell] = (),
        rollout_cells: Sequence[Cell] = (),
    ) -> tuple[StepReport, list[Published]]:
        """One update; then, if due, publish the new version to every rollout cell."""
        report = self.trainer.run_step(micro_batches, satellites)
        self._since_publication += 1
        pubs: list[Published] = []
        if self.publication_due():
            pubs = self.publish(rollout_cells)
        return report, pubs

    def publish(self, rollout_cells: Sequence[Cell]) -> list[Published]:
        """Publish the core's current params to ``rollout_cells`` now (e.g. a cell just turned to rollout)."""
        version = self.trainer.version
        params = self.trainer.state.params
        pubs = [self.publisher.publish(params, version, c, Role.ROLLOUT) for c in rollout_cells]
        self.published_version = version
        self._since_publication = 0
        return pubs

    def bring_up(self, cell: Cell) -> Published:
        """Give a cell that just turned to rollout the core's current params (cadence unchanged)."""
        return self.publisher.publish(self.trainer.state.params, self.trainer.version, cell, Role.ROLLOUT)
