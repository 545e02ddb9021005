"""Small overflow-safe pieces the losses share (jax.numpy, traceable)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

MAX_LOG_RATIO_CLAMP = 80.0  # exp(80) ~ 5.5e34: float32 headroom (exp(88.8) overflows)


def finite_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_number(where: str, name: str, v, *, lo=None, hi=None, lo_open=False, hi_open=False, none_ok=False):
    """``v`` a finite number in the given range (``None`` allowed with ``none_ok``), else ValueError naming it."""
    if v is None and none_ok:
        return
    ok = finite_number(v)
    if ok and lo is not None:
        ok = v > lo if lo_open else v >= lo
    if ok and hi is not None:
        ok = v < hi if hi_open else v <= hi
    if not ok:
        lb = "" if lo is None else ("(" if lo_open else "[") + f"{lo:g}"
        ub = "" if hi is None else f"{hi:g}" + (")" if hi_open else "]")
        rng = f" in {lb or '(-inf'}, {ub or 'inf)'}" if (lo is not None or hi is not None) else ""
        raise ValueError(f"{where}{name} must be a finite number{rng}, got {v!r}")


def safe_exp(x, clamp: float):
    """``exp(x)`` for ``x <= clamp``; beyond it the tangent line ``e^C (1 + x - C)``.

    Equal to ``exp`` wherever a healthy run is, continuous with a continuous first
    derivative at ``C``, and finite (value and gradient) for any finite ``x``, where
    plain ``exp`` overflows float32 at 88.7. For ``x -> -inf`` it is 0 like ``exp``.
    """
    e = jnp.exp(jnp.minimum(x, clamp))
    return jnp.where(x > clamp, e * (1.0 + (x - clamp)), e)


def k3_of_log_ratio(log_r, clamp: float):
    """``r - 1 - log r`` with ``r = safe_exp(log_r)``: Schulman's k3 estimate of KL(q || p)
    for samples of q and ``log_r = log p - log q``; >= 0, finite for finite ``log_r``."""
    return safe_exp(log_r, clamp) - 1.0 - log_r


def sequence_sum(x_BxT, active_BxT, sequence_ids_BxT):
    """Per token: the sum of ``x`` over the active tokens of its sequence (ids in [0, B*T)).

    The batch must hold whole sequences (each id's tokens all here). Inactive tokens
    get the sum of their id's sequence too; callers mask them.
    """
    n = x_BxT.size
    ids = jnp.clip(sequence_ids_BxT.reshape(-1).astype(jnp.int32), 0, n - 1)
    vals = jnp.where(active_BxT, x_BxT, 0.0).reshape(-1)
    sums = jax.ops.segment_sum(vals, ids, num_segments=n)
    return sums[ids].reshape(x_BxT.shape)


def sequence_mean(x_BxT, active_BxT, sequence_ids_BxT):
    """Per token: the mean of ``x`` over the active tokens of its sequence (0 if it has none)."""
    total = sequence_sum(x_BxT, active_BxT, sequence_ids_BxT)
    count = sequence_sum(jnp.ones_like(x_BxT), active_BxT, sequence_ids_BxT)
    return total / jnp.maximum(count, 1.0)
