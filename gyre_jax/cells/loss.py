"""The loss a training cell differentiates: the model over packed rows + the policy-gradient loss.

Glue only: the model (gyre_jax.model) and the loss math (gyre_jax.losses) live
elsewhere. Returns a ``loss_fn(params, micro_batch) -> (loss, metrics)`` for
``CellSteps``; combine its metrics with ``gyre_jax.losses.METRIC_REDUCTIONS``.

Training memory is planned from the micro-batch's shape when the step is traced
(``memory_plan``), so a config with long rows trains within memory without
naming any knob:

* rows of ``model_config.long_row_len`` tokens or more (default 8192; 0 turns
  the rule off) recompute each layer in the backward pass (``remat``, with
  ``model_config.remat_policy``) and project hidden states onto the vocabulary
  in chunks of positions (``loss_from_hidden``), never holding [B, L, V] logits;
* shorter rows project in chunks too when their full float32 logits would
  exceed ``LOGITS_BYTES_BUDGET`` (a 150K vocabulary at a few thousand tokens);
* ``model_config.remat=True`` remats at any length; ``policy_loss_fn(logits_chunk=...)``
  fixes the projection (None: full logits, an int: that chunk size).

The plan changes how the result is computed, never the result (tests/test_long_context.py).

A mixture-of-experts model (``num_experts > 0``) adds ``router_aux_loss_coef`` x HF's
load-balancing loss over the micro-batch's real tokens, weighted by the micro-batch's share
of the step's loss weight (the shares sum to 1 over a step); metrics ``moe_aux_loss`` (that
weighted mean) and ``moe_max_load`` (max over layers and experts of E x the expert's share of
(token, expert) pairs: 1 is perfectly balanced, E is everything on one expert).

Routing replay (R3): a micro-batch with a ``routing`` field ([B, L, MoE layers x top-k] expert
ids the engine recorded at each trained token's predicting position, -1 elsewhere) passes it
to the model, which uses it where ``model_config.routing_replay`` (model/moe.py) and compares
it with the live routing either way: metrics ``routing_recorded_tokens`` (trained tokens with
recorded routing) and ``routing_mismatch_tokens`` (those whose live top-k set differs from the
recorded one in at least one MoE layer); the step record's ``routing_mismatch`` is their ratio.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Protocol, cast

import jax
import jax.numpy as jnp

from gyre_jax.cells.train_step import ADAPTER_KEY
from gyre_jax.losses import PolicyLossConfig, chunked_token_logprobs, loss_from_hidden, loss_from_logits, token_logprobs
from gyre_jax.losses.registry import declare_metrics
from gyre_jax.model import ModelConfig, Transformer
from gyre_jax.model.lora import DROPOUT_RNG as LORA_DROPOUT
from gyre_jax.model.moe import expert_load, load_balancing_loss
from gyre_jax.model.transformer import moe_stats

log = logging.getLogger(__name__)
declare_metrics({"moe_aux_loss": "mean", "moe_max_load": "max", "routing_mismatch_tokens": "count",
                 "routing_recorded_tokens": "count"}, "gyre_jax.cells.loss")

LOGITS_BYTES_BUDGET = 512 << 20  # full float32 logits of a micro-batch above this: chunked projection
CHUNK_BYTES = 64 << 20  # target float32 logits of one chunk of positions
MIN_CHUNK, MAX_CHUNK = 128, 4096  # positions per chunk (more chunks only cost loop steps)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """How one micro-batch shape trains: per-layer remat, and the vocab projection's chunk (None: whole)."""

    remat: bool
    logits_chunk: int | None
    why: str


class PolicyLossFn(Protocol):
    """What ``policy_loss_fn`` returns: the loss, carrying what ``CellSteps`` and the scorer read."""

    context_parallel_axis: str | None
    expert_parallel_axis: str | None
    logprob_fn: Callable[[Any, Any], Any]  # (params, micro_batch) -> logp_BxL

    def __call__(self, params: Any, mb: Any) -> tuple[Any, dict[str, Any]]: ...


def _chunk_for(model_config: ModelConfig, rows: int) -> int:
    """Positions per chunk: a power of two with about CHUNK_BYTES of float32 logits, in [MIN_CHUNK, MAX_CHUNK]."""
    per_position = max(1, rows) * model_config.padded_vocab * 4
    fit = max(1, CHUNK_BYTES // per_position)
    return int(min(MAX_CHUNK, max(MIN_CHUNK, 1 << (fit.bit_length() - 1))))


def memory_plan(model_config: ModelConfig, rows: int, row_len: int, *, logits_chunk="auto") -> MemoryPlan:
    """The training memory plan for micro-batches of ``rows`` x ``row_len`` tokens (module docstring)."""
    long = model_config.long_row_len > 0 and row_len >= model_config.long_row_len
    remat = model_config.remat or long
    logits_bytes = rows * row_len * model_config.padded_vocab * 4
    if logits_chunk != "auto":
        chunk, why_chunk = logits_chunk, "logits_chunk given"
    elif long or logits_bytes > LOGITS_BYTES_BUDGET:
        chunk = min(row_len, _chunk_for(model_config, rows))
        why_chunk = f"row_len >= long_row_len={model_config.long_row_len}" if long else (
            f"full logits would be {logits_bytes / 2**30:.2f} GiB > {LOGITS_BYTES_BUDGET / 2**30:.2f} GiB")
    else:
        chunk, why_chunk = None, "short rows, small logits"
    why_remat = ("model_config.remat" if model_config.remat else
                 f"row_len {row_len} >= long_row_len={model_config.long_row_len}" if long else "short rows")
    return MemoryPlan(remat=remat, logits_chunk=chunk, why=f"remat: {why_remat}; logits: {why_chunk}")


def policy_loss_fn(model_config: ModelConfig, loss_config: PolicyLossConfig = PolicyLossConfig(), *,
                   logits_chunk: int | None | str = "auto") -> PolicyLossFn:
    """``logits_chunk``: "auto" (``memory_plan`` decides from each micro-batch's shape), None
    (full [B, L, V] logits), or scan the vocab projection over chunks of this many positions.

    The returned ``loss_fn`` carries ``context_parallel_axis`` (the model config's), which
    ``CellSteps`` reads to split rows along their sequence over that mesh axis, and
    ``logprob_fn(params, micro_batch) -> logp_BxL``: the targets' log-probs under the same
    model and memory plan, no gradient (the per-step pass of ``gyre_jax/cells/score.py``).
    """
    if logits_chunk not in ("auto", None) and (not isinstance(logits_chunk, int) or logits_chunk < 1):
        raise ValueError(f"policy_loss_fn: logits_chunk must be 'auto', None or a positive int, got {logits_chunk!r}")
    models: dict[bool, Transformer] = {}

    def loss_fn(params, mb):
        rows, row_len = mb["tokens"].shape  # static at trace time: one plan per compiled shape
        plan = memory_plan(model_config, rows, row_len, logits_chunk=logits_chunk)
        if plan.remat or plan.logits_chunk is not None:
            log.info("training memory plan for [%d, %d] rows: %s", rows, row_len, plan.why)
        if plan.remat not in models:  # remat changes the computation, not the parameters
            models[plan.remat] = Transformer(model_config.replace(remat=plan.remat))
        model = models[plan.remat]
        inputs = (mb["tokens"], mb["positions"], mb["segment_ids"], mb["subtree_end"])
        moe = model_config.num_experts > 0
        apply = functools.partial(model.apply, mutable=["intermediates"]) if moe else model.apply
        apply = _with_lora(_with_routing(apply, mb), mb, model_config, training=True)
        if plan.logits_chunk is None:
            out = apply(params, *inputs)
            logits, inter = out if moe else (out, None)
            loss, metrics = loss_from_logits(logits, mb, loss_config)
        else:
            out = apply(params, *inputs, return_hidden=True)
            (hidden_BxLxD, unembed_DxV), inter = out if moe else (out, None)
            loss, metrics = loss_from_hidden(hidden_BxLxD, unembed_DxV, mb, loss_config,
                                             chunk_size=plan.logits_chunk, layout="DxV")
        if moe:
            stats = moe_stats(inter)
            loss, metrics = _add_moe_loss(loss, metrics, stats, model_config)
            if "routing" in mb:
                metrics = dict(metrics, **_routing_metrics(stats, mb))
        return loss, metrics

    def logprob_fn(params, mb):  # the MoE statistics are not collected: apply without mutable sows nothing
        rows, row_len = mb["tokens"].shape
        plan = memory_plan(model_config, rows, row_len, logits_chunk=logits_chunk)
        if False not in models:  # a forward alone never needs remat
            models[False] = Transformer(model_config.replace(remat=False))
        inputs = (mb["tokens"], mb["positions"], mb["segment_ids"], mb["subtree_end"])
        apply = _with_lora(_with_routing(models[False].apply, mb), mb, model_config, training=False)
        if plan.logits_chunk is None:
            return token_logprobs(apply(params, *inputs), mb["targets"])
        hidden_BxLxD, unembed_DxV = apply(params, *inputs, return_hidden=True)
        return chunked_token_logprobs(hidden_BxLxD, unembed_DxV, mb["targets"], chunk_size=plan.logits_chunk,
                                      layout="DxV")

    fn = cast(PolicyLossFn, loss_fn)  # a plain function (jit traces it), given the protocol's attributes here
    fn.context_parallel_axis = model_config.context_parallel_axis
    fn.expert_parallel_axis = model_config.expert_parallel_axis
    fn.logprob_fn = logprob_fn
    return fn


def _with_routing(apply, mb):
    """The model's apply, given the micro-batch's recorded routing when it has one."""
    if "routing" not in mb:
        return apply
    return functools.partial(apply, routing_BxLxR=mb["routing"])


def _with_lora(apply, mb, model_config: ModelConfig, *, training: bool):
    """The LoRA model's apply (model/lora.py): each token's adapter from the micro-batch's ``adapter``
    field (several adapters), and dropout's rng when training (a row's mask comes from its own seed,
    so the key is fixed: the same row draws the same mask on any cell, in any micro-batch)."""
    lora = model_config.lora
    if lora is None:
        return apply
    kw: dict[str, Any] = {}
    if lora.num_adapters > 1 and ADAPTER_KEY in mb:
        kw["adapter_BxL"] = mb[ADAPTER_KEY]
    if training and lora.dropout:
        kw["rngs"] = {LORA_DROPOUT: jax.random.key(0)}
    return functools.partial(apply, **kw) if kw else apply


def _routing_metrics(stats, mb):
    """Trained tokens with recorded routing, and those whose live routing differs in any MoE layer."""
    b, n = mb["tokens"].shape
    recorded_BxL = mb["loss_mask"].astype(bool) & (mb["routing"][..., 0] >= 0)
    differs_BxL = jnp.max(stats.mismatch, axis=0).reshape(b, n) > 0
    return {"routing_recorded_tokens": jnp.sum(recorded_BxL).astype(jnp.float32),
            "routing_mismatch_tokens": jnp.sum(recorded_BxL & differs_BxL).astype(jnp.float32)}


def _add_moe_loss(loss, metrics, stats, model_config: ModelConfig):
    """The load-balancing term and the routing metrics of one micro-batch (module docstring)."""
    share = jax.lax.stop_gradient(metrics["weight_sum"])
    aux = load_balancing_loss(stats, model_config.num_experts)
    metrics = dict(metrics, moe_aux_loss=share * jax.lax.stop_gradient(aux),
                   moe_max_load=model_config.num_experts * jnp.max(expert_load(stats)))
    return loss + model_config.router_aux_loss_coef * share * aux, metrics
