"""What the controller drives: four small Protocols and a clock.

The real cells (``gyre_jax.cells``) and the recording proxy (``gyre_jax.serving``)
get thin adapters to these; the simulator implements them on a simulated cluster
and ``gyre_jax.testing.fake_cluster`` implements them on a virtual clock. Every
method is non-blocking: a switch or a publish *starts* and its completion shows up
later in ``role()`` / ``published_version()``.

Cell ids are 0..n-1; cell 0 is the core cell (params + optimizer state).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from gyre_jax.scheduler.policy import NOMINAL, ReadyGroup, StepSizes


@runtime_checkable
class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the run started (real or virtual)."""


@runtime_checkable
class CellPool(Protocol):
    """The cells and their roles (cells issue)."""

    def cell_ids(self) -> Sequence[int]: ...

    def core_cell(self) -> int: ...

    # Optional: ``changed_cells() -> set[int]``, the cells whose role changed since the
    # last call. A pool that has it lets the controller re-read only those each tick.

    def role(self, cell: int) -> str:
        """One of vocab.CELL_ROLES: 'rollout' | 'train' | 'to_train' | 'to_rollout' (the last two while switching)."""

    def slots(self, cell: int) -> int:
        """Concurrent model calls the cell can serve in rollout role."""

    def switch_to_train(self, cell: int) -> None:
        """Start rollout -> train (the proxy has drained the cell). The cell takes a
        params snapshot from the core and joins the step in progress."""

    def switch_to_rollout(self, cell: int) -> None:
        """Start train -> rollout: load the published params in the serving layout."""

    def publish(self, version: int) -> None:
        """Start sending params of `version` from the core to the rollout cells."""

    def published_version(self) -> int: ...

    def publish_in_progress(self) -> bool: ...


@runtime_checkable
class Proxy(Protocol):
    """The recording proxy's routing side (serving issue)."""

    def drain(self, cell: int) -> None:
        """Stop routing to `cell` and move its in-flight calls, with their KV cache, to
        the other rollout cells (or the head of the queue). Agents never see it."""

    def admit(self, cell: int) -> None:
        """Start routing calls to `cell` (it finished switching to rollout)."""

    def routable(self, cell: int) -> bool: ...

    def in_flight_calls(self, cell: int) -> int: ...

    def queued_calls(self) -> int: ...


@runtime_checkable
class RolloutLauncher(Protocol):
    """Starts agent-harness rollouts in groups (one task, `group_size` samples)."""

    def launch(self, n_groups: int, version: int) -> None: ...

    def launched_groups(self) -> int: ...

    def running_rollouts(self) -> int: ...

    def running_groups(self) -> Mapping[int, int]:
        """version -> groups with at least one rollout still running."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainProgress:
    steps_done: int  # optimizer updates applied
    open_step_taken: int  # groups assigned to step `steps_done`
    pending_work_s: float  # assigned, not yet computed (cell-seconds)
    update_in_progress: bool
    ready_groups: tuple[ReadyGroup, ...]  # finished groups waiting; oldest version first, FIFO within
    ready_work_s: float | None = None  # their summed work_s, if kept incrementally (None: the policy sums)
    # Finished groups the trainer dropped instead of training (DAPO's dynamic sampling: no
    # signal), since the start. The controller nets them out of the launch count, so admission
    # launches a replacement for each.
    dropped_groups: int = 0
    step_sizes: StepSizes = NOMINAL  # steps holding more than G groups (a resume past the bound)


@runtime_checkable
class Trainer(Protocol):
    """The training side: buffer of finished groups, the open step, the core's update."""

    def progress(self) -> TrainProgress: ...

    def take_groups(self, n: int) -> None:
        """Assign the first `n` of `progress().ready_groups` to the open step; their
        micro-batches become work for every cell in train role."""
