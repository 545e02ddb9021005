"""One command for the day a GPU or TPU is lent: is the device path right, and how near its peaks?

    python tools/device_check.py            # on one GPU/TPU: ~1B model, bfloat16; under 8 minutes
    python tools/device_check.py --dry      # any CPU: tiny shapes, Pallas in interpret mode; ~15 s (= --quick)

Prints ONE JSON line (and nothing else on stdout; tools/benchkit.py's header first), each check
independent: a check that fails records ``<check>_error`` and the rest still run.

* ``tree_attention_max_diff_vs_xla`` / ``_vs_dense``: the Pallas tree-attention kernel
  (gyre_jax/model/tree_attention_pallas.py; ``pallas`` on the device, ``pallas_interpret``
  with --dry) against the pure-JAX blockwise path and the dense [L, L]-mask reference, on a
  packed row of several branching trees. ``tree_attention_speedup_vs_dense``: dense time /
  Pallas time; on a GPU also ``cudnn_attention_s`` (jax.nn.dot_product_attention, causal:
  cuDNN cannot take a tree mask, so it is a speed reference only).
* ``paged_attention_*``: paged attention vs its reference, once the checkout has
  ``gyre_jax.model.paged_attention`` (issue 30 item 2); else ``paged_attention: "absent"``.
* ``train_mfu``: the real jitted train step (CellSteps.train_step: policy loss + AdamW) on one
  row; FLOPs counted as tools/bench_roofline.py does (6 x matmul params + causal attention),
  over the device kind's spec peak (``PEAKS``); ``train_fraction_of_matmul_peak`` over a
  measured ``jnp.dot``. ``train_compile_s``: XLA lower + compile of that step.
* ``decode_tokens_per_s`` and ``decode_fraction_of_hbm_bw``: the model's jitted decode_step
  loop at ``slots`` live rows of ``context`` tokens; bytes per step = weights + live K/V, over
  the spec bandwidth (``_of_measured_bw``: over a measured copy). ``decode_compile_s``.
"""
from __future__ import annotations

import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import benchkit  # noqa: E402

# Dense bf16 FLOP/s and HBM bytes/s per chip, from the vendors' spec sheets (device_kind substring).
PEAKS = {
    "h200": (989e12, 4.8e12), "h100": (989e12, 3.35e12), "a100": (312e12, 2.0e12), "l4": (121e12, 0.3e12),
    "tpu v6": (918e12, 1.64e12), "tpu v5p": (459e12, 2.76e12), "tpu v5 lite": (197e12, 0.82e12),
    "tpu v5e": (197e12, 0.82e12), "tpu v4": (275e12, 1.2e12),
}
# ~1B parameters (16 x 47.2M + 32768 x 2048 embedding = 0.82B), Llama/Qwen-shaped.
MODEL_1B = dict(vocab_size=32768, d_model=2048, n_layers=16, n_heads=16, n_kv_heads=8, head_dim=128, d_ff=5632,
                qk_norm=True, rope_theta=1e6)
MODEL_DRY = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128)
REAL = dict(dtype="bfloat16", row_len=4096, attn_len=8192, block=128, slots=32, context=2048, matmul_n=8192,
            bw_mib=4096, repeats=3, decode_steps=16)
DRY = dict(dtype="float32", row_len=64, attn_len=128, block=32, slots=2, context=16, matmul_n=256, bw_mib=8,
           repeats=1, decode_steps=2)


def spec_peaks(kind: str):
    k = kind.lower()
    return next((v for name, v in PEAKS.items() if name in k), (None, None))


def tree_row(length: int, seed: int = 0):
    """One packed row of several trees, each a trunk with two branches (segment, subtree_end)."""
    rng = np.random.default_rng(seed)
    seg, sub, i, s = np.zeros(length, np.int32), np.zeros(length, np.int32), 0, 1
    while i < length:
        n = int(min(length - i, rng.integers(length // 8, length // 3 + 2)))
        trunk, b1 = n // 2, n // 2 + n // 4
        seg[i:i + n] = s
        sub[i:i + trunk] = i + n  # the trunk is seen by both branches
        sub[i + trunk:i + b1] = i + b1
        sub[i + b1:i + n] = i + n
        i, s = i + n, s + 1
    return seg[None], sub[None]


def _time(fn, repeats: int) -> float:
    import jax

    return benchkit.median_of(lambda: jax.block_until_ready(fn()), repeats, warmup=1)


def check_tree_attention(p, dry: bool) -> dict:
    import jax
    import jax.numpy as jnp

    from gyre_jax.model.attention import attend, tree_attention_mask
    from gyre_jax.model.tree_attention import packed_tree_attention

    L, n, kv, h = p["attn_len"], 8, 4, 64 if not dry else 16
    dt = jnp.dtype(p["dtype"])
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (1, L, n, h), jnp.float32).astype(dt)
    k = jax.random.normal(ks[1], (1, L, kv, h), jnp.float32).astype(dt)
    v = jax.random.normal(ks[2], (1, L, kv, h), jnp.float32).astype(dt)
    seg, sub = (jnp.asarray(x) for x in tree_row(L))
    blocks = dict(block_q=p["block"], block_k=p["block"])
    impl = "pallas_interpret" if dry else "pallas"
    kernel = jax.jit(lambda q, k, v: packed_tree_attention(q, k, v, seg, sub, impl=impl, **blocks))
    xla = jax.jit(lambda q, k, v: packed_tree_attention(q, k, v, seg, sub, impl="xla", **blocks))
    dense = jax.jit(lambda q, k, v: attend(q, k, v, tree_attention_mask(seg, sub)))
    out_k, out_x, out_d = (np.asarray(f(q, k, v), np.float32) for f in (kernel, xla, dense))
    res = {"tree_attention_impl": impl, "tree_attention_len": L,
           "tree_attention_max_diff_vs_xla": float(np.abs(out_k - out_x).max()),
           "tree_attention_max_diff_vs_dense": float(np.abs(out_k - out_d).max())}
    t_k, t_d = _time(lambda: kernel(q, k, v), p["repeats"]), _time(lambda: dense(q, k, v), p["repeats"])
    res.update(tree_attention_kernel_s=t_k, dense_attention_s=t_d, tree_attention_speedup_vs_dense=t_d / t_k)
    if jax.devices()[0].platform == "gpu":
        try:
            cud = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
            res["cudnn_attention_s"] = _time(lambda: cud(q, k, v), p["repeats"])
        except Exception as e:  # noqa: BLE001 - a speed reference only
            res["cudnn_attention_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return res


def check_paged_attention(p, dry: bool) -> dict:
    import importlib.util

    if importlib.util.find_spec("gyre_jax.model.paged_attention") is None:
        return {"paged_attention": "absent"}
    mod = __import__("gyre_jax.model.paged_attention", fromlist=["device_check"])
    if not hasattr(mod, "device_check"):
        return {"paged_attention": "present, without a device_check(dry) hook"}
    return {f"paged_attention_{k}": v for k, v in mod.device_check(dry=dry).items()}


def check_train(mc, p) -> dict:
    import functools

    import jax

    from gyre_jax import cells
    from gyre_jax.cells.loss import policy_loss_fn
    from gyre_jax.cells.train_step import device_micro_batch
    from gyre_jax.losses import METRIC_REDUCTIONS, PolicyLossConfig
    from gyre_jax.model import count_params, init_boxed, init_params, param_logical_axes

    from bench_roofline import policy_row, train_flops_per_token

    opt = cells.OptimizerConfig(learning_rate=1e-4, weight_decay=0.01)
    spec = cells.StateSpec.create(functools.partial(init_boxed, mc), cells.make_optimizer(opt, param_logical_axes(mc)))
    steps = cells.CellSteps(spec, policy_loss_fn(mc, PolicyLossConfig()), cells.make_schedule(opt),
                            reductions=METRIC_REDUCTIONS)
    (cell,) = cells.split_cells(cells.CellConfig(cell_size=1), jax.devices()[:1])
    params = init_params(mc, jax.random.key(0))
    state = spec.state_from_params(params, cell.train_mesh)
    mb = device_micro_batch(policy_row(mc, p["row_len"]))
    batch = jax.device_put({k: v[None] for k, v in mb.items()})
    compiled, compile_s = benchkit.timed(lambda: steps.train_step(cell.train_mesh).lower(state, batch).compile())
    box = [state]

    def run():
        box[0], m = compiled(box[0], batch)
        return m

    t = _time(run, p["repeats"])
    flops = train_flops_per_token(mc, p["row_len"])["train"] * p["row_len"] / t
    return {"params": count_params(params), "train_row_len": p["row_len"], "train_step_s": t,
            "train_compile_s": compile_s, "train_flops_per_s": flops, "_train_flops": flops}


def check_decode(mc, p) -> dict:
    import jax
    import jax.numpy as jnp

    from gyre_jax.model import decode, init_params

    from bench_roofline import kv_bytes_per_token

    params = init_params(mc, jax.random.key(0))
    s, steps = p["slots"], p["decode_steps"]
    max_len = p["context"] + (2 + p["repeats"]) * steps + 8

    def loop(prm, tok_S, cache):
        def body(carry, _):
            tok, c = carry
            logits, c = decode.decode_step(prm, mc, tok, c)
            return (jnp.argmax(logits, -1).astype(jnp.int32), c), None

        return jax.lax.scan(body, (tok_S, cache), None, length=steps)[0]

    cache = decode.init_cache(mc, s, max_len).replace(lengths=jnp.full((s,), p["context"], jnp.int32))
    tok = jnp.ones((s,), jnp.int32)
    fn, compile_s = benchkit.timed(lambda: jax.jit(loop, donate_argnums=2).lower(params, tok, cache).compile())
    box = [tok, cache]

    def run():
        box[0], box[1] = fn(params, box[0], box[1])
        return box[0]

    t = _time(run, p["repeats"]) / steps
    w = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    mean_len = p["context"] + (1 + p["repeats"] / 2) * steps
    step_bytes = w + s * mean_len * kv_bytes_per_token(mc)
    return {"decode_slots": s, "decode_context": p["context"], "decode_step_ms": t * 1e3,
            "decode_tokens_per_s": s / t, "decode_compile_s": compile_s, "_decode_bytes_per_s": step_bytes / t}


def run_check(out: dict, name: str, fn, *a) -> None:
    try:
        out.update(fn(*a))
    except Exception as e:  # noqa: BLE001 - one failing check must not hide the others
        out[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def main(argv=None) -> dict:
    bench = benchkit.Bench(__file__, __doc__, quick_help="the same as --dry")
    bench.parser.add_argument("--dry", action="store_true", help="tiny shapes, Pallas interpret mode: any CPU, ~15 s")
    args = bench.parse(argv)
    args.dry = args.dry or args.quick
    import jax

    from gyre_jax.model import ModelConfig

    from bench_roofline import measure_matmul_flops, measure_memory_bw

    p = DRY if args.dry else REAL
    dev = jax.devices()[0]
    peak_flops, peak_bw = spec_peaks(dev.device_kind)
    out: dict = {"device_kind": dev.device_kind, "platform": dev.platform, "dry": args.dry, "dtype": p["dtype"],
                 "spec_peak_flops": peak_flops, "spec_hbm_bytes_per_s": peak_bw}
    sw = benchkit.Stopwatch.started()
    run_check(out, "tree_attention", check_tree_attention, p, args.dry)
    run_check(out, "paged_attention", check_paged_attention, p, args.dry)
    mc = ModelConfig(**(MODEL_DRY if args.dry else MODEL_1B), dtype=p["dtype"], param_dtype=p["dtype"],
                     max_seq_len=max(p["row_len"], p["context"] + 256), attention_block_q=p["block"],
                     attention_block_k=p["block"],
                     # dry: the kernel is checked above; interpreting it inside the train step only adds compile time
                     attention_kernel="xla" if args.dry else "pallas")
    run_check(out, "matmul", lambda: {"matmul_flops_per_s": measure_matmul_flops(p["matmul_n"], p["dtype"],
                                                                                  p["repeats"])})
    run_check(out, "memory", lambda: {"memory_bytes_per_s": measure_memory_bw(p["bw_mib"], p["dtype"],
                                                                              p["repeats"])["bytes_per_s"]})
    run_check(out, "train", check_train, mc, p)
    run_check(out, "decode", check_decode, mc.replace(attention_kernel="xla"), p)
    flops, bps = out.pop("_train_flops", None), out.pop("_decode_bytes_per_s", None)
    if flops is not None:
        out["train_mfu"] = flops / peak_flops if peak_flops else None
        if out.get("matmul_flops_per_s"):
            out["train_fraction_of_matmul_peak"] = flops / out["matmul_flops_per_s"]
    if bps is not None:
        out["decode_fraction_of_hbm_bw"] = bps / peak_bw if peak_bw else None
        if out.get("memory_bytes_per_s"):
            out["decode_fraction_of_measured_bw"] = bps / out["memory_bytes_per_s"]
    out["wall_s"] = sw.s
    out["sizes"] = types.SimpleNamespace(**p).__dict__ | {"model": "dry" if args.dry else "1B"}
    return bench.emit(out)  # its "sizes" field is the header's


if __name__ == "__main__":
    main()
