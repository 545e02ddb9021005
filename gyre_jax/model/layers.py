"""Building blocks of a Llama/Qwen-family decoder: RMSNorm, RoPE, SwiGLU MLP.

Every parameter carries logical axis names (nn.with_logical_partitioning); the
mapping from logical names to mesh axes lives with the cells, not here.
"""
from __future__ import annotations

import functools
import math
from typing import cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from gyre_jax.model import lora as lora_lib
from gyre_jax.model.config import ModelConfig


# Fan-in scaled normal init: a tiny random model trains from step one and real
# checkpoints overwrite it anyway.
def dense_init(fan_in: int):
    return nn.initializers.normal(stddev=fan_in**-0.5)


def dense_param(module: nn.Module, name: str, shape, axes, fan_in: int):
    """A weight of ``module`` (dense_init, logical axes for the sharding rules), stored in the
    config's param dtype and cast to its compute dtype: every block's weights are made this way."""
    cfg = module.config  # type: ignore[attr-defined]  # every model block carries its ModelConfig
    w = module.param(name, nn.with_logical_partitioning(dense_init(fan_in), axes), shape, cfg.jnp_param_dtype)
    return cast(jax.Array, w).astype(cfg.jnp_dtype)  # flax hands back the unboxed array, not the partitioning box


class RMSNorm(nn.Module):
    """x / rms(x) * scale over the last axis, computed in float32 (bfloat16 variance is too coarse).

    Over d_model by default; ``head_dim=True`` normalizes each head's q or k vector
    (Qwen3's q_norm/k_norm: one [H] scale shared by all heads).
    """

    config: ModelConfig
    head_dim: bool = False

    @nn.compact
    def __call__(self, x_BxLxD):
        cfg = self.config
        width, axis = (cfg.head_dim, "head_dim") if self.head_dim else (cfg.d_model, "embed")
        scale_D = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones, (axis,)),
            (width,),
            cfg.jnp_param_dtype,
        )
        x = x_BxLxD.astype(jnp.float32)
        var = jnp.mean(x * x, axis=-1, keepdims=True)
        y = x * jax.lax.rsqrt(var + cfg.norm_eps) * scale_D.astype(jnp.float32)
        return y.astype(cfg.jnp_dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """[H/2] inverse frequencies (float64, host): theta^(-2k/H), then the config's scaling.

    ``llama3`` follows HF's ``_compute_llama3_parameters``: wavelengths longer than
    original_max_len/low_freq_factor are divided by ``factor``, shorter than
    original_max_len/high_freq_factor kept, and those between interpolated.
    """
    h = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
    if cfg.rope_scaling == "none":
        return inv
    factor, lo, hi, old = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_len
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return np.where(medium, smoothed, scaled)


def rope(x_BxLxNxH, positions_BxL, theta: float, *, inv_freq_F=None):
    """Rotary embedding at explicit per-token positions (tree positions work as is).

    Uses the "rotate half" layout of HF Llama/Qwen (pairs (k, k + H/2)), so their
    q/k projection weights load without a permutation. ``inv_freq_F`` (from
    ``rope_inv_freq``) overrides the plain ``theta`` frequencies (rope scaling).
    """
    h = x_BxLxNxH.shape[-1]
    if inv_freq_F is None:
        inv_freq_F = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    inv_freq_F = jnp.asarray(inv_freq_F, jnp.float32)
    angle_BxLxF = positions_BxL.astype(jnp.float32)[..., None] * inv_freq_F
    cos = jnp.cos(angle_BxLxF)[:, :, None, :]
    sin = jnp.sin(angle_BxLxF)[:, :, None, :]
    x = x_BxLxNxH.astype(jnp.float32)
    x1, x2 = x[..., : h // 2], x[..., h // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxNxH.dtype)


def project(module: nn.Module, name: str, x, w, spec: str, n_in: int, in_shape, in_axes, out_shape, out_axes,
            lora_in=None):
    """``einsum(spec, x, w)``, plus the projection's LoRA update when ``config.lora`` adapts it (model/lora.py)."""
    y = jnp.einsum(spec, x, w)
    ab = lora_lib.adapter_weights(module, name, in_shape, in_axes, out_shape, out_axes)
    if ab is None:
        return y
    return y + lora_lib.delta(module, x, ab, lora_in, n_in).astype(y.dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); LoRA on any of the three (``lora_in``: model/lora.py)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x_BxLxD, lora_in=None):
        cfg = self.config
        dt = cfg.jnp_dtype
        d, f = cfg.d_model, cfg.d_ff

        gate_DxF = dense_param(self, "gate", (d, f), ("embed", "mlp"), d)
        up_DxF = dense_param(self, "up", (d, f), ("embed", "mlp"), d)
        down_FxD = dense_param(self, "down", (f, d), ("mlp", "embed"), f)
        x = x_BxLxD.astype(dt)
        if cfg.lora is None:
            h_BxLxF = nn.silu(x @ gate_DxF) * (x @ up_DxF)
            return h_BxLxF @ down_FxD
        into = functools.partial(project, self, spec="bld,df->blf", n_in=1, in_shape=(d,), in_axes=("embed",),
                                 out_shape=(f,), out_axes=("mlp",), lora_in=lora_in)
        h_BxLxF = nn.silu(into("gate", x, gate_DxF)) * into("up", x, up_DxF)
        return project(self, "down", h_BxLxF, down_FxD, "blf,fd->bld", 1, (f,), ("mlp",), (d,), ("embed",), lora_in)
