"""A LoRA run's engine (serving/lora_weights.py): born with the base and an adapter, then published
adapters alone, merged into the weights or applied beside them; either way its greedy tokens are the
merged model's (a float64 merge), before and after a publication."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gyre_jax.cells.frozen_base import Adapted, FrozenBase
from gyre_jax.model import Transformer
from gyre_jax.model import lora as L
from gyre_jax.serving.engine import GyreEngine
from gyre_jax.testing.tiny_serving_model import CFG, sharp_params
from tests.test_lora import _numpy_merge, _random_adapter
from tests.test_serving_engine import Runner, pinput, prompts

MAX_LEN = 64
LCFG = CFG.replace(lora=L.LoraConfig(rank=4, alpha=8.0), max_seq_len=MAX_LEN)


@pytest.fixture(scope="module")
def setup():
    base = sharp_params()
    return base, _random_adapter(LCFG, 1), _random_adapter(LCFG, 2)


def _greedy(params, prompt, n):
    f = jax.jit(lambda p, x, m: Transformer(CFG).apply(
        p, x[None], jnp.arange(MAX_LEN)[None], (jnp.arange(MAX_LEN) < m).astype(jnp.int32)[None],
        jnp.full((1, MAX_LEN), MAX_LEN, jnp.int32))[0])
    seq = list(prompt)
    for _ in range(n):
        x = np.zeros(MAX_LEN, np.int32)
        x[:len(seq)] = seq
        seq.append(int(np.argmax(np.asarray(f(params, x, len(seq)))[len(seq) - 1])))
    return seq[len(prompt):]


@pytest.mark.parametrize("serving", ["merged", pytest.param("unmerged", marks=pytest.mark.slow)])  # (unmerged: also
# the next test's path, with two adapters)
def test_lora_engine_serves_the_merged_model_and_takes_adapters_alone(setup, serving):
    base, ad1, ad2 = setup
    frozen = FrozenBase(LCFG, base)
    engine = GyreEngine(LCFG, Adapted(frozen, (ad1,)), max_slots=2, max_len=MAX_LEN, lora_serving=serving)
    assert engine.config.lora is (None if serving == "merged" else LCFG.lora)
    p = prompts(1, seed=3)[0][:12]
    for version, ad in ((0, ad1), (1, ad2)):
        if version:
            engine.publish((ad2,), version)  # what a publication moved: the adapters alone
        merged = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), _numpy_merge(LCFG, base, ad))
        r = Runner(engine)
        r.insert(0, pinput(f"v{version}", p, max_tokens=8, temperature=0.0))
        r.step(9)
        assert [t for t, _ in r.out[0]] == _greedy(merged, p, 8), f"version {version}"
    want_base = _greedy(base, p, 8)
    assert want_base != _greedy(jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), _numpy_merge(LCFG, base, ad2)),
                                p, 8), "the adapters must change the output for this check to mean anything"


def test_several_adapters_each_slot_its_own(setup):
    """Multi-LoRA serving: one engine, one base, two adapters; each call decodes with the adapter its
    sampling names (what the proxy sets from the rollout's key), side by side in one batch, and a call
    naming an adapter the engine lacks fails alone."""
    base, ad1, ad2 = setup
    cfg2 = LCFG.replace(lora=L.LoraConfig(rank=4, alpha=8.0, num_adapters=2))
    engine = GyreEngine(cfg2, Adapted(FrozenBase(cfg2, base), (ad1, ad2)), max_slots=2, max_len=MAX_LEN,
                        lora_serving="unmerged")
    p = prompts(1, seed=3)[0][:12]
    r = Runner(engine)
    r.insert(0, pinput("a0", p, max_tokens=8, temperature=0.0, adapter=0))
    r.insert(1, pinput("a1", p, max_tokens=8, temperature=0.0, adapter=1))
    r.step(9)
    for slot, ad in ((0, ad1), (1, ad2)):
        merged = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), _numpy_merge(LCFG, base, ad))
        assert [t for t, _ in r.out[slot]] == _greedy(merged, p, 8), f"slot {slot}"
    assert r.out[0] != r.out[1]
    engine.prefill(params=engine.params_ref, padded_tokens=pinput("bad", p, max_tokens=2, adapter=2),
                   true_length=len(p) - 1)
    assert "adapter 2 requested" in engine.pop_error("bad")
    with pytest.raises(ValueError, match="merged' serves one adapter"):
        GyreEngine(cfg2, Adapted(FrozenBase(cfg2, base), (ad1, ad2)), max_slots=2, max_len=MAX_LEN)
