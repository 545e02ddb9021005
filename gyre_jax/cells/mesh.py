"""Split the devices into cells, and say which cell does what.

A cell is the smallest group of devices that holds the model in the training
layout (docs/design.md, "Cells, in JAX terms"). Every cell owns two meshes over
the same devices:

* ``train_mesh`` with axes ``('fsdp', 'tensor')``: the core and training
  satellites hold params (and, on the core, optimizer state) in this layout;
* ``serve_mesh`` with axes ``('data', 'tensor')``: a rollout cell holds params
  for the engine in this layout (weights split over 'tensor' only, so decode
  needs no all-gather of weights per token). With ``serve_expert > 1`` it is
  ``('data', 'expert', 'tensor')``: an MoE model's experts split over 'expert',
  slots over 'data' x 'expert', tokens sent to their experts all-to-all.

Exactly one cell is the core (cell 0): it owns the authoritative params and the
optimizer state and never changes role. The others are satellites whose role
(TRAIN or ROLLOUT) the scheduler decides; this module only records it.
``CellLayout.role_to_mesh()`` is the map the rest of the system consumes.
"""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from gyre_jax.scheduler import vocab
from gyre_jax.sharding import DATA, EXPERT, FSDP, TENSOR  # noqa: F401  (re-exported: cells speak of their axes)

TRAIN_AXES = (FSDP, TENSOR)
SERVE_AXES = (DATA, TENSOR)
# With expert parallelism (train_expert > 1) the training mesh gains an 'expert' axis between the two;
# without it the meshes are exactly as before, so dense layouts and their compiled steps do not change.
TRAIN_AXES_EP = (FSDP, EXPERT, TENSOR)
SERVE_AXES_EP = (DATA, EXPERT, TENSOR)  # serve_expert > 1: the engine's MoE layers dispatch over 'expert'


class Role(enum.Enum):
    """A cell's role. TRAIN and ROLLOUT carry the scheduler's names (scheduler.vocab),
    so ``Role(pool_role)`` and ``role.value`` convert between the two sides."""

    CORE = "core"  # cell 0: params + optimizer state, applies updates, publishes
    TRAIN = vocab.TRAIN  # satellite computing gradients for the core
    ROLLOUT = vocab.ROLLOUT  # satellite serving the agents


@dataclasses.dataclass(frozen=True, kw_only=True)
class CellConfig:
    """How to carve devices into cells.

    ``cell_size`` devices per cell; inside a cell the training mesh is
    ``(cell_size // train_tensor, train_tensor)`` over ('fsdp', 'tensor') and the
    serving mesh ``(cell_size // serve_tensor, serve_tensor)`` over
    ('data', 'tensor'). ``train_expert > 1`` makes the training mesh
    ``(cell_size // (train_expert * train_tensor), train_expert, train_tensor)`` over
    ('fsdp', 'expert', 'tensor'): an MoE model's experts split over 'expert' (rows too),
    set ``ModelConfig.expert_parallel_axis="expert"`` for the loss (model/moe.py).
    ``serve_expert > 1`` makes the serving mesh ``(cell_size // (serve_expert *
    serve_tensor), serve_expert, serve_tensor)`` over ('data', 'expert', 'tensor'); the
    engine then dispatches to the experts over 'expert' by itself (serving/engine_state.py).
    """

    cell_size: int
    train_tensor: int = 1  # tensor-parallel degree in the training layout
    serve_tensor: int | None = None  # tensor-parallel degree when serving; None = cell_size
    train_expert: int = 1  # expert-parallel degree in the training layout (MoE models)
    serve_expert: int = 1  # expert-parallel degree in the serving layout (MoE models)

    def __post_init__(self):
        for name in ("cell_size", "train_tensor", "train_expert", "serve_expert"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"CellConfig.{name} must be a positive int, got {v!r}")
        if self.serve_tensor is not None and (
            not isinstance(self.serve_tensor, int) or isinstance(self.serve_tensor, bool) or self.serve_tensor <= 0
        ):
            raise ValueError(f"CellConfig.serve_tensor must be a positive int or None, got {self.serve_tensor!r}")
        for name, v in (("train_tensor", self.train_tensor), ("serve_tensor", self.serve_tensor_or_size)):
            if self.cell_size % v:
                raise ValueError(f"CellConfig: cell_size={self.cell_size} is not a multiple of {name}={v}")
        if self.cell_size % (self.train_tensor * self.train_expert):
            raise ValueError(f"CellConfig: cell_size={self.cell_size} is not a multiple of train_tensor * "
                             f"train_expert={self.train_tensor * self.train_expert}")
        if self.cell_size % (self.serve_tensor_or_size * self.serve_expert):
            raise ValueError(f"CellConfig: cell_size={self.cell_size} is not a multiple of serve_tensor * "
                             f"serve_expert={self.serve_tensor_or_size * self.serve_expert}")

    @property
    def serve_tensor_or_size(self) -> int:
        return self.cell_size if self.serve_tensor is None else self.serve_tensor


@dataclasses.dataclass(frozen=True, eq=False)
class Cell:
    """A fixed set of devices with its training and serving meshes.

    Identity (``eq=False``): two Cell objects are the same cell only if they are
    the same object; jitted functions are cached per cell.
    """

    index: int
    devices: tuple[jax.Device, ...]
    train_mesh: Mesh
    serve_mesh: Mesh

    def mesh(self, role: Role) -> Mesh:
        return self.serve_mesh if role is Role.ROLLOUT else self.train_mesh

    def __repr__(self) -> str:
        ids = ",".join(str(d.id) for d in self.devices)
        return f"Cell({self.index}, devices=[{ids}])"


def split_cells(config: CellConfig, devices: Sequence[jax.Device] | None = None) -> tuple[Cell, ...]:
    """Split ``devices`` (default ``jax.devices()``) into consecutive cells.

    Consecutive device ids share a host (and on TPU, neighbouring chips), so a
    cell's collectives stay local.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if n == 0:
        raise ValueError("split_cells: no devices")
    if n % config.cell_size:
        raise ValueError(
            f"split_cells: {n} devices do not divide into cells of cell_size={config.cell_size} "
            f"({n % config.cell_size} left over); pick a cell_size that divides {n}"
        )
    if len({d.id for d in devices}) != n:
        raise ValueError(f"split_cells: duplicate devices in {[d.id for d in devices]}")
    cells = []
    st = config.train_tensor
    vt = config.serve_tensor_or_size
    size = config.cell_size
    for i in range(n // size):
        devs = np.array(devices[i * size : (i + 1) * size], dtype=object)
        cells.append(
            Cell(
                index=i,
                devices=tuple(devs.tolist()),
                train_mesh=_mesh(devs, st, config.train_expert, TRAIN_AXES, TRAIN_AXES_EP),
                serve_mesh=_mesh(devs, vt, config.serve_expert, SERVE_AXES, SERVE_AXES_EP),
            )
        )
    return tuple(cells)


def _mesh(devs: np.ndarray, tensor: int, expert: int, axes: tuple[str, str], axes_ep: tuple[str, str, str]) -> Mesh:
    """The cell's devices as (outer, tensor), or (outer, expert, tensor) with expert parallelism: dense
    layouts keep their two-axis meshes, so their compiled programs do not change."""
    if expert == 1:
        return Mesh(devs.reshape(devs.size // tensor, tensor), axes)
    return Mesh(devs.reshape(devs.size // (tensor * expert), expert, tensor), axes_ep)


@dataclasses.dataclass(frozen=True)
class CellLayout:
    """Cells and the role of each. Cell 0 is the core; the rest are satellites.

    Immutable: ``with_role`` returns a new layout, so a decision and the layout
    it was made on cannot drift apart.
    """

    cells: tuple[Cell, ...]
    roles: tuple[Role, ...]

    def __post_init__(self):
        if len(self.cells) != len(self.roles):
            raise ValueError(f"CellLayout: {len(self.cells)} cells but {len(self.roles)} roles")
        if not self.cells:
            raise ValueError("CellLayout: no cells")
        for i, (c, r) in enumerate(zip(self.cells, self.roles)):
            if c.index != i:
                raise ValueError(f"CellLayout: cell at position {i} has index {c.index}")
            if not isinstance(r, Role):
                raise ValueError(f"CellLayout: role of cell {i} is {r!r}, not a Role")
            if (i == 0) != (r is Role.CORE):
                raise ValueError(f"CellLayout: cell 0 and only cell 0 is CORE; cell {i} has role {r.value}")

    @classmethod
    def create(cls, cells: Sequence[Cell], satellite_role: Role = Role.ROLLOUT) -> "CellLayout":
        """Core on cell 0, every satellite in ``satellite_role``."""
        if satellite_role is Role.CORE:
            raise ValueError("CellLayout.create: satellites cannot be CORE")
        cells = tuple(cells)
        return cls(cells, (Role.CORE,) + (satellite_role,) * (len(cells) - 1))

    def with_role(self, cell_index: int, role: Role) -> "CellLayout":
        if not 0 < cell_index < len(self.cells):
            raise ValueError(
                f"CellLayout.with_role: cell_index={cell_index} is not a satellite (1..{len(self.cells) - 1})"
            )
        if role is Role.CORE:
            raise ValueError("CellLayout.with_role: the core is fixed to cell 0")
        roles = list(self.roles)
        roles[cell_index] = role
        return CellLayout(self.cells, tuple(roles))

    @property
    def core(self) -> Cell:
        return self.cells[0]

    def cells_in(self, role: Role) -> tuple[Cell, ...]:
        return tuple(c for c, r in zip(self.cells, self.roles) if r is role)

    def role_to_mesh(self) -> dict[Role, tuple[Mesh, ...]]:
        """Role -> meshes of the cells in that role, in the layout that role uses."""
        return {role: tuple(c.mesh(role) for c in self.cells_in(role)) for role in Role}
