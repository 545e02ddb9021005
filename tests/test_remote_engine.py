"""EngineServer + RemoteBackend (gyre_jax.pods.remote_engine): an engine in another process, over real HTTP.

The engine here is the JAX-free FakeBackend (deterministic tokens), so every
answer through the HTTP hop is compared with the same call made on the backend
directly. The full path with a JetStream engine in a satellite process is
tests/test_pods_rl.py.
"""
import asyncio

import aiohttp
import numpy as np
import pytest

from gyre_jax.pods.remote_engine import EngineServer, RemoteBackend
from gyre_jax.serving.backend import EngineError, GenerateRequest, SamplingParams
from gyre_jax.testing.fake_backend import FakeBackend


def _request(rid: str, n: int = 12, prompt=(5, 6, 7, 8)) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_ids=np.asarray(prompt, np.int32),
                           sampling=SamplingParams(max_tokens=n, temperature=0.0, stop_ids=()))


async def _drain(stream):
    return [(ev.token_id, ev.logprob) async for ev in stream], stream.finish


def test_remote_backend_streams_what_the_engine_generates_and_survives_bad_requests():
    async def main():
        engine = FakeBackend("sat", max_context=64)
        server = EngineServer(engine)
        url = await server.start("127.0.0.1")
        gone = []
        remote = RemoteBackend("cell1", url, max_context=64, capacity=8, version=3, token=server.token)
        remote.on_unreachable = gone.append
        try:
            want, want_finish = await _drain(FakeBackend("ref", max_context=64).submit(_request("a")))
            got, finish = await _drain(remote.submit(_request("a")))
            assert got == want and finish == want_finish == "length"
            assert remote.num_active() == 0 and remote.policy_version == 3

            # An engine-side refusal is an EngineError naming the cell; the limit is checked core-side first.
            with pytest.raises(ValueError, match="over the limit of 64"):
                remote.submit(_request("big", n=70))
            # Anyone without the shared secret is refused, and nothing is generated for them.
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                async with aiohttp.ClientSession(headers=headers) as s:
                    for path in ("/generate", "/cancel", "/export"):
                        async with s.post(url + path, json={"request_id": "a", "prompt_ids": [1]}) as r:
                            assert r.status == 401, (path, headers, r.status)
            # Bad requests get answers, and the server keeps serving.
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {server.token}"}) as s:
                async with s.post(url + "/generate", data=b"{not json") as r:
                    assert r.status == 400 and "not JSON" in (await r.json())["error"]
                async with s.post(url + "/generate", json={"prompt_ids": [1]}) as r:
                    assert "KeyError" in (await r.text())
            got, _ = await _drain(remote.submit(_request("b")))
            assert got == want

            # A call moved off the satellite: the stream ends "moved" with its tokens so far, no KV over HTTP.
            stream = remote.submit(_request("c", n=30))
            first = [await stream.__anext__() for _ in range(4)]
            assert await remote.export("c")
            rest, finish = await _drain(stream)
            assert finish == "moved" and stream.resume is not None and stream.resume.kv is None
            assert [int(t) for t in stream.resume.output_ids] == [e.token_id for e in first] + [t for t, _ in rest]
            assert stream.resume.source == "cell1"
        finally:
            await server.stop()
        # The satellite is gone: the next call fails as an EngineError and the core hears once why.
        with pytest.raises(EngineError, match="unreachable"):
            await _drain(remote.submit(_request("d")))
        with pytest.raises(EngineError):
            await _drain(remote.submit(_request("e")))
        assert len(gone) == 1 and "unreachable" in gone[0], gone
        await remote.close()

    asyncio.run(main())
