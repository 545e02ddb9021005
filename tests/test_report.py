"""The run report's data layer (gyre_jax/report): what the page shows must be what the run did.

* the tree, the trained paths and the advantages come from the trainer's own code: trained tokens equal
  ``select_paths(build_tree(calls))``'s, every call's end node is its prompt + output, the advantages a
  float64 GRPO reference's over each step's rollouts;
* decoding keeps every token (a node's pieces cover its ids exactly) and reads the chat template's roles
  (byte tokenizer, and a Llama-3-layout HF tokenizer);
* why each call sits where it does in the tree (continue, retry, drift, compaction, sub-agent);
* per-step statuses and grouped failure reasons with an example; per-task tables;
* the page's data files are strict JSON (no NaN) and a rebuild redoes only changed groups;
* the page itself renders in a real browser (slow: headless Chromium).
"""
from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from gyre_jax.report import build_report
from gyre_jax.report import rollouts as rl_lib
from gyre_jax.report.decode import SPECIAL, START, TurnDecoder
from gyre_jax.rl import attempts as attempts_lib
from gyre_jax.rl.metrics import MetricsWriter
from gyre_jax.serving.tokenizer import ByteTokenizer
from gyre_jax.trajectory.records import ModelCallRecord, RolloutOutcome
from gyre_jax.trajectory.select import SelectConfig, select_paths
from gyre_jax.trajectory.store import TrajectoryStore
from gyre_jax.trajectory.synth import preset, synth_rollout
from gyre_jax.trajectory.tree import build_tree

TOK = ByteTokenizer()


def strict_json(text: str):
    def refuse(tok):
        raise ValueError(f"not JSON: {tok}")
    return json.loads(text, parse_constant=refuse)


def read_js(path: str):
    """The JSON inside a data file (``window.X = {...};`` or ``gyreRollouts({...});``)."""
    text = open(path).read().strip()
    if text.startswith("gyreRollouts("):
        return strict_json(text[len("gyreRollouts("):-2])
    return strict_json(text.split(" = ", 1)[1].rstrip(";"))


def _chat(messages, add_generation_prompt=True) -> list[int]:
    return TOK.render_chat(messages, add_generation_prompt=add_generation_prompt)


def _call(rid, gid, i, prompt, output, *, role="main", agent=0, parent=None, version=0, task="t0"):
    return ModelCallRecord(run_id="rl", rollout_id=rid, task_id=task, group_id=gid, agent_id=agent,
                           parent_agent_id=parent, role=role, call_index=i, prompt_ids=np.asarray(prompt, np.int32),
                           output_ids=np.asarray(output, np.int32),
                           output_logprobs=np.full(len(output), -0.5, np.float32), policy_version=version,
                           t_start=1.0 + i, t_end=1.5 + i, finish_reason="stop")


def _agent_rollout(rid: str, gid: str, version: int, task: str = "t0") -> list[ModelCallRecord]:
    """A chat rollout through the byte tokenizer's template: a tool call, its result, a retry, a drifted
    re-render, a compaction and a sub-agent (every branch kind the report names)."""
    sys_, user = {"role": "system", "content": "You are an agent."}, {"role": "user", "content": f"Do {task}."}
    p0 = _chat([sys_, user])
    o0 = TOK.encode('write it') + [TOK.special["<|tool_call|>"]] + TOK.encode('{"name":"run","arguments":{}}') + \
        [TOK.special["<|/tool_call|>"], TOK.special["<|im_end|>"]]
    tool = {"role": "tool", "tool_call_id": "c1", "content": "ok: 3 tests passed"}
    p1 = p0 + o0 + TOK.encode("\n") + _chat([tool])[1:]  # the next prompt extends the context
    o1 = TOK.encode("done") + [TOK.special["<|im_end|>"]]
    p3 = p0 + TOK.encode("write  it") + TOK.encode("\n")  # re-renders call 0's output with other tokens
    summ = p1 + o1 + TOK.encode("\n") + _chat([{"role": "user", "content": "Summarize."}])[1:]
    p5 = _chat([sys_, {"role": "user", "content": f"Do {task}. Summary: it is written."}])
    sub = _chat([{"role": "system", "content": "Sub-agent."}, {"role": "user", "content": "run the tests"}])
    kw = dict(version=version, task=task)
    return [_call(rid, gid, 0, p0, o0, **kw), _call(rid, gid, 1, p1, o1, **kw),
            _call(rid, gid, 2, p1, TOK.encode("again") + [TOK.special["<|im_end|>"]], **kw),
            _call(rid, gid, 3, p3, o1, **kw),
            _call(rid, gid, 4, summ, TOK.encode("it is written"), role="summary", **kw),
            _call(rid, gid, 5, p5, o1, version=version + 1, task=task),
            _call(rid, gid, 6, sub, TOK.encode("tests pass"), role="subagent", agent=1, parent=0, **kw)]


def test_call_kinds_name_why_each_call_branches_where_it_does():
    calls = _agent_rollout("g0-0", "g0", 0)
    kinds = [k for k, _ in rl_lib.call_kinds(calls)]
    assert kinds == ["start", "continue", "retry", "drift", "summary", "compacted", "subagent"]
    shared = [s for _, s in rl_lib.call_kinds(calls)]
    assert shared[1] == len(calls[0].sequence)  # call 1 shares all of call 0's prompt and output
    assert len(calls[0].prompt_ids) <= shared[3] < len(calls[2].sequence)  # drift: inside the output


def test_pieces_cover_every_token_and_read_the_templates_roles():
    dec = TurnDecoder(TOK)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
            {"role": "assistant", "content": "A", "tool_calls": [{"name": "run", "arguments": {"x": 1}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "R"}]
    ids = _chat(msgs)
    pieces, _ = dec.pieces(ids)
    assert sum(p[3] for p in pieces) == len(ids)
    assert [p[0] for p in pieces if p[2] & START] == ["system", "user", "assistant", "tool", "assistant"]
    text = "".join(p[1] for p in pieces if not p[2] & SPECIAL)
    assert "S" in text and '"name":"run"' in text and "R" in text
    # Split anywhere (a branch point inside a turn, or inside a role's name): the same roles, token for token.
    for cut in range(1, len(ids)):
        a, st = dec.pieces(ids[:cut])
        b, _ = dec.pieces(ids[cut:], st)
        assert sum(p[3] for p in a + b) == len(ids)
        assert [p[0] for p in a + b if p[2] & START] == ["system", "user", "assistant", "tool", "assistant"], cut


def test_a_llama3_templates_roles(tmp_path):
    pytest.importorskip("tokenizers")
    from gyre_jax.serving.hf_tokenizer import HFChatTokenizer
    from gyre_jax.testing.tiny_hf_tokenizer import write_tiny_hf_tokenizer

    write_tiny_hf_tokenizer(str(tmp_path), "llama3")
    tok = HFChatTokenizer.from_dir(str(tmp_path))
    ids = tok.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}])
    pieces, _ = TurnDecoder(tok).pieces(ids)
    assert TurnDecoder(tok).layout == "llama3"
    assert [p[0] for p in pieces if p[2] & START] == ["system", "user", "assistant"]
    assert sum(p[3] for p in pieces) == len(ids)
    assert "Hello, world!" in "".join(p[1] for p in pieces if p[0] == "user" and not p[2] & SPECIAL)


def _workdir(tmp_path, n_groups=3, group_size=4):
    """A run's mode directory: agent rollouts (trained at steps 0-1, the last group pending, one rollout
    still running), synthetic branching rollouts, metrics.jsonl, eval files and an attempt record."""
    wd = str(tmp_path / "elastic")
    scores = [[1.0, 0.0, 0.5, 0.25], [0.0, 0.0, 1.0, None], [0.75, 0.5, None, 1.0]]
    with TrajectoryStore(os.path.join(wd, "store"), run_id="rl") as st:
        for g in range(n_groups):
            gid = f"g{g:05d}"
            for k in range(group_size):
                rid = f"{gid}-{k}"
                calls = _agent_rollout(rid, gid, g, task=f"t{g % 2}")
                for c in calls:
                    st.append(c)
                s = scores[g][k]
                err = "harness failed: exit 1 after 12.5s (bridge 0xdeadbeef)" if s is None else None
                st.append(RolloutOutcome(run_id="rl", rollout_id=rid, task_id=f"t{g % 2}", group_id=gid,
                                         status="completed" if s is not None else "infra_error", score=s,
                                         details={"error": err} if err else {"grader": {"exact": s == 1.0}},
                                         policy_versions=(g, g + 1), num_calls=len(calls), t_end=100.0 + g))
        st.append(_call("g00009-0", "g00009", 0, _chat([{"role": "user", "content": "x"}]), [65], task="t0"))
        st.mark_trained([f"g00000-{k}" for k in range(4)], step=0)
        st.mark_trained(["g00001-0", "g00001-1", "g00001-2"], step=1)
        st.mark_dropped(["g00001-3"], step=1, reason="infra_error")
    with MetricsWriter(wd, process_index=0) as m:
        m.write(0, {"version": 1, "reward": 0.4375, "time_s": 5.0})
        m.write(1, {"version": 2, "reward": float("nan"), "time_s": 9.0})  # null in the file
    with MetricsWriter(os.path.join(wd, "eval"), process_index=0, jsonl_name="eval.jsonl") as m:
        m.write(0, {"eval/reward": 0.25})
        m.write(2, {"eval/reward": 0.75})
    for v, sc in ((0, [0.0, 1.0, None]), (2, [1.0, 1.0, 0.5])):
        os.makedirs(os.path.join(wd, "eval", f"v{v:06d}"))
        with open(os.path.join(wd, "eval", f"v{v:06d}", "episodes.jsonl"), "w") as f:
            for i, s in enumerate(sc):
                f.write(json.dumps({"rollout_id": f"e0000-{i}", "task_id": "held", "status": "completed"
                                    if s is not None else "infra_error", "score": s}) + "\n")
    a = attempts_lib.AttemptLog(wd, first_step=0, n_cells=2)
    a.end([(0, 0.0, 9.0, "train"), (1, 0.0, 4.0, "rollout"), (1, 4.0, 9.0, "to_train")], 9.0,
          RuntimeError("the core's step failed"))
    return wd


def _grpo(scores) -> list[float]:
    """GRPO over one group in float64: (s - mean) / (population std + 1e-6) over the scored; 0 without spread."""
    s = np.asarray([x for x in scores if x is not None], np.float64)
    if s.size < 2 or s.max() == s.min():
        return [0.0] * s.size
    return list((s - s.mean()) / (s.std() + 1e-6))


def test_the_report_shows_what_the_trainer_did(tmp_path):
    wd = _workdir(tmp_path)
    stats = build_report(wd, progress=False)
    assert stats["rollouts"] == 13 and stats["groups"] == 4 and stats["groups_built"] == 4
    data = os.path.join(wd, "report", "data")
    index = read_js(os.path.join(data, "index.js"))
    rows = {r[0]: rl_lib.index_dict(r) for r in index["rows"]}
    run = read_js(os.path.join(data, "run.js"))
    assert rows["g00009-0"]["state"] == rows["g00009-0"]["status"] == "running"  # calls, no outcome yet
    assert rows["g00001-3"]["status"] == "infra_error" and rows["g00001-3"]["state"] == "dropped"
    assert rows["g00002-0"]["state"] == "pending" and rows["g00000-0"]["step"] == 0
    # Advantages: GRPO per group (the default estimator), independently.
    want = {**dict(zip([f"g00000-{k}" for k in range(4)], _grpo([1.0, 0.0, 0.5, 0.25]))),
            **dict(zip(["g00001-0", "g00001-1", "g00001-2"], _grpo([0.0, 0.0, 1.0])))}
    for rid, a in want.items():
        assert rows[rid]["advantage"] == pytest.approx(a, rel=1e-6, abs=1e-7), rid
    assert rows["g00001-3"]["advantage"] is None  # a failure has none: never trained as a zero
    # Trees: trained tokens and paths are select_paths(build_tree(calls))'s; end nodes are the calls' sequences.
    details = read_js(os.path.join(data, "rollouts", "g00000.js"))
    with TrajectoryStore(os.path.join(wd, "store"), writable=False) as st:
        for rid, d in details.items():
            calls = st.calls(rid)
            sel = select_paths(build_tree(calls), SelectConfig())
            nodes = d["tree"]["nodes"]
            kept = [n for n in nodes if n["kept"]]
            assert sum(n["trainable"] for n in kept) == sel.trainable_kept == rows[rid]["trained_tokens"]
            assert sum(n["n"] for n in kept) == sel.tokens_kept
            assert d["tree"]["stats"]["paths_selected"] == sel.paths_selected
            for n in nodes:
                assert sum(p[3] for p in n["pieces"]) == n["n"]  # decoding dropped no token
            for c, rec in zip(d["calls"], calls):
                path, i = [], c["end"]
                while i >= 0:
                    path.append(nodes[i])
                    i = nodes[i]["p"]
                assert sum(n["n"] for n in path) == len(rec.sequence)
                text = "".join(p[1] for n in reversed(path) for p in n["pieces"])
                specials = {v: k for k, v in TOK.special.items()}
                assert text == "".join(specials.get(int(t), chr(int(t))) for t in rec.sequence)
            assert [c["kind"] for c in d["calls"]] == ["start", "continue", "retry", "drift", "summary", "compacted",
                                                       "subagent"]
            assert d["staleness"] == 0 and d["calls"][6]["completion"]["content"] == "tests pass"
    # Steps: statuses and grouped failure reasons with an example; the failed rollout's error is kept whole.
    assert run["steps"]["1"]["statuses"] == {"completed": 3, "infra_error": 1}
    (why, n, example), = run["steps"]["1"]["reasons"]
    assert n == 1 and example == "g00001-3" and "exit N" in why and "<id>" in why
    assert run["steps"]["pending"]["statuses"] == {"completed": 3, "infra_error": 1}
    assert run["steps"]["running"]["statuses"] == {"running": 1}
    # Tasks: training rollouts per task per sampling version; held-out pass rate per eval version.
    assert run["tasks"]["t0"]["0"] == [4, 1, pytest.approx(1.75 / 4), 0]
    assert run["evals"]["tasks"]["held"] == {"0": [2, 1, 0.5, 1], "2": [3, 2, pytest.approx(2.5 / 3), 0]}
    assert run["evals"]["columns"]["eval/reward"] == [0.25, 0.75]
    assert run["metrics"]["columns"]["reward"] == [0.4375, None]
    assert run["state"]["status"] == "failed" and "core's step failed" in run["state"]["error"]
    assert run["timeline"]["segments"][0] == [0, 0.0, 9.0, "train"]


def test_a_rebuild_redoes_only_the_groups_that_changed(tmp_path):
    wd = _workdir(tmp_path)
    build_report(wd, progress=False)
    again = build_report(wd, progress=False)
    assert again["groups_built"] == 0 and again["rollouts"] == 13
    with TrajectoryStore(os.path.join(wd, "store"), run_id="rl") as st:
        st.mark_trained([f"g00002-{k}" for k in (0, 1, 3)], step=2)
        st.mark_dropped(["g00002-2"], step=2, reason="infra_error")
    third = build_report(wd, progress=False)
    assert third["groups_built"] == 1
    rows = {r[0]: rl_lib.index_dict(r) for r in read_js(os.path.join(wd, "report", "data", "index.js"))["rows"]}
    assert rows["g00002-0"]["step"] == 2 and rows["g00002-0"]["state"] == "trained"
    assert math.isclose(rows["g00002-0"]["advantage"], _grpo([0.75, 0.5, 1.0])[0], rel_tol=1e-6)


def test_the_page_is_written_before_the_rollout_files_and_an_interrupted_build_resumes(tmp_path, monkeypatch):
    """Phase one lists every rollout from its outcome (a page that works, whatever the run's size); a build cut
    off in phase two leaves it, and the next build makes the groups it did not finish."""
    from gyre_jax.report import build as build_lib

    wd = _workdir(tmp_path)
    real = build_lib._build_groups

    def first_group_then_stop(sdir, mode_dir, data, settings, jobs):
        for out in real(sdir, mode_dir, data, settings, jobs[:1]):
            yield out
        raise KeyboardInterrupt("stopped while building")

    monkeypatch.setattr(build_lib, "_build_groups", first_group_then_stop)
    with pytest.raises(KeyboardInterrupt):
        build_report(wd, progress=False)
    rows = {r[0]: rl_lib.index_dict(r) for r in read_js(os.path.join(wd, "report", "data", "index.js"))["rows"]}
    assert len(rows) == 13 and rows["g00001-3"]["status"] == "infra_error" and "exit N" in rows["g00001-3"]["reason"]
    assert rows["g00002-1"]["trained_tokens"] is None and rows["g00002-1"]["calls"] == 7  # from its outcome
    assert os.path.exists(os.path.join(wd, "report", "index.html"))
    assert read_js(os.path.join(wd, "report", "data", "run.js"))["steps"]["1"]["statuses"] == {"completed": 3,
                                                                                               "infra_error": 1}
    monkeypatch.setattr(build_lib, "_build_groups", real)
    again = build_report(wd, progress=False)
    assert again["groups_built"] == 3  # the three the stop cut off
    rows = {r[0]: rl_lib.index_dict(r) for r in read_js(os.path.join(wd, "report", "data", "index.js"))["rows"]}
    assert all(r["trained_tokens"] is not None for r in rows.values())


def test_synthetic_rollouts_with_every_branch_kind_build(tmp_path):
    """The synthetic generator's rollouts (random ids far past the byte range, sub-agents, retries, drift,
    compaction, timeouts, failures) build without error and keep every token."""
    cfg = preset("tiny", num_groups=2, group_size=3)
    d = str(tmp_path / "synth")
    with TrajectoryStore(os.path.join(d, "store"), run_id=cfg.run_id) as st:
        for k in range(6):
            calls, outcome = synth_rollout(cfg, k // 3, k % 3)
            for c in calls:
                st.append(c)
            st.append(outcome)
    stats = build_report(d, progress=False)
    assert stats["rollouts"] == 6
    for name in os.listdir(os.path.join(d, "report", "data", "rollouts")):
        for det in read_js(os.path.join(d, "report", "data", "rollouts", name)).values():
            assert all(sum(p[3] for p in n["pieces"]) == n["n"] for n in det["tree"]["nodes"])


@pytest.mark.slow  # a real browser: ~10-20 s
def test_the_page_renders_a_rollouts_tree_and_calls_in_chromium(tmp_path):
    from gyre_jax.testing.chromium import HeadlessChromium, available

    if not available():
        pytest.skip("no /usr/bin/chromium")
    wd = _workdir(tmp_path)
    stats = build_report(wd, progress=False)
    with HeadlessChromium() as b:
        b.open("file://" + stats["report"])
        assert b.wait_for("window.Plotly && document.querySelectorAll('#chart-curves .main-svg').length > 0")
        b.click('#tabs a[data-tab="rollouts"]')
        b.wait_for("document.querySelectorAll('#rollout-table tbody tr').length === 13")
        b.click('#rollout-table tbody tr[data-id="g00000-0"]')
        assert b.wait_for("document.querySelectorAll('#tree .node').length") >= 7
        assert b.eval("document.querySelectorAll('#calls tbody tr').length") == 7
        kinds = b.eval("Array.from(document.querySelectorAll('#tree .branch')).map(e => e.textContent)")
        assert {"retry", "drift", "compacted", "subagent"} <= set(kinds), kinds
        assert b.eval("document.querySelectorAll('#tree .node.kept').length") > 0
        b.click('#calls tbody tr[data-i="1"]')  # the call after the tool ran: its new turn is the tool result
        roles = b.wait_for("Array.from(document.querySelectorAll('#call-view > .turn .who')).map(e => e.textContent)")
        assert roles[-1].startswith("completion") and "tool" in roles, roles
        assert "3 tests passed" in b.eval("document.querySelector('#call-view').textContent")
        b.screenshot(str(tmp_path / "rollout.png"))
        b.click('#tabs a[data-tab="steps"]')
        b.click("#step-table a.ex")  # a failure's example opens with its log
        b.wait_for("document.querySelector('#detail .error-line') !== null")
        assert "harness failed" in b.eval("document.querySelector('#detail').textContent")
        b.click('#tabs a[data-tab="timeline"]')
        b.wait_for("document.querySelectorAll('#chart-timeline .main-svg').length > 0")
        assert not b.errors, b.errors
    assert os.path.getsize(tmp_path / "rollout.png") > 10_000


@pytest.mark.slow  # a real browser, from tools/report_screenshot.py's own process: ~10-20 s
def test_the_screenshot_tool_opens_a_branching_rollout_and_says_what_rendered(tmp_path):
    import subprocess
    import sys

    from gyre_jax.testing.chromium import available

    if not available():
        pytest.skip("no /usr/bin/chromium")
    stats = build_report(_workdir(tmp_path), progress=False)
    png = tmp_path / "rollout.png"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, os.path.join(root, "tools", "report_screenshot.py"), stats["report"],
                        "--branching", "--out", str(png)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout, p.stderr)
    seen = json.loads(p.stdout.splitlines()[-1])
    assert seen["branch_labels"] and seen["tree_nodes"] > len(seen["branch_labels"]), seen
    assert seen["call_rows"] == seen["calls_recorded"] > 1 and seen["open_call_turns"][-1].startswith("completion")
    assert os.path.getsize(png) > 10_000
