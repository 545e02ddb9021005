"""How long a run's report takes to build, and how big the page is (issue 44: "a 10,000-rollout run's
report builds in seconds, not minutes").

    python tools/bench_report.py                          # 10,000 synthetic rollouts (groups of 8)
    python tools/bench_report.py --rollouts 2000 --calls 30
    python tools/bench_report.py --workdir /tmp/gyre_learn   # an existing run (every <mode> in it)
    python tools/bench_report.py --quick                  # 200 rollouts: what the tests run

Synthetic runs: ``gyre_jax.trajectory.synth`` rollouts (sub-agents, retries, drift, compaction, timeouts and
failures; ids drawn from the byte range, so they decode) written into a store, trained in steps of 32 (the
store's cursor: so advantages and path selection run as for a real run), with a metrics.jsonl line per
step. Each run is built twice: cold (every group) and again with nothing changed (what a rerun on a
running run costs). Prints a table, then ONE JSON line: page_s (until the page and its tables are written,
every rollout listed: it is usable from then on), build_s (cold, wall, every rollout's file), build_cpu_s (its CPU time, the
build's worker processes included: what it costs on quiet cores when the machine is shared), rebuild_s, rollouts, calls,
recorded_tokens, bytes_total (the page, its data and the 1.2 MB plotly.js), bytes_index (what the page
loads first: the rollout table), bytes_run (curves and tables), bytes_largest_group (the most a click
loads), load (the 1-minute load average at the start: the machine is shared).
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gyre_jax.report import build_report, mode_dirs  # noqa: E402

import benchkit  # noqa: E402 (tools/, beside this script)

STEP_ROLLOUTS = 32


def synth_run(mode_dir: str, rollouts: int, group_size: int, calls: int, seed: int) -> dict:
    """A store of ``rollouts`` synthetic rollouts in ``mode_dir/store``, trained STEP_ROLLOUTS at a time."""
    from gyre_jax.rl.metrics import MetricsWriter
    from gyre_jax.trajectory.store import StoreConfig, TrajectoryStore
    from gyre_jax.trajectory.synth import preset, synth_rollout

    cfg = preset("tiny", seed=seed, num_groups=rollouts // group_size, group_size=group_size, calls_per_rollout=calls,
                 vocab_size=128, system_prompt_len=64, task_prompt_len=32, output_len=24, tool_result_len=48,
                 max_context=640, summary_len=32, subagent_rate=0.1, subagent_calls=3, retry_rate=0.05,
                 drift_rate=0.05, timeout_rate=0.1, infra_error_rate=0.02, verifier_error_rate=0.02,
                 version_every_calls=0)
    n_calls = n_tokens = 0
    sw = benchkit.Stopwatch.started()
    with TrajectoryStore(os.path.join(mode_dir, "store"), run_id=cfg.run_id,
                         config=StoreConfig(fsync="never", vocab_size=cfg.vocab_size)) as st, \
            MetricsWriter(mode_dir, process_index=0) as m:
        step, batch, scores = 0, [], []
        for k in range(cfg.num_groups * cfg.group_size):
            cs, outcome = synth_rollout(cfg, k // cfg.group_size, k % cfg.group_size)
            for c in cs:
                st.append(c)
                n_tokens += int(c.prompt_ids.shape[0] + c.output_ids.shape[0])
            n_calls += len(cs)
            st.append(outcome)
            batch.append(outcome)
            if len(batch) == STEP_ROLLOUTS:
                st.mark_trained([o.rollout_id for o in batch if not o.is_failure], step=step)
                failed = [o.rollout_id for o in batch if o.is_failure]
                if failed:
                    st.mark_dropped(failed, step=step, reason="failure")
                scored = [o.score for o in batch if o.score is not None]
                m.write(step, {"version": step + 1, "reward": sum(scored) / max(len(scored), 1),
                               "trained_rollouts": len(scored), "time_s": float(step)})
                scores += scored
                step, batch = step + 1, []
    return {"rollouts": cfg.num_groups * cfg.group_size, "calls": n_calls, "recorded_tokens": n_tokens,
            "steps": step, "synth_s": round(sw.s, 2)}


def _cpu_s() -> float:
    """CPU seconds of this process and of its finished children: the build's worker processes are joined
    when it returns, so their time is in it (process_time alone left it out: 3.4 s for a 10,000-rollout
    build that used minutes)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def measure(mode_dir: str, title: str, workers: int = 0) -> dict:
    out = os.path.join(mode_dir, "report")
    shutil.rmtree(out, ignore_errors=True)
    c0 = _cpu_s()
    cold = build_report(mode_dir, out, progress=False, workers=workers)
    cpu = _cpu_s() - c0
    warm = build_report(mode_dir, out, progress=False, workers=workers)
    shards = os.path.join(out, "data", "rollouts")
    largest = max((os.path.getsize(os.path.join(shards, n)) for n in os.listdir(shards)), default=0)
    return {"run": title, "rollouts": cold["rollouts"], "build_s": cold["seconds"], "build_cpu_s": round(cpu, 2),
            "page_s": cold["page_s"],
            "rebuild_s": warm["seconds"], "bytes_total": cold["bytes_total"], "bytes_data": cold["bytes_data"],
            "bytes_index": cold["bytes_index"], "bytes_run": cold["bytes_run"], "bytes_largest_group": largest,
            "report": cold["report"]}


def main(argv=None) -> dict:
    bench = benchkit.Bench(__file__, __doc__, quick_help="200 synthetic rollouts")
    ap = bench.parser
    ap.add_argument("--rollouts", type=int, default=10_000)
    ap.add_argument("--group_size", type=int, default=8)
    ap.add_argument("--calls", type=int, default=12, help="model calls per (full) synthetic rollout")
    ap.add_argument("--workdir", default="", help="measure this run's report instead of a synthetic one")
    ap.add_argument("--keep", default="", help="keep the synthetic run in this directory")
    ap.add_argument("--workers", type=int, default=0, help="build processes (0: one per CPU up to 8; 1: one)")
    args = bench.parse(argv)
    rows, extra = [], {}
    if args.workdir:
        for d in mode_dirs(args.workdir):
            rows.append(measure(d, d, args.workers))
    else:
        n = 200 if args.quick else args.rollouts
        root = args.keep or tempfile.mkdtemp(prefix="gyre-bench-report-")
        mode_dir = os.path.join(root, "synth")
        shutil.rmtree(mode_dir, ignore_errors=True)
        extra = synth_run(mode_dir, n, args.group_size, args.calls, seed=0)
        rows.append(measure(mode_dir, f"synthetic, {n} rollouts x {args.calls} calls", args.workers))
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f"{'run':44s} {'rollouts':>8s} {'page s':>7s} {'build s':>8s} {'CPU s':>6s} {'rebuild s':>9s} "
          f"{'page MB':>8s} {'index KB':>9s} {'run KB':>7s} {'max group KB':>12s}")
    for r in rows:
        print(f"{r['run'][-44:]:44s} {r['rollouts']:8d} {r['page_s']:7.1f} {r['build_s']:8.1f} {r['build_cpu_s']:6.1f} "
              f"{r['rebuild_s']:9.2f} "
              f"{r['bytes_total'] / 1e6:8.1f} {r['bytes_index'] / 1e3:9.0f} {r['bytes_run'] / 1e3:7.0f} "
              f"{r['bytes_largest_group'] / 1e3:12.0f}")
    result = {**extra, **{k: v for k, v in rows[0].items() if k not in ("run", "report")}} if rows else {}
    return bench.emit(result, sizes=dict(rollouts=result.get("rollouts"), group_size=args.group_size, calls=args.calls,
                                         workdir=args.workdir or None, workers=args.workers))


if __name__ == "__main__":
    main()
