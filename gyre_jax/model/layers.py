"""Building blocks of a Llama/Qwen-family decoder: RMSNorm, RoPE, SwiGLU MLP.

Every parameter carries logical axis names (nn.with_logical_partitioning); the
mapping from logical names to mesh axes lives with the cells, not here.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from gyre_jax.model.config import ModelConfig

# Fan-in scaled normal init: a tiny random model trains from step one and real
# checkpoints overwrite it anyway.
def dense_init(fan_in: int):
    return nn.initializers.normal(stddev=fan_in**-0.5)


class RMSNorm(nn.Module):
    """x / rms(x) * scale, computed in float32 (bfloat16 variance is too coarse)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x_BxLxD):
        cfg = self.config
        scale_D = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
            (cfg.d_model,),
            cfg.jnp_param_dtype,
        )
        x = x_BxLxD.astype(jnp.float32)
        var = jnp.mean(x * x, axis=-1, keepdims=True)
        y = x * jax.lax.rsqrt(var + cfg.norm_eps) * scale_D.astype(jnp.float32)
        return y.astype(cfg.jnp_dtype)


def rope(x_BxLxNxH, positions_BxL, theta: float):
    """Rotary embedding at explicit per-token positions (tree positions work as is).

    Uses the "rotate half" layout of HF Llama/Qwen (pairs (k, k + H/2)), so their
    q/k projection weights load without a permutation.
    """
    h = x_BxLxNxH.shape[-1]
    inv_freq_F = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    angle_BxLxF = positions_BxL.astype(jnp.float32)[..., None] * inv_freq_F
    cos = jnp.cos(angle_BxLxF)[:, :, None, :]
    sin = jnp.sin(angle_BxLxF)[:, :, None, :]
    x = x_BxLxNxH.astype(jnp.float32)
    x1, x2 = x[..., : h // 2], x[..., h // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxNxH.dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x_BxLxD):
        cfg = self.config
        dt = cfg.jnp_dtype

        def w(name, shape, axes, fan_in):
            return self.param(
                name, nn.with_logical_partitioning(dense_init(fan_in), axes), shape, cfg.jnp_param_dtype
            ).astype(dt)

        gate_DxF = w("gate", (cfg.d_model, cfg.d_ff), ("embed", "mlp"), cfg.d_model)
        up_DxF = w("up", (cfg.d_model, cfg.d_ff), ("embed", "mlp"), cfg.d_model)
        down_FxD = w("down", (cfg.d_ff, cfg.d_model), ("mlp", "embed"), cfg.d_ff)
        x = x_BxLxD.astype(dt)
        h_BxLxF = nn.silu(x @ gate_DxF) * (x @ up_DxF)
        return h_BxLxF @ down_FxD
