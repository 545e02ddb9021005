"""The only way the harness reaches a model: OpenAI chat completions over HTTP (aiohttp).

Retries: HTTP 5xx and 429, connection errors and per-attempt timeouts are retried up to
``max_retries`` times with exponential backoff and jitter; every retry is counted. Other
4xx answers and malformed bodies are not retried. A call that still fails raises
:class:`InfraError`, which carries the retries it spent (they are counted too).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import random

import aiohttp

from gyre_jax.agents.config import HarnessConfig
from gyre_jax.serving.identity import HEADER_ATTEMPT


class InfraError(Exception):
    """The model server could not answer a call (after retries, or not retryable)."""

    def __init__(self, message: str, *, retries: int = 0):
        super().__init__(message)
        self.retries = retries


@dataclasses.dataclass(frozen=True)
class ChatReply:
    message: dict  # the assistant message: role, content (str), maybe tool_calls
    finish_reason: str | None
    usage: dict | None  # {"prompt_tokens", "completion_tokens", ...} when the server sent it
    retries: int  # failed attempts before this answer


def _retry_delay(config: HarnessConfig, attempt: int) -> float:
    # Full exponential backoff plus up to 50% jitter, so concurrent rollouts hitting the
    # same failing backend do not retry in lockstep.
    base = min(config.backoff_max_s, config.backoff_base_s * (2 ** attempt))
    return base * (1.0 + 0.5 * random.random())


class ChatClient:
    """POST ``{base_url}/chat/completions`` with retries. One per harness; share the session."""

    def __init__(self, session: aiohttp.ClientSession, config: HarnessConfig):
        self.session = session
        self.config = config
        self.url = config.base_url + "/chat/completions"

    async def chat(self, messages: list[dict], *, headers: dict[str, str], tools: list[dict] | None = None,
                   max_tokens: int | None = None) -> ChatReply:
        """One logical call; ``X-Gyre-Attempt`` is set per attempt so the server can
        tell retries apart (``X-Gyre-Call`` in ``headers`` stays the same)."""
        cfg = self.config
        body = {"model": cfg.model, "messages": messages, "max_tokens": max_tokens or cfg.max_tokens,
                "temperature": cfg.temperature, **cfg.extra_body}
        if tools:
            body["tools"] = tools
        payload = json.dumps(body)
        timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
        last_error = ""
        for attempt in range(cfg.max_retries + 1):
            if attempt:
                await asyncio.sleep(_retry_delay(cfg, attempt - 1))
            h = {**headers, HEADER_ATTEMPT: str(attempt), "Content-Type": "application/json"}
            try:
                async with self.session.post(self.url, data=payload, headers=h, timeout=timeout) as resp:
                    text = await resp.text()
                    if resp.status >= 500 or resp.status == 429:
                        last_error = f"HTTP {resp.status} from {self.url}: {text[:300]}"
                        continue
                    if resp.status != 200:
                        raise InfraError(f"HTTP {resp.status} from {self.url} (not retried): {text[:300]}",
                                         retries=attempt)
            except (aiohttp.ClientError, TimeoutError) as e:
                last_error = f"{type(e).__name__} calling {self.url}: {e}"
                continue
            return _parse_reply(text, self.url, retries=attempt)
        raise InfraError(f"call failed after {cfg.max_retries} retries; last error: {last_error}",
                         retries=cfg.max_retries)


def _parse_reply(text: str, url: str, *, retries: int) -> ChatReply:
    try:
        data = json.loads(text)
        choice = data["choices"][0]
        msg = choice["message"]
        if not isinstance(msg, dict):
            raise TypeError("message is not an object")
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise InfraError(f"malformed chat completion from {url} ({type(e).__name__}: {e}): {text[:300]}",
                         retries=retries) from None
    message = {"role": "assistant", "content": msg.get("content") or ""}
    if msg.get("tool_calls"):
        message["tool_calls"] = msg["tool_calls"]
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else None
    return ChatReply(message, choice.get("finish_reason"), usage, retries)
