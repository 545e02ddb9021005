"""The example harness end to end over real HTTP, against the fake OpenAI server.

Every test runs real rollouts: aiohttp client -> loopback HTTP -> FakeOpenAIServer,
real tools in real workspaces, graders in real subprocesses.
"""
import asyncio
import dataclasses
import os
import socket
import textwrap

import pytest

from gyre_jax.agents.agent import SUBAGENT_SYSTEM_PROMPT, SUMMARY_HEADER, SUMMARY_REQUEST, tool_call_message
from gyre_jax.agents.config import HarnessConfig
from gyre_jax.agents.demos import demonstration
from gyre_jax.agents.harness import RolloutRequest, group_requests, iter_rollouts, run_rollouts
from gyre_jax.agents.tasks import repo_spec, solution_turns, tiny
from gyre_jax.agents.tasks.base import Task
from gyre_jax.serving import identity as H
from gyre_jax.testing.fake_openai_server import FakeOpenAIServer, FakeReply, tool_calls
from gyre_jax.trajectory import vocab


def _reply(msg: dict) -> FakeReply:
    return FakeReply(content=msg.get("content") or "", tool_calls=msg.get("tool_calls"))


def _config(base_url, **kw):
    kw.setdefault("backoff_base_s", 0.01)
    kw.setdefault("backoff_max_s", 0.05)
    kw.setdefault("grader_timeout_s", 30.0)
    kw.setdefault("deadline_s", 30.0)
    return HarnessConfig(base_url=base_url, run_id="run1", **kw)


def _serve_and_run(responder, requests, tmp_path, base_url=None, **cfg):
    async def main():
        async with FakeOpenAIServer(responder) as srv:
            config = _config(base_url or srv.base_url, **cfg)
            results = await run_rollouts(requests, config, workspace_root=tmp_path)
            return srv, results
    return asyncio.run(main())


@pytest.fixture(scope="module")
def repo_task():
    return repo_spec.make_task(5, n_modules=1, functions_per_module=1)


def test_multi_turn_structured_rollout_completes_scores_and_matches_demo(repo_task, tmp_path):
    turns = solution_turns(repo_task)

    def responder(req):
        return _reply(tool_call_message(turns[req.turn], text_format=False, id_prefix=f"call{req.turn}"))

    srv, [res] = _serve_and_run(responder, [RolloutRequest(rollout_id="r0", task=repo_task, group_id="g0")],
                                tmp_path)
    assert res.status == vocab.STATUS_COMPLETED, res.error
    assert res.score == 1.0 and res.grader_details["passed"] == res.grader_details["total"] == 10
    assert res.finish_reason == "finish"
    assert (res.calls, res.retries, res.compactions, res.subagents, res.tool_errors) == (4, 0, 0, 0, 0)
    assert res.tool_calls == 1 + 3 + 1 + 1  # list, 3 writes, run, finish
    for k, req in enumerate(srv.requests):
        assert req.header(H.HEADER_RUN) == "run1" and req.header(H.HEADER_ROLLOUT) == "r0"
        assert req.header(H.HEADER_TASK) == repo_task.task_id and req.header(H.HEADER_GROUP) == "g0"
        assert req.header(H.HEADER_AGENT) == "0" and req.header(H.HEADER_PARENT_AGENT) is None
        assert req.header(H.HEADER_ROLE) == "main"
        assert req.header(H.HEADER_CALL) == str(k) and req.header(H.HEADER_ATTEMPT) == "0"
        assert req.header("Authorization") == "Bearer gyre:run1:r0"
        assert H.parse_api_key(req.header("Authorization")) == ("run1", "r0")
        assert [t["function"]["name"] for t in req.body["tools"]] == list(repo_task.tools)
    # The harness's context over HTTP is exactly the demonstration transcript.
    demo = demonstration(repo_task, text_format=False)
    assert srv.requests[-1].messages == demo.messages[:-1]
    assert srv.requests[1].messages[-1]["role"] == "tool"


def test_plain_text_tool_calls_tiny_group_partial_credit(tmp_path):
    task = tiny.make_task(11)
    expected = task.params["expected"]
    wrong = expected[:-1] + ("X" if expected[-1] != "X" else "Y")

    def responder(req):
        content = expected if req.header(H.HEADER_ROLLOUT).endswith("-0") else wrong
        return _reply(tool_call_message([("write_file", {"path": "answer.txt", "content": content}),
                                         ("finish", {})], text_format=True))

    srv, res = _serve_and_run(responder, group_requests(task, 2, group_id="gt"), tmp_path,
                              send_tools_schema=False, bytes_per_token=1.0)
    assert [r.status for r in res] == [vocab.STATUS_COMPLETED] * 2
    assert res[0].score == 1.0
    assert res[1].score == pytest.approx((len(expected) - 1) / len(expected))
    details = dict(res[1].grader_details)
    tree = details.pop("tree")  # what crossed from the workspace into the graded tree (graded_tree.py)
    assert details == {"expected": expected, "got": wrong, "exact": False}
    assert tree["carried"] == 1 and not any(tree["refused"].values())  # answer.txt, nothing refused
    assert all("tools" not in r.body for r in srv.requests)
    assert srv.requests[0].messages == demonstration(task).messages[:-1]


@pytest.mark.parametrize("usage", ["auto", None])
def test_compaction_makes_summary_call_then_fresh_context(tmp_path, usage):
    task = tiny.make_task(2)
    summary = "SUMMARY: wrote notes0.txt and notes1.txt"

    def responder(req):
        if req.header(H.HEADER_ROLE) == "summary":
            return FakeReply(content=summary, usage=usage)
        if SUMMARY_HEADER in req.messages[1]["content"]:
            calls = solution_turns(task)[0]
        else:
            calls = [("write_file", {"path": f"notes{req.turn}.txt", "content": "n" * 200})]
        return FakeReply(content=tool_call_message(calls, text_format=True)["content"], usage=usage)

    srv, [res] = _serve_and_run(responder, [RolloutRequest(rollout_id="c0", task=task, group_id="g")], tmp_path,
                                send_tools_schema=False, bytes_per_token=1.0, context_budget_tokens=500)
    assert res.status == vocab.STATUS_COMPLETED and res.score == 1.0, res.error
    assert res.compactions == 1 and res.calls == 4
    roles = [r.header(H.HEADER_ROLE) for r in srv.requests]
    assert roles == ["main", "main", "summary", "main"]
    before, summ, after = srv.requests[1], srv.requests[2], srv.requests[3]
    # The summary call sees the whole context (with the second turn's result) plus the request.
    assert summ.messages[:len(before.messages)] == before.messages
    assert summ.messages[-1] == {"role": "user", "content": SUMMARY_REQUEST}
    assert len(summ.messages) == len(before.messages) + 3
    assert summ.header(H.HEADER_AGENT) == "0" and "tools" not in summ.body
    assert after.messages == [before.messages[0], {"role": "user", "content": task.prompt + SUMMARY_HEADER + summary}]
    assert [r.header(H.HEADER_CALL) for r in srv.requests] == ["0", "1", "2", "3"]


def test_subagent_has_own_context_id_and_role(tmp_path):
    task = tiny.make_task(4)
    sub_task = "write the answer file"

    def responder(req):
        if req.header(H.HEADER_AGENT) == "1":
            if req.turn == 0:
                return tool_calls(*[c for c in solution_turns(task)[0] if c[0] == "write_file"])
            return tool_calls(("finish", {"message": "answer written"}))
        if req.turn == 0:
            return tool_calls(("spawn_subagent", {"task": sub_task}))
        return tool_calls(("finish", {}))

    task = Task(**{**task.to_dict(), "tools": ("write_file", "spawn_subagent", "finish")})
    srv, [res] = _serve_and_run(responder, [RolloutRequest(rollout_id="s0", task=task, group_id="g")], tmp_path)
    assert res.status == vocab.STATUS_COMPLETED and res.score == 1.0, res.error
    assert res.subagents == 1 and res.calls == 4
    agents = [(r.header(H.HEADER_AGENT), r.header(H.HEADER_PARENT_AGENT), r.header(H.HEADER_ROLE))
              for r in srv.requests]
    assert agents == [("0", None, "main"), ("1", "0", "subagent"), ("1", "0", "subagent"), ("0", None, "main")]
    sub_first = srv.requests[1]
    assert sub_first.messages == [{"role": "system", "content": SUBAGENT_SYSTEM_PROMPT},
                                  {"role": "user", "content": sub_task}]
    # Depth limit 1: the sub-agent is not offered spawn_subagent.
    assert [t["function"]["name"] for t in sub_first.body["tools"]] == ["write_file", "finish"]
    last = srv.requests[3].messages
    assert last[-1] == {"role": "tool", "tool_call_id": "call_0",
                        "content": "sub-agent 1 ended (finish): answer written"}
    assert len(last) == 4  # main context: system, user, spawn call, its result; none of the sub-agent's
    assert {r.header(H.HEADER_ROLLOUT) for r in srv.requests} == {"s0"}


def test_failed_call_is_retried_and_counted(tmp_path):
    task = tiny.make_task(6)
    turn = tool_call_message(solution_turns(task)[0], text_format=True)

    def responder(req):
        return FakeReply(status=500) if req.index == 0 else _reply(turn)

    srv, [res] = _serve_and_run(responder, [RolloutRequest(rollout_id="e0", task=task, group_id="g")], tmp_path)
    assert res.status == vocab.STATUS_COMPLETED and res.score == 1.0
    assert res.retries == 1 and res.calls == 1
    assert [(r.header(H.HEADER_CALL), r.header(H.HEADER_ATTEMPT)) for r in srv.requests] == [("0", "0"), ("0", "1")]


def test_unreachable_server_and_client_error_are_infra_errors(tmp_path):
    task = tiny.make_task(7)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    srv, [down] = _serve_and_run(lambda req: FakeReply(), [RolloutRequest(rollout_id="u0", task=task, group_id="g")],
                                 tmp_path, base_url=dead, max_retries=2)
    assert down.status == vocab.STATUS_INFRA_ERROR and down.score is None and down.grader_details == {}
    assert down.retries == 2 and down.calls == 0 and "after 2 retries" in down.error
    srv, [bad] = _serve_and_run(lambda req: FakeReply(status=400, error="prompt too long"),
                                [RolloutRequest(rollout_id="u1", task=task, group_id="g")], tmp_path)
    assert bad.status == vocab.STATUS_INFRA_ERROR and bad.score is None and bad.retries == 0
    assert "HTTP 400" in bad.error and "prompt too long" in bad.error and len(srv.requests) == 1


def _processes_running(argv: list[str]) -> list[int]:
    """Host pids whose command line is exactly ``argv``."""
    want = ("\0".join(argv) + "\0").encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read() == want:
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_deadline_grades_workspace_for_partial_credit(repo_task, tmp_path):
    files = repo_spec.reference_files(repo_task)
    partial = [("write_file", {"path": p, "content": c}) for p, c in files.items() if p != repo_spec.README]

    def responder(req):
        if req.turn == 0:
            return tool_calls(*partial)
        if req.header(H.HEADER_ROLLOUT) == "hang":  # the model stops answering
            return FakeReply(hang=True)
        return tool_calls(("run", {"command": "exec sleep 61.25", "timeout_s": 120}))

    reqs = [RolloutRequest(rollout_id=r, task=repo_task, group_id="g") for r in ("hang", "cmd")]
    srv, res = _serve_and_run(responder, reqs, tmp_path, deadline_s=1.0, command_timeout_s=120.0)
    for r in res:
        assert r.status == vocab.STATUS_TIMEOUT and r.finish_reason is None, r.error
        failed = {c["check"] for c in r.grader_details["checks"] if not c["ok"]}
        mod, pkg = repo_task.params["modules"][0]["name"], repo_task.params["package"]
        assert failed == {"exists:README.md", f"readme:{pkg}", f"readme:{mod}"}
        assert r.score == pytest.approx(7 / 10)
        assert 1.0 <= r.agent_time_s < 5.0
        outcome = r.to_outcome("run1", policy_versions=[3])
        assert outcome.status == "timeout" and not outcome.is_failure and outcome.score == r.score
        # "hang": its second call never answered; "cmd": its second call answered, its command hung.
        assert outcome.details["harness"]["calls"] == r.calls == {"hang": 1, "cmd": 2}[r.rollout_id]
    # The command running at the deadline was killed, not left behind (its pid is its
    # sandbox's: look for it on the host by its command line).
    assert not _processes_running(["sleep", "61.25"])


def test_a_tasks_own_deadline_is_stretched_by_deadline_scale(repo_task, tmp_path):
    """A task with its own deadline (a task file's timeout_s) gets it times config.deadline_scale (a held-out eval
    or a slow host stretches it); config.deadline_s is for tasks without one. It was the task's alone: an eval's
    4x went nowhere and SmolLM2's episodes timed out at 120 s beside training."""
    task = dataclasses.replace(repo_task, deadline_s=0.4)
    hang = lambda req: FakeReply(hang=True)  # noqa: E731 - the model never answers
    _, [res] = _serve_and_run(hang, [RolloutRequest(rollout_id="s", task=task, group_id="g")], tmp_path,
                              deadline_s=30.0, deadline_scale=3.0)
    assert res.status == vocab.STATUS_TIMEOUT and 1.2 <= res.agent_time_s < 5.0, (res.status, res.agent_time_s)


_BAD_GRADERS = textwrap.dedent("""
    import threading

    def crash(task, workspace):
        raise RuntimeError("grader bug")

    def hang(task, workspace):
        threading.Event().wait()

    def garbage(task, workspace):
        return {"score": 0.5}
""")


def test_grader_failures_are_verifier_errors_not_zeros(tmp_path, monkeypatch):
    (tmp_path / "bad_graders_mod.py").write_text(_BAD_GRADERS)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    base = tiny.make_task(8)
    reqs = [RolloutRequest(rollout_id=name, group_id="g",
                           task=Task(**{**base.to_dict(), "grader": f"bad_graders_mod:{name}"}))
            for name in ("crash", "hang", "garbage")]
    turn = tool_call_message(solution_turns(base)[0], text_format=True)
    srv, res = _serve_and_run(lambda req: _reply(turn), reqs, tmp_path / "ws", grader_timeout_s=3.0)
    for r in res:
        assert r.status == vocab.STATUS_VERIFIER_ERROR and r.score is None and r.finish_reason == "finish", r
    outcome = res[0].to_outcome("run1")  # a valid trajectory record, no score, reason kept
    assert outcome.is_failure and outcome.score is None and "grader bug" in outcome.details["error"]
    assert "RuntimeError: grader bug" in res[0].error
    assert "timed out after 3 s" in res[1].error
    assert "returned dict" in res[2].error
    assert (tmp_path / "ws" / "crash" / "answer.txt").read_text() == base.params["expected"]


def test_many_rollouts_run_concurrently_within_the_limit(tmp_path):
    tasks = [tiny.make_task(100 + k) for k in range(12)]
    by_id = {f"c{k}": t for k, t in enumerate(tasks)}
    four_in_flight = asyncio.Event()

    async def responder(req):
        if req.index < 4:  # a serial harness would never get 4 calls in at once
            if srv_ref[0].in_flight >= 4:
                four_in_flight.set()
            try:
                await asyncio.wait_for(four_in_flight.wait(), 20)
            except TimeoutError:
                return FakeReply(status=400, error="rollouts did not run concurrently")
        task = by_id[req.header(H.HEADER_ROLLOUT)]
        return _reply(tool_call_message(solution_turns(task)[0], text_format=True))

    srv_ref = []

    async def main():
        async with FakeOpenAIServer(responder) as srv:
            srv_ref.append(srv)
            config = _config(srv.base_url, concurrency=4, send_tools_schema=False)
            reqs = [RolloutRequest(rollout_id=i, task=t, group_id=t.task_id) for i, t in by_id.items()]
            streamed = [r.rollout_id async for r in iter_rollouts(reqs, config, workspace_root=tmp_path / "a")]
            ordered = await run_rollouts(reqs[:3], config, workspace_root=tmp_path / "b")
            return srv, streamed, ordered

    srv, streamed, ordered = asyncio.run(main())
    assert sorted(streamed) == sorted(by_id)
    assert srv.max_in_flight == 4
    assert [r.rollout_id for r in ordered] == ["c0", "c1", "c2"]
    assert all(r.status == vocab.STATUS_COMPLETED and r.score == 1.0 for r in ordered)
    for rid, task in by_id.items():
        assert (tmp_path / "a" / rid / "answer.txt").read_text() == task.params["expected"]


def test_duplicate_rollout_ids_and_reused_workspace_are_rejected(tmp_path):
    task = tiny.make_task(1)
    config = _config("http://127.0.0.1:9/v1")
    reqs = [RolloutRequest(rollout_id="d", task=task, group_id="g")] * 2

    async def drain(reqs):
        return [r async for r in iter_rollouts(reqs, config, workspace_root=tmp_path)]

    with pytest.raises(ValueError, match="duplicate rollout ids"):
        asyncio.run(drain(reqs))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "old.txt").write_text("x")
    with pytest.raises(FileExistsError, match="already holds files"):
        asyncio.run(drain(reqs[:1]))
