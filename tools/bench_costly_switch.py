"""Elastic on the real controller when a role switch outlasts a training step (issue 26 item 5).

  python tools/bench_costly_switch.py [--to-train-s 600] [--to-rollout-s 300] [--steps 8]

The Controller with its online estimates drives the fakes of gyre_jax/testing/fake_cluster.py
(tiny_sim_config: 8 cells of 2 slots, 4 groups x 2 rollouts per step, ~90 s steps) three ways:
blind (no priors: the RL loop's first run), seeded with the costs the blind run measured (what
--config.scheduler.priors=<its scheduler_costs.json> gives the next run), and async_stream at
every fixed split. A table, then one JSON line: makespans (virtual seconds), switches, and
seeded_vs_best_async (best async makespan / seeded makespan; 1.0 = the best fixed split).
"""
from __future__ import annotations

import dataclasses
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's gyre_jax

from gyre_jax.scheduler import costs_file, workloads  # noqa: E402
from gyre_jax.scheduler import policy as P  # noqa: E402
from gyre_jax.scheduler.controller import Controller  # noqa: E402
from gyre_jax.testing.fake_cluster import fake_cluster, tiny_sim_config  # noqa: E402

import benchkit  # noqa: E402


def run(cfg, policy):
    rollouts = workloads.rollouts_for(cfg)
    cfg = cfg.replace(policy=policy)
    fc = fake_cluster(cfg, rollouts, P.initial_roles(policy, cfg.cluster.n_cells))
    ctl = Controller(policy, cells=fc.cells, proxy=fc.proxy, rollouts=fc.rollouts, trainer=fc.trainer, clock=fc.clock)
    for i in range(1, 100_000):  # load samples every sample_s, as a polling loop takes them
        fc.clock.at(i * ctl.sample_s, lambda: None)
    while not ctl.done():
        ctl.tick()
        if not fc.clock.advance():
            raise RuntimeError("the fakes ran out of events before the last step")
    roles = "".join(fc.cells.role(c)[0] for c in range(cfg.cluster.n_cells))
    return fc.clock.now(), ctl.switches, roles, ctl.estimates.measured()


def main(argv=None) -> dict:
    bench = benchkit.Bench(__file__, __doc__, quick={"steps": 2})
    ap = bench.parser
    ap.add_argument("--to-train-s", type=float, default=600.0)
    ap.add_argument("--to-rollout-s", type=float, default=300.0)
    ap.add_argument("--steps", type=int, default=8)
    a = bench.parse(argv)
    cfg = tiny_sim_config("elastic", **{"cluster.switch_to_train_s": a.to_train_s,
                                        "cluster.switch_to_rollout_s": a.to_rollout_s, "policy.total_steps": a.steps})
    blind = run(cfg, cfg.policy)
    with tempfile.TemporaryDirectory() as d:  # the pilot's costs through the file, as the loop writes and reads it
        path = os.path.join(d, costs_file.FILE_NAME)
        costs_file.save(path, blind[3])
        seeded = run(cfg, dataclasses.replace(cfg.policy, priors=costs_file.load(path)))
    fixed = {k: run(cfg, dataclasses.replace(cfg.policy, mode="async_stream", async_train_cells=k))[0]
             for k in range(1, cfg.cluster.n_cells)}
    best = min(fixed, key=fixed.get)
    print(f"{'run':28s} {'makespan s':>10s} {'switches':>8s}  final roles")
    print(f"{'elastic, blind':28s} {blind[0]:10.0f} {blind[1]:8d}  {blind[2]}")
    print(f"{'elastic, seeded by blind':28s} {seeded[0]:10.0f} {seeded[1]:8d}  {seeded[2]}")
    for k, t in fixed.items():
        print(f"{f'async_stream, {k} training':28s} {t:10.0f} {0:8d}{'  (best)' if k == best else ''}")
    return bench.emit({
        "switch_to_train_s": a.to_train_s, "switch_to_rollout_s": a.to_rollout_s, "steps": a.steps,
        "cells": cfg.cluster.n_cells, "groups_per_step": cfg.policy.groups_per_step,
        "group_size": cfg.policy.group_size,
        "blind_makespan_s": round(blind[0], 1), "blind_switches": blind[1],
        "seeded_makespan_s": round(seeded[0], 1), "seeded_switches": seeded[1],
        "best_async_split": best, "best_async_makespan_s": round(fixed[best], 1),
        "seeded_vs_best_async": round(fixed[best] / seeded[0], 4),
        "blind_vs_best_async": round(fixed[best] / blind[0], 4),
    }, sizes={"steps": a.steps, "cells": cfg.cluster.n_cells, "groups_per_step": cfg.policy.groups_per_step,
              "group_size": cfg.policy.group_size})


if __name__ == "__main__":
    main()
