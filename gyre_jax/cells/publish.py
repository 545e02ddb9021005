"""Versioned weight publication: core -> serving layout on a rollout cell, core -> snapshot on a satellite.

A move is one ``jax.device_put`` of the whole params tree to the target cell's
shardings (derived from the one rules table): the runtime copies every shard
device to device and reshards where the layouts differ, in one batched call.
Every move is measured (bytes, seconds from dispatch until the target holds
the whole tree) and recorded with the policy version it carries.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import jax

from gyre_jax.cells.mesh import Cell, Role
from gyre_jax.scheduler.vocab import TO_ROLLOUT, TO_TRAIN  # a move's kind is the switch it serves
from gyre_jax.sharding import RULES, tree_shardings


@dataclasses.dataclass(frozen=True)
class MoveStats:
    kind: str  # TO_ROLLOUT or TO_TRAIN
    version: int
    cell_index: int
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


@dataclasses.dataclass(frozen=True)
class Published:
    """Params of one policy version held by one cell, in that cell's layout for its role."""

    version: int
    cell: Cell
    role: Role
    params: Any
    move: MoveStats


def tree_bytes(tree) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def move(tree, shardings, *, kind: str, version: int, cell_index: int) -> tuple[Any, MoveStats]:
    """Copy ``tree`` to ``shardings`` and wait until it is there; (copy, stats)."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(jax.device_put(tree, shardings))
    return out, MoveStats(kind, int(version), cell_index, tree_bytes(tree), time.perf_counter() - t0)


class WeightPublisher:
    """Publishes core params to other cells; remembers the latest version on each.

    ``logical_params`` / ``abstract_params``: the model's logical axis tree and
    abstract params (``StateSpec.logical_params`` / ``.abstract_params``).
    Thread-safe: the controller may publish while a step runs.
    """

    def __init__(self, logical_params, abstract_params, *, rules=RULES):
        self.logical_params = logical_params
        self.abstract_params = abstract_params
        self.rules = rules
        self.history: list[MoveStats] = []
        self._latest: dict[int, Published] = {}
        self._shardings: dict[tuple[Any, Role], Any] = {}
        self._lock = threading.Lock()

    def shardings(self, cell: Cell, role: Role):
        key = (cell.mesh(role), role)
        with self._lock:
            if key not in self._shardings:
                self._shardings[key] = tree_shardings(
                    self.logical_params, cell.mesh(role), self.abstract_params, rules=self.rules
                )
            return self._shardings[key]

    def publish(self, params, version: int, cell: Cell, role: Role = Role.ROLLOUT) -> Published:
        """Move ``params`` (policy ``version``) to ``cell`` in the layout of ``role``.

        A cell never goes back to an older version than it holds. The previous
        copy on the cell is dropped once the new one is complete.
        """
        if role is Role.CORE:
            raise ValueError("publish: the core holds the authoritative params; publish to TRAIN or ROLLOUT")
        with self._lock:
            prev = self._latest.get(cell.index)
            if prev is not None and version < prev.version:
                raise ValueError(
                    f"publish: cell {cell.index} holds version {prev.version}; refusing older version {version}"
                )
        kind = TO_ROLLOUT if role is Role.ROLLOUT else TO_TRAIN
        out, stats = move(params, self.shardings(cell, role), kind=kind, version=version, cell_index=cell.index)
        pub = Published(int(version), cell, role, out, stats)
        with self._lock:
            self._latest[cell.index] = pub
            self.history.append(stats)
        return pub

    def latest(self, cell: Cell) -> Published | None:
        with self._lock:
            return self._latest.get(cell.index)

    def forget(self, cell: Cell) -> None:
        """Drop what ``cell`` holds (it changed role); frees its copy."""
        with self._lock:
            self._latest.pop(cell.index, None)
