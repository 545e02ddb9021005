"""The 'simulate' job: run a preset in several modes, write a report and timelines.

``python -m launch.main --config configs/sim_paper.py --workdir /tmp/sim`` writes
``report.json``, ``report.txt``, ``timelines.png`` (all modes on one time axis) and
``timeline_<mode>.png`` (one mode with agents/calls/queue below) to the workdir.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os

from gyre_jax.scheduler import presets
from gyre_jax.scheduler.modes import mode_names
from gyre_jax.scheduler.simulator import SimResult, simulate
from gyre_jax.scheduler.vocab import ASYNC, ASYNC_STREAM, COLOCATE, ELASTIC, ELASTIC_NO_STREAM

log = logging.getLogger(__name__)

_KEYS = ("preset", "modes", "steps", "seed", "accelerators", "async_train_cells", "staleness_bound",
         "call_merge", "plot", "job")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimJobConfig:
    preset: str
    modes: tuple[str, ...]
    steps: int = 0  # 0: the preset's
    seed: int = 0
    accelerators: int = 0  # 0: the preset's
    async_train_cells: int = 0  # 0: balanced split
    staleness_bound: int = -1  # -1: the preset's
    call_merge: int = 0  # 0: the preset's
    plot: bool = True

    def __post_init__(self):
        if self.preset not in presets.PRESETS:
            raise ValueError(f"config.preset={self.preset!r}; known: {sorted(presets.PRESETS)}")
        bad = [m for m in self.modes if m not in mode_names()]
        if bad or not self.modes:
            raise ValueError(f"config.modes={','.join(self.modes)!r}: unknown {bad}; known: {mode_names()}")

    @classmethod
    def from_config(cls, config) -> "SimJobConfig":
        unknown = sorted(set(config.keys()) - set(_KEYS))
        if unknown:
            raise ValueError(f"simulate config: unknown fields {unknown}; known: {sorted(_KEYS)}")
        kw = {k: config[k] for k in _KEYS if k in config and k != "job"}
        if "modes" in kw:
            kw["modes"] = tuple(m.strip() for m in str(kw["modes"]).split(",") if m.strip())
        return cls(**kw)

    def sim_config(self, mode: str):
        kw = {}
        if self.steps:
            kw["steps"] = self.steps
        if self.accelerators:
            kw["accelerators"] = self.accelerators
        if self.call_merge:
            kw["call_merge"] = self.call_merge
        cfg = presets.get(self.preset, mode, **kw)
        over = {"seed": self.seed, "policy.async_train_cells": self.async_train_cells}
        if self.staleness_bound >= 0:
            over["policy.staleness_bound"] = self.staleness_bound
        return cfg.replace(**over)


def ratios(results: dict[str, SimResult]) -> dict[str, float]:
    """Speedups (baseline makespan / elastic makespan) for whatever modes ran."""
    m = {k: r.makespan_s for k, r in results.items()}
    out = {}
    if ELASTIC in m:
        for base in (ASYNC, COLOCATE, ASYNC_STREAM, ELASTIC_NO_STREAM):
            if base in m:
                out[f"elastic_vs_{base}"] = m[base] / m[ELASTIC]
        out["elastic_over_lower_bound"] = m[ELASTIC] / results[ELASTIC].lower_bound_s
        out["mean_staleness"] = results[ELASTIC].staleness_mean
    if ASYNC in m and ASYNC_STREAM in m:
        out["streaming_only_vs_async"] = m[ASYNC] / m[ASYNC_STREAM]
        out["streaming_only_time_cut"] = 1 - m[ASYNC_STREAM] / m[ASYNC]
    return out


def table(results: dict[str, SimResult]) -> str:
    hdr = (f"{'mode':18s} {'makespan_h':>10s} {'x_LB':>6s} {'stale_mean':>10s} {'stale_max':>9s} {'switches':>8s} "
           f"{'rollout%':>8s} {'train%':>7s} {'switch%':>7s} {'busy%':>6s} {'trunc':>6s} {'wall_s':>7s}")
    lines = [hdr, "-" * len(hdr)]
    for mode, r in results.items():
        s = r.summary()
        extra = f" (train cells {r.config.policy.async_train_cells})" if r.config.policy.strategy.fixed_split else ""
        lines.append(
            f"{mode:18s} {s['makespan_h']:10.2f} {s['over_lower_bound']:6.3f} {s['staleness_mean']:10.2f} "
            f"{s['staleness_max']:9d} {s['switches']:8d} {100 * s['util_rollout_role']:8.1f} "
            f"{100 * s['util_train_role']:7.1f} {100 * s['util_switching']:7.2f} {100 * s['util_busy']:6.1f} "
            f"{s['truncated_rollouts']:6d} {s['wall_s']:7.1f}{extra}")
    return "\n".join(lines)


def describe(cfg) -> str:
    c, p, w = cfg.cluster, cfg.policy, cfg.workload
    return (f"{w.name}: {c.accelerators} accelerators = {c.n_cells} cells x {c.cell_size}, {c.slots_per_cell} slots/cell; "
            f"{p.total_steps} steps x {p.groups_per_step} groups x {p.group_size} rollouts; staleness bound "
            f"{p.staleness_bound}; serve_reserve {p.serve_reserve:.2f}; call_merge {cfg.call_merge}")


def run(config, workdir: str) -> dict:
    job = SimJobConfig.from_config(config)
    os.makedirs(workdir, exist_ok=True)
    results: dict[str, SimResult] = {}
    for mode in job.modes:
        cfg = job.sim_config(mode)
        log.info("simulating %s / %s: %s", job.preset, mode, describe(cfg))
        print(f"simulating {job.preset} / {mode} ...", flush=True)
        results[mode] = simulate(cfg, progress=True, record_decisions=False)
    first = next(iter(results.values())).config
    text = f"{describe(first)}\n\n{table(results)}\n"
    rat = ratios(results)
    if rat:
        text += "\n" + "\n".join(f"{k:28s} {v:.3f}" for k, v in rat.items()) + "\n"
    report = {
        "preset": job.preset,
        "setup": describe(first),
        "modes": {m: {**r.summary(), "lower_bound_kind": r.lower_bound_kind,
                      "async_train_cells": r.config.policy.async_train_cells,
                      "step_end_h": [t / 3600 for t in r.step_end_s]} for m, r in results.items()},
        **rat,
    }
    with open(os.path.join(workdir, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(workdir, "report.txt"), "w") as f:
        f.write(text)
    if job.plot:
        from gyre_jax.scheduler import plot

        plot.plot_timelines(list(results.values()), os.path.join(workdir, "timelines.png"),
                            title=f"{job.preset}: {describe(first)}")
        for mode, r in results.items():
            plot.plot_timeline(r, os.path.join(workdir, f"timeline_{mode}.png"), title=f"{job.preset} / {mode}")
    print(text, flush=True)
    return report
