"""Per-token log-probs and entropies from logits, without a float32 copy of the logits.

Vocab-sized arrays dominate memory in LLM training: for B*L = 64K tokens and
V = 152K, bf16 logits are 20 GB and an f32 copy 40 GB more. So the functions
here never materialise an upcast [B, L, V] array:

* forward: ``max`` is exact in the logits' dtype; the sums ``sum(exp(f32(x) -
  m))`` (and ``sum(p * f32(x))`` for entropy) walk the vocab in chunks, so at
  most one [B, L, vocab_chunk_size] float32 block exists at a time. The target
  logit is a gather of one element per token.
* backward: a ``jax.custom_vjp`` keeps only the input logits (already alive)
  and the [B, L] statistics as residuals, and writes the gradient directly in
  the logits' dtype from one fused elementwise expression. Plain autodiff would
  instead save ``exp(f32(x) - m)``, an f32 [B, L, V] residual.
* ``chunked_token_logprobs`` goes from hidden states and the unembedding
  matrix, scanning over sequence chunks with rematerialisation, so full logits
  never exist, forward or backward.

Masked positions may hold garbage (-inf, huge values): a zero cotangent gives
an exactly zero gradient row (selected, not multiplied), so NaNs computed from
garbage never leak into gradients.

Forward-mode differentiation (``jax.jvp``) is not supported by the custom VJPs;
reverse mode (``jax.grad``, ``jax.vjp``), ``jit`` and ``vmap`` are.
"""
from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp

_F32 = jnp.float32
DEFAULT_VOCAB_CHUNK = 8192


# XLA:CPU has no bfloat16 gather or dynamic-slice: its float-normalization pass
# upcasts the *whole operand* to f32 first, i.e. a full f32 copy of the logits.
# Moving data as uint16 bits and widening only the selected elements (bf16 is
# the top half of an f32, so the shift is exact, inf/NaN included) avoids it.
# (Measured on XLA:CPU: a bf16 forward compiled alone still keeps one bf16-sized
# uint16 view for the loop; inside value_and_grad only one f32 chunk remains.)
def _storage(x):
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype == jnp.bfloat16 else x


def _widen(stored, dtype):
    if dtype == jnp.bfloat16:
        return jax.lax.bitcast_convert_type(stored.astype(jnp.uint32) << 16, _F32)
    return stored.astype(_F32)


def _vocab_stats(logits_BxLxV, vocab_chunk, with_entropy):
    """(lse, entropy or None) per position in float32, reading the logits chunk by chunk.

    With ``m = max_v x_v`` (exact in the logits' dtype), ``e_v = exp(x_v - m)``:
    ``s = sum_v e_v``, ``t = sum_v e_v (x_v - m)``; then ``lse = m + log s`` and
    ``sum_v p_v x_v = m + t / s``, so ``H = lse - sum_v p_v x_v = log s - t / s``.
    The vocab axis is walked in chunks of ``vocab_chunk`` by a loop, so the
    float32 working set is one [..., vocab_chunk] block on every backend
    (XLA:CPU does not fuse an upcast into a reduction; GPU/TPU would, but a
    loop needs no compiler luck).
    """
    v = logits_BxLxV.shape[-1]
    m = jnp.max(logits_BxLxV, axis=-1)
    # A row of -inf (garbage at a masked position) would give inf - inf = NaN in
    # every term; shift by 0 instead so the row's statistics stay -inf/0.
    m_f32 = jnp.where(jnp.isfinite(m), m.astype(_F32), 0.0)

    dtype = logits_BxLxV.dtype
    bits = _storage(logits_BxLxV)

    def chunk_sums(bits_chunk):
        z = _widen(bits_chunk, dtype) - m_f32[..., None]
        e = jnp.exp(z)
        s = jnp.sum(e, axis=-1)
        t = jnp.sum(jnp.where(e > 0, e * z, 0.0), axis=-1) if with_entropy else jnp.zeros_like(s)
        return s, t

    c = v if vocab_chunk is None else min(int(vocab_chunk), v)
    n_full = v // c
    if n_full == 1 and c == v:
        s, t = chunk_sums(bits)
    else:
        def body(i, acc):
            ds, dt = chunk_sums(jax.lax.dynamic_slice_in_dim(bits, i * c, c, axis=-1))
            return acc[0] + ds, acc[1] + dt

        zero = jnp.zeros(logits_BxLxV.shape[:-1], _F32)
        s, t = jax.lax.fori_loop(0, n_full, body, (zero, zero))
        if n_full * c < v:
            ds, dt = chunk_sums(bits[..., n_full * c :])
            s, t = s + ds, t + dt
    log_s = jnp.log(s)
    lse = m_f32 + log_s
    ent = log_s - t / s if with_entropy else None
    return lse, ent


# Shape and dtype contracts are chex assertions (AssertionError naming the
# argument); they run at trace time only, on static shapes.
def _check_logits(name, logits):
    chex.assert_type(logits, float, custom_message=f"{name}: logits must be floating point [..., V]")
    if logits.ndim < 1:
        raise ValueError(f"{name}: logits must be [..., V], got a scalar")


def _check_logits_targets(name, logits, targets):
    _check_logits(name, logits)
    chex.assert_shape(
        targets, logits.shape[:-1], custom_message=f"{name}: targets must have the logits' shape without the vocab axis"
    )
    chex.assert_type(targets, int, custom_message=f"{name}: targets must be integer token ids")


def _check_chunk(name, vocab_chunk_size):
    if vocab_chunk_size is not None and (not isinstance(vocab_chunk_size, int) or vocab_chunk_size < 1):
        raise ValueError(f"{name}: vocab_chunk_size must be a positive int or None, got {vocab_chunk_size!r}")


def _target_in_range(targets_BxL, v):
    return (targets_BxL >= 0) & (targets_BxL < v)


def _target_logit_f32(logits_BxLxV, targets_BxL):
    """x[..., t] in float32; NaN where ``t`` is outside ``[0, V)`` (no wrap, no clamp)."""
    ok = _target_in_range(targets_BxL, logits_BxLxV.shape[-1])
    t = jnp.where(ok, targets_BxL, 0)[..., None].astype(jnp.int32)
    picked = jnp.take_along_axis(_storage(logits_BxLxV), t, axis=-1)[..., 0]
    return jnp.where(ok, _widen(picked, logits_BxLxV.dtype), jnp.nan)


# One custom VJP serves logprobs, entropy and both: residuals are the logits
# (alive anyway), targets and [B, L] statistics; the backward is one fused
# elementwise expression written straight into the logits' dtype.
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _logp_ent(logits_BxLxV, targets_BxL, vocab_chunk, want_logp, want_ent):
    return _logp_ent_fwd(logits_BxLxV, targets_BxL, vocab_chunk, want_logp, want_ent)[0]


def _logp_ent_fwd(logits_BxLxV, targets_BxL, vocab_chunk, want_logp, want_ent):
    lse_BxL, ent_BxL = _vocab_stats(logits_BxLxV, vocab_chunk, want_ent)
    logp_BxL = _target_logit_f32(logits_BxLxV, targets_BxL) - lse_BxL if want_logp else None
    return (logp_BxL, ent_BxL), (logits_BxLxV, targets_BxL, lse_BxL, ent_BxL)


def _logp_ent_bwd(vocab_chunk, want_logp, want_ent, res, g):
    logits_BxLxV, targets_BxL, lse_BxL, ent_BxL = res
    g_logp, g_ent = g
    x = logits_BxLxV.astype(_F32)
    logp_v = x - lse_BxL[..., None]
    p = jnp.exp(logp_v)
    d = jnp.zeros_like(p)
    nonzero = jnp.zeros(p.shape, bool)
    if want_logp:
        # d logp / dx_v = 1[v == t] - p_v
        gl = g_logp[..., None].astype(_F32)
        nonzero = nonzero | (gl != 0)
        # The forward is NaN at an out-of-range target: so is its gradient row
        # (still exactly 0 below where the cotangent is 0).
        gl = jnp.where(_target_in_range(targets_BxL, x.shape[-1])[..., None], gl, jnp.nan)
        onehot = jnp.arange(x.shape[-1], dtype=jnp.int32) == targets_BxL[..., None].astype(jnp.int32)
        d = d + gl * (onehot.astype(_F32) - p)
    if want_ent:
        # dH/dx_v = -p_v (log p_v + H); a p_v == 0 term is 0 even where log p_v = -inf.
        ge = g_ent[..., None].astype(_F32)
        d = d + jnp.where(p > 0, -ge * p * (logp_v + ent_BxL[..., None]), 0.0)
        nonzero = nonzero | (ge != 0)
    # Select, not multiply: a zero cotangent (a masked token) gives exactly 0 even
    # where garbage logits made p NaN, so no NaN leaks into the gradient.
    d = jnp.where(nonzero, d, 0.0)
    return d.astype(logits_BxLxV.dtype), None


_logp_ent.defvjp(_logp_ent_fwd, _logp_ent_bwd)


def token_logprobs(
    logits_BxLxV: jax.Array, targets_BxL: jax.Array, *, vocab_chunk_size: int | None = DEFAULT_VOCAB_CHUNK
) -> jax.Array:
    """Log-probability of each target token, in float32.

    ``logp[b, l] = x[b, l, t] - log sum_v exp(x[b, l, v])`` with ``x = logits``,
    ``t = targets[b, l]``. Gradient: ``d logp / d x_v = 1[v == t] - softmax(x)_v``,
    returned in the logits' dtype. Works for any leading shape ``[..., V]``.
    ``vocab_chunk_size`` bounds the float32 working set of the forward
    reduction (None: one pass over the whole vocab).

    Out-of-range targets (``t < 0`` or ``t >= V``; negative ids do *not* wrap
    around) give ``logp = NaN``, and the gradient row of such a position is NaN
    where its cotangent is non-zero, exactly 0 where it is zero. So an
    out-of-range id at a position whose weight is 0 (a masked position, through
    ``policy_gradient_loss``) changes nothing, while one that is trained on
    shows up as a NaN loss instead of silently training on some other token.
    Ids cannot be range-checked with an error on device (they may be traced).
    """
    _check_logits_targets("token_logprobs", logits_BxLxV, targets_BxL)
    _check_chunk("token_logprobs", vocab_chunk_size)
    return _logp_ent(logits_BxLxV, targets_BxL, vocab_chunk_size, True, False)[0]


def token_entropy(logits_BxLxV: jax.Array, *, vocab_chunk_size: int | None = DEFAULT_VOCAB_CHUNK) -> jax.Array:
    """Entropy of the next-token distribution at each position, in float32.

    ``H = -sum_v p_v log p_v = lse(x) - sum_v p_v x_v`` with ``p = softmax(x)``.
    Gradient: ``dH/dx_v = -p_v (log p_v + H)``, returned in the logits' dtype.
    """
    _check_logits("token_entropy", logits_BxLxV)
    _check_chunk("token_entropy", vocab_chunk_size)
    dummy = jnp.zeros(logits_BxLxV.shape[:-1], jnp.int32)
    return _logp_ent(logits_BxLxV, dummy, vocab_chunk_size, False, True)[1]


def token_logprobs_and_entropy(
    logits_BxLxV: jax.Array, targets_BxL: jax.Array, *, vocab_chunk_size: int | None = DEFAULT_VOCAB_CHUNK
) -> tuple[jax.Array, jax.Array]:
    """``(token_logprobs, token_entropy)`` sharing one read of the logits."""
    _check_logits_targets("token_logprobs_and_entropy", logits_BxLxV, targets_BxL)
    _check_chunk("token_logprobs_and_entropy", vocab_chunk_size)
    return _logp_ent(logits_BxLxV, targets_BxL, vocab_chunk_size, True, True)


# ----------------------------------------------------------------------------- chunked


def _unembed_DxV(unembed, d_model, layout):
    chex.assert_rank(unembed, 2, custom_message="chunked_token_logprobs: unembed must be [D, V] or [V, D]")
    if layout is None:
        fits = [name for name, ax in (("DxV", 0), ("VxD", 1)) if unembed.shape[ax] == d_model]
        if len(fits) != 1:
            raise ValueError(
                f"chunked_token_logprobs: cannot tell the layout of unembed {unembed.shape} for "
                f"d_model={d_model}; pass layout='DxV' or layout='VxD'"
            )
        layout = fits[0]
    if layout not in ("DxV", "VxD"):
        raise ValueError(f"chunked_token_logprobs: layout must be 'DxV' or 'VxD', got {layout!r}")
    w = unembed if layout == "DxV" else unembed.T
    if w.shape[0] != d_model:
        raise ValueError(
            f"chunked_token_logprobs: unembed {unembed.shape} with layout={layout!r} does not "
            f"match hidden d_model={d_model}"
        )
    return w


def chunked_token_logprobs(
    hidden_BxLxD: jax.Array,
    unembed: jax.Array,
    targets_BxL: jax.Array,
    *,
    chunk_size: int,
    layout: str | None = None,
    with_entropy: bool = False,
):
    """``token_logprobs(hidden @ W, targets)`` without materialising [B, L, V] logits.

    ``unembed`` is ``W`` as [D, V] (``layout='DxV'``, an untied output kernel) or
    [V, D] (``layout='VxD'``, a tied embedding table); inferred from shapes when
    unambiguous. The sequence axis is scanned in chunks of ``chunk_size``
    positions (padded up to a multiple); each chunk's body is rematerialised in
    the backward pass, so live memory is one [B, chunk_size, V] block of logits
    (computed with float32 accumulation) plus O(B*L) statistics. The batch axis
    is left whole so a data-parallel sharding of B is preserved.

    Returns ``logp_BxL`` (float32), or ``(logp_BxL, entropy_BxL)`` when
    ``with_entropy``. The gradient flows to both ``hidden`` and ``unembed``.
    """
    where = "chunked_token_logprobs"
    chex.assert_rank(hidden_BxLxD, 3, custom_message=f"{where}: hidden must be [B, L, D]")
    b, l, d = hidden_BxLxD.shape
    chex.assert_shape(targets_BxL, (b, l), custom_message=f"{where}: targets must be [B, L] of hidden")
    chex.assert_type(targets_BxL, int, custom_message=f"{where}: targets must be integer token ids")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunked_token_logprobs: chunk_size must be a positive int, got {chunk_size!r}")
    w_DxV = _unembed_DxV(unembed, d, layout)
    c = min(chunk_size, l)
    n = -(-l // c)
    pad = n * c - l
    h = jnp.pad(hidden_BxLxD, ((0, 0), (0, pad), (0, 0)))
    t = jnp.pad(targets_BxL, ((0, 0), (0, pad)))
    h_NxBxCxD = h.reshape(b, n, c, d).transpose(1, 0, 2, 3)
    t_NxBxC = t.reshape(b, n, c).transpose(1, 0, 2)

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def body(w, h_BxCxD, t_BxC):
        logits_BxCxV = jnp.einsum("bcd,dv->bcv", h_BxCxD, w, preferred_element_type=_F32)
        logp, ent = _logp_ent(logits_BxCxV, t_BxC, None, True, with_entropy)
        return logp, (ent if with_entropy else jnp.zeros_like(logp))

    def step(carry, xs):
        return carry, body(w_DxV, *xs)

    _, (logp_NxBxC, ent_NxBxC) = jax.lax.scan(step, None, (h_NxBxCxD, t_NxBxC))
    logp_BxL = logp_NxBxC.transpose(1, 0, 2).reshape(b, n * c)[:, :l]
    if not with_entropy:
        return logp_BxL
    return logp_BxL, ent_NxBxC.transpose(1, 0, 2).reshape(b, n * c)[:, :l]
