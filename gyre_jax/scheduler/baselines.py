"""The baselines elastic is judged against, each at its strongest honest setting.

The async baseline fixes how many cells train. Which split a practitioner gets
decides the ratio, so it is reported three ways:

* ``first_step``: the split balanced on the first step's rollouts (what one measures
  before committing a run; under drift it goes stale);
* ``best_fixed``: every split simulated, the fastest kept (hindsight: no practitioner
  has it, so it is the strongest fixed async);
* ``per_step``: an oracle that re-balances the split at every step on that step's own
  rollouts (it knows them in advance; switches are paid as in elastic).

Colocate has no split. ``best_baseline`` is the faster of colocate and best-fixed async.
"""
from __future__ import annotations

import dataclasses

from gyre_jax.scheduler.results import SimResult
from gyre_jax.scheduler.simulator import simulate
from gyre_jax.scheduler.vocab import ASYNC, COLOCATE
from gyre_jax.scheduler.workloads import Rollouts, SimConfig, rollouts_for


def balanced_split(config: SimConfig, rollouts: Rollouts, first: int = 0, stop: int | None = None) -> int:
    """Training cells by the training share of rollouts [first, stop) (serving = slot-seconds / slots)."""
    a, b = rollouts.offsets[first], rollouts.offsets[stop if stop is not None else rollouts.n]
    serve = sum(rollouts.call_s[a:b]) / config.cluster.slots_per_cell
    train = sum(rollouts.tokens[a:b]) / config.workload.train_tokens_per_s_per_cell
    n = config.cluster.n_cells
    return int(min(n - 1, max(1, round(n * train / (serve + train)))))


@dataclasses.dataclass(frozen=True)
class AsyncSweep:
    by_split: dict[int, SimResult]  # training cells -> result
    first_step_split: int
    first_step: SimResult
    per_step: SimResult | None

    @property
    def best_split(self) -> int:
        return min(self.by_split, key=lambda k: (self.by_split[k].makespan_s, k))

    @property
    def best(self) -> SimResult:
        return self.by_split[self.best_split]


def async_sweep(config: SimConfig, rollouts: Rollouts | None = None, *, splits=None, per_step: bool = True,
                mode: str = ASYNC) -> AsyncSweep:
    """Simulate `mode` (async or async_stream) at every split in `splits` (default: all)."""
    rollouts = rollouts if rollouts is not None else rollouts_for(config)
    base = config.replace(**{"policy.mode": mode, "policy.async_split_by_step": ()})
    n = config.cluster.n_cells
    p = config.policy
    per = p.groups_per_step * p.group_size
    first = balanced_split(config, rollouts, 0, per)
    splits = sorted(set(range(1, n) if splits is None else splits) | {first})

    def run(k, sched=()):
        return simulate(base.replace(**{"policy.async_train_cells": k, "policy.async_split_by_step": sched}),
                        rollouts=rollouts, record_decisions=False)

    by = {k: run(k) for k in splits}
    oracle = None
    if per_step:
        sched = tuple(balanced_split(config, rollouts, s * per, (s + 1) * per) for s in range(p.total_steps))
        oracle = run(sched[0], sched)
    return AsyncSweep(by_split=by, first_step_split=first, first_step=by[first], per_step=oracle)


def colocate(config: SimConfig, rollouts: Rollouts | None = None) -> SimResult:
    return simulate(config.replace(**{"policy.mode": COLOCATE}), rollouts=rollouts, record_decisions=False)
