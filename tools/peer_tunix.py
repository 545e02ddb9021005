"""The peer side of tools/bench_roofline.py: Tunix's Qwen3 of a given shape, timed on this machine.

Runs in its OWN venv (Tunix is never a dependency of gyre_jax); bench_roofline.py starts it as
a child with one JSON argument, then sends one JSON request a line on stdin and reads one JSON
line back for each, so it can interleave the peer's timed runs with its own (the machine is
shared: load changes by the minute and must hit both sides alike). Making the venv (~2 min):

    python3.11 -m venv /work/venvs/peer
    /work/venvs/peer/bin/pip install "jax[cpu]==0.10.2" flax optax chex numpy
    /work/venvs/peer/bin/pip install --no-deps google-tunix==0.1.7
    /work/venvs/peer/bin/pip install google-metrax jaxtyping wadler_lindig huggingface_hub perfetto pandas \
        sentencepiece pillow safetensors

Requests (``op``): ``train_setup`` then ``train`` (one timed step each); ``decode_setup`` then
``decode`` with ``slots``. Each timed reply carries ``s`` (wall seconds) and ``cpu_s`` (this
process's CPU seconds, all threads). What is timed (random weights, same shape and dtype as
ours, one CPU device, the settings a Tunix user would pick on CPU):

* train: ``jax.value_and_grad`` of token cross-entropy over one causal row + optax AdamW update,
  one jitted function. Tunix's model as its trainers call it: a dense [B, L, L] causal mask
  (its only other attention, ``use_flash_attention``, is the TPU splash kernel); no remat.
* decode: Tunix's ``Sampler`` (greedy) with its KV cache sized for the run (prompt + steps + 16).
  ``decode_setup`` runs the public ``Sampler.__call__`` once (it compiles the Sampler's own
  jitted prefill and decode at these shapes and checks they run), then keeps one prefilled
  state from the same jitted prefill; each ``decode`` times the Sampler's jitted decode loop
  alone (``_compiled_decode_fn``: a while_loop over the steps, the cache donated and updated in
  place) on a copy of that state. Ours is timed likewise without prefill (the engine's
  ``generate``). Timing the whole ``__call__`` instead would re-run the prefill (at 32 slots
  of 512 tokens, 32 x 512 x vocab f32 logits: Tunix's Qwen3 has no last-token-only prefill)
  every call and bury the decode in it: that is what kept an earlier version from finishing.
"""
from __future__ import annotations

import importlib.metadata
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tunix.generate import sampler as sampler_lib
from tunix.models.qwen3 import model as qwen3

import benchkit  # tools/, beside this script: stdlib only, so it loads in the peer's own venv


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


def _timed(fn) -> dict:
    c0 = time.process_time()
    _, s = benchkit.timed(fn)
    return {"s": s, "cpu_s": time.process_time() - c0}


def build(shape, dtype):
    dt = jnp.dtype(dtype)
    cfg = qwen3.ModelConfig(
        num_layers=shape["n_layers"], vocab_size=shape["vocab_size"], embed_dim=shape["d_model"],
        hidden_dim=shape["d_ff"], num_heads=shape["n_heads"], head_dim=shape["head_dim"],
        num_kv_heads=shape["n_kv_heads"], rope_theta=int(shape["rope_theta"]), norm_eps=shape["norm_eps"],
        use_tied_embedding=True, dtype=dt, param_dtype=dt)
    return cfg, qwen3.Qwen3(cfg, rngs=nnx.Rngs(0))


class Train:
    def __init__(self, model, cfg, row_len):
        graphdef, state = nnx.split(model)
        tx = optax.adamw(1e-4, weight_decay=0.01)
        rng = np.random.default_rng(0)
        toks = jnp.asarray(rng.integers(2, cfg.vocab_size, (1, row_len + 1)), jnp.int32)
        inp, tgt = toks[:, :-1], toks[:, 1:]
        pos = jnp.arange(row_len, dtype=jnp.int32)[None]
        mask = jnp.tril(jnp.ones((row_len, row_len), bool))[None]

        def loss_fn(st):
            logits, _ = nnx.merge(graphdef, st)(inp, pos, None, mask)
            logp = jax.nn.log_softmax(logits, -1)
            return -jnp.mean(jnp.take_along_axis(logp, tgt[..., None], -1))

        def step(st, os_):
            loss, g = jax.value_and_grad(loss_fn)(st)
            upd, os_ = tx.update(g, os_, st)
            return optax.apply_updates(st, upd), os_, loss

        self._step = jax.jit(step, donate_argnums=(0, 1))
        state = jax.tree.map(jnp.copy, state)  # donated each step: the Sampler keeps the model's own arrays
        self._box = [state, tx.init(state)]

    def once(self):
        st, os_, loss = self._step(*self._box)
        self._box = [st, os_]
        jax.block_until_ready(loss)
        self.loss = float(loss)


class Decode:
    def __init__(self, model, cfg, slots, context, steps):
        cache_size = context + steps + 16
        self.s = sampler_lib.Sampler(model, IdTokenizer(), sampler_lib.CacheConfig(
            cache_size=cache_size, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim))
        ids = np.random.default_rng(1).integers(2, cfg.vocab_size, (slots, context))
        # eos never produced: an id outside the vocabulary, so every call decodes all its steps.
        eos = [cfg.vocab_size + 7]
        out = self.s([" ".join(map(str, row)) for row in ids], max_generation_steps=steps, max_prompt_length=context,
                     temperature=0.0, eos_tokens=eos)
        self.public_tokens = [len(t) for t in out.tokens]
        st = self.s.init_sample_state(jnp.asarray(ids, jnp.int32), total_sampling_steps=context + steps,
                                      include_logits=False, forbidden_token_ids=None, temperature=0.0, top_p=None,
                                      top_k=None, seed=jax.random.PRNGKey(0), beam_size=None)
        self._params = self.s._flattened_transformer_state
        self._prefilled = self.s._compiled_prefill_fn(self._params, st, None, echo=False)
        jax.block_until_ready(self._prefilled.token_buffer)
        self.slots, self.cache_size = slots, cache_size

    def once(self):
        # Donated by the decode fn: every run starts from a fresh copy of the prefilled state.
        st = jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, self._prefilled)
        jax.block_until_ready(st.token_buffer)
        t = _timed(lambda: jax.block_until_ready(self._run(st)))
        return t

    def _run(self, st):
        out = self.s._compiled_decode_fn(self._params, st)
        self.steps = int(out.decoding_step) - int(self._prefilled.decoding_step)
        return out.token_buffer


def main():
    a = json.loads(sys.argv[1])
    cfg, model = build(a["shape"], a["dtype"])
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    reply({"version": importlib.metadata.version("google-tunix"), "jax": jax.__version__, "params": int(n_params)})
    train, decode = None, {}
    for line in sys.stdin:
        req = json.loads(line)
        try:
            op = req["op"]
            if op == "train_setup":
                with benchkit.Stopwatch() as sw:
                    train = Train(model, cfg, a["row_len"])
                    train.once()
                out = {"compile_and_first_s": sw.s, "loss": train.loss}
            elif op == "train":
                out = dict(_timed(train.once), tokens=a["row_len"])
            elif op == "decode_setup":
                with benchkit.Stopwatch() as sw:
                    d = decode[req["slots"]] = Decode(model, cfg, req["slots"], a["context"], a["decode_steps"])
                    d.once()
                out = {"setup_s": sw.s, "cache_size": d.cache_size, "steps": d.steps,
                       "public_call_tokens": d.public_tokens[0]}
            elif op == "decode":
                d = decode[req["slots"]]
                out = dict(d.once(), tokens=d.slots * d.steps)
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as e:  # the parent reports it; the bench goes on without the peer's figure
            out = {"error": f"{type(e).__name__}: {e}"}
        reply(out)


def reply(obj):
    print(json.dumps(obj), flush=True)


if __name__ == "__main__":
    main()
