"""What recording MoE routing for replay (R3) costs on the host: bytes per generated token in the
call records and in packed training rows, and the host time to unpack a token's routing from
the engine's result row, to encode and decode a call record carrying it, and to build the
tree and packed rows of a rollout with it (vs the same rollout without routing).

    python tools/bench_routing.py                       # Qwen3-30B-A3B's shape: 48 MoE layers x top-8, 128 experts
    python tools/bench_routing.py --layers 94 --top-k 8 --experts 128   # Qwen3-235B-A22B

Then what replay buys (``--fidelity-tokens`` > 0): a tiny random MoE model in bfloat16 samples
sequences with the KV-cache decode (recording its routing), and the packed training forward
over the same tokens, same params, recomputes their log-probs routed live and replayed: the
fraction of tokens routed differently and the log-prob error against the sampled ones in each
mode (bf16 cache decode and tree-packed forward are different kernels, as engine and trainer are).

Prints a table, then one JSON line (named fields; the sizes it ran). The host part is numpy
only (the engine's packing is one bitcast inside its jitted step); the fidelity part compiles
a few small functions (~30 CPU-s).
"""
from __future__ import annotations

import os
import sys

import benchkit


def _best(fn, repeat):
    return benchkit.best_of(fn, repeat)


def main(argv=None) -> dict:
    bench = benchkit.Bench(__file__, __doc__, quick=dict(layers=4, top_k=2, experts=8, calls=2, prompt=64, output=16,
                                                        repeat=1, fidelity_tokens=2, fidelity_seqs=1))
    ap = bench.parser
    ap.add_argument("--layers", type=int, default=48, help="MoE layers")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--calls", type=int, default=8, help="calls of the rollout (multi-turn, each extends the last)")
    ap.add_argument("--prompt", type=int, default=2048, help="first call's prompt tokens")
    ap.add_argument("--output", type=int, default=512, help="generated tokens per call")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--fidelity-tokens", type=int, default=48, help="tokens sampled per sequence (0: skip)")
    ap.add_argument("--fidelity-seqs", type=int, default=4)
    args = bench.parse(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import numpy as np

    from gyre_jax.serving.engine_state import RoutingLayout, decode_result_steps
    from gyre_jax.trajectory.binpack import pack_trees
    from gyre_jax.trajectory.records import ModelCallRecord, record_from_bytes
    from gyre_jax.trajectory.tree import build_tree

    width = args.layers * args.top_k
    lay = RoutingLayout(width, 1 if args.experts <= 256 else 2)
    rng = np.random.default_rng(0)

    # Engine result row -> (token, log-prob, routing): what the backend does per generated token.
    n_tok = 256
    ids = rng.integers(0, args.experts, (n_tok, width)).astype(lay.dtype)
    words = np.frombuffer(np.pad(ids, ((0, 0), (0, lay.words * 4 // lay.itemsize - width))).tobytes(),
                          "<i4").reshape(n_tok, lay.words)
    row = np.concatenate([np.stack([rng.integers(0, 1000, n_tok), np.full(n_tok, -1, np.int32)], 1), words],
                         1).astype(np.int32).reshape(-1)
    plain = row.reshape(n_tok, -1)[:, :2].reshape(-1)
    unpack_s = _best(lambda: decode_result_steps(row, lay), args.repeat) / n_tok
    unpack_plain_s = _best(lambda: decode_result_steps(plain, RoutingLayout()), args.repeat) / n_tok

    # A multi-turn rollout's records, with and without routing.
    def calls(routed: bool):
        out, prompt = [], rng.integers(0, 150000, args.prompt)
        for i in range(args.calls):
            o = rng.integers(0, 150000, args.output)
            r = rng.integers(0, args.experts, (args.output, width)).astype(lay.dtype) if routed else None
            out.append(ModelCallRecord(
                run_id="b", rollout_id="r", task_id="t", group_id="g", agent_id=0, parent_agent_id=None, role="main",
                call_index=i, prompt_ids=prompt, output_ids=o, output_logprobs=-rng.random(args.output),
                policy_version=0, t_start=0.0, t_end=1.0, finish_reason="stop", output_routing=r))
            prompt = np.concatenate([prompt, o, rng.integers(0, 150000, 64)])
        return out

    timings = {}
    for routed in (False, True):
        cs = calls(routed)
        blobs = [c.to_bytes() for c in cs]
        enc = _best(lambda: [c.to_bytes() for c in cs], args.repeat)
        dec = _best(lambda: [record_from_bytes(b) for b in blobs], args.repeat)
        tree = build_tree(cs)
        row_len = sum(int(n.tokens.shape[0]) for n in tree.walk()) + 16
        build = _best(lambda: build_tree(cs), args.repeat)
        pack = _best(lambda: pack_trees([tree], [1.0], row_len, routing_width=width if routed else 0), args.repeat)
        timings[routed] = dict(record_bytes=sum(len(b) for b in blobs), encode_s=enc, decode_s=dec, tree_s=build,
                               pack_s=pack, row_len=row_len)
    gen = args.calls * args.output
    rec_per_tok = (timings[True]["record_bytes"] - timings[False]["record_bytes"]) / gen
    rows_per_pos = width * 2  # int16 [B, L, R] in packed rows

    print(f"{'what':44s} {'no routing':>12s} {'routing':>12s}")
    print(f"{'bytes per generated token (record)':44s} {8:12d} {8 + rec_per_tok:12.1f}")
    print(f"{'bytes per row position (packed rows)':44s} {'':>12s} {rows_per_pos:12d}")
    print(f"{'engine result columns per token':44s} {2:12d} {lay.step_cols:12d}")
    print(f"{'unpack one token from the result row (us)':44s} {unpack_plain_s * 1e6:12.2f} {unpack_s * 1e6:12.2f}")
    for k, what in (("encode_s", "encode the rollout's records (ms)"), ("decode_s", "decode them (ms)"),
                    ("tree_s", "build its tree (ms)"), ("pack_s", "pack it into a row (ms)")):
        print(f"{what:44s} {timings[False][k] * 1e3:12.2f} {timings[True][k] * 1e3:12.2f}")
    fid = fidelity(args.fidelity_seqs, args.fidelity_tokens) if args.fidelity_tokens > 0 else {}
    if fid:
        print(f"{'tiny bf16 MoE, ' + str(fid['fidelity_tokens']) + ' sampled tokens':44s} {'live':>12s} {'replayed':>12s}")
        print(f"{'  tokens routed unlike sampling (fraction)':44s} {fid['mismatch_live']:12.4f} {fid['mismatch_replay']:12.4f}")
        print(f"{'  max |train - sampled log-prob|':44s} {fid['max_err_live']:12.4f} {fid['max_err_replay']:12.4f}")
        print(f"{'  mean |train - sampled log-prob|':44s} {fid['mean_err_live']:12.5f} {fid['mean_err_replay']:12.5f}")
    return bench.emit({
        "moe_layers": args.layers, "top_k": args.top_k, "experts": args.experts,
        "routing_width": width, "calls": args.calls, "prompt_tokens": args.prompt, "output_tokens_per_call": args.output,
        "generated_tokens": gen, "row_len": timings[True]["row_len"],
        "record_bytes_per_generated_token": 8 + rec_per_tok, "routing_bytes_per_generated_token": rec_per_tok,
        "row_bytes_per_position": rows_per_pos, "engine_columns_per_token": lay.step_cols,
        "unpack_us_per_token": unpack_s * 1e6, "unpack_us_per_token_without": unpack_plain_s * 1e6,
        **{f"{k[:-2]}_ms" + ("" if r else "_without"): v * 1e3
           for r in (True, False) for k, v in timings[r].items() if k.endswith("_s")},
        **fid,
    }, sizes=dict(moe_layers=args.layers, top_k=args.top_k, experts=args.experts, calls=args.calls,
                  prompt_tokens=args.prompt, output_tokens_per_call=args.output, repeat=args.repeat,
                  fidelity_tokens=args.fidelity_tokens, fidelity_seqs=args.fidelity_seqs))


def fidelity(n_seqs: int, n_tok: int) -> dict:
    """Sample with the bf16 KV-cache decode (recording routing), score the same tokens with the packed
    forward routed live and replayed; mismatch fractions and log-prob errors (module docstring)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from gyre_jax.model import Transformer, init_params, model_config_tiny
    from gyre_jax.model import decode as dec
    from gyre_jax.model.transformer import moe_stats

    cfg = model_config_tiny(vocab_size=256, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128,
                            max_seq_len=128, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                            dtype="bfloat16")
    params = init_params(cfg, jax.random.key(0))
    prompt_len, m = 16, 16 + n_tok + 1
    prefill = jax.jit(dec.prefill, static_argnums=1)
    step = jax.jit(dec.decode_step, static_argnums=1, static_argnames="with_routing")
    rng = np.random.default_rng(0)
    seqs, lps, routes = [], [], []
    for _ in range(n_seqs):
        seq = list(rng.integers(1, cfg.vocab_size, prompt_len))
        _, kv = prefill(params, cfg, jnp.asarray(seq[:-1], jnp.int32))
        cache = dec.insert(dec.init_cache(cfg, 1, m), kv, 0)
        lp_seq, r_seq = [], []
        for _ in range(n_tok):  # sample at temperature 1 from the decode's float32 logits
            logits, cache, r = step(params, cfg, jnp.asarray([seq[-1]], jnp.int32), cache, with_routing=True)
            logp = np.asarray(jax.nn.log_softmax(logits[0]), np.float64)
            t = int(rng.choice(cfg.vocab_size, p=np.exp(logp) / np.exp(logp).sum()))
            seq.append(t)
            lp_seq.append(logp[t])
            r_seq.append(np.asarray(r[0]))
        seqs.append(seq), lps.append(lp_seq), routes.append(r_seq)
    n = prompt_len + n_tok
    toks = np.asarray(seqs, np.int32)
    routing = np.full((n_seqs, n, cfg.routing_width), -1, np.int16)
    routing[:, prompt_len - 1: n - 1] = np.asarray(routes)  # at each sampled token's predicting position
    pos = np.tile(np.arange(n, dtype=np.int32), (n_seqs, 1))
    seg, end = np.ones((n_seqs, n), np.int32), np.full((n_seqs, n), n, np.int32)
    out = {"fidelity_tokens": n_seqs * n_tok, "fidelity_experts": cfg.num_experts, "fidelity_moe_layers": cfg.n_layers}
    for name, c in (("live", cfg), ("replay", cfg.replace(routing_replay=True))):
        logits, inter = jax.jit(lambda p, r, c=c: Transformer(c).apply(p, toks, pos, seg, end, routing_BxLxR=r,
                                                                      mutable=["intermediates"]))(params, routing)
        logp = np.asarray(jax.nn.log_softmax(logits), np.float64)
        got = np.take_along_axis(logp[:, prompt_len - 1: n - 1], toks[:, prompt_len:, None], -1)[..., 0]
        err = np.abs(got - np.asarray(lps))
        mism = np.asarray(jnp.max(moe_stats(inter).mismatch, 0)).reshape(n_seqs, n)[:, prompt_len - 1: n - 1]
        out.update({f"mismatch_{name}": float(mism.mean()), f"max_err_{name}": float(err.max()),
                    f"mean_err_{name}": float(err.mean())})
    return out


if __name__ == "__main__":
    main()
