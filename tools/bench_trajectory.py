"""Trajectory processor at paper scale: rebuild + select + pack of one long rollout.

    python tools/bench_trajectory.py                  # paper preset, ~1 min
    python tools/bench_trajectory.py --preset tiny    # seconds

Runs pinned to one CPU core. For each (selection mode, row length) it runs the
whole host pipeline (``processor.process_step``: tree rebuild from the call
records, path selection, splitting, bin-packing, loss weights) on the same
rollout and prints a table; then ONE final JSON line for the default
configuration (``--mode``, ``--row-len``).

Baseline: expanding every selected path into its own sequence (what frameworks
without prefix sharing train on): ``expanded_tokens``; ``expanded_over_packed``
is the training-token saving of the packed tree over it.

Targets (issue 3): ``packed_over_unique <= 1.02`` and ``seconds <= 5`` for the
paper-scale rollout. Issue 12: ``packed_over_unique_cp_row <= 1.02`` with rows as long
as a cell's context-parallel capacity (``--cp-row-len``, default 8 x 128K). ``unique_tokens`` in the JSON line is the unique tokens of
the *selected* tree (what is packed); ``tree_unique_tokens`` is the whole tree's.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gyre_jax.trajectory.processor import ProcessorConfig, process_step  # noqa: E402
from gyre_jax.trajectory.select import SelectConfig, select_paths  # noqa: E402
from gyre_jax.trajectory.synth import PRESETS, preset, synth_rollout  # noqa: E402
from gyre_jax.trajectory.tree import build_tree  # noqa: E402

import benchkit  # noqa: E402


def _rollout(preset_name: str, seed: int, index: int = 0):
    """(calls, outcome) of one synthetic rollout (gyre_jax.trajectory.synth)."""
    cfg = preset(preset_name, seed=seed, timeout_rate=0.0, infra_error_rate=0.0, verifier_error_rate=0.0)
    return synth_rollout(cfg, 0, index)


def lower_bound(calls, mode: str, row_len: int) -> float:
    """A floor on packed_over_unique for one rollout in rows of row_len.

    The prefix every selected path shares (the root and its single-child chain) is
    in every row that holds any of the rollout's tokens, so with U unique tokens
    and a root of r tokens: rows >= ceil((U - r) / (row_len - r)) and every row
    after the first repeats the root.
    """
    sel = select_paths(build_tree(calls), SelectConfig(mode=mode))
    u, r, node = sel.tokens_kept, 0, sel.tree
    while True:  # the shared prefix: the root and its single-child descendants
        r += node.tokens.shape[0]
        if len(node.children) != 1:
            break
        node = node.children[0]
    rows = max(1, -(-(u - r) // (row_len - r)))
    return (u + (rows - 1) * r) / u


def main(argv=None) -> dict:
    bench = benchkit.Bench(__file__, __doc__, quick=dict(preset="tiny", repeats=1, cp_row_len=16384, step_rollouts=2))
    ap = bench.parser
    ap.add_argument("--preset", default="paper", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", default="priority", help="selection mode of the final JSON line")
    ap.add_argument("--row-len", type=int, default=None, help="row length of the final JSON line "
                    "(default: the longest recorded context rounded up to a multiple of 1024)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per config (min is reported)")
    ap.add_argument("--cp-row-len", type=int, default=8 * 131072,
                    help="also pack into rows of a cell's context-parallel capacity (devices x per-device context, "
                         "gyre_jax/model/context_parallel.py); 0: skip")
    ap.add_argument("--step-rollouts", type=int, default=8,
                    help="also pack a step of this many rollouts (one group) to show cross-rollout fill; 0: skip")
    args = bench.parse(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core

    (calls, outcome), gen_s = benchkit.timed(_rollout, args.preset, args.seed)
    recorded = sum(int(c.prompt_ids.shape[0] + c.output_ids.shape[0]) for c in calls)
    max_ctx = max(int(c.prompt_ids.shape[0] + c.output_ids.shape[0]) for c in calls)
    base_L = args.row_len or -(-max_ctx // 1024) * 1024
    print(f"preset={args.preset} calls={len(calls)} recorded_tokens={recorded} max_context={max_ctx} "
          f"(generated in {gen_s:.1f}s)", flush=True)

    configs = [(m, L) for m in ("priority", "unbounded", "main_only") for L in (base_L, 2 * base_L, 4 * base_L)]
    if (args.mode, base_L) not in configs:
        configs.insert(0, (args.mode, base_L))
    head = ("mode", "row_len", "paths", "tree_uniq", "selected", "expanded", "packed", "pk/uniq",
            "pk/uniq_lb", "exp/pk", "dup", "rows", "fill", "rebuild_s", "select_s", "pack_s", "total_s")
    print(" ".join(f"{h:>10}" for h in head))
    results = {}
    for mode, L in configs:
        cfg = ProcessorConfig(row_len=L, select=SelectConfig(mode=mode))
        best = None
        for _ in range(args.repeats):
            b = process_step(calls, [outcome], cfg)
            if best is None or b.stats.seconds["total"] < best.stats.seconds["total"]:
                best = b
        st = best.stats
        lb = lower_bound(calls, mode, L)
        results[(mode, L)] = (st, lb)
        s = st.seconds
        row = (mode, L, f"{st.paths_selected}/{st.paths_total}", st.unique_tokens, st.selected_tokens,
               st.expanded_tokens, st.packed_tokens, f"{st.packed_over_unique:.4f}", f"{lb:.4f}",
               f"{st.dedup_factor:.2f}", st.duplicated_tokens, st.rows, f"{st.fill:.3f}",
               f"{s['rebuild']:.3f}", f"{s['select']:.3f}", f"{s['pack']:.3f}", f"{s['total']:.3f}")
        print(" ".join(f"{str(v):>10}" for v in row), flush=True)

    cp = None
    if args.cp_row_len > 0:  # one row spans the cell: the shared prefix is packed once
        cp = process_step(calls, [outcome], ProcessorConfig(row_len=args.cp_row_len,
                                                            select=SelectConfig(mode=args.mode))).stats
        print(f"context-parallel row ({args.mode}, row_len={args.cp_row_len}): rows={cp.rows} "
              f"packed_over_unique={cp.packed_over_unique:.4f} fill={cp.fill:.3f}", flush=True)

    if args.step_rollouts > 0:
        step = [_rollout(args.preset, args.seed, i) for i in range(args.step_rollouts)]
        step_calls = [c for cs, _ in step for c in cs]
        step_outs = [o for _, o in step]
        step_L = max(base_L, -(-max(int(c.prompt_ids.shape[0] + c.output_ids.shape[0]) for c in step_calls) // 1024) * 1024)
        for mode, L in ((args.mode, step_L), (args.mode, 2 * step_L)):
            b = process_step(step_calls, step_outs, ProcessorConfig(row_len=L, select=SelectConfig(mode=mode)))
            sst = b.stats
            print(f"step of {args.step_rollouts} rollouts, {mode}, row_len={L}: rows={sst.rows} "
                  f"fill={sst.fill:.3f} packed_over_unique={sst.packed_over_unique:.4f} "
                  f"expanded_over_packed={sst.dedup_factor:.2f} seconds={sst.seconds['total']:.2f} "
                  f"({sst.recorded_tokens / sst.seconds['total'] / 1e6:.0f}M recorded tokens/s)", flush=True)

    st, lb = results[(args.mode, base_L)]
    secs = st.seconds["total"]
    return bench.emit({
        "preset": args.preset, "mode": args.mode, "row_len": base_L, "calls": len(calls),
        "recorded_tokens": st.recorded_tokens,
        "unique_tokens": st.selected_tokens,
        "tree_unique_tokens": st.unique_tokens,
        "expanded_tokens": st.expanded_tokens,
        "packed_tokens": st.packed_tokens,
        "packed_over_unique": round(st.packed_over_unique, 5),
        "packed_over_unique_lower_bound": round(lb, 5),
        "packed_over_unique_2x_row": round(results[(args.mode, 2 * base_L)][0].packed_over_unique, 5),
        "packed_over_unique_4x_row": round(results[(args.mode, 4 * base_L)][0].packed_over_unique, 5),
        "cp_row_len": args.cp_row_len,
        "packed_over_unique_cp_row": None if cp is None else round(cp.packed_over_unique, 5),
        "expanded_over_packed": round(st.dedup_factor, 3),
        "duplicated_tokens": st.duplicated_tokens,
        "fill": round(st.fill, 4),
        "seconds": round(secs, 4),
        "seconds_by_phase": {k: round(v, 4) for k, v in st.seconds.items()},
        "recorded_tokens_per_s": round(st.recorded_tokens / secs),
        "targets_met": bool(st.packed_over_unique <= 1.02 and secs <= 5.0),
    }, sizes=dict(preset=args.preset, seed=args.seed, mode=args.mode, row_len=base_L, repeats=args.repeats,
                  cp_row_len=args.cp_row_len, step_rollouts=args.step_rollouts))


if __name__ == "__main__":
    main()
