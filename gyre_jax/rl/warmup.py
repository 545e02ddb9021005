"""Compile ahead of use, while the run sets up: every cell's training step, and each engine's prefill and
generate (one short call with a real task's prompt), so no satellite compiles while holding a micro-batch
and no rollout's deadline runs while an engine compiles."""
from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from gyre_jax.cells.mesh import Role
from gyre_jax.serving.backend import GenerateRequest, SamplingParams
from gyre_jax.trajectory.binpack import pack_trees
from gyre_jax.trajectory.node import TreeNode

log = logging.getLogger(__name__)


def warm_steps(steps, cells, *, row_len: int, micro_batch_rows: int, routing_width: int) -> None:
    """Compile grad_step on every cell's training mesh (and the core's update): a satellite joining a step would
    otherwise compile while holding a micro-batch. Only a speed-up: a failure is logged, the step compiles on
    first use anyway."""
    tree = TreeNode.span([1, 2, 3], children=[TreeNode.span([4, 5], trainable=True)])
    mb = pack_trees([tree], [0.0], row_len, min_rows=micro_batch_rows,
                    routing_width=routing_width).rows.as_dict()  # the run's batches' fields
    t0 = time.perf_counter()
    try:
        for c in cells:
            steps.warm(c.mesh(Role.TRAIN), mb, core=c.index == 0)
    except Exception:  # noqa: BLE001 - only a speed-up; the step compiles on first use anyway
        log.exception("warm-up compile failed")
    log.info("rl: compiled the training steps of %d cells in %.1fs", len(cells), time.perf_counter() - t0)


def warm_engines(server, backends: dict, prompt_ids) -> None:
    """One short call per engine (``server``: the ServerThread they run on), so prefill and generate are
    compiled before any rollout's deadline starts running."""
    prompt = np.asarray(prompt_ids, np.int32)

    async def one(backend, i):
        req = GenerateRequest(request_id=f"warm-{i}", prompt_ids=prompt, sampling=SamplingParams(max_tokens=2))
        async for _ in backend.submit(req):
            pass

    async def all_():
        await asyncio.gather(*(one(b, i) for i, b in enumerate(backends.values())))

    t0 = time.perf_counter()
    server.run(all_(), timeout=600)
    log.info("rl: warmed %d engines in %.1fs", len(backends), time.perf_counter() - t0)
