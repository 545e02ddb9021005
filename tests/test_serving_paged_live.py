"""A paged engine behind JetStream's real threads: concurrent calls sharing prefixes, a pool too
small for all of them at once (admission waits for pages), and (slow) a drain that moves live
calls, with their pages' contents, to a contiguous cell. Every call's greedy tokens equal the
full-forward reference, and afterwards only the prefix cache holds pages."""
from __future__ import annotations

import asyncio
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from gyre_jax.serving.backend import GenerateRequest, SamplingParams
from gyre_jax.serving.engine import GyreEngine
from gyre_jax.serving.jetstream_backend import JetStreamBackend
from gyre_jax.serving.router import Router
from gyre_jax.testing.tiny_serving_model import CFG, sharp_params
from tests.test_serving_engine import params, ref_greedy, ref_logits  # noqa: F401

BOUND_S = 120.0
# Every engine here has one shape (slots, length, steps per call, pages of 8), so the last test's
# engine compiles nothing the first one's did not (the run's compilation cache answers it).
KW = dict(max_slots=8, max_len=256, tokens_per_call=4)
PAGED = dict(KW, kv_cache="paged", page_size=8)


def _requests():
    rs = np.random.RandomState(11)
    heads = [rs.randint(0, 256, size=n).astype(np.int32) for n in (37, 52)]
    out = []
    for i in range(6):  # two rollouts of three calls, each call its own tail
        prompt = np.concatenate([heads[i // 3], rs.randint(0, 256, size=3 + 4 * i).astype(np.int32)])
        out.append(GenerateRequest(request_id=f"q{i}", prompt_ids=prompt,
                                   sampling=SamplingParams(max_tokens=24, temperature=0.0)))
    return out


async def _run(paged_pages: int | None, drain: bool):
    weights = sharp_params()
    devs = jax.devices()

    def mesh(i):
        return Mesh(np.array(devs[i:i + 1]).reshape(1, 1), ("data", "tensor"))

    paged = GyreEngine(CFG, weights, mesh=mesh(0), name="p", **PAGED, kv_pages=paged_pages)  # serves every call first
    other = GyreEngine(CFG, weights, mesh=mesh(1), name="c", **KW)
    router = Router([JetStreamBackend(paged), JetStreamBackend(other)], wait_for_cell_s=BOUND_S)
    await router.drain("c")  # everything starts on the paged cell
    outs: dict[str, list[int]] = {}
    started = asyncio.Event()

    async def one(req):
        call = router.start(req, affinity="rollout")
        toks = []
        async for ev in call:
            toks.append(ev.token_id)
            if len(toks) == 6:
                started.set()
        outs[req.request_id] = toks

    try:
        tasks = [asyncio.create_task(one(r)) for r in _requests()]
        if drain:
            await asyncio.wait_for(started.wait(), BOUND_S)
            await router.admit("c")
            await asyncio.wait_for(router.drain("p"), BOUND_S)  # live calls move with their KV
        await asyncio.wait_for(asyncio.gather(*tasks), BOUND_S)
        deadline = time.monotonic() + BOUND_S  # the ended calls' releases reach the generate thread
        while paged.kv_stats()["pages_in_use"] != paged.kv_stats()["prefix_cache_pages"]:
            assert time.monotonic() < deadline, paged.kv_stats()
            await asyncio.sleep(0.02)
        stats = paged.kv_stats()
        waits = paged.counters["page_waits"]
        shared = paged.counters["shared_page_tokens"]
        moved = other.counters["moved_tokens"]
    finally:
        await router.close()
    return outs, stats, waits, shared, moved


def _reference(ref_logits):  # noqa: F811
    return {r.request_id: ref_greedy(ref_logits, r.prompt_ids, r.sampling.max_tokens) for r in _requests()}


def test_paged_cell_under_jetstream_threads(ref_logits):  # noqa: F811
    # 14 usable pages of 8 tokens: a call needs 8-13 (prompt + 24 new), a rollout's second call
    # 5 more when it maps the first one's prefix pages, so calls wait for pages and share them.
    outs, stats, waits, shared, _ = asyncio.run(_run(15, drain=False))
    assert outs == _reference(ref_logits) and all(len(t) == 24 for t in outs.values())
    assert waits > 0 and shared > 0
    assert stats["pages_in_use"] == stats["prefix_cache_pages"] and stats["pages_reserved"] == 0


@pytest.mark.slow  # ~80 s here: a second pair of engines and a drain
def test_drain_moves_paged_calls_to_a_contiguous_cell(ref_logits):  # noqa: F811
    outs, stats, _, _, moved = asyncio.run(_run(None, drain=True))
    assert outs == _reference(ref_logits) and moved > 0
    assert stats["pages_in_use"] == stats["prefix_cache_pages"] and stats["pages_reserved"] == 0


def test_next_call_maps_the_previous_answer_pages_stored_once(ref_logits):  # noqa: F811
    """Turn 2 of a rollout (same cache key) re-sends turn 1's answer through a paged cell behind
    JetStream's threads: turn 1's pages, answer included, are in the engine's page cache and the
    backend keeps no copied block beside them (each byte once); turn 2 maps those pages and
    computes only its new tokens; both turns' greedy tokens equal the reference."""
    eng = GyreEngine(CFG, sharp_params(), **PAGED, kv_pages=15)
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    p1 = np.arange(1, 30, dtype=np.int32) * 7 % 256

    async def turns():
        backend = JetStreamBackend(eng)
        try:
            out1 = [ev.token_id async for ev in backend.submit(
                GenerateRequest(request_id="t1", prompt_ids=p1, sampling=greedy, cache_key="roll/0"))]
            await asyncio.wait_for(backend.settle(), BOUND_S)  # turn 1's release has reached the engine
            block_bytes, kept = backend.prefix_cache_bytes(), eng.kv_stats()["prefix_cache_pages"]
            p2 = np.concatenate([p1, out1, [5, 6, 7, 8]]).astype(np.int32)
            before = dict(eng.counters)
            out2 = [ev.token_id async for ev in backend.submit(
                GenerateRequest(request_id="t2", prompt_ids=p2, sampling=greedy, cache_key="roll/0"))]
            return out1, p2, out2, block_bytes, kept, {k: eng.counters[k] - before[k] for k in before}
        finally:
            await backend.close()

    out1, p2, out2, block_bytes, kept, delta = asyncio.run(turns())
    assert out1 == ref_greedy(ref_logits, p1, 16) and out2 == ref_greedy(ref_logits, p2, 16)
    assert block_bytes == 0  # the pages are the only copy
    assert kept == (len(p1) + 16 - 1) // 8  # prompt and answer: every full page turn 1 computed
    assert delta["shared_page_tokens"] == kept * 8
    assert delta["prefill_tokens"] == len(p2) - 1 - kept * 8
