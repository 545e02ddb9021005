"""The frozen base of a LoRA run: weights every cell reads and none trains, placed once per mesh.

In a LoRA run (``ModelConfig.lora``; gyre_jax/model/lora.py) the train state's params are the
adapters alone (a tuple, one per adapter), so the optimizer, the gradient accumulators, the
checkpoint, every role switch and every publication hold and move adapters only. The base is
held here: in the serving dtype (``ModelConfig.dtype``: every matrix is cast to it at use anyway,
so storing it there changes no result; vectors such as norm scales keep their dtype), copied to
a mesh the first time a step on that mesh asks for it (``on``), and read from there by every
later step (``CellSteps`` binds it as the jitted steps' first argument). It never changes during
a run: a resumed run must find the same base (``fingerprint``).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from gyre_jax.model import ModelConfig, param_logical_axes
from gyre_jax.model import lora as lora_lib
from gyre_jax.sharding import RULES, tree_shardings

FINGERPRINT_SAMPLES = 4096  # values read per array for the fingerprint


def serving_dtype(params, config: ModelConfig):
    """Every matrix (>= 2 dims) in the config's compute dtype, the rest as it is (module docstring)."""
    dt = config.jnp_dtype
    return jax.tree.map(lambda x: x.astype(dt) if x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating) else x,
                        params)


class FrozenBase:
    """The base ``{"params": ...}`` of a LoRA model and its copies on the meshes that train or score with it."""

    def __init__(self, config: ModelConfig, params, *, cast: bool = True):
        """``config``: the LoRA model's config (``config.lora`` set); ``params``: its base, e.g. from
        ``init_params`` or ``load_pretrained`` (any placement; cast to the serving dtype unless ``cast``)."""
        if config.lora is None:
            raise ValueError("FrozenBase: config.lora is None (a plain run trains its params, it has no frozen base)")
        self.config = config
        self.base_config = config.replace(lora=None)
        self.logical = param_logical_axes(self.base_config)
        if jax.tree.structure(params) != jax.tree.structure(self.logical, is_leaf=_is_spec):  # type: ignore[operator]  # PyTreeDef is unresolved in jax's stubs
            raise ValueError("FrozenBase: params do not match the model's parameter tree")
        self.params = serving_dtype(params, config) if cast else params
        self.abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.params)
        self._on: dict = {}
        self._lock = threading.Lock()
        self._fingerprint: str | None = None

    def shardings(self, mesh: Mesh, *, rules=RULES):
        return tree_shardings(self.logical, mesh, self.abstract, rules=rules)

    def on(self, mesh: Mesh, *, rules=RULES):
        """The base laid out on ``mesh`` (copied there on the first call for this mesh and rules)."""
        key = (mesh, rules)
        with self._lock:
            if key not in self._on:
                self._on[key] = jax.block_until_ready(jax.device_put(self.params, self.shardings(mesh, rules=rules)))
            return self._on[key]

    def variables(self, base, adapters) -> dict:
        """What the LoRA model applies: ``{"params": base, "lora": effective(adapters)}``."""
        return lora_lib.variables(self.config, base, adapters)

    @property
    def nbytes(self) -> int:
        return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(self.abstract))

    def fingerprint(self) -> str:
        """A hash of every array's path, shape, dtype and an evenly spaced sample of its values: what a
        checkpoint records, so a resume onto another base fails instead of training nonsense (computed
        once: the base never changes)."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.params)
        return self._fingerprint


@dataclasses.dataclass(frozen=True)
class Adapted:
    """A LoRA run's weights where one value stands for them (a new engine's ``params``): the frozen base
    and the adapters (a tuple of ``{"lora": ...}``). Later publications move the adapters alone."""

    base: FrozenBase
    adapters: Any


def fingerprint(params) -> str:
    h = hashlib.sha256()
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        stride = max(1, x.size // FINGERPRINT_SAMPLES)
        sample = np.asarray(jax.device_get(_sample(x, stride))).astype(np.float32)
        h.update(f"{jax.tree_util.keystr(path)}:{tuple(x.shape)}:{x.dtype}".encode())
        h.update(sample.tobytes())
    return h.hexdigest()[:32]


@functools.partial(jax.jit, static_argnums=1)
def _sample(x, stride: int):
    """Every ``stride``-th value of ``x`` (row-major), at most FINGERPRINT_SAMPLES: one small gather on the
    devices that hold ``x``, not a copy of it."""
    return jnp.ravel(x)[::stride][:FINGERPRINT_SAMPLES]


def _is_spec(x) -> bool:
    return isinstance(x, jax.sharding.PartitionSpec)
