"""Qwen3-MoE's config.json fields <-> ModelConfig's MoE fields (the names are the same).

The expert count has two spellings: published checkpoints (and transformers 4.x) say
``num_experts``; transformers 5.x keeps the attribute as ``num_local_experts``
(``Qwen3MoeConfig.attribute_map``), so a config it saves says that. We read either (both must
agree when both are there) and write ``num_experts``: 4.x reads only that name, and 5.x maps it
onto ``num_local_experts`` when it loads.

``Qwen3MoeForCausalLM`` is Qwen3 (q/k RMSNorm, no biases) whose feed-forward is a sparse
block in the layers ``mlp_only_layers`` / ``decoder_sparse_step`` select; the other layers
keep a dense MLP of ``intermediate_size``. Tensors: gyre_jax/model/hf/tensors.py (moe_entries).
"""
from __future__ import annotations

from typing import Any

from gyre_jax.model.config import ModelConfig

MOE_FAMILY = "qwen3_moe"
# HF fields that change what the model computes; a Qwen3-MoE config.json must have these (the expert
# count under either of its names, EXPERT_COUNT_KEYS).
_REQUIRED = ("num_experts_per_tok", "moe_intermediate_size")
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts")  # published / transformers 5.x's saved name


def expert_count(hf: dict[str, Any], where: str) -> int:
    """The expert count of a Qwen3-MoE config.json, whichever name it is under (ValueError if none, or two that
    disagree)."""
    found = {k: hf[k] for k in EXPERT_COUNT_KEYS if hf.get(k) is not None}
    if not found:
        raise ValueError(f"{where}: Qwen3-MoE config needs the expert count ({' or '.join(EXPERT_COUNT_KEYS)})")
    if len({int(v) for v in found.values()}) > 1:
        raise ValueError(f"{where}: Qwen3-MoE config gives two expert counts: {found}")
    return int(next(iter(found.values())))


def moe_from_hf(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """ModelConfig keyword arguments of a Qwen3-MoE config.json (UnsupportedCheckpoint-worthy errors as ValueError)."""
    missing = [k for k in _REQUIRED if k not in hf]
    if missing:
        raise ValueError(f"{where}: Qwen3-MoE config needs {missing}")
    return dict(num_experts=expert_count(hf, where), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(hf["moe_intermediate_size"]),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),  # transformers' Qwen3MoeConfig default
                mlp_only_layers=tuple(int(i) for i in (hf.get("mlp_only_layers") or ())),
                decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
                # transformers adds the load-balancing loss only with output_router_logits=true; so do we.
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)) if hf.get("output_router_logits")
                else 0.0)


def moe_to_hf(cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
    """The config.json fields of cfg's MoE block (``base``: the source's, whose coefficient stays when ours is off).
    The expert count goes under ``num_experts``, the name every transformers version reads (module docstring);
    the caller drops a source's ``num_local_experts``."""
    on = cfg.router_aux_loss_coef > 0
    return dict(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                mlp_only_layers=list(cfg.mlp_only_layers), decoder_sparse_step=cfg.decoder_sparse_step,
                router_aux_loss_coef=cfg.router_aux_loss_coef if on else base.get("router_aux_loss_coef", 0.001),
                output_router_logits=on)
