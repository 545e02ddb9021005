"""Elastic is never worse than the best baseline by more than 2%.

The baselines at their strongest: colocate, and async at its best fixed split in
hindsight (every split simulated). Workloads are drawn at random (hypothesis): one model
call or forty, no tools or 30-second ones, training from 5% to 70% of the work, batches
of one wave of slots or several, on the issue's 16-cell cluster with the presets'
staleness bound of 2. The one-wave uniform-short workload that elastic used to lose
(1.76x slower than colocate) is pinned as its own test.

Where the claim does not hold (stated, not hidden): clusters of a few cells, where the
core cell (pinned to training) is a large share of serving capacity, and runs of a
handful of steps with very heavy tails, where the best of 15 splits picked in hindsight
is partly luck. tools/bench_scheduler.py reports the ratio on the presets.

Pinned too: training-heavy work on one-accelerator cells, found by the slow random test
on Dec 2. Elastic took the split minimizing the step model (11 of 16 training: serving-
bound), admission stayed pinned to it and the training cells idled ~7% of each step
(0.97 / 0.95 / 0.93 of colocate at 6 / 12 / 24 steps); it now takes the training-bound
split beside it (10), whose serving slack is lent to training (1.02 at each length).

Issue 46: where a role switch costs more than a step, elastic is held to the best fixed split with
streaming included (async_stream at its best split in hindsight): the issue's 8-cell 600 s / 300 s
case, a split the step model missed that the simulator's pilot finds, and (slow) the first cases of
tools/search_scheduler.py, the random hunt for such losses.
"""
import json
import math
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre_jax.scheduler import baselines, policy, presets
from gyre_jax.scheduler.policy import PolicyConfig
from gyre_jax.scheduler.simulator import simulate
from gyre_jax.scheduler.workloads import (
    ClusterConfig,
    SimConfig,
    WorkloadConfig,
    batch_filling_cluster,
    mean_call_s,
    rollouts_for,
)

FLOOR = 0.98
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def elastic_vs_best_baseline(cfg: SimConfig) -> tuple[float, dict]:
    ro = rollouts_for(cfg)
    sweep = baselines.async_sweep(cfg, ro, per_step=False)
    co = baselines.colocate(cfg, ro)
    el = simulate(cfg.replace(**{"policy.mode": "elastic"}), rollouts=ro, record_decisions=False)
    best = min(co.makespan_s, sweep.best.makespan_s)
    info = dict(colocate=co.makespan_s, async_best=sweep.best.makespan_s, split=sweep.best_split,
                elastic=el.makespan_s, switches=el.switches)
    return best / el.makespan_s, info


@st.composite
def workloads(draw, max_steps=8):
    slots = draw(st.sampled_from([4, 8, 16]))
    calls = draw(st.sampled_from([1, 3, 8, 20]))
    w = dict(name="random", calls_median=float(calls), calls_shape=draw(st.floats(0.01, 0.8)), calls_max=calls * 6,
             decode_tokens_median=draw(st.floats(50, 800)), decode_tokens_sigma=draw(st.floats(0, 0.6)),
             context_tokens_median=draw(st.floats(100, 2000)), context_tokens_sigma=draw(st.floats(0, 0.6)),
             decode_tok_s=draw(st.floats(20, 50)), prefill_tok_s=draw(st.floats(1000, 20000)),
             tool_s_median=draw(st.sampled_from([0.0, 2.0, 10.0, 30.0])), tool_s_sigma=draw(st.floats(0, 1.0)),
             optimizer_s=draw(st.floats(0, 20)), train_tokens_per_s_per_cell=1.0)
    # training throughput set so that training is `share` of the work
    share = draw(st.floats(0.05, 0.7))
    serve_per_call = mean_call_s(WorkloadConfig(**w)) / slots
    w["train_tokens_per_s_per_cell"] = (w["decode_tokens_median"] + w["context_tokens_median"]) / (
        serve_per_call * share / (1 - share))
    wl = WorkloadConfig(**w)
    cl = ClusterConfig(accelerators=16, cell_size=1, slots_per_cell=slots, publish_s=draw(st.floats(1, 30)))
    gs = draw(st.sampled_from([4, 8]))
    G = batch_filling_cluster(cl, wl, gs) * draw(st.sampled_from([1, 2]))
    pol = PolicyConfig(mode="elastic", total_steps=draw(st.integers(6, max_steps)), groups_per_step=G, group_size=gs,
                       staleness_bound=2)
    return SimConfig(cluster=cl, workload=wl, policy=pol, seed=draw(st.integers(0, 999)))


def one_wave_uniform_short(steps: int = 20) -> SimConfig:
    """The issue's case: 256 accelerators in 16 cells, one 13 s call per rollout, one wave of slots."""
    prefill_s = 300 / 20000
    wl = presets._wl_122b("one_wave_13s", calls_median=1, calls_shape=0.01, calls_max=1,
                          decode_tokens_median=(13 - prefill_s) * 45, decode_tokens_sigma=0.0,
                          context_tokens_median=300, context_tokens_sigma=0.0, tool_s_median=0, tool_s_sigma=0,
                          rollout_timeout_s=math.inf)
    return presets._make(presets._CELL_122B, wl, "elastic", steps, group_size=16, waves=1)


def test_one_wave_uniform_short_is_no_longer_lost():
    ratio, info = elastic_vs_best_baseline(one_wave_uniform_short())
    assert ratio >= FLOOR, info
    assert info["elastic"] < info["colocate"]  # was 1.76x slower than colocate


def test_switches_costlier_than_a_step_degrade_to_the_best_fixed_split():
    # Issue 26: 600 s / 300 s switches, 13 s steps. Elastic switched 26 times and took 5.4x
    # as long as async at its best split. A switch must pay for itself: none does here, and
    # elastic runs at the split its (pilot) priors give, streaming into its steps.
    cfg = one_wave_uniform_short(8).replace(**{"cluster.switch_to_train_s": 600.0,
                                               "cluster.switch_to_rollout_s": 300.0})
    ratio, info = elastic_vs_best_baseline(cfg)
    assert ratio >= FLOOR, info
    assert info["switches"] == 0, info


def test_costly_switches_with_measured_costs_only_never_pay_a_round_trip():
    # The RL loop without priors: elastic starts with the core alone and learns what a switch
    # costs from the first one still under way; no cell is sent back (it moved 26 times).
    cfg = one_wave_uniform_short(8).replace(**{"cluster.switch_to_train_s": 600.0,
                                               "cluster.switch_to_rollout_s": 300.0, "model_priors": False})
    el = simulate(cfg, record_decisions=True)
    back = [a for d in el.decisions for a in d.actions if isinstance(a, policy.ToRollout)]
    assert back == [] and el.switches < cfg.cluster.n_cells, el.switches


def elastic_over_best_fixed_split(cfg: SimConfig) -> tuple[float, dict]:
    """Elastic's time over the best fixed split's: async and async_stream (streaming included) at every split."""
    ro = rollouts_for(cfg)
    fixed = {f"{m}:{k}": r.makespan_s for m in ("async", "async_stream")
             for k, r in baselines.async_sweep(cfg, ro, per_step=False, mode=m).by_split.items()}
    el = simulate(cfg.replace(**{"policy.mode": "elastic"}), rollouts=ro, record_decisions=False)
    best = min(fixed, key=fixed.__getitem__)
    return el.makespan_s / fixed[best], dict(elastic=el.makespan_s, best=best, best_s=fixed[best], switches=el.switches)


def test_issue_46_eight_cells_switches_of_600_and_300_s():
    # Issue 46: 8 cells, the one-wave short workload (~25 s steps), 8 steps, 600 s to train and 300 s
    # back. With the pilot's costs elastic runs as the best fixed split (no switch pays in ~190 s).
    cfg = presets.short_one_wave("elastic", steps=8, accelerators=128).replace(
        **{"cluster.switch_to_train_s": 600.0, "cluster.switch_to_rollout_s": 300.0})
    ratio, info = elastic_over_best_fixed_split(cfg)
    assert ratio <= 1.02 and info["switches"] == 0, info
    # Blind (the RL loop's first run) it cannot know the split before the first step nor a switch's
    # cost before one arrives: it bets one cell on a switch of unknown cost, not four (331 s either
    # way, the split it starts at: docs/design.md says why no blind policy can promise 1.02 here).
    blind = simulate(cfg.replace(model_priors=False), record_decisions=False)
    assert blind.switches <= 1, blind.switches


def test_blind_cheap_switch_to_training_dear_way_back_stays_within_2pct_of_the_best_fixed_split():
    # Issue 46, blind (no priors: the RL loop's first run): 8 cells, the uniform short workload at 4 waves,
    # 8 steps, switches of 30 s to train and 1,200 s back (a step is ~150 s). Having timed a 30 s switch to
    # training, elastic lent every satellite to the step's tail as if the way back were as cheap, and
    # brought each back in 1,200 s: 2.16x the best fixed split. An unmeasured way back is priced as a move
    # for the rest of the run. The best fixed split (async_stream on 2 training cells; every split of both
    # async modes simulated when this was written) and the split elastic starts at (1) run beside it.
    cfg = presets.short_uniform("elastic", steps=8, accelerators=128, waves=4).replace(
        **{"cluster.switch_to_train_s": 30.0, "cluster.switch_to_rollout_s": 1200.0, "model_priors": False})
    ro = rollouts_for(cfg)
    blind = simulate(cfg, rollouts=ro, record_decisions=False)
    fixed = {k: simulate(cfg.replace(**{"policy.mode": "async_stream", "policy.async_train_cells": k}), rollouts=ro,
                         record_decisions=False).makespan_s for k in (1, 2)}
    assert blind.makespan_s <= 1.02 * min(fixed.values()), (blind.makespan_s, blind.switches, fixed)


def test_a_pilot_finds_the_split_the_step_model_misses():
    # Found by tools/search_scheduler.py: 10 cells of 2 slots, groups of 8, 3 calls per rollout, switches
    # of 389 s / 4,001 s (a step is ~115 s). The step model's split (5 training) ran 1.25x the best fixed
    # one (4): groups are admitted whole, and 10 slots hold one group of 8 where 12 start a second one
    # sooner. The pilot runs its first step's rollouts at the model's split and its neighbours.
    wl = WorkloadConfig(name="search", calls_median=3.0, calls_shape=0.5764, calls_max=18, decode_tokens_median=90.85,
                        decode_tokens_sigma=0.4678, context_tokens_median=1955.2, context_tokens_sigma=0.583,
                        decode_tok_s=31.56, prefill_tok_s=3240.8, tool_s_median=0.0, tool_s_sigma=0.0,
                        train_tokens_per_s_per_cell=1469.86, optimizer_s=15.68)
    cl = ClusterConfig(accelerators=10, cell_size=1, slots_per_cell=2, switch_to_train_s=389.4,
                       switch_to_rollout_s=4000.7, publish_s=9.31)
    pol = PolicyConfig(mode="elastic", total_steps=5, groups_per_step=8, group_size=8, staleness_bound=2)
    ratio, info = elastic_over_best_fixed_split(SimConfig(cluster=cl, workload=wl, policy=pol, seed=369))
    assert ratio <= 1.02, info


@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=workloads(max_steps=6))
def test_elastic_within_2pct_of_the_best_baseline(cfg):
    ratio, info = elastic_vs_best_baseline(cfg)
    assert ratio >= FLOOR, info


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=workloads())
def test_elastic_within_2pct_of_the_best_baseline_many(cfg):
    ratio, info = elastic_vs_best_baseline(cfg)
    assert ratio >= FLOOR, info


def training_heavy_one_accelerator_cells(steps: int = 12) -> SimConfig:
    """The slow random test's counterexample: 16 cells of 1 accelerator, 4 slots, 20 calls of
    15 s per rollout, no tools, training ~2x the serving cell-seconds."""
    wl = WorkloadConfig(name="random", calls_dist="lognormal", calls_median=20.0, calls_shape=0.1121605270261317,
                        calls_max=120, decode_tokens_median=300.0, decode_tokens_sigma=0.0, context_tokens_median=100.0,
                        context_tokens_sigma=0.0, decode_tok_s=20.0, prefill_tok_s=1000.0, tool_s_median=0.0,
                        tool_s_sigma=0.0, rollout_timeout_s=math.inf, train_tokens_per_s_per_cell=52.27568705891288,
                        optimizer_s=0.0)
    cl = ClusterConfig(accelerators=16, cell_size=1, slots_per_cell=4, switch_to_train_s=8.5, switch_to_rollout_s=3.5,
                       kv_move_s=0.5, publish_s=1.0)
    pol = PolicyConfig(mode="elastic", total_steps=steps, groups_per_step=32, group_size=4, staleness_bound=2)
    return SimConfig(cluster=cl, workload=wl, policy=pol, seed=0)


def test_training_heavy_one_accelerator_cells():  # was 0.945 of colocate: the serving-bound split idled training
    ratio, info = elastic_vs_best_baseline(training_heavy_one_accelerator_cells())
    assert ratio >= FLOOR, info


@pytest.mark.slow
def test_the_loss_search_finds_none_on_its_first_cases():
    """tools/search_scheduler.py (issue 46's hunt: random clusters, workloads and switches that cost 1-20
    steps) on its first cases of seed 0: elastic within 2% of the best fixed split on each."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "search_scheduler.py"), "--cases", "6",
                          "--max-cells", "8"], capture_output=True, text=True, check=True, timeout=1800)
    final = json.loads(out.stdout.strip().splitlines()[-1])
    assert final["losses"] == [] and final["worst_elastic_over_best_fixed"] <= 1.02, out.stdout
