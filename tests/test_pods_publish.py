"""A satellite keeps serving the version it holds while a new one is pulled (gyre_jax.pods.satellite.serve).

In one process, as the rl job's satellite does it in its own (gyre_jax.pods.rl_job):
two transfer servers on one coordination service, the satellite's ``serve`` loop on
a thread, a real engine (GyreEngine under JetStream) built on the first publication
and handed each later one by ``on_publish``. The core mails a publication whose
bytes it has not offered yet, so the satellite's pull is in flight (its log says
so) and cannot end; a call made then is answered, on the old version, token for token what it was
before; once the bytes are offered the engine serves the new version.
"""
import asyncio
import logging
import threading

import jax
import numpy as np
import pytest
from flax import linen as nn

from gyre_jax import cells
from gyre_jax.cells import Role
from gyre_jax.model import init_boxed
from gyre_jax.pods.dp_job import build
from gyre_jax.pods.satellite import PUBLISHED, SatelliteLink, serve
from gyre_jax.pods.transport import Transport, get
from gyre_jax.serving.backend import GenerateRequest, SamplingParams
from tests.test_pods_dp import _config
from tests.test_pods_transport import kv  # noqa: F401 - the module's coordination service


def _call(backend, loop, rid):
    """One greedy call on ``backend`` (on its event loop): [(token, logprob)], the engine's version after."""
    async def go():
        req = GenerateRequest(request_id=rid, prompt_ids=np.asarray([5, 6, 7, 8], np.int32),
                              sampling=SamplingParams(max_tokens=6, temperature=0.0, stop_ids=()))
        return [(ev.token_id, ev.logprob) async for ev in backend.submit(req)], backend.policy_version

    return asyncio.run_coroutine_threadsafe(go(), loop).result(120)


@pytest.mark.slow  # ~25 s: JetStream's driver takes ~10 s to stop
def test_a_call_is_served_while_a_publication_is_pulled(kv):  # noqa: F811 - the fixture
    from gyre_jax.serving.engine import GyreEngine
    from gyre_jax.serving.jetstream_backend import JetStreamBackend

    model, spec, steps = build(_config())
    core, sat = cells.split_cells(cells.CellConfig(cell_size=2))[:2]
    a, b = Transport(client=kv, process_index=0), Transport(client=kv, process_index=1)
    init = jax.jit(lambda r: nn.unbox(init_boxed(model, r)), out_shardings=steps.param_shardings(core.train_mesh))
    v0, v1 = init(jax.random.key(0)), init(jax.random.key(1))
    serve_shardings = cells.WeightPublisher(spec.logical_params, spec.abstract_params).shardings(sat, Role.ROLLOUT)

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    box = {}

    def on_publish(version, params):  # as rl_job.satellite_main: an engine on the first, a swap after
        if "backend" in box:
            box["backend"].engine.publish(params, version)
            return

        async def make():
            return JetStreamBackend(GyreEngine(model, params, mesh=sat.serve_mesh, max_slots=2, max_len=32,
                                               version=version))
        box["backend"] = asyncio.run_coroutine_threadsafe(make(), loop).result(300)

    pulling = threading.Event()

    class Said(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("pods satellite 1: pulling v1,"):
                pulling.set()

    sat_log = logging.getLogger("gyre_jax.pods.satellite")
    said, level = Said(), sat_log.level
    sat_log.addHandler(said)
    sat_log.setLevel(logging.INFO)
    sat_thread = threading.Thread(target=lambda: box.update(done=serve(
        b, steps, sat.train_mesh, serve_shardings=serve_shardings, on_publish=on_publish, generation="g")))
    sat_thread.start()
    link = SatelliteLink(a, 1, steps, core.train_mesh, generation="g")
    try:
        link.publish(v0, 0, 1)
        backend = box["backend"]
        before = _call(backend, loop, "before")
        assert before[1] == 0

        # Version 1 under way: the satellite's pull is in flight (it says so) and waits for bytes not offered yet.
        uuid = a.new_uuid()
        link.mail.send({"op": "publish", "uuid": uuid, "version": 1, "core": 0})
        assert pulling.wait(60), "the satellite never started pulling the publication"
        during = _call(backend, loop, "during")
        assert during == before  # answered, on the old version, while the new one could not be in yet
        with pytest.raises(Exception, match="NOT_FOUND"):
            kv.key_value_try_get(PUBLISHED.format(process=1, version=1))

        a.offer(uuid, v1)
        get(kv, PUBLISHED.format(process=1, version=1), timeout_s=120)
        after = _call(backend, loop, "after")
        assert after[1] == 1 and after[0] != before[0]
    finally:
        link.stop()
        sat_thread.join(120)
        if "backend" in box:
            asyncio.run_coroutine_threadsafe(box["backend"].close(), loop).result(120)
        loop.call_soon_threadsafe(loop.stop)
        sat_log.removeHandler(said)
        sat_log.setLevel(level)
    assert box["done"]["published_version"] == 1
