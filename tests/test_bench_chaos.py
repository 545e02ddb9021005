"""tools/bench_chaos.py --quick: two random stops of the real demo, a rerun to the end, and the audit says clean."""
import json
import os
import subprocess
import sys

import pytest

from tests.test_tools import assert_header

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # ~3-5 min on 2 cores: three attempts of the demo, each with its imports and set-up
def test_quick_chaos_run_loses_nothing_and_resumes(tmp_path):
    # --keep: on a failure, each attempt's log stays in tmp_path (trial0.<attempt>.log) next to the table.
    p = subprocess.run([sys.executable, "tools/bench_chaos.py", "--quick", "--seed", "3", "--keep", "--root", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert_header(out, "bench_chaos")
    bad = {k: out[k] for k in ("rollouts_lost", "rollouts_trained_twice", "groups_short", "wrong_state", "duplicate_steps",
                               "steps_short", "unresumable_workdirs", "infra_errors", "failed_attempts", "hangs") if out[k]}
    if bad or out["kills"] + out["failed_attempts"] < 1:
        pytest.fail(f"{bad}, kills {out['kills']}; logs in {tmp_path}\n{p.stdout}")
    assert out["finished_rollouts"] >= out["steps"] * out["groups_per_step"] * out["group_size"], p.stdout
    assert out["params_hash_differ"] == 0, p.stdout  # every replayed version is the lost run's
