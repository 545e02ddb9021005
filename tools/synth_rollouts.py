"""Write synthetic agent rollouts (gyre_jax.trajectory.synth) into a trajectory store.

    python tools/synth_rollouts.py --preset paper --out /tmp/synth_paper
    python tools/synth_rollouts.py --preset tiny --out /tmp/synth_tiny --set num_groups=4 --set drift_rate=0.5

Prints a table (one row per rollout: calls, roles, status, recorded tokens,
unique tokens and rebuild seconds of its tree) and then one JSON line with the
totals. Rebuild time is one core, `gyre_jax.trajectory.tree.rebuild` on the
records read back from the store.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tqdm import tqdm  # noqa: E402

from gyre_jax.trajectory.store import StoreConfig, TrajectoryStore  # noqa: E402
from gyre_jax.trajectory.synth import PRESETS, preset, synth_rollout  # noqa: E402
from gyre_jax.trajectory.tree import rebuild  # noqa: E402
from gyre_jax.trajectory.vocab import ROLES  # noqa: E402

import benchkit  # noqa: E402 (tools/, beside this script)


def _parse_set(items: list[str]) -> dict:
    fields = {f.name: f.type for f in dataclasses.fields(PRESETS["tiny"])}
    out = {}
    for item in items:
        key, sep, val = item.partition("=")
        if not sep or key not in fields:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE with KEY one of {sorted(fields)}")
        typ = fields[key]
        out[key] = val if typ == "str" else float(val) if typ == "float" else int(val)
    return out


def main(argv=None) -> dict:
    bench = benchkit.Bench(__file__, __doc__, quick=dict(set=["num_groups=1", "group_size=2"]))
    ap = bench.parser
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--out", default="", help="store directory (created; must not hold a store already); "
                    "default: a new temp directory")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a SynthConfig field")
    ap.add_argument("--fsync", default="never", choices=("always", "interval", "never"))
    ap.add_argument("--no-rebuild", action="store_true", help="skip rebuilding each tree (faster)")
    args = bench.parse(argv)
    args.out = args.out or tempfile.mkdtemp(prefix="gyre_synth_")
    cfg = preset(args.preset, **_parse_set(args.set))
    if os.path.exists(os.path.join(args.out, "meta.json")):
        raise SystemExit(f"{args.out} already holds a store; pick a new directory")
    rows = []
    sw = benchkit.Stopwatch.started()
    n = cfg.num_groups * cfg.group_size
    with TrajectoryStore(args.out, run_id=cfg.run_id, config=StoreConfig(fsync=args.fsync, vocab_size=cfg.vocab_size)) as st:
        for k in tqdm(range(n), desc="rollouts", unit="rollout", disable=n < 4):
            calls, outcome = synth_rollout(cfg, k // cfg.group_size, k % cfg.group_size)
            for c in calls:
                st.append(c)
            st.append(outcome)
            row = dict(rollout=outcome.rollout_id, calls=len(calls), status=outcome.status,
                       roles="/".join(str(sum(c.role == r for c in calls)) for r in ROLES),
                       recorded=sum(c.prompt_ids.shape[0] + c.output_ids.shape[0] for c in calls),
                       max_prompt=max(c.prompt_ids.shape[0] for c in calls))
            if not args.no_rebuild:
                back = st.calls(outcome.rollout_id)
                rt, rebuild_s = benchkit.timed(rebuild, back)
                row.update(unique=rt.unique_tokens, trainable=rt.trainable_tokens, rebuild_s=rebuild_s)
            rows.append(row)
        stats = st.stats()
    cols = list(rows[0])
    print(" ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]:>14.4f}" if isinstance(r[c], float) else f"{r[c]!s:>14}" for c in cols))
    result = dict(
        preset=args.preset, out=os.path.abspath(args.out), rollouts=len(rows), calls=stats.calls,
        recorded_tokens=sum(r["recorded"] for r in rows), max_prompt_tokens=max(r["max_prompt"] for r in rows),
        log_bytes=stats.log_bytes, seconds=sw.s,
    )
    if not args.no_rebuild:
        result.update(unique_tokens=sum(r["unique"] for r in rows), trainable_tokens=sum(r["trainable"] for r in rows),
                      rebuild_seconds=sum(r["rebuild_s"] for r in rows),
                      max_rebuild_seconds=max(r["rebuild_s"] for r in rows))
    return bench.emit(result, sizes=dict(preset=args.preset, overrides=args.set, rollouts=len(rows),
                                         fsync=args.fsync, rebuild=not args.no_rebuild))


if __name__ == "__main__":
    main()
