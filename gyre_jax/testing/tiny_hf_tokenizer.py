"""Test helper: a small byte-level BPE ``tokenizer.json`` trained here, with a family's
special tokens and a ``tokenizer_config.json`` carrying a chat template modelled on the
real Qwen3 / Llama-3.1 ones (gyre_jax/serving/chat_templates). Nothing is downloaded.

Qwen3 keeps ``<|im_start|>``/``<|im_end|>``/``<|endoftext|>`` special and
``<tool_call>``/``</tool_call>``/``<think>``/... as plain added tokens (as Qwen's file
does, so they decode as text); Llama-3 has its header/turn specials.
"""
from __future__ import annotations

import json
import os

from gyre_jax.serving.hf_tokenizer import builtin_template

_SPECIAL = {
    "qwen3": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
               "<|eot_id|>", "<|python_tag|>"],
}
_ADDED = {"qwen3": ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"],
          "llama3": []}
_CONFIG: dict[str, dict[str, str | None]] = {
    "qwen3": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
}

CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "Hello, world! How are you today?",
    "def add(a, b):\n    return a + b\n", "import json\nprint(json.dumps({'x': 1}))",
    '{"name": "read_file", "arguments": {"path": "src/main.py"}}', '{"name": "bash", "parameters": {"cmd": "ls -la"}}',
    "The answer is 42. Let me check the file first.", "I'll run the tests and report back.",
    "Reverse the string 'abc' to get 'cba'.", "Error: file not found at /tmp/x.txt", "You are a helpful assistant.",
    "system user assistant tool", "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024",
] * 4


def write_tiny_hf_tokenizer(path: str, family: str, *, vocab_size: int = 400) -> int:
    """Write tokenizer.json + tokenizer_config.json (+ generation_config.json) into ``path``; returns the vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if family not in _SPECIAL:
        raise ValueError(f"family {family!r}: expected one of {sorted(_SPECIAL)}")
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=_SPECIAL[family], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(CORPUS, trainer)
    from tokenizers import AddedToken

    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in _ADDED[family]])
    os.makedirs(path, exist_ok=True)
    tk.save(os.path.join(path, "tokenizer.json"))
    cfg = dict(_CONFIG[family], chat_template=builtin_template(family), tokenizer_class="PreTrainedTokenizerFast")
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    eos = [tk.token_to_id(t) for t in (("<|im_end|>", "<|endoftext|>") if family == "qwen3"
                                       else ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"))]
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos}, f)
    return tk.get_vocab_size(with_added_tokens=True)
