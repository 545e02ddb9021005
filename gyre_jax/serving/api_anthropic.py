"""Anthropic Messages API: request parsing and response shapes.

Enough for the Claude Code CLI pointed at the proxy (ANTHROPIC_BASE_URL): system
as text or text blocks, user/assistant messages with text, tool_use and
tool_result blocks, custom tools (input_schema), streaming with the events
message_start, content_block_start, content_block_delta (text_delta /
input_json_delta), content_block_stop, message_delta, message_stop.
Unsupported inputs (images, documents, thinking blocks, top_k) are refused with 400
naming the field; ``stop_sequences`` are matched on the decoded text (stop_reason
"stop_sequence"); ``tool_choice`` (auto / any / tool / none) is honoured as on the
OpenAI API; options that do not change the tokens (metadata, cache_control,
thinking settings, ``disable_parallel_tool_use``) are accepted and listed in the
``X-Gyre-Ignored-Fields`` response header. Tool-use ids are the model's own (no
``toolu_`` rewrite), or invented ones the template does not render. ``system`` messages
inside ``messages`` (Claude Code's mid-conversation system turns) are kept in place.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from gyre_jax.serving.api_common import (
    ApiError,
    ChatCall,
    bad,
    get_bool,
    get_float,
    get_int,
    get_list,
    get_stop_strings,
    get_stop_token_ids,
    get_str,
    tool_choice_plan,
)
from gyre_jax.serving.tokenizer import Tokenizer

_KNOWN = {"model", "messages", "system", "max_tokens", "temperature", "top_p", "top_k", "stop_sequences", "stream",
          "tools", "tool_choice", "metadata", "thinking", "stop_token_ids", "return_token_ids", "service_tier",
          "context_management", "output_config"}
# Accepted, but they cannot change the tokens we produce (reported in X-Gyre-Ignored-Fields).
_NO_EFFECT = {"metadata", "thinking", "context_management", "output_config", "service_tier"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise bad(f"{where}: expected a string or a list of blocks")
    parts = []
    for j, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise bad(f"{where}[{j}]: only text blocks are supported here, got {kind!r}")
        parts.append(b["text"])
    return "".join(parts)


def _messages(body: dict) -> list[dict]:
    out: list[dict] = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text_of(system, "system")})
    msgs = get_list(body, "messages", required=True)
    if not msgs:
        raise bad("messages: at least one message is required", "messages")
    for i, m in enumerate(msgs):
        w = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise bad(f"{w}.role: expected 'user', 'assistant' or 'system'")
        role, content = m["role"], m.get("content")
        if role == "system":  # a mid-conversation system message (Claude Code sends these)
            out.append({"role": "system", "content": _text_of(content, f"{w}.content")})
            continue
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad(f"{w}.content: expected a string or a list of blocks")
        text, calls = [], []
        for j, b in enumerate(content):
            wb = f"{w}.content[{j}]"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                text.append(get_str(b, "text", where=f"{wb}."))
            elif kind == "tool_use" and role == "assistant":
                inp = b.get("input", {})
                if not isinstance(inp, dict) or not isinstance(b.get("name"), str):
                    raise bad(f"{wb}: tool_use needs a string 'name' and an object 'input'")
                calls.append({"id": b.get("id") or "", "name": b["name"], "arguments": inp})
            elif kind == "tool_result" and role == "user":
                if text:  # keep the order: text before this result is its own user turn
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                res = _text_of(b.get("content"), f"{wb}.content")
                if b.get("is_error"):
                    res = "[error] " + res
                out.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id") or ""), "content": res})
            else:
                raise bad(f"{wb}: block type {kind!r} is not supported in a {role} message")
        if role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif text:
            out.append({"role": "user", "content": "".join(text)})
    return out


def parse_messages(body: dict, tok: Tokenizer) -> ChatCall:
    if get_int(body, "top_k", None) is not None:
        raise bad("top_k: not supported (sampling must match what the trainer assumes)", "top_k")
    stops = get_stop_strings(body, "stop_sequences", limit=16)
    tools = []
    for i, t in enumerate(get_list(body, "tools")):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or t.get("type", "custom") != "custom":
            raise bad(f"tools[{i}]: only custom tools with a 'name' and 'input_schema' are supported", "tools")
        tools.append(_function_of(t))
    try:
        prompt = tok.render_chat(_messages(body), tools)
    except ValueError as e:
        raise bad(str(e)) from None
    forced, stop_extra, parse_tools, not_honoured = _tool_choice(body, tok, tools)
    return ChatCall(api="anthropic.messages", model=get_str(body, "model"),
                    prompt_ids=np.asarray(prompt + list(forced), np.int32),
                    max_tokens=get_int(body, "max_tokens", None, lo=1) or _required("max_tokens"),
                    temperature=get_float(body, "temperature", 1.0, lo=0.0, hi=1.0),
                    top_p=get_float(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True), seed=None,
                    stop_ids=tuple(tok.stop_ids) + stop_extra + get_stop_token_ids(body, tok.vocab_size),
                    stream=get_bool(body, "stream"), parse_tools=parse_tools, forced_ids=forced, stop_strings=stops,
                    ignored=tuple(sorted(set(body) - _KNOWN | (_NO_EFFECT & set(body)) | not_honoured)),
                    extras={"return_token_ids": get_bool(body, "return_token_ids")})


def _tool_choice(body: dict, tok: Tokenizer, tools: list[dict]):
    """Anthropic ``tool_choice``: {"type": "auto" | "any" | "tool" (+ "name") | "none"}; the not honoured
    ``disable_parallel_tool_use`` is reported as ``tool_choice.disable_parallel_tool_use``."""
    tc = body.get("tool_choice")
    if tc is None:
        return tool_choice_plan(tok, "auto", None, tools, "tool_choice") + (set(),)
    kinds = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}
    if not isinstance(tc, dict) or tc.get("type") not in kinds:
        raise bad("tool_choice: expected {'type': 'auto' | 'any' | 'tool' | 'none'}", "tool_choice")
    if tc["type"] == "tool" and not isinstance(tc.get("name"), str):
        raise bad("tool_choice.name: required string for type 'tool'", "tool_choice")
    ignored = {"tool_choice.disable_parallel_tool_use"} if tc.get("disable_parallel_tool_use") else set()
    return tool_choice_plan(tok, kinds[tc["type"]], tc.get("name"), tools, "tool_choice.name") + (ignored,)


def _required(name: str):
    raise bad(f"{name}: required", name)


def _function_of(tool: dict) -> dict:
    """An Anthropic custom tool as the OpenAI function object a chat template renders: only the fields it
    has (no empty description added), ``input_schema`` as ``parameters``."""
    keys = {"name": "name", "description": "description", "input_schema": "parameters"}
    return {keys[k]: v for k, v in tool.items() if k in keys}


def count_tokens(body: dict, tok: Tokenizer) -> dict:
    tools = [{"name": t.get("name"), **_function_of(t)} for t in get_list(body, "tools") if isinstance(t, dict)]
    return {"input_tokens": len(tok.render_chat(_messages(body), tools))}


def stop_reason(finish: str, n_tool_calls: int, stop_sequence: str | None = None) -> str:
    if stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS["tool_calls" if finish == "stop" and n_tool_calls else finish]


class BlockBuilder:
    """AssistantStream events -> Anthropic content blocks and stream events."""

    def __init__(self):
        self.blocks: list[dict] = []
        self._open_text = False
        self.n_tool_calls = 0

    def events(self, evs) -> list[tuple[str, dict]]:
        out = []
        for kind, val in evs:
            if kind == "text":
                if not self._open_text:
                    self.blocks.append({"type": "text", "text": ""})
                    self._open_text = True
                    out.append(("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                                        "content_block": {"type": "text", "text": ""}}))
                self.blocks[-1]["text"] += val
                out.append(("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                                    "delta": {"type": "text_delta", "text": val}}))
            else:
                out += self._close_text()
                self.n_tool_calls += 1
                cid = val["id"]  # the model's own id, or one invented by CallIds (exact round trips)
                self.blocks.append({"type": "tool_use", "id": cid, "name": val["name"], "input": val["arguments"]})
                i = len(self.blocks) - 1
                out += [("content_block_start", {"type": "content_block_start", "index": i, "content_block": {
                            "type": "tool_use", "id": cid, "name": val["name"], "input": {}}}),
                        ("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                            "type": "input_json_delta", "partial_json": json.dumps(val["arguments"], ensure_ascii=False)}}),
                        ("content_block_stop", {"type": "content_block_stop", "index": i})]
        return out

    def _close_text(self):
        if not self._open_text:
            return []
        self._open_text = False
        return [("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})]

    def finish(self) -> list[tuple[str, dict]]:
        out = self._close_text()
        if not self.blocks:  # always answer with at least one (empty) text block
            self.blocks.append({"type": "text", "text": ""})
            out += [("content_block_start", {"type": "content_block_start", "index": 0,
                                             "content_block": {"type": "text", "text": ""}}),
                    ("content_block_stop", {"type": "content_block_stop", "index": 0})]
        return out


def message_start(call: ChatCall, mid: str) -> dict:
    return {"type": "message_start", "message": {
        "id": mid, "type": "message", "role": "assistant", "model": call.model, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": int(len(call.prompt_ids)), "output_tokens": 0}}}


def message_delta(finish: str, n_tool_calls: int, n_out: int, stop_sequence: str | None = None) -> dict:
    return {"type": "message_delta", "delta": {"stop_reason": stop_reason(finish, n_tool_calls, stop_sequence),
                                                "stop_sequence": stop_sequence}, "usage": {"output_tokens": n_out}}


def message_response(call: ChatCall, tok: Tokenizer, mid: str, sample) -> dict:
    b = BlockBuilder()
    b.events(sample.events)
    b.finish()
    out = {"id": mid, "type": "message", "role": "assistant", "model": call.model, "content": b.blocks,
           "stop_reason": stop_reason(sample.finish, b.n_tool_calls, sample.stop_sequence),
           "stop_sequence": sample.stop_sequence,
           "usage": {"input_tokens": int(len(call.prompt_ids)), "output_tokens": len(sample.tokens)}}
    if call.extras.get("return_token_ids"):
        out["prompt_token_ids"] = [int(t) for t in call.prompt_ids]
        out["token_ids"] = [int(t) for t in sample.tokens]
    return out


def error_body(e: ApiError) -> dict:
    kinds = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
    return {"type": "error", "error": {"type": kinds.get(e.status, "api_error"), "message": e.message}}


