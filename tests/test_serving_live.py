"""The real engine (GyreEngine under JetStream's orchestrator) behind the live
proxy on loopback, driven by a real HTTP client (aiohttp).

Two cells: A on device 0, B tensor-parallel over devices 2-3 (another sharding,
so a moved KV prefix really crosses devices and layouts) and running 4 decode
steps per generate call. Outputs are checked
against a plain full-forward reference decode; records against the tokens.
"""
from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from gyre_jax.model import Transformer
from gyre_jax.serving import identity as P
from gyre_jax.serving.engine import GyreEngine
from gyre_jax.serving.jetstream_backend import JetStreamBackend
from gyre_jax.serving.proxy import Proxy, ProxyConfig
from gyre_jax.serving.router import Router
from gyre_jax.serving.server_thread import ServerThread
from gyre_jax.serving.tokenizer import ByteTokenizer
from gyre_jax.testing.tiny_serving_model import CFG, sharp_params
from gyre_jax.trajectory.store import TrajectoryStore

SLOTS, MAX_LEN = 16, 256
LOGP_ATOL = 1e-4  # float32 cached decode vs full forward (see test_serving_engine)
TOK = ByteTokenizer()
CHAT_STOPS = tuple(TOK.stop_ids)
EOS = TOK.special["<|eos|>"]


class HookedEngine(GyreEngine):
    """GyreEngine with two test hooks: a gate that holds the generate thread, and
    poisoned prompts whose prefill raises (an engine failure for one request)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gate = threading.Event()
        self.gate.set()
        self.open_after_detaches: int | None = None
        self._detaches = 0
        self.poison: set[int] = set()

    def generate(self, params, decode_state):
        self.gate.wait()
        return super().generate(params, decode_state)

    def detach(self, request_id, *, export):
        fut = super().detach(request_id, export=export)
        self._detaches += 1
        if self.open_after_detaches is not None and self._detaches >= self.open_after_detaches:
            self.gate.set()
        return fut

    fail_moved_imports = False

    def _prefill(self, params, inp):
        if inp.tokens.size and int(inp.tokens[0]) in self.poison:
            raise RuntimeError("poisoned prompt")
        if self.fail_moved_imports and inp.kv is not None and inp.kv_origin == "moved":
            raise RuntimeError("KV import failed (injected)")
        return super()._prefill(params, inp)


@pytest.fixture(scope="module")
def params():
    return sharp_params()


@pytest.fixture(scope="module")
def ref(params):
    f = jax.jit(lambda p, x, n: Transformer(CFG).apply(
        p, x[None], jnp.arange(MAX_LEN)[None], (jnp.arange(MAX_LEN) < n).astype(jnp.int32)[None],
        jnp.full((1, MAX_LEN), MAX_LEN, jnp.int32))[0])

    class Ref:
        def logits(self, seq, p=params):
            x = np.zeros(MAX_LEN, np.int32)
            x[: len(seq)] = seq
            return np.asarray(f(p, x, len(seq)), np.float64)[: len(seq)]

        def greedy(self, prompt, n, stop=(), p=params):
            seq = list(int(t) for t in prompt)
            for _ in range(n):
                t = int(np.argmax(self.logits(seq, p)[-1]))
                seq.append(t)
                if t in stop:
                    break
            return seq[len(prompt):]

        def logprobs(self, prompt, out):
            lg = self.logits(list(prompt) + list(out))[len(prompt) - 1: -1]
            lg = lg - lg.max(-1, keepdims=True)
            lp = lg - np.log(np.exp(lg).sum(-1, keepdims=True))
            return lp[np.arange(len(out)), out]

    return Ref()


@pytest.fixture(scope="module")
def server(params, tmp_path_factory):
    store = TrajectoryStore(str(tmp_path_factory.mktemp("store")), run_id="run1")
    devs = jax.devices()
    eng_a = HookedEngine(CFG, params, mesh=Mesh(np.array(devs[:1]).reshape(1, 1), ("data", "tensor")),
                       max_slots=SLOTS, max_len=MAX_LEN, name="A")
    eng_b = HookedEngine(CFG, params, mesh=Mesh(np.array(devs[2:4]).reshape(1, 2), ("data", "tensor")),
                       max_slots=SLOTS, max_len=MAX_LEN, name="B", tokens_per_call=4)  # 4 decode steps per call

    async def build():
        router = Router([JetStreamBackend(eng_a), JetStreamBackend(eng_b)])
        return Proxy(router, TOK, store, ProxyConfig(max_tokens_cap=200))

    st = ServerThread(build)
    st.start()
    st.engines = {"A": eng_a, "B": eng_b}
    yield st, store
    st.stop()
    store.close()


def hdr(rollout, call=None):
    h = {P.HEADER_RUN: "run1", P.HEADER_ROLLOUT: rollout, P.HEADER_TASK: "t", P.HEADER_GROUP: "g"}
    if call is not None:
        h[P.HEADER_CALL] = str(call)
    return h


async def _post(url, body, h):
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json=body, headers=h) as r:
            return r.status, await r.text()


def post(url, body, h):
    return asyncio.run(_post(url, body, h))


def sse(text):
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines.get("event"), lines["data"] if lines["data"] == "[DONE]" else json.loads(lines["data"])))
    return out


def check_record(rec, prompt, out, ref, finish):
    assert rec.prompt_ids.tolist() == list(prompt)
    assert rec.output_ids.tolist() == list(out)
    np.testing.assert_allclose(rec.output_logprobs, ref.logprobs(prompt, out), rtol=0, atol=LOGP_ATOL)
    assert rec.finish_reason == finish and rec.policy_version == 0


def test_openai_chat_whole_and_streamed(server, ref):
    st, store = server
    msgs = [{"role": "user", "content": "Write a haiku about caches."}]
    prompt = TOK.render_chat(msgs)
    want = ref.greedy(prompt, 24, stop=CHAT_STOPS)
    body = {"model": "gyre", "messages": msgs, "max_tokens": 24, "temperature": 0}
    status, text = post(st.url + "/v1/chat/completions", body, hdr("chat", 0))
    assert status == 200, text
    msg = json.loads(text)["choices"][0]["message"]
    assert msg["content"] == TOK.parse_assistant(want)["content"]
    status, text = post(st.url + "/v1/chat/completions", {**body, "stream": True}, hdr("chat", 1))
    assert status == 200, text
    chunks = [d for _, d in sse(text)[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == msg["content"]
    recs = store.calls("chat")
    assert len(recs) == 2
    fin = "stop" if want[-1] in CHAT_STOPS else "length"
    for r in recs:
        check_record(r, prompt, want, ref, fin)


def test_completions_token_ids_sampled_stream_equals_whole(server, ref):
    st, store = server
    prompt = [int(x) for x in np.random.RandomState(7).randint(0, 256, 30)]
    body = {"model": "gyre", "prompt": prompt, "max_tokens": 20, "temperature": 1.0, "seed": 1234,
            "return_token_ids": True}
    status, text = post(st.url + "/v1/completions", body, hdr("comp", 0))
    assert status == 200, text
    out = json.loads(text)["choices"][0]["token_ids"]
    status, text = post(st.url + "/v1/completions", {**body, "stream": True}, hdr("comp", 1))
    streamed = [t for _, d in sse(text)[:-1] for t in d["choices"][0].get("token_ids", [])]
    assert streamed == out  # sampling depends on the seed and position only
    recs = store.calls("comp")
    assert len(recs) == 2
    for r in recs:
        check_record(r, prompt, out, ref, "stop" if out[-1] == EOS else "length")


def test_anthropic_messages_stream(server, ref):
    st, store = server
    body = {"model": "gyre", "max_tokens": 16, "temperature": 0, "stream": True, "system": "terse",
            "messages": [{"role": "user", "content": "hi"}]}
    status, text = post(st.url + "/v1/messages", body, {"x-api-key": P.api_key("run1", "anth")})
    assert status == 200, text
    events = sse(text)
    assert events[0][0] == "message_start" and events[-1][0] == "message_stop"
    prompt = TOK.render_chat([{"role": "system", "content": "terse"}, {"role": "user", "content": "hi"}])
    want = ref.greedy(prompt, 16, stop=CHAT_STOPS)
    text_out = "".join(d["delta"].get("text", "") for e, d in events if e == "content_block_delta")
    assert text_out == TOK.parse_assistant(want)["content"]
    (rec,) = store.calls("anth")
    check_record(rec, prompt, want, ref, "stop" if want[-1] in CHAT_STOPS else "length")


def test_multi_turn_reuses_cached_prefix(server, ref):
    st, store = server
    msgs = [{"role": "user", "content": "Count to three."}]
    body = {"model": "gyre", "messages": msgs, "max_tokens": 12, "temperature": 0}
    status, text = post(st.url + "/v1/chat/completions", body, hdr("multi"))
    assert status == 200
    (r1,) = store.calls("multi")
    for b in st.proxy.router.cells.values():
        st.run(b.settle())  # turn 1's KV is in the prefix cache
    engines = st.engines.values()
    before = {k: sum(e.counters[k] for e in engines) for k in ("prefill_tokens", "cached_tokens")}
    turn2 = [int(t) for t in r1.sequence] + TOK.encode("\n") + TOK.render_chat([{"role": "user", "content": "Again."}])[1:]
    status, text = post(st.url + "/v1/completions", {"model": "gyre", "prompt": turn2, "max_tokens": 10,
                                                     "temperature": 0, "return_token_ids": True}, hdr("multi"))
    assert status == 200, text
    got = json.loads(text)["choices"][0]["token_ids"]
    assert got == ref.greedy(turn2, 10, stop=(EOS,))
    cached = sum(e.counters["cached_tokens"] for e in engines) - before["cached_tokens"]
    computed = sum(e.counters["prefill_tokens"] for e in engines) - before["prefill_tokens"]
    assert cached == len(r1.sequence) - 1 and computed == len(turn2) - 1 - cached


def drain_while_streaming(st, prompts, n_tok, tag):
    """Stream one call per prompt from A; once every call has 3 tokens, drain A
    (B admitting). Returns (tokens each client saw, drain result)."""
    router, eng_a = st.proxy.router, st.engines["A"]
    n = len(prompts)
    st.run(router.drain("B"))  # so every call lands on A
    got = {i: [] for i in range(n)}

    async def client(i, progress, all_started):
        body = {"model": "gyre", "prompt": prompts[i], "max_tokens": n_tok, "temperature": 0, "stream": True,
                "return_token_ids": True}
        async with aiohttp.ClientSession() as s:
            async with s.post(st.url + "/v1/completions", json=body, headers=hdr(f"{tag}-{i}", 0)) as r:
                assert r.status == 200
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        got[i] += json.loads(line[6:])["choices"][0].get("token_ids", [])
                        if len(got[i]) >= 3 and i not in progress:
                            progress.add(i)
                            if len(progress) == n:
                                all_started.set()

    async def main():
        progress, all_started = set(), asyncio.Event()
        tasks = [asyncio.create_task(client(i, progress, all_started)) for i in range(n)]
        await all_started.wait()  # every call is streaming from A
        eng_a.open_after_detaches, eng_a._detaches = n, 0
        eng_a.gate.clear()  # hold A's generate thread until every export is queued
        await st.run_async(router.admit("B"))
        result = await st.run_async(router.drain("A"))
        await asyncio.gather(*tasks)
        return result

    try:
        result = asyncio.run(main())
    finally:
        eng_a.open_after_detaches = None
        eng_a.gate.set()
        st.run(router.admit("A"))
    return got, result


def test_drain_moves_live_calls_with_their_kv(server, ref):
    st, store = server
    router, eng_b = st.proxy.router, st.engines["B"]
    rs = np.random.RandomState(11)
    prompts = [[int(x) for x in rs.randint(0, 256, int(rs.randint(5, 40)))] for _ in range(16)]
    wants = [ref.greedy(p, 60, stop=(EOS,)) for p in prompts]
    assert all(len(w) > 8 for w in wants)  # each call is still running when the drain starts
    moved_before, prefill_b = eng_b.counters["moved_tokens"], eng_b.counters["prefill_tokens"]
    kv_before = router.counters["moves_kv"]
    got, result = drain_while_streaming(st, prompts, 60, "drain")
    assert result == {"exported": 16, "finished_in_place": 0}
    for i in range(16):
        assert got[i] == wants[i], i
        (rec,) = store.calls(f"drain-{i}")  # exactly one record, with every token
        assert rec.output_ids.tolist() == wants[i] and rec.prompt_ids.tolist() == prompts[i]
    # the KV prefixes moved: B imported them and recomputed none of those tokens
    moved = eng_b.counters["moved_tokens"] - moved_before
    assert eng_b.counters["prefill_tokens"] == prefill_b
    assert moved >= sum(len(p) + 3 - 1 for p in prompts)
    assert router.counters["moves_kv"] - kv_before == 16 and router.counters["moves_recompute"] == 0


def test_failed_kv_import_falls_back_to_recompute(server, ref):
    st, store = server
    router, eng_b = st.proxy.router, st.engines["B"]
    rs = np.random.RandomState(12)
    prompts = [[int(x) for x in rs.randint(0, 256, int(rs.randint(5, 40)))] for _ in range(4)]
    wants = [ref.greedy(p, 40, stop=(EOS,)) for p in prompts]
    assert all(len(w) > 8 for w in wants)
    prefill_b = eng_b.counters["prefill_tokens"]
    eng_b.fail_moved_imports = True
    try:
        got, result = drain_while_streaming(st, prompts, 40, "recompute")
    finally:
        eng_b.fail_moved_imports = False
    assert result == {"exported": 4, "finished_in_place": 0}
    assert router.counters["moves_recompute"] == 4
    for i in range(4):
        assert got[i] == wants[i], i
        (rec,) = store.calls(f"recompute-{i}")
        assert rec.output_ids.tolist() == wants[i]
    assert eng_b.counters["prefill_tokens"] - prefill_b >= sum(len(p) + 3 - 1 for p in prompts)


def test_engine_error_fails_that_request_only(server):
    st, _ = server
    st.engines["A"].poison.add(250)
    st.engines["B"].poison.add(250)

    async def go():
        return await asyncio.gather(
            _post(st.url + "/v1/completions", {"model": "gyre", "prompt": [250, 1, 2], "max_tokens": 4}, hdr("poison", 0)),
            _post(st.url + "/v1/completions", {"model": "gyre", "prompt": [10, 1, 2], "max_tokens": 4}, hdr("fine", 0)))

    (s1, t1), (s2, t2) = asyncio.run(go())
    assert s1 == 500 and "poisoned prompt" in t1
    assert s2 == 200, t2
    assert post(st.url + "/v1/completions", {"model": "gyre", "prompt": [11, 1], "max_tokens": 2}, hdr("fine", 1))[0] == 200


def test_weight_publication_between_drain_and_admit(server, ref):
    st, store = server
    router, eng_a = st.proxy.router, st.engines["A"]
    new = sharp_params(seed=1)
    st.run(router.drain("B"))
    st.run(router.drain("A"))
    eng_a.publish(new, version=1)
    st.run(router.admit("A"))
    try:
        prompt = [5, 6, 7, 8, 9]
        status, text = post(st.url + "/v1/completions", {"model": "gyre", "prompt": prompt, "max_tokens": 6,
                                                         "temperature": 0, "return_token_ids": True}, hdr("pub", 0))
        assert status == 200, text
        assert json.loads(text)["choices"][0]["token_ids"] == ref.greedy(prompt, 6, stop=(EOS,), p=new)
        (rec,) = store.calls("pub")
        assert rec.policy_version == 1
    finally:
        st.run(router.admit("B"))
