"""A Hugging Face tokenizer with its own chat template and tool-call syntax.

``HFChatTokenizer.from_dir(path)`` reads ``tokenizer.json`` (the ``tokenizers``
library), ``tokenizer_config.json`` (special tokens, ``chat_template``) and, if there,
``generation_config.json`` (eos ids). Prompts are rendered the way transformers'
``apply_chat_template(..., tokenize=True)`` does it (and so vLLM/SGLang): the jinja
template (a sandboxed environment with transformers' ``tojson``, ``raise_exception``,
``strftime_now``, trim_blocks/lstrip_blocks) renders text, which is encoded with
special tokens recognised. Unlike ByteTokenizer's token-level template, a message whose
text contains a special token's text is therefore encoded as that token, exactly as the
model was trained and as other servers do.

Tool calls follow the family (``tool_format``, detected from the template):

* ``"qwen"``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` spans
  (``<tool_call>``/``</tool_call>`` are single tokens in Qwen2.5/Qwen3 vocabularies); a
  text run right before a call loses the one ``"\\n"`` the template puts there.
* ``"llama3_json"``: the whole assistant message is ``{"name": ..., "parameters":
  {...}}`` (optionally after ``<|python_tag|>``, several joined by ``;``).
* ``"none"``: no tool parsing (a template without tools).

``parse_assistant`` gives the normalized ``{"content", "tool_calls", "stopped"}`` the
API layers use; rendering that message back with the template gives the model's
tokens again whenever the model wrote the canonical form (the retokenization drift
benchmark, tools/bench_retokenize_drift.py, measures how often it did not). Tool
calls carry no id in these formats: parsed calls get ``call_<k>``.
"""
from __future__ import annotations

import datetime
import json
import os
from typing import Any, Sequence

from gyre_jax.serving.tokenizer_base import Tokenizer, cut_at_stop, parse_call_json

TEMPLATES_DIR = os.path.join(os.path.dirname(__file__), "chat_templates")
TOOL_FORMATS = ("qwen", "llama3_json", "none")
# End-of-turn tokens by family; the first one present is the turn end ("<|im_end|>" role).
_TURN_ENDS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>")
_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>")


def _token_text(v) -> str | None:
    if isinstance(v, dict):  # tokenizer_config: {"content": "<|im_end|>", ...}
        return v.get("content")
    return v


def _jinja_env():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' filter (jinja's own HTML-escapes and sorts keys: other tokens than the model saw)
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def detect_tool_format(template: str) -> str:
    if "<tool_call>" in template:
        return "qwen"
    if '"parameters"' in template and "<|eot_id|>" in template:
        return "llama3_json"
    return "none"


class HFChatTokenizer(Tokenizer):
    """``Tokenizer`` over a HF tokenizer.json with the checkpoint's chat template."""

    def __init__(self, tk, *, chat_template: str, special_map: dict[str, str], stop_names: Sequence[str],
                 tool_format: str | None = None, template_kwargs: dict | None = None, where: str = "tokenizer"):
        self.tk, self.where = tk, where
        self.vocab_size = tk.get_vocab_size(with_added_tokens=True)
        self.special = {}
        for canon, name in special_map.items():
            i = tk.token_to_id(name)
            if i is None:
                raise ValueError(f"{where}: special token {name!r} (for {canon}) is not in the vocabulary")
            self.special[canon] = i
        self._stop = tuple(dict.fromkeys(tk.token_to_id(n) for n in stop_names if tk.token_to_id(n) is not None))
        if not self._stop:
            raise ValueError(f"{where}: none of the stop tokens {list(stop_names)} is in the vocabulary")
        self.template_text = chat_template
        self._template = _jinja_env().from_string(chat_template)
        self.tool_format = tool_format or detect_tool_format(chat_template)
        if self.tool_format not in TOOL_FORMATS:
            raise ValueError(f"{where}: tool_format {self.tool_format!r}; known: {TOOL_FORMATS}")
        self._special_tokens = {t.content: i for i, t in tk.get_added_tokens_decoder().items() if t.special}
        self._special_ids = set(self._special_tokens.values())
        self.template_kwargs = dict(template_kwargs or {})
        self._open: int | None = None  # <tool_call> and </tool_call> (qwen format)
        self._close: int | None = None
        if self.tool_format == "qwen":
            self._open, self._close = tk.token_to_id("<tool_call>"), tk.token_to_id("</tool_call>")
            self._marks()
        self.python_tag_id = tk.token_to_id("<|python_tag|>")
        # For the text of a plain encode: special-token text stays text (only templates make specials).
        self._plain = tk.__class__.from_str(tk.to_str())
        self._plain.encode_special_tokens = True

    # ---- construction ---------------------------------------------------
    @classmethod
    def from_dir(cls, path: str, *, chat_template: str | None = None, tool_format: str | None = None,
                 template_kwargs: dict | None = None) -> "HFChatTokenizer":
        """From a checkpoint directory (tokenizer.json + tokenizer_config.json [+ generation_config.json]).

        ``chat_template``: a template text or a built-in name ("qwen3", "llama3") used when
        the directory defines none (or to override it).
        """
        try:
            from tokenizers import Tokenizer as RawTokenizer
        except ImportError:
            raise ImportError("HF tokenizers need the 'tokenizers' package: pip install 'gyre_jax[models]'") from None
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tj):
            raise FileNotFoundError(f"{tj}: no tokenizer.json (a HF 'fast' tokenizer file is needed)")
        tk = RawTokenizer.from_file(tj)
        tc = _read_json(os.path.join(path, "tokenizer_config.json"))
        gen = _read_json(os.path.join(path, "generation_config.json"))
        return cls._from_parts(tk, tc, gen, _pick_template(path, tc, chat_template), where=path,
                               tool_format=tool_format, template_kwargs=template_kwargs)

    @classmethod
    def from_gguf(cls, path: str, *, chat_template: str | None = None, tool_format: str | None = None,
                  template_kwargs: dict | None = None) -> "HFChatTokenizer":
        """From a ``.gguf`` file's metadata (vocabulary, merges, special ids, ``tokenizer.chat_template``), built
        as transformers builds it for ``from_pretrained(..., gguf_file=...)`` (model/hf/gguf_tokenizer.py)."""
        from gyre_jax.model.hf.gguf_tokenizer import gguf_tokenizer

        tk, tc = gguf_tokenizer(path)
        if chat_template:
            tc["chat_template"] = chat_template if "{" in chat_template else builtin_template(chat_template)
        if not tc.get("chat_template"):
            raise ValueError(f"{path}: no tokenizer.chat_template in the file; pass chat_template='qwen3'|'llama3'")
        return cls._from_parts(tk, tc, {}, tc["chat_template"], where=path, tool_format=tool_format,
                               template_kwargs=template_kwargs)

    @classmethod
    def _from_parts(cls, tk, tc: dict, gen: dict, template: str, *, where: str, tool_format: str | None,
                    template_kwargs: dict | None) -> "HFChatTokenizer":
        """The special tokens and stops of a tokenizer and its tokenizer_config (+ generation_config)."""
        vocab = tk.get_vocab(with_added_tokens=True)
        eos = _token_text(tc.get("eos_token"))
        turn_end = next((n for n in _TURN_ENDS if n in vocab and n in template), eos)
        if turn_end is None:
            raise ValueError(f"{where}: cannot tell the end-of-turn token (no eos_token and none of {_TURN_ENDS})")
        eos_name = next((n for n in _EOS_NAMES if n in vocab), eos or turn_end)
        bos = _token_text(tc.get("bos_token")) or eos_name
        pad = _token_text(tc.get("pad_token")) or eos_name
        special_map = {"<|im_end|>": turn_end, "<|eos|>": eos_name, "<|bos|>": bos, "<|pad|>": pad}
        if "<tool_call>" in vocab and "</tool_call>" in vocab:
            special_map.update({"<|tool_call|>": "<tool_call>", "<|/tool_call|>": "</tool_call>"})
        gen_eos = gen.get("eos_token_id")
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        inv = {i: t for t, i in vocab.items()}
        stops = [turn_end] + [n for n in ("<|eom_id|>",) if n in vocab and n in template]
        stops += [eos_name] + ([eos] if eos else []) + [inv[i] for i in gen_eos if i in inv]
        kw = {"bos_token": bos, "eos_token": eos or eos_name}
        kw.update(template_kwargs or {})
        return cls(tk, chat_template=template, special_map=special_map, stop_names=stops, tool_format=tool_format,
                   template_kwargs=kw, where=where)

    # ---- text <-> ids ---------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self._plain.encode(text, add_special_tokens=False).ids)

    def encode_with_special(self, text: str) -> list[int]:
        """Text whose special-token text becomes special tokens (a rendered template)."""
        return list(self.tk.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tk.decode([int(i) for i in ids if int(i) not in self._special_ids], skip_special_tokens=False)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stop

    def _marks(self) -> tuple[int, int]:
        """The qwen format's <tool_call> / </tool_call> ids."""
        if self._open is None or self._close is None:
            raise ValueError(f"{self.where}: the template uses <tool_call> but it is not a single token here")
        return self._open, self._close

    def tool_call_open_ids(self) -> list[int]:
        if self.tool_format == "qwen":
            return [self._marks()[0]] + self.encode('\n{"name": "')
        if self.tool_format == "llama3_json":
            return self.encode('{"name": "')
        raise ValueError(f"{self.where}: this chat template has no tool-call syntax (tool_format='none')")

    # ---- the chat template ----------------------------------------------
    accepts_template_kwargs = True

    def render_text(self, messages: Sequence[dict], tools: Sequence[dict] | None = None, *,
                    add_generation_prompt: bool = True, template_kwargs: dict | None = None) -> str:
        """The template's text, as transformers' ``apply_chat_template(messages, tools=[{"type": "function",
        "function": tool}], **kwargs)`` renders it: each tool is the client's function object as sent (no
        fields added, its key order kept: the template dumps it with ``tojson``), and ``template_kwargs``
        (a request's ``chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``) go over the tokenizer's own."""
        hf_msgs = [_to_hf_message(m, i) for i, m in enumerate(messages)]
        kw = dict(self.template_kwargs)
        if template_kwargs:
            clash = sorted(set(template_kwargs) & {"messages", "tools", "add_generation_prompt"})
            if clash:
                raise ValueError(f"chat_template_kwargs: {clash} are set from the request itself, not here")
            kw.update(template_kwargs)
        if tools:
            kw["tools"] = [{"type": "function", "function": dict(t)} for t in tools]
        import jinja2

        try:
            return self._template.render(messages=hf_msgs, add_generation_prompt=add_generation_prompt, **kw)
        except (jinja2.exceptions.TemplateError, TypeError, KeyError, AttributeError) as e:  # a 400, not a 500
            raise ValueError(f"chat template: {e}") from None

    def render_chat(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                    *, add_generation_prompt: bool = True, template_kwargs: dict | None = None) -> list[int]:
        return self.encode_with_special(self.render_text(messages, tools, add_generation_prompt=add_generation_prompt,
                                                         template_kwargs=template_kwargs))

    def render_tool_call(self, tc: dict) -> list[int]:
        args = tc.get("arguments") or {}
        if self.tool_format == "qwen":
            body = '\n{"name": "' + tc["name"] + '", "arguments": ' + json.dumps(args, ensure_ascii=False) + "}\n"
            open_id, close_id = self._marks()
            return [open_id] + self.encode(body) + [close_id]
        if self.tool_format == "llama3_json":
            return self.encode('{"name": "' + tc["name"] + '", "parameters": ' + json.dumps(args, ensure_ascii=False)
                               + "}")
        raise ValueError(f"{self.where}: this chat template has no tool-call syntax (tool_format='none')")

    # ---- generated ids -> message ---------------------------------------
    def parse_assistant(self, ids: Sequence[int]) -> dict[str, Any]:
        cut, stopped = cut_at_stop(ids, self.stop_ids)
        if self.tool_format == "qwen":
            content, calls = self.split_tool_calls(cut, *self._marks(), keep_marks=True, separator="\n",
                                                   call_id=lambda k: f"call_{k}")
        elif self.tool_format == "llama3_json":
            content, calls = self._parse_llama(cut)
        else:
            content, calls = self.decode(cut), []
        return {"content": content, "tool_calls": calls, "stopped": stopped}

    def parse_call_span(self, span: Sequence[int]) -> dict | None:
        """The ids between ``<tool_call>`` and ``</tool_call>`` -> {"name", "arguments"}, or None.

        Qwen's calls carry no id: one the model wrote into the JSON is dropped (call_<k> is given)."""
        call = parse_call_json(self.decode(span))
        if call is not None:
            call.pop("id", None)
        return call

    def _parse_llama(self, ids: list[int]) -> tuple[str, list[dict]]:
        body = [t for t in ids if t != self.python_tag_id] if ids[:1] == [self.python_tag_id] else ids
        text = self.decode(body)
        calls = parse_llama_calls(text)
        if calls is None:
            return self.decode(ids), []
        for k, c in enumerate(calls):
            c["id"] = f"call_{k}"
        return "", calls


def parse_llama_calls(text: str) -> list[dict] | None:
    """Llama-3 JSON tool calls: the whole message is one call, or several joined by ';'."""
    s = text.strip()
    if not s.startswith("{"):
        return None
    one = parse_call_json(s, "parameters")
    if one is not None:
        return [one]
    calls = [parse_call_json(p, "parameters") for p in s.split(";")]
    whole = [c for c in calls if c is not None]
    return whole if len(calls) > 1 and len(whole) == len(calls) else None


def _to_hf_message(m: dict, i: int) -> dict:
    role = m.get("role")
    if role not in ("system", "user", "assistant", "tool"):
        raise ValueError(f"messages[{i}].role: {role!r} is not one of system, user, assistant, tool")
    content = m.get("content") or ""
    if not isinstance(content, str):
        raise ValueError(f"messages[{i}].content must be text after normalization, got {type(content).__name__}")
    out: dict[str, Any] = {"role": role, "content": content}
    if m.get("tool_calls"):
        out["tool_calls"] = [{"type": "function", "id": tc.get("id"),
                              "function": {"name": tc["name"], "arguments": tc.get("arguments") or {}}}
                             for tc in m["tool_calls"]]
    if role == "tool" and m.get("tool_call_id"):
        out["tool_call_id"] = m["tool_call_id"]
    reasoning = m.get("reasoning_content")
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise ValueError(f"messages[{i}].reasoning_content must be text, got {type(reasoning).__name__}")
        # transformers' aliasing: Qwen3 reads reasoning_content (inside <think>), gpt-oss templates read thinking.
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def builtin_template(name: str) -> str:
    p = os.path.join(TEMPLATES_DIR, f"{name}.jinja")
    if not os.path.exists(p):
        known = sorted(f[:-6] for f in os.listdir(TEMPLATES_DIR) if f.endswith(".jinja"))
        raise ValueError(f"chat template {name!r}: not a built-in one ({known}) nor template text")
    with open(p) as f:
        return f.read()


def _pick_template(path: str, tc: dict, override: str | None) -> str:
    if override:
        return override if "{" in override else builtin_template(override)
    t = tc.get("chat_template")
    if isinstance(t, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {d.get("name"): d.get("template") for d in t}
        t = named.get("tool_use") or named.get("default")
    if not t and os.path.exists(os.path.join(path, "chat_template.jinja")):
        with open(os.path.join(path, "chat_template.jinja")) as f:
            t = f.read()
    if not t:
        raise ValueError(f"{path}: tokenizer_config.json has no chat_template; pass chat_template='qwen3'|'llama3'")
    return t
