"""What the store's cursor costs per step: the journal (now) against a whole rewrite each step (before).

  python tools/bench_cursor.py [--steps 400] [--rollouts-per-step 64]

A store gets ``steps x rollouts_per_step`` finished rollouts (one tiny call each), then the
trainer's pattern: one ``mark_trained`` per step. "journal" is the store as it is (one fsynced
line per step, compacted into the snapshot when the journal outgrows it); "rewrite" writes the
whole cursor each step the way the store did before (temp file, fsync, rename, fsync dir).
Bytes are what each wrote to the cursor files over the run. Prints a table, then ONE JSON line:
steps, rollouts_per_step, journal_bytes, rewrite_bytes, bytes_ratio, journal_bytes_per_step, rewrite_bytes_per_step (run it at
two --steps: the journal's stays flat, a rewrite's grows with the steps), journal_ms_per_step,
rewrite_ms_per_step, journal_ms_last_100, rewrite_ms_last_100, compactions.
"""
from __future__ import annotations

import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gyre_jax.trajectory import cursor as store_mod  # noqa: E402
from gyre_jax.trajectory.records import ModelCallRecord, RolloutOutcome  # noqa: E402
from gyre_jax.trajectory.store import StoreConfig, TrajectoryStore  # noqa: E402

import benchkit  # noqa: E402


def _fill(d: str, steps: int, per: int) -> TrajectoryStore:
    st = TrajectoryStore(d, run_id="run", config=StoreConfig(fsync="never"))
    for s in range(steps):
        for k in range(per):
            rid = f"g{s:05d}-{k}"
            st.append(ModelCallRecord(run_id="run", rollout_id=rid, task_id="t", group_id=f"g{s:05d}", agent_id=0,
                                      parent_agent_id=None, role="main", call_index=0, prompt_ids=np.arange(1, 3, dtype=np.int32),
                                      output_ids=np.arange(3, 4, dtype=np.int32), output_logprobs=np.zeros(1, np.float32),
                                      policy_version=s, t_start=0.0, t_end=0.0, finish_reason="stop"))
            st.append(RolloutOutcome(run_id="run", rollout_id=rid, task_id="t", group_id=f"g{s:05d}", status="completed",
                                     score=1.0, policy_versions=(s,), t_end=0.0, num_calls=1))
    return st


def run(kind: str, steps: int, per: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        st = _fill(d, steps, per)
        written, snaps, times = [0], [0], []
        real_atomic, real_write = store_mod._atomic_write_json, TrajectoryStore.journal_write

        def atomic(path, obj):
            real_atomic(path, obj)
            written[0] += os.path.getsize(path)
            snaps[0] += 1

        def jwrite(fd, line, offset):
            written[0] += len(line)
            return real_write(fd, line, offset)

        store_mod._atomic_write_json = atomic
        TrajectoryStore.journal_write = staticmethod(jwrite)
        try:
            for s in range(steps):
                ids = [f"g{s:05d}-{k}" for k in range(per)]
                with benchkit.Stopwatch() as sw:
                    if kind == "journal":
                        st.mark_trained(ids, step=s)
                    else:  # before: memory, then the whole cursor rewritten
                        for rid in ids:
                            st._cursor.consumed[rid] = {"state": "trained", "step": s, "reason": None,
                                                        "outcome_offset": st._rollouts[rid].outcome[0]}
                        atomic(os.path.join(d, "cursor.json"), st.cursor_state())
                times.append(sw.s)
        finally:
            store_mod._atomic_write_json, TrajectoryStore.journal_write = real_atomic, staticmethod(real_write)
        st.close()
        return dict(bytes=written[0], snapshots=snaps[0], ms_per_step=1e3 * float(np.mean(times)),
                    ms_last_100=1e3 * float(np.mean(times[-100:])))


def main(argv=None) -> dict:
    bench = benchkit.Bench(__file__, __doc__, quick={"steps": 20, "rollouts_per_step": 8})
    ap = bench.parser
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rollouts-per-step", type=int, default=64)
    a = bench.parse(argv)
    j = run("journal", a.steps, a.rollouts_per_step)
    r = run("rewrite", a.steps, a.rollouts_per_step)
    print(f"{'cursor':<8} {'bytes':>12} {'snapshots':>9} {'ms/step':>8} {'ms/step last 100':>16}")
    for name, x in (("journal", j), ("rewrite", r)):
        print(f"{name:<8} {x['bytes']:>12,} {x['snapshots']:>9} {x['ms_per_step']:>8.2f} {x['ms_last_100']:>16.2f}")
    return bench.emit(dict(steps=a.steps, rollouts_per_step=a.rollouts_per_step, journal_bytes=j["bytes"],
                          rewrite_bytes=r["bytes"], bytes_ratio=round(r["bytes"] / j["bytes"], 1),
                          journal_bytes_per_step=round(j["bytes"] / a.steps), rewrite_bytes_per_step=round(r["bytes"] / a.steps),
                          journal_ms_per_step=round(j["ms_per_step"], 3), rewrite_ms_per_step=round(r["ms_per_step"], 3),
                          journal_ms_last_100=round(j["ms_last_100"], 3), rewrite_ms_last_100=round(r["ms_last_100"], 3),
                           compactions=j["snapshots"]), sizes={"steps": a.steps, "rollouts_per_step": a.rollouts_per_step})


if __name__ == "__main__":
    main()
