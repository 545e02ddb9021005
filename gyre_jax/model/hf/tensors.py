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

Convert = Callable[[np.ndarray], np.ndarray]
# An entry's two conversions: HF tensor -> ours, ours -> HF (Entry.to_ours, Entry.to_hf).
Converters = tuple[Convert, Convert]


@dataclasses.dataclass(frozen=True)
class Entry:
    path: tuple[str, ...]  # our param path under "params"
    hf_name: str  # with "{i}" for the layer index when per_layer
    hf_shape: tuple[int, ...]
    per_layer: bool
    to_ours: Convert  # HF tensor -> our (one layer's) array
    to_hf: Convert  # inverse
    layers: tuple[int, ...] = ()  # per_layer: the HF layer index of each slot of our stack (a run of layers)
    experts: int = 0  # > 0: one HF tensor per expert ("{j}" in hf_name), stacked on our axis 1

    def name(self, i: int | None = None) -> str:
        return self.hf_name.format(i=i) if self.per_layer else self.hf_name

    def tensors(self) -> list[tuple[str, tuple[int, ...], int | None]]:
        """(HF name, index into our stacked param, HF layer) of every HF tensor this entry covers."""
        if not self.per_layer:
            return [(self.hf_name, (), None)]
        if not self.experts:
            return [(self.hf_name.format(i=i), (slot,), i) for slot, i in enumerate(self.layers)]
        return [(self.hf_name.format(i=i, j=j), (slot, j), i) for slot, i in enumerate(self.layers)
                for j in range(self.experts)]


def _linear_in(d_in: int, *out: int) -> Converters:
    """HF [prod(out), d_in] <-> ours [d_in, *out] (q, k, v, gate, up)."""
    return (lambda w: w.T.reshape(d_in, *out)), (lambda a: a.reshape(d_in, -1).T)


def _linear_out(d_out: int, *inn: int) -> Converters:
    """HF [d_out, prod(inn)] <-> ours [*inn, d_out] (o, down)."""
    return (lambda w: w.T.reshape(*inn, d_out)), (lambda a: a.reshape(-1, d_out).T)


def _vocab_rows(v: int, vp: int) -> Converters:
    """HF [V, D] <-> ours [Vp, D] (zero rows appended for the mesh's vocab padding)."""
    def to_ours(w):
        return w if vp == v else np.concatenate([w, np.zeros((vp - v, w.shape[1]), w.dtype)], axis=0)

    return to_ours, (lambda a: a[:v])


def entries(cfg: ModelConfig) -> list[Entry]:
    d, n, k, h, f, v, vp = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, cfg.vocab_size,
                            cfg.padded_vocab)
    same: Converters = (lambda w: w), (lambda a: a)
    L = "model.layers.{i}."
    out = [Entry(("embed",), "model.embed_tokens.weight", (v, d), False, *_vocab_rows(v, vp))]
    if not cfg.tie_embeddings:
        rows_in, rows_out = _vocab_rows(v, vp)
        out.append(Entry(("unembed",), "lm_head.weight", (v, d), False,
                         lambda w: rows_in(w).T, lambda a: rows_out(a.T)))
    out.append(Entry(("final_norm", "scale"), "model.norm.weight", (d,), False, *same))
    # (our path under the stack, HF name after the layer prefix, HF shape, conversions)
    attn: list[tuple[tuple[str, ...], str, tuple[int, ...], Converters]] = [
        (("attn_norm", "scale"), "input_layernorm.weight", (d,), same),
        (("mlp_norm", "scale"), "post_attention_layernorm.weight", (d,), same),
        (("attn", "q"), "self_attn.q_proj.weight", (n * h, d), _linear_in(d, n, h)),
        (("attn", "k"), "self_attn.k_proj.weight", (k * h, d), _linear_in(d, k, h)),
        (("attn", "v"), "self_attn.v_proj.weight", (k * h, d), _linear_in(d, k, h)),
        (("attn", "o"), "self_attn.o_proj.weight", (d, n * h), _linear_out(d, n, h)),
    ]
    mlp: list[tuple[tuple[str, ...], str, tuple[int, ...], Converters]] = [
        (("mlp", "gate"), "mlp.gate_proj.weight", (f, d), _linear_in(d, f)),
        (("mlp", "up"), "mlp.up_proj.weight", (f, d), _linear_in(d, f)),
        (("mlp", "down"), "mlp.down_proj.weight", (d, f), _linear_out(d, f)),
    ]
    if cfg.qkv_bias:
        attn += [
            (("attn", "q_bias"), "self_attn.q_proj.bias", (n * h,), ((lambda w: w.reshape(n, h)), (lambda a: a.reshape(-1)))),
            (("attn", "k_bias"), "self_attn.k_proj.bias", (k * h,), ((lambda w: w.reshape(k, h)), (lambda a: a.reshape(-1)))),
            (("attn", "v_bias"), "self_attn.v_proj.bias", (k * h,), ((lambda w: w.reshape(k, h)), (lambda a: a.reshape(-1)))),
        ]
    if cfg.qk_norm:
        attn += [
            (("attn", "q_norm", "scale"), "self_attn.q_norm.weight", (h,), same),
            (("attn", "k_norm", "scale"), "self_attn.k_norm.weight", (h,), same),
        ]
    # One stack per run of same-kind layers (ModelConfig.layer_runs): "layers" unless dense and MoE mix.
    for stack, start, stop, is_moe in cfg.layer_runs():
        ids = tuple(range(start, stop))
        for path, name, shape, (a, b) in attn + ([] if is_moe else mlp):
            out.append(Entry((stack,) + path, L + name, shape, True, a, b, layers=ids))
        if is_moe:
            out += moe_entries(cfg, stack, ids)
    return out


# Tensors some checkpoints carry that the model recomputes (RoPE tables): skipped on import.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def moe_entries(cfg: ModelConfig, stack: str, ids: tuple[int, ...]) -> list[Entry]:
    """Qwen3-MoE's sparse block: router ``mlp.gate`` [E, D] and per-expert SwiGLU tensors
    ``mlp.experts.{j}.*`` (HF keeps one tensor per expert; we stack them on axis 1 of [Y, E, ...])."""
    d, e, f = cfg.d_model, cfg.num_experts, cfg.moe_intermediate_size
    L, X = "model.layers.{i}.", "model.layers.{i}.mlp.experts.{j}."
    return [
        Entry((stack, "moe", "router"), L + "mlp.gate.weight", (e, d), True, *_linear_in(d, e), layers=ids),
        Entry((stack, "moe", "gate"), X + "gate_proj.weight", (f, d), True, *_linear_in(d, f), layers=ids, experts=e),
        Entry((stack, "moe", "up"), X + "up_proj.weight", (f, d), True, *_linear_in(d, f), layers=ids, experts=e),
        Entry((stack, "moe", "down"), X + "down_proj.weight", (d, f), True, *_linear_out(d, f), layers=ids,
              experts=e),
    ]
