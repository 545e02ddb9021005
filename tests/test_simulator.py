"""The discrete-event simulator: determinism, staleness bound, nothing dropped, outputs."""
import dataclasses
import math

import numpy as np
import pytest

from gyre_jax.scheduler import policy as P
from gyre_jax.scheduler import presets, simulator, workloads
from gyre_jax.testing.fake_cluster import tiny_sim_config


@pytest.fixture(scope="module")
def runs():
    return {m: simulator.simulate(tiny_sim_config(m)) for m in P.MODES}


def test_small_simulation_is_deterministic_for_a_seed(runs):
    again = simulator.simulate(tiny_sim_config("elastic"))
    first = runs["elastic"]
    assert again.makespan_s == first.makespan_s
    assert again.decisions == first.decisions
    assert again.segments == first.segments
    other = simulator.simulate(tiny_sim_config("elastic", seed=7))
    assert other.makespan_s != first.makespan_s


@pytest.mark.parametrize("mode", P.MODES)
def test_staleness_bounded_and_no_rollout_discarded(runs, mode):
    r = runs[mode]
    p = r.config.policy
    assert r.staleness_max <= p.effective_staleness
    # every rollout of every step trained exactly once, the deadline-cut ones included
    assert r.rollouts_trained == p.total_steps * p.groups_per_step * p.group_size
    assert r.truncated_rollouts > 0
    assert len(r.step_end_s) == p.total_steps and list(r.step_end_s) == sorted(r.step_end_s)
    assert r.makespan_s >= r.lower_bound_s


def test_staleness_bound_holds_under_a_very_heavy_tail():
    # Pareto alpha 1.1, no deadline: stragglers far beyond the bound's reach
    for mode, bound in (("elastic", 1), ("async_stream", 2), ("elastic_no_stream", 0)):
        cfg = tiny_sim_config(mode, **{"workload.calls_dist": "pareto", "workload.calls_shape": 1.1,
                                       "workload.calls_max": 400, "workload.rollout_timeout_s": math.inf,
                                       "policy.staleness_bound": bound, "policy.total_steps": 8})
        r = simulator.simulate(cfg)
        assert r.staleness_max <= bound, mode
        assert r.rollouts_trained == 8 * 4 * 2
        assert r.truncated_rollouts == 0


def test_colocate_is_on_policy_and_elastic_moves_cells(runs):
    assert runs["colocate"].staleness_max == 0
    assert runs["async"].switches == 0 and runs["async_stream"].switches == 0
    e = runs["elastic"]
    assert e.switches > 0 and e.moved_calls > 0  # drains moved in-flight calls, none lost
    # in this config elastic beats both baselines
    assert e.makespan_s < runs["async"].makespan_s and e.makespan_s < runs["colocate"].makespan_s


def test_time_accounting_adds_up(runs):
    for r in runs.values():
        assert sum(r.state_time_s.values()) == pytest.approx(r.n_cells * r.makespan_s, rel=1e-9)
        per_cell = np.zeros(r.n_cells)
        for c, t0, t1, _ in r.segments:
            assert t1 >= t0
            per_cell[c] += t1 - t0
        np.testing.assert_allclose(per_cell, r.makespan_s, rtol=1e-9)
        u = r.utilization()
        assert 0 < u["busy"] <= 1 + 1e-9


def test_call_merge_keeps_each_rollouts_totals():
    w = tiny_sim_config().workload
    a = workloads.sample_rollouts(w, 40, 3)
    b = workloads.sample_rollouts(w, 40, 3, merge=3)
    for r in range(40):
        x, y = slice(a.offsets[r], a.offsets[r + 1]), slice(b.offsets[r], b.offsets[r + 1])
        assert math.isclose(sum(a.call_s[x]), sum(b.call_s[y]), rel_tol=1e-12)
        assert math.isclose(sum(a.tool_s[x]), sum(b.tool_s[y]), rel_tol=1e-12)
        assert math.isclose(sum(a.tokens[x]), sum(b.tokens[y]), rel_tol=1e-12)
        assert b.offsets[r + 1] - b.offsets[r] == -(-(a.offsets[r + 1] - a.offsets[r]) // 3)


def test_presets_build_and_validate():
    for name in presets.PRESETS:
        cfg = presets.get(name, "elastic")
        assert cfg.policy.groups_per_step >= 1 and cfg.cluster.n_cells >= 2
    with pytest.raises(LookupError, match="known"):
        presets.get("nl2repo_typo")
    with pytest.raises(ValueError, match="cell_size"):
        workloads.ClusterConfig(accelerators=100, cell_size=64, slots_per_cell=4)
    with pytest.raises(ValueError, match="calls_dist"):
        tiny_sim_config(**{"workload.calls_dist": "zipf"})


def test_cli_writes_report_table_and_timelines(tmp_path):
    import json

    from ml_collections import config_dict

    from gyre_jax.scheduler import cli

    c = config_dict.ConfigDict(dict(job="simulate", preset="deepswe", modes="colocate,elastic", steps=1,
                                    accelerators=48, seed=0))
    report = cli.run(c, str(tmp_path))
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["elastic_vs_colocate"] == pytest.approx(report["elastic_vs_colocate"])
    assert set(on_disk["modes"]) == {"colocate", "elastic"}
    assert "elastic_over_lower_bound" in (tmp_path / "report.txt").read_text()
    for png in ("timelines.png", "timeline_colocate.png", "timeline_elastic.png"):
        assert (tmp_path / png).stat().st_size > 10_000
    with pytest.raises(ValueError, match="unknown fields"):
        cli.run(config_dict.ConfigDict(dict(job="simulate", preset="deepswe", modez="elastic")), str(tmp_path))


def test_lower_bound_critical_path_matches_a_per_rollout_loop():
    from gyre_jax.scheduler.results import lower_bound

    cfg = tiny_sim_config(**{"workload.rollout_timeout_s": 1e9})
    ro = workloads.rollouts_for(cfg)
    longest = max(sum(ro.call_s[a:b]) + sum(ro.tool_s[a:b - 1]) for a, b in zip(ro.offsets, ro.offsets[1:]))
    lb, kind = lower_bound(cfg, ro, 0.0, 0.0)
    assert kind == "critical_path" and lb == pytest.approx(longest + cfg.workload.optimizer_s, rel=1e-12)
    lb, kind = lower_bound(cfg, ro, serving_slot_s=8 * 2 * 1e4, train_work_s=0.0)  # 8 cells x 2 slots busy 1e4 s
    assert kind == "work" and lb == pytest.approx(1e4 + 6 * 2.0 / 8)


def test_drift_scales_tokens_per_call_and_calls_per_rollout_with_launch_order():
    w = tiny_sim_config().workload
    n = 2000
    base = workloads.sample_rollouts(w, n, 5)
    grown = workloads.sample_rollouts(dataclasses.replace(w, drift_tokens=2.0), n, 5)
    # same draws, each call's tokens times its rollout's factor 1 + r / (n - 1)
    assert grown.offsets == base.offsets
    owner = np.repeat(np.arange(n), np.diff(base.offsets))
    np.testing.assert_allclose(grown.tokens, np.asarray(base.tokens) * (1 + owner / (n - 1)), rtol=1e-12)
    np.testing.assert_allclose(grown.call_s, np.asarray(base.call_s) * (1 + owner / (n - 1)), rtol=1e-12)
    calls = np.diff(workloads.sample_rollouts(dataclasses.replace(w, drift_calls=3.0, calls_shape=0.3), n, 5).offsets)
    flat = np.diff(workloads.sample_rollouts(dataclasses.replace(w, calls_shape=0.3), n, 5).offsets)
    # the last fifth (mean factor 2.8) against the first (1.2): ~2.33x as many calls
    ratio = calls[-n // 5:].mean() / calls[: n // 5].mean()
    assert 2.1 < ratio < 2.6 and 0.9 < flat[-n // 5:].mean() / flat[: n // 5].mean() < 1.1
    with pytest.raises(ValueError, match="drift_calls"):
        dataclasses.replace(w, drift_calls=0.0)
