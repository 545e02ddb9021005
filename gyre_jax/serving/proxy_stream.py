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
    anthropic = call.api.startswith("anthropic")
    rid = f"{'msg' if anthropic else 'gyre'}-{routed[0].request_id}"
    lock = asyncio.Lock()  # the samples' events are whole SSE messages, never interleaved
    last_write = [time.monotonic()]

    async def write(data: bytes):
        async with lock:
            await resp.write(data)
            last_write[0] = time.monotonic()

    async def send(obj, event: str | None = None):
        head = f"event: {event}\n" if event else ""
        await write(f"{head}data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode())

    ping = b'event: ping\ndata: {"type": "ping"}\n\n' if anthropic else b": keep-alive\n\n"
    every = proxy.cfg.stream_keepalive_s

    async def keep_alive():  # while the prompt prefills (or a slow sample waits), the client hears something
        while True:
            await asyncio.sleep(max(0.0, last_write[0] + every - time.monotonic()))
            if time.monotonic() - last_write[0] >= every:
                await write(ping)
                proxy.counters["stream_keepalives"] += 1

    blocks = A.BlockBuilder()
    n_calls = [0] * len(routed)
    want_ids = bool(call.extras.get("return_token_ids"))

    def emitter(i: int):
        async def emit(evs, token_id):
            token_ids = [token_id] if want_ids and token_id is not None else None
            if anthropic:
                for name, obj in blocks.events(evs):
                    await send(obj, name)
                return
            for kind, val in evs:
                if call.api == "openai.completions":
                    await send(O.completion_chunk(call, rid, val, None, token_ids, index=i))
                    token_ids = None
                elif kind == "text":
                    await send(O.chat_chunk(call, rid, {"content": val}, index=i))
                else:
                    await send(O.chat_chunk(call, rid, O.tool_call_delta(n_calls[i], val), index=i))
                    n_calls[i] += 1
            if token_ids and call.api == "openai.completions":  # a stop id: no text, still report the id
                await send(O.completion_chunk(call, rid, "", None, token_ids, index=i))
        return emit

    async def one(i: int, r) -> Sample:
        sample = await consume(r, proxy.output(call, r), emitter(i))
        await proxy.record_call(call, r, dataclasses.replace(binding, call_index=binding.call_index + i), t0, sample)
        return sample

    recorded = False
    pinger = asyncio.ensure_future(keep_alive())
    try:
        if anthropic:
            await send(A.message_start(call, rid), "message_start")
        elif call.api == "openai.chat":
            for i in range(len(routed)):
                await send(O.chat_chunk(call, rid, {"role": "assistant", "content": ""}, index=i))
        samples = await gather_samples(one(i, r) for i, r in enumerate(routed))
        recorded = True
        n_out = sum(len(sm.tokens) for sm in samples)
        if anthropic:
            for name, obj in blocks.finish():
                await send(obj, name)
            await send(A.message_delta(samples[0].finish, blocks.n_tool_calls, n_out, samples[0].stop_sequence),
                       "message_delta")
            await send({"type": "message_stop"}, "message_stop")
        else:
            for i, sm in enumerate(samples):
                if call.api == "openai.chat":
                    await send(O.chat_chunk(call, rid, {}, O.finish_reason(sm.finish, n_calls[i]), index=i))
                else:
                    await send(O.completion_chunk(call, rid, "", "stop" if sm.finish == "stop" else "length", index=i))
            if call.extras.get("include_usage"):
                await send({"id": rid, "object": "chat.completion.chunk", "choices": [],
                            "usage": O.usage(len(call.prompt_ids), n_out)})
            await resp.write(b"data: [DONE]\n\n")
    except asyncio.CancelledError:  # the client went away: counted once, by the proxy's _serve
        raise
    except ConnectionError:  # the client went away mid-write: counted here (the handler returns normally)
        proxy.counters["calls_unrecorded_client_gone" if not recorded else "calls_recorded_client_gone"] += 1
    except Exception as e:  # noqa: BLE001 - headers are sent: report it in the stream
        if not isinstance(e, (EngineError, NoCellError, RecordError, ApiError)):
            log.exception("error while streaming %s", rid)
        proxy.counters["stream_errors"] += 1
        msg = e.message if isinstance(e, ApiError) else f"{type(e).__name__}: {e}"
        err = ApiError(500, msg, kind="api_error")
        with contextlib.suppress(ConnectionError, RuntimeError):
            await send(A.error_body(err) if anthropic else O.error_body(err), "error" if anthropic else None)
    finally:
        pinger.cancel()
        with contextlib.suppress(BaseException):
            await pinger
    with contextlib.suppress(ConnectionError, RuntimeError):
        await resp.write_eof()
    return resp
