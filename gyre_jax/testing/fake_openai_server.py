"""A FAKE OpenAI-compatible chat server for tests: real aiohttp HTTP on loopback, scripted
replies instead of a model.

``FakeOpenAIServer(responder)`` serves ``POST /v1/chat/completions``. For each request
the responder gets a :class:`FakeRequest` (headers, parsed body, arrival index) and
returns a :class:`FakeReply` (or an awaitable of one): assistant text and/or tool calls,
an HTTP error status, or ``hang=True`` (the request never completes until the server
closes: a model that stops answering). Every request is recorded in ``requests``;
``max_in_flight`` tracks the highest number of concurrent requests.

``usage`` is filled in like a byte-level tokenizer would (one token per byte of
message content) unless the reply sets it or sets ``usage=None``.
"""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
from typing import Any, Awaitable, Callable

from aiohttp import web

from gyre_jax.serving.bound_port import bound_port

_AUTO = "auto"


@dataclasses.dataclass
class FakeRequest:
    index: int  # arrival order, from 0
    headers: dict[str, str]
    body: dict

    def header(self, name: str) -> str | None:
        low = name.lower()
        return next((v for k, v in self.headers.items() if k.lower() == low), None)

    @property
    def messages(self) -> list[dict]:
        return self.body["messages"]

    @property
    def turn(self) -> int:
        """Assistant messages already in the context: 0 for an agent's first call."""
        return sum(m.get("role") == "assistant" for m in self.messages)


@dataclasses.dataclass
class FakeReply:
    content: str = ""
    tool_calls: list[dict] | None = None
    status: int = 200
    error: str = "fake server error"
    finish_reason: str = "stop"
    usage: Any = _AUTO  # "auto", None (omit the field), or a dict
    hang: bool = False


def tool_call(name: str, args: dict, call_id: str = "call_0") -> dict:
    """One structured OpenAI tool call."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def tool_calls(*calls: tuple[str, dict]) -> FakeReply:
    return FakeReply(tool_calls=[tool_call(n, a, f"call_{k}") for k, (n, a) in enumerate(calls)],
                     finish_reason="tool_calls")


Responder = Callable[[FakeRequest], "FakeReply | Awaitable[FakeReply]"]


def _content_bytes(messages: list[dict]) -> int:
    n = 0
    for m in messages:
        n += len((m.get("content") or "").encode())
        for tc in m.get("tool_calls") or ():
            n += len(tc["function"]["name"]) + len(tc["function"]["arguments"])
    return n


class FakeOpenAIServer:
    def __init__(self, responder: Responder, *, host: str = "127.0.0.1"):
        self.responder = responder
        self.host = host
        self.requests: list[FakeRequest] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._closing = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> "FakeOpenAIServer":
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        self.port = bound_port(site)
        return self

    async def close(self) -> None:
        self._closing.set()
        if self._runner is not None:
            await self._runner.cleanup()

    async def __aenter__(self) -> "FakeOpenAIServer":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def requests_where(self, **headers: str) -> list[FakeRequest]:
        """Recorded requests whose headers match, e.g. requests_where(**{"X-Gyre-Role": "summary"})."""
        return [r for r in self.requests if all(r.header(k) == v for k, v in headers.items())]

    async def _chat(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            if not isinstance(body.get("messages"), list):
                raise ValueError("messages must be a list")
        except (ValueError, AttributeError) as e:
            return web.json_response({"error": {"message": f"bad request: {e}"}}, status=400)
        req = FakeRequest(len(self.requests), dict(request.headers), body)
        self.requests.append(req)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            reply = self.responder(req)
            if inspect.isawaitable(reply):
                reply = await reply
            if reply.hang:
                await self._closing.wait()
                return web.json_response({"error": {"message": "server closing"}}, status=503)
            if reply.status != 200:
                return web.json_response({"error": {"message": reply.error}}, status=reply.status)
            message: dict[str, Any] = {"role": "assistant", "content": reply.content}
            if reply.tool_calls:
                message["tool_calls"] = reply.tool_calls
            data: dict[str, Any] = {"id": f"fake-{req.index}", "object": "chat.completion",
                                    "model": body.get("model", "fake"),
                                    "choices": [{"index": 0, "message": message,
                                                 "finish_reason": reply.finish_reason}]}
            if reply.usage == _AUTO:
                prompt = _content_bytes(body["messages"])
                completion = _content_bytes([message])
                data["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion}
            elif reply.usage is not None:
                data["usage"] = reply.usage
            return web.json_response(data)
        finally:
            self.in_flight -= 1
