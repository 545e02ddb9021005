"""Agents people already have, trained through the proxy: mini-swe-agent as a command harness,
the example task set's own graders, the held-out episode eval's numbers, and the config's refusals.

mini-swe-agent (the `harnesses` extra) runs unmodified inside a real bubblewrap sandbox, talks
OpenAI through litellm to a live proxy over its unix socket, and is answered by a scripted fake
model that writes mini-swe-agent's own action format; its workspace is graded by the task's
command. Nothing leaves 127.0.0.1 (the sandbox has no network but the proxy's socket).
"""
import asyncio
import json
import os
import sys

import pytest

from gyre_jax.agents import sandbox as sb
from gyre_jax.agents.config import HarnessConfig
from gyre_jax.agents.harness import RolloutRequest, RolloutResult, run_rollouts
from gyre_jax.agents.harnesses import make_harness
from gyre_jax.agents.task_check import check_tasks
from gyre_jax.agents.tasks import dataset
from gyre_jax.rl.episode_eval import episode_metrics, pass_at_k
from gyre_jax.serving.proxy import Proxy, ProxyConfig
from gyre_jax.serving.router import Router
from gyre_jax.serving.server_thread import ServerThread
from gyre_jax.serving.tokenizer import ByteTokenizer
from gyre_jax.testing.fake_backend import FakeBackend
from gyre_jax.trajectory import tree
from gyre_jax.trajectory.store import TrajectoryStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
TASKS = os.path.join(EXAMPLES, "tasks", "tasks.jsonl")
_USABLE, _WHY = sb.bwrap_usable()
TOK = ByteTokenizer()
IM_END = TOK.special["<|im_end|>"]

# mini-swe-agent's text protocol: a thought and one fenced command; the second reply submits.
REPLIES = ("I will write it.\n```mswea_bash_command\necho hello > answer.txt\n```",
           "Done.\n```mswea_bash_command\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```")


def _script_for(req):
    text = TOK.decode([int(t) for t in req.prompt_ids])
    reply = REPLIES[min(text.count("<returncode>"), 1)]  # observations seen so far pick the turn
    ids = TOK.encode(reply) + [IM_END]
    n0 = len(req.prompt_ids)
    return lambda seq: ids[min(len(seq) - n0, len(ids) - 1)]


@pytest.mark.skipif(not _USABLE, reason=f"bubblewrap sandbox unavailable: {_WHY}")
@pytest.mark.skipif(not os.path.exists(os.path.join(os.path.dirname(sys.executable), "mini")), reason="mini-swe-agent not installed (pip install -e '.[harnesses]')")
def test_mini_swe_agent_episode_is_recorded_as_one_shared_prefix_path_and_graded(tmp_path):
    from configs import external

    store = TrajectoryStore(str(tmp_path / "store"), run_id="mswea")
    sock = str(tmp_path / "p.sock")

    async def build():
        return Proxy(Router([FakeBackend("A", script_for=_script_for, max_context=8192)]), TOK, store,
                     ProxyConfig(auth_token="run-secret-123", unix_path=sock, max_tokens_cap=256,
                                 clamp_max_tokens=True, model_aliases=("*",)))

    st = ServerThread(build)
    st.start()
    try:
        (task, _), = [x for x in dataset.load_task_file(TASKS) if x[0].task_id == "hello"]
        cfg = external.get_config()
        options = cfg.harness.kind_options.command
        h = make_harness("command", command=options.command, unix_socket=sock,
                         ro_paths=(os.path.join(EXAMPLES, "harnesses"),), env=dict(options.env))
        hc = HarnessConfig(base_url=st.url + "/v1", run_id="mswea", sandbox=sb.SandboxConfig(kind="bubblewrap"),
                           deadline_s=120.0, grader_timeout_s=60.0)
        r, = asyncio.run(run_rollouts([RolloutRequest(rollout_id="r0", task=task, group_id="g")], hc,
                                      workspace_root=str(tmp_path / "ws"), harness=h, keys=st.proxy))
        assert (r.status, r.score, r.exit_code) == ("completed", 1.0, 0), (r.error, r.output_tail[-2000:])
        calls = store.calls("r0")
        assert [c.call_index for c in calls] == [0, 1]
        assert TOK.decode(calls[0].output_ids.tolist()).startswith(REPLIES[0])
        # the second call's prompt is the first call's prompt + reply + the observation: one path
        # whose shared prefix the tree stores once
        n0 = len(calls[0].prompt_ids)
        assert (calls[1].prompt_ids[:n0] == calls[0].prompt_ids).all()
        rebuilt = tree.rebuild(calls)
        assert rebuilt.unique_tokens == len(calls[1].prompt_ids) + len(calls[1].output_ids)
        assert rebuilt.unique_tokens < rebuilt.recorded_tokens
    finally:
        st.stop()
        store.close()


@pytest.mark.slow
def test_example_task_set_passes_the_grader_check(tmp_path):
    """Every example task: its untouched workspace scores below 1, its metadata.solution scores 1, and
    nothing says its grader is broken (--check_tasks, through the real sandbox and grader path)."""
    tasks = dataset.load_task_file(TASKS)
    assert {s for _, s in tasks} == {"train", "eval"}
    hc = HarnessConfig(base_url="http://127.0.0.1:1/v1", sandbox=sb.SandboxConfig(kind="auto"))
    results = asyncio.run(check_tasks([t for t, _ in tasks], hc, tmp_path, concurrency=2))
    assert all(r.ok for r in results), "\n".join(r.line() for r in results)
    assert [(r.untouched, r.solution) for r in results] == [(0.0, 1.0)] * len(tasks)


def _result(rid, task, score, status="completed", subagents=0, compactions=0):
    return RolloutResult(rollout_id=rid, group_id=task, task_id=task, status=status, score=score, grader_details={},
                         calls=0, retries=0, compactions=compactions, subagents=subagents, tool_calls=0, tool_errors=0,
                         finish_reason=None, error=None, wall_time_s=0.0, agent_time_s=0.0, grader_time_s=0.0,
                         workspace="", t_end=0.0)


def test_the_eval_keeps_every_episode_score_in_order(tmp_path):
    from gyre_jax.rl.episode_eval import write_episodes

    results = [_result("e0001-0", "b", None, "timeout"), _result("e0000-1", "a", 0.5, subagents=1),
               _result("e0000-0", "a", 1.0)]
    write_episodes(str(tmp_path / "episodes.jsonl"), results, {"e0000-1": 3})
    rows = [json.loads(line) for line in open(tmp_path / "episodes.jsonl")]
    assert [(r["rollout_id"], r["task_id"], r["status"], r["score"], r["calls"], r["subagents"]) for r in rows] == [
        ("e0000-0", "a", "completed", 1.0, 0, 0), ("e0000-1", "a", "completed", 0.5, 3, 1),
        ("e0001-0", "b", "timeout", None, 0, 0)]


def test_episode_metrics_pass_at_k_counts_failures_apart():
    class T:
        def __init__(self, tid):
            self.task_id = tid

    tasks = [T("a"), T("b"), T("c")]
    results = [_result("a0", "a", 1.0, subagents=2, compactions=1), _result("a1", "a", 0.0), _result("a2", "a", 0.5),
               _result("b0", "b", 0.0), _result("b1", "b", 0.0), _result("b2", "b", None, "infra_error"),
               _result("c0", "c", None, "verifier_error"), _result("c1", "c", None, "infra_error"),
               _result("c2", "c", None, "timeout")]
    m = episode_metrics(results, tasks, k=3, pass_score=1.0, calls={"a0": 4, "a1": 2})
    # a: 1 of 3 passes; b: 0 of 2 scored; c: nothing scored (not a zero, left out)
    assert m["eval_reward"] == pytest.approx((1.0 + 0.0 + 0.5 + 0.0 + 0.0) / 5)
    assert m["eval_exact"] == pytest.approx((1 / 3 + 0.0) / 2)
    assert m["eval_pass_at_k"] == pytest.approx((1.0 + 0.0) / 2)  # a: k=3 of n=3 with c=1 -> 1
    assert (m["eval_failed"], m["eval_grader_errors"], m["eval_timeouts"]) == (4, 1, 1)
    assert m["eval_calls"] == pytest.approx(6 / 9)
    assert (m["eval_subagents"], m["eval_compactions"]) == (pytest.approx(2 / 9), pytest.approx(1 / 9))
    # the unbiased estimator against its definition, by enumeration of k-subsets
    import itertools

    for n, c, k in [(5, 2, 1), (5, 2, 2), (5, 2, 4), (4, 0, 2), (6, 6, 3)]:
        samples = [1] * c + [0] * (n - c)
        subsets = list(itertools.combinations(range(n), k))
        ref = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(ref, abs=1e-12)


def test_config_refuses_unknown_harness_and_unsandboxed_commands(monkeypatch, tmp_path):
    from configs import external
    from gyre_jax.rl.config import ConfigError, RLConfig

    def refused(match, **fields):
        c = external.get_config()
        for k, v in fields.items():
            section, name = k.split("__")
            c[section][name] = v
        with pytest.raises(ConfigError, match=match):
            RLConfig.from_config(c)

    refused(r"harness.*'claude'.*builtin.*command.*python", harness__kind="claude")
    refused(r"harness.kind_options.command.command must be a non-empty", harness__command="")
    refused(r"missing\.jsonl", task__dataset=str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(open(TASKS).readline() + '{"id": "x", "instruction": 3, "grader": "true"}\n')
    refused(r"bad\.jsonl:2.*instruction", task__dataset=str(bad))
    refused(r"eval.kind='first_call'.*episodes", eval__kind="first_call")
    # a command harness never runs the policy's commands unconfined by accident
    monkeypatch.setattr(sb, "bwrap_usable", lambda: (False, "no bubblewrap here"))
    refused(r"sandbox='auto': no bubblewrap here.*sandbox=none")
    c = external.get_config()
    c.harness.sandbox = "none"  # chosen explicitly: accepted
    assert RLConfig.from_config(c).harness.sandbox.kind == "none"


@pytest.mark.skipif(not _USABLE, reason=f"bubblewrap sandbox unavailable: {_WHY}")
@pytest.mark.skipif(not os.path.exists(os.path.join(os.path.dirname(sys.executable), "mini")),
                    reason="mini-swe-agent not installed (pip install -e '.[harnesses]')")
@pytest.mark.slow  # ~70 s idle (a whole RL job with a third-party harness); its episode test stays in the default run
def test_rl_job_trains_mini_swe_agent_rollouts_on_the_task_file_and_resumes(tmp_path):
    """configs/external.py shrunk: one step of 2 mini-swe-agent rollouts (processes in their sandboxes)
    on the example task file, trained; whole-episode eval before and after; a rerun with steps=2
    resumes from the checkpoint and trains one more step."""
    from configs import external
    from gyre_jax import jobs

    def config(steps):
        c = external.get_config()
        c.steps, c.progress, c.first_last = steps, False, 1
        c.model.update(dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64))
        c.cells.update(dict(cell_size=4, max_slots=4))
        c.scheduler.update(dict(groups_per_step=1, group_size=2, min_work_per_switch_s=0.0))
        c.train.micro_batch_rows = 4
        c.eval.update(dict(every=1, tasks=1, samples_per_task=2))
        return c

    workdir = str(tmp_path / "w")
    first = jobs.get("rl")(config(1), workdir)
    summary = jobs.get("rl")(config(2), workdir)
    wd = os.path.join(workdir, "elastic") if os.path.isdir(os.path.join(workdir, "elastic")) else workdir
    lines = [json.loads(x) for x in open(os.path.join(wd, "metrics.jsonl"))]
    assert [r["step"] for r in lines] == [0, 1] and first["steps"] == 1
    with TrajectoryStore(os.path.join(wd, "store"), run_id="rl", writable=False) as store:
        done = store.complete_rollouts()
        assert len(done) == 4
        consumed = store.consumed()
        for rid in done:
            calls = store.calls(rid)
            assert calls and all(c.rollout_id == rid for c in calls), rid  # mini-swe-agent's calls, under its key
            o = store.outcome(rid)
            assert o.status in ("completed", "timeout") and o.score is not None, (rid, o.status)
            assert consumed[rid]["state"] == "trained", consumed[rid]
        tree.rebuild(store.calls(done[0]))  # the calls make one exact tree
    evals = [json.loads(x) for x in open(os.path.join(wd, "eval", "eval.jsonl"))]
    assert sorted({e["step"] for e in evals}) == [0, 1, 2]  # before training, after step 1 (first run), after 2
    assert all(e["eval/episodes"] == 2 and e["eval/failed"] == 0 and e["eval/calls"] >= 1 for e in evals)
    assert summary["eval_k"] == 2 and 0.0 <= summary["eval_pass_at_k_last"] <= 1.0
