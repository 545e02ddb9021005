"""Rollout routing replay (R3) for MoE models, end to end on a tiny MoE model.

The real engine (GyreEngine under JetStream) behind the live proxy records each sampled
token's experts with its call; the store keeps them; the tree and packing put them at each
trained token's predicting position; the training forward with ``routing_replay`` then
reproduces the recorded behaviour log-probs to LOGP_ATOL, the tolerance the dense model's
records meet (tests/test_serving_live.check_record), and uses the recorded experts (rotated
ids break it). With replay off, the routing-mismatch count is 0 at the sampling params and
> 0 after an update. Model-level: decode's recorded routing replayed by the packed forward
gives decode's logits, and foreign routing changes them while the router still trains.
"""
from __future__ import annotations

import asyncio
import json

import aiohttp
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gyre_jax.cells.loss import policy_loss_fn
from gyre_jax.losses import PolicyLossConfig
from gyre_jax.model import Transformer, init_params, model_config_tiny
from gyre_jax.model import decode as dec
from gyre_jax.model.transformer import moe_stats
from gyre_jax.rl.report import routing_metrics
from gyre_jax.serving import identity as P
from gyre_jax.serving.engine import GyreEngine
from gyre_jax.serving.jetstream_backend import JetStreamBackend
from gyre_jax.serving.proxy import Proxy, ProxyConfig
from gyre_jax.serving.router import Router
from gyre_jax.serving.server_thread import ServerThread
from gyre_jax.serving.tokenizer import ByteTokenizer
from gyre_jax.trajectory.binpack import pack_trees
from gyre_jax.trajectory.store import TrajectoryStore
from gyre_jax.trajectory.tree import build_tree

LOGP_ATOL = 1e-4  # float32 cached decode vs full forward (tests/test_serving_live.py, dense)
ATOL = 1e-5
# Three layers, the middle one dense: two MoE stacks around a dense one, so the recorded
# [R = 2 MoE layers x top-2] ids must be split across stacks in order.
CFG = model_config_tiny(vocab_size=272, max_seq_len=128, n_layers=3, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=16, mlp_only_layers=(1,))
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.key(0))


# ---- model level -------------------------------------------------------------------------------
def _decode_routing(params, seq, start):
    """Prefill seq[:start], then decode seq[start:] one token at a time: (logits, routing) per position."""
    _, kv = jax.jit(dec.prefill, static_argnums=1)(params, CFG, jnp.asarray(seq[:start]))
    cache = dec.insert(dec.init_cache(CFG, 1, 32), kv, 0)
    step = jax.jit(dec.decode_step, static_argnums=1, static_argnames="with_routing")
    logits, routing = [], []
    for t in range(start, len(seq)):
        lg, cache, r = step(params, CFG, jnp.asarray([seq[t]], jnp.int32), cache, with_routing=True)
        logits.append(np.asarray(lg[0]))
        routing.append(np.asarray(r[0]))
    return np.stack(logits), np.stack(routing)


def _row(n):
    return (np.arange(n, dtype=np.int32)[None], np.ones((1, n), np.int32), np.full((1, n), n, np.int32))


@pytest.mark.slow  # ~30 CPU-s of compiles (decode, two forwards, a gradient); the proxy tests below cover the path
def test_decode_routing_replayed_by_the_packed_forward(params):
    seq = np.random.default_rng(5).integers(1, CFG.vocab_size, 12).astype(np.int32)
    n, start = len(seq), 6
    logits_dec, routing_dec = _decode_routing(params, seq, start)
    assert routing_dec.shape == (n - start, CFG.routing_width) and routing_dec.max() < CFG.num_experts
    pos, seg, end = _row(n)
    routing = np.full((1, n, CFG.routing_width), -1, np.int16)
    routing[0, start:] = routing_dec  # decode's step t routed the token at position t
    replay = CFG.replace(routing_replay=True)
    fwd = jax.jit(lambda p, r, c: Transformer(c).apply(p, seq[None], pos, seg, end, routing_BxLxR=r,
                                                       mutable=["intermediates"]), static_argnums=2)
    logits, inter = fwd(params, routing, replay)
    np.testing.assert_allclose(np.asarray(logits[0, start:]), logits_dec, atol=ATOL, rtol=0)
    assert float(jnp.sum(moe_stats(inter).mismatch)) == 0  # same params: live routing is what decode chose

    # Routing a decode under other weights chose: replayed, it changes the logits and is counted as mismatched.
    _, foreign = _decode_routing(init_params(CFG, jax.random.key(1)), seq, start)
    routing[0, start:] = foreign
    live, inter_live = fwd(params, routing, CFG)  # replay off: only compared
    np.testing.assert_allclose(np.asarray(live[0, start:]), logits_dec, atol=ATOL, rtol=0)
    differs = np.any(np.sort(foreign.reshape(-1, 2, 2), -1) != np.sort(routing_dec.reshape(-1, 2, 2), -1), (1, 2))
    assert differs.any()
    got_mismatch = np.asarray(jnp.max(moe_stats(inter_live).mismatch, 0)).reshape(n)[start:] > 0
    np.testing.assert_array_equal(got_mismatch, differs)
    forced, _ = fwd(params, routing, replay)
    assert np.abs(np.asarray(forced[0, start:]) - logits_dec).max(-1)[differs].min() > 1e-3


@pytest.mark.parametrize("experts, width", [(128, 384), (512, 6), (4, 3)])
def test_result_row_routing_round_trips(experts, width):
    """The engine packs each token's R expert ids into int32 result columns (4 per word up to 256 experts,
    else 2); the host unpacks exactly those ids, beside their token and log-prob."""
    from gyre_jax.serving.engine_state import HELD_MARK, RoutingLayout, decode_result_steps

    lay = RoutingLayout(width, 1 if experts <= 256 else 2)
    ids = np.random.default_rng(0).integers(0, experts, (3, width)).astype(np.int32)
    words = np.asarray(lay.pack(jnp.asarray(ids)))
    assert words.shape == (3, -(-width * lay.itemsize // 4)) and words.dtype == np.int32
    lp = np.array([-0.5, -1.0, -2.0], np.float32).view(np.int32)
    row = np.concatenate([np.stack([[7, HELD_MARK, 9], lp], 1), words], 1).reshape(-1)
    got = decode_result_steps(row, lay)
    assert [(t, p) for t, p, _ in got] == [(7, -0.5), (9, -2.0)]  # the held marker's step is dropped
    for (_, _, r), want in zip(got, ids[[0, 2]]):
        assert r.dtype == lay.dtype and r.tolist() == want.tolist()


# ---- through the engine, the proxy and the store ----------------------------------------------
@pytest.fixture(scope="module")
def rollout(params, tmp_path_factory):
    """One rollout of three calls through the live proxy: a first turn, a retry of it (another seed: the
    tree branches after the shared prompt) and a second turn that extends the first."""
    store = TrajectoryStore(str(tmp_path_factory.mktemp("store")), run_id="run1")
    # Paged cache and 2 decode steps per generate call: routing rides through the scan over steps and the
    # paged decode (the contiguous cache's decode records the same way: the model-level test above).
    engine = GyreEngine(CFG, params, max_slots=4, max_len=128, name="A", tokens_per_call=2, kv_cache="paged",
                        page_size=16)

    async def build():
        return Proxy(Router([JetStreamBackend(engine)]), TOK, store, ProxyConfig(max_tokens_cap=64))

    st = ServerThread(build)
    st.start()

    def complete(prompt, call, seed, n):
        body = {"model": "gyre", "prompt": [int(t) for t in prompt], "max_tokens": n, "temperature": 1.0,
                "seed": seed, "return_token_ids": True}
        h = {P.HEADER_RUN: "run1", P.HEADER_ROLLOUT: "rr", P.HEADER_TASK: "t", P.HEADER_GROUP: "g",
             P.HEADER_CALL: str(call)}

        async def go():
            async with aiohttp.ClientSession() as s:
                async with s.post(st.url + "/v1/completions", json=body, headers=h) as r:
                    return r.status, await r.text()

        status, text = asyncio.run(go())
        assert status == 200, text
        return json.loads(text)["choices"][0]["token_ids"]

    try:
        prompt = np.random.RandomState(3).randint(0, 256, 20)
        out0 = complete(prompt, 0, 11, 12)
        complete(prompt, 1, 12, 12)
        complete(list(prompt) + out0 + list(np.random.RandomState(4).randint(0, 256, 5)), 2, 13, 10)
    finally:
        st.stop()
    recs = store.calls("rr")
    store.close()
    return recs


def test_records_carry_one_routing_row_per_output_token(rollout):
    assert len(rollout) == 3
    for r in rollout:
        assert r.output_routing is not None and r.output_routing.dtype == np.uint8
        assert r.output_routing.shape == (r.output_ids.shape[0], CFG.routing_width)
        assert int(r.output_routing.max()) < CFG.num_experts


@pytest.fixture(scope="module")
def rows(rollout):
    tree = build_tree(rollout)
    pack = pack_trees([tree], [1.0], 128, routing_width=CFG.routing_width)
    assert len(tree.children) >= 2 or any(len(n.children) >= 2 for n in tree.walk())  # the retry branches
    return pack.rows


def _batch(rows, **over):
    d = {k: jnp.asarray(v) for k, v in rows.as_dict().items()}
    return {**d, **{k: jnp.asarray(v) for k, v in over.items()}}


def test_replayed_training_forward_reproduces_behaviour_logprobs(params, rows):
    mask = rows.loss_mask
    assert (rows.routing[..., 0] >= 0).sum() == mask.sum()  # every trained token has its routing, no other
    logp = jax.jit(policy_loss_fn(CFG.replace(routing_replay=True)).logprob_fn)
    got = np.asarray(logp(params, _batch(rows)))
    np.testing.assert_allclose(got[mask], rows.behavior_logprobs[mask], rtol=0, atol=LOGP_ATOL)
    # The forward really uses the records: rotated expert ids miss the behaviour log-probs.
    rotated = np.where(rows.routing >= 0, (rows.routing + 1) % CFG.num_experts, -1).astype(np.int16)
    bad = np.asarray(logp(params, _batch(rows, routing=rotated)))
    assert np.abs(bad[mask] - rows.behavior_logprobs[mask]).max() > 1e-2


def test_routing_mismatch_is_zero_at_the_sampling_params_and_positive_after_an_update(params, rows):
    loss_off = policy_loss_fn(CFG, PolicyLossConfig())
    metrics = jax.jit(lambda p, mb: loss_off(p, mb)[1])
    m0 = jax.device_get(metrics(params, _batch(rows)))
    assert m0["routing_recorded_tokens"] == rows.loss_mask.sum() > 0
    assert m0["routing_mismatch_tokens"] == 0 and routing_metrics(m0)["routing_mismatch"] == 0.0
    loss_on = policy_loss_fn(CFG.replace(routing_replay=True), PolicyLossConfig())
    grads = jax.jit(jax.grad(lambda p, mb: loss_on(p, mb)[0]))(params, _batch(rows))
    for stack in ("layers_0", "layers_2"):  # R3: the live router weights the replayed experts, so it trains
        assert float(jnp.abs(grads["params"][stack]["moe"]["router"]).max()) > 0, stack
    updated = jax.tree.map(lambda p, g: p - 50.0 * g, params, grads)  # one large plain gradient step
    m1 = jax.device_get(metrics(updated, _batch(rows)))
    assert m1["routing_mismatch_tokens"] > 0, m1
    assert 0 < routing_metrics(m1)["routing_mismatch"] <= 1
    on = jax.device_get(jax.jit(lambda p, mb: loss_on(p, mb)[1])(updated, _batch(rows)))
    assert on["routing_mismatch_tokens"] > 0  # with replay on: the tokens replay kept on their sampled experts


# ---- a moved call recomputed from its tokens ------------------------------------------------------
def _tied(params, eps=1e-7):
    """Experts 0-2 of every MoE layer get one router column up to ``eps``: near-ties that the float
    differences between prefill and decode break either way, as a bf16 engine's routing often is."""
    def tie(path, x):
        if "router" not in jax.tree_util.keystr(path):
            return x
        r = np.asarray(x).copy()  # [1, D, E]
        r[..., :3] = 4 * r[..., :1] + eps * np.random.RandomState(0).randn(*r[..., :3].shape).astype(np.float32)
        return jnp.asarray(r)

    return jax.tree_util.tree_map_with_path(tie, params)


def test_a_recomputed_cache_replays_its_decode_routing(params):
    """A call decoded 24 tokens (every position but the first computed by decode, each recording its
    experts); recomputing its cache from the tokens with those experts replayed gives decode's cache
    (the fallback of a move without KV); routed live, the prefill picks other experts among the tied ones."""
    from gyre_jax.serving.backend import SamplingParams
    from gyre_jax.serving.engine_state import PrefillInput, decode_result_steps
    from gyre_jax.serving.jetstream_backend import replay_rows

    engine = GyreEngine(CFG, _tied(params), max_slots=2, max_len=64, name="tied")
    prompt = np.array([7, 42], np.int32)
    ds = engine.init_decode_state()
    pre = engine.prefill(params=engine.params_ref, padded_tokens=PrefillInput(
        "a", prompt[:-1], int(prompt[-1]), 0, SamplingParams(max_tokens=40, seed=5)), true_length=1)
    ds = engine.insert(pre, ds, 0)
    toks, rows = [], []
    for _ in range(24):
        ds, res = engine.generate(engine.params_ref, ds)
        for t, _, r in decode_result_steps(np.asarray(res.data)[0, :res.tokens_idx[1]], engine.result_layout):
            toks.append(t)
            rows.append(r)
    n = len(prompt) + len(toks) - 1  # the slot holds seq[:-1]
    seq = np.concatenate([prompt, toks]).astype(np.int32)
    decoded = [np.stack([np.asarray(c[0, :n]) for c in cache]) for cache in (ds.cache.k, ds.cache.v)]
    err = {}
    for how, routing in (("replayed", replay_rows(len(prompt), np.stack(rows))), ("live", None)):
        inp = PrefillInput(how, seq[:-1], int(seq[-1]), len(toks), SamplingParams(max_tokens=40), routing=routing)
        pre = engine.prefill(params=engine.params_ref, padded_tokens=inp, true_length=n)
        assert engine.pop_error(how) is None
        err[how] = max(float(np.abs(np.asarray(got)[:, :n] - want).max())
                       for got, want in zip((pre.k, pre.v), decoded))
    assert err["replayed"] <= ATOL and err["live"] > 1e-2, err


def test_a_call_moved_without_kv_hands_its_routing_to_the_recompute(params):
    """Through the backend: a call exported after a few tokens carries their recorded routing in its
    ResumeState; resumed without its KV (as after a failed export or import) its prefill gets those
    rows at the positions decode computed (the test above: then the cache is decode's) and it
    finishes its tokens. (Comparing the continuation's samples instead would test the near-tied
    router: decode re-routes each new token live, and any 1e-6 apart flips a tie either way.)"""
    from gyre_jax.serving.backend import GenerateRequest, SamplingParams
    from gyre_jax.serving.jetstream_backend import replay_rows
    from tests.test_serving_live import HookedEngine

    class Recording(HookedEngine):
        def _prefill(self, params, inp):
            self.inputs.append(inp)
            return super()._prefill(params, inp)

    engine = Recording(CFG, _tied(params), max_slots=2, max_len=64, name="tied")
    engine.inputs = []
    backend = JetStreamBackend(engine)
    prompt = np.array([7, 42, 9], np.int32)
    sp = SamplingParams(max_tokens=24, seed=5)

    async def main():
        stream, got = backend.submit(GenerateRequest(request_id="moved", prompt_ids=prompt, sampling=sp)), []
        async for ev in stream:
            got.append((ev.token_id, ev.routing))
            if len(got) == 4:  # export; the generate thread is held until the export is queued
                engine.open_after_detaches, engine._detaches = 1, 0
                engine.gate.clear()
                assert await backend.export("moved")
        assert stream.finish == "moved" and stream.resume is not None
        state = stream.resume.without_kv()
        rest = [ev.token_id async for ev in backend.submit(GenerateRequest(
            request_id="moved", prompt_ids=prompt, sampling=sp, resume=state))]
        return got, state, rest

    try:
        got, state, rest = asyncio.run(main())
    finally:
        engine.gate.set()
        asyncio.run(backend.close())
    g = len(got)
    assert 4 <= g < 24 and len(rest) == 24 - g
    rows = np.stack([r for _, r in got])
    np.testing.assert_array_equal(state.output_routing, rows)
    first, again = engine.inputs
    assert first.routing is None  # a fresh call: its prompt is routed live
    want = np.full((len(prompt) + g - 1, CFG.routing_width), -1)
    want[len(prompt) - 1:] = rows  # the last prompt token and the outputs but the last: decode's positions
    np.testing.assert_array_equal(again.routing, want)
    np.testing.assert_array_equal(replay_rows(len(prompt), rows), want)
