"""A serving engine in another process, behind the core's router: ``EngineServer`` (satellite) and ``RemoteBackend`` (core).

Model calls are small (prompt ids in, one token id and log-prob per generated
token out), so they go over HTTP on aiohttp (a well-kept library), not JAX's
transfer server: one ``POST /generate`` per call whose response streams
newline-delimited JSON, ``{"t": id, "lp": logprob}`` per token (an MoE engine adds
``"r": [expert ids], "rb": bytes per id``: its routing, for replay), then one
``{"finish": ..., "resume": ...}`` (or ``{"error": ...}``, an ``EngineError``
here). ``POST /cancel`` and ``POST /export`` do what ``Backend.cancel`` and
``Backend.export`` do. Weights never travel here: they move on
``jax.experimental.transfer`` (``SatelliteLink.publish``).

A moved call's KV prefix stays in the satellite (``ResumeState.kv`` is None over
HTTP): the router recomputes it on the next cell, the fallback it already has.
If the satellite dies, its open streams fail (``EngineError``) and the harness
retries the call on the cells still routable (the core takes the dead cell out).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets

import aiohttp
import numpy as np
from aiohttp import web

from gyre_jax.serving.backend import (
    Backend,
    EngineError,
    GenerateRequest,
    ResumeState,
    SamplingParams,
    TokenEvent,
    TokenStream,
)
from gyre_jax.serving.bound_port import bound_port

log = logging.getLogger(__name__)


def _resume_to_json(r: ResumeState | None) -> dict | None:
    if r is None:
        return None
    return {"prompt_ids": r.prompt_ids.tolist(), "output_ids": r.output_ids.tolist(),
            "output_logprobs": [float(x) for x in r.output_logprobs], "source": r.source}


def _resume_from_json(d: dict | None) -> ResumeState | None:
    if d is None:
        return None
    return ResumeState(prompt_ids=np.asarray(d["prompt_ids"], np.int32), output_ids=np.asarray(d["output_ids"], np.int32),
                       output_logprobs=np.asarray(d["output_logprobs"], np.float32), source=d.get("source", ""))


class EngineServer:
    """The satellite's side: ``backend`` (a JetStreamBackend on this process's cell) served over HTTP.

    Build and start it on the asyncio loop the backend runs on (``await start(host)``).
    """

    def __init__(self, backend: Backend, token: str | None = None):
        """``token``: the shared secret every request must carry (``Authorization: Bearer``); by default a
        fresh one, published with the URL to the core only (the engine's endpoints can generate, cancel and
        export live calls: nobody else on the host or network may reach them)."""
        self.backend = backend
        self.token = token or secrets.token_hex(16)
        self._runner: web.AppRunner | None = None
        self.url = ""

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        got = request.headers.get("Authorization", "")
        if not secrets.compare_digest(got.encode(), f"Bearer {self.token}".encode()):
            return web.json_response({"error": "unauthorized: the engine server takes requests from its core only"},
                                     status=401)
        return await handler(request)

    async def start(self, host: str = "127.0.0.1") -> str:
        app = web.Application(middlewares=[self._auth])
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/cancel", self._cancel)
        app.router.add_post("/export", self._export)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, 0)
        await site.start()
        port = bound_port(site)
        self.url = f"http://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        try:
            d = await request.json()
        except ValueError as e:  # a bad request is answered, never fatal to the server
            return web.json_response({"error": f"POST /generate: body is not JSON: {e}"}, status=400)
        resp = web.StreamResponse()
        resp.content_type = "application/x-ndjson"
        await resp.prepare(request)
        try:
            req = GenerateRequest(request_id=d["request_id"], prompt_ids=np.asarray(d["prompt_ids"], np.int32),
                                  sampling=SamplingParams(**d["sampling"]), resume=_resume_from_json(d.get("resume")),
                                  cache_key=d.get("cache_key"))
            stream = self.backend.submit(req)
            async for ev in stream:
                msg = {"t": int(ev.token_id), "lp": float(ev.logprob)}
                if ev.routing is not None:
                    msg.update(r=ev.routing.tolist(), rb=int(ev.routing.dtype.itemsize))
                await resp.write(json.dumps(msg).encode() + b"\n")
            end = {"finish": stream.finish, "resume": _resume_to_json(stream.resume.without_kv() if stream.resume else None),
                   "version": int(self.backend.policy_version), "stats": self.backend.stats()}
        except (EngineError, ValueError, KeyError, TypeError) as e:  # KeyError/TypeError: a malformed request
            end = {"error": f"{type(e).__name__}: {e}"}
        except ConnectionResetError:  # the core went away or cancelled by closing: free the slot
            self.backend.cancel(d.get("request_id", ""))
            raise
        await resp.write(json.dumps(end).encode() + b"\n")
        await resp.write_eof()
        return resp

    async def _cancel(self, request: web.Request) -> web.Response:
        self.backend.cancel((await request.json())["request_id"])
        return web.json_response({"ok": True})

    async def _export(self, request: web.Request) -> web.Response:
        moved = await self.backend.export((await request.json())["request_id"])
        return web.json_response({"moved": bool(moved)})


class _RemoteStream(TokenStream):
    def __init__(self, backend: "RemoteBackend", request: GenerateRequest):
        self.request_id = request.request_id
        self._b = backend
        self._req = request
        self._resp: aiohttp.ClientResponse | None = None
        self._done = False

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        try:
            if self._resp is None:
                r = self._req
                body = {"request_id": r.request_id, "prompt_ids": r.prompt_ids.tolist(), "cache_key": r.cache_key,
                        "sampling": dataclasses.asdict(r.sampling),  # every field, one added later too
                        "resume": _resume_to_json(r.resume.without_kv() if r.resume is not None else None)}
                self._resp = await self._b.session().post(self._b.url + "/generate", json=body)
                if self._resp.status != 200:
                    raise EngineError(f"{self._b.name}: HTTP {self._resp.status}")
            line = await self._resp.content.readline()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            self._end()
            why = f"{self._b.name} ({self._b.url}) unreachable: {e!r}"
            self._b.unreachable(why)
            raise EngineError(why) from e
        if not line:
            self._end()
            why = f"{self._b.name}: stream of {self.request_id} cut off (satellite process gone)"
            self._b.unreachable(why)
            raise EngineError(why)
        d = json.loads(line)
        if "t" in d:
            routing = None if "r" not in d else np.asarray(d["r"], np.uint8 if d.get("rb") == 1 else np.uint16)
            return TokenEvent(int(d["t"]), float(d["lp"]), routing)
        self._end()
        if "error" in d:
            raise EngineError(f"{self._b.name}: {d['error']}")
        self.finish = d["finish"]
        self.resume = _resume_from_json(d["resume"])
        if self.resume is not None:  # the core's name for the cell it left
            self.resume = dataclasses.replace(self.resume, source=self._b.name)
        if "stats" in d:
            self._b.report_stats(d["stats"])
        raise StopAsyncIteration

    def _end(self) -> None:
        if not self._done:
            self._done = True
            self._b.call_ended(self.request_id)
            if self._resp is not None:
                self._resp.release()


class RemoteBackend(Backend):
    """The core's side: a ``Backend`` whose engine runs in a satellite process at ``url``.

    ``policy_version`` is what the core last published there (``set_version``,
    after the satellite reported it loaded).
    """

    def __init__(self, name: str, url: str, *, max_context: int, capacity: int, version: int,
                 token: str | None = None):
        self.name, self.url = name, url
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.max_context, self.capacity = int(max_context), int(capacity)
        self._version = int(version)
        self._active: set[str] = set()
        self._session: aiohttp.ClientSession | None = None
        self._stats: dict = {"prefill_tokens": 0.0}
        self.on_unreachable = None  # called once (with a reason) when the satellite stops answering
        self._unreachable = False

    def unreachable(self, why: str) -> None:
        if not self._unreachable:
            self._unreachable = True
            log.error("%s: %s", self.name, why)
            if self.on_unreachable is not None:
                self.on_unreachable(why)

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:  # made on the event loop that uses it
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                                                  headers=self._headers)
        return self._session

    def set_version(self, version: int) -> None:
        self._version = int(version)

    def call_ended(self, request_id: str) -> None:
        """A stream's call is over (finished, failed or cut off): it no longer counts as active."""
        self._active.discard(request_id)

    def report_stats(self, stats: dict) -> None:
        """The satellite engine's counters, as the end of its latest finished call reported them."""
        self._stats = stats

    def submit(self, request: GenerateRequest) -> TokenStream:
        if request.prompt_ids.shape[0] + request.sampling.max_tokens > self.max_context:
            raise ValueError(f"{self.name}: prompt {request.prompt_ids.shape[0]} + max_tokens "
                             f"{request.sampling.max_tokens} over the limit of {self.max_context} tokens")
        self._active.add(request.request_id)
        return _RemoteStream(self, request)

    def cancel(self, request_id: str) -> None:
        if request_id in self._active:
            asyncio.get_running_loop().create_task(self._post("/cancel", {"request_id": request_id}))

    async def export(self, request_id: str) -> bool:
        d = await self._post("/export", {"request_id": request_id})
        return bool(d and d.get("moved"))

    async def _post(self, path: str, body: dict) -> dict | None:
        try:
            async with self.session().post(self.url + path, json=body) as r:
                return await r.json()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
            log.warning("%s%s failed: %r", self.url, path, e)
            return None

    def num_active(self) -> int:
        return len(self._active)

    @property
    def policy_version(self) -> int:
        return self._version

    def stats(self) -> dict[str, float]:
        return dict(self._stats)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
