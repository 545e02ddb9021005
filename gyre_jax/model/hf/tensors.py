"""Which HF tensor is which of our params, and the reshapes between the two layouts.

HF stores every linear layer as ``[out, in]`` (torch ``nn.Linear``); we store
``[in, ...out]`` with heads split out (q ``[D, N, H]``, o ``[N, H, D]``) and the
layers stacked on a leading axis (nn.scan). RoPE needs no permutation: ``rope``
uses HF's rotate-half layout. Each ``Entry`` converts one tensor of one layer
both ways, so import and export are exact inverses (pure reshapes/transposes).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from gyre_jax.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Entry:
    path: tuple[str, ...]  # our param path under "params"
    hf_name: str  # with "{i}" for the layer index when per_layer
    hf_shape: tuple[int, ...]
    per_layer: bool
    to_ours: Callable[[np.ndarray], np.ndarray]  # HF tensor -> our (one layer's) array
    to_hf: Callable[[np.ndarray], np.ndarray]  # inverse

    def name(self, i: int | None = None) -> str:
        return self.hf_name.format(i=i) if self.per_layer else self.hf_name


def _linear_in(d_in, *out):
    """HF [prod(out), d_in] <-> ours [d_in, *out] (q, k, v, gate, up)."""
    return (lambda w: w.T.reshape(d_in, *out)), (lambda a: a.reshape(d_in, -1).T)


def _linear_out(d_out, *inn):
    """HF [d_out, prod(inn)] <-> ours [*inn, d_out] (o, down)."""
    return (lambda w: w.T.reshape(*inn, d_out)), (lambda a: a.reshape(-1, d_out).T)


def _vocab_rows(v, vp):
    """HF [V, D] <-> ours [Vp, D] (zero rows appended for the mesh's vocab padding)."""
    def to_ours(w):
        return w if vp == v else np.concatenate([w, np.zeros((vp - v, w.shape[1]), w.dtype)], axis=0)

    return to_ours, (lambda a: a[:v])


def entries(cfg: ModelConfig) -> list[Entry]:
    d, n, k, h, f, v, vp = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, cfg.vocab_size,
                            cfg.padded_vocab)
    same = (lambda w: w), (lambda a: a)
    L = "model.layers.{i}."
    out = [Entry(("embed",), "model.embed_tokens.weight", (v, d), False, *_vocab_rows(v, vp))]
    if not cfg.tie_embeddings:
        rows_in, rows_out = _vocab_rows(v, vp)
        out.append(Entry(("unembed",), "lm_head.weight", (v, d), False,
                         lambda w: rows_in(w).T, lambda a: rows_out(a.T)))
    out.append(Entry(("final_norm", "scale"), "model.norm.weight", (d,), False, *same))
    layer = [
        (("attn_norm", "scale"), "input_layernorm.weight", (d,), same),
        (("mlp_norm", "scale"), "post_attention_layernorm.weight", (d,), same),
        (("attn", "q"), "self_attn.q_proj.weight", (n * h, d), _linear_in(d, n, h)),
        (("attn", "k"), "self_attn.k_proj.weight", (k * h, d), _linear_in(d, k, h)),
        (("attn", "v"), "self_attn.v_proj.weight", (k * h, d), _linear_in(d, k, h)),
        (("attn", "o"), "self_attn.o_proj.weight", (d, n * h), _linear_out(d, n, h)),
        (("mlp", "gate"), "mlp.gate_proj.weight", (f, d), _linear_in(d, f)),
        (("mlp", "up"), "mlp.up_proj.weight", (f, d), _linear_in(d, f)),
        (("mlp", "down"), "mlp.down_proj.weight", (d, f), _linear_out(d, f)),
    ]
    if cfg.qkv_bias:
        layer += [
            (("attn", "q_bias"), "self_attn.q_proj.bias", (n * h,), ((lambda w: w.reshape(n, h)), (lambda a: a.reshape(-1)))),
            (("attn", "k_bias"), "self_attn.k_proj.bias", (k * h,), ((lambda w: w.reshape(k, h)), (lambda a: a.reshape(-1)))),
            (("attn", "v_bias"), "self_attn.v_proj.bias", (k * h,), ((lambda w: w.reshape(k, h)), (lambda a: a.reshape(-1)))),
        ]
    if cfg.qk_norm:
        layer += [
            (("attn", "q_norm", "scale"), "self_attn.q_norm.weight", (h,), same),
            (("attn", "k_norm", "scale"), "self_attn.k_norm.weight", (h,), same),
        ]
    for path, name, shape, (a, b) in layer:
        out.append(Entry(("layers",) + path, L + name, shape, True, a, b))
    return out


# Tensors some checkpoints carry that the model recomputes (RoPE tables): skipped on import.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
