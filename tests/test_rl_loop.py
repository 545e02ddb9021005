"""The RL loop end to end on the real stack (cells, JetStream engines, HTTP proxy, harness,
graders in subprocesses, store, processor, elastic step, Orbax), at the tiniest sizes.

Default run: config checks, the SFT prompt contract, and ONE loop run (elastic, 2 steps)
with injected faults: a grader that crashes (verifier_error), rollouts that stall past
their deadline (timeout, graded for partial credit), engine errors on one call (500,
the harness retries). Slow: the colocate and async baselines, resume, the full demo.
"""
from __future__ import annotations

import collections
import json
import os

import pytest

from configs import demo as demo_config
from gyre_jax import jobs
from gyre_jax.rl.config import RLConfig


def tiny_config(mode: str = "elastic", steps: int = 2, **faults):
    c = demo_config.get_config()
    c.steps = steps
    c.progress = False
    c.checkpoint_every = 1
    c.first_last = 1
    c.model.update(dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64, max_seq_len=96))
    c.cells.update(dict(cell_size=4, max_slots=8, max_len=96))  # 2 cells: the core and one satellite
    c.train.row_len = 96
    c.scheduler.update(dict(mode=mode, groups_per_step=2, group_size=4, min_work_per_switch_s=0.0))
    c.harness.update(dict(max_tokens=12, deadline_s=20.0))
    c.train.micro_batch_rows = 4  # a multiple of the cell's fsdp size (4)
    c.sft.steps = 0  # random init: the loop's mechanics, not learning (test_sft_warm_start_learns covers SFT)
    c.eval.every = 0  # off unless a test asks for it (it compiles its own sampler)
    c.faults.update(faults)
    return c


def _outcomes(workdir):
    from gyre_jax.trajectory.store import TrajectoryStore

    with TrajectoryStore(os.path.join(workdir, "store"), run_id="rl", writable=False) as store:
        outs = {r: store.outcome(r) for r in store.complete_rollouts()}
        return outs, store.consumed(), {r: len(store.calls(r)) if r in outs else 0 for r in store.rollout_ids()}


def _check_run(workdir, summary, *, steps, rollouts):
    lines = [json.loads(x) for x in open(os.path.join(workdir, "metrics.jsonl"))]
    assert [r["step"] for r in lines] == list(range(steps))
    for key in ("reward", "partial_credit", "staleness_mean", "staleness_max", "dedup_factor", "gen_tokens_per_s",
                "train_tokens_per_s", "switch_s_mean", "failures/verifier_error", "failures/infra_error", "roles"):
        assert key in lines[0], key
    # What the controller measured and concluded, per step (None until measured: then absent).
    last = lines[-1]
    assert last["sched/work_s_per_rollout"] > 0 and 1 <= last["sched/train_cells_target"] <= 3, last
    assert last["sched/max_running_rollouts"] >= 1
    # ... and the same costs in scheduler_costs.json, rewritten each step: the next run's priors, a resume's start
    costs = json.load(open(os.path.join(workdir, "scheduler_costs.json")))
    assert costs["work_s_per_rollout"] == last["sched/work_s_per_rollout"]
    assert costs["serve_s_per_rollout"] == last.get("sched/serve_s_per_rollout"), costs
    assert os.path.getsize(os.path.join(workdir, "timeline.png")) > 1000
    assert os.path.isdir(os.path.join(workdir, "checkpoints", str(steps)))
    outs, consumed, _ = _outcomes(workdir)
    # Every finished rollout was consumed exactly once (the store refuses a second mark),
    # trained iff it has a score, dropped with its failure class as the reason otherwise.
    assert len(outs) == rollouts and set(consumed) == set(outs)
    for rid, o in outs.items():
        entry = consumed[rid]
        if o.is_failure:
            assert entry["state"] == "dropped" and entry["reason"] == o.status, (rid, entry)
        else:
            assert entry["state"] == "trained", (rid, entry)
    assert sum(summary["statuses"].values()) == rollouts
    trees = summary["trees"]  # the run's tree shapes add up from the per-step records
    assert trees["trained_rollouts"] == sum(r["trained_rollouts"] for r in lines) > 0
    assert trees["dedup_factor_real"] == (sum(r["trees/expanded_tokens"] for r in lines)
                                          / sum(r["trees/packed_tokens"] for r in lines)) >= 1.0
    for r in lines:  # staleness bounded by admission (S = 1)
        assert r["staleness_max"] <= 1
    return lines, outs


def test_config_rejects_unknown_and_bad_fields():
    c = demo_config.get_config()
    cfg = RLConfig.from_config(c)
    assert cfg.scheduler.mode == "elastic" and cfg.model.vocab_size >= 267
    d = c.to_dict()
    d["scheduler"]["modee"] = "x"
    with pytest.raises(ValueError, match="unknown field.*modee"):
        RLConfig.from_config(d)
    c.scheduler.mode = "sideways"
    with pytest.raises(ValueError, match="mode='sideways'"):
        RLConfig.from_config(c)


def test_sft_prompt_is_what_the_proxy_renders():
    """A demonstration's prompt ids are exactly the proxy's rendering of the harness's
    first request for that task, and the target is the scripted reply + end of turn."""
    from gyre_jax.agents.config import HarnessConfig
    from gyre_jax.agents.tasks import make_task
    from gyre_jax.rl.sft import demo_examples
    from gyre_jax.serving.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    task = make_task("tiny", 3, ops=("reverse",))
    hc = HarnessConfig(base_url="http://x.invalid/v1", send_tools_schema=False, max_turns=1)
    [(prompt, target)] = demo_examples([task], hc, tok)
    expected = [tok.bos_id]
    for role, text in (("system", task.system_prompt), ("user", task.prompt)):
        expected += [tok.special["<|im_start|>"]] + tok.encode(role + "\n" + text) + [tok.special["<|im_end|>"]] + tok.encode("\n")
    expected += [tok.special["<|im_start|>"]] + tok.encode("assistant\n")
    assert prompt.tolist() == expected
    answer = task.params["expected"]
    assert target[-1] == tok.special["<|im_end|>"]
    assert tok.decode(target[:-1].tolist()) == (f'<tool>write_file {{"path": "answer.txt", "content": "{answer}"}}</tool>'
                                               "\n<tool>finish</tool>")


def test_sft_warm_start_learns():
    """A few supervised steps on demonstrations lower the NLL of the scripted replies."""
    import jax

    from gyre_jax.agents.config import HarnessConfig
    from gyre_jax.agents.tasks import make_task
    from gyre_jax.model import ModelConfig, init_params
    from gyre_jax.rl.sft import demo_examples, warm_start
    from gyre_jax.serving.tokenizer import ByteTokenizer

    mc = ModelConfig(vocab_size=272, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64,
                     max_seq_len=160)
    hc = HarnessConfig(base_url="http://x.invalid/v1", send_tools_schema=False, max_turns=1, system_prompt="Answer.")
    examples = demo_examples([make_task("tiny", s, ops=("copy",), max_len=3) for s in range(8)], hc, ByteTokenizer())
    params = init_params(mc, jax.random.key(0))
    _, hist = warm_start(params, mc, examples, steps=12, rows=2, row_len=160, learning_rate=1e-2, seed=0,
                         progress=False)
    assert len(hist) == 12 and hist[-1]["loss"] < hist[0]["loss"] - 1.0, hist


@pytest.mark.parametrize("kind", ["reverse", "one_char", "random"])
def test_noisy_demonstrations_corrupt_exactly_the_fraction(kind):
    """noisy_tasks: exactly round(f*n) answers replaced, each differs from the right one but
    keeps its length and alphabet ('reverse': the right one reversed unless a palindrome;
    'one_char': exactly one position differs); the rest untouched; SFT targets carry it."""
    from gyre_jax.agents.config import HarnessConfig
    from gyre_jax.agents.tasks import make_task
    from gyre_jax.agents.tasks.tiny import expected_answer
    from gyre_jax.rl.sft import demo_examples, noisy_tasks
    from gyre_jax.serving.tokenizer import ByteTokenizer

    clean = [make_task("tiny", s, ops=("copy", "sum"), min_len=1, max_len=3) for s in range(40)]
    noisy, mask = noisy_tasks(clean, 0.3, seed=1, kind=kind)
    assert mask.sum() == 12 and len(noisy) == 40
    for c, n, bad in zip(clean, noisy, mask):
        assert n.task_id == c.task_id and n.prompt == c.prompt
        right = expected_answer(c.params["op"], c.params["arg"])
        assert c.params["expected"] == right  # the originals are not mutated
        if not bad:
            assert n.params == c.params
            continue
        wrong = n.params["expected"]
        assert wrong != right and len(wrong) == len(right)
        alphabet = "0123456789" if c.params["op"] == "sum" else "abcdefghijklmnopqrstuvwxyz"
        assert set(wrong) <= set(alphabet)
        n_diff = sum(a != b for a, b in zip(wrong, right))
        if kind == "one_char" or (kind == "reverse" and right == right[::-1]):
            assert n_diff == 1, (right, wrong)
        elif kind == "reverse":
            assert wrong == right[::-1]
    assert noisy_tasks(clean, 0.3, seed=1, kind=kind)[1].tolist() == mask.tolist()  # seeded
    assert noisy_tasks(clean, 0.0, seed=1, kind=kind)[1].sum() == 0
    k = int(mask.argmax())
    hc = HarnessConfig(base_url="http://x.invalid/v1", send_tools_schema=False, max_turns=1, system_prompt="Answer.")
    (_, target), = demo_examples([noisy[k]], hc, ByteTokenizer())
    assert f'"content": "{noisy[k].params["expected"]}"' in ByteTokenizer().decode(target[:-1].tolist())
    with pytest.raises(ValueError, match="fraction"):
        noisy_tasks(clean, 1.0, seed=0)
    with pytest.raises(ValueError, match="kind"):
        noisy_tasks(clean, 0.5, seed=0, kind="shuffle")
    with pytest.raises(ValueError, match="family"):
        noisy_tasks([make_task("repo_spec", 0)], 0.9, seed=0)


def test_give_up_demonstrations_just_finish():
    """noisy kind 'give_up': exactly round(f*n) demonstrations call finish without writing
    (a lazy agent's transcript, graded 0); the others write the right answer."""
    from gyre_jax.agents.config import HarnessConfig
    from gyre_jax.agents.tasks import make_task
    from gyre_jax.rl.sft import demo_examples, noisy_tasks
    from gyre_jax.serving.tokenizer import ByteTokenizer

    clean = [make_task("tiny", s, ops=("copy",), min_len=2, max_len=3) for s in range(10)]
    noisy, mask = noisy_tasks(clean, 0.4, seed=3, kind="give_up")
    assert mask.sum() == 4
    hc = HarnessConfig(base_url="http://x.invalid/v1", send_tools_schema=False, max_turns=1, system_prompt="Answer.")
    tok = ByteTokenizer()
    for task, bad, (_, target) in zip(noisy, mask, demo_examples(noisy, hc, tok)):
        text = tok.decode(target[:-1].tolist())
        if bad:
            assert text == "<tool>finish</tool>", text
        else:
            assert f'"content": "{task.params["expected"]}"' in text and text.endswith("<tool>finish</tool>")


def test_sft_batch_weights_every_demonstrated_token_equally():
    """SFT is token-mean NLL: a short and a long demonstration's tokens weigh the same."""
    import numpy as np

    from gyre_jax.rl.sft import _batch

    examples = [(np.arange(3, 8, dtype=np.int32), np.arange(10, 12, dtype=np.int32)),
                (np.arange(3, 6, dtype=np.int32), np.arange(20, 40, dtype=np.int32))]
    b, _ = _batch(examples, np.arange(2), 0, rows=1, row_len=64)
    w, m = b["loss_weights"], b["loss_mask"]
    assert m.sum() == 2 + 20 + 2  # the batch cycles back to the first example
    assert np.allclose(w[m], 1.0 / 24, rtol=1e-6) and not w[~m].any()


def test_loop_elastic_with_faults(tmp_path):
    """2 elastic steps; every class of fault injected and counted as its class."""
    c = tiny_config("elastic", grader_crash_every=5, timeout_every=7, engine_error_every=3)
    c.harness.deadline_s = 5.0  # the stalled rollouts wait this long; the others need well under 1 s
    c.eval = dict(kind="first_call", every=1, tasks=4, samples_per_task=2, temperature=1.0)  # start + each step
    summary = jobs.get(c.job)(c, str(tmp_path))
    wd = os.path.join(tmp_path, "elastic")
    lines, outs = _check_run(wd, summary, steps=2, rollouts=16)
    assert [r["eval/version"] for r in lines] == [1, 2] and lines[0]["eval/version_start"] == 0
    for r in lines:
        assert 0.0 <= r["eval/reward"] <= 1.0 and 0.0 <= r["eval/format"] <= 1.0 and r["eval/grader_errors"] == 0
    assert summary["eval_first"] == lines[0]["eval/reward_start"] and summary["eval_last"] == lines[-1]["eval/reward"]
    inj = summary["injected_faults"]
    # 16 rollouts: #5, #10, #15 crash their grader; #7, #14 stall; #3, #6, #9, #12 fail once.
    assert inj == {"grader_crash": 3, "timeout": 2, "engine_error": 4}
    st = collections.Counter(o.status for o in outs.values())
    assert st["verifier_error"] == 3 and st["timeout"] == 2 and st["infra_error"] == 0, st
    assert st["completed"] == 11
    for o in outs.values():
        if o.status == "verifier_error":
            assert o.score is None and "injected grader crash" in (o.details.get("error") or "")
        if o.status == "timeout":  # graded on the kept workspace: half the answer -> partial credit
            assert 0.0 < o.score < 1.0, o
    assert summary["engine_errors"] == 4 and summary["retries"] >= 4
    assert sum(r["failures/verifier_error"] for r in lines) == 3
    assert sum(r["failures/timeout"] for r in lines) == 2
    assert summary["util_rollout"] > 0 and summary["util_train"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["colocate", "async"])
def test_loop_baseline_modes(tmp_path, mode):
    c = tiny_config(mode)
    summary = jobs.get(c.job)(c, str(tmp_path))
    lines, outs = _check_run(os.path.join(tmp_path, mode), summary, steps=2, rollouts=16)
    assert summary["mode"] == mode and summary["wall_s"] > 0
    if mode == "colocate":  # on-policy by construction: rollouts of step u start after version u is out
        assert all(r["staleness_max"] == 0 for r in lines)
    if mode == "async":  # fixed split: the core trains, the satellite serves, no switch
        assert summary["switches"] == 0


@pytest.mark.slow
def test_loop_resumes_without_losing_or_retraining(tmp_path):
    c = tiny_config("elastic", steps=2)
    first = jobs.get(c.job)(c, str(tmp_path))
    wd = os.path.join(tmp_path, "elastic")
    _, consumed_before, _ = _outcomes(wd)
    # The resumed run goes on from the costs its workdir holds: told a switch costs a day, it lends the
    # satellite to training no more (the first run, switches measured cheap, did).
    path = os.path.join(wd, "scheduler_costs.json")
    costs = json.load(open(path))
    assert first["switches"] > 0 and costs["switch_round_trip_s"] is not None, (first["switches"], costs)
    with open(path, "w") as f:
        json.dump({**costs, "switch_round_trip_s": 86400.0}, f)
    c.steps = 3
    summary = jobs.get(c.job)(c, str(tmp_path))  # same workdir: resumes at step 2
    assert summary["switches"] == 0 and json.load(open(path))["switch_round_trip_s"] == 86400.0
    outs, consumed, _ = _outcomes(wd)
    assert summary["steps"] == 1
    assert all(consumed[r] == e for r, e in consumed_before.items())  # nothing re-trained
    assert {e["step"] for r, e in consumed.items() if r not in consumed_before} == {2}
    assert set(consumed) == set(outs) or len(outs) - len(consumed) <= 8  # at most one unfinished group's worth


@pytest.mark.slow
def test_full_demo(tmp_path):
    """The README's command (configs/demo.py as is); ~6-8 min on 2 idle cores, up to ~17 on a
    slow or loaded host. RL must raise the held-out reward (fixed tasks, fixed sampling key) over
    the SFT warm start's. Its wall time is the README's measured figure, not asserted here (a
    host's speed is no property of the code: tools/bench_demo_modes.py times the modes)."""
    c = demo_config.get_config()
    c.progress = False
    summary = jobs.get(c.job)(c, str(tmp_path))
    assert summary["steps"] == c.steps, summary
    assert summary["eval_first"] > 0.5, summary  # the SFT warm start works
    assert summary["eval_last"] > summary["eval_first"] + 0.02, summary
    assert summary["reward_last"] > summary["reward_first"], summary
