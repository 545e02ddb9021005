"""The Tokenizer interface and the token-level chat template every tokenizer shares
(tokenizer.py's module docstring shows the template), with the tool-call id and JSON helpers.

Its own module so that tokenizer.py's ``load_tokenizer`` can build a checkpoint's
``HFChatTokenizer`` (hf_tokenizer.py) while that class extends ``Tokenizer``: both import
this module, neither the other's importer. tokenizer.py re-exports every name here.
"""
from __future__ import annotations

import abc
import json
import re
from typing import Any, Sequence

SPECIAL_TOKENS = (
    "<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>",
    "<|tool_call|>", "<|/tool_call|>", "<|tools|>", "<|/tools|>", "<|tool_result|>", "<|/tool_result|>",
)
CHAT_ROLES = ("system", "user", "assistant", "tool")


class Tokenizer(abc.ABC):
    """What the proxy needs from a tokenizer: text <-> ids plus the chat template."""

    vocab_size: int
    special: dict[str, int]  # name ("<|im_end|>", ...) -> id

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Plain text to ids; special-token text is NOT interpreted."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Ids to text; special tokens are dropped, undecodable bytes replaced."""

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.special["<|im_end|>"], self.special["<|eos|>"])

    @property
    def bos_id(self) -> int:
        return self.special["<|bos|>"]

    def tool_call_open_ids(self) -> list[int]:
        """Ids that open a tool call in this tokenizer's chat format, up to where the name begins.

        Constrained decoding of ``tool_choice`` ("required", a named function) forces
        these first; a tokenizer family with another tool-call syntax overrides it.
        """
        return self._tok("<|tool_call|>") + self.encode('{"name":"')

    def _tok(self, name: str) -> list[int]:
        return [self.special[name]]

    # ---- chat template (token level) -----------------------------------
    # Whether render_chat's template_kwargs can change the prompt (a checkpoint's jinja template); the
    # token-level template has no options, so the API layers list a request's chat_template_kwargs as ignored.
    accepts_template_kwargs = False

    def render_chat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                    *, add_generation_prompt: bool = True, template_kwargs: dict | None = None) -> list[int]:
        """Render normalized messages (see module docstring) to prompt ids.

        A message is ``{"role", "content": str, "tool_calls": [{"id","name",
        "arguments": dict}], "tool_call_id", "reasoning_content": str}``; the API layers
        convert OpenAI and Anthropic shapes into this one. A tool is the client's function
        object (``name``, optional ``description`` and ``parameters``). Raises ValueError
        naming the bad message. The token-level template drops reasoning_content and has
        no ``template_kwargs``.
        """
        ids = self._tok("<|bos|>")
        msgs = list(messages)
        if tools:
            tools = [{"name": t["name"], "description": t.get("description", ""), "parameters": t.get("parameters", {})}
                     for t in tools]
            if not msgs or msgs[0].get("role") != "system":
                msgs.insert(0, {"role": "system", "content": ""})
        for i, m in enumerate(msgs):
            role = m.get("role")
            if role not in CHAT_ROLES:
                raise ValueError(f"messages[{i}].role: {role!r} is not one of {CHAT_ROLES}")
            content = m.get("content") or ""
            if not isinstance(content, str):
                raise ValueError(f"messages[{i}].content must be text after normalization, got {type(content).__name__}")
            ids += self._tok("<|im_start|>") + self.encode(role + "\n")
            if role == "tool":
                ids += self._tok("<|tool_result|>") + self.encode(str(m.get("tool_call_id") or ""))
                ids += self._tok("<|/tool_result|>")
            ids += self.encode(content)
            if role == "system" and i == 0 and tools:
                ids += self._tok("<|tools|>") + self.encode(_dumps(list(tools))) + self._tok("<|/tools|>")
            for tc in m.get("tool_calls") or ():
                ids += self.render_tool_call(tc)
            ids += self._tok("<|im_end|>") + self.encode("\n")
        if add_generation_prompt:
            ids += self._tok("<|im_start|>") + self.encode("assistant\n")
        return ids

    def render_tool_call(self, tc: dict) -> list[int]:
        """``{"name":..,"arguments":..,"id":..}``: the name first, so tool_choice can force it right after
        the opening; an id the proxy invented (the model wrote none) is not rendered, so the re-rendered
        turn is the tokens the model produced."""
        body = '{"name":' + _dumps(tc["name"]) + ',"arguments":' + _dumps(tc.get("arguments") or {})
        cid = rendered_call_id(tc.get("id") or "")
        if cid:
            body += ',"id":' + _dumps(cid)
        return self._tok("<|tool_call|>") + self.encode(body + "}") + self._tok("<|/tool_call|>")

    def parse_assistant(self, ids: Sequence[int]) -> dict[str, Any]:
        """Generated ids -> ``{"content": str, "tool_calls": [...], "stopped": bool}``.

        Stops at the first stop id. A tool-call span whose body is not a JSON
        object with a string "name" is kept as text (the harness sees what the
        model wrote; nothing is dropped).
        """
        cut, stopped = cut_at_stop(ids, self.stop_ids)
        content, calls = self.split_tool_calls(cut, self.special["<|tool_call|>"], self.special["<|/tool_call|>"],
                                               keep_marks=False, separator="", call_id=invented_call_id)
        return {"content": content, "tool_calls": calls, "stopped": stopped}

    def parse_call_span(self, span: Sequence[int]) -> dict | None:
        """The ids between a call's open and close marks -> ``{"name", "arguments"[, "id"]}``, or None."""
        return parse_call_json(self.decode(span))

    def split_tool_calls(self, ids: Sequence[int], open_id: int, close_id: int, *, keep_marks: bool,
                         separator: str, call_id) -> tuple[str, list[dict]]:
        """(text, calls) of ids whose calls sit between ``open_id`` and ``close_id``: the one span scanner.

        Each span is parsed by ``parse_call_span``; one that does not parse (or never closes) stays
        text, with its marks when they are text tokens (``keep_marks``: Qwen's) and without when they
        are specials that decode to nothing (ours). ``separator``: what the template puts before a
        call, cut from the text there. Text runs are decoded where AssistantStream ends them (at a
        call's open mark when nothing is held back, else at a parsed call), so streaming adds up to
        this. A call the model gave no id gets ``call_id(k)``.
        """
        parts: list[str] = []
        run: list[int] = []
        calls: list[dict] = []
        span: list[int] | None = None
        for t in ids:
            if t == open_id and span is None:
                span = []
                if not separator:
                    parts.append(self.decode(run))
                    run = []
            elif t == close_id and span is not None:
                call = self.parse_call_span(span)
                if call is None:  # not a well-formed call: the model's text stays text
                    run += [open_id, *span, close_id] if keep_marks else span
                else:
                    text = self.decode(run)
                    parts.append(text[: -len(separator)] if separator and text.endswith(separator) else text)
                    run = []
                    call.setdefault("id", call_id(len(calls)))
                    calls.append(call)
                span = None
            elif span is not None:
                span.append(t)
            else:
                run.append(t)
        if span is not None:  # unterminated tool call: its text
            run += [open_id, *span] if keep_marks else span
        parts.append(self.decode(run))
        return "".join(parts), calls


def cut_at_stop(ids: Sequence[int], stop_ids: Sequence[int]) -> tuple[list[int], bool]:
    """(the ids before the first stop id, whether there was one)."""
    stop = set(stop_ids)
    cut: list[int] = []
    for t in ids:
        if int(t) in stop:
            return cut, True
        cut.append(int(t))
    return cut, False


# Tool-call ids the proxy makes up when the model wrote none: recognizable, so rendering the call back
# omits them (the model's tokens had no id). The API layers add a per-response nonce (unique ids per
# conversation) and their own prefix ("call" for OpenAI, "toolu" for Anthropic).
_INVENTED_ID_RE = re.compile(r"(call|toolu)_gy[0-9a-f]*_[0-9]+")


def invented_call_id(k: int, *, nonce: str = "", prefix: str = "call") -> str:
    return f"{prefix}_gy{nonce}_{k}"


def is_invented_call_id(cid: str) -> bool:
    return bool(_INVENTED_ID_RE.fullmatch(cid))


# An id the model itself wrote that looks like one of ours (or starts with the escape) reaches the client
# escaped, so that echoing it back renders the model's own id, not nothing: one QUOTED_ID prefix added
# on the way out (client_call_id), exactly one removed when rendering (rendered_call_id).
QUOTED_ID = "gyq_"


def client_call_id(model_id: str) -> str:
    """The id a client sees for an id the model wrote."""
    return QUOTED_ID + model_id if is_invented_call_id(model_id) or model_id.startswith(QUOTED_ID) else model_id


def rendered_call_id(cid: str) -> str | None:
    """The id text a call the client echoes renders (None: one we invented, the model wrote none)."""
    if cid.startswith(QUOTED_ID):
        return cid[len(QUOTED_ID):]
    return None if is_invented_call_id(cid) else cid


def _dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def parse_call_json(text: str, args_key: str = "arguments") -> dict | None:
    """A tool call's JSON body -> ``{"name", "arguments"[, "id"]}``, or None if it is not one.

    Every format's: ours and Qwen's spans, Llama-3's JSON message (``args_key="parameters"``;
    "arguments" is taken too). The arguments must be an object; an "id" is kept when the model
    wrote a non-empty one (the formats without ids drop or replace it).
    """
    try:
        body = json.loads(text)
    except ValueError:
        return None
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None
    args = body.get(args_key, body.get("arguments", {}))
    if not isinstance(args, dict):
        return None
    out = {"name": body["name"], "arguments": args}
    if isinstance(body.get("id"), str) and body["id"]:
        out["id"] = body["id"]
    return out
