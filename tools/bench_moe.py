"""Mixture-of-experts block speed (gyre_jax/model/moe.py): grouped matmuls vs the dense reference,
and expert parallelism over 1, 2 and 4 devices. Forward + backward of one MoE block (router,
experts, combine), tokens per second, best of ``--repeat`` timed runs after a compile run.
Then serving (``--serve-slots`` > 0): the engine's decode of a one-MoE-layer model with its
experts split over a serving 'expert' axis of 1, 2 and 4 devices (cells.serve_expert), decoded
tokens per second over all slots (one ``generate`` call = ``--tokens-per-call`` steps).

    python tools/bench_moe.py            # CPU: 4 host devices, sizes below
    python tools/bench_moe.py --tokens 8192 --experts 64 --top-k 8

Prints a table, then one JSON line (named fields; the sizes it ran). On CPU every device shares
the same cores, so the expert-parallel rows measure the dispatch's overhead (all-to-all, the
worst-case buffers), not a speed-up; on accelerators each device brings its own compute.
"""
from __future__ import annotations

import os
import sys

import benchkit


def main(argv=None) -> dict:
    bench = benchkit.Bench(__file__, __doc__, quick=dict(tokens=64, d_model=32, experts=4, expert_width=32, repeat=1,
                                                        ep="1,2", serve_slots=2, tokens_per_call=2))
    ap = bench.parser
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-width", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ep", default="1,2,4", help="expert-parallel degrees to time")
    ap.add_argument("--serve-slots", type=int, default=16, help="decode slots of the serving runs (0: skip them)")
    ap.add_argument("--tokens-per-call", type=int, default=8)
    args = bench.parse(argv)
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

    def timed(fn, *a):  # the first call compiles
        return benchkit.best_of(lambda: jax.block_until_ready(fn(*a)), args.repeat, warmup=1)

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
    serve = {p: _serve_decode(args, cfg, p, timed) for p in degrees} if args.serve_slots else {}
    for p, s in serve.items():
        print(f"{'serve+ep':10} {p:7d} {'decode_ms':>11} {s * 1e3:.1f} per call, "
              f"{args.serve_slots * args.tokens_per_call / s:.0f} tokens/s")
    final = dict(
        ragged_tokens_per_s=round(args.tokens / t["ragged:1"]), dense_tokens_per_s=round(args.tokens / t["dense:1"]),
        ragged_speedup_over_dense=round(t["dense:1"] / t["ragged:1"], 2),
        **{f"ep{p}_tokens_per_s": round(args.tokens / t[f"ragged+ep:{p}"]) for p in degrees},
        **{f"serve_ep{p}_decode_tokens_per_s": round(args.serve_slots * args.tokens_per_call / s)
           for p, s in serve.items()},
        serve_slots=args.serve_slots, tokens_per_call=args.tokens_per_call,
        tokens=args.tokens, d_model=args.d_model, experts=args.experts, top_k=args.top_k,
        expert_width=args.expert_width, backend=jax.default_backend(), devices=len(jax.devices()),
    )
    return bench.emit(final, sizes=dict(tokens=args.tokens, d_model=args.d_model, experts=args.experts, top_k=args.top_k,
                                        expert_width=args.expert_width, ep=degrees, serve_slots=args.serve_slots,
                                        tokens_per_call=args.tokens_per_call, repeat=args.repeat))


def _serve_decode(args, cfg, p: int, timed) -> float:
    """Seconds per engine ``generate`` call with every slot decoding, experts over p serving devices."""
    import jax
    import numpy as np

    from gyre_jax.cells.mesh import CellConfig, Role, split_cells
    from gyre_jax.model import init_params
    from gyre_jax.serving.backend import SamplingParams
    from gyre_jax.serving.engine import GyreEngine
    from gyre_jax.serving.engine_state import PrefillInput

    mc = cfg.replace(vocab_size=512, n_layers=1, max_seq_len=256)
    [cell] = split_cells(CellConfig(cell_size=p, serve_tensor=1, serve_expert=p), jax.devices()[:p])
    engine = GyreEngine(mc, init_params(mc, jax.random.key(2)), mesh=cell.mesh(Role.ROLLOUT),
                        max_slots=args.serve_slots, max_len=256, tokens_per_call=args.tokens_per_call)
    ds = engine.init_decode_state()
    for s in range(args.serve_slots):
        toks = np.random.RandomState(s).randint(0, 512, 16).astype(np.int32)
        pre = engine.prefill(params=engine.params_ref, true_length=15, padded_tokens=PrefillInput(
            f"s{s}", toks[:-1], int(toks[-1]), 0, SamplingParams(max_tokens=200, seed=s)))
        ds = engine.insert(pre, ds, s)
    state = [ds]

    def call():  # the decode state is donated: each call continues the last one's
        state[0], res = engine.generate(engine.params_ref, state[0])
        return res.data

    return timed(call)


if __name__ == "__main__":
    main()
