"""Bounded load: 64 concurrent multi-turn chat sessions through the live proxy and
two real engine cells. No errors, every call recorded once, latency reported."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from gyre_jax.model import init_params, model_config_tiny
from gyre_jax.serving import identity as P
from gyre_jax.serving.engine import GyreEngine
from gyre_jax.serving.jetstream_backend import JetStreamBackend
from gyre_jax.serving.proxy import Proxy, ProxyConfig
from gyre_jax.serving.router import Router
from gyre_jax.serving.server_thread import ServerThread
from gyre_jax.serving.tokenizer import ByteTokenizer
from gyre_jax.trajectory.store import TrajectoryStore

SESSIONS, TURNS = 64, 3


@pytest.mark.slow
def test_64_concurrent_multi_turn_sessions(tmp_path):
    cfg = model_config_tiny(vocab_size=272, max_seq_len=512)
    params = init_params(cfg, jax.random.key(0))
    tok = ByteTokenizer()
    store = TrajectoryStore(str(tmp_path / "store"), run_id="load")
    devs = jax.devices()

    async def build():
        cells = [JetStreamBackend(GyreEngine(cfg, params, mesh=Mesh(np.array([d]).reshape(1, 1), ("data", "tensor")),
                                             max_slots=32, max_len=512, name=f"cell{i}", tokens_per_call=4))
                 for i, d in enumerate(devs[:2])]
        return Proxy(Router(cells), tok, store, ProxyConfig(max_tokens_cap=64))

    st = ServerThread(build)
    st.start()
    lat: list[float] = []
    errors: list[str] = []

    async def session(s, i, tag="s", record_latency=True):
        msgs = [{"role": "system", "content": f"session {i}"}]
        for turn in range(TURNS):
            msgs.append({"role": "user", "content": f"turn {turn}: say something"})
            h = {P.HEADER_RUN: "load", P.HEADER_ROLLOUT: f"{tag}{i}", P.HEADER_TASK: "t", P.HEADER_GROUP: f"g{i % 8}",
                 P.HEADER_CALL: str(turn)}
            body = {"model": "gyre", "messages": msgs, "max_tokens": 24, "temperature": 1.0, "seed": i,
                    "stream": turn % 2 == 1}
            t0 = time.perf_counter()
            async with s.post(st.url + "/v1/chat/completions", json=body, headers=h) as r:
                text = await r.text()
            if record_latency:
                lat.append(time.perf_counter() - t0)
            if r.status != 200:
                errors.append(f"s{i} turn {turn}: {r.status} {text[:200]}")
                return
            if body["stream"]:
                content = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                                  for line in text.split("\n") if line.startswith("data: {"))
            else:
                content = json.loads(text)["choices"][0]["message"]["content"]
            msgs.append({"role": "assistant", "content": content})

    async def main():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            # Warm-up (compiles the prefill buckets and the step on both cells), not timed.
            await asyncio.gather(*(session(s, i, "warm", False) for i in range(4)))
            t0 = time.perf_counter()
            await asyncio.gather(*(session(s, i) for i in range(SESSIONS)))
            return time.perf_counter() - t0

    try:
        wall = asyncio.run(main())
        stats = {n: b.stats() for n, b in st.proxy.router.cells.items()}
    finally:
        st.stop()
    assert not errors, errors[:5]
    p50, p99 = np.percentile(lat, 50), np.percentile(lat, 99)
    cached = sum(s["cached_tokens"] for s in stats.values())
    print(f"\n{SESSIONS} sessions x {TURNS} turns in {wall:.1f}s: call latency p50 {p50:.3f}s p99 {p99:.3f}s; "
          f"prefix-cache tokens reused {cached:.0f}; per cell calls "
          f"{ {n: s['submitted'] for n, s in stats.items()} }")
    for i in range(SESSIONS):
        recs = store.calls(f"s{i}")
        assert [r.call_index for r in recs] == list(range(TURNS))
        for a, b in zip(recs, recs[1:]):  # each turn's prompt extends the previous call
            assert b.prompt_ids[: len(a.prompt_ids)].tolist() == a.prompt_ids.tolist()
    assert store.stats().calls == (SESSIONS + 4) * TURNS
    store.close()
