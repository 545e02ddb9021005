"""tools/bench_learning.py: its arithmetic on known curves, and a real smoke run (--quick)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from tests.test_tools import assert_header  # noqa: E402

import bench_learning  # noqa: E402


def _run(curve, rl_s, branching=0.5, dedup=2.0):
    return {"curve": curve, "summary": {"rl_s": rl_s, "trees": {"branching_rollout_fraction": branching,
                                                                  "dedup_factor_real": dedup}}}


def test_gains_spread_and_time_to_target_from_known_curves():
    # warm start 0.4 in every mode; final 0.7 (elastic), 0.65 (colocate): target = 0.4 + 0.9 * 0.25 = 0.625
    runs = {(0, "elastic"): _run([(0, 0.0, 0.4), (5, 50.0, 0.63), (10, 100.0, 0.7)], 100.0),
            (0, "colocate"): _run([(0, 0.0, 0.4), (5, 80.0, 0.5), (10, 160.0, 0.65)], 160.0)}
    out = bench_learning.analyse(runs, [0], ["elastic", "colocate"])
    assert out["eval_warm_start"] == pytest.approx(0.4)
    assert out["eval_gain_elastic"] == pytest.approx(0.3) and out["eval_gain_colocate"] == pytest.approx(0.25)
    assert out["final_eval_spread"] == pytest.approx(0.05)
    assert out["time_to_target_s_elastic"] == 50.0 and out["time_to_target_s_colocate"] == 160.0
    assert out["time_to_target_colocate_over_elastic"] == pytest.approx(3.2)
    assert out["branching_rollout_fraction"] == 0.5 and out["dedup_factor_real"] == 2.0
    # a mode whose gain is negative sets a target below the warm start: reached at once
    runs[0, "colocate"] = _run([(0, 0.0, 0.4), (10, 160.0, 0.3)], 160.0)
    out = bench_learning.analyse(runs, [0], ["elastic", "colocate"])
    assert out["time_to_target_s_elastic"] == 0.0


def test_the_final_spread_is_judged_against_the_evals_own_noise():
    # Same warm-start params: v0 evals 0.40 and 0.46 (the eval's run-to-run spread 0.06). Finals 0.70, 0.66
    # from two tasks x 2 samples each: within-task variances 0.02 (0.6, 0.8) and 0.08 (0.5, 0.9).
    eps = {"a": [0.6, 0.8], "b": [0.5, 0.9]}
    se = bench_learning.eval_se(eps)
    assert se == pytest.approx((2 * 0.02 + 2 * 0.08) ** 0.5 / 4)  # the sum over tasks, by hand
    runs = {(0, "elastic"): {**_run([(0, 0.0, 0.40), (4, 40.0, 0.70)], 40.0), "episodes": {4: eps}},
            (0, "async"): {**_run([(0, 0.0, 0.46), (4, 50.0, 0.66)], 50.0), "episodes": {4: eps}}}
    out = bench_learning.analyse(runs, [0], ["elastic", "async"])
    assert out["warm_eval_spread"] == pytest.approx(0.06) and out["final_eval_se"] == pytest.approx(se)
    assert out["eval_noise"] == pytest.approx(max(0.06, 1.96 * 2 ** 0.5 * se))
    assert out["final_spread_within_noise"] is True  # 0.04 apart
    runs[0, "async"]["curve"][-1] = (4, 50.0, 0.30)  # 0.40 apart: more than the noise explains
    assert bench_learning.analyse(runs, [0], ["elastic", "async"])["final_spread_within_noise"] is False
    # a task with one scored episode has no within-task variance to estimate: no SE (not a zero)
    assert bench_learning.eval_se({"a": [1.0], "b": [0.5, 0.7]}) is None


def test_read_run_dates_each_eval_by_the_step_that_published_its_version(tmp_path):
    d = tmp_path / "elastic"
    (d / "eval").mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "version": s + 1, "time_s": 10.0 * (s + 1)}) + "\n"
                                             for s in range(4)))
    (d / "eval" / "eval.jsonl").write_text("".join(json.dumps({"step": v, "eval/reward": v / 10}) + "\n"
                                                   for v in (0, 2, 4)))
    (d / "summary.json").write_text(json.dumps({"rl_s": 40.0}))
    (d / "eval" / "v000002").mkdir()
    (d / "eval" / "v000002" / "episodes.jsonl").write_text("".join(
        json.dumps({"rollout_id": r, "task_id": t, "score": x}) + "\n"
        for r, t, x in (("e0-0", "a", 1.0), ("e0-1", "a", None), ("e1-0", "b", 0.5))))
    run = bench_learning.read_run(str(d))
    assert run["curve"] == [(0, 0.0, 0.0), (2, 20.0, 0.2), (4, 40.0, 0.4)]
    assert run["episodes"] == {2: {"a": [1.0], "b": [0.5]}}  # unscored episodes are not zeros


@pytest.mark.slow  # ~80 s on 2 idle cores (a whole launch, warm start and eval); the arithmetic above runs by default
def test_quick_smoke_run_writes_the_plot_and_the_json_line(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_learning.py"), "--quick", "--modes",
                        "elastic", "--workdir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert_header(out, "bench_learning")
    assert out["quick"] is True and out["modes"] == ["elastic"]
    assert 0.0 <= out["eval_final_elastic"] <= 1.0 and out["eval_warm_start"] is not None
    assert out["trained_rollouts"] == 2 * 2 * 4  # steps x groups x group size of --quick
    assert os.path.getsize(tmp_path / "learning.png") > 10_000
