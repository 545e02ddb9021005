"""The workdir audit (gyre_jax.rl.audit) counts each way a run can mistrain, from the store and metrics.jsonl."""
import json
import os

import numpy as np

from gyre_jax.rl.audit import audit_workdir, consumed_once_problems, store_view
from gyre_jax.trajectory.records import ModelCallRecord, RolloutOutcome
from gyre_jax.trajectory.store import TrajectoryStore


def _rollout(store, rid, version, status="completed", error=None):
    gid = rid.split("-")[0]
    store.append(ModelCallRecord(run_id="rl", rollout_id=rid, task_id="t-" + gid, group_id=gid, agent_id=0,
                                 parent_agent_id=None, role="main", call_index=0, prompt_ids=np.arange(1, 4, dtype=np.int32),
                                 output_ids=np.arange(5, 7, dtype=np.int32), output_logprobs=np.full(2, -0.5, np.float32),
                                 policy_version=version, t_start=1.0, t_end=2.0, finish_reason="stop"))
    store.append(RolloutOutcome(run_id="rl", rollout_id=rid, task_id="t-" + gid, group_id=gid, status=status,
                                score=None if status != "completed" else 0.5, policy_versions=(version,), t_end=2.0,
                                num_calls=1, details={"error": error} if error else {}))


def test_audit_counts_lost_twice_short_stale_and_infra_errors(tmp_path):
    wd = str(tmp_path)
    with TrajectoryStore(os.path.join(wd, "store"), run_id="rl") as st:
        for k in range(2):  # g00000: healthy, step 0
            _rollout(st, f"g00000-{k}", 0)
        st.mark_trained(["g00000-0", "g00000-1"], step=0)
        # g00001: slot 1 abandoned and never re-run (short), slot 0 trained twice (two attempts), step 1
        _rollout(st, "g00001-0", 1)
        _rollout(st, "g00001-0.r1", 1)
        _rollout(st, "g00001-1", 1, "infra_error", "abandoned: the run stopped")
        st.mark_trained(["g00001-0", "g00001-0.r1"], step=1)
        st.mark_dropped(["g00001-1"], step=1, reason="infra_error")
        # g00002: sampled by version 0, trained at step 3 (staleness 3, bound 1); one rollout lost;
        # an infra_error that is not an abandoned attempt (a failure that became data)
        _rollout(st, "g00002-0", 0)
        _rollout(st, "g00002-1", 0, "infra_error", "proxy answered 500")
        _rollout(st, "g00002-2", 0)
        st.mark_trained(["g00002-0"], step=3)
        st.mark_dropped(["g00002-1"], step=3, reason="infra_error")
    with open(os.path.join(wd, "metrics.jsonl"), "w") as f:
        for step, groups, extra in ((0, "g00000", 0), (1, "g00001,g00000", 1), (3, "g00002", 0)):  # g00000 twice
            f.write(json.dumps({"step": step, "groups": groups, "resume/extra_groups": extra}) + "\n")
    a = audit_workdir(wd, group_size=2, staleness_bound=1)
    assert (a["rollouts_lost"], a["groups_short"], a["staleness_max"], a["max_staleness_over_bound"]) == (1, 1, 3, 2)  # short: g00001
    assert a["over_bound_examples"] == [["g00002-0", 3, [0]]]  # which rollout, its step and sampling versions
    assert a["rollouts_trained_twice"] == 1 + 2  # g00001's slot 0, and g00000's two rollouts in a second step
    assert (a["infra_errors"], a["wrong_state"], a["duplicate_steps"], a["finished"]) == (1, 0, 0, 8)
    assert (a["oversized_steps"], a["extra_groups"]) == (1, 1)  # reported, not a fault (a resume past the bound)
    outs, consumed, unfinished = store_view(wd)
    assert consumed_once_problems(outs, consumed) == ["lost (finished, never consumed): g00002-2"]
