"""The peer side of tools/bench_roofline.py: Tunix's Qwen3 of a given shape, timed on this machine.

Runs in its OWN venv (Tunix is never a dependency of gyre_jax); bench_roofline.py starts it as
a child with one JSON argument and reads one JSON line back. Making the venv (~2 min):

    python3.11 -m venv /work/venvs/peer
    /work/venvs/peer/bin/pip install "jax[cpu]==0.10.2" flax optax chex numpy
    /work/venvs/peer/bin/pip install --no-deps google-tunix==0.1.7
    /work/venvs/peer/bin/pip install google-metrax jaxtyping wadler_lindig huggingface_hub perfetto pandas \
        sentencepiece pillow safetensors

What is timed (random weights, same shape and dtype as ours, one CPU device):
* train: ``nnx.value_and_grad`` of token cross-entropy over one causal row + optax AdamW update,
  one jitted function (Tunix's model as its trainers call it: a dense [B, L, L] causal mask);
  median seconds per step -> ``train_tokens_per_s``.
* decode: Tunix's ``Sampler`` (greedy), S prompts of ``context`` tokens; tokens/s of the decode
  loop alone = S x (n2 - n1) / (time of n2 steps - time of n1 steps), which cancels the prefill.
"""
from __future__ import annotations

import importlib.metadata
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tunix.generate import sampler as sampler_lib
from tunix.models.qwen3 import model as qwen3


class IdTokenizer:
    """Text = space-separated token ids (the bench has no vocabulary; Tunix's Sampler takes strings)."""

    def encode(self, text, **kwargs):
        return [int(t) for t in text.split()]

    def decode(self, ids, **kwargs):
        return " ".join(str(int(i)) for i in ids)

    def bos_id(self):
        return 0  # falsy: the Sampler then adds no BOS

    def eos_id(self):
        return 1

    def pad_id(self):
        return 0


def _median(fn, repeats):
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def build(shape, dtype):
    dt = jnp.dtype(dtype)
    cfg = qwen3.ModelConfig(
        num_layers=shape["n_layers"], vocab_size=shape["vocab_size"], embed_dim=shape["d_model"],
        hidden_dim=shape["d_ff"], num_heads=shape["n_heads"], head_dim=shape["head_dim"],
        num_kv_heads=shape["n_kv_heads"], rope_theta=int(shape["rope_theta"]), norm_eps=shape["norm_eps"],
        use_tied_embedding=True, dtype=dt, param_dtype=dt)
    return cfg, qwen3.Qwen3(cfg, rngs=nnx.Rngs(0))


def time_train(model, cfg, row_len, repeats):
    graphdef, state = nnx.split(model)
    tx = optax.adamw(1e-4, weight_decay=0.01)
    opt_state = tx.init(state)
    rng = np.random.default_rng(0)
    toks = jnp.asarray(rng.integers(2, cfg.vocab_size, (1, row_len + 1)), jnp.int32)
    inp, tgt = toks[:, :-1], toks[:, 1:]
    pos = jnp.arange(row_len, dtype=jnp.int32)[None]
    mask = jnp.tril(jnp.ones((row_len, row_len), bool))[None]

    def loss_fn(st):
        logits, _ = nnx.merge(graphdef, st)(inp, pos, None, mask)
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.mean(jnp.take_along_axis(logp, tgt[..., None], -1))

    @jax.jit
    def step(st, os_):
        loss, g = jax.value_and_grad(loss_fn)(st)
        upd, os_ = tx.update(g, os_, st)
        return optax.apply_updates(st, upd), os_, loss

    box = [state, opt_state]

    def run():
        box[0], box[1], loss = step(box[0], box[1])
        jax.block_until_ready(loss)

    run()
    return _median(run, repeats)


def time_decode(model, cfg, slots, context, steps, repeats):
    cache = sampler_lib.CacheConfig(cache_size=context + steps + 16, num_layers=cfg.num_layers,
                                    num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    s = sampler_lib.Sampler(model, IdTokenizer(), cache)
    prompt = " ".join(str(int(t)) for t in np.random.default_rng(1).integers(2, cfg.vocab_size, context))
    # eos never produced: an id outside the vocabulary, so every call decodes all its steps.
    call = dict(max_prompt_length=context, temperature=0.0, eos_tokens=[cfg.vocab_size + 7])

    def gen(n):
        out = s([prompt] * slots, max_generation_steps=n, **call)
        jax.block_until_ready(out.tokens)

    n1, n2 = 8, 8 + steps
    gen(n1), gen(n2)  # compile both lengths
    t1, t2 = _median(lambda: gen(n1), repeats), _median(lambda: gen(n2), repeats)
    if t2 <= t1:  # load noise swamped the difference: no figure rather than a wrong one
        raise RuntimeError(f"decode x{slots}: {n2} steps took no longer than {n1} ({t2:.3f} s vs {t1:.3f} s)")
    return slots * (n2 - n1) / (t2 - t1)


def main():
    a = json.loads(sys.argv[1])
    cfg, model = build(a["shape"], a["dtype"])
    out = {"version": importlib.metadata.version("google-tunix"), "jax": jax.__version__}
    t = time_train(model, cfg, a["row_len"], a["repeats"])
    out.update(train_step_s=t, train_tokens_per_s=a["row_len"] / t)
    print(json.dumps(out), flush=True)  # as it goes: a parent that stops us early keeps what was measured
    for s in a["slots"]:
        out[f"decode_tokens_per_s_{s}"] = time_decode(model, cfg, s, a["context"], a["decode_steps"], a["repeats"])
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
