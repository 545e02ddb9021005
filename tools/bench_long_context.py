"""Long context on CPU: blockwise tree attention vs the dense mask, tile skipping, longest row.

    python tools/bench_long_context.py                      # all fields; ~10 min; one child up to ~4 GiB
    python tools/bench_long_context.py --max-len 16384      # quicker: rows up to 16K only
    python tools/bench_long_context.py --quick              # a smoke run: the tiny preset, rows of 1-2K

Rows are paper-like: the synthetic paper-preset rollout (gyre_jax.trajectory.synth) is
rebuilt, selected and packed by the trajectory processor into one row of ``--tree-row-len``
tokens; shorter rows are its first L tokens (subtree_end clipped to L: each kept token's
context is unchanged).

Prints tables, then ONE final JSON line:
  * ``skipped_tile_fraction`` / ``masked_tile_fraction``: tile pairs (``--block`` square)
    the blockwise kernel skips vs tile pairs whose exact tree mask is all False; also for the
    whole selected tree in one context-parallel row (``--cp-row-len``, ``*_whole_tree``).
  * ``speedup_vs_dense_4k``: tiny model forward+backward (the training loss), L=4,096,
    dense [L, L] mask / blockwise, min of ``--repeats`` timed runs after compile; reported
    for the paper-like tree row and a plain causal row; the field is the smaller (causal
    skips least).
  * ``max_row_len_fwd_bwd``: longest L in the doubling ladder (16K ... ``--max-len``) whose
    forward+backward of the tiny model (remat per layer, chunked vocab projection) runs in
    a child process with peak RSS <= ``--mem-limit-gib`` (the child's own VmHWM). Runs first,
    while this process is still small.
  * ``prefill_75k_ok``: GyreEngine (JetStream Engine API) prefills a ``--prefill-len`` prompt
    in chunks of ``--prefill-chunk`` (blockwise cache attention) and decodes greedily; its
    first token equals decode.prefill_chunked's argmax.
Targets (issue 12): skipped within 5% of masked, speedup >= 1.0, max_row_len >= 65,536.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import benchkit  # noqa: E402 (tools/, beside this script)

TINY_VOCAB = 128  # model_config_tiny's vocab_size
_ROW_KEYS = ("tokens", "targets", "loss_mask", "behavior_logprobs", "positions", "segment_ids", "subtree_end",
             "loss_weights", "advantages")


def paper_tree_row(row_len: int, seed: int = 0, preset_name: str = "paper") -> dict[str, np.ndarray]:
    """The fullest packed row of one paper-preset rollout, as [1, row_len] arrays."""
    from gyre_jax.trajectory.processor import ProcessorConfig, process_step
    from gyre_jax.trajectory.select import SelectConfig
    from gyre_jax.trajectory.synth import preset, synth_rollout

    cfg = preset(preset_name, seed=seed, timeout_rate=0.0, infra_error_rate=0.0, verifier_error_rate=0.0)
    calls, outcome = synth_rollout(cfg, 0, 0)
    batch = process_step(calls, [outcome], ProcessorConfig(row_len=row_len, select=SelectConfig(mode="priority")))
    rows = batch.rows
    best = int(np.argmax((rows.segment_ids > 0).sum(1)))
    out = {k: getattr(rows, k)[best: best + 1].copy() for k in _ROW_KEYS}
    for k in ("tokens", "targets"):  # synthetic ids are Qwen-sized; the tiny model's vocab is TINY_VOCAB
        out[k] %= TINY_VOCAB
    return out


def crop(row: dict[str, np.ndarray], length: int) -> dict[str, np.ndarray]:
    out = {k: v[:, :length].copy() for k, v in row.items()}
    out["subtree_end"] = np.minimum(out["subtree_end"], length).astype(np.int32)
    return out


def causal_row(row: dict[str, np.ndarray], length: int) -> dict[str, np.ndarray]:
    out = crop(row, length)
    out["segment_ids"] = np.ones_like(out["segment_ids"])
    out["subtree_end"] = np.full_like(out["subtree_end"], length)
    out["positions"] = np.arange(length, dtype=np.int32)[None]
    return out


def _fwd_bwd(model_cfg, logits_chunk):
    import jax

    from gyre_jax.cells.loss import policy_loss_fn

    loss_fn = policy_loss_fn(model_cfg, logits_chunk=logits_chunk)
    return jax.jit(jax.value_and_grad(lambda p, mb: loss_fn(p, mb)[0]))


def tiny_config(length: int, **kw):
    from gyre_jax.model.config import model_config_tiny

    return model_config_tiny(max_seq_len=length, **kw)


def time_fwd_bwd(row, impl: str, repeats: int, block: int) -> float:
    import jax

    from gyre_jax.model.transformer import init_params

    length = row["tokens"].shape[1]
    cfg = tiny_config(length, attention_impl=impl, attention_block_q=block, attention_block_k=block)
    params = init_params(cfg, jax.random.key(0))
    step = _fwd_bwd(cfg, None)
    mb = {k: jax.numpy.asarray(v) for k, v in row.items()}
    return benchkit.best_of(lambda: jax.block_until_ready(step(params, mb)), repeats, warmup=1)  # warm-up: compile


def child_fwd_bwd(npz_path: str, block: int, logits_chunk: int) -> None:
    """One forward+backward of a long row (run in its own process so its peak RSS is its own)."""
    import jax

    from gyre_jax.model.transformer import init_params

    row = dict(np.load(npz_path))
    length = row["tokens"].shape[1]
    # Every real token trained (the prefix of a paper row is mostly untrained system prompt, which
    # would leave the gradient zero): the backward does real work through every layer.
    real = row["segment_ids"] > 0
    row["loss_mask"] = real
    row["loss_weights"] = (real / real.sum()).astype(np.float32)
    row["advantages"] = np.ones_like(row["advantages"])
    cfg = tiny_config(length, remat=True, attention_block_q=block, attention_block_k=block)
    params = init_params(cfg, jax.random.key(0))
    step = _fwd_bwd(cfg, logits_chunk)
    (loss, grads), seconds = benchkit.timed(
        lambda: jax.block_until_ready(step(params, {k: jax.numpy.asarray(v) for k, v in row.items()})))
    finite = bool(np.isfinite(float(loss))) and all(bool(np.isfinite(np.asarray(g)).all())
                                                   for g in jax.tree.leaves(grads))
    grad_norm = float(np.sqrt(sum(float(jax.numpy.sum(g.astype(np.float32) ** 2)) for g in jax.tree.leaves(grads))))
    with open("/proc/self/status") as f:  # VmHWM: this process's own peak (ru_maxrss keeps the forking parent's)
        hwm_kib = next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:"))
    print(json.dumps({"length": length, "seconds": seconds, "finite": finite,
                      "trained_tokens": int(row["loss_mask"].sum()), "grad_norm": grad_norm,
                      "peak_rss_gib": hwm_kib / 2**20}), flush=True)


def run_child(row, length, args, tmp) -> dict:
    path = os.path.join(tmp, f"row_{length}.npz")
    np.savez(path, **crop(row, length))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", path, "--block", str(args.block),
           "--logits-chunk", str(args.logits_chunk)]
    with open(path + ".out", "w") as out_f, open(path + ".err", "w") as err_f, benchkit.Stopwatch() as sw:
        proc = subprocess.Popen(cmd, stdout=out_f, stderr=err_f)
        _, status, usage = os.wait4(proc.pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    out, err = open(path + ".out").read(), open(path + ".err").read()
    peak_kib = usage.ru_maxrss  # an upper bound (includes the parent's RSS at fork); the child reports VmHWM
    res = {"length": length, "rc": rc, "peak_rss_gib": peak_kib / 2**20, "wall_s": sw.s}
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if rc == 0 and lines:
        res.update(json.loads(lines[-1]))
    else:
        res["error"] = err.strip().splitlines()[-1] if err.strip() else f"exit {rc}"
    return res


def prefill_long(length: int, chunk: int, decode_steps: int, block: int) -> dict:
    """The engine (GyreEngine, JetStream API) prefills a ``length``-token prompt in chunks, then decodes greedily.

    Checked against decode.prefill_chunked (the same cache path without the engine): same first token.
    """
    import jax
    import jax.numpy as jnp

    from gyre_jax.model import decode
    from gyre_jax.model.transformer import init_params
    from gyre_jax.serving.backend import SamplingParams
    from gyre_jax.serving.engine import GyreEngine
    from gyre_jax.serving.engine_state import PrefillInput, decode_result_pairs

    cap = -(-(length + decode_steps + 2) // chunk) * chunk
    cfg = tiny_config(cap, attention_block_q=block, attention_block_k=block)
    params = init_params(cfg, jax.random.key(0))
    prompt = np.random.default_rng(0).integers(1, cfg.vocab_size, length).astype(np.int32)
    eng = GyreEngine(cfg, params, max_slots=1, max_len=cap, prefill_chunk=chunk)
    with benchkit.Stopwatch() as sw:
        inp = PrefillInput("long", prompt[:-1], int(prompt[-1]), 0, SamplingParams(max_tokens=decode_steps,
                                                                                   temperature=0.0))
        pre = eng.prefill(params=eng.params_ref, padded_tokens=inp, true_length=length - 1)
        err = eng.pop_error("long")
        jax.block_until_ready(pre.k)
    prefill_s = sw.s
    ds = eng.insert(pre, eng.init_decode_state(), 0)
    toks = []
    with benchkit.Stopwatch() as sw:
        for _ in range(decode_steps):
            ds, res = eng.generate(eng.params_ref, ds)
            data = np.asarray(res.data)
            if data[0, res.tokens_idx[1]]:
                toks += [t for t, _ in decode_result_pairs(data[0, :2])]
    decode_s = sw.s
    _, logits = decode.prefill_chunked(params, cfg, jnp.asarray(prompt), cache_len=cap, chunk=chunk)
    ref_first = int(np.argmax(np.asarray(logits)))
    ok = err is None and len(toks) == decode_steps and toks[0] == ref_first
    return {"prompt_tokens": length, "max_len": cap, "chunk": chunk, "prefill_s": prefill_s,
            "decode_steps": decode_steps, "decode_s": decode_s, "tokens": toks, "reference_first_token": ref_first,
            "error": err, "ok": bool(ok)}


def main(argv=None) -> dict | None:
    bench = benchkit.Bench(__file__, __doc__, quick=dict(
        preset="tiny", tree_row_len=2048, block=128, cp_row_len=4096, repeats=1, ladder_start=1024, max_len=1024,
        speed_len=512, logits_chunk=256, prefill_len=600, prefill_chunk=256))
    ap = bench.parser
    ap.add_argument("--preset", default="paper", help="the synthetic rollout preset the rows come from")
    ap.add_argument("--tree-row-len", type=int, default=131072, help="row length the paper tree is packed into")
    ap.add_argument("--block", type=int, default=512, help="tile size (queries and keys)")
    ap.add_argument("--cp-row-len", type=int, default=8 * 131072,
                    help="also the tile fractions of the whole tree packed in one row this long; 0: skip")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ladder-start", type=int, default=16384, help="shortest row of the fwd+bwd ladder")
    ap.add_argument("--max-len", type=int, default=65536, help="longest row of the fwd+bwd ladder")
    ap.add_argument("--speed-len", type=int, default=4096, help="row length of the dense vs blockwise timing")
    ap.add_argument("--mem-limit-gib", type=float, default=16.0)
    ap.add_argument("--logits-chunk", type=int, default=4096, help="positions per vocab-projection chunk (long rows)")
    ap.add_argument("--prefill-len", type=int, default=75000)
    ap.add_argument("--prefill-chunk", type=int, default=8192)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = bench.parse(argv)
    if args.child:
        child_fwd_bwd(args.child, args.block, args.logits_chunk)
        return None

    from gyre_jax.model.tree_attention import tile_fractions_np

    row, built_s = benchkit.timed(paper_tree_row, args.tree_row_len, preset_name=args.preset)
    n_real = int((row["segment_ids"] > 0).sum())
    print(f"paper tree row: row_len={args.tree_row_len} real_tokens={n_real} trees={int(row['segment_ids'].max())} "
          f"(built in {built_s:.1f}s)", flush=True)

    print(f"{'block':>6} {'skipped':>8} {'masked':>8}  (tile pairs of the paper tree row)")
    tiles = {}
    for block in sorted({128, 256, args.block}):
        tiles[block] = tile_fractions_np(row["segment_ids"][0], row["subtree_end"][0], block, block)
        print(f"{block:>6} {tiles[block][0]:8.4f} {tiles[block][1]:8.4f}", flush=True)
    skipped, masked = tiles[args.block]
    whole = None
    if args.cp_row_len:  # the whole selected tree in one context-parallel row: sub-agents and branches skip more
        cp_row = paper_tree_row(args.cp_row_len, preset_name=args.preset)
        n_cp = int((cp_row["segment_ids"] > 0).sum())
        whole = tile_fractions_np(cp_row["segment_ids"][0][:n_cp], cp_row["subtree_end"][0][:n_cp], args.block,
                                  args.block)
        print(f"whole tree in one row of {args.cp_row_len}: {n_cp} tokens, skipped {whole[0]:.4f} "
              f"masked {whole[1]:.4f}", flush=True)

    print(f"{'L':>7} {'rc':>3} {'peak_rss_GiB':>12} {'run_s':>7} {'wall_s':>7}  (fwd+bwd, remat, chunked vocab)")
    ladder, max_ok = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        length = args.ladder_start
        while length <= args.max_len:
            res = run_child(row, length, args, tmp)
            ladder.append(res)
            ok = res["rc"] == 0 and res.get("finite") and res["peak_rss_gib"] <= args.mem_limit_gib
            print(f"{length:>7} {res['rc']:>3} {res['peak_rss_gib']:12.2f} {res.get('seconds', float('nan')):7.1f} "
                  f"{res['wall_s']:7.1f} trained_tokens={res.get('trained_tokens')} finite={res.get('finite')} "
                  f"{res.get('error', '')}", flush=True)
            if not ok:
                break
            max_ok = length
            length *= 2

    print(f"{'row':>8} {'L':>6} {'dense_s':>8} {'blockwise_s':>11} {'speedup':>8}  (tiny model fwd+bwd)")
    speed = {}
    n = args.speed_len
    for name, r in (("tree", crop(row, n)), ("causal", causal_row(row, n))):
        d = time_fwd_bwd(r, "dense", args.repeats, args.block)
        b = time_fwd_bwd(r, "blockwise", args.repeats, args.block)
        speed[name] = d / b
        print(f"{name:>8} {n:>6} {d:8.3f} {b:11.3f} {d / b:8.2f}", flush=True)

    prefill = prefill_long(args.prefill_len, args.prefill_chunk, 4, args.block)
    print(f"prefill: {prefill}", flush=True)

    return bench.emit({
        "block": args.block,
        "tree_row_len": args.tree_row_len,
        "tree_row_real_tokens": n_real,
        "skipped_tile_fraction": round(skipped, 4),
        "masked_tile_fraction": round(masked, 4),
        "whole_tree_row_tokens": None if whole is None else n_cp,
        "skipped_tile_fraction_whole_tree": None if whole is None else round(whole[0], 4),
        "masked_tile_fraction_whole_tree": None if whole is None else round(whole[1], 4),
        "speedup_vs_dense_4k": round(min(speed.values()), 3),
        "speedup_vs_dense_4k_tree": round(speed["tree"], 3),
        "speedup_vs_dense_4k_causal": round(speed["causal"], 3),
        "max_row_len_fwd_bwd": max_ok,
        "fwd_bwd_ladder": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in ladder],
        "prefill_75k_ok": prefill["ok"],
        "prefill": {k: (round(v, 3) if isinstance(v, float) else v) for k, v in prefill.items()},
        "targets_met": bool(abs(skipped - masked) <= 0.05 and min(speed.values()) >= 1.0 and max_ok >= 65536
                            and prefill["ok"]),
    }, sizes=dict(preset=args.preset, tree_row_len=args.tree_row_len, block=args.block, cp_row_len=args.cp_row_len,
                  repeats=args.repeats, ladder=[args.ladder_start, args.max_len], speed_len=args.speed_len,
                  logits_chunk=args.logits_chunk, prefill_len=args.prefill_len, prefill_chunk=args.prefill_chunk,
                  model="model_config_tiny"))


if __name__ == "__main__":
    main()
