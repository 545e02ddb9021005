"""Train state (params, optax state, step, policy version), the optimizer, and their shardings.

``policy_version`` names the params: it starts at ``initial_version`` (e.g. the
version of a loaded checkpoint) and grows by one per optimizer update, so the
staleness of a row is ``policy_version - target_version`` in optimizer updates,
the unit the paper reports. ``step`` counts updates of this optimizer (it drives
the learning-rate schedule) and restarts at 0 when the optimizer is reset.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gyre_jax.sharding import RULES, tree_shardings


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW with global-norm gradient clipping and warmup + cosine (or constant) schedule."""

    learning_rate: float  # peak learning rate
    warmup_steps: int = 0  # linear warmup from 0 to learning_rate
    decay_steps: int = 0  # cosine decay after warmup to final_lr_fraction * lr; 0 = constant
    final_lr_fraction: float = 0.1
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 0.0  # applied to matrices only (not norm scales)
    max_grad_norm: float | None = 1.0  # None = no clipping

    def __post_init__(self):
        w = "OptimizerConfig"
        if not self.learning_rate > 0:
            raise ValueError(f"{w}.learning_rate must be > 0, got {self.learning_rate}")
        for name in ("warmup_steps", "decay_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{w}.{name} must be an int >= 0, got {v!r}")
        if not 0 <= self.final_lr_fraction <= 1:
            raise ValueError(f"{w}.final_lr_fraction must be in [0, 1], got {self.final_lr_fraction}")
        for name in ("adam_b1", "adam_b2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{w}.{name} must be in [0, 1), got {getattr(self, name)}")
        if not self.adam_eps > 0:
            raise ValueError(f"{w}.adam_eps must be > 0, got {self.adam_eps}")
        if self.weight_decay < 0:
            raise ValueError(f"{w}.weight_decay must be >= 0, got {self.weight_decay}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"{w}.max_grad_norm must be > 0 or None, got {self.max_grad_norm}")


def make_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    peak = cfg.learning_rate
    if cfg.decay_steps:
        after = optax.cosine_decay_schedule(peak, cfg.decay_steps, alpha=cfg.final_lr_fraction)
    else:
        after = optax.constant_schedule(peak)
    if not cfg.warmup_steps:
        return after
    warm = optax.linear_schedule(0.0, peak, cfg.warmup_steps)
    return optax.join_schedules([warm, after], [cfg.warmup_steps])


def matrix_mask(logical_tree):
    """True for parameters with >= 2 axes besides 'layers' (weight decay goes there only)."""
    return jax.tree.map(
        lambda s: sum(a is not None and a != "layers" for a in s) >= 2,
        logical_tree,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def make_optimizer(cfg: OptimizerConfig, logical_params) -> optax.GradientTransformation:
    """clip_by_global_norm (over the whole step's gradient) then AdamW with the schedule.

    ``logical_params``: the model's logical axis tree (``gyre_jax.model.param_logical_axes``);
    it says which parameters are matrices, the only ones weight decay touches.
    """
    decay_mask = matrix_mask(logical_params)
    parts = []
    if cfg.max_grad_norm is not None:
        parts.append(optax.clip_by_global_norm(cfg.max_grad_norm))
    parts.append(
        optax.adamw(
            make_schedule(cfg), b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps, weight_decay=cfg.weight_decay, mask=decay_mask
        )
    )
    return optax.chain(*parts)


class PerAdapter(optax.GradientTransformation):
    """``per_adapter``'s transformation; ``inner`` and ``n`` say how its state is laid out (a tuple of ``n``
    states of ``inner``, adapter by adapter), which ``StateSpec.state_shardings`` reads."""

    inner: optax.GradientTransformation
    n: int


def per_adapter(tx: optax.GradientTransformation, n: int) -> PerAdapter:
    """``tx`` over a tuple of ``n`` LoRA adapters (gyre_jax/model/lora.py), each with its own state.

    Each adapter is clipped, stepped and scheduled on its own. With several adapters (multi-LoRA:
    each trains on its own task set), one whose gradient is exactly zero in a step (none of its
    rollouts were in it) is left as it was, state and weights: Adam's momentum would otherwise keep
    moving an adapter nothing trained, and its step count would run on. With one adapter this is
    ``tx`` itself, update for update.
    """
    if n < 1:
        raise ValueError(f"per_adapter: n={n} must be >= 1")

    def _check(tree, what):
        if not isinstance(tree, tuple) or len(tree) != n:
            raise ValueError(f"per_adapter: {what} must be a tuple of {n} adapters, got {type(tree).__name__}"
                             + (f" of {len(tree)}" if isinstance(tree, tuple) else ""))

    def init(params):
        _check(params, "params")
        return tuple(tx.init(p) for p in params)

    def update(grads, state, params=None):
        _check(grads, "grads")
        updates, states = [], []
        for i in range(n):
            u, s = tx.update(grads[i], state[i], None if params is None else params[i])
            if n > 1:
                live = optax.tree.norm(grads[i]) > 0
                u = jax.tree.map(lambda x: jnp.where(live, x, jnp.zeros_like(x)), u)  # noqa: B023 - used at once
                s = jax.tree.map(lambda new, old: jnp.where(live, new, old), s, state[i])  # noqa: B023
            updates.append(u)
            states.append(s)
        return tuple(updates), tuple(states)

    out = PerAdapter(init, update)
    out.inner, out.n = tx, n
    return out


@flax.struct.dataclass
class TrainState:
    # Leaves are arrays; abstract_state() / state_shardings() fill the same tree with their
    # ShapeDtypeStructs / NamedShardings, hence Any.
    step: Any  # int32 scalar: optimizer updates applied (drives the schedule)
    policy_version: Any  # int32 scalar: version of ``params``
    params: Any
    opt_state: Any


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """What a cell needs to lay out a train state: abstract values and logical axes.

    ``init_boxed(rng)`` returns params with ``nn.Partitioned`` boxes (logical
    names), e.g. ``functools.partial(gyre_jax.model.init_boxed, model_config)``.
    """

    init_boxed: Callable[[jax.Array], Any]
    tx: optax.GradientTransformation
    abstract_params: Any  # ShapeDtypeStruct tree (unboxed)
    logical_params: Any  # PartitionSpec tree of logical names, same structure
    _jits: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def create(cls, init_boxed, tx) -> "StateSpec":
        boxed = jax.eval_shape(init_boxed, jax.random.key(0))
        return cls(init_boxed, tx, nn.unbox(boxed), nn.get_partition_spec(boxed))

    def param_shardings(self, mesh: Mesh, *, rules=RULES):
        return tree_shardings(self.logical_params, mesh, self.abstract_params, rules=rules)

    def abstract_state(self) -> TrainState:
        scalar = jax.ShapeDtypeStruct((), jnp.int32)
        return TrainState(
            step=scalar,
            policy_version=scalar,
            params=self.abstract_params,
            opt_state=jax.eval_shape(self.tx.init, self.abstract_params),
        )

    def state_shardings(self, mesh: Mesh, *, rules=RULES) -> TrainState:
        """Shardings of every leaf: optimizer moments follow their parameter, counters replicate."""
        replicated = NamedSharding(mesh, PartitionSpec())
        params = self.param_shardings(mesh, rules=rules)

        def moments_like_params(tx, state, shardings):
            return optax.tree_map_params(tx, lambda _, s: s, state, shardings,
                                         transform_non_params=lambda _: replicated,
                                         is_leaf=lambda x: isinstance(x, NamedSharding))

        state = self.abstract_state().opt_state
        if isinstance(self.tx, PerAdapter):  # a tuple of states, adapter i's moments shaped like params[i]
            opt = tuple(moments_like_params(self.tx.inner, s, p) for s, p in zip(state, params))
        else:
            opt = moments_like_params(self.tx, state, params)
        return TrainState(step=replicated, policy_version=replicated, params=params, opt_state=opt)

    def init_state(self, rng: jax.Array, mesh: Mesh, *, initial_version: int = 0, rules=RULES) -> TrainState:
        """Fresh state, born sharded on ``mesh`` (init jitted with out_shardings, once per mesh)."""
        make = lambda r, v: self._wrap(nn.unbox(self.init_boxed(r)), v)  # noqa: E731
        return self._jit("init", mesh, rules, make)(rng, jnp.asarray(initial_version, jnp.int32))

    def state_from_params(self, params, mesh: Mesh, *, initial_version: int = 0, rules=RULES) -> TrainState:
        """State around given params (e.g. a loaded checkpoint), fresh optimizer, laid out on ``mesh``."""
        if jax.tree.structure(params) != jax.tree.structure(self.abstract_params):  # type: ignore[operator]  # PyTreeDef is unresolved in jax's stubs
            raise ValueError("state_from_params: params tree does not match the model's")
        params = jax.device_put(params, self.param_shardings(mesh, rules=rules))  # from wherever they are
        return self._jit("from_params", mesh, rules, self._wrap)(params, jnp.asarray(initial_version, jnp.int32))

    def _jit(self, kind, mesh, rules, fn):
        key = (kind, mesh, rules)
        if key not in self._jits:
            self._jits[key] = jax.jit(fn, out_shardings=self.state_shardings(mesh, rules=rules))
        return self._jits[key]

    def _wrap(self, params, version) -> TrainState:
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            policy_version=jnp.asarray(version, jnp.int32),
            params=params,
            opt_state=self.tx.init(params),
        )
