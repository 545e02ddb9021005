"""Test helper: a HF checkpoint (config dict + float32 tensors) written as a GGUF file the way llama.cpp's
``convert_hf_to_gguf.py`` writes it, with the ``gguf`` package's own writer and quantizers.

llama.cpp's names and metadata keys; a llama-arch model's q/k rows permuted as the converter's
``LlamaModel.permute`` does (rotate-half pairs to interleaved: written here independently of the loader's
inverse); an untied head as ``output.weight``; Llama-3's rope scaling as a ``rope_freqs.weight`` table.
``types`` picks each matrix's storage type by name suffix (norms and biases stay F32, as llama.cpp keeps them).
"""
from __future__ import annotations

import math

import numpy as np

_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
          "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
          "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
          "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
          "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
          "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
          "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, row by row: row (h, half, j) -> (h, j, half)."""
    rows = w.shape[0]
    hd = rows // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        for j in range(hd // 2):
            out[h * hd + 2 * j] = w[h * hd + j]
            out[h * hd + 2 * j + 1] = w[h * hd + hd // 2 + j]
    return out


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{_NAMES[rest]}"


def write_tiny_gguf(path: str, cfg: dict, tensors: dict[str, np.ndarray], *, types: dict[str, str] | None = None,
                    tokenizer: dict | None = None) -> dict[str, tuple[str, np.ndarray]]:
    """Write ``path``; returns {HF name: (type name, the stored array: float32 or the quantized bytes)}.

    ``types``: {HF name suffix: GGML type name}; the first matching suffix wins, default F32.
    ``tokenizer``: extra ``tokenizer.ggml.*`` / ``tokenizer.chat_template`` fields {key: value}.
    """
    import gguf

    arch = _ARCH[cfg["architectures"][0]]
    n, k = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg.get("max_position_embeddings", 512))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n)
    w.add_head_count_kv(k)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    _add_fields(w, tokenizer or {})
    scaling = cfg.get("rope_scaling")
    if arch == "llama" and scaling:
        w.add_tensor("rope_freqs.weight", _llama3_rope_factors(cfg["rope_theta"], head_dim, scaling))
    stored: dict[str, tuple[str, np.ndarray]] = {}
    for name, a in tensors.items():
        if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
            a = llama_cpp_permute(a, n)
        elif arch == "llama" and name.endswith("self_attn.k_proj.weight"):
            a = llama_cpp_permute(a, k)
        kind = "F32"
        if a.ndim > 1:
            kind = next((t for suffix, t in (types or {}).items() if name.endswith(suffix)), "F32")
        stored[name] = (kind, _add_tensor(w, gguf_name(name), a, kind))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def _add_fields(w, fields: dict) -> None:
    """Metadata fields {key: value} with the GGUF types llama.cpp writes them with."""
    for key, value in fields.items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif key.endswith("token_type"):
            w.add_array(key, [int(v) for v in value])  # an int32 array, as llama.cpp writes it
        else:
            w.add_array(key, list(value))


def _llama3_rope_factors(theta: float, head_dim: int, scaling: dict) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` of a Llama-3 rope scaling: the divisor of each frequency."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    f, lo, hi, old = (scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"],
                      scaling["original_max_position_embeddings"])
    factors = []
    for freq in inv:
        wl = 2 * math.pi / freq
        factors.append(1.0 if wl < old / hi else f if wl > old / lo else
                       1 / ((1 - (old / wl - lo) / (hi - lo)) / f + (old / wl - lo) / (hi - lo)))
    return np.asarray(factors, np.float32)


def _add_tensor(w, name: str, a: np.ndarray, kind: str) -> np.ndarray:
    """One tensor as GGML type ``kind``; the array stored (float32, float16 or the quantized bytes)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        data = np.ascontiguousarray(a, np.float32)
        w.add_tensor(name, data)
    elif kind == "F16":
        data = a.astype(np.float16)
        w.add_tensor(name, data)
    else:
        data = gguf.quants.quantize(a.astype(np.float32), qtype)
        w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    return data


def gguf_tokenizer_fields(hf_dir: str, pre: str = "default") -> dict:
    """A HF tokenizer directory's tokenizer.json + tokenizer_config.json as GGUF ``tokenizer.*`` metadata (what
    llama.cpp's converter writes for a byte-level BPE): tokens by id, merges, types (3 control for special added
    tokens, 4 user-defined for other added ones, 1 normal), special ids and the chat template."""
    import json
    import os

    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        tj = json.load(f)
    with open(os.path.join(hf_dir, "tokenizer_config.json")) as f:
        tc = json.load(f)
    vocab = dict(tj["model"]["vocab"])
    kinds = {}
    for t in tj.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
        kinds[t["id"]] = 3 if t.get("special") else 4
    tokens = [""] * (max(vocab.values()) + 1)
    for t, i in vocab.items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]

    def tid(key):
        v = tc.get(key)
        v = v.get("content") if isinstance(v, dict) else v
        return vocab.get(v) if v else None

    out = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
           "tokenizer.ggml.token_type": [kinds.get(i, 1) for i in range(len(tokens))],
           "tokenizer.ggml.merges": merges, "tokenizer.chat_template": tc["chat_template"]}
    for key, name in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("pad_token", "padding_token_id")):
        if tid(key) is not None:
            out[f"tokenizer.ggml.{name}"] = tid(key)
    return out
