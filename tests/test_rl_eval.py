"""Held-out eval (gyre_jax.rl.evaluate): the sampler against a plain full-forward loop, the
scoring path on hand-written replies, and config validation. Tiny shapes, a few seconds."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gyre_jax.agents.tasks import make_task
from gyre_jax.model import Transformer
from gyre_jax.rl.evaluate import HeldOutEval, first_call_prompt
from gyre_jax.serving.tokenizer import ByteTokenizer
from gyre_jax.testing.tiny_serving_model import CFG, sharp_params

TOK = ByteTokenizer()
IM_END = TOK.special["<|im_end|>"]
N_NEW = 10


def _tasks():
    # Different ops and argument lengths -> prompts of different lengths (the padding path).
    return [make_task("tiny", 2, ops=("copy",), min_len=1, max_len=1),
            make_task("tiny", 5, ops=("reverse",), min_len=4, max_len=4),
            make_task("tiny", 9, ops=("upper",), min_len=7, max_len=7)]


def _eval(tasks, *, temperature, samples=1, max_len=128, seed=0, max_tokens=N_NEW):
    return HeldOutEval(CFG, tasks, TOK, system_prompt="Answer.", samples_per_task=samples, max_tokens=max_tokens,
                       temperature=temperature, seed=seed, max_len=max_len)


@jax.jit
def _full_logp(params, tokens_L):
    """log-softmax of every position of one sequence, by the training forward (no cache)."""
    (n,) = tokens_L.shape
    ones = jnp.ones((1, n), jnp.int32)
    logits = Transformer(CFG).apply(params, tokens_L[None], jnp.arange(n, dtype=jnp.int32)[None], ones, ones * n)
    return jax.nn.log_softmax(logits[0].astype(jnp.float32))


def _reference_greedy(params, prompt, n_new, buf_len):
    """Greedy decoding by re-running the full model on the growing sequence (causal, so
    the zero padding after the current length cannot change the logits read)."""
    seq = list(prompt)
    toks, logps = [], []
    for _ in range(n_new):
        buf = np.zeros(buf_len, np.int32)
        buf[:len(seq)] = seq
        lp = np.asarray(_full_logp(params, jnp.asarray(buf)))[len(seq) - 1]
        t = int(np.argmax(lp))
        toks.append(t)
        logps.append(lp[t])
        seq.append(t)
    return toks, np.asarray(logps)


def test_greedy_sampler_matches_full_forward_loop():
    params = sharp_params(seed=3)
    tasks = _tasks()
    ev = _eval(tasks, temperature=0.0)
    assert len(set(ev.lengths_S.tolist())) == 3  # three different prompt lengths, padded to one
    toks, logps = ev.sample(params)
    assert toks.shape == logps.shape == (3, N_NEW)
    buf_len = int(ev.lengths_S.max()) + N_NEW
    for i, task in enumerate(tasks):
        prompt = first_call_prompt(task, TOK, "Answer.")
        assert ev.prompts_SxT[i, :ev.lengths_S[i]].tolist() == prompt
        ref_toks, ref_logps = _reference_greedy(params, prompt, N_NEW, buf_len)
        assert toks[i].tolist() == ref_toks, i
        np.testing.assert_allclose(logps[i], ref_logps, atol=1e-4, rtol=0)
    assert len({tuple(t) for t in toks.tolist()}) > 1  # the prompts matter (not a constant output)


def test_temperature_sampling_is_fixed_by_seed_and_logps_are_the_models():
    """Temperature 1: the same key gives the same samples at every call (evals differ only by
    params); a different seed gives others; each sampled token's log-prob is the full
    forward's on the sampled sequence."""
    params = sharp_params(seed=4, scale=1.0)
    tasks = _tasks()[:2]
    ev = _eval(tasks, temperature=1.0, samples=4, max_tokens=8)
    t1, lp1 = ev.sample(params)
    t2, _ = ev.sample(params)
    assert (t1 == t2).all()
    t3, _ = _eval(tasks, temperature=1.0, samples=4, max_tokens=8, seed=1).sample(params)
    assert not (t1 == t3).all()
    assert len({tuple(r) for r in t1[:4].tolist()}) > 1  # samples of one task differ from each other
    for i in range(t1.shape[0]):
        n = int(ev.lengths_S[i])
        seq = np.concatenate([ev.prompts_SxT[i, :n], t1[i]]).astype(np.int32)
        full = np.asarray(_full_logp(params, jnp.asarray(seq)))
        ref = full[np.arange(n - 1, n - 1 + 8), t1[i]]
        np.testing.assert_allclose(lp1[i], ref, atol=1e-4, rtol=0)


def _call(content):
    return f'<tool>write_file {{"path": "answer.txt", "content": "{content}"}}</tool>'


def test_scoring_of_known_replies():
    task = make_task("tiny", 11, ops=("copy",), min_len=4, max_len=4)
    exp = task.params["expected"]
    wrong = exp[:2] + ("z" if exp[2] != "z" else "y") + exp[3]  # 3 of 4 characters right
    replies = [
        _call(exp) + "\n<tool>finish</tool>",  # right: 1.0, parsed
        _call(wrong) + "\n<tool>finish</tool>",  # char_match partial credit 3/4, parsed
        "I think the answer is " + exp,  # no tool call: 0.0, not parsed
        _call(exp),  # no finish: the write still counts (1.0), parsed
        "<tool>finish</tool>" + _call(exp),  # finish first: nothing written (0.0), parsed
        'garbage <tool>write_file {"path": ',  # unterminated: 0.0, not parsed
    ]
    outputs = [TOK.encode(r) + [IM_END] for r in replies]
    outputs.append(TOK.encode("oops") + [IM_END] + TOK.encode(_call(exp)))  # a call after <|im_end|> is cut: 0.0
    ev = _eval([task], temperature=1.0, samples=len(outputs))
    r = ev.score_outputs(outputs)
    scores = [1.0, 0.75, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert r["eval_reward"] == pytest.approx(np.mean(scores), abs=1e-12)
    assert r["eval_exact"] == pytest.approx(2 / 7, abs=1e-12)
    assert r["eval_format"] == pytest.approx(4 / 7, abs=1e-12)
    assert r["eval_grader_errors"] == 0
    with pytest.raises(ValueError, match="outputs"):
        ev.score_outputs(outputs[:3])


def test_grader_failure_is_not_a_score():
    """A grader that raises (here: inconsistent task params) is counted, not scored 0."""
    good = make_task("tiny", 11, ops=("copy",), min_len=4, max_len=4)
    bad = dataclasses.replace(good, params={**good.params, "expected": "nope"})
    ev = _eval([good, bad], temperature=1.0, samples=1)
    r = ev.score_outputs([TOK.encode(_call(good.params["expected"])), TOK.encode(_call("nope"))])
    assert r["eval_reward"] == 1.0 and r["eval_grader_errors"] == 1


def test_config_and_size_validation_name_the_field():
    from configs import demo as demo_config
    from gyre_jax.rl.config import RLConfig

    c = demo_config.get_config()
    c.eval = dict(every=2, tasks=4, samples_per_task=0, temperature=1.0)
    with pytest.raises(ValueError, match="config.eval.samples_per_task"):
        RLConfig.from_config(c)
    c.eval = dict(every=-1)
    with pytest.raises(ValueError, match="config.eval.every"):
        RLConfig.from_config(c)
    c.eval = dict(every=2, temperature=-0.5)
    with pytest.raises(ValueError, match="config.eval.temperature"):
        RLConfig.from_config(c)
    c.eval = dict(everyy=2)
    with pytest.raises(ValueError, match="unknown field.*everyy"):
        RLConfig.from_config(c)
    c.eval = dict(every=3)
    assert RLConfig.from_config(c).eval.every == 3
    c.eval = dict(deadline_scale=0.0)
    with pytest.raises(ValueError, match="config.eval.deadline_scale"):
        RLConfig.from_config(c)
    with pytest.raises(ValueError, match="max_len=40 cannot hold"):
        _eval(_tasks(), temperature=0.0, max_len=40)
    with pytest.raises(ValueError, match="max_seq_len"):
        _eval(_tasks(), temperature=0.0, max_len=CFG.max_seq_len + 1)


def test_eval_runs_a_replys_commands_in_the_rollout_sandbox(tmp_path):
    """A held-out reply's `run` call is model output: it runs confined like a rollout's commands
    (the host file it aims at is never written; with kind 'none' it is, so the test can fail)."""
    from gyre_jax.agents.sandbox import SandboxConfig, bwrap_usable
    from gyre_jax.rl.evaluate import score_text

    ok, why = bwrap_usable()
    if not ok:
        pytest.skip(f"bubblewrap cannot run here: {why}")
    task = make_task("repo_spec", 3)
    assert "run" in task.tools
    target = tmp_path / "escaped.txt"
    reply = f'<tool>run {{"command": "echo pwned > {target}"}}</tool><tool>finish</tool>'
    score, parsed = score_text(task, reply, SandboxConfig(kind="bubblewrap"))
    assert parsed and score is not None and not target.exists()
    score_text(task, reply, SandboxConfig(kind="none"))
    assert target.read_text() == "pwned\n"


def test_episode_eval_gives_its_episodes_the_scaled_deadline(tmp_path):
    """The eval's harness is the run's, with harness.deadline_s x eval.deadline_scale (a run's own load must not
    score as the policy's timeouts), its temperature and as many episodes in flight as the engine has slots."""
    from configs import demo as demo_config
    from gyre_jax.rl.config import RLConfig
    from gyre_jax.rl.evaluators import make_evaluator

    c = demo_config.get_config()
    c.eval.kind, c.eval.deadline_scale, c.eval.temperature = "episodes", 3.0, 0.5
    cfg = RLConfig.from_config(c)
    ev = make_evaluator(cfg, ByteTokenizer(), None, lambda *a: None, str(tmp_path))
    hc = ev.fn.hc
    assert hc.deadline_s == pytest.approx(cfg.harness.deadline_s * 3.0) and hc.temperature == 0.5
    assert hc.concurrency == max(cfg.scheduler.group_size, cfg.cells.max_slots)
