"""Stress: many concurrent calls through a Router over real GyreEngine +
JetStreamBackend cells (tokens_per_call=8) while a driver drains / publishes /
admits cells at random moments, including right after a call was routed (still
in JetStream's prefill queue). Every call must finish with its full output
within a bound: a lost call (the elastic demo saw one hang for 60 s) fails here.

It caught the bug: exporting a call still queued for prefill ended its stream and
detached its channel, so JetStream's later close was dropped and the router, already
waiting on that channel, waited forever (the drain never returned). ``_Channel.wake``.
"""
from __future__ import annotations

import asyncio
import random

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from gyre_jax.serving.backend import GenerateRequest, SamplingParams
from gyre_jax.serving.engine import GyreEngine
from gyre_jax.serving.jetstream_backend import JetStreamBackend
from gyre_jax.serving.router import Router
from gyre_jax.testing.tiny_serving_model import CFG, sharp_params

CALL_BOUND_S = 30.0  # a call of <= 80 tokens on a tiny model; far above its normal time


async def _stress(n_calls: int, n_cells: int, seed: int):
    params = sharp_params()
    devs = jax.devices()
    engines = [GyreEngine(CFG, params, mesh=Mesh(np.array(devs[i:i + 1]).reshape(1, 1), ("data", "tensor")),
                          max_slots=16, max_len=256, name=f"c{i}", tokens_per_call=8) for i in range(n_cells)]
    backends = [JetStreamBackend(e) for e in engines]
    for b in backends:  # compile prefill and decode first: the bound is for a call, not for XLA on a loaded machine
        warm = b.submit(GenerateRequest(request_id=f"warm-{b.name}", prompt_ids=np.asarray([1, 7, 9], np.int32),
                                        sampling=SamplingParams(max_tokens=9, temperature=1.0, seed=0)))
        async for _ in warm:
            pass
    router = Router(backends, wait_for_cell_s=CALL_BOUND_S)
    rng = random.Random(seed)
    routed = asyncio.Event()
    version = 0

    async def one(i: int):
        req = GenerateRequest(request_id=f"r{i}", prompt_ids=np.asarray([1 + i % 200, 7, 9], np.int32),
                              sampling=SamplingParams(max_tokens=rng.randint(20, 80), temperature=1.0, seed=i))
        call = router.start(req, affinity=f"a{i % 7}")
        n = 0
        async def consume():
            nonlocal n
            async for _ in call:
                n += 1
                routed.set()
        await asyncio.wait_for(consume(), CALL_BOUND_S)
        assert call.finish == "length" and n == req.sampling.max_tokens, (call.request_id, call.finish, n, call.cells)

    async def driver(done: asyncio.Event):
        nonlocal version
        while not done.is_set():
            routed.clear()
            await (routed.wait() if rng.random() < 0.5 else asyncio.sleep(0))
            cell = rng.choice(sorted(router.cells))
            if len(router.admitting()) < 2 or cell not in router.admitting():
                continue
            await asyncio.wait_for(router.drain(cell), CALL_BOUND_S)
            if rng.random() < 0.5:
                version += 1
                engines[int(cell[1:])].publish(params, version)
            await router.admit(cell)

    done = asyncio.Event()
    drv = asyncio.create_task(driver(done))
    try:
        sem = asyncio.Semaphore(40)
        async def bounded(i):
            async with sem:
                await one(i)
        await asyncio.gather(*(bounded(i) for i in range(n_calls)))
    finally:
        done.set()
        routed.set()
        await drv
        await router.close()
    return router.counters


@pytest.mark.slow  # ~30 s per seed; drains with live calls stay in the default run (test_serving_live)
@pytest.mark.parametrize("seed", [0, 1])
def test_drain_admit_publish_stress_every_call_finishes(seed):
    c = asyncio.run(_stress(n_calls=120, n_cells=3, seed=seed))
    assert c["drains"] > 3, c
