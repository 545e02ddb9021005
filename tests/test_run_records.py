"""What a run writes for the people reading it (issue 44, item 3), each fixed where a newcomer tripped:

* the progress line of step N shows step N's reward (it showed the step before's);
* after a resume, summary.json's top level and timeline.png cover every attempt (they covered the last);
* a command harness's outcome counts the calls the proxy recorded (it said ``harness.calls=0``);
* metrics.jsonl and eval.jsonl are JSON: a NaN mean is ``null`` (it was a bare ``NaN`` token);
* ``eval.tasks`` over the held-out set's size says so, naming both numbers (it was cut silently);
* the harness environment variables and eval/vNNNNNN/episodes.jsonl are in the README;
* the SDKs a python harness uses are declared in the ``harnesses`` extra.
"""
from __future__ import annotations

import io
import json
import logging
import os
import queue
import re
import tomllib
import types

import pytest

from gyre_jax.agents.harness import RolloutResult
from gyre_jax.agents.task_sources import DatasetSource
from gyre_jax.rl import attempts as attempts_lib
from gyre_jax.rl import loop as loop_lib
from gyre_jax.rl.episode_eval import BackgroundEval
from gyre_jax.rl.metrics import MetricsWriter
from gyre_jax.rl.progress import Progress
from gyre_jax.rl.report import StepRecord, run_summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def strict_json(line: str):
    """json.loads that refuses NaN / Infinity, as jq, JavaScript and most JSON readers do."""
    def refuse(tok):
        raise ValueError(f"not JSON: {tok}")
    return json.loads(line, parse_constant=refuse)


# ------------------------------------------------------------------------------------------ progress line
class _Recorder:
    """Stands in for StepRecorder: a step's record is its reward (the real one needs a whole cluster)."""

    def __init__(self, **_):
        pass

    def record(self, done):
        return StepRecord(done.step, {"reward": done.reward, "time_s": float(done.step)})


def test_the_progress_line_of_a_step_shows_that_steps_reward(monkeypatch):
    from gyre_jax.rl.hooks import StepHooks

    monkeypatch.setattr(loop_lib, "StepRecorder", _Recorder)
    done = queue.Queue()
    written = []
    hooks = StepHooks(3)  # the metrics writer's hook, as rl/build.py adds it
    hooks.add_hook(lambda info: written.append((info.record.step, info.record["reward"])), name="metrics")
    c = types.SimpleNamespace(
        clock=None, server=None, timeline=None, controller=None, evaluator=None, cfg=None, workdir="",
        trainer=types.SimpleNamespace(done=done),
        launcher=types.SimpleNamespace(running_rollouts=lambda: 3),
        pool=types.SimpleNamespace(roles=lambda: ["train", "rollout"], training_failed=None),
        step_hooks=hooks)
    out = io.StringIO()  # not a terminal: one line per step
    bar = Progress(total=3, desc="rl[elastic]", enabled=True, every_s=3600.0, stream=out)
    records = loop_lib._Records(c, bar)
    for step, reward in ((0, 0.25), (1, 0.5), (2, 0.75)):
        done.put(types.SimpleNamespace(step=step, version=step + 1, params=None, reward=reward,
                                       report=types.SimpleNamespace(failed_cells=())))
        records.take()
    lines = out.getvalue().splitlines()
    assert [ln.split(" | ")[:2] for ln in lines] == [
        ["rl[elastic]: step 1/3", "reward=0.250 in_flight=3 roles=tr"],
        ["rl[elastic]: step 2/3", "reward=0.500 in_flight=3 roles=tr"],
        ["rl[elastic]: step 3/3", "reward=0.750 in_flight=3 roles=tr"]], lines
    assert written == [(0, 0.25), (1, 0.5), (2, 0.75)]


# ------------------------------------------------------------------------------------------ resumed runs
def _fake_parts(n_cells: int):
    launcher = types.SimpleNamespace(statuses={"completed": 8}, group_failures=[], rerun_rollouts=0, results=[])
    timeline = types.SimpleNamespace(switch_count=lambda: 1)
    pool = types.SimpleNamespace(failures=[], out={})
    server = types.SimpleNamespace(proxy=types.SimpleNamespace(counters={}))
    cfg = types.SimpleNamespace(first_last=1, scheduler=types.SimpleNamespace(mode="elastic",
                                                                              updates_per_publication=1))
    return cfg, dict(launcher=launcher, timeline=timeline, pool=pool, server=server)


def _record(step: int, reward: float) -> dict:
    return {"step": step, "reward": reward, "train_busy_cell_s": 1.0, "staleness_mean": 0.5,
            "staleness_max": float(step), "switches": 1, "switch_failures": 0, "trainable_tokens": 10,
            "trainable_tokens_dropped": 1, "weight_move_bytes": 100, "retries": 0, "trained_rollouts": 8,
            "time_s": 1.0 + step}


def test_a_resumed_runs_summary_and_timeline_cover_every_attempt(tmp_path, monkeypatch):
    """Attempt 0 trained steps 0-1 and was killed; attempt 1 resumed at step 2 and trained 2-3. The top
    level is the run (4 steps, the first step's reward first, both attempts' time and cells); ``attempt``
    is the resumed part alone."""
    wd = str(tmp_path / "elastic")
    n_cells = 2
    first = attempts_lib.AttemptLog(wd, first_step=0, n_cells=n_cells, extra={"setup_s": 5.0, "sft_steps": 4,
                                                                              "sft_loss_last": 0.5})
    first.update([(0, 0.0, 10.0, "rollout"), (1, 0.0, 10.0, "train")], 10.0, step=0)
    first.update([(0, 0.0, 20.0, "rollout"), (1, 0.0, 20.0, "train")], 20.0, step=1,
                 counters={"engine_errors": 2, "retries": 5, "injected_faults": {"timeout": 1}})
    monkeypatch.setattr(attempts_lib, "_alive", lambda pid: False)  # attempt 0's process is gone: killed
    with MetricsWriter(wd, process_index=0) as m:  # what attempt 0 left in metrics.jsonl
        for s, r in ((0, 0.1), (1, 0.2)):
            m.write(s, {k: v for k, v in _record(s, r).items() if k != "step"})
    second = attempts_lib.AttemptLog(wd, first_step=2, n_cells=n_cells, extra={"setup_s": 3.0, "sft_steps": 0})
    segments = [(0, 0.0, 30.0, "train"), (1, 0.0, 30.0, "rollout")]
    second.update(segments, 15.0, step=2)
    second.end(segments, 30.0, None)
    attempts = attempts_lib.read_all(wd)
    assert [a["status"] for a in attempts] == ["killed", "finished"]

    cfg, parts = _fake_parts(n_cells)
    history = [StepRecord(s, {k: v for k, v in _record(s, r).items() if k != "step"}) for s, r in ((2, 0.7), (3, 0.9))]
    drawn = {}
    real_plot = run_summary.__globals__["summary_lib"].plot_timeline

    def plot(segs, n, ends, path, **kw):
        drawn.update(segments=list(segs), ends=list(ends), restarts=list(kw.get("restarts", ())))
        real_plot(segs, n, ends, path, **kw)

    monkeypatch.setattr(run_summary.__globals__["summary_lib"], "plot_timeline", plot)
    earlier = loop_lib.earlier_records(os.path.join(wd, "metrics.jsonl"), 2)
    out = run_summary(cfg=cfg, workdir=wd, history=history, evals=[], segments=segments, n_cells=n_cells,
                      step_end_s=[15.0, 30.0], wall_rl=30.0, wall=33.0, injected={}, sft_history=[],
                      earlier=earlier, attempts=attempts, statuses={"completed": 30, "infra_error": 2}, **parts)
    assert out["steps"] == 4 and out["first_step"] == 0 and out["attempts"] == 2
    assert out["reward_first"] == pytest.approx(0.1) and out["reward_last"] == pytest.approx(0.9)
    assert out["rl_s"] == pytest.approx(50.0) and out["wall_s"] == pytest.approx(5.0 + 20.0 + 33.0)
    assert out["staleness_max"] == 3.0 and out["trainable_tokens"] == 40 and out["switches"] == 4
    assert out["trees"]["trained_rollouts"] == 32
    assert out["statuses"] == {"completed": 30, "infra_error": 2}
    assert out["sft_steps"] == 4 and out["sft_loss_last"] == 0.5  # attempt 0's warm start
    assert out["engine_errors"] == 2 and out["retries"] == 5 and out["injected_faults"] == {"timeout": 1}
    # Half the cell-time in each role over both attempts (attempt 0: cell 1 trains; attempt 1: cell 0).
    assert out["util_train"] == pytest.approx(0.5) and out["util_rollout"] == pytest.approx(0.5)
    assert out["attempt"]["steps"] == 2 and out["attempt"]["first_step"] == 2
    assert out["attempt"]["reward_first"] == pytest.approx(0.7)
    with open(os.path.join(wd, "summary.json")) as f:
        assert strict_json(f.read()) == out
    # A mean over nothing scored is null in summary.json; the modes table reads it back as "-".
    from gyre_jax.rl.summary import table
    assert table([{**out, "eval_first": None, "reward_last": None}]).splitlines()[1].split()[4:8] == \
        ["0.100", "-", "-", "-"]
    # The timeline: attempt 1 drawn after attempt 0's 20 s, the restart marked, every step's end.
    assert max(t1 for _, _, t1, _ in drawn["segments"]) == pytest.approx(50.0)
    assert sorted(drawn["ends"]) == pytest.approx([10.0, 20.0, 35.0])
    assert [t for t, _ in drawn["restarts"]] == [pytest.approx(20.0)] and "step 2" in drawn["restarts"][0][1]
    assert os.path.getsize(os.path.join(wd, "timeline.png")) > 1000


def test_an_attempt_that_fails_or_stops_says_so(tmp_path):
    log = attempts_lib.AttemptLog(str(tmp_path), first_step=0, n_cells=1)
    log.end([(0, 0.0, 1.0, "train")], 1.0, RuntimeError("the core's step failed"))
    stopped = attempts_lib.AttemptLog(str(tmp_path), first_step=0, n_cells=1)
    stopped.end([], 0.5, KeyboardInterrupt("SIGTERM"))
    attempts_lib.record_start_failure(str(tmp_path), TimeoutError("the engines did not start in 300 s"))
    a, b, c = attempts_lib.read_all(str(tmp_path))
    assert (a["attempt"], a["status"], a["error"]) == (0, "failed", "RuntimeError: the core's step failed")
    assert (b["attempt"], b["status"], b["error"]) == (1, "stopped", "SIGTERM")
    assert (c["attempt"], c["status"], c["phase"]) == (2, "failed", "start") and "did not start" in c["error"]
    segments, _, restarts, total = attempts_lib.whole_timeline([a, b, c])
    assert total == 1.5 and len(restarts) == 1  # a failed start has no cells to draw


# ------------------------------------------------------------------------------------------ harness calls
def test_a_command_harness_outcome_counts_the_recorded_calls():
    res = RolloutResult(rollout_id="g00001-0", task_id="t", group_id="g00001", status="completed", score=1.0,
                        grader_details={}, calls=0, retries=0, compactions=0, subagents=0, tool_calls=0,
                        tool_errors=0, finish_reason=None, error=None, wall_time_s=1.0, agent_time_s=1.0,
                        grader_time_s=0.1, workspace="/w", t_end=1.0, harness_kind="command", exit_code=0)
    outcome = res.to_outcome("rl", policy_versions=(0,), num_calls=3)
    assert outcome.num_calls == 3 and outcome.details["harness"]["calls"] == 3
    assert outcome.details["harness"]["harness_counted_calls"] == 0  # what the harness itself said


# ------------------------------------------------------------------------------------------ JSON files
def test_metrics_and_eval_jsonl_write_null_for_nan(tmp_path):
    with MetricsWriter(str(tmp_path), process_index=0) as m:
        m.write(0, {"reward": float("nan"), "exact": 0.5, "x": float("inf")})
    (line,) = open(tmp_path / "metrics.jsonl").read().splitlines()
    rec = strict_json(line)
    assert rec["reward"] is None and rec["x"] is None and rec["exact"] == 0.5
    # eval.jsonl: an eval whose every episode failed (nothing scored) has NaN means.
    ev = BackgroundEval(lambda params, version: {"eval_reward": float("nan"), "eval_exact": float("nan"),
                                                 "eval_pass_at_k": float("nan"), "eval_k": 2, "eval_episodes": 4,
                                                 "eval_s": 0.1}, log_dir=str(tmp_path / "eval"))
    ev.start()
    ev.submit(0, {})
    ev.finish(timeout=30)
    ev.close()
    (line,) = open(tmp_path / "eval" / "eval.jsonl").read().splitlines()
    rec = strict_json(line)
    assert rec["step"] == 0 and rec["eval/reward"] is None and rec["eval/episodes"] == 4


# ------------------------------------------------------------------------------------------ eval.tasks
def test_eval_tasks_over_the_held_out_set_runs_them_all_and_says_so(tmp_path, caplog):
    lines = [{"id": f"t{i}", "instruction": "x", "grader": "true", "split": "eval" if i < 2 else "train"}
             for i in range(4)]
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    src = DatasetSource(str(path))
    with caplog.at_level(logging.WARNING, logger="gyre_jax"):
        tasks = src.eval_tasks(5)
    assert [t.task_id for t in tasks] == ["t0", "t1"]
    (msg,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "eval.tasks=5" in msg and "2 held-out" in msg and str(path) in msg
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gyre_jax"):
        assert len(src.eval_tasks(2)) == 2
    assert not caplog.records  # at or under the set's size: nothing to say


# ------------------------------------------------------------------------------------------ docs, extras
def test_the_readme_documents_the_harness_environment_and_episodes_jsonl():
    readme = open(os.path.join(ROOT, "README.md")).read()
    source = open(os.path.join(ROOT, "gyre_jax", "agents", "harnesses", "command.py")).read()
    env = set(re.findall(r'"(GYRE_[A-Z_]+)":', source))
    assert {"GYRE_MODEL", "GYRE_WORKSPACE", "GYRE_ROLLOUT_ID", "GYRE_TASK_ID"} <= env
    assert [v for v in sorted(env) if f"`{v}`" not in readme] == []
    assert "eval/vNNNNNN/episodes.jsonl" in readme


def test_the_sdks_a_python_harness_uses_are_declared_in_the_harnesses_extra():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    declared = {re.split(r"[<>=\[ ]", d)[0] for d in extras["harnesses"]}
    doc = open(os.path.join(ROOT, "gyre_jax", "agents", "harnesses", "python_entry.py")).read()
    used = set(re.findall(r"from (openai|anthropic) import", doc))
    assert used and used <= declared
    assert {"openai", "anthropic"} <= declared  # the clients the python harness's ClientConfig is for


# ------------------------------------------------------------------------------------------ time split
def test_each_steps_record_splits_its_time_between_engines_agents_tools_and_graders():
    """A step's record: the engines' prefill and decode seconds since the last record (summed over engines),
    and, over the rollouts that finished since, the time in model calls, in tools (the agent's own time
    outside its calls) and in grading; the next record counts only what came after."""
    from gyre_jax.rl.report import StepRecorder

    engines = {n: types.SimpleNamespace(engine=types.SimpleNamespace(counters={"prefill_s": 0.0, "generate_s": 0.0}))
               for n in ("cell1", "cell2")}
    server = types.SimpleNamespace(proxy=types.SimpleNamespace(counters={}, router=types.SimpleNamespace(cells=engines)))
    results: list[dict] = []
    launcher = types.SimpleNamespace(results=results, running_rollouts=lambda: 0)
    pool = types.SimpleNamespace(moves=lambda: [], failures=[], out=set(), roles=lambda: "tr")
    timeline = types.SimpleNamespace(switches_since=lambda n: [])
    clock = types.SimpleNamespace(now=lambda: 1.0)
    rec = StepRecorder(clock=clock, server=server, timeline=timeline, launcher=launcher, pool=pool)

    engines["cell1"].engine.counters.update(prefill_s=1.5, generate_s=10.0)
    engines["cell2"].engine.counters.update(prefill_s=0.5, generate_s=4.0)
    results += [dict(retries=0, agent_s=9.0, model_s=7.0, grader_s=0.25), dict(retries=0, agent_s=3.0, model_s=2.5,
                                                                             grader_s=0.5),
                dict(retries=0, status="timeout", agent_s=240.0, model_s=20.0, grader_s=0.0)]  # a cut call: no tools
    first = rec._cluster_view(2.0)
    assert (first["time/prefill_s"], first["time/decode_s"]) == (2.0, 14.0)
    assert (first["time/model_calls_s"], first["time/tools_s"], first["time/grading_s"]) == (29.5, 2.5, 0.75)
    engines["cell1"].engine.counters["generate_s"] = 11.0
    results.append(dict(retries=0, agent_s=4.0, model_s=1.0, grader_s=2.0))
    second = rec._cluster_view(3.0)
    assert (second["time/prefill_s"], second["time/decode_s"]) == (0.0, 1.0)
    assert (second["time/model_calls_s"], second["time/tools_s"], second["time/grading_s"]) == (1.0, 3.0, 2.0)
