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
from typing import Any, Literal, overload

import numpy as np

from gyre_jax.serving.tokenizer import ByteTokenizer, Tokenizer, client_call_id, invented_call_id, is_invented_call_id


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


@overload
def get_str(body: dict, key: str, *, required: Literal[True] = True, where: str = "") -> str: ...
@overload
def get_str(body: dict, key: str, *, required: bool, where: str = "") -> str | None: ...
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
    stop_strings: tuple[str, ...] = ()  # text stop sequences, matched on the decoded text
    # tool_choice forcing a call: ids put after the rendered prompt (prefilled, recorded as prompt:
    # the model did not choose them) and shown to the client as the start of its output.
    forced_ids: tuple[int, ...] = ()
    n: int = 1  # samples of this prompt (recorded as n calls of the rollout)


def get_stop_strings(body: dict, key: str, *, limit: int) -> tuple[str, ...]:
    """``stop`` / ``stop_sequences``: one string or a list of non-empty strings."""
    v = body.get(key)
    if v is None or v == "" or v == []:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(x, str) and x for x in items):
        raise bad(f"{key}: expected a non-empty string or a list of non-empty strings", key)
    if len(items) > limit:
        raise bad(f"{key}: at most {limit} stop sequences, got {len(items)}", key)
    return tuple(dict.fromkeys(items))


def tool_choice_plan(tok: Tokenizer, mode: str, name: str | None, tools: list[dict], where: str):
    """(forced_ids, extra_stop_ids, parse_tools) that honour a tool choice.

    mode "auto": nothing. "none": generation stops at the tool-call opening when that is a special token
    (so no call is emitted), else calls are not parsed (the model's text is returned as text).
    "required" / "named": the tool-call opening (``tok.tool_call_open_ids()``) and, when the function is
    known (named, or the only tool), its name and the tokens up to its arguments are forced; the arguments
    are the model's own free JSON.
    """
    if mode == "auto":
        return (), (), True
    if mode == "none":
        opening = tok.tool_call_open_ids()
        if opening and opening[0] in set(tok.special.values()):
            return (), (opening[0],), True
        return (), (), False
    if not tools:
        raise bad(f"{where}: requires a tool call but the request has no tools", where.split(".")[0])
    names = [t["name"] for t in tools]
    if mode == "named" and name not in names:
        raise bad(f"{where}: function {name!r} is not among the request's tools {names}", where.split(".")[0])
    if mode == "required" and len(names) > 1:
        return tuple(tok.tool_call_open_ids()), (), True
    return tuple(forced_call_prefix(tok, name or names[0])), (), True


def forced_call_prefix(tok: Tokenizer, name: str) -> list[int]:
    """The ids of a call to ``name`` up to its arguments, as the template renders them: the common
    prefix of two renderings that differ only in the arguments (so it tokenizes as the full call does)."""
    a = tok.render_tool_call({"name": name, "arguments": {}})
    b = tok.render_tool_call({"name": name, "arguments": {"a": 0}})
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    opening = tok.tool_call_open_ids()
    return a[:k] if a[:len(opening)] == opening else opening


class CallIds:
    """The ids a client sees for the model's tool calls, chosen so a conversation echoed back renders to
    exactly the tokens the model produced: an id the model wrote is passed through unchanged (in both
    APIs; escaped by ``tokenizer.client_call_id`` if it looks like one we invent); a call without one (or any call in a format that carries no ids) gets an invented id that the
    template recognizes and does not render, unique per response (``nonce``)."""

    def __init__(self, tok: Tokenizer, nonce: str, prefix: str):
        self._keep = getattr(tok, "tool_format", "gyre") == "gyre"
        self._nonce, self._prefix, self._k = "".join(c for c in nonce.lower() if c in "0123456789abcdef")[-10:], \
            prefix, 0

    def __call__(self, call: dict) -> dict:
        cid = call.get("id") or ""
        if not (self._keep and cid and not is_invented_call_id(cid)):
            cid = invented_call_id(self._k, nonce=self._nonce, prefix=self._prefix)
        self._k += 1
        return {**call, "id": cid}


class OutputText:
    """One sample's client-visible output: ``AssistantStream`` events with the forced opening fed first,
    the client's tool-call ids (``CallIds``) and text stop sequences applied. Text that may be the start of
    a stop sequence is held back; once one matches, ``hit`` names it, the text before it is the last text
    and the caller stops generating (the tokens so far are recorded as generated)."""

    def __init__(self, tok: Tokenizer, call: ChatCall, ids: CallIds):
        self._asm = AssistantStream(tok, parse_tools=call.parse_tools,
                                    stop_ids=None if call.parse_tools else call.stop_ids)
        self._ids, self._stops = ids, call.stop_strings
        self._held = ""
        self.hit: str | None = None
        self.n_calls = 0
        self._pending = [ev for t in call.forced_ids for ev in self._asm.feed(int(t))]

    def feed(self, t: int) -> list[tuple[str, Any]]:
        evs, self._pending = self._pending + self._asm.feed(int(t)), []
        return self._filter(evs)

    def finish(self) -> list[tuple[str, Any]]:
        evs, self._pending = self._pending + self._asm.finish(), []
        out = self._filter(evs)
        if self.hit is None and self._held:
            out.append(("text", self._held))
        self._held = ""
        return out

    def _filter(self, evs) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for kind, val in evs:
            if self.hit is not None:
                break
            if kind != "text":
                if self._held:
                    out.append(("text", self._held))
                    self._held = ""
                self.n_calls += 1
                out.append((kind, self._ids(val)))
                continue
            s = self._held + val
            found = [(i, x) for x in self._stops if (i := s.find(x)) >= 0]
            if found:
                i, self.hit = min(found)
                if i:
                    out.append(("text", s[:i]))
                self._held = ""
                continue
            keep = max((k for x in self._stops for k in range(1, len(x)) if s.endswith(x[:k])), default=0)
            if len(s) > keep:
                out.append(("text", s[:len(s) - keep]))
            self._held = s[len(s) - keep:]
        return out


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
        self._open: int | None = None  # the tool-call span's open and close ids (None: no spans parsed)
        self._close: int | None = None
        self._hold = ""  # text kept back at the end of a run: the template's separator before a call
        self._keep_marks = False  # a malformed call's open/close tokens are text (Qwen) or dropped specials (ours)
        self._json_message = parse_tools and fmt == "llama3_json"
        self._ids_rendered = fmt == "gyre"  # the other formats carry no ids: parse_assistant names them call_<k>
        if parse_tools and fmt == "gyre":
            self._open, self._close = tok.special["<|tool_call|>"], tok.special["<|/tool_call|>"]
        elif parse_tools and fmt == "qwen":
            self._open, self._close = tok.special["<|tool_call|>"], tok.special["<|/tool_call|>"]
            self._hold, self._keep_marks = "\n", True
        self._parse_span = tok.parse_call_span  # the same span parser as parse_assistant's
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
                return self._text_ids(self._marked(span, closed=True) if self._keep_marks else span)
            out = self._flush_text(final=True, strip=self._hold)
            if "id" in call and self._ids_rendered:  # the model's own id, escaped if it looks like one we invent
                call["id"] = client_call_id(call["id"])
            call.setdefault("id", invented_call_id(self.n_calls) if self._ids_rendered else f"call_{self.n_calls}")
            self.n_calls += 1
            return out + [("tool_call", call)]
        return self._text_ids([t])

    def finish(self) -> list[tuple[str, Any]]:
        out = self._end_message()
        if self._span is not None:  # unterminated tool call: its text
            span, self._span = self._span, None
            out += self._text_ids(self._marked(span, closed=False) if self._keep_marks else span)
        return out + self._flush_text(final=True)

    def _marked(self, span: list[int], *, closed: bool) -> list[int]:
        """A malformed span as text, with its open (and close) tokens."""
        if self._open is None or self._close is None:  # a span starts only at self._open
            raise RuntimeError("AssistantStream: a tool-call span with no open/close ids")
        return [self._open] + span + ([self._close] if closed else [])

    def _feed_message(self, t: int) -> list[tuple[str, Any]]:
        """Llama-3 JSON: decide from the first non-blank text whether the message is a tool call."""
        message = self._message
        if message is None:  # feed() calls this only while a message is undecided
            return self._text_ids([t])
        message.append(t)
        if self._buffering:
            return []
        text = self.tok.decode(message)
        if message[0] == getattr(self.tok, "python_tag_id", None) or text.lstrip().startswith("{"):
            self._buffering = True
            return []
        if not text.strip():
            return []
        self._message = None
        return self._text_ids(message)

    def _end_message(self) -> list[tuple[str, Any]]:
        if self._message is None:
            return []
        ids, self._message = self._message, None
        parsed = self.tok.parse_assistant(ids)
        out = [("text", parsed["content"])] if parsed["content"] else []
        self.n_calls += len(parsed["tool_calls"])
        return out + [("tool_call", c) for c in parsed["tool_calls"]]

    def _text_ids(self, ids: list[int]) -> list[tuple[str, Any]]:
        if isinstance(self.tok, ByteTokenizer):
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
