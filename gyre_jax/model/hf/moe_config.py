"""Qwen3-MoE's config.json fields <-> ModelConfig's MoE fields (the names are the same).

``Qwen3MoeForCausalLM`` is Qwen3 (q/k RMSNorm, no biases) whose feed-forward is a sparse
block in the layers ``mlp_only_layers`` / ``decoder_sparse_step`` select; the other layers
keep a dense MLP of ``intermediate_size``. Tensors: gyre_jax/model/hf/tensors.py (moe_entries).
"""
from __future__ import annotations

from typing import Any

from gyre_jax.model.config import ModelConfig

MOE_FAMILY = "qwen3_moe"
# HF fields that change what the model computes; a Qwen3-MoE config.json must have the first three.
_REQUIRED = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


def moe_from_hf(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """ModelConfig keyword arguments of a Qwen3-MoE config.json (UnsupportedCheckpoint-worthy errors as ValueError)."""
    missing = [k for k in _REQUIRED if k not in hf]
    if missing:
        raise ValueError(f"{where}: Qwen3-MoE config needs {missing}")
    return dict(num_experts=int(hf["num_experts"]), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(hf["moe_intermediate_size"]),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),  # transformers' Qwen3MoeConfig default
                mlp_only_layers=tuple(int(i) for i in (hf.get("mlp_only_layers") or ())),
                decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
                # transformers adds the load-balancing loss only with output_router_logits=true; so do we.
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)) if hf.get("output_router_logits")
                else 0.0)


def moe_to_hf(cfg: ModelConfig, base: dict[str, Any]) -> dict[str, Any]:
    """The config.json fields of cfg's MoE block (``base``: the source's, whose coefficient stays when ours is off)."""
    on = cfg.router_aux_loss_coef > 0
    return dict(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                mlp_only_layers=list(cfg.mlp_only_layers), decoder_sparse_step=cfg.decoder_sparse_step,
                router_aux_loss_coef=cfg.router_aux_loss_coef if on else base.get("router_aux_loss_coef", 0.001),
                output_router_logits=on)
