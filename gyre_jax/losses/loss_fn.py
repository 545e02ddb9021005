"""One call from model output and a packed batch to ``(loss, metrics)``.

The batch is a mapping with the ``PackedRows`` field names of
``gyre_jax/trajectory/serialize.py`` (``PackedRows.as_dict()`` works as is):

    targets            int [B, L]   token predicted at each position
    loss_mask          bool [B, L]  target is a trainable token
    loss_weights       f32 [B, L]   aggregation weights, normalised over the global step
    behavior_logprobs  f32 [B, L]   sampler's log-prob of the target   (RL objectives)
    advantages         f32 [B, L]   per token (one value per rollout)   (RL objectives)

and whatever else the config reads (``PolicyLossConfig.batch_needs()``:
``prox_logprobs``, ``trainer_logprobs``, ``ref_logprobs``; for sequence-level entries
``seq_log_ratio`` / ``seq_log_mismatch`` precomputed, or ``sequence_ids``). Extra keys
are ignored. The effective weight is ``loss_weights`` where ``loss_mask`` is true and
0 elsewhere; any weight outside the mask is reported as ``weight_outside_mask`` (it
should be 0: a non-zero value is an upstream bug, shown, not silently trained on).
"""
from __future__ import annotations

from typing import Mapping

import chex
import jax
import jax.numpy as jnp

from gyre_jax.losses.logprobs import (
    DEFAULT_VOCAB_CHUNK,
    chunked_token_logprobs,
    token_entropy,
    token_logprobs,
    token_logprobs_and_entropy,
)
from gyre_jax.losses.policy_gradient import PolicyLossConfig, policy_loss

BASE_KEYS = ("targets", "loss_mask", "loss_weights")
BATCH_KEYS = ("targets", "loss_mask", "behavior_logprobs", "advantages", "loss_weights")  # the RL objectives'


def batch_keys(config: PolicyLossConfig) -> tuple[str, ...]:
    """The batch keys ``loss_from_*`` reads for ``config`` (sequence statistics excepted)."""
    return BASE_KEYS + config.batch_needs()


def _batch_fields(batch: Mapping, shape_BxL, config: PolicyLossConfig, where: str):
    keys = BASE_KEYS + tuple(k for k in config.batch_needs() if k != "ref_logprobs")
    missing = [k for k in keys if k not in batch]
    if missing:
        raise KeyError(f"{where}: batch is missing {missing} (loss {config.loss!r}); it has {sorted(batch)}")
    for k in keys:
        chex.assert_shape(batch[k], tuple(shape_BxL), custom_message=f"{where}: batch[{k!r}] must be [B, L]")
    mask = jnp.asarray(batch["loss_mask"]).astype(bool)
    lw = jnp.asarray(batch["loss_weights"]).astype(jnp.float32)
    weights = jnp.where(mask, lw, 0.0)
    outside = jnp.sum(jnp.where(mask, 0.0, jnp.abs(lw)))
    return jnp.asarray(batch["targets"]), weights, outside


def _finish(logp, ent, batch, weights, outside, config, ref_logprobs_BxL, where):
    if config.kl_coef and ref_logprobs_BxL is None and "ref_logprobs" not in batch:
        raise KeyError(f"{where}: kl_coef={config.kl_coef} needs reference log-probs: batch['ref_logprobs'] or "
                       f"ref_logprobs_BxL")
    loss, metrics = policy_loss(logp, weights, batch, config, entropy_BxT=ent,
                                ref_logp_BxT=None if ref_logprobs_BxL is None else jnp.asarray(ref_logprobs_BxL),
                                where=where)
    metrics["weight_outside_mask"] = outside
    return loss, metrics


def loss_from_logits(
    logits_BxLxV: jax.Array,
    batch: Mapping[str, jax.Array],
    config: PolicyLossConfig = PolicyLossConfig(),
    *,
    ref_logprobs_BxL: jax.Array | None = None,
    vocab_chunk_size: int | None = DEFAULT_VOCAB_CHUNK,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``policy_loss`` of the batch's targets under ``logits``.

    Entropy is computed in the same pass over the logits when it is in the
    loss (``entropy_coef != 0``), and on ``stop_gradient(logits)`` when it is
    only a metric (so the backward pass does not pay for it).
    """
    where = "loss_from_logits"
    shape = logits_BxLxV.shape[:-1]
    targets, weights, outside = _batch_fields(batch, shape, config, where)
    if config.entropy_coef != 0.0:
        logp, ent = token_logprobs_and_entropy(logits_BxLxV, targets, vocab_chunk_size=vocab_chunk_size)
    else:
        logp = token_logprobs(logits_BxLxV, targets, vocab_chunk_size=vocab_chunk_size)
        ent = None
        if config.entropy_metric:
            ent = token_entropy(jax.lax.stop_gradient(logits_BxLxV), vocab_chunk_size=vocab_chunk_size)
    return _finish(logp, ent, batch, weights, outside, config, ref_logprobs_BxL, where)


def loss_from_hidden(
    hidden_BxLxD: jax.Array,
    unembed: jax.Array,
    batch: Mapping[str, jax.Array],
    config: PolicyLossConfig = PolicyLossConfig(),
    *,
    chunk_size: int,
    layout: str | None = None,
    ref_logprobs_BxL: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """As ``loss_from_logits`` with ``logits = hidden @ W``, never materialising them.

    ``unembed``/``layout``/``chunk_size`` as in ``chunked_token_logprobs``.
    """
    where = "loss_from_hidden"
    shape = hidden_BxLxD.shape[:-1]
    targets, weights, outside = _batch_fields(batch, shape, config, where)
    want_ent = config.entropy_coef != 0.0 or config.entropy_metric
    out = chunked_token_logprobs(
        hidden_BxLxD, unembed, targets, chunk_size=chunk_size, layout=layout, with_entropy=want_ent
    )
    logp, ent = out if want_ent else (out, None)
    if ent is not None and config.entropy_coef == 0.0:
        ent = jax.lax.stop_gradient(ent)
    return _finish(logp, ent, batch, weights, outside, config, ref_logprobs_BxL, where)
