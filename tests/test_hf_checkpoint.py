"""HF checkpoints in and out (gyre_jax.model.hf).

Imported logits are checked against a float64 numpy forward written from the HF
modeling code (Qwen2/Qwen3/Llama: [out, in] linears, q/k/v bias, q/k RMSNorm over
head_dim before RoPE, rotate-half RoPE with llama3 frequency scaling, repeat_kv GQA,
tied or separate lm_head) reading the *HF tensors* directly, so a layout mistake in
the loader cannot cancel out. Files are written by the ``safetensors`` library
(gyre_jax.testing.tiny_hf_checkpoint), independent of our streaming reader/writer.
"""
import functools
import json
import math
import os

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh
from safetensors.numpy import load_file

from gyre_jax.cells.mesh import FSDP, TENSOR
from gyre_jax.model import Transformer
from gyre_jax.model.hf import UnsupportedCheckpoint, load_pretrained, save_pretrained
from gyre_jax.model.transformer import PAD_LOGIT
from gyre_jax.testing.tiny_hf_checkpoint import is_moe_layer, write_tiny_hf_checkpoint


# --------------------------------------------------------------- reference (HF semantics)
def _llama3_inv_freq(inv, rs):
    """transformers' _compute_llama3_parameters, transcribed."""
    factor, lo, hi, old = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"], rs[
        "original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old / lo, old / hi
    wavelen = 2 * math.pi / inv
    inv_l = np.where(wavelen > low_freq_wavelen, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, inv_l)


def hf_reference_logits(cfg: dict, t: dict, ids, positions):
    """float64 forward of one causal sequence, HF Llama/Qwen2/Qwen3 semantics."""
    t = {k: v.astype(np.float64) for k, v in t.items()}
    arch = cfg["architectures"][0]
    d, n, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    h = cfg.get("head_dim") or d // n
    eps = cfg["rms_norm_eps"]

    def rmsnorm(x, w):
        return w * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps))

    inv = 1.0 / (cfg["rope_theta"] ** (np.arange(0, h, 2) / h))
    if cfg.get("rope_scaling"):
        inv = _llama3_inv_freq(inv, cfg["rope_scaling"])
    freqs = np.asarray(positions, np.float64)[:, None] * inv[None]
    emb = np.concatenate([freqs, freqs], -1)
    cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]

    def rotate_half(x):
        return np.concatenate([-x[..., h // 2:], x[..., : h // 2]], -1)

    def linear(x, name, bias=False):
        y = x @ t[name + ".weight"].T
        return y + t[name + ".bias"] if bias else y

    T = len(ids)
    x = t["model.embed_tokens.weight"][np.asarray(ids)]
    causal = np.tril(np.ones((T, T), bool))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        hs = rmsnorm(x, t[p + "input_layernorm.weight"])
        bias = arch == "Qwen2ForCausalLM"
        q = linear(hs, p + "self_attn.q_proj", bias).reshape(T, n, h)
        k = linear(hs, p + "self_attn.k_proj", bias).reshape(T, kv, h)
        v = linear(hs, p + "self_attn.v_proj", bias).reshape(T, kv, h)
        if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
            q = rmsnorm(q, t[p + "self_attn.q_norm.weight"])
            k = rmsnorm(k, t[p + "self_attn.k_norm.weight"])
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, n // kv, axis=1), np.repeat(v, n // kv, axis=1)  # repeat_kv
        s = np.einsum("qnh,knh->nqk", q, k) / math.sqrt(h)
        s = np.where(causal[None], s, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        o = np.einsum("nqk,knh->qnh", pr, v).reshape(T, n * h)
        x = x + linear(o, p + "self_attn.o_proj")
        hs = rmsnorm(x, t[p + "post_attention_layernorm.weight"])
        if is_moe_layer(cfg, i):
            x = x + _sparse_moe_block(cfg, hs, linear, p + "mlp.")
        else:
            x = x + _swiglu(hs, linear, p + "mlp.")
    x = rmsnorm(x, t["model.norm.weight"])
    head = t["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else t["lm_head.weight"]
    return x @ head.T


def _swiglu(hs, linear, p):
    g = linear(hs, p + "gate_proj")
    return linear((g / (1 + np.exp(-g))) * linear(hs, p + "up_proj"), p + "down_proj")


def _sparse_moe_block(cfg, hs, linear, p):
    """transformers' Qwen3MoeSparseMoeBlock: softmax router in float, top k (renormalised if norm_topk_prob)."""
    logits = linear(hs, p + "gate")
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    k = cfg["num_experts_per_tok"]
    out = np.zeros_like(hs)
    for n in range(hs.shape[0]):
        top = np.argsort(-probs[n], kind="stable")[:k]
        w = probs[n, top] / (probs[n, top].sum() if cfg["norm_topk_prob"] else 1.0)
        for e, we in zip(top, w):
            out[n] += we * _swiglu(hs[n:n + 1], linear, p + f"experts.{e}.")[0]
    return out


@functools.cache
def _forward(cfg):
    return jax.jit(Transformer(cfg).apply)


def _our_logits(cfg, params, ids, positions):
    L = len(ids)
    row = lambda a: np.asarray(a, np.int32)[None]  # noqa: E731
    return np.asarray(_forward(cfg)(params, row(ids), row(positions), row(np.ones(L)), row(np.full(L, L))))[0]


def _hidden_and_cached(cfg, params, ids, positions):
    """(hidden, unembed) of the return_hidden path; also checks the KV-cache path's logits equal the forward's."""
    L = len(ids)
    row = lambda a: np.asarray(a, np.int32)[None]  # noqa: E731
    m = Transformer(cfg)
    hidden, unembed = m.apply(params, row(ids), row(positions), row(np.ones(L)), row(np.full(L, L)),
                              return_hidden=True)
    kv = np.zeros((cfg.n_layers, 1, L, cfg.n_kv_heads, cfg.head_dim), np.float32)
    cached, _ = m.apply(params, row(ids), row(positions), np.tril(np.ones((L, L), bool))[None], kv, kv,
                        np.zeros(1, np.int32), method=Transformer.with_cache)
    np.testing.assert_allclose(np.asarray(cached)[0], _our_logits(cfg, params, ids, positions), rtol=1e-5, atol=1e-5)
    return np.asarray(hidden, np.float64), np.asarray(unembed, np.float64)


def _mesh():
    return Mesh(np.array(jax.devices()).reshape(4, 2), (FSDP, TENSOR))


CASES = {  # id: (family, writer overrides, load on the (fsdp=4, tensor=2) mesh)
    "qwen2-tied": ("qwen2", dict(), False),
    "qwen3-tied": ("qwen3", dict(), False),
    "qwen3-untied-sharded-padded": ("qwen3", dict(tie=False, vocab_size=95, num_shards=3), True),
    "llama3-rope-scaling": ("llama3", dict(hidden_size=64, vocab_size=95), True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_imported_logits_match_hf_reference(tmp_path, case):
    family, over, on_mesh = CASES[case]
    hf_cfg, tensors = write_tiny_hf_checkpoint(str(tmp_path), family, seed=3, **over)
    mesh = _mesh() if on_mesh else None
    cfg, params = load_pretrained(str(tmp_path), mesh=mesh)
    assert (cfg.qkv_bias, cfg.qk_norm) == (family == "qwen2", family == "qwen3")
    assert cfg.tie_embeddings == hf_cfg["tie_word_embeddings"]
    assert cfg.rope_scaling == ("llama3" if family == "llama3" else "none")
    if on_mesh:
        assert cfg.padded_vocab == 96 and cfg.vocab_size == 95  # the tensor axis (2) splits the vocab
        assert params["params"]["embed"].sharding.spec == jax.sharding.PartitionSpec(TENSOR, FSDP)
        assert params["params"]["layers"]["mlp"]["gate"].sharding.spec == jax.sharding.PartitionSpec(None, FSDP, TENSOR)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, hf_cfg["vocab_size"], 12)
    positions = np.arange(12) + (40 if family == "llama3" else 0)  # llama3: across the scaled bands
    want = hf_reference_logits(hf_cfg, tensors, ids, positions)
    got = _our_logits(cfg, params, ids, positions)
    np.testing.assert_allclose(got[:, : cfg.vocab_size], want, rtol=1e-5, atol=1e-5)
    assert (got[:, cfg.vocab_size:] == PAD_LOGIT).all()
    assert got.shape[-1] == cfg.padded_vocab
    if on_mesh:  # the loss's path (hidden @ unembed, padding cut off) and the KV-cache path agree
        hidden, unembed = _hidden_and_cached(cfg, params, ids, positions)
        assert unembed.shape == (cfg.d_model, cfg.vocab_size)
        np.testing.assert_allclose(hidden[0] @ unembed, want, rtol=1e-5, atol=1e-5)


def test_llama3_scaling_changes_the_answer(tmp_path):
    """The scaled frequencies matter at these positions (else the test above proves nothing about them)."""
    hf_cfg, tensors = write_tiny_hf_checkpoint(str(tmp_path), "llama3", hidden_size=64)
    plain = dict(hf_cfg, rope_scaling=None)
    ids, pos = np.arange(12) % 90, np.arange(12) + 40
    diff = np.abs(hf_reference_logits(hf_cfg, tensors, ids, pos) - hf_reference_logits(plain, tensors, ids, pos))
    assert diff.max() > 1e-2


def _files_bitwise(path):
    out = {}
    for fn in sorted(os.listdir(path)):
        if fn.endswith(".safetensors"):
            for k, v in load_file(os.path.join(path, fn)).items():
                out[k] = (v.dtype, v.shape, v.tobytes())
    return out


@pytest.mark.parametrize("family,dtype", [("qwen3", "bfloat16"), ("qwen2", "float32"), ("llama3", "bfloat16")])
def test_import_export_import_is_bit_exact(tmp_path, family, dtype):
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    write_tiny_hf_checkpoint(src, family, dtype=dtype, num_shards=2, tie=family == "qwen2")
    cfg, params = load_pretrained(src, mesh=_mesh())
    assert params["params"]["embed"].dtype == np.dtype(getattr(ml_dtypes, dtype, np.float32))
    written = save_pretrained(params, cfg, out, like=src, max_shard_bytes=20_000)
    assert "model.safetensors.index.json" in written and sum(w.endswith(".safetensors") for w in written) > 1
    assert _files_bitwise(out) == _files_bitwise(src)  # names, dtypes, shapes, bytes
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        wm = json.load(f)["weight_map"]
    assert set(wm) == set(_files_bitwise(src))
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(out, "config.json")) as g:
        a, b = json.load(f), json.load(g)
    for key in ("architectures", "vocab_size", "hidden_size", "num_key_value_heads", "rope_theta", "rope_scaling",
                "tie_word_embeddings", "torch_dtype", "bos_token_id", "eos_token_id"):
        assert a.get(key) == b.get(key), key
    cfg2, params2 = load_pretrained(out)
    assert cfg2 == cfg.replace(vocab_pad_multiple=1)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), params, params2)


def test_single_file_export_reads_back_with_safetensors(tmp_path):
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    _, tensors = write_tiny_hf_checkpoint(src, "qwen3")
    cfg, params = load_pretrained(src)
    assert save_pretrained(params, cfg, out) == ["model.safetensors", "config.json"]
    back = load_file(os.path.join(out, "model.safetensors"))
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        np.testing.assert_array_equal(back[k], v, err_msg=k)
    save_pretrained(params, cfg, out, dtype="bfloat16")  # a f32 policy written for serving in bf16
    back = load_file(os.path.join(out, "model.safetensors"))
    for k, v in tensors.items():
        assert back[k].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(back[k], v.astype(ml_dtypes.bfloat16), err_msg=k)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"


def _edit(path, fn, **changes):
    p = os.path.join(path, fn)
    with open(p) as f:
        d = json.load(f)
    d.update(changes)
    with open(p, "w") as f:
        json.dump(d, f)


def test_clear_errors(tmp_path):
    from safetensors.numpy import save_file

    p = str(tmp_path / "a")
    write_tiny_hf_checkpoint(p, "qwen3")
    _edit(p, "config.json", architectures=["MixtralForCausalLM"])
    with pytest.raises(UnsupportedCheckpoint, match="MixtralForCausalLM.*supported"):
        load_pretrained(p)
    _edit(p, "config.json", architectures=["Qwen3MoeForCausalLM"])  # supported, but no MoE fields given
    with pytest.raises(UnsupportedCheckpoint, match="Qwen3-MoE config needs"):
        load_pretrained(p)
    _edit(p, "config.json", architectures=["Qwen3ForCausalLM"], rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(UnsupportedCheckpoint, match="yarn"):
        load_pretrained(p)
    _edit(p, "config.json", rope_scaling=None, intermediate_size=40)
    with pytest.raises(UnsupportedCheckpoint, match=r"model.layers.0.mlp.gate_proj.weight.*\(48, 32\).*\(40, 32\)"):
        load_pretrained(p)
    _edit(p, "config.json", intermediate_size=48, tie_word_embeddings=False)
    with pytest.raises(UnsupportedCheckpoint, match="missing.*lm_head.weight"):
        load_pretrained(p)
    q = str(tmp_path / "b")
    _, t = write_tiny_hf_checkpoint(q, "qwen2")
    t["model.layers.0.self_attn.o_proj.bias"] = np.zeros(32, np.float32)
    save_file(t, os.path.join(q, "model.safetensors"))
    with pytest.raises(UnsupportedCheckpoint, match="no place for.*o_proj.bias"):
        load_pretrained(q)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(str(tmp_path))


def _set_config(path, drop=(), **changes):
    p = os.path.join(path, "config.json")
    with open(p) as f:
        d = json.load(f)
    for k in drop:
        d.pop(k)
    d.update(changes)
    with open(p, "w") as f:
        json.dump(d, f)


def test_tie_word_embeddings_is_read_as_transformers_reads_it(tmp_path):
    """No field: untied (transformers' Qwen/Llama default) when lm_head.weight is stored, tied when it is not;
    ``true`` beside a stored head that differs from the embedding: the head is used (transformers does not tie);
    ``true`` beside an equal copy: tied."""
    from safetensors.numpy import save_file

    untied, tied = str(tmp_path / "untied"), str(tmp_path / "tied")
    hf_u, t_u = write_tiny_hf_checkpoint(untied, "qwen3", seed=2, tie=False)
    hf_t, t_t = write_tiny_hf_checkpoint(tied, "qwen3", seed=2)
    ids, pos = np.arange(8) * 11 % 96, np.arange(8)
    for path, hf_cfg, t, want_tied in ((untied, hf_u, t_u, False), (tied, hf_t, t_t, True)):
        _set_config(path, drop=["tie_word_embeddings"])
        cfg, params = load_pretrained(path)
        assert cfg.tie_embeddings == want_tied, path
        np.testing.assert_allclose(_our_logits(cfg, params, ids, pos)[:, : cfg.vocab_size],
                                   hf_reference_logits(hf_cfg, t, ids, pos), rtol=1e-5, atol=1e-5)
    _set_config(untied, tie_word_embeddings=True)  # a field that disagrees with the files: the stored head wins
    assert not load_pretrained(untied)[0].tie_embeddings
    save_file({**t_t, "lm_head.weight": t_t["model.embed_tokens.weight"]}, os.path.join(tied, "model.safetensors"))
    _set_config(tied, tie_word_embeddings=True)  # the head stored as an equal copy (torch .bin conversions)
    assert load_pretrained(tied)[0].tie_embeddings


def test_rl_export_keeps_the_source_dtype_named_by_dtype(tmp_path):
    """transformers >= 4.56 writes ``dtype`` (not ``torch_dtype``): a bf16 source exports as bf16."""
    from types import SimpleNamespace

    from gyre_jax.rl.export import export_hf

    src = str(tmp_path / "src")
    write_tiny_hf_checkpoint(src, "qwen3", dtype="bfloat16")
    _set_config(src, drop=["torch_dtype"], dtype="bfloat16")
    cfg, params = load_pretrained(src, dtype="float32")  # the policy trains in float32
    out = export_hf(SimpleNamespace(hf_path=src, model=cfg), params, str(tmp_path), version=1)
    assert {v.dtype for v in load_file(os.path.join(out, "model.safetensors")).values()} == {np.dtype(ml_dtypes.bfloat16)}
