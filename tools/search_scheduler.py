"""Hunt for workloads where elastic loses to a fixed split (simulated): random clusters, workloads and
switch costs, each run in elastic and in every fixed split, the losses printed.

  python tools/search_scheduler.py [--cases 40] [--seed 0] [--switch above_step|any] [--blind] [--max-cells 12]

Each case draws a cluster (3 to --max-cells cells of one accelerator, 2 to 32 slots each), a workload
(one model call or many, tools or none, training 5% to 80% of the work, a batch of one to four waves
of slots, groups of 2 to 16, 2 to 16 steps, staleness bound 1 or 2) and switch costs: with
``--switch above_step`` (the default: issue 46's class) each direction costs 1x to 20x a step of the
drawn workload, independently (asymmetric); with ``any``, 0.05x to 20x. Elastic gets the simulator's
pilot priors (the first step's costs and the cluster's switch costs) unless ``--blind``: then it
starts knowing nothing, as the RL loop's first run does, and learns a switch's cost by making one.

The fixed splits are async and async_stream at every split (the strongest fixed baseline: streaming
included); colocate is reported beside them. A case is a loss when elastic takes more than
``--tolerance`` (2%) longer than the best fixed split. Every case prints one line (its draw in a
form ``--replay SEED:INDEX`` reruns with elastic's switches listed); then ONE final JSON line:
``worst_elastic_over_best_fixed`` (elastic's time / the best fixed split's), the worst case, the
losses and the CPU seconds.
"""
from __future__ import annotations

import json
import math
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's gyre_jax

from gyre_jax.scheduler import baselines  # noqa: E402
from gyre_jax.scheduler.policy import PolicyConfig, ToRollout, ToTrain  # noqa: E402
from gyre_jax.scheduler.simulator import simulate  # noqa: E402
from gyre_jax.scheduler.workloads import (  # noqa: E402
    ClusterConfig,
    SimConfig,
    WorkloadConfig,
    batch_filling_cluster,
    mean_call_s,
    rollouts_for,
)

import benchkit  # noqa: E402 (tools/, beside this script)

SWITCH_RANGES = {"above_step": (1.0, 20.0), "any": (0.05, 20.0)}


def draw(rng: random.Random, *, switch: str = "above_step", max_cells: int = 12, blind: bool = False) -> SimConfig:
    """One random case (see the module docstring)."""
    n = rng.randint(3, max_cells)
    slots = rng.choice([2, 4, 8, 16, 32])
    calls = rng.choice([1, 1, 3, 8, 20])
    w = dict(name="search", calls_median=float(calls), calls_shape=rng.uniform(0.01, 0.8), calls_max=calls * 6,
             decode_tokens_median=rng.uniform(50, 800), decode_tokens_sigma=rng.uniform(0, 0.6),
             context_tokens_median=rng.uniform(100, 2000), context_tokens_sigma=rng.uniform(0, 0.6),
             decode_tok_s=rng.uniform(20, 50), prefill_tok_s=rng.uniform(1000, 20000),
             tool_s_median=rng.choice([0.0, 0.0, 2.0, 10.0]), tool_s_sigma=rng.uniform(0, 1.0),
             optimizer_s=rng.uniform(0, 20), train_tokens_per_s_per_cell=1.0)
    share = rng.uniform(0.05, 0.8)  # training's share of the work: the training throughput follows
    serve_per_call = mean_call_s(WorkloadConfig(**w)) / slots
    w["train_tokens_per_s_per_cell"] = (w["decode_tokens_median"] + w["context_tokens_median"]) / (
        serve_per_call * share / (1 - share))
    wl = WorkloadConfig(**w)
    gs = rng.choice([2, 4, 8, 16])
    publish_s = rng.uniform(0.5, 10)
    G = max(1, batch_filling_cluster(ClusterConfig(accelerators=n, cell_size=1, slots_per_cell=slots), wl, gs)
            * rng.choice([1, 1, 2, 4]))
    # a step's rough length, the unit of the switch costs: the batch's work spread over the cells
    calls_mean = calls * math.exp(w["calls_shape"] ** 2 / 2) if calls > 1 else 1
    serve = G * gs * calls_mean * mean_call_s(wl) / slots
    step_s = max(serve / (n - 1), serve / (1 - share) / n) + w["optimizer_s"]
    lo, hi = SWITCH_RANGES[switch]
    to_train, to_rollout = (step_s * math.exp(rng.uniform(math.log(lo), math.log(hi))) for _ in range(2))
    cl = ClusterConfig(accelerators=n, cell_size=1, slots_per_cell=slots, publish_s=publish_s,
                       switch_to_train_s=to_train, switch_to_rollout_s=to_rollout)
    pol = PolicyConfig(mode="elastic", total_steps=rng.randint(2, 16), groups_per_step=G, group_size=gs,
                       staleness_bound=rng.choice([1, 2, 2]))
    return SimConfig(cluster=cl, workload=wl, policy=pol, seed=rng.randint(0, 999), model_priors=not blind)


def evaluate(cfg: SimConfig, *, streaming_baseline: bool = True) -> dict:
    """Elastic's makespan over the best fixed split's (async, and async_stream unless told not to)."""
    ro = rollouts_for(cfg)
    el = simulate(cfg, rollouts=ro, record_decisions=False)
    fixed = {}
    for mode in ("async", "async_stream") if streaming_baseline else ("async",):
        sweep = baselines.async_sweep(cfg, ro, per_step=False, mode=mode)
        fixed.update({f"{mode}:{k}": r.makespan_s for k, r in sweep.by_split.items()})
    best = min(fixed, key=fixed.__getitem__)
    colocate = baselines.colocate(cfg, ro).makespan_s
    return {"elastic_over_best_fixed": el.makespan_s / fixed[best], "elastic_s": el.makespan_s,
            "switches": el.switches, "best_fixed": best, "best_fixed_s": fixed[best], "colocate_s": colocate}


def describe(cfg: SimConfig) -> str:
    c, p = cfg.cluster, cfg.policy
    return (f"{c.n_cells} cells x {c.slots_per_cell} slots, {p.total_steps} steps of {p.groups_per_step}x"
            f"{p.group_size}, S={p.staleness_bound}, calls~{cfg.workload.calls_median:g}, "
            f"switch {c.switch_to_train_s:.0f}/{c.switch_to_rollout_s:.0f} s, {'blind' if not cfg.model_priors else 'priors'}")


def replay(cfg: SimConfig) -> None:
    """One case again, with elastic's role switches listed."""
    print(cfg)
    r = evaluate(cfg)
    print(json.dumps(r))
    el = simulate(cfg)
    for d in el.decisions:
        moves = [a for a in d.actions if isinstance(a, (ToTrain, ToRollout))]
        if moves:
            print(f"  t={d.time:9.1f}  {moves}")


def main(argv=None) -> dict | None:
    bench = benchkit.Bench(__file__, __doc__, quick=dict(cases=2, max_cells=4))
    ap = bench.parser
    ap.add_argument("--cases", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--switch", choices=sorted(SWITCH_RANGES), default="above_step")
    ap.add_argument("--blind", action="store_true", help="no priors: elastic learns the costs by paying them")
    ap.add_argument("--max-cells", type=int, default=12)
    ap.add_argument("--tolerance", type=float, default=0.02)
    ap.add_argument("--replay", default="", help="SEED:INDEX of a printed case: rerun it with its switches listed")
    a = bench.parse(argv)
    kw = dict(switch=a.switch, max_cells=a.max_cells, blind=a.blind)
    if a.replay:
        seed, i = (int(x) for x in a.replay.split(":"))
        replay(draw(random.Random(seed * 1_000_003 + i), **kw))
        return None
    cpu0, wall0 = time.process_time(), time.perf_counter()
    worst, losses = None, []
    for i in range(a.cases):
        cfg = draw(random.Random(a.seed * 1_000_003 + i), **kw)
        t0 = time.process_time()
        r = evaluate(cfg)
        ratio = r["elastic_over_best_fixed"]
        loss = ratio > 1 + a.tolerance
        if loss:
            losses.append(f"{a.seed}:{i}")
        if worst is None or ratio > worst[0]:
            worst = (ratio, f"{a.seed}:{i}", describe(cfg))
        el = time.perf_counter() - wall0
        print(f"{a.seed}:{i:<4d} elastic/best fixed {ratio:6.3f} ({r['switches']:3d} switches; best {r['best_fixed']}, "
              f"colocate/elastic {r['colocate_s'] / r['elastic_s']:.2f})  {describe(cfg)}  "
              f"[{time.process_time() - t0:.1f} s CPU; ETA {el / (i + 1) * (a.cases - i - 1):.0f} s]"
              f"{'  <-- LOSS' if loss else ''}", flush=True)
    assert worst is not None
    return bench.emit({"cases": a.cases, "seed": a.seed, "switch": a.switch,
                       "blind": a.blind, "max_cells": a.max_cells, "tolerance": a.tolerance,
                       "worst_elastic_over_best_fixed": round(worst[0], 4), "worst_case": worst[1],
                       "worst_case_is": worst[2], "losses": losses, "cpu_s": round(time.process_time() - cpu0, 1)},
                      sizes=dict(cases=a.cases, seed=a.seed, switch=a.switch, blind=a.blind, max_cells=a.max_cells))


if __name__ == "__main__":
    main()
