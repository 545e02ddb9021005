"""GyreEngine through the JetStream Engine API (prefill / insert / generate),
against a plain reference: a full forward pass over the whole sequence per step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gyre_jax.model import Transformer
from gyre_jax.serving.backend import SamplingParams
from gyre_jax.serving.engine import GyreEngine
from gyre_jax.serving.engine_state import (
    BLOCK_LOGICAL,
    CACHE_LOGICAL,
    PrefillInput,
    decode_result_pairs,
    kv_bytes_per_slot,
    kv_shardings,
)
from gyre_jax.sharding import RULES, mesh_spec
from gyre_jax.testing.tiny_serving_model import CFG, sharp_params

SLOTS, MAX_LEN = 16, 256
# float32 logits of this model reach |30|; the cached decode (attention over a
# 256-entry buffer, one token at a time) and the full causal forward are different
# kernels, so their logits differ by ~1e-6 relative, i.e. up to ~5e-5 absolute.
LOGP_ATOL = 1e-4


@pytest.fixture(scope="module")
def params():
    return sharp_params()


@pytest.fixture(scope="module")
def engine(params):
    return GyreEngine(CFG, params, max_slots=SLOTS, max_len=MAX_LEN)


@pytest.fixture(scope="module")
def ref_logits(params):
    """Full forward over one causal sequence, padded to MAX_LEN (one compile)."""
    f = jax.jit(lambda p, x, n: Transformer(CFG).apply(
        p, x[None], jnp.arange(MAX_LEN)[None], (jnp.arange(MAX_LEN) < n).astype(jnp.int32)[None],
        jnp.full((1, MAX_LEN), MAX_LEN, jnp.int32))[0])

    def logits(seq):
        x = np.zeros(MAX_LEN, np.int32)
        x[: len(seq)] = seq
        return np.asarray(f(params, x, len(seq)), np.float64)[: len(seq)]

    return logits


def ref_greedy(ref_logits, prompt, n, stop=()):
    seq = list(prompt)
    for _ in range(n):
        t = int(np.argmax(ref_logits(seq)[-1]))
        seq.append(t)
        if t in stop:
            break
    return seq[len(prompt):]


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def prompts(n, seed=0):
    rs = np.random.RandomState(seed)
    return [rs.randint(0, 256, size=int(rs.randint(3, 60))).astype(np.int32) for _ in range(n)]


def pinput(rid, prompt, **sp):
    return PrefillInput(rid, prompt[:-1], int(prompt[-1]), 0, SamplingParams(**sp))


class Runner:
    """Drives the engine the way JetStream's generate thread does, collecting
    (token, logprob) per slot while the slot's validity flag is set."""

    def __init__(self, engine):
        self.e, self.ds = engine, engine.init_decode_state()
        self.out: dict[int, list] = {}
        self.live: set[int] = set()
        self.held: set[int] = set()  # finished, slot held until released

    def insert(self, slot, inp):
        pre = self.e.prefill(params=self.e.params_ref, padded_tokens=inp, true_length=len(inp.tokens))
        self.ds = self.e.insert(pre, self.ds, slot)
        self.out[slot], _ = [], self.live.add(slot)

    def step(self, n=1):
        for _ in range(n):
            self.ds, res = self.e.generate(self.e.params_ref, self.ds)
            data = np.asarray(res.data)
            k2 = res.tokens_idx[1]  # 2 columns (token, log-prob bits) per decode step
            for s in list(self.live):
                for j in range(0, k2, 2):
                    pairs = decode_result_pairs(data[s, j:j + 2])
                    if not data[s, k2 + j]:  # invalid: JetStream would free the slot
                        self.live.discard(s)
                        break
                    if not pairs:  # the held marker: the request ended at its last token
                        self.live.discard(s)
                        self.held.add(s)
                        break
                    self.out[s] += pairs


def test_greedy_continuous_batching_equals_reference(engine, ref_logits):
    ps = prompts(4)
    r = Runner(engine)
    r.insert(0, pinput("a", ps[0], max_tokens=12, temperature=0.0))
    r.insert(5, pinput("b", ps[1], max_tokens=12, temperature=0.0))
    r.step(4)
    r.insert(9, pinput("c", ps[2], max_tokens=9, temperature=0.0))  # joins mid-flight
    r.step(3)
    r.insert(1, pinput("d", ps[3], max_tokens=5, temperature=0.7, seed=3))  # a sampled neighbour
    r.step(12)
    assert not r.live - {1}
    for slot, p, n in ((0, ps[0], 12), (5, ps[1], 12), (9, ps[2], 9)):
        assert [t for t, _ in r.out[slot]] == ref_greedy(ref_logits, p, n)


def test_logprobs_match_forward_pass_at_temperature_one(engine, ref_logits):
    p = prompts(1, seed=1)[0]
    r = Runner(engine)
    r.insert(2, pinput("lp", p, max_tokens=20, temperature=1.0, seed=11))
    r.step(21)
    toks = [t for t, _ in r.out[2]]
    lps = np.array([lp for _, lp in r.out[2]])
    seq = np.concatenate([p, toks])
    ref = log_softmax(ref_logits(seq))[len(p) - 1: -1]
    np.testing.assert_allclose(lps, ref[np.arange(len(toks)), toks], rtol=0, atol=LOGP_ATOL)


def test_temperature_top_p_logprobs_are_the_sampling_distribution(engine, ref_logits):
    p = prompts(1, seed=2)[0]
    temp, top_p = 0.7, 0.6
    r = Runner(engine)
    r.insert(3, pinput("tp", p, max_tokens=16, temperature=temp, top_p=top_p, seed=5))
    r.step(17)
    toks = [t for t, _ in r.out[3]]
    lps = np.array([lp for _, lp in r.out[3]])
    logits = ref_logits(np.concatenate([p, toks]))[len(p) - 1: -1] / temp
    for i, t in enumerate(toks):
        lp = log_softmax(logits[i])
        order = np.argsort(-lp)
        mass_before = np.cumsum(np.exp(lp[order])) - np.exp(lp[order])
        nucleus = order[mass_before < top_p]
        assert t in nucleus, f"token {i} ({t}) sampled outside the top-p nucleus"
        ref = lp[t] - np.log(np.exp(lp[nucleus]).sum())
        assert abs(lps[i] - ref) < LOGP_ATOL, (i, lps[i], ref)


def test_sampling_depends_only_on_seed_and_position(engine):
    p = prompts(1, seed=3)[0]
    r = Runner(engine)
    r.insert(4, pinput("s1", p, max_tokens=10, temperature=1.0, seed=99))
    r.step(3)
    r.insert(12, pinput("s2", p, max_tokens=10, temperature=1.0, seed=99))  # other slot, other batch mates
    r.step(12)
    assert r.out[4] == r.out[12] and len(r.out[4]) == 10


def test_stop_ids_emit_the_stop_token_then_end(engine, ref_logits):
    p = prompts(1, seed=4)[0]
    full = ref_greedy(ref_logits, p, 10)
    stop = full[5]
    r = Runner(engine)
    r.insert(6, pinput("st", p, max_tokens=10, temperature=0.0, stop_ids=(stop,)))
    r.step(11)
    want = full[: full.index(stop) + 1]
    assert [t for t, _ in r.out[6]] == want and 6 in r.held


def turn_two_on_exported_kv(engine, ref_logits, after_release=lambda p1: None):
    """Turn 2 of a conversation prefilled on turn 1's exported KV: only the new tokens run
    through the model, and the output equals a fresh reference. Shared by both cache kinds
    (test_serving_engine_paged.py runs it on pages); ``after_release(p1)`` checks the cache
    between the turns. Returns the runner, turn 2 still held in slot 8."""
    p1 = prompts(1, seed=5)[0]
    r = Runner(engine)
    r.insert(7, pinput("t1", p1, max_tokens=8, temperature=0.0))
    r.step(9)
    out1 = [t for t, _ in r.out[7]]
    assert out1 == ref_greedy(ref_logits, p1, 8)
    assert 7 in r.held  # ended by max_tokens: the slot is held for the backend
    snap = engine.release("t1", snapshot=True)
    r.ds = engine._service(r.ds)  # what the generate thread does at its next step
    block = snap.result(timeout=30).kv
    assert block.length == len(p1) + len(out1) - 1
    after_release(p1)
    p2 = np.concatenate([p1, out1, np.arange(40, 60, dtype=np.int32)])
    before = engine.counters["prefill_tokens"]
    inp = pinput("t2", p2, max_tokens=8, temperature=0.0)
    pre = engine.prefill(params=engine.params_ref, existing_prefix=block, padded_tokens=inp, true_length=0)
    assert engine.counters["prefill_tokens"] - before == len(p2) - 1 - block.length
    r.ds = engine.insert(pre, r.ds, 8)
    r.out[8], _ = [], r.live.add(8)
    r.step(9)
    assert [t for t, _ in r.out[8]] == ref_greedy(ref_logits, p2, 8)
    return r


def test_existing_prefix_is_reused_not_recomputed(engine, ref_logits):
    turn_two_on_exported_kv(engine, ref_logits)


def test_a_request_inserted_after_all_others_finished_is_decoded(engine, ref_logits):
    """Regression: a finished batch's last result (no slot generating) must not
    make the engine skip decoding a request inserted after it."""
    p1, p2 = prompts(2, seed=6)
    r = Runner(engine)
    r.insert(10, pinput("idle-a", p1, max_tokens=3, temperature=0.0))
    r.step(3)  # a's last token: the call's result says "nothing generating now"
    assert len(r.out[10]) == 3
    r.insert(11, pinput("idle-b", p2, max_tokens=6, temperature=0.0))
    r.step(7)
    assert [t for t, _ in r.out[11]] == ref_greedy(ref_logits, p2, 6)


@pytest.mark.parametrize("slots", [4, 3])  # 3 slots do not divide over 'data' = 2: replicated
def test_kv_cache_shardings_come_from_the_rules_table(params, slots):
    """The engine's KV cache and KV blocks are sharded as cells.sharding.RULES says
    (slots over 'data', kv heads over 'tensor'), like every other array."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "tensor"))
    eng = GyreEngine(CFG, params, max_slots=slots, max_len=MAX_LEN, mesh=mesh)
    rules = dict(RULES)
    assert rules["cache_batch"] == ("data", "expert") and rules["cache_len"] is None and rules["kv_heads"] == "tensor"
    cache_spec = PartitionSpec("data" if slots % 2 == 0 else None, None, "tensor")  # each layer's [S, M, K, H]
    assert mesh_spec(CACHE_LOGICAL, mesh, shape=(slots, MAX_LEN, CFG.n_kv_heads, CFG.head_dim),
                     replicate_indivisible=True) == cache_spec
    assert mesh_spec(BLOCK_LOGICAL, mesh) == PartitionSpec(None, None, "tensor")
    ds = eng.init_decode_state()
    assert len(ds.cache.k) == len(ds.cache.v) == CFG.n_layers
    for arr in ds.cache.k + ds.cache.v:
        assert arr.sharding.is_equivalent_to(NamedSharding(mesh, cache_spec), arr.ndim), arr.sharding
    assert ds.cache.lengths.sharding.is_fully_replicated
    assert eng.get_prefix_destination_sharding() == NamedSharding(mesh, PartitionSpec(None, None, "tensor"))
    # More tensor devices than kv heads: the heads are copied, not split (was the engine's own rule).
    wide = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "tensor"))
    assert CFG.n_kv_heads % 4
    cache, block = kv_shardings(CFG, MAX_LEN, slots, wide)
    assert cache.spec == (PartitionSpec("data") if slots % 2 == 0 else PartitionSpec())
    assert block.spec == PartitionSpec()


def test_long_prompts_are_prefilled_in_chunks(params, ref_logits):
    """prefill_chunk=16: a 150-token prompt runs as chunks into one buffer (the last one
    overlapping), and a prefix-cache hit prefills only its new tokens, chunked too;
    greedy outputs equal the full-forward reference."""
    # The fixture's slot count: its decode and insert are compiled already (chunking does not depend on it).
    eng = GyreEngine(CFG, params, max_slots=SLOTS, max_len=MAX_LEN, prefill_chunk=16)
    rs = np.random.RandomState(3)
    p1 = rs.randint(0, 256, size=150).astype(np.int32)
    r = Runner(eng)
    r.insert(0, pinput("c1", p1, max_tokens=6, temperature=0.0))
    r.step(7)
    out1 = [t for t, _ in r.out[0]]
    assert out1 == ref_greedy(ref_logits, p1, 6)
    assert eng.counters["prefill_tokens"] == len(p1) - 1
    snap = eng.release("c1", snapshot=True)
    r.ds = eng._service(r.ds)
    block = snap.result(timeout=30).kv
    p2 = np.concatenate([p1, out1, rs.randint(0, 256, size=40).astype(np.int32)])
    inp = pinput("c2", p2, max_tokens=6, temperature=0.0)
    pre = eng.prefill(params=eng.params_ref, existing_prefix=block, padded_tokens=inp, true_length=0)
    assert eng.counters["prefill_tokens"] == len(p1) - 1 + len(p2) - 1 - block.length
    r.ds = eng.insert(pre, r.ds, 1)
    r.out[1], _ = [], r.live.add(1)
    r.step(7)
    assert [t for t, _ in r.out[1]] == ref_greedy(ref_logits, p2, 6)


def test_kv_budget_too_small_names_the_plan(params):
    with pytest.raises(ValueError, match=r"16 slots x max_len=256 .* 3 slots fit at this max_len"):
        GyreEngine(CFG, params, max_slots=16, max_len=256, kv_budget_bytes=3.5 * kv_bytes_per_slot(CFG, 256))


def test_fixed_prefill_runs_every_prompt_and_prefix_as_one_program(params, ref_logits):
    """fixed_prefill: prompts of 3..150 tokens and a prefix-cache hit all prefill as 16-token chunks into one
    MAX_LEN buffer: one prefill program and one insert for all of them (each (prefix, prompt) bucket pair
    was its own program: minutes each for a 30-layer model on CPU); greedy outputs equal the reference."""
    eng = GyreEngine(CFG, params, max_slots=SLOTS, max_len=MAX_LEN, prefill_chunk=16, fixed_prefill=True)
    sizes = lambda: {k: getattr(eng, "_" + k)._cache_size() for k in ("prefill_new", "prefill_on", "prefill_into",
                                                                      "insert")}
    before = sizes()
    rs = np.random.RandomState(4)
    ps = prompts(3, seed=9) + [rs.randint(0, 256, size=150).astype(np.int32)]
    r = Runner(eng)
    for slot, p in enumerate(ps):
        r.insert(slot, pinput(f"f{slot}", p, max_tokens=6, temperature=0.0))
    r.step(7)
    for slot, p in enumerate(ps):
        assert [t for t, _ in r.out[slot]] == ref_greedy(ref_logits, p, 6), slot
    snap = eng.release("f3", snapshot=True)
    r.ds = eng._service(r.ds)
    block = snap.result(timeout=30).kv
    p2 = np.concatenate([ps[3], [t for t, _ in r.out[3]], rs.randint(0, 256, size=30).astype(np.int32)])
    done = eng.counters["prefill_tokens"]
    pre = eng.prefill(params=eng.params_ref, existing_prefix=block,
                      padded_tokens=pinput("f4", p2, max_tokens=6, temperature=0.0), true_length=0)
    assert eng.counters["prefill_tokens"] - done == len(p2) - 1 - block.length  # only the new tokens
    r.ds = eng.insert(pre, r.ds, 4)
    r.out[4], _ = [], r.live.add(4)
    r.step(7)
    assert [t for t, _ in r.out[4]] == ref_greedy(ref_logits, p2, 6)
    grew = {k: v - before[k] for k, v in sizes().items()}
    assert grew["prefill_new"] == grew["prefill_on"] == 0 and grew["prefill_into"] <= 1 and grew["insert"] <= 1, grew
