"""Model configuration: one frozen, validated dataclass.

Field names follow the Llama/Qwen family so a real checkpoint's config maps onto
it one field at a time (hidden_size -> d_model, intermediate_size -> d_ff, ...).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int  # grouped-query attention: n_heads // n_kv_heads query heads share one k/v head
    head_dim: int
    d_ff: int  # SwiGLU hidden width
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True  # unembedding = embedding.T (Qwen small models, Gemma) or its own matrix (Llama)
    dtype: str = "float32"  # activations and matmul inputs; softmax, norms and logits stay float32
    param_dtype: str = "float32"  # stored parameters
    max_seq_len: int = 4096  # longest path position the model is meant to see; default KV-cache length
    remat: bool = False  # recompute each layer's activations in the backward pass (long rows)

    def __post_init__(self):
        where = "ModelConfig"
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "max_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{where}.{name} must be a positive int, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"{where}: n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"{where}.head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"{where}.rope_theta must be > 0, got {self.rope_theta}")
        if not self.norm_eps > 0:
            raise ValueError(f"{where}.norm_eps must be > 0, got {self.norm_eps}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"{where}.{name} must be one of {sorted(_DTYPES)}, got {getattr(self, name)!r}")

    @property
    def jnp_dtype(self):
        return _DTYPES[self.dtype]

    @property
    def jnp_param_dtype(self):
        return _DTYPES[self.param_dtype]

    @property
    def q_per_kv(self) -> int:
        return self.n_heads // self.n_kv_heads

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def model_config_tiny(**overrides) -> ModelConfig:
    """A model small enough for unit tests on CPU (a few ms per forward pass)."""
    base = dict(
        vocab_size=128,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        d_ff=64,
        max_seq_len=256,
    )
    base.update(overrides)
    return ModelConfig(**base)
