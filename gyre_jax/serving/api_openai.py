"""OpenAI-compatible request parsing and response shapes (chat and completions).

Supported: ``/v1/chat/completions`` (messages with system/developer/user/
assistant/tool roles, text content parts, ``tools`` of type function, assistant
``tool_calls``, streaming SSE with ``stream_options.include_usage``, ``logprobs``)
and ``/v1/completions`` (``prompt`` as a string or a list of token ids).
Extensions (as vLLM has them): ``chat_template_kwargs`` (variables for the checkpoint's chat
template, e.g. Qwen3's ``{"enable_thinking": false}``; listed in ``X-Gyre-Ignored-Fields`` with the
byte tokenizer, whose template has none), an assistant message's ``reasoning_content`` (or
``reasoning``: rendered where the template puts it, Qwen3 inside ``<think>``),
``stop_token_ids`` (token-level stops), ``ignore_eos`` (completions:
do not stop at <|eos|>, as in vLLM) and ``return_token_ids``
(adds ``prompt_token_ids`` / ``token_ids`` to the response, for harnesses that
keep tokens themselves). Text ``stop`` sequences are matched on the decoded text
(cut from the reply; the tokens are recorded as generated); ``n`` > 1 samples the
prompt n times (n calls of the rollout; streamed, each chunk names its choice index); ``tool_choice``
("none", "required", a named function) is honoured (``api_common.tool_choice_plan``).
``echo``, ``best_of`` and penalties are refused with 400 rather than silently ignored;
``parallel_tool_calls: false`` is not enforced and is listed in ``X-Gyre-Ignored-Fields``.
"""
from __future__ import annotations

import json
import time
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
from gyre_jax.serving.tokenizer import Tokenizer, chat_template_kwargs

_CHAT_KNOWN = {"model", "messages", "tools", "tool_choice", "parallel_tool_calls", "max_tokens",
               "max_completion_tokens", "temperature", "top_p", "n", "stream", "stream_options", "seed", "stop",
               "logprobs", "top_logprobs", "user", "stop_token_ids", "return_token_ids", "metadata", "store",
               "presence_penalty", "frequency_penalty", "chat_template_kwargs"}
_COMPLETION_KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options",
                     "seed", "stop", "logprobs", "echo", "best_of", "user", "stop_token_ids", "return_token_ids",
                     "presence_penalty", "frequency_penalty", "suffix", "ignore_eos"}


MAX_N = 16  # samples per request
# Accepted, but they cannot change the tokens we produce (reported in X-Gyre-Ignored-Fields).
_NO_EFFECT = {"user", "metadata", "store"}


def _common(body: dict, api: str, known: set[str]) -> dict[str, Any]:
    n = get_int(body, "n", 1, lo=1, hi=MAX_N)
    for k in ("presence_penalty", "frequency_penalty"):
        if body.get(k) not in (None, 0, 0.0):
            raise bad(f"{k}: not supported (sampling must match what the trainer assumes)", k)
    so = body.get("stream_options") or {}
    if not isinstance(so, dict):
        raise bad("stream_options: expected an object", "stream_options")
    return dict(
        model=get_str(body, "model"),
        temperature=get_float(body, "temperature", 1.0, lo=0.0, hi=2.0),
        top_p=get_float(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
        seed=get_int(body, "seed", None, lo=0, hi=2**31 - 1),
        stream=get_bool(body, "stream"),
        ignored=tuple(sorted((set(body) - known) | (_NO_EFFECT & set(body)))),
        include_usage=bool(so.get("include_usage", False)),
        n=n, stop_strings=get_stop_strings(body, "stop", limit=4),
    )


def _tool_choice(body: dict, tok: Tokenizer, tools: list[dict]):
    """OpenAI ``tool_choice``: "auto" | "none" | "required" | {"type": "function", "function": {"name"}}."""
    tc = body.get("tool_choice")
    if tc is None or tc == "auto":
        return tool_choice_plan(tok, "auto", None, tools, "tool_choice")
    if tc in ("none", "required"):
        return tool_choice_plan(tok, tc, None, tools, "tool_choice")
    fn = tc.get("function") if isinstance(tc, dict) else None
    if not isinstance(tc, dict) or tc.get("type") != "function" or not isinstance(fn, dict) \
            or not isinstance(fn.get("name"), str):
        raise bad("tool_choice: expected 'auto', 'none', 'required' or {'type': 'function', 'function': "
                  "{'name': ...}}", "tool_choice")
    return tool_choice_plan(tok, "named", fn["name"], tools, "tool_choice.function.name")


def _content_text(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}: expected a string or a list of content parts, got {type(content).__name__}")
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad(f"{where}[{j}]: only text parts are supported, got {kind!r}")
        if not isinstance(part.get("text"), str):
            raise bad(f"{where}[{j}].text: expected a string")
        out.append(part["text"])
    return "".join(out)


def parse_chat(body: dict, tok: Tokenizer) -> ChatCall:
    c = _common(body, "openai.chat", _CHAT_KNOWN)
    msgs = [_chat_message(m, f"messages[{i}]") for i, m in enumerate(get_list(body, "messages", required=True))]
    if not msgs:
        raise bad("messages: at least one message is required", "messages")
    tools = []
    for i, t in enumerate(get_list(body, "tools")):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise bad(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ...}}}}", "tools")
        tools.append(dict(fn))  # as sent: a template renders the client's object, not one we rebuilt
    try:
        kwargs = chat_template_kwargs(body.get("chat_template_kwargs"), "chat_template_kwargs")
        prompt = tok.render_chat(msgs, tools, template_kwargs=kwargs)
    except ValueError as e:
        raise bad(str(e)) from None
    forced, stop_extra, parse_tools = _tool_choice(body, tok, tools)
    not_honoured = [k for k, no in (("parallel_tool_calls", body.get("parallel_tool_calls") is False),
                                    ("chat_template_kwargs", bool(kwargs) and not tok.accepts_template_kwargs)) if no]
    ignored = tuple(sorted(c["ignored"] + tuple(not_honoured)))
    lp = get_bool(body, "logprobs")
    if get_int(body, "top_logprobs", 0, lo=0) not in (0, None):
        raise bad("top_logprobs: only 0 is supported (the sampled token's log-prob is returned)", "top_logprobs")
    mt = get_int(body, "max_completion_tokens", None, lo=1)
    mt = get_int(body, "max_tokens", mt, lo=1)
    return ChatCall(api="openai.chat", model=c["model"], prompt_ids=np.asarray(prompt + list(forced), np.int32),
                    max_tokens=mt, temperature=c["temperature"], top_p=c["top_p"], seed=c["seed"],
                    stop_ids=tuple(tok.stop_ids) + stop_extra + get_stop_token_ids(body, tok.vocab_size),
                    stream=c["stream"], parse_tools=parse_tools, ignored=ignored, forced_ids=forced,
                    stop_strings=c["stop_strings"], n=c["n"],
                    extras={"logprobs": lp, "include_usage": c["include_usage"],
                            "return_token_ids": get_bool(body, "return_token_ids")})


def _chat_message(m, w: str) -> dict:
    """One of a chat request's messages as the chat template renders it (``w``: where, for errors)."""
    if not isinstance(m, dict):
        raise bad(f"{w}: expected an object")
    role = m.get("role")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise bad(f"{w}.role: {role!r} is not one of system, developer, user, assistant, tool")
    out = {"role": role, "content": _content_text(m.get("content"), f"{w}.content")}
    if role == "tool":
        out["tool_call_id"] = get_str(m, "tool_call_id", required=False, where=f"{w}.") or ""
    if role == "assistant":  # the reasoning of an earlier turn (vLLM's field; "reasoning" is its newer name)
        key = "reasoning_content" if m.get("reasoning_content") is not None else "reasoning"
        reasoning = get_str(m, key, required=False, where=f"{w}.")
        if reasoning is not None:
            out["reasoning_content"] = reasoning
    calls = [_tool_call(tc, f"{w}.tool_calls[{j}]") for j, tc in enumerate(get_list(m, "tool_calls", where=f"{w}."))]
    if calls:
        out["tool_calls"] = calls
    return out


def _tool_call(tc, w: str) -> dict:
    """An assistant message's tool call: {"id", "name", "arguments": a JSON object}."""
    fn = tc.get("function") if isinstance(tc, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad(f"{w}.function.name: required string")
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError as e:
        raise bad(f"{w}.function.arguments: not valid JSON ({e})") from None
    if not isinstance(args, dict):
        raise bad(f"{w}.function.arguments: must be a JSON object")
    return {"id": tc.get("id") or "", "name": fn["name"], "arguments": args}


def parse_completion(body: dict, tok: Tokenizer, vocab_size: int) -> ChatCall:
    c = _common(body, "openai.completions", _COMPLETION_KNOWN)
    # What would change the output, refused rather than ignored. Compared by type as well as value:
    # `True in (1,)` holds in Python, which let "echo": true through.
    allowed = {"echo": (None, False), "best_of": (None, 1), "suffix": (None, "")}
    for k, ok in allowed.items():
        v = body.get(k)
        if not any(v is a or (type(v) is type(a) and v == a) for a in ok):
            raise bad(f"{k}: not supported (only {' or '.join(json.dumps(a) for a in ok)})", k)
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        ids = tok.encode(p)
    elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        bad_i = [i for i, x in enumerate(p) if not 0 <= x < vocab_size]
        if bad_i:
            raise bad(f"prompt[{bad_i[0]}]: token id {p[bad_i[0]]} is not in [0, {vocab_size})", "prompt")
        ids = p
    else:
        raise bad("prompt: expected a string or one non-empty list of token ids (batches are not supported)", "prompt")
    if not ids:
        raise bad("prompt: is empty", "prompt")
    lp = get_int(body, "logprobs", None, lo=0, hi=1)
    return ChatCall(api="openai.completions", model=c["model"], prompt_ids=np.asarray(ids, np.int32),
                    max_tokens=get_int(body, "max_tokens", 16, lo=1), temperature=c["temperature"], top_p=c["top_p"],
                    seed=c["seed"], stop_ids=(() if get_bool(body, "ignore_eos") else (tok.special["<|eos|>"],))
                    + get_stop_token_ids(body, vocab_size),
                    stream=c["stream"], parse_tools=False, ignored=c["ignored"], stop_strings=c["stop_strings"],
                    n=c["n"], extras={"logprobs": lp is not None, "include_usage": c["include_usage"],
                            "return_token_ids": get_bool(body, "return_token_ids")})


# ---- responses -------------------------------------------------------------------
def finish_reason(finish: str, n_tool_calls: int) -> str:
    if finish == "stop" and n_tool_calls:
        return "tool_calls"
    return "stop" if finish == "stop" else "length"


def _tool_calls_json(calls) -> list[dict]:
    return [{"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for c in calls]


def _logprobs(tok: Tokenizer, ids, lps) -> dict:
    return {"content": [{"token": tok.decode([t]), "token_id": int(t), "logprob": float(lp), "top_logprobs": []}
                        for t, lp in zip(ids, lps)]}


def usage(n_prompt: int, n_out: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def chat_response(call: ChatCall, tok: Tokenizer, rid: str, samples) -> dict:
    """samples: one ``Sample`` (proxy) per choice."""
    choices = []
    for i, sm in enumerate(samples):
        msg: dict[str, Any] = {"role": "assistant", "content": sm.text}
        if sm.calls:
            msg["tool_calls"] = _tool_calls_json(sm.calls)
        choice = {"index": i, "message": msg, "finish_reason": finish_reason(sm.finish, len(sm.calls)),
                  "logprobs": _logprobs(tok, sm.tokens, sm.logprobs) if call.extras.get("logprobs") else None}
        if call.extras.get("return_token_ids"):
            choice["token_ids"] = [int(t) for t in sm.tokens]
        choices.append(choice)
    out = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": call.model,
           "choices": choices, "usage": usage(len(call.prompt_ids), sum(len(sm.tokens) for sm in samples))}
    if call.extras.get("return_token_ids"):
        out["prompt_token_ids"] = [int(t) for t in call.prompt_ids]
    return out


def chat_chunk(call: ChatCall, rid: str, delta: dict, finish: str | None = None, *, index: int = 0, **extra) -> dict:
    d = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": call.model,
         "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}]}
    d.update(extra)
    return d


def tool_call_delta(index: int, c: dict) -> dict:
    j = _tool_calls_json([c])[0]
    j["index"] = index
    return {"tool_calls": [j]}


def completion_response(call: ChatCall, tok: Tokenizer, rid: str, samples) -> dict:
    choices = []
    for i, sm in enumerate(samples):
        choice = {"index": i, "text": sm.text, "finish_reason": "stop" if sm.finish == "stop" else "length",
                  "logprobs": None}
        if call.extras.get("logprobs"):
            choice["logprobs"] = {"tokens": [tok.decode([t]) for t in sm.tokens],
                                  "token_logprobs": [float(x) for x in sm.logprobs], "top_logprobs": None,
                                  "text_offset": None}
        if call.extras.get("return_token_ids"):
            choice["token_ids"] = [int(t) for t in sm.tokens]
        choices.append(choice)
    out = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": call.model,
           "choices": choices, "usage": usage(len(call.prompt_ids), sum(len(sm.tokens) for sm in samples))}
    if call.extras.get("return_token_ids"):
        out["prompt_token_ids"] = [int(t) for t in call.prompt_ids]
    return out


def completion_chunk(call: ChatCall, rid: str, text: str, finish: str | None, token_ids=None, *, index: int = 0) -> dict:
    choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": call.model,
            "choices": [choice]}


def error_body(e: ApiError) -> dict:
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.status}}
