"""Test helper: tiny random Hugging Face checkpoints in the exact on-disk layout.

Writes ``config.json`` and safetensors files with HF tensor names, ``[out, in]``
linear weights, biases/q-k norms per family, optional ``lm_head``, bf16 or f32, one
file or several plus ``model.safetensors.index.json`` -- with the ``safetensors``
library itself, so the loader under test (gyre_jax.model.hf) is checked against an
independent writer. Nothing is downloaded. Families: ``qwen2`` (q/k/v bias),
``qwen3`` (q/k norm), ``llama3`` (rope scaling ``llama3``, untied head), ``qwen3_moe``
(Qwen3 with sparse expert blocks: router ``mlp.gate`` and per-expert ``mlp.experts.{j}.*``;
the layers ``mlp_only_layers`` names keep a dense MLP).
"""
from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np

FAMILIES = ("qwen2", "qwen3", "llama3", "qwen3_moe")
ARCHS = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama3": "LlamaForCausalLM",
         "qwen3_moe": "Qwen3MoeForCausalLM"}
QK_NORM_ARCHS = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def tiny_hf_config(family: str, *, vocab_size: int = 96, hidden_size: int = 32, layers: int = 2, heads: int = 4,
                   kv_heads: int = 2, head_dim: int | None = None, intermediate_size: int = 48,
                   tie: bool | None = None, dtype: str = "float32", **extra) -> dict:
    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: expected one of {FAMILIES}")
    arch = ARCHS[family]
    cfg = {
        "architectures": [arch], "model_type": "llama" if family == "llama3" else family,
        "vocab_size": vocab_size, "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "hidden_act": "silu", "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0 if family != "llama3" else 500000.0,
        "tie_word_embeddings": (family != "llama3") if tie is None else tie, "torch_dtype": dtype,
        "bos_token_id": 1, "eos_token_id": 2,
    }
    if family == "qwen3_moe":  # 4 experts, top 2, renormalised (as Qwen3-30B-A3B: 128 experts, top 8)
        cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                   mlp_only_layers=[], decoder_sparse_step=1, router_aux_loss_coef=0.001,
                   output_router_logits=False)
    if family in ("qwen3", "qwen3_moe") or head_dim is not None:
        cfg["head_dim"] = head_dim or 2 * hidden_size // heads  # Qwen3 decouples head_dim from hidden/heads
    if family in ("qwen3", "llama3", "qwen3_moe"):
        cfg["attention_bias"] = False
    if family == "llama3":
        cfg["mlp_bias"] = False
        # Short original context so the test's positions cross all three frequency bands.
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    else:
        cfg["use_sliding_window"] = False
    cfg.update(extra)
    return cfg


def tiny_hf_tensors(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 tensors of the HF layout for ``cfg`` (norm scales near 1, biases non-zero)."""
    rng = np.random.default_rng(seed)
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    n, k = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    h = cfg.get("head_dim") or d // n
    arch = cfg["architectures"][0]

    def w(*shape, scale=None):
        return (rng.standard_normal(shape) * (scale or shape[-1] ** -0.5)).astype(np.float32)

    def norm(m):
        return (1.0 + 0.1 * rng.standard_normal(m)).astype(np.float32)

    t = {"model.embed_tokens.weight": w(v, d, scale=1.0), "model.norm.weight": norm(d)}
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = w(v, d)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(d)
        t[p + "post_attention_layernorm.weight"] = norm(d)
        t[p + "self_attn.q_proj.weight"] = w(n * h, d)
        t[p + "self_attn.k_proj.weight"] = w(k * h, d)
        t[p + "self_attn.v_proj.weight"] = w(k * h, d)
        t[p + "self_attn.o_proj.weight"] = w(d, n * h)
        if is_moe_layer(cfg, i):
            e, fe = cfg["num_experts"], cfg["moe_intermediate_size"]
            t[p + "mlp.gate.weight"] = w(e, d, scale=1.0)  # a sharp router: top-k choices far from ties
            for j in range(e):
                t[p + f"mlp.experts.{j}.gate_proj.weight"] = w(fe, d)
                t[p + f"mlp.experts.{j}.up_proj.weight"] = w(fe, d)
                t[p + f"mlp.experts.{j}.down_proj.weight"] = w(d, fe)
        else:
            t[p + "mlp.gate_proj.weight"] = w(f, d)
            t[p + "mlp.up_proj.weight"] = w(f, d)
            t[p + "mlp.down_proj.weight"] = w(d, f)
        if arch == "Qwen2ForCausalLM":
            for name, m in (("q", n), ("k", k), ("v", k)):
                t[p + f"self_attn.{name}_proj.bias"] = (0.5 * rng.standard_normal(m * h)).astype(np.float32)
        if arch in QK_NORM_ARCHS:
            t[p + "self_attn.q_norm.weight"] = norm(h)
            t[p + "self_attn.k_norm.weight"] = norm(h)
    return t


def is_moe_layer(cfg: dict, i: int) -> bool:
    """transformers' Qwen3MoeDecoderLayer rule for a sparse block at layer i."""
    return (cfg.get("num_experts", 0) > 0 and i not in (cfg.get("mlp_only_layers") or [])
            and (i + 1) % cfg.get("decoder_sparse_step", 1) == 0)


def write_tiny_hf_checkpoint(path: str, family: str, *, seed: int = 0, num_shards: int = 1,
                             **config_overrides) -> tuple[dict, dict[str, np.ndarray]]:
    """Write a checkpoint into ``path``; returns (config dict, tensors as stored, as float32 numpy)."""
    from safetensors.numpy import save_file

    cfg = tiny_hf_config(family, **config_overrides)
    tensors = tiny_hf_tensors(cfg, seed)
    store_dt = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[cfg["torch_dtype"]]
    stored = {n: a.astype(store_dt) for n, a in tensors.items()}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
    names = list(stored)
    if num_shards == 1:
        save_file(stored, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    else:
        parts = np.array_split(np.arange(len(names)), num_shards)
        weight_map = {}
        for j, idx in enumerate(parts):
            fn = f"model-{j + 1:05d}-of-{num_shards:05d}.safetensors"
            save_file({names[q]: stored[names[q]] for q in idx}, os.path.join(path, fn), metadata={"format": "pt"})
            weight_map.update({names[q]: fn for q in idx})
        total = sum(a.nbytes for a in stored.values())
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
    return cfg, {n: a.astype(np.float32) for n, a in stored.items()}
