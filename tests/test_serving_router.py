"""Router placement, drain / re-route and the recompute fallback, on fake cells."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from gyre_jax.serving.backend import GenerateRequest, SamplingParams
from gyre_jax.serving.router import NoCellError, Router
from gyre_jax.testing.fake_backend import FakeBackend, default_script


def req(i, n=30, prompt=None):
    p = np.array(prompt if prompt is not None else [i + 1, 2 * i + 3, 7], np.int32)
    return GenerateRequest(request_id=f"r{i}", prompt_ids=p, sampling=SamplingParams(max_tokens=n))


def undisturbed(r):
    seq = [int(t) for t in r.prompt_ids]
    for _ in range(r.sampling.max_tokens):
        seq.append(default_script(seq))
    return seq[len(r.prompt_ids):]


async def consume(call, out, after=None, k=0, started=None):
    async for ev in call:
        out.append(ev.token_id)
        if started is not None and len(out) == k:
            started.release()
            await after.wait()


def test_least_loaded_with_rollout_affinity():
    async def go():
        a, b = FakeBackend("A", capacity=2), FakeBackend("B", capacity=4)
        r = Router([a, b])
        assert r.pick().name == "A"  # tie on load: by name
        calls = [r.start(req(i), affinity="roll-1") for i in range(3)]
        its = [c.__aiter__() for c in calls]
        for it in its:
            await it.__anext__()  # each call is placed when it starts
        # A holds roll-1's prefix: calls follow it until A is full, then go to B
        assert [c.cell for c in calls] == ["A", "A", "B"]
        c4 = r.start(req(4), affinity="roll-2")
        it4 = c4.__aiter__()
        await it4.__anext__()
        assert c4.cell == "B"  # least loaded: A 2/2, B 1/4
        for it in its + [it4]:
            await it.aclose()
        assert a.num_active() == 0 and b.num_active() == 0

    asyncio.run(go())


@pytest.mark.parametrize("fail_imports", [False, True])
def test_drain_moves_every_call_once_and_outputs_are_undisturbed(fail_imports):
    async def go():
        after, started = asyncio.Event(), asyncio.Semaphore(0)
        exported = []

        def on_export(rid):  # consumers resume only once the drain has stopped all 16
            exported.append(rid)
            if len(exported) == 16:
                after.set()

        a = FakeBackend("A", capacity=16, on_export=on_export)
        b = FakeBackend("B", capacity=16, fail_imports=fail_imports)
        r = Router([a, b])
        await r.drain("B")
        reqs = [req(i, n=40) for i in range(16)]
        outs = [[] for _ in reqs]
        tasks = [asyncio.create_task(consume(r.start(q), o, after, 5, started)) for q, o in zip(reqs, outs)]
        for _ in reqs:
            await started.acquire()  # all 16 are mid-stream on A
        await r.admit("B")
        res = await r.drain("A")
        await asyncio.gather(*tasks)
        assert res == {"exported": 16, "finished_in_place": 0}
        for q, o in zip(reqs, outs):
            assert o == undisturbed(q)
        prefix_tokens = sum(len(q.prompt_ids) + 5 - 1 for q in reqs)
        if fail_imports:  # every import failed: recomputed from the tokens instead
            assert r.counters["moves_recompute"] == 16 and r.counters["moves_kv"] == 0
            assert b.counters["prefill_tokens"] >= prefix_tokens
        else:
            assert r.counters["moves_kv"] == 16 and r.counters["moves_recompute"] == 0
            assert b.counters["moved_tokens"] == prefix_tokens and b.counters["prefill_tokens"] == 0
        assert a.num_active() == 0 and b.num_active() == 0

    asyncio.run(go())


def test_no_admitting_cell_waits_for_admit_then_times_out():
    async def go():
        a = FakeBackend("A")
        r = Router([a], wait_for_cell_s=5.0)
        await r.drain("A")
        out = []
        t = asyncio.create_task(consume(r.start(req(0, n=3)), out))
        await asyncio.sleep(0)
        assert not out
        await r.admit("A")  # e.g. after a weight publication
        await t
        assert out == undisturbed(req(0, n=3))
        r2 = Router([FakeBackend("B")], wait_for_cell_s=0.05)
        await r2.drain("B")
        with pytest.raises(NoCellError):
            await consume(r2.start(req(1)), [])

    asyncio.run(go())


def test_bad_requests_are_refused():
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(max_tokens=3, top_p=0.0)
    with pytest.raises(ValueError, match="at least 1 token"):
        GenerateRequest(request_id="x", prompt_ids=np.zeros(0, np.int32), sampling=SamplingParams(max_tokens=1))
    with pytest.raises(KeyError, match="unknown cell"):
        asyncio.run(Router([FakeBackend("A")]).drain("Z"))


def test_kv_is_not_imported_across_policy_versions():
    async def go():
        after, started = asyncio.Event(), asyncio.Semaphore(0)
        a = FakeBackend("A", on_export=lambda rid: after.set(), policy_version=3)
        b = FakeBackend("B", policy_version=4)  # published newer weights
        r = Router([a, b])
        await r.drain("B")
        q = req(0, n=20)
        out = []
        t = asyncio.create_task(consume(r.start(q), out, after, 4, started))
        await started.acquire()
        await r.admit("B")
        await r.drain("A")
        await t
        assert out == undisturbed(q)
        assert r.counters["moves_recompute"] == 1 and r.counters["moves_kv"] == 0
        assert b.counters["moved_tokens"] == 0 and b.counters["prefill_tokens"] == len(q.prompt_ids) + 4 - 1

    asyncio.run(go())
