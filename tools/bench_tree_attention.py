"""Benchmark: training on tree-packed rows vs the same paths expanded.

Synthetic agent-like trees (a long shared prompt, then turns with retries that
branch) are trained on two ways, with the same model, the same row length L and
the same jitted forward+backward (value_and_grad of the masked mean token NLL,
gradients accumulated row by row with lax.scan):

  * packed:   each tree serialized once (shared prefixes stored once), trees
              bin-packed (first-fit decreasing, gyre_jax.trajectory.binpack) into
              rows of L, tree attention mask;
  * expanded: every root-to-leaf path as its own causal sequence, paths
              sequence-packed several per row (each its own segment) into rows of
              the same L, first-fit decreasing. This is the strongest honest
              baseline without prefix sharing.

Both compute the same per-path token predictions. Throughput is stated in
*unique tree tokens* per second of wall time for both, so
speedup = expanded_time / packed_time. Dedup factor = tokens of all paths
expanded / unique tree tokens.

    python tools/bench_tree_attention.py            # default, < 2 min on 2 cores
    python tools/bench_tree_attention.py --row_len 1024 --d_model 256
"""
from __future__ import annotations

import os
import sys

# Run from a checkout without installing: put the repo root on the path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from gyre_jax.losses import token_logprobs
from gyre_jax.model import ModelConfig, Transformer, count_params, init_params
from gyre_jax.trajectory.binpack import first_fit_decreasing, pack_trees
from gyre_jax.trajectory.node import TreeNode
from gyre_jax.trajectory.serialize import PAD_ID, serialize_tree

import benchkit  # noqa: E402 (tools/, beside this script)

BENCH = dict(quick=dict(row_len=64, packed_rows=1, prompt_len=8, depth=2, node_len=4, max_branches=2, vocab=64,
                        d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32, iters=1))


def parse_args(argv=None, bench=None):
    bench = bench or benchkit.Bench(__file__, __doc__, **BENCH)
    p = bench.parser
    p.add_argument("--row_len", type=int, default=512, help="L, tokens per row (both layouts)")
    p.add_argument("--packed_rows", type=int, default=8, help="generate trees to fill about this many packed rows")
    p.add_argument("--prompt_len", type=int, default=96, help="shared prompt tokens at each tree root (+-25%%)")
    p.add_argument("--depth", type=int, default=3, help="turn levels after the prompt along each path")
    p.add_argument("--node_len", type=int, default=12, help="mean tokens per turn node (uniform in [0.5x, 1.5x])")
    p.add_argument("--max_branches", type=int, default=3, help="retries per turn: uniform in [1, max_branches]")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--d_model", type=int, default=128)
    p.add_argument("--n_layers", type=int, default=4)
    p.add_argument("--n_heads", type=int, default=4)
    p.add_argument("--n_kv_heads", type=int, default=2)
    p.add_argument("--head_dim", type=int, default=32)
    p.add_argument("--d_ff", type=int, default=384)
    p.add_argument("--iters", type=int, default=4, help="timed iterations per layout, interleaved (after one warm-up each)")
    p.add_argument("--seed", type=int, default=0)
    return bench.parse(argv)


def make_tree(rng, args) -> TreeNode:
    """A prompt, then ``depth`` turns; each turn has 1..max_branches alternatives."""

    def span(n, trainable):
        return TreeNode.span(rng.integers(1, args.vocab, n), trainable=trainable)

    def turn(depth):
        node = span(max(1, int(rng.integers(args.node_len // 2, args.node_len * 3 // 2 + 1))), True)
        if depth < args.depth:
            node.children = [turn(depth + 1) for _ in range(int(rng.integers(1, args.max_branches + 1)))]
        return node

    root = span(int(rng.integers(args.prompt_len * 3 // 4, args.prompt_len * 5 // 4 + 1)), False)
    root.children = [turn(1) for _ in range(int(rng.integers(1, args.max_branches + 1)))]
    return root


def make_trees(rng, args):
    """Trees whose serialization fits a row, until ~packed_rows rows' worth of tokens."""
    trees, total, target = [], 0, int(0.95 * args.packed_rows * args.row_len)
    while total < target:
        t = make_tree(rng, args)
        n = len(serialize_tree(t))
        if n > args.row_len:
            continue
        trees.append(t)
        total += n
    return trees


def expanded_rows(trees, row_len):
    """Every path as its own causal segment, sequence-packed (FFD) into rows of row_len."""
    paths = []
    for t in trees:
        st = serialize_tree(t)
        for idx in st.path_indices():
            paths.append((st.tokens[idx], st.targets[idx], st.loss_mask[idx]))
    assignment = first_fit_decreasing([len(p[0]) for p in paths], row_len)
    b = len(assignment)
    out = {
        "tokens": np.full((b, row_len), PAD_ID, np.int32),
        "targets": np.full((b, row_len), PAD_ID, np.int32),
        "loss_mask": np.zeros((b, row_len), bool),
        "positions": np.zeros((b, row_len), np.int32),
        "segment_ids": np.zeros((b, row_len), np.int32),
        "subtree_end": np.tile(np.arange(1, row_len + 1, dtype=np.int32), (b, 1)),
    }
    for r, row in enumerate(assignment):
        start = 0
        for seg, k in enumerate(row, start=1):
            tok, tgt, lm = paths[k]
            sl = slice(start, start + len(tok))
            out["tokens"][r, sl] = tok
            out["targets"][r, sl] = tgt
            out["loss_mask"][r, sl] = lm
            out["positions"][r, sl] = np.arange(len(tok))
            out["segment_ids"][r, sl] = seg
            out["subtree_end"][r, sl] = start + len(tok)
            start += len(tok)
    return out, sum(len(p[0]) for p in paths), len(paths)


def build_step(model: Transformer):
    """Jitted fwd+bwd over a batch of rows, one row at a time (constant memory)."""

    def row_nll(params, row):
        logits = model.apply(
            params, row["tokens"][None], row["positions"][None], row["segment_ids"][None], row["subtree_end"][None]
        )
        logp = token_logprobs(logits, row["targets"][None])[0]
        return -jnp.sum(jnp.where(row["loss_mask"], logp, 0.0))

    grad_fn = jax.value_and_grad(row_nll)

    @jax.jit
    def step(params, batch):
        denom = jnp.maximum(jnp.sum(batch["loss_mask"]), 1).astype(jnp.float32)

        def body(acc, row):
            loss, g = grad_fn(params, row)
            return jax.tree.map(jnp.add, acc, (loss, g)), None

        zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (loss, grads), _ = jax.lax.scan(body, zero, batch)
        return loss / denom, jax.tree.map(lambda g: g / denom, grads)

    return step


def time_layouts(step, params, batches, iters):
    """Warm up (compile) every layout, then time them interleaved, so load from
    other processes hits both alike; the minimum is the least disturbed run."""
    batches = {k: jax.device_put(b) for k, b in batches.items()}
    warm, loss = {}, {}
    for name, batch in batches.items():
        out, warm[name] = benchkit.timed(lambda: jax.block_until_ready(step(params, batch)))
        loss[name] = float(out[0])
    times = {k: [] for k in batches}
    for _ in range(iters):
        for name, batch in batches.items():
            times[name].append(benchkit.timed(lambda: jax.block_until_ready(step(params, batch)))[1])
    return times, warm, loss


def main(argv=None) -> dict:
    bench = benchkit.Bench(__file__, __doc__, **BENCH)
    args = parse_args(argv, bench)
    rng = np.random.default_rng(args.seed)
    trees = make_trees(rng, args)
    unique = sum(t.num_tokens() for t in trees)
    packed = pack_trees(trees, [0.0] * len(trees), args.row_len)
    rows = packed.rows
    packed_batch = {k: getattr(rows, k) for k in ("tokens", "targets", "loss_mask", "positions", "segment_ids", "subtree_end")}
    exp_batch, expanded, n_paths = expanded_rows(trees, args.row_len)
    dedup = expanded / unique

    cfg = ModelConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        head_dim=args.head_dim,
        d_ff=args.d_ff,
        max_seq_len=args.row_len,
    )
    params = init_params(cfg, jax.random.key(args.seed))
    step = build_step(Transformer(cfg))

    print(f"devices: {jax.devices()[0].platform} x{len(jax.devices())}  model: {count_params(params):,} params "
          f"(d_model={cfg.d_model} layers={cfg.n_layers} heads={cfg.n_heads}/{cfg.n_kv_heads} "
          f"head_dim={cfg.head_dim} d_ff={cfg.d_ff} vocab={cfg.vocab_size})")
    print(f"trees: {len(trees)}  paths: {n_paths}  unique tokens: {unique}  expanded tokens: {expanded}  "
          f"dedup factor: {dedup:.2f}  row_len L={args.row_len}")
    batches = {"packed": packed_batch, "expanded": exp_batch}
    times, warm, loss = time_layouts(step, params, batches, args.iters)
    results = {}
    for name, batch in batches.items():
        b = batch["tokens"].shape[0]
        fill = float((batch["segment_ids"] > 0).mean())
        t = min(times[name])
        results[name] = dict(rows=b, fill=fill, time=t, loss=loss[name])
        print(f"  {name}: {b} rows, fill {fill:.1%}, first call {warm[name]:.1f}s, "
              f"timed {', '.join(f'{x:.3f}' for x in times[name])}s -> min {t:.3f}s = {t / b * 1e3:.0f} ms/row", flush=True)

    hdr = f"{'layout':<10}{'rows':>6}{'L':>6}{'tokens in rows':>16}{'fill':>8}{'loss':>9}{'s/step':>10}{'unique tok/s':>14}"
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for name, r in results.items():
        in_rows = int((packed_batch if name == "packed" else exp_batch)["segment_ids"].astype(bool).sum())
        print(f"{name:<10}{r['rows']:>6}{args.row_len:>6}{in_rows:>16}{r['fill']:>8.1%}{r['loss']:>9.4f}"
              f"{r['time']:>10.3f}{unique / r['time']:>14.0f}")
    speedup = results["expanded"]["time"] / results["packed"]["time"]
    print(f"\ntokens/s = unique tree tokens ({unique}) / wall seconds of one fwd+bwd over all rows (min of the timed runs), for both layouts;"
          f"\nspeedup = expanded_time / packed_time = {speedup:.2f}; target >= 0.8 x dedup = {0.8 * dedup:.2f}"
          f"\n(a row costs the same in both layouts, so the noise-free speedup is the row ratio "
          f"{results['expanded']['rows'] / results['packed']['rows']:.2f}; the gap to dedup is bin-packing fill)")
    return bench.emit({
        "dedup_factor": round(dedup, 3),
        "packed_tokens_per_s": round(unique / results["packed"]["time"], 1),
        "expanded_tokens_per_s": round(unique / results["expanded"]["time"], 1),
        "speedup": round(speedup, 3),
        "row_len": args.row_len,
        "packed_rows": results["packed"]["rows"],
        "expanded_rows": results["expanded"]["rows"],
        "unique_tokens": unique,
        "expanded_tokens": expanded,
    }, sizes=dict(row_len=args.row_len, trees=len(trees), unique_tokens=unique, params=count_params(params),
                  d_model=cfg.d_model, n_layers=cfg.n_layers, iters=args.iters))


if __name__ == "__main__":
    main()
