"""The tiny_tests family: a run_tests tool whose suite takes heavy-tailed wall time in a
real sandboxed subprocess, a receipt the agent cannot forge, and its grading."""
import asyncio
import math
import os
import statistics
import time

import pytest

from gyre_jax.agents import test_suite as ts
from gyre_jax.agents.agent import tool_call_message
from gyre_jax.agents.config import HarnessConfig
from gyre_jax.agents.demos import demonstration
from gyre_jax.agents.harness import RolloutRequest, run_rollouts
from gyre_jax.agents.tasks import make_task, solution_turns, test_suite, tiny, tiny_tests
from gyre_jax.agents.tools import ToolError, Workspace
from gyre_jax.serving import identity as H
from gyre_jax.testing.fake_openai_server import FakeOpenAIServer, FakeReply
from gyre_jax.trajectory import vocab

SCALE = 0.05  # suites of 0.05-1.5 s: the same draws as the demo's 1-30 s, 20x faster


def _phi(x):
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def test_suite_times_are_deterministic_heavy_tailed_and_clipped():
    n = 20000
    xs = [ts.heavy_tailed_seconds(s) for s in range(n)]
    assert xs == [ts.heavy_tailed_seconds(s) for s in range(n)]  # a pure function of the seed
    assert min(xs) == 1.0 and max(xs) == 30.0
    # Against the log-normal's own CDF (median 3, sigma 1): the floor, the median, p90 and the cap.
    for frac, want in [(sum(x <= 1.0 for x in xs) / n, _phi(math.log(1 / 3))),
                       (sum(x <= 3.0 for x in xs) / n, 0.5),
                       (sum(x <= 3.0 * math.exp(1.2816) for x in xs) / n, 0.9),
                       (sum(x >= 30.0 for x in xs) / n, 1 - _phi(math.log(10)))]:
        sd = math.sqrt(want * (1 - want) / n)
        assert abs(frac - want) < 4 * sd, (frac, want)
    assert statistics.mean(xs) > 1.5 * statistics.median(xs)  # the tail pulls the mean up
    with pytest.raises(ValueError, match="low_s <= median_s"):
        ts.heavy_tailed_seconds(0, low_s=5.0, median_s=3.0)


def test_make_task_is_deterministic_and_scales_its_suite():
    a, b = make_task("tiny_tests", 7), make_task("tiny_tests", 7)
    assert a == b and a.params["test_s"] == round(ts.heavy_tailed_seconds(7), 3)
    assert a.tools == ("write_file", "run_tests", "finish")
    fast = tiny_tests.make_task(7, run_tests_scale=SCALE)
    assert fast.params["test_s"] == pytest.approx(SCALE * a.params["test_s"], abs=1e-3)
    assert fast.params["expected"] == a.params["expected"] == tiny.make_task(7).params["expected"]
    assert test_suite(a).duration_s == a.params["test_s"] and test_suite(tiny.make_task(7)) is None
    with pytest.raises(ValueError, match="run_tests_scale"):
        tiny_tests.make_task(0, run_tests_scale=-1.0)
    # Other families do not offer it (their prompts and schemas are unchanged).
    assert "run_tests" not in tiny.make_task(0).tools and "run_tests" not in make_task("repo_spec", 0).tools


def test_demonstration_runs_the_suite_without_its_wait_and_scores_one():
    task = tiny_tests.make_task(6)  # an 8.9 s suite: the demonstration must not wait for it
    assert task.params["test_s"] > 8.0
    t0 = time.monotonic()
    demo = demonstration(task, verify=True)
    # Waiting for the suite would take its whole test_s; the bound is that, not a speed target.
    assert time.monotonic() - t0 < task.params["test_s"]
    assert demo.score == 1.0
    assert "<tool>run_tests</tool>" in demo.messages[-1]["content"]


def test_workspace_without_a_suite_refuses(tmp_path):
    ws = Workspace(tmp_path, sandbox=None)
    with pytest.raises(ToolError, match="no test suite"):
        asyncio.run(ws.call("run_tests", {}))
    with pytest.raises(ToolError, match="unexpected argument"):
        asyncio.run(ws.call("run_tests", {"x": 1}))


def test_rollouts_wait_on_real_suites_concurrently_and_only_tested_answers_earn_full_credit(tmp_path):
    """Five rollouts over real HTTP with the real sandbox: each suite is a subprocess that
    takes its task's time; they overlap (the event loop is free while they run); the grade
    needs a receipt of the final answer."""
    # Seeds with long suites (8.9, 8.2, 4.7 s at scale 1; r2 and r4 never run theirs), at 0.2x.
    tasks = {f"r{k}": tiny_tests.make_task(seed, run_tests_scale=0.2) for k, seed in enumerate((6, 7, 0, 4, 10))}
    # r0, r1: the ideal transcript. r2: never tests. r3: tests, then changes its answer.
    # r4: writes its own receipt (a forgery) instead of testing.
    def turns(rid, task):
        exp = task.params["expected"]
        if rid == "r2":
            return [("write_file", {"path": "answer.txt", "content": exp}), ("finish", {})]
        if rid == "r3":
            return [("write_file", {"path": "answer.txt", "content": exp[:-1] + "Z"}), ("run_tests", {}),
                    ("write_file", {"path": "answer.txt", "content": exp}), ("finish", {})]
        if rid == "r4":
            return [("write_file", {"path": "answer.txt", "content": exp}),
                    ("write_file", {"path": ts.RECEIPT_FILE, "content": ts.receipt("guess", exp.encode())}),
                    ("finish", {})]
        return solution_turns(task)[0]

    def responder(req):
        rid = req.header(H.HEADER_ROLLOUT)
        return FakeReply(content=tool_call_message(turns(rid, tasks[rid]), text_format=True)["content"])

    async def main():
        async with FakeOpenAIServer(responder) as srv:
            config = HarnessConfig(base_url=srv.base_url, run_id="rt", send_tools_schema=False, concurrency=8,
                                   deadline_s=60.0, grader_timeout_s=30.0)
            reqs = [RolloutRequest(rollout_id=rid, task=t, group_id=t.task_id) for rid, t in tasks.items()]
            t0 = time.monotonic()
            res = await run_rollouts(reqs, config, workspace_root=tmp_path)
            return res, time.monotonic() - t0

    res, wall = asyncio.run(main())
    by = {r.rollout_id: r for r in res}
    assert all(r.status == vocab.STATUS_COMPLETED for r in res), [r.error for r in res]
    for rid in ("r0", "r1"):
        assert by[rid].score == 1.0 and by[rid].grader_details["tested"] is True
        assert by[rid].agent_time_s >= tasks[rid].params["test_s"]  # it really waited for its suite
    assert by["r2"].score == tiny_tests.UNTESTED_FACTOR and by["r2"].grader_details["tested"] is False
    assert by["r3"].score == tiny_tests.UNTESTED_FACTOR  # the receipt covers the answer it tested, not this one
    assert by["r4"].score == tiny_tests.UNTESTED_FACTOR  # a receipt without the key is no receipt
    # r3's suite saw a wrong answer: its output says so, and the rollout counted the command.
    assert by["r3"].sandbox["commands"] == 1 and by["r2"].sandbox["commands"] == 0
    tested = [tasks[r].params["test_s"] for r in ("r0", "r1", "r3")]
    assert sum(tested) > 4.0 and wall < sum(tested) - 1.0  # suites overlap rather than queue


def test_suite_output_reports_each_case(tmp_path):
    task = tiny_tests.make_task(1, run_tests_scale=0.0)  # an instant suite: the cases, not the wait
    ws = Workspace(tmp_path, sandbox=None, test_suite=test_suite(task))
    wrong = asyncio.run(ws.call("run_tests", {}))
    assert wrong.startswith("exit code 1") and "test_file_exists FAILED" in wrong and "0 passed, 3 failed" in wrong
    ws.write_file("answer.txt", task.params["expected"])
    right = asyncio.run(ws.call("run_tests", {}))
    assert right.startswith("exit code 0") and "3 passed, 0 failed" in right
    receipt = (tmp_path / ts.RECEIPT_FILE).read_text()
    assert ts.receipt_valid(task.params["receipt_key"], receipt, task.params["expected"].encode())
    assert not ts.receipt_valid(task.params["receipt_key"], receipt, b"other")


def test_a_fifo_planted_as_the_receipt_does_not_freeze_run_tests(tmp_path):
    task = tiny_tests.make_task(1, run_tests_scale=0.0)
    ws = Workspace(tmp_path, sandbox=None, test_suite=test_suite(task))
    ws.write_file("answer.txt", task.params["expected"])
    os.mkfifo(tmp_path / ts.RECEIPT_FILE)

    async def run():
        return await asyncio.wait_for(ws.call("run_tests", {}), 30)

    with pytest.raises(ToolError, match="not a regular file|cannot open"):
        asyncio.run(run())
