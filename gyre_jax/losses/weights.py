"""Per-token loss weights: where the loss aggregation lives.

``policy_gradient_loss`` computes ``sum_t w_t l_t``; the choice of mean is the
choice of ``w``. Every builder takes the counts of the *global* step, so the
weights of any micro-batch are already normalised and micro-batch losses (and
gradients) simply add up to the step's, whatever the split.

* ``rollout_token_mean`` (ours, docs/design.md "Counting rule"): each unique
  trainable token of rollout r gets ``w = 1 / (N_r * R)``, with ``N_r`` the
  unique trainable tokens of r and ``R`` the rollouts of the step. A token shared
  by several paths of a tree is one packed target (the serializer's branch-point
  rule), so counting ``loss_mask`` counts it once.
* ``token_mean``: ``w = 1 / N`` with ``N`` the trainable tokens of the step.
* ``sequence_mean``: ``w = 1 / (N_s * S)``, the rollout rule with sequence ids
  (for example one id per packed tree or per path) instead of rollout ids.

Tokens with ``loss_mask`` false get 0. Inputs may be numpy (host side: the
result is numpy, and ids and counts are validated with errors that say where)
or jax arrays (traceable; no value checks possible).

The registry (``WEIGHT_BUILDERS``, ``--config.train.weights``) holds the builders the
RL loop can use: ``rollout_token_mean`` (default), ``token_mean`` and ``constant``
(Dr. GRPO's constant normaliser); ``build_loss_weights`` runs one. ``sequence_mean``
is the rollout rule with other ids (in the loop, a sequence is a rollout).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from gyre_jax.losses.registry import WEIGHT_BUILDERS


def _is_jax(*xs) -> bool:
    return any(isinstance(x, jax.Array) for x in xs if x is not None)


def _check_count(name: str, what: str, n) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"{name}: {what} must be a positive int (the global step's count), got {n!r}")
    return int(n)


def group_mean_weights(
    loss_mask, group_ids, num_groups: int, group_token_counts=None, *, name: str = "group_mean_weights"
):
    """``w = loss_mask / (N_g * G)`` with ``g = group_ids`` at each token.

    ``group_ids`` index ``[0, num_groups)`` wherever ``loss_mask`` is true (any
    value elsewhere). ``group_token_counts[g]`` is ``N_g`` over the whole step;
    when None it is counted from ``loss_mask`` itself, which is right only if
    the arrays given cover the whole step.
    """
    g = _check_count(name, "num_groups", num_groups)
    if _is_jax(loss_mask, group_ids, group_token_counts):
        mask_j = jnp.asarray(loss_mask).astype(bool)
        ids_j = jnp.asarray(group_ids)
        if ids_j.shape != mask_j.shape:
            raise ValueError(f"{name}: ids shape {ids_j.shape} != loss_mask shape {mask_j.shape}")
        ids_j = jnp.where(mask_j, ids_j, 0).astype(jnp.int32)
        if group_token_counts is None:
            counts_j = jnp.zeros(g, jnp.float32).at[ids_j].add(mask_j.astype(jnp.float32))
        else:
            counts_j = jnp.asarray(group_token_counts, jnp.float32)
        n_j = counts_j[ids_j]
        return jnp.where(mask_j, 1.0 / (jnp.where(n_j > 0, n_j, 1.0) * g), 0.0).astype(jnp.float32)

    mask = np.asarray(loss_mask).astype(bool)
    ids = np.asarray(group_ids)
    if ids.shape != mask.shape:
        raise ValueError(f"{name}: ids shape {ids.shape} != loss_mask shape {mask.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"{name}: ids must be integers, got dtype {ids.dtype}")
    used = ids[mask]
    bad = (used < 0) | (used >= g)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(mask)[np.flatnonzero(bad)[0]])
        raise ValueError(
            f"{name}: id {int(used[bad][0])} at index {where} (a trainable token) is outside [0, {g})"
        )
    seen = np.bincount(used, minlength=g).astype(np.int64)
    if group_token_counts is None:
        counts = seen
    else:
        counts = np.asarray(group_token_counts)
        if counts.shape != (g,):
            raise ValueError(f"{name}: token counts have shape {counts.shape}, expected ({g},)")
        short = np.flatnonzero(counts < seen)
        if short.size:
            k = int(short[0])
            raise ValueError(
                f"{name}: group {k} has {int(seen[k])} trainable tokens here but its step count is "
                f"{counts[k]}; the counts must cover the whole step"
            )
    w = np.zeros(mask.shape, np.float64)
    w[mask] = 1.0 / (counts[used].astype(np.float64) * g)
    return w.astype(np.float32)


def rollout_token_mean_weights(loss_mask, rollout_ids, num_rollouts: int, *, rollout_token_counts=None):
    """Our counting rule: ``w = 1 / (N_r * R)`` on trainable tokens, 0 elsewhere.

    ``rollout_ids[b, l]`` in ``[0, R)`` names the rollout of each trainable
    token; ``num_rollouts`` is ``R`` for the global step; ``rollout_token_counts``
    (shape [R]) are the ``N_r`` of the step (counted from ``loss_mask`` if None).
    """
    return group_mean_weights(
        loss_mask, rollout_ids, num_rollouts, rollout_token_counts, name="rollout_token_mean_weights"
    )


def sequence_mean_weights(loss_mask, sequence_ids, num_sequences: int, *, sequence_token_counts=None):
    """Mean over sequences of per-sequence token means: ``w = 1 / (N_s * S)``."""
    return group_mean_weights(
        loss_mask, sequence_ids, num_sequences, sequence_token_counts, name="sequence_mean_weights"
    )


def token_mean_weights(loss_mask, total_tokens: int | None = None):
    """``w = 1 / N`` on trainable tokens, ``N = total_tokens`` of the step (default: ``loss_mask.sum()``)."""
    name = "token_mean_weights"
    if _is_jax(loss_mask):
        mask_j = jnp.asarray(loss_mask).astype(bool)
        n_j = jnp.sum(mask_j).astype(jnp.float32) if total_tokens is None else jnp.float32(total_tokens)
        return jnp.where(mask_j, 1.0 / jnp.maximum(n_j, 1.0), 0.0).astype(jnp.float32)
    mask = np.asarray(loss_mask).astype(bool)
    seen = int(mask.sum())
    n = seen if total_tokens is None else _check_count(name, "total_tokens", total_tokens)
    if n < seen:
        raise ValueError(f"{name}: total_tokens={n} is less than the {seen} trainable tokens given")
    return np.where(mask, 1.0 / max(n, 1), 0.0).astype(np.float32)


# ----------------------------------------------------------------------------- registry
# A registered builder gives the *unnormalised* weights of the rows it is shown and how
# many normaliser units those rows hold; the step's weights are ``u / (units of the step)``.
# A trainer that packs a step in pieces (streaming) divides by a nominal count first and
# rescales the step's gradient by nominal / actual at its end (``build_loss_weights``'s
# ``normalizer``), so any builder streams.


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConstantConfig:
    weights_normalizer: int = 4096  # C: tokens per rollout the sum is divided by (e.g. the generation budget)

    def __post_init__(self):
        c = self.weights_normalizer
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 1:
            raise ValueError(f"ConstantConfig.weights_normalizer must be a positive int, got {c!r}")


@WEIGHT_BUILDERS.register(
    "rollout_token_mean", units="rollouts",
    summary="each rollout's trainable tokens average to 1/R: w = 1 / (N_r * R) (our counting rule)",
    paper="QwenGyre (this project's design: rollout-first mean); the sample-level mean of GRPO, Shao et al. 2024")
def rollout_token_mean(loss_mask, rollout_ids, num_rollouts, rollout_token_counts, cfg):
    if _is_jax(loss_mask, rollout_ids, rollout_token_counts):
        mask = jnp.asarray(loss_mask).astype(bool)
        ids = jnp.where(mask, jnp.asarray(rollout_ids), 0).astype(jnp.int32)
        counts = (jnp.zeros(num_rollouts, jnp.float32).at[ids].add(mask.astype(jnp.float32))
                  if rollout_token_counts is None else jnp.asarray(rollout_token_counts, jnp.float32))
        return jnp.where(mask, 1.0 / jnp.maximum(counts[ids], 1.0), 0.0), float(num_rollouts)
    # validates ids and counts with errors that say where
    group_mean_weights(loss_mask, rollout_ids, num_rollouts, rollout_token_counts, name="rollout_token_mean")
    mask = np.asarray(loss_mask).astype(bool)
    ids = np.where(mask, np.asarray(rollout_ids), 0)
    counts = np.bincount(ids[mask], minlength=num_rollouts) if rollout_token_counts is None else \
        np.asarray(rollout_token_counts)
    u = np.zeros(mask.shape, np.float64)
    u[mask] = 1.0 / counts[ids[mask]].astype(np.float64)
    return u, float(num_rollouts)


@WEIGHT_BUILDERS.register(
    "token_mean", units="tokens",
    summary="every trainable token of the step counts the same: w = 1 / N",
    paper="Yu et al. 2025, DAPO (token-level policy-gradient loss)")
def token_mean(loss_mask, rollout_ids, num_rollouts, rollout_token_counts, cfg):
    xp = jnp if _is_jax(loss_mask, rollout_token_counts) else np
    mask = xp.asarray(loss_mask).astype(bool)
    seen = xp.sum(mask)
    n = seen if rollout_token_counts is None else xp.sum(xp.asarray(rollout_token_counts))
    if xp is np:
        if n < seen:
            raise ValueError(f"token_mean: the step's token count {int(n)} is less than the {int(seen)} given")
        n = float(n)
    return mask.astype(xp.float32 if xp is jnp else np.float64), n


@WEIGHT_BUILDERS.register(
    "constant", config=ConstantConfig, units="rollouts",
    summary="sum of token losses over a constant: w = 1 / (C * R), no per-length normaliser",
    paper="Liu et al. 2025, Understanding R1-Zero-Like Training (Dr. GRPO)")
def constant(loss_mask, rollout_ids, num_rollouts, rollout_token_counts, cfg: ConstantConfig):
    xp = jnp if _is_jax(loss_mask) else np
    return xp.asarray(loss_mask).astype(bool) / float(cfg.weights_normalizer), float(num_rollouts)


def get_weight_builder(name: str):
    """The weight builder registered as ``name``; ``LookupError`` lists the known ones."""
    return WEIGHT_BUILDERS.get(name)


def build_loss_weights(name: str, loss_mask, rollout_ids, num_rollouts: int, *, rollout_token_counts=None,
                       config=None, normalizer: float | None = None) -> tuple[np.ndarray, float]:
    """``(weights, units)`` of the registered builder ``name`` for these rows (float32; numpy in, numpy out,
    jax arrays traceable).

    ``rollout_ids`` index ``[0, num_rollouts)`` at trainable tokens; ``rollout_token_counts``
    are the rollouts' ``N_r`` over the whole step (None: counted here). The weights are the
    builder's ``u / normalizer``; ``normalizer`` None divides by the rows' own ``units`` (the
    rows are the whole step: weights sum to 1 for the rollout- and token-means).
    """
    entry = get_weight_builder(name)
    cfg = entry.config() if config is None else entry.check_config(config, "build_loss_weights: ")
    _check_count(f"build_loss_weights({name!r})", "num_rollouts", num_rollouts)
    u, units = entry.fn(loss_mask, rollout_ids, int(num_rollouts), rollout_token_counts, cfg)
    z = units if normalizer is None else normalizer
    if _is_jax(u):
        return (u / jnp.maximum(z, 1e-30)).astype(jnp.float32), units
    z = float(z)
    if not np.any(u):  # no trainable token here (e.g. every rollout of a streamed group failed)
        return np.zeros(np.shape(u), np.float32), units
    if not (z > 0 and np.isfinite(z)):
        raise ValueError(f"build_loss_weights({name!r}): normalizer must be finite and > 0, got {z!r}")
    return (np.asarray(u, np.float64) / z).astype(np.float32), units
