"""Mixture-of-experts block speed (gyre_jax/model/moe.py): grouped matmuls vs the dense reference,
and expert parallelism over 1, 2 and 4 devices. Forward + backward of one MoE block (router,
experts, combine), tokens per second, best of ``--repeat`` timed runs after a compile run.

    python tools/bench_moe.py            # CPU: 4 host devices, sizes below
    python tools/bench_moe.py --tokens 8192 --experts 64 --top-k 8

Prints a table, then one JSON line (named fields; the sizes it ran). On CPU every device shares
the same cores, so the expert-parallel rows measure the dispatch's overhead (all-to-all, the
worst-case buffers), not a speed-up; on accelerators each device brings its own compute.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-width", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ep", default="1,2,4", help="expert-parallel degrees to time")
    args = ap.parse_args(argv)
    degrees = [int(x) for x in args.ep.split(",")]
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={max(degrees)}")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from gyre_jax.model import model_config_tiny
    from gyre_jax.model.moe import MoE

    cfg = model_config_tiny(d_model=args.d_model, num_experts=args.experts, num_experts_per_tok=args.top_k,
                            moe_intermediate_size=args.expert_width)
    x = jax.random.normal(jax.random.key(0), (1, args.tokens, args.d_model))
    params = MoE(cfg).init(jax.random.key(1), x[:, :8])

    def step_fn(c):
        def loss(p, x):
            y, stats = MoE(c).apply(p, x)
            return (y * y).mean() + stats.prob_E.sum() * 0.0

        return jax.jit(jax.value_and_grad(loss))

    def timed(fn, *a):
        jax.block_until_ready(fn(*a))  # compile
        best = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*a))
            best = min(best, time.perf_counter() - t0)
        return best

    rows = []
    for impl in ("ragged", "dense"):
        rows.append((impl, 1, timed(step_fn(cfg.replace(moe_impl=impl)), params, x)))
    for p in degrees:
        mesh = Mesh(np.array(jax.devices()[:p]), ("expert",))
        with jax.set_mesh(mesh):
            rows.append(("ragged+ep", p, timed(step_fn(cfg.replace(expert_parallel_axis="expert")), params, x)))
    print(f"{'experts':10} {'devices':>7} {'fwd+bwd_ms':>11} {'tokens/s':>10}")
    for name, p, s in rows:
        print(f"{name:10} {p:7d} {s * 1e3:11.1f} {args.tokens / s:10.0f}")
    t = {f"{n}:{p}": s for n, p, s in rows}
    final = dict(
        ragged_tokens_per_s=round(args.tokens / t["ragged:1"]), dense_tokens_per_s=round(args.tokens / t["dense:1"]),
        ragged_speedup_over_dense=round(t["dense:1"] / t["ragged:1"], 2),
        **{f"ep{p}_tokens_per_s": round(args.tokens / t[f"ragged+ep:{p}"]) for p in degrees},
        tokens=args.tokens, d_model=args.d_model, experts=args.experts, top_k=args.top_k,
        expert_width=args.expert_width, backend=jax.default_backend(), devices=len(jax.devices()),
    )
    print(json.dumps(final))
    return 0


if __name__ == "__main__":
    sys.exit(main())
