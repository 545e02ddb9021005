"""Hugging Face ``config.json`` <-> ``ModelConfig`` for the dense Llama/Qwen families.

Supported: ``Qwen2ForCausalLM`` (Qwen2, Qwen2.5: q/k/v bias), ``Qwen3ForCausalLM`` (q/k
RMSNorm over head_dim, no bias), ``Qwen3MoeForCausalLM`` (Qwen3 with sparse expert blocks,
hf/moe_config.py) and ``LlamaForCausalLM`` (Llama-3.x, plain or ``llama3``
rope scaling). Anything the model here does not compute (sliding windows, other MoE families, other
rope scalings, MLP or output-projection biases, another activation) raises
``UnsupportedCheckpoint`` naming the field, instead of loading a model that computes
something else.
"""
from __future__ import annotations

from typing import Any

from gyre_jax.model.config import ModelConfig
from gyre_jax.model.hf.moe_config import MOE_FAMILY, moe_from_hf, moe_to_hf

ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama",
                 "Qwen3MoeForCausalLM": MOE_FAMILY}
_DTYPE_NAMES = {"bfloat16": "bfloat16", "float32": "float32", "float16": "float16",
                "torch.bfloat16": "bfloat16", "torch.float32": "float32", "torch.float16": "float16"}


class UnsupportedCheckpoint(ValueError):
    """A checkpoint this model cannot compute faithfully (the message names the field or tensor)."""


def source_dtype(hf: dict[str, Any], where: str = "config.json") -> str | None:
    """The dtype config.json gives its tensors, or None if it names none.

    transformers >= 4.56 writes ``dtype``; older files (and our export, for older servers) ``torch_dtype``.
    """
    raw = hf.get("dtype") or hf.get("torch_dtype")
    if raw is None:
        return None
    name = _DTYPE_NAMES.get(str(raw))
    if name is None:
        key = "dtype" if hf.get("dtype") else "torch_dtype"
        raise UnsupportedCheckpoint(f"{where}: {key}={raw!r} is not supported; supported: bfloat16, float16, float32")
    return name


def family_of(hf: dict[str, Any], where: str = "config.json") -> str:
    archs = hf.get("architectures") or []
    known = [a for a in archs if a in ARCHITECTURES]
    if not known:
        raise UnsupportedCheckpoint(
            f"{where}: architectures={archs!r} (model_type={hf.get('model_type')!r}) is not supported; "
            f"supported: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[known[0]]


def _rope_params(hf: dict[str, Any]) -> tuple[float, dict | None]:
    """(theta, scaling dict or None) from either the classic or the transformers-v5 layout."""
    rp = hf.get("rope_parameters")
    scaling = hf.get("rope_scaling")
    theta = hf.get("rope_theta")
    if isinstance(rp, dict):
        theta = rp.get("rope_theta", theta)
        scaling = scaling or rp
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    return float(theta if theta is not None else 10000.0), scaling


def config_from_hf(hf: dict[str, Any], *, dtype: str | None = None, vocab_pad_multiple: int = 1,
                   max_seq_len: int | None = None, where: str = "config.json") -> ModelConfig:
    """ModelConfig of a checkpoint's config.json (dtype: the params' dtype; default the file's)."""
    fam = family_of(hf, where)

    def need(key):
        if key not in hf:
            raise UnsupportedCheckpoint(f"{where}: required field {key!r} is missing")
        return hf[key]

    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedCheckpoint(f"{where}: hidden_act={hf['hidden_act']!r}; only 'silu' (SwiGLU) is supported")
    if hf.get("use_sliding_window"):
        raise UnsupportedCheckpoint(f"{where}: use_sliding_window=true is not supported (full attention only)")
    if hf.get("mlp_bias"):
        raise UnsupportedCheckpoint(f"{where}: mlp_bias=true is not supported")
    if fam != "qwen2" and hf.get("attention_bias"):
        raise UnsupportedCheckpoint(f"{where}: attention_bias=true ({fam}: biases on q/k/v and o) is not supported")
    theta, scaling = _rope_params(hf)
    rope: dict[str, Any] = {}
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "llama3":
            raise UnsupportedCheckpoint(f"{where}: rope_scaling type {kind!r} is not supported; supported: llama3")
        rope = dict(rope_scaling="llama3", rope_factor=float(scaling["factor"]),
                    rope_low_freq_factor=float(scaling["low_freq_factor"]),
                    rope_high_freq_factor=float(scaling["high_freq_factor"]),
                    rope_original_max_len=int(scaling["original_max_position_embeddings"]))
    d, n = int(need("hidden_size")), int(need("num_attention_heads"))
    dt = dtype or source_dtype(hf, where) or "float32"
    try:
        moe = moe_from_hf(hf, where) if fam == MOE_FAMILY else {}
        return ModelConfig(
            vocab_size=int(need("vocab_size")), d_model=d, n_layers=int(need("num_hidden_layers")), n_heads=n,
            n_kv_heads=int(hf.get("num_key_value_heads") or n), head_dim=int(hf.get("head_dim") or d // n),
            d_ff=int(need("intermediate_size")), rope_theta=theta, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            # Absent, transformers' Qwen2, Qwen3 and Llama configs all default it to False (untied).
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)), dtype=dt, param_dtype=dt,
            max_seq_len=int(max_seq_len or hf.get("max_position_embeddings") or 4096),
            qkv_bias=fam == "qwen2", qk_norm=fam in ("qwen3", MOE_FAMILY), vocab_pad_multiple=vocab_pad_multiple,
            **rope, **moe)
    except ValueError as e:
        raise UnsupportedCheckpoint(f"{where}: {e}") from None


def family_of_config(cfg: ModelConfig) -> str:
    """The HF family a ModelConfig exports as (its features pick it)."""
    if cfg.qkv_bias and cfg.qk_norm:
        raise UnsupportedCheckpoint("ModelConfig has both qkv_bias and qk_norm: no HF family computes that")
    if cfg.num_experts > 0:
        if not cfg.qk_norm or cfg.qkv_bias:
            raise UnsupportedCheckpoint("ModelConfig: an MoE model exports as Qwen3-MoE, which needs qk_norm=True "
                                        "and qkv_bias=False")
        return MOE_FAMILY
    return "qwen2" if cfg.qkv_bias else "qwen3" if cfg.qk_norm else "llama"


def hf_config(cfg: ModelConfig, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json for ``cfg``: ``base`` (the source checkpoint's, to keep token ids etc.) with our fields set."""
    fam = family_of_config(cfg)
    arch = {v: k for k, v in ARCHITECTURES.items()}[fam]
    out = dict(base or {})
    for k in ("rope_parameters", "dtype"):  # rewritten below in the classic layout
        out.pop(k, None)
    out.update(
        architectures=[arch], model_type=fam, vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, hidden_act="silu", rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings, torch_dtype=cfg.param_dtype,
        max_position_embeddings=out.get("max_position_embeddings", cfg.max_seq_len))
    out["rope_scaling"] = None if cfg.rope_scaling == "none" else dict(
        rope_type="llama3", factor=cfg.rope_factor, low_freq_factor=cfg.rope_low_freq_factor,
        high_freq_factor=cfg.rope_high_freq_factor, original_max_position_embeddings=cfg.rope_original_max_len)
    if fam == MOE_FAMILY:
        out.pop("num_local_experts", None)  # transformers 5.x's name for it: num_experts below is read by all
        out.update(moe_to_hf(cfg, base or {}))
    if fam != "qwen2":
        out["attention_bias"] = False
    if fam == "llama":
        out["mlp_bias"] = False
    else:
        out["use_sliding_window"] = False
    return out
