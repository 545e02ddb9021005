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

import json
from typing import Any, Sequence

from gyre_jax.serving.tokenizer_base import (  # noqa: F401 (re-exported: this module is the tokenizers' one import)
    CHAT_ROLES,
    QUOTED_ID,
    SPECIAL_TOKENS,
    Tokenizer,
    client_call_id,
    cut_at_stop,
    invented_call_id,
    is_invented_call_id,
    parse_call_json,
    rendered_call_id,
)


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
