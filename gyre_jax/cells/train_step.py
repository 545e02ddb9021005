"""The pure jitted steps: grad_step on any cell, apply_update and train_step on the core.

Contract for a micro-batch: a dict of [b, L] arrays (``MICRO_BATCH_KEYS``, the
device-side fields of ``PackedRows``) whose ``loss_weights`` are already
normalized over the global step, so the step's loss and gradient are plain sums
over its micro-batches (docs/design.md, invariant 3). A ``loss_fn(params,
micro_batch) -> (loss, stats)`` returns such a sum for one micro-batch; every
value in ``stats`` must be additive over micro-batches too.

Reduction order is part of the contract: gradients of a step are summed in
micro-batch index order (``acc = g0; acc = acc + g1; ...``), both in
``train_step`` (scan) and in the elastic runner, so the result does not depend
on which cell computed which micro-batch.

``CellSteps`` builds every jitted function once per mesh and keeps it, so adding
or removing cells never recompiles a layout it has seen.

Context parallelism: when the loss's model config names ``context_parallel_axis``
(``policy_loss_fn`` passes it on), a micro-batch's rows are split along their
sequence over that axis of the cell's mesh (rows no longer split over it), and
attention all-gathers keys and values inside the step (gyre_jax/model/context_parallel.py).
One packed row can then be as long as the cell's devices hold together; the
gradient equals the one-device gradient (tests/test_context_parallel_train.py).
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gyre_jax.cells.frozen_base import FrozenBase
from gyre_jax.cells.train_state import StateSpec, TrainState
from gyre_jax.losses.policy_gradient import combine_metrics
from gyre_jax.sharding import RULES, batch_sharding

MICRO_BATCH_KEYS: tuple[str, ...] = (
    "tokens",
    "targets",
    "loss_mask",
    "behavior_logprobs",
    "positions",
    "segment_ids",
    "subtree_end",
    "target_version",
    "loss_weights",
    "advantages",
)
# The per-step pass's fields (gyre_jax/cells/score.py; zeros when the objective reads none).
SCORE_KEYS = ("prox_logprobs", "trainer_logprobs", "ref_logprobs", "seq_log_ratio", "seq_log_mismatch")
MICRO_BATCH_KEYS = MICRO_BATCH_KEYS + SCORE_KEYS
# An MoE model's recorded routing (routing replay, cells/loss.py): [B, L, R] int16, -1 = routed
# live; present for every micro-batch of an MoE run, absent otherwise. Sharded like [B, L].
ROUTING_KEY = "routing"
# Multi-LoRA (model/lora.py): [B, L] int32, the adapter each token trains; absent with one adapter.
ADAPTER_KEY = "adapter"

LossFn = Callable[[Any, Mapping[str, jax.Array]], tuple[jax.Array, dict[str, jax.Array]]]


def context_parallel_rules(rules, axis: str):
    """``rules`` with a packed row's sequence ("length") split over mesh ``axis`` and rows ("batch") not."""
    out = []
    for name, axes in rules:
        if name == "length":
            axes = axis
        elif name == "batch":
            axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
            axes = tuple(a for a in axes if a != axis) or None
        out.append((name, axes))
    if "length" not in dict(out):
        raise ValueError("context_parallel_rules: the rules have no 'length' axis to split")
    return tuple(out)


def device_micro_batch(rows: Mapping[str, Any], *, where: str = "micro-batch") -> dict[str, np.ndarray]:
    """The device-side fields of a packed micro-batch (PackedRows or its dict), checked.

    The per-step pass's fields (``SCORE_KEYS``) may be absent: they are then zeros, which
    is right only for an objective that reads none of them (the trainer fills them otherwise).
    """
    d = rows.as_dict() if hasattr(rows, "as_dict") else rows
    missing = [k for k in MICRO_BATCH_KEYS if k not in d and k not in SCORE_KEYS]
    if missing:
        raise ValueError(f"{where}: missing fields {missing}")
    shape = np.shape(d["tokens"])
    out = {k: np.asarray(d[k]) if k in d else np.zeros(shape, np.float32) for k in MICRO_BATCH_KEYS}
    if len(shape) != 2:
        raise ValueError(f"{where}: tokens must be [B, L], got shape {shape}")
    for k, v in out.items():
        if v.shape != shape:
            raise ValueError(f"{where}: {k} has shape {v.shape}, tokens has {shape}")
    if d.get(ROUTING_KEY) is not None:
        r = np.asarray(d[ROUTING_KEY])
        if r.ndim != 3 or r.shape[:2] != shape or r.dtype.kind != "i":
            raise ValueError(f"{where}: {ROUTING_KEY} must be integer [B, L, R] with [B, L] = {shape}, got "
                             f"{r.dtype} {r.shape}")
        out[ROUTING_KEY] = r
    if d.get(ADAPTER_KEY) is not None:
        a = np.asarray(d[ADAPTER_KEY])
        if a.shape != shape or a.dtype.kind != "i":
            raise ValueError(f"{where}: {ADAPTER_KEY} must be integer [B, L] = {shape}, got {a.dtype} {a.shape}")
        out[ADAPTER_KEY] = a.astype(np.int32)
    return out


def staleness(target_version_BxL, loss_mask_BxL, version, xp=np):
    """(mean, max) over trained tokens of ``version - target_version``; (0, 0) if none.

    Works on numpy (host) or jax.numpy (inside a step) via ``xp``.
    """
    mask = loss_mask_BxL.astype(bool)
    lag = (version - target_version_BxL).astype(xp.float32)
    n = mask.sum()
    mean = xp.where(mask, lag, 0.0).sum() / xp.maximum(n, 1)
    mx = xp.max(xp.where(mask, lag, -xp.inf))
    return mean, xp.where(n > 0, mx, 0.0)


def check_versions(mb: Mapping[str, np.ndarray], version: int, *, where: str) -> None:
    """Trained tokens need a behavior version, and none may come from a future policy."""
    tv = mb["target_version"][mb["loss_mask"].astype(bool)]
    if tv.size and tv.min() < 0:
        raise ValueError(f"{where}: a trained token has target_version {int(tv.min())} (no behavior policy)")
    if tv.size and tv.max() > version:
        raise ValueError(
            f"{where}: a trained token was sampled by policy version {int(tv.max())}, "
            f"newer than the version being trained ({version})"
        )


# Stat reductions as data (like gyre_jax.losses.METRIC_REDUCTIONS), so both the jitted
# scan (needs identities to start from) and the host (float64 numpy) can apply them.
_IDENTITY = {"sum": 0.0, "min": np.inf, "max": -np.inf}


def stat_reduction(key: str, reductions: Mapping[str, str] | None) -> str:
    how = "sum" if reductions is None else reductions.get(key)
    if how not in _IDENTITY:
        raise KeyError(f"no reduction (sum/min/max) for stat {key!r}; got {how!r}")
    return how


def combine_stats(a: Mapping, b: Mapping, reductions: Mapping[str, str] | None, *, host: bool = False) -> dict:
    """Merge two micro-batches' stats with the losses' one combiner; ``reductions`` None: every stat sums."""
    return combine_metrics(a, b, {k: stat_reduction(k, reductions) for k in a}, host=host)


def make_grad_fn(loss_fn: LossFn):
    """(params, micro_batch) -> (grads, stats) with stats['loss'] the micro-batch loss."""

    def grad_fn(params, mb):
        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, mb)
        return grads, {**stats, "loss": loss}

    return grad_fn


def apply_grads(tx: optax.GradientTransformation, schedule, state: TrainState, grads):
    """One optimizer update with the step's summed gradient (clipping sees the whole step)."""
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    new = TrainState(
        step=state.step + 1,
        policy_version=state.policy_version + 1,
        params=optax.apply_updates(state.params, updates),
        opt_state=opt_state,
    )
    metrics = {
        "grad_norm": optax.tree.norm(grads),
        "update_norm": optax.tree.norm(updates),
        "learning_rate": jnp.asarray(schedule(state.step), jnp.float32),
    }
    return new, metrics


def _lower(fn, *args):
    """``fn.lower(*args)`` for a jitted function, or one with bound leading arguments (a LoRA run's base)."""
    if isinstance(fn, functools.partial):
        return fn.func.lower(*fn.args, *args)
    return fn.lower(*args)


class CellSteps:
    """Jitted steps for one model + loss + optimizer, built once per mesh and cached.

    ``grad_step(mesh)`` runs on any cell in the training layout;
    ``apply_update(mesh)``, ``accumulate(mesh)`` and ``train_step(mesh)`` run on
    the core. ``compiled()`` says how many executables each one holds.
    """

    def __init__(
        self,
        spec: StateSpec,
        loss_fn: LossFn,
        schedule: optax.Schedule,
        *,
        reductions: Mapping[str, str] | None = None,
        rules=RULES,
        context_parallel_axis: str | None = None,
        base: FrozenBase | None = None,
    ):
        """``context_parallel_axis``: mesh axis to split rows' sequence over; default the
        ``loss_fn.context_parallel_axis`` that ``policy_loss_fn`` sets from the model config.

        ``base``: a LoRA run's frozen base (cells/frozen_base.py). Then ``spec``'s params are the
        adapters, ``loss_fn`` takes the model's variables (``{"params": base, "lora": ...}``), and
        every step that runs the model gets this mesh's copy of the base as a bound first argument:
        callers pass adapters where a plain run passes params, and gradients are the adapters' only."""
        self.context_parallel_axis = context_parallel_axis or getattr(loss_fn, "context_parallel_axis", None)
        # Expert parallelism (model/moe.py) dispatches inside shard_map over the abstract mesh, as CP does.
        self.expert_parallel_axis = getattr(loss_fn, "expert_parallel_axis", None)
        if self.context_parallel_axis is not None:
            rules = context_parallel_rules(rules, self.context_parallel_axis)
        self.spec = spec
        self.reductions = reductions  # how each stat combines over micro-batches (None: all sum)
        self.loss_fn = loss_fn
        self.base = base
        if base is None:
            self.grad_fn = make_grad_fn(loss_fn)
            self._grad = lambda _b, params, mb: self.grad_fn(params, mb)
        else:
            def lora_grad(b, adapters, mb):  # gradients of the adapters only: the base is an input, not a param
                return make_grad_fn(lambda a, m: loss_fn(base.variables(b, a), m))(adapters, mb)

            self._grad = lora_grad
            # (adapters, mb) -> (grads, stats) over the host's base: for jax.eval_shape; jit grad_step instead
            self.grad_fn = lambda adapters, mb: self._grad(base.params, adapters, mb)
        self.schedule = schedule
        self.rules = rules
        self._cache: dict[tuple[str, Mesh], Any] = {}
        self._lock = threading.RLock()  # cells build their steps from their own threads

    def _get(self, kind: str, mesh: Mesh, build):
        key = (kind, mesh)
        with self._lock:
            if key not in self._cache:
                self._cache[key] = build()
            return self._cache[key]

    def param_shardings(self, mesh: Mesh):
        return self._get("param_shardings", mesh, lambda: self.spec.param_shardings(mesh, rules=self.rules))

    def state_shardings(self, mesh: Mesh) -> TrainState:
        return self._get("state_shardings", mesh, lambda: self.spec.state_shardings(mesh, rules=self.rules))

    def batch_sharding(self, mesh: Mesh) -> NamedSharding:
        return batch_sharding(mesh, rules=self.rules)

    def _in_mesh(self, fn, mesh: Mesh):
        """``fn`` traced with ``mesh`` as the abstract mesh when rows are context-parallel or experts
        expert-parallel (the model finds its sequence or expert axis there); ``fn`` itself otherwise."""
        named = {"context_parallel_axis": self.context_parallel_axis, "expert_parallel_axis": self.expert_parallel_axis}
        if all(a is None for a in named.values()):
            return fn
        for what, axis in named.items():
            if axis is not None and axis not in mesh.shape:
                raise ValueError(f"{what}={axis!r} is not an axis of the cell's mesh {dict(mesh.shape)}")

        def wrapped(*args):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return fn(*args)

        return wrapped

    def _jit_model(self, mesh: Mesh, fn, in_shardings, out_shardings, donate_argnums=()):
        """``fn(base, *args)`` jitted on ``mesh``, taking ``*args``: in a LoRA run with this mesh's copy of the
        frozen base bound as its first argument (placed once, read by every call), else with None."""
        if self.base is None:
            return jax.jit(self._in_mesh(lambda *a: fn(None, *a), mesh), in_shardings=in_shardings,
                           out_shardings=out_shardings, donate_argnums=donate_argnums)
        jitted = jax.jit(self._in_mesh(fn, mesh), in_shardings=(self.base.shardings(mesh, rules=self.rules),
                                                                *in_shardings),
                         out_shardings=out_shardings, donate_argnums=tuple(d + 1 for d in donate_argnums))
        bound = functools.partial(jitted, self.base.on(mesh, rules=self.rules))
        bound._cache_size = jitted._cache_size  # type: ignore[attr-defined]  # compiled() counts executables
        return bound

    def grad_step(self, mesh: Mesh):
        """Jitted (params, micro_batch) -> (grads, stats): grads in this mesh's param layout (a LoRA run:
        adapters in, the adapters' gradients out)."""

        def build():
            ps = self.param_shardings(mesh)
            rep = NamedSharding(mesh, PartitionSpec())
            return self._jit_model(mesh, self._grad, (ps, self.batch_sharding(mesh)), (ps, rep))

        return self._get("grad_step", mesh, build)

    def score_step(self, mesh: Mesh):
        """Jitted (params, micro_batch) -> logp_BxL, no gradient: the targets' log-probs under
        any params of this model (the step's, an older version's, the reference's), laid out
        like the micro-batch. Needs a ``loss_fn`` with ``logprob_fn`` (``policy_loss_fn``'s)."""
        fn = getattr(self.loss_fn, "logprob_fn", None)
        if fn is None:
            raise ValueError("CellSteps.score_step: the loss_fn has no logprob_fn (build it with policy_loss_fn)")

        base = self.base

        def score(b, p, mb):
            return jax.lax.stop_gradient(fn(p if base is None else base.variables(b, p), mb))

        def build():
            bs = self.batch_sharding(mesh)
            return self._jit_model(mesh, score, (self.param_shardings(mesh), bs), bs)

        return self._get("score_step", mesh, build)

    def accumulate(self, mesh: Mesh):
        """Jitted acc + grads (acc donated): the one reduction used for every step."""

        def build():
            ps = self.param_shardings(mesh)
            return jax.jit(
                lambda acc, g: jax.tree.map(jnp.add, acc, g),
                in_shardings=(ps, ps),
                out_shardings=ps,
                donate_argnums=0,
            )

        return self._get("accumulate", mesh, build)

    def scale(self, mesh: Mesh):
        """Jitted (grads, scale) -> grads * scale (grads donated): a step's late normalizer."""

        def build():
            ps = self.param_shardings(mesh)
            rep = NamedSharding(mesh, PartitionSpec())
            return jax.jit(
                lambda g, c: jax.tree.map(lambda x: x * c.astype(x.dtype), g),
                in_shardings=(ps, rep),
                out_shardings=ps,
                donate_argnums=0,
            )

        return self._get("scale", mesh, build)

    def apply_update(self, mesh: Mesh):
        """Jitted (state, grads) -> (state, metrics), state donated."""

        def build():
            ss = self.state_shardings(mesh)
            rep = NamedSharding(mesh, PartitionSpec())
            return jax.jit(
                lambda s, g: apply_grads(self.spec.tx, self.schedule, s, g),
                in_shardings=(ss, self.param_shardings(mesh)),
                out_shardings=(ss, rep),
                donate_argnums=0,  # grads cannot alias: params and moments already take the outputs
            )

        return self._get("apply_update", mesh, build)

    def train_step(self, mesh: Mesh):
        """Jitted train_step(state, batch) -> (state, metrics) on one cell.

        ``batch``: dict of [M, b, L] arrays, M micro-batches summed in index order
        (scan), the same reduction the elastic runner does across cells.
        """

        def step(b, state: TrainState, batch):
            # One grad_fn in the HLO (inside the scan): zero-initialised accumulators,
            # 0 + g0 == g0, so the sums match the elastic reducer's acc = g0 + g1 + ...
            first = jax.tree.map(lambda x: x[0], batch)
            _, stats_shape = jax.eval_shape(self._grad, b, state.params, first)
            acc0 = jax.tree.map(jnp.zeros_like, state.params)
            stats0 = {k: jnp.full(v.shape, _IDENTITY[stat_reduction(k, self.reductions)], v.dtype) for k, v in stats_shape.items()}

            def body(carry, mb):
                acc, stats = carry
                g, s = self._grad(b, state.params, mb)
                return (jax.tree.map(jnp.add, acc, g), combine_stats(stats, s, self.reductions)), None

            (grads, stats), _ = jax.lax.scan(body, (acc0, stats0), batch)
            st_mean, st_max = staleness(batch["target_version"], batch["loss_mask"], state.policy_version, xp=jnp)
            new, metrics = apply_grads(self.spec.tx, self.schedule, state, grads)
            return new, {**stats, **metrics, "staleness_mean": st_mean, "staleness_max": st_max}

        def build():
            ss = self.state_shardings(mesh)
            b = self.batch_sharding(mesh)
            stacked = NamedSharding(mesh, PartitionSpec(None, *b.spec))
            rep = NamedSharding(mesh, PartitionSpec())
            return self._jit_model(mesh, step, (ss, stacked), (ss, rep), donate_argnums=(0,))

        return self._get("train_step", mesh, build)

    def warm(self, mesh: Mesh, micro_batch: Mapping[str, Any], *, core: bool = False) -> None:
        """Compile this mesh's steps now (e.g. while a cell drains, before it joins training).

        Compiles grad_step (and, with ``core``, accumulate and apply_update) ahead of time for
        ``micro_batch``'s shapes, from abstract values: nothing runs and nothing is allocated (a
        fwd+bwd pass on zeros cost a 135M model minutes of a loaded 2-core host and gigabytes),
        and a later call of the same shapes finds the executable. Safe from several threads.
        """
        mb = device_micro_batch(micro_batch, where="warm")
        bs = self.batch_sharding(mesh)
        mb_abs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=bs) for k, v in mb.items()}

        def abstract(tree, shardings):
            return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), tree, shardings)

        params = abstract(self.spec.abstract_params, self.param_shardings(mesh))
        _lower(self.grad_step(mesh), params, mb_abs).compile()
        if core:
            _lower(self.accumulate(mesh), params, params).compile()
            state = abstract(self.spec.abstract_state(), self.state_shardings(mesh))
            _lower(self.apply_update(mesh), state, params).compile()

    def compiled(self) -> dict[tuple[str, int], int]:
        """(kind, id of first device of the mesh) -> executables held by that jitted function."""
        return {
            (kind, int(mesh.devices.flat[0].id)): fn._cache_size()
            for (kind, mesh), fn in self._cache.items()
            if hasattr(fn, "_cache_size")
        }
