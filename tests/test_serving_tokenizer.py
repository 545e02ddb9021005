"""Tokenizers, the token-level chat template, and streamed vs whole output parsing."""
from __future__ import annotations

import base64
import importlib.util

import numpy as np
import pytest

from gyre_jax.serving.api_common import AssistantStream
from gyre_jax.serving.tokenizer import SPECIAL_TOKENS, ByteTokenizer, load_tokenizer

TOK = ByteTokenizer()


def test_byte_roundtrip_and_specials_are_not_parsed_from_text():
    s = "héllo <|im_end|> wörld ✓"
    ids = TOK.encode(s)
    assert max(ids) < 256 and TOK.decode(ids) == s
    assert TOK.vocab_size == 256 + len(SPECIAL_TOKENS)
    with pytest.raises(ValueError, match=r"messages\[0\].role"):
        TOK.render_chat([{"role": "robot", "content": "x"}])


def test_tool_calls_render_and_parse_back_exactly():
    tools = [{"name": "read", "description": "read a file", "parameters": {"type": "object"}}]
    msg = {"role": "assistant", "content": "let me look",
           "tool_calls": [{"id": "c7", "name": "read", "arguments": {"path": "a.py", "n": 3}}]}
    ids = TOK.render_chat([{"role": "user", "content": "go"}, msg], tools, add_generation_prompt=False)
    start = len(TOK.render_chat([{"role": "user", "content": "go"}], tools))
    body = ids[start:-1]  # the assistant turn as the model would generate it, incl. <|im_end|>
    parsed = TOK.parse_assistant(body)
    assert parsed == {"content": "let me look", "tool_calls": msg["tool_calls"], "stopped": True}


def _stream(tok, ids, **kw):
    s = AssistantStream(tok, **kw)
    text, calls = [], []
    for t in ids:
        for kind, v in s.feed(t):
            (text if kind == "text" else calls).append(v)
    for kind, v in s.finish():
        (text if kind == "text" else calls).append(v)
    return "".join(text), calls


def test_streamed_parse_equals_whole_parse_on_random_outputs():
    """Random ids over bytes (incl. broken UTF-8) and specials, with real and
    malformed tool-call spans: the streamed text and calls equal parse_assistant."""
    rs = np.random.RandomState(0)
    good = TOK.render_tool_call({"name": "f", "arguments": {"x": "é"}})
    broken = [TOK.special["<|tool_call|>"]] + TOK.encode('{"name": 3}') + [TOK.special["<|/tool_call|>"]]
    for _ in range(300):
        parts = []
        for _ in range(rs.randint(1, 6)):
            r = rs.rand()
            if r < 0.15:
                parts += good
            elif r < 0.25:
                parts += broken
            elif r < 0.3:
                parts += [TOK.special["<|tool_call|>"]]  # unterminated
            else:
                parts += list(rs.choice(np.r_[rs.randint(0, 256, 8), [0xC3, 0xA9, 0xE2, 0x9C]], rs.randint(1, 9)))
        if rs.rand() < 0.5:
            parts.append(TOK.special["<|im_end|>"])
        ids = [int(t) for t in parts]
        want = TOK.parse_assistant(ids)
        text, calls = _stream(TOK, ids)
        assert text == want["content"] and calls == want["tool_calls"], ids


def test_sentencepiece_file(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(["the quick brown fox jumps over the lazy dog"] * 50 + ["hello world"] * 50))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "m"), vocab_size=34,
                                   user_defined_symbols=["<|im_start|>", "<|im_end|>"], minloglevel=2)
    tok = load_tokenizer(f"sentencepiece:{tmp_path / 'm.model'}")
    ids = tok.encode("hello world")
    assert tok.decode(ids) == "hello world"
    assert tok.special["<|im_start|>"] < 34  # the file's own special token is used as is
    assert tok.special["<|tool_call|>"] >= 34 and tok.vocab_size == 34 + len(SPECIAL_TOKENS) - 2
    prompt = tok.render_chat([{"role": "user", "content": "hello"}])
    assert prompt[0] == tok.bos_id and tok.special["<|im_end|>"] in prompt


def test_tiktoken_file(tmp_path):
    pytest.importorskip("tiktoken")
    ranks = [bytes([i]) for i in range(256)] + [b"he", b"ll", b"hell", b"hello"]
    path = tmp_path / "t.tiktoken"
    path.write_text("".join(f"{base64.b64encode(b).decode()} {i}\n" for i, b in enumerate(ranks)))
    tok = load_tokenizer(f"tiktoken:{path}")
    ids = tok.encode("hello hello")
    assert tok.decode(ids) == "hello hello" and 259 in ids
    assert tok.vocab_size == 260 + len(SPECIAL_TOKENS)


def test_missing_package_and_bad_spec_are_named():
    if importlib.util.find_spec("tokenizers") is None:
        with pytest.raises(ImportError, match="tokenizers"):
            load_tokenizer("hf:/nonexistent/tokenizer.json")
    with pytest.raises(ValueError, match="unknown kind 'bpe'"):
        load_tokenizer("bpe:/x")
    with pytest.raises(ValueError, match="expected 'byte'"):
        load_tokenizer("nonsense")
