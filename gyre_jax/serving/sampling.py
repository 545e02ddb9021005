"""Per-slot sampling (greedy / temperature / top-p) with the behavior log-prob.

Pure jittable functions; every slot has its own parameters, so one decode step
serves requests with different settings.

Which log-prob is reported (the "behavior" log-prob the trainer's importance
ratio divides by):
  * temperature > 0: log of the probability the token had in the distribution it
    was actually drawn from, i.e. softmax(logits / T) restricted to the top-p
    nucleus and renormalized. With T = 1 and top_p = 1 this is exactly
    log_softmax(logits) of the model.
  * temperature = 0 (greedy): the argmax is taken, and the reported log-prob is
    log_softmax(logits) at T = 1 without truncation (the point mass actually used
    would always give 0, which carries no information for training).

The random draw of slot s uses ``fold_in(PRNGKey(seed_s), step_s)`` where step_s
counts the tokens already generated for that request, so a request's samples do
not depend on which other requests share the batch, on its slot, or on the cell
it runs on: a call moved mid-generation continues exactly as it would have.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def nucleus_logprobs(logits_SxV, temperature_S, top_p_S):
    """Log-probs of the sampling distribution per slot (-inf outside the nucleus).

    Greedy slots (temperature 0) get log_softmax(logits) (see module docstring).
    Tokens tied with the smallest kept probability are kept too.
    """
    logits_SxV = logits_SxV.astype(jnp.float32)
    greedy_S = temperature_S <= 0
    t_S = jnp.where(greedy_S, 1.0, temperature_S)
    logp_SxV = jax.nn.log_softmax(logits_SxV / t_S[:, None], axis=-1)
    sorted_SxV = -jnp.sort(-logp_SxV, axis=-1)  # descending
    p_sorted = jnp.exp(sorted_SxV)
    mass_before_SxV = jnp.cumsum(p_sorted, axis=-1) - p_sorted
    # Keep the smallest prefix whose mass reaches top_p (always at least one token).
    n_keep_S = jnp.maximum(jnp.sum(mass_before_SxV < top_p_S[:, None], axis=-1), 1)
    threshold_S = jnp.take_along_axis(sorted_SxV, (n_keep_S - 1)[:, None], axis=-1)[:, 0]
    no_trunc_S = greedy_S | (top_p_S >= 1.0)
    keep_SxV = no_trunc_S[:, None] | (logp_SxV >= threshold_S[:, None])
    masked = jnp.where(keep_SxV, logp_SxV, -jnp.inf)
    renorm = masked - jax.nn.logsumexp(masked, axis=-1, keepdims=True)
    return jnp.where(no_trunc_S[:, None], logp_SxV, renorm)


def plain_logprobs(logits_SxV, temperature_S):
    """``nucleus_logprobs`` when no slot truncates (every slot greedy or top_p >= 1): no sort."""
    t_S = jnp.where(temperature_S <= 0, 1.0, temperature_S)
    return jax.nn.log_softmax(logits_SxV.astype(jnp.float32) / t_S[:, None], axis=-1)


def sample_tokens(logits_SxV, temperature_S, top_p_S, seed_S, step_S):
    """(token_S int32, logprob_S float32) for each slot.

    The vocabulary sort (top-p) runs only when some slot truncates, and the random draw only
    when some slot samples (``lax.cond``: one branch runs): an all-greedy batch, the common
    case of evals and of many agents, skips both (at 8 slots they were a quarter of a CPU
    decode step). Every branch gives the same values as the full computation.
    """
    greedy_S = temperature_S <= 0
    truncates = jnp.any(~greedy_S & (top_p_S < 1.0))
    logp_SxV = jax.lax.cond(truncates, nucleus_logprobs, lambda lg, t, _: plain_logprobs(lg, t),
                            logits_SxV, temperature_S, top_p_S)

    def draw(logp):
        keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.PRNGKey(s), n))(
            seed_S.astype(jnp.uint32), step_S.astype(jnp.uint32)
        )
        return jax.vmap(jax.random.categorical)(keys, logp).astype(jnp.int32)

    drawn_S = jax.lax.cond(jnp.any(~greedy_S), draw, lambda logp: jnp.zeros(logp.shape[:1], jnp.int32), logp_SxV)
    tok_S = jnp.where(greedy_S, jnp.argmax(logits_SxV, axis=-1), drawn_S).astype(jnp.int32)
    lp_S = jnp.take_along_axis(logp_SxV, tok_S[:, None], axis=-1)[:, 0]
    return tok_S, lp_S
