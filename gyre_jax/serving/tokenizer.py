"""Tokenizers and the chat template the proxy renders prompts with.

Built in (offline, no files): ``ByteTokenizer``. Ids 0..255 are the UTF-8 bytes,
then special tokens (``SPECIAL_TOKENS``). Chat turns are rendered as *token ids*,
never as text that is re-parsed, so a user or tool message that happens to
contain the text "<|im_end|>" stays plain bytes and cannot inject a turn break::

    <|bos|>
    <|im_start|>system\\n ...content... [<|tools|>[json tool specs]<|/tools|>] <|im_end|>\\n
    <|im_start|>user\\n ...content... <|im_end|>\\n
    <|im_start|>assistant\\n ...text... <|tool_call|>{"name":..,"arguments":{..}[,"id":..]}<|/tool_call|> <|im_end|>\\n
    <|im_start|>tool\\n<|tool_result|>call id<|/tool_result|>...result text... <|im_end|>\\n
    <|im_start|>assistant\\n          <- generation prompt

The model ends its turn with ``<|im_end|>`` (stop token; ``<|eos|>`` stops too).
``parse_assistant`` turns generated ids back into text and tool calls; rendering
that parsed message again gives the same ids (for well-formed tool calls), so a
multi-turn prompt re-uses the previous turn's tokens exactly (prefix cache hits).

User-supplied tokenizer files: ``load_tokenizer("hf:path/tokenizer.json")``,
``"sentencepiece:path/x.model"`` or ``"tiktoken:path/x.tiktoken"``. Each needs its
package (``tokenizers``, ``sentencepiece``, ``tiktoken``) and is imported only when
asked for; a missing package raises ImportError naming it. Those wrap the file's
byte-pair vocabulary with the same token-level chat template, using the file's
own special tokens where it defines them (see ``FileTokenizer``).
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


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes (ids 0..255) plus ``SPECIAL_TOKENS`` (ids 256..)."""

    def __init__(self):
        self.special = {name: 256 + i for i, name in enumerate(SPECIAL_TOKENS)}
        self.vocab_size = 256 + len(SPECIAL_TOKENS)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """Raw bytes, for streaming: the caller joins partial UTF-8 sequences."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256)


class FileTokenizer(Tokenizer):
    """A user-supplied BPE vocabulary with the same token-level chat template.

    Special tokens the file defines (by exact name, e.g. Qwen's "<|im_start|>")
    are used as they are; the others get fresh ids after the file's vocabulary,
    so the model's vocab_size must be at least ``vocab_size``.
    """

    def __init__(self, *, encode_fn, decode_fn, base_vocab: int, known_special: dict[str, int]):
        self._encode, self._decode = encode_fn, decode_fn
        self.special = {}
        nxt = base_vocab
        for name in SPECIAL_TOKENS:
            if name in known_special:
                self.special[name] = int(known_special[name])
            else:
                self.special[name] = nxt
                nxt += 1
        self.vocab_size = nxt
        self._special_ids = set(self.special.values())

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self._encode(text)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._decode([int(i) for i in ids if int(i) not in self._special_ids])


def _require(module: str, package: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"this tokenizer file needs the {package!r} package: pip install {package}") from None


def _has_chat_template(directory: str) -> bool:
    import os

    p = os.path.join(directory, "tokenizer_config.json")
    if os.path.exists(os.path.join(directory, "chat_template.jinja")):
        return True
    if not os.path.exists(p):
        return False
    with open(p) as f:
        return bool(json.load(f).get("chat_template"))


def chat_template_kwargs(value: Any, where: str) -> dict[str, Any]:
    """A config's or a request's ``chat_template_kwargs`` (a JSON object, as text or a mapping) as a dict.

    Empty text or None is ``{}``. Each key reaches the checkpoint's jinja template as a variable, as
    transformers' ``apply_chat_template(**kwargs)`` and vLLM's request field of the same name pass them
    (Qwen3: ``{"enable_thinking": false}`` renders the empty think block that asks for no reasoning).
    """
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{where}: not valid JSON ({e}); e.g. '{{\"enable_thinking\": false}}'") from None
    if not hasattr(value, "keys") or not all(isinstance(k, str) for k in value.keys()):
        raise ValueError(f"{where}: expected a JSON object of template variables, got {type(value).__name__}")
    return {k: value[k] for k in value.keys()}


def load_tokenizer(spec: str = "byte", *, template_kwargs: dict | None = None) -> Tokenizer:
    """``"byte"`` (built in) or ``"<kind>:<path>"`` with kind hf | sentencepiece | tiktoken.

    ``hf:DIR`` (or ``hf:DIR/tokenizer.json`` beside a tokenizer_config.json with a
    ``chat_template``, or ``hf:FILE.gguf``) is the checkpoint's own tokenizer, template and tool-call
    syntax (``HFChatTokenizer``); a bare tokenizer.json gets our token-level template.
    ``template_kwargs``: variables every render passes to that chat template (a config's
    ``chat_template_kwargs``); the other kinds have no template to pass them to (ValueError).
    """
    if template_kwargs and not spec.startswith("hf:"):
        raise ValueError(f"chat_template_kwargs {template_kwargs}: tokenizer {spec!r} has no chat template of its "
                         "own (only a checkpoint's, hf:DIR, takes them)")
    if spec == "byte":
        return ByteTokenizer()
    kind, sep, path = spec.partition(":")
    if not sep or not path:
        raise ValueError(f"tokenizer spec {spec!r}: expected 'byte' or '<hf|sentencepiece|tiktoken>:<path>'")
    if kind == "hf":
        import os

        if path.endswith(".gguf"):  # a GGUF file carries its tokenizer and chat template in its metadata
            _require("tokenizers", "tokenizers")
            from gyre_jax.serving.hf_tokenizer import HFChatTokenizer

            return HFChatTokenizer.from_gguf(path, template_kwargs=template_kwargs)
        d = path if os.path.isdir(path) else os.path.dirname(path)
        if os.path.isdir(path) or _has_chat_template(d):  # a checkpoint's own template and tool-call syntax
            _require("tokenizers", "tokenizers")
            from gyre_jax.serving.hf_tokenizer import HFChatTokenizer

            return HFChatTokenizer.from_dir(d, template_kwargs=template_kwargs)
        if template_kwargs:
            raise ValueError(f"chat_template_kwargs {template_kwargs}: {path} has no chat template (no "
                             "tokenizer_config.json chat_template beside it)")
        tk = _require("tokenizers", "tokenizers").Tokenizer.from_file(path)
        known = {n: tk.token_to_id(n) for n in SPECIAL_TOKENS if tk.token_to_id(n) is not None}
        return FileTokenizer(encode_fn=lambda s: tk.encode(s, add_special_tokens=False).ids,
                             decode_fn=lambda ids: tk.decode(ids), base_vocab=tk.get_vocab_size(), known_special=known)
    if kind == "sentencepiece":
        sp = _require("sentencepiece", "sentencepiece").SentencePieceProcessor(model_file=path)
        known = {n: sp.piece_to_id(n) for n in SPECIAL_TOKENS if sp.piece_to_id(n) != sp.unk_id()}
        return FileTokenizer(encode_fn=sp.encode, decode_fn=sp.decode, base_vocab=sp.get_piece_size(), known_special=known)
    if kind == "tiktoken":
        tiktoken = _require("tiktoken", "tiktoken")
        load = _require("tiktoken.load", "tiktoken").load_tiktoken_bpe
        ranks = load(path)
        enc = tiktoken.Encoding(name=path, pat_str=r"""'s|'t|'re|'ve|'m|'ll|'d| ?\w+| ?\d+| ?[^\s\w]+|\s+(?!\S)|\s+""",
                                mergeable_ranks=ranks, special_tokens={})
        return FileTokenizer(encode_fn=lambda s: enc.encode(s, disallowed_special=()), decode_fn=enc.decode,
                             base_vocab=enc.n_vocab, known_special={})
    raise ValueError(f"tokenizer spec {spec!r}: unknown kind {kind!r}; known: byte, hf, sentencepiece, tiktoken")
