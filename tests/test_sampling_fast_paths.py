"""sample_tokens skips the vocabulary sort and the random draw when no slot needs them, with
values equal to the full computation (nucleus_logprobs + a draw for every slot)."""
import jax
import jax.numpy as jnp
import numpy as np

from gyre_jax.serving.sampling import nucleus_logprobs, plain_logprobs, sample_tokens

S, V = 4, 64


def _full(logits, temp, top_p, seed, step):
    """The computation without fast paths: sort, renormalize and draw for every slot."""
    logp = nucleus_logprobs(logits, temp, top_p)
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.PRNGKey(s), n))(seed.astype(jnp.uint32),
                                                                             step.astype(jnp.uint32))
    drawn = jax.vmap(jax.random.categorical)(keys, logp)
    tok = jnp.where(temp <= 0, jnp.argmax(logits, -1), drawn).astype(jnp.int32)
    return tok, jnp.take_along_axis(logp, tok[:, None], -1)[:, 0]


def test_every_mix_of_slots_equals_the_full_computation():
    logits = jax.random.normal(jax.random.key(0), (S, V)) * 3
    seed, step = jnp.arange(S, dtype=jnp.int32) + 11, jnp.arange(S, dtype=jnp.int32) * 3
    fast, full = jax.jit(sample_tokens), jax.jit(_full)
    mixes = {  # all greedy (no sort, no draw); sampling without truncation (no sort); truncating
        "greedy": ([0.0] * S, [1.0] * S),
        "greedy_top_p_ignored": ([0.0] * S, [0.5] * S),
        "sample_no_trunc": ([0.0, 0.7, 1.0, 1.3], [1.0] * S),
        "trunc": ([0.0, 0.7, 1.0, 1.3], [1.0, 0.6, 0.9, 1.0]),
    }
    for name, (t, p) in mixes.items():
        t, p = jnp.asarray(t, jnp.float32), jnp.asarray(p, jnp.float32)
        tok, lp = fast(logits, t, p, seed, step)
        want_tok, want_lp = full(logits, t, p, seed, step)
        np.testing.assert_array_equal(np.asarray(tok), np.asarray(want_tok), err_msg=name)
        np.testing.assert_array_equal(np.asarray(lp), np.asarray(want_lp), err_msg=name)


def test_an_all_greedy_step_has_no_sort_on_its_path():
    """The sort lives only in the truncating branch of a conditional, never on the straight path."""
    t, p = jnp.zeros((S,)), jnp.ones((S,))
    jaxpr = jax.make_jaxpr(sample_tokens)(jnp.zeros((S, V)), t, p, jnp.zeros((S,), jnp.int32),
                                          jnp.zeros((S,), jnp.int32)).jaxpr
    top = {e.primitive.name for e in jaxpr.eqns}
    assert "sort" not in top and "cond" in top
    np.testing.assert_array_equal(np.asarray(plain_logprobs(jnp.ones((1, 4)), jnp.zeros((1,)))),
                                  np.full((1, 4), np.log(0.25), np.float32))
