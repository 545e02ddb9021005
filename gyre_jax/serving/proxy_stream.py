"""Streaming (SSE) responses of the proxy: OpenAI chunks or Anthropic events."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time

import numpy as np
from aiohttp import web

from gyre_jax.serving import api_anthropic as A
from gyre_jax.serving import api_openai as O
from gyre_jax.serving.api_common import ApiError, ChatCall, OutputText
from gyre_jax.serving.backend import EngineError
from gyre_jax.serving.router import NoCellError
from gyre_jax.trajectory.records import RecordError

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Sample:
    """One generated sample as recorded (tokens exactly as generated) and as the client sees it (events)."""

    tokens: list[int]
    logprobs: list[float]
    finish: str  # "stop" (a stop id or a stop sequence) | "length" | "cancelled"
    events: list  # OutputText events: ("text", str) / ("tool_call", dict)
    stop_sequence: str | None = None  # the text stop sequence that ended it
    routing: list | None = None  # per token: the engine's recorded routing (or None), RoutedCall.routing

    def routing_array(self):
        """[tokens, R] recorded routing, or None unless every token has one (a call that moved through an
        engine recording none keeps no routing: its tokens are then routed live in training)."""
        if not self.routing or any(r is None for r in self.routing):
            return None
        if len({(r.shape, r.dtype) for r in self.routing}) != 1:
            return None
        return np.stack(self.routing)

    @property
    def text(self) -> str:
        return "".join(v for k, v in self.events if k == "text")

    @property
    def calls(self) -> list[dict]:
        return [v for k, v in self.events if k != "text"]


async def consume(routed, out: OutputText, emit=None) -> Sample:
    """Run one routed call to its end through ``out``; ``emit(events, token_id | None)`` streams them.
    A text stop sequence ends generation at the token that completed it (the call is cancelled)."""
    events: list = []
    async with contextlib.aclosing(routed.__aiter__()) as stream:
        async for ev in stream:
            evs = out.feed(ev.token_id)
            events += evs
            if emit is not None:
                await emit(evs, ev.token_id)
            if out.hit is not None:
                break
    evs = out.finish()
    events += evs
    if emit is not None:
        await emit(evs, None)
    finish = "stop" if out.hit is not None else routed.finish
    return Sample(list(routed.tokens), list(routed.logprobs), finish, events, out.hit,
                  list(getattr(routed, "routing", ())))




async def gather_samples(coros) -> list:
    """Run a call's samples together; if one fails, the others are cancelled (their slots freed,
    nothing recorded for them) before the error propagates."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks)


async def stream_response(proxy, request, call: ChatCall, routed: list, binding, t0) -> web.StreamResponse:
    """Server-sent events for a call's samples (``routed``: one per choice; Anthropic has one), in the
    API's own event shapes; each record is written (proxy.record_call) before the final events, errors
    become an error event."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       **proxy.reply_headers(call)})
    await resp.prepare(request)
    es = _EventStream(proxy, resp, call, routed)

    async def one(i: int, r) -> Sample:
        sample = await consume(r, proxy.output(call, r), es.emitter(i))
        await proxy.record_call(call, r, dataclasses.replace(binding, call_index=binding.call_index + i), t0, sample)
        return sample

    recorded = False
    pinger = asyncio.ensure_future(es.keep_alive())
    try:
        await es.start()
        samples = await gather_samples(one(i, r) for i, r in enumerate(routed))
        recorded = True
        await es.finish(samples)
    except asyncio.CancelledError:  # the client went away: counted once, by the proxy's _serve
        raise
    except ConnectionError:  # the client went away mid-write: counted here (the handler returns normally)
        proxy.counters["calls_unrecorded_client_gone" if not recorded else "calls_recorded_client_gone"] += 1
    except Exception as e:  # noqa: BLE001 - headers are sent: report it in the stream
        await es.fail(e)
    finally:
        pinger.cancel()
        with contextlib.suppress(BaseException):
            await pinger
    with contextlib.suppress(ConnectionError, RuntimeError):
        await resp.write_eof()
    return resp


class _EventStream:
    """One streamed response's events: whole SSE messages written under a lock (the samples' events
    never interleave), a keep-alive while nothing else is written, each API's own event shapes."""

    def __init__(self, proxy, resp: web.StreamResponse, call: ChatCall, routed: list):
        self.proxy, self.resp, self.call, self.n_samples = proxy, resp, call, len(routed)
        self.anthropic = call.api.startswith("anthropic")
        self.rid = f"{'msg' if self.anthropic else 'gyre'}-{routed[0].request_id}"
        self.lock = asyncio.Lock()
        self.last_write = time.monotonic()
        self.blocks = A.BlockBuilder()
        self.n_calls = [0] * len(routed)
        self.want_ids = bool(call.extras.get("return_token_ids"))

    async def write(self, data: bytes):
        async with self.lock:
            await self.resp.write(data)
            self.last_write = time.monotonic()

    async def send(self, obj, event: str | None = None):
        head = f"event: {event}\n" if event else ""
        await self.write(f"{head}data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode())

    async def keep_alive(self):
        """While the prompt prefills (or a slow sample waits), the client hears something."""
        ping = b'event: ping\ndata: {"type": "ping"}\n\n' if self.anthropic else b": keep-alive\n\n"
        every = self.proxy.cfg.stream_keepalive_s
        while True:
            await asyncio.sleep(max(0.0, self.last_write + every - time.monotonic()))
            if time.monotonic() - self.last_write >= every:
                await self.write(ping)
                self.proxy.counters["stream_keepalives"] += 1

    def emitter(self, i: int):
        """``emit(events, token_id)`` for sample ``i`` (consume's callback)."""
        call, rid = self.call, self.rid

        async def emit(evs, token_id):
            token_ids = [token_id] if self.want_ids and token_id is not None else None
            if self.anthropic:
                for name, obj in self.blocks.events(evs):
                    await self.send(obj, name)
                return
            for kind, val in evs:
                if call.api == "openai.completions":
                    await self.send(O.completion_chunk(call, rid, val, None, token_ids, index=i))
                    token_ids = None
                elif kind == "text":
                    await self.send(O.chat_chunk(call, rid, {"content": val}, index=i))
                else:
                    await self.send(O.chat_chunk(call, rid, O.tool_call_delta(self.n_calls[i], val), index=i))
                    self.n_calls[i] += 1
            if token_ids and call.api == "openai.completions":  # a stop id: no text, still report the id
                await self.send(O.completion_chunk(call, rid, "", None, token_ids, index=i))
        return emit

    async def start(self):
        if self.anthropic:
            await self.send(A.message_start(self.call, self.rid), "message_start")
        elif self.call.api == "openai.chat":
            for i in range(self.n_samples):
                await self.send(O.chat_chunk(self.call, self.rid, {"role": "assistant", "content": ""}, index=i))

    async def finish(self, samples: list[Sample]):
        """The final events, once every sample is recorded."""
        call, rid = self.call, self.rid
        n_out = sum(len(sm.tokens) for sm in samples)
        if self.anthropic:
            for name, obj in self.blocks.finish():
                await self.send(obj, name)
            await self.send(A.message_delta(samples[0].finish, self.blocks.n_tool_calls, n_out,
                                            samples[0].stop_sequence), "message_delta")
            await self.send({"type": "message_stop"}, "message_stop")
            return
        for i, sm in enumerate(samples):
            if call.api == "openai.chat":
                await self.send(O.chat_chunk(call, rid, {}, O.finish_reason(sm.finish, self.n_calls[i]), index=i))
            else:
                await self.send(O.completion_chunk(call, rid, "", "stop" if sm.finish == "stop" else "length", index=i))
        if call.extras.get("include_usage"):
            await self.send({"id": rid, "object": "chat.completion.chunk", "choices": [],
                             "usage": O.usage(len(call.prompt_ids), n_out)})
        await self.resp.write(b"data: [DONE]\n\n")

    async def fail(self, e: Exception):
        """An error after the headers went out: an error event in the stream."""
        if not isinstance(e, (EngineError, NoCellError, RecordError, ApiError)):
            log.exception("error while streaming %s", self.rid)
        self.proxy.counters["stream_errors"] += 1
        msg = e.message if isinstance(e, ApiError) else f"{type(e).__name__}: {e}"
        err = ApiError(500, msg, kind="api_error")
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self.send(A.error_body(err) if self.anthropic else O.error_body(err),
                            "error" if self.anthropic else None)
