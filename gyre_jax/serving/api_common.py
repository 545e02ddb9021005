"""Pieces shared by the OpenAI and Anthropic API layers of the proxy.

* ``ApiError``: an HTTP error with a message that names the offending field.
* field readers (``get_int``, ``get_float``, ...) that raise ApiError(400).
* ``ChatCall``: an API request normalized to what the engine needs (prompt ids,
  sampling, streaming flag, which API asked).
* ``AssistantStream``: turns generated ids into text deltas and tool calls as
  they arrive; its result always equals ``Tokenizer.parse_assistant`` of the
  same ids, so the streamed and non-streamed answers agree.
"""
from __future__ import annotations

import codecs
import dataclasses
import math
from typing import Any

import numpy as np

from gyre_jax.serving.tokenizer import ByteTokenizer, Tokenizer, _parse_call


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def get_int(body: dict, key: str, default=None, *, lo: int | None = None, hi: int | None = None, where: str = ""):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"{where}{key}: expected an integer, got {type(v).__name__}", key)
    if lo is not None and v < lo:
        raise bad(f"{where}{key}: {v} is below the minimum {lo}", key)
    if hi is not None and v > hi:
        raise bad(f"{where}{key}: {v} exceeds the limit {hi}", key)
    return v


def get_float(body: dict, key: str, default, *, lo: float, hi: float, lo_open: bool = False):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(f"{key}: expected a number, got {v!r}", key)
    if v > hi or v < lo or (lo_open and v <= lo):
        raise bad(f"{key}: {v} is outside {'(' if lo_open else '['}{lo}, {hi}]", key)
    return float(v)


def get_bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"{key}: expected true or false, got {v!r}", key)
    return v


def get_str(body: dict, key: str, *, required: bool = True, where: str = "") -> str | None:
    v = body.get(key)
    if v is None and not required:
        return None
    if not isinstance(v, str):
        raise bad(f"{where}{key}: expected a string, got {type(v).__name__ if v is not None else 'nothing'}", key)
    return v


def get_list(body: dict, key: str, *, required: bool = False, where: str = "") -> list:
    v = body.get(key)
    if v is None:
        if required:
            raise bad(f"{where}{key}: required", key)
        return []
    if not isinstance(v, list):
        raise bad(f"{where}{key}: expected a list, got {type(v).__name__}", key)
    return v


def get_stop_token_ids(body: dict, vocab_size: int) -> tuple[int, ...]:
    """Extension field ``stop_token_ids`` (token-level stops, as in vLLM)."""
    ids = get_list(body, "stop_token_ids")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise bad(f"stop_token_ids[{i}]: {t!r} is not a token id in [0, {vocab_size})", "stop_token_ids")
    return tuple(ids)


@dataclasses.dataclass(kw_only=True)
class ChatCall:
    api: str  # "openai.chat" | "openai.completions" | "anthropic.messages"
    model: str
    prompt_ids: np.ndarray
    max_tokens: int | None  # None: fill the context (up to the server's cap)
    temperature: float
    top_p: float
    seed: int | None
    stop_ids: tuple[int, ...]
    stream: bool
    parse_tools: bool  # chat APIs parse tool calls out of the output
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)  # API-specific options
    ignored: tuple[str, ...] = ()  # request fields we do not act on (reported in a header)


class AssistantStream:
    """Incremental ``parse_assistant``: feed ids, get ("text", str) / ("tool_call", dict) events.

    Three tool-call syntaxes, picked by the tokenizer's ``tool_format``: ours (the
    default: ``<|tool_call|>`` ... ``<|/tool_call|>`` special ids), Qwen's (``<tool_call>``
    ... ``</tool_call>`` tokens; the ``"\n"`` the template puts before a call is held back
    until the next token shows whether a call follows) and Llama-3's JSON message (a
    message that opens with ``{`` or ``<|python_tag|>`` is buffered and parsed whole at
    its end; any other message streams as text). The events always add up to
    ``tok.parse_assistant`` of the same ids.
    """

    def __init__(self, tok: Tokenizer, *, parse_tools: bool = True, stop_ids=None):
        self.tok = tok
        fmt = getattr(tok, "tool_format", "gyre")
        self._open = self._close = None
        self._hold = ""  # text kept back at the end of a run: the template's separator before a call
        self._keep_marks = False  # a malformed call's open/close tokens are text (Qwen) or dropped specials (ours)
        self._json_message = parse_tools and fmt == "llama3_json"
        if parse_tools and fmt == "gyre":
            self._open, self._close = tok.special["<|tool_call|>"], tok.special["<|/tool_call|>"]
        elif parse_tools and fmt == "qwen":
            self._open, self._close = tok.special["<|tool_call|>"], tok.special["<|/tool_call|>"]
            self._hold, self._keep_marks = "\n", True
        self._parse_span = getattr(tok, "parse_call_span", None) or (lambda ids: _parse_call(tok.decode(ids)))
        self._stop = set(tok.stop_ids if stop_ids is None else stop_ids)
        self._span: list[int] | None = None
        self._run: list[int] = []  # current text run (generic tokenizers re-decode it)
        self._emitted = 0
        self._message: list[int] | None = [] if self._json_message else None  # undecided / buffered JSON message
        self._buffering = False
        self._bytes = isinstance(tok, ByteTokenizer)
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stopped = False
        self.n_calls = 0

    def feed(self, t: int) -> list[tuple[str, Any]]:
        if self.stopped:
            return []
        if t in self._stop:
            self.stopped = True
            return self._end_message() + self._flush_text(final=True)
        if self._message is not None:
            return self._feed_message(t)
        if self._open is not None and t == self._open and self._span is None:
            self._span = []
            return [] if self._hold else self._flush_text(final=True)
        if self._span is not None:
            if t != self._close:
                self._span.append(t)
                return []
            span, self._span = self._span, None
            call = self._parse_span(span)
            if call is None:
                return self._text_ids([self._open] + span + [self._close] if self._keep_marks else span)
            out = self._flush_text(final=True, strip=self._hold)
            call.setdefault("id", f"call_{self.n_calls}")
            self.n_calls += 1
            return out + [("tool_call", call)]
        return self._text_ids([t])

    def finish(self) -> list[tuple[str, Any]]:
        out = self._end_message()
        if self._span is not None:  # unterminated tool call: its text
            span, self._span = self._span, None
            out += self._text_ids([self._open] + span if self._keep_marks else span)
        return out + self._flush_text(final=True)

    def _feed_message(self, t: int) -> list[tuple[str, Any]]:
        """Llama-3 JSON: decide from the first non-blank text whether the message is a tool call."""
        self._message.append(t)
        if self._buffering:
            return []
        text = self.tok.decode(self._message)
        if self._message[0] == getattr(self.tok, "python_tag_id", None) or text.lstrip().startswith("{"):
            self._buffering = True
            return []
        if not text.strip():
            return []
        ids, self._message = self._message, None
        return self._text_ids(ids)

    def _end_message(self) -> list[tuple[str, Any]]:
        if self._message is None:
            return []
        ids, self._message = self._message, None
        parsed = self.tok.parse_assistant(ids)
        out = [("text", parsed["content"])] if parsed["content"] else []
        self.n_calls += len(parsed["tool_calls"])
        return out + [("tool_call", c) for c in parsed["tool_calls"]]

    def _text_ids(self, ids: list[int]) -> list[tuple[str, Any]]:
        if self._bytes:
            s = self._dec.decode(self.tok.decode_bytes(ids))
            return [("text", s)] if s else []
        self._run += ids
        s = self.tok.decode(self._run)
        keep = len(s) - (1 if s.endswith("\ufffd") else 0)  # maybe a partial character
        if self._hold and s[:keep].endswith(self._hold):  # maybe the separator before a tool call
            keep -= len(self._hold)
        if keep > self._emitted:
            d, self._emitted = s[self._emitted:keep], keep
            return [("text", d)]
        return []

    def _flush_text(self, *, final: bool, strip: str = "") -> list[tuple[str, Any]]:
        if self._bytes:
            s = self._dec.decode(b"", final=True)
            self._dec.reset()
            return [("text", s)] if s else []
        s = self.tok.decode(self._run)
        if strip and s.endswith(strip):
            s = s[: -len(strip)]
        d = s[self._emitted:]
        self._run, self._emitted = [], 0
        return [("text", d)] if d else []
