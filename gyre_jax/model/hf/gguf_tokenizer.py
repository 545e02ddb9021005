"""A ``tokenizers.Tokenizer`` from a GGUF file's ``tokenizer.*`` metadata, as transformers builds it.

A GGUF has no tokenizer.json: it stores the vocabulary (``tokenizer.ggml.tokens``), the merges, each
token's type (3 = control, 4 = user-defined) and the special ids under llama.cpp's key names.
transformers (``integrations/gguf/gguf_tokenizer_mapping.py``, 5.x) turns a byte-level one
(``tokenizer.ggml.model == "gpt2"``: Llama-3, Qwen2/3, SmolLM2) into a GPT-2 style BPE: vocabulary as
spelled (re-spelled in the byte alphabet where a token is not), the file's merges, ByteLevel
pre-tokenizer and decoder, control tokens added as special tokens and user-defined ones as plain
added tokens, and, for the pre-tokenizers it knows by name (``tokenizer.ggml.pre``), llama.cpp's
split regex ahead of a regex-less ByteLevel. This module builds the same object so our ids equal
transformers' (tests/test_gguf.py checks it on SmolLM2's file). Sentencepiece vocabularies
(``tokenizer.ggml.model == "llama"``) are not supported here.
"""
from __future__ import annotations

import functools
from typing import Any

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the split regex transformers puts ahead of ByteLevel (the families we load; any other
# name keeps GPT-2's own ByteLevel regex, as transformers does)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
CONTROL, USER_DEFINED = 3, 4
_SPECIAL_KEYS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                 "pad_token": "padding_token_id"}


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def gguf_tokenizer(path: str) -> tuple[Any, dict[str, Any]]:
    """(tokenizers.Tokenizer, tokenizer_config dict with chat_template and the special tokens' text)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    from gyre_jax.model.hf.gguf_file import open_reader

    reader = open_reader(path)

    def meta(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    kind = meta("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer.ggml.model={kind!r}; only byte-level BPE ('gpt2': Llama-3, Qwen2/3, "
                         "SmolLM2) is supported from GGUF metadata")
    tokens: list[str] = meta("tokenizer.ggml.tokens") or []
    types: list[int] = meta("tokenizer.ggml.token_type") or []
    merges = [tuple(m.split(" ")) for m in (meta("tokenizer.ggml.merges") or [])]
    if not tokens or not merges:
        raise ValueError(f"{path}: tokenizer.ggml.tokens or tokenizer.ggml.merges is missing")
    alphabet = set(bytes_to_unicode().values())
    spell = bytes_to_unicode()
    vocab = {t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)}
    tk = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                       fuse_unk=False))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tc: dict[str, Any] = {"chat_template": meta("tokenizer.chat_template"),
                          "add_bos_token": bool(meta("tokenizer.ggml.add_bos_token", False))}
    for name, key in _SPECIAL_KEYS.items():
        i = meta(f"tokenizer.ggml.{key}")
        tc[name] = tokens[i] if i is not None and 0 <= i < len(tokens) else None
    named = [t for t in (tc["unk_token"], tc["bos_token"], tc["eos_token"], tc["pad_token"]) if t]
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel: transformers skips it.
    control = [t for t, ty in zip(tokens, types) if ty == CONTROL and set(t) <= alphabet]
    tk.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(named + control)])
    user = [t for t, ty in zip(tokens, types) if ty == USER_DEFINED and t in vocab]
    if user:
        tk.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    split = PRE_TOKENIZER_SPLITS.get(meta("tokenizer.ggml.pre"))
    if split is not None:
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tk, tc
