"""Streaming (SSE) responses of the proxy: OpenAI chunks or Anthropic events."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from aiohttp import web

from gyre_jax.serving import api_anthropic as A
from gyre_jax.serving import api_openai as O
from gyre_jax.serving.api_common import ApiError, AssistantStream, ChatCall
from gyre_jax.serving.backend import EngineError
from gyre_jax.serving.router import NoCellError
from gyre_jax.trajectory.records import RecordError

log = logging.getLogger(__name__)


async def stream_response(proxy, request, call: ChatCall, routed, binding, t0) -> web.StreamResponse:
    """Server-sent events for one call, in the API's own event shapes; the record is
    written (proxy._record) before the final event, errors become an error event."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       **proxy._headers(call)})
    await resp.prepare(request)
    anthropic = call.api.startswith("anthropic")
    rid = f"{'msg' if anthropic else 'gyre'}-{routed.request_id}"

    async def send(obj, event: str | None = None):
        head = f"event: {event}\n" if event else ""
        await resp.write(f"{head}data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode())

    asm = AssistantStream(proxy.tok, parse_tools=call.parse_tools,
                          stop_ids=None if call.parse_tools else call.stop_ids)
    blocks = A.BlockBuilder()
    n_calls = 0

    async def emit(evs, token_ids=None):
        nonlocal n_calls
        if anthropic:
            for name, obj in blocks.events(evs):
                await send(obj, name)
            return
        for kind, val in evs:
            if call.api == "openai.completions":
                await send(O.completion_chunk(call, rid, val, None, token_ids))
                token_ids = None
            elif kind == "text":
                await send(O.chat_chunk(call, rid, {"content": val}))
            else:
                await send(O.chat_chunk(call, rid, O.tool_call_delta(n_calls, val)))
                n_calls += 1
        if token_ids and call.api == "openai.completions":  # a stop id: no text, still report the id
            await send(O.completion_chunk(call, rid, "", None, token_ids))

    want_ids = bool(call.extras.get("return_token_ids"))
    try:
        if anthropic:
            await send(A.message_start(call, rid), "message_start")
        elif call.api == "openai.chat":
            await send(O.chat_chunk(call, rid, {"role": "assistant", "content": ""}))
        async with contextlib.aclosing(routed.__aiter__()) as events:
            async for ev in events:
                await emit(asm.feed(ev.token_id), [ev.token_id] if want_ids else None)
        await emit(asm.finish())
        await proxy._record(call, routed, binding, t0)
        n_out = len(routed.tokens)
        if anthropic:
            for name, obj in blocks.finish():
                await send(obj, name)
            await send(A.message_delta(routed.finish, blocks.n_tool_calls, n_out), "message_delta")
            await send({"type": "message_stop"}, "message_stop")
        else:
            fin = O.finish_reason(routed.finish, n_calls) if call.api == "openai.chat" else (
                "stop" if routed.finish == "stop" else "length")
            if call.api == "openai.chat":
                await send(O.chat_chunk(call, rid, {}, fin))
            else:
                await send(O.completion_chunk(call, rid, "", fin))
            if call.extras.get("include_usage"):
                await send({"id": rid, "object": "chat.completion.chunk", "choices": [],
                            "usage": O.usage(len(call.prompt_ids), n_out)})
            await resp.write(b"data: [DONE]\n\n")
    except (ConnectionError, asyncio.CancelledError):
        proxy.counters["calls_unrecorded_client_gone"] += 1
        raise
    except Exception as e:  # noqa: BLE001 - headers are sent: report it in the stream
        if not isinstance(e, (EngineError, NoCellError, RecordError, ApiError)):
            log.exception("error while streaming %s", rid)
        proxy.counters["stream_errors"] += 1
        msg = e.message if isinstance(e, ApiError) else f"{type(e).__name__}: {e}"
        err = ApiError(500, msg, kind="api_error")
        with contextlib.suppress(ConnectionError, RuntimeError):
            await send(A.error_body(err) if anthropic else O.error_body(err), "error" if anthropic else None)
    with contextlib.suppress(ConnectionError, RuntimeError):
        await resp.write_eof()
    return resp
