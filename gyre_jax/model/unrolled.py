"""The forward over per-layer buffers: each layer's weights and k/v are arrays of their own.

Why: the scanned model keeps every layer's weights, and a stacked KV cache, in [Y, ...]
arrays indexed by the scan's layer counter. XLA on CPU copies a layer's slice out of such
an array before any dot that reads it, so a decode step read every weight and every cached
k/v three times (read, write the copy, read it again): ~40% of a 32-slot step of the ~100M
model, and at one slot most of it (tools/bench_roofline.py). Here the layers run as an
unrolled Python loop over their own arrays, and each layer's cache is written in place
(donated), so a step reads each weight and each live k/v once.

    lp = split_params(config, params)                 # LayerParams: once, when weights arrive
    logits, (ks, vs) = forward_layers(config, lp, tokens_BxT, positions_BxT, mask, ks, vs, index_B)

``ks``/``vs`` are tuples of Y per-layer buffers: [B, S, K, H] (a contiguous cache, with a dense
mask or a CacheMask, as ``Transformer.with_cache`` takes them) or [K, NP, G, H] page pools
(with a PagedMask). Same blocks, same math as the scanned forward (tests compare them).
The cost: compile time grows with depth (one copy of the block per layer).
"""
from __future__ import annotations

from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from gyre_jax.model.config import ModelConfig
from gyre_jax.model.lora import lora_inputs
from gyre_jax.model.paged import PagedMask
from gyre_jax.model.transformer import Block, Transformer
from gyre_jax.model.tree_attention import CacheMask


class LayerParams(flax.struct.PyTreeNode):  # PyTreeNode: flax.struct.dataclass with a typed replace()
    """Params with the scanned stacks split into one tree per layer (depth order)."""

    rest: Any  # {"params": {embed, final_norm[, unembed]}}: everything outside the stacks
    layers: tuple  # ({"params": block params of layer 0}, {"params": ... of layer 1}, ...)


def split_params(config: ModelConfig, params, take: Callable[[Any, int], Any] | None = None) -> LayerParams:
    """``{"params": ...}`` from init_params (stacked layers) as LayerParams.

    ``take(leaf, i)`` gives layer i of a stacked leaf (default ``leaf[i]``); e.g. a callback
    that puts each slice on its devices at once, so the split never holds two whole copies."""
    take = take or (lambda x, i: x[i])
    p = params["params"]
    names = {name for name, *_ in config.layer_runs()}
    missing = names - set(p)
    if missing:
        raise ValueError(f"split_params: params lack the layer stacks {sorted(missing)} that config.layer_runs() names")
    layers = []
    for name, start, stop, _ in config.layer_runs():
        for i in range(stop - start):
            # every collection's stack (the base's "params", a LoRA model's "lora" adapters) cut at layer i
            layers.append({col: jax.tree.map(lambda x: take(x, i), tree[name])  # noqa: B023 - used at once
                           for col, tree in params.items() if name in tree})
    return LayerParams(rest={"params": {k: v for k, v in p.items() if k not in names}}, layers=tuple(layers))


def layer_sharding(stacked: NamedSharding) -> NamedSharding:
    """One layer's sharding from its stacked param's (the layer axis is never split over devices:
    sharding.RULES maps 'layers' to None)."""
    if stacked.spec and stacked.spec[0] is not None:
        raise ValueError(f"layer_sharding: a stacked param is split over {stacked.spec[0]!r} along its layer axis")
    return NamedSharding(stacked.mesh, PartitionSpec(*stacked.spec[1:]))


def _embed(module: Transformer, tokens_BxT):
    return module.embed_tokens(tokens_BxT)


def _head(module: Transformer, hidden_BxTxD):
    return module.head_logits(module.final_norm(hidden_BxTxD))


def forward_layers(config: ModelConfig, lp: LayerParams, tokens_BxT, positions_BxT, mask, ks: tuple, vs: tuple,
                   cache_index_B, *, with_routing: bool = False, routing_BxTxR=None, adapter_BxT=None):
    """``Transformer.with_cache`` over per-layer params and per-layer k/v buffers.

    Returns (logits_BxTxV float32, (ks, vs)) with each layer's buffer updated; with
    ``with_routing`` (an MoE model) also the experts each MoE layer chose for each token,
    int32 [B*T, MoE layers x top-k] in layer order (what the engine records for replay).
    ``routing_BxTxR``: recorded experts per token in that layout (-1: route live), used where
    ``config.routing_replay`` (model/moe.py): a recomputed cache takes its tokens' decode routing.
    ``adapter_BxT``: with several LoRA adapters, each token's (model/lora.py; a decode step: each slot's)."""
    if len(lp.layers) != config.n_layers or len(ks) != config.n_layers or len(vs) != config.n_layers:
        raise ValueError(f"forward_layers: need {config.n_layers} layers of params and of k/v, got "
                         f"{len(lp.layers)}, {len(ks)}, {len(vs)}")
    model = Transformer(config)
    x = model.apply(lp.rest, tokens_BxT, method=_embed)
    one_token = tokens_BxT.shape[1] == 1 and not isinstance(mask, (CacheMask, PagedMask))
    moe_flags = [moe for _, start, stop, moe in config.layer_runs() for _ in range(start, stop)]
    k_top = config.num_experts_per_tok
    if routing_BxTxR is not None and routing_BxTxR.shape[-1] != config.routing_width:
        raise ValueError(f"forward_layers: routing has {routing_BxTxR.shape[-1]} ids per token, the model records "
                         f"{config.routing_width} (MoE layers x top-k)")
    lora_in = lora_inputs(config.lora, config.jnp_dtype, adapter_BxT, tokens_BxT, positions_BxT)
    new_k, new_v, experts = [], [], []
    m = 0  # MoE layers so far: this layer's slice of the recorded routing
    for layer, (p, k, v, moe) in enumerate(zip(lp.layers, ks, vs, moe_flags)):
        block = Block(config, moe=moe)
        routing = None
        if moe and routing_BxTxR is not None:
            routing = routing_BxTxR[..., m * k_top:(m + 1) * k_top]
        m += int(moe)
        out: Any  # (flax types apply() loosely): the block's (carry or x, cache and MoE stats)
        if one_token:  # the decode form: the row scattered into the buffer in place, attention without a transpose
            out = block.apply(p, (x, k[None], v[None], 0), None, positions_BxT, mask,
                              cache_index_B, None, routing, lora_in)
            (x, k1, v1, _), stats = out
            k, v = k1[0], v1[0]
        else:
            out = block.apply(p, x, (k, v), positions_BxT, mask, cache_index_B, None, routing, lora_in)
            x, ((k, v), stats) = out
        new_k.append(k)
        new_v.append(v)
        if with_routing and moe:
            experts.append(stats.experts)  # [B*T, K]
    logits = model.apply(lp.rest, x, method=_head)
    if not with_routing:
        return logits, (tuple(new_k), tuple(new_v))
    if not experts:
        raise ValueError("forward_layers: with_routing on a model without MoE layers")
    return logits, (tuple(new_k), tuple(new_v)), jnp.concatenate(experts, axis=-1)
