"""kill -9 the real RL loop mid-step, rerun the same command: it resumes from the last
checkpoint, no finished rollout is lost, none is trained twice (counted by rollout id in
the store), and the losses equal an uninterrupted run's.

The loop runs as ``python -m launch.main --config configs/demo.py --workdir W`` with
``--config.*`` flags equal to ``test_rl_loop.tiny_config`` in colocate mode, greedy
(temperature 0), an entropy bonus (see _config_flags), a checkpoint after every step.
Default run: kill + resume, counted by rollout id (~35 s). Slow: + an uninterrupted
reference run, losses compared exactly (~15 s more). ``--config.faults.pause_at_step=2`` makes
the trainer print ``PAUSED 2`` once step 2 runs on the cells and block before its update
is kept or saved (``gyre_jax.rl.faults.pause_at_step``), so the kill lands at
an exact point of the step, with no sleep and no race.

Why the losses can be equal at all: colocate is on-policy (the groups of step u start
after version u is published, so a step's groups are fixed), greedy decoding makes each
rollout a function of the params, the trainer sorts a step's groups and rollouts by id
before packing (not finishing order), and the elastic step sums micro-batch gradients
in index order. The checkpoint restores params and optimizer state bit for bit.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading

import pytest
from test_rl_loop import tiny_config

from configs import demo as demo_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, PAUSE = 4, 2
ROLLOUTS_PER_STEP = 2 * 4  # tiny_config: groups_per_step x group_size
RUN_TIMEOUT_S = 300  # a hung child is killed (and the test fails) rather than hanging the run


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _config_flags() -> list[str]:
    """``--config.a.b=v`` for every field where the resume config differs from configs/demo.py."""
    c = tiny_config("colocate", steps=STEPS)
    c.harness.temperature = 0.0  # greedy: a step's rollouts are a function of the params
    # Greedy makes a group's rollouts identical, so their rewards are equal and every
    # group-normalized advantage is 0: the policy-gradient loss is exactly 0 at every step
    # and would compare equal whatever the params. The entropy bonus makes the loss and the
    # update depend on the params, the optimizer state and the rollouts' tokens.
    c.train.entropy_coef = 0.01
    base, want = _flat(demo_config.get_config().to_dict()), _flat(c.to_dict())
    assert set(base) == set(want)
    return [f"--config.{k}={v}" for k, v in sorted(want.items()) if v != base[k]]


def _cmd(workdir: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "launch.main", "--config", "configs/demo.py", "--workdir", workdir,
            *_config_flags(), *extra]


def _spawn(workdir: str, log_name: str, *extra: str) -> tuple[subprocess.Popen, threading.Timer]:
    # stderr to a file: a full pipe nobody reads would block the child (absl logs go there).
    err = open(os.path.join(workdir, log_name), "w")
    p = subprocess.Popen(_cmd(workdir, *extra), cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=err, text=True)
    err.close()
    watchdog = threading.Timer(RUN_TIMEOUT_S, p.kill)
    watchdog.start()
    return p, watchdog


def _stderr_tail(workdir: str, log_name: str) -> str:
    with open(os.path.join(workdir, log_name)) as f:
        return f.read()[-4000:]


def _run_to_end(workdir: str, log_name: str) -> str:
    p, watchdog = _spawn(workdir, log_name)
    try:
        out, _ = p.communicate()
    finally:
        watchdog.cancel()
    assert p.returncode == 0, (p.returncode, out[-2000:], _stderr_tail(workdir, log_name))
    return out


def _run_and_kill(workdir: str) -> list[str]:
    """Start with the pause at step PAUSE; SIGKILL as soon as it says PAUSED."""
    p, watchdog = _spawn(workdir, "killed.stderr", f"--config.faults.pause_at_step={PAUSE}")
    lines = []
    try:
        for line in p.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("PAUSED"):
                os.kill(p.pid, signal.SIGKILL)
                break
        p.wait()
    finally:
        watchdog.cancel()
    assert p.returncode == -signal.SIGKILL, (p.returncode, lines, _stderr_tail(workdir, "killed.stderr"))
    assert lines[-1] == f"PAUSED {PAUSE}", lines
    return lines


def _store_view(mode_dir: str):
    from gyre_jax.trajectory.store import TrajectoryStore

    with TrajectoryStore(os.path.join(mode_dir, "store"), run_id="rl", writable=False) as store:
        return {r: store.outcome(r) for r in store.complete_rollouts()}, store.consumed()


def _losses(mode_dir: str) -> list[tuple[int, float, float]]:
    with open(os.path.join(mode_dir, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, f)]


def _check_consumed(outs: dict, consumed: dict) -> None:
    """Every finished rollout consumed exactly once: trained, or dropped with its failure class."""
    assert set(consumed) == set(outs), (sorted(set(outs) - set(consumed)), sorted(set(consumed) - set(outs)))
    for rid, o in outs.items():
        e = consumed[rid]
        if o.is_failure:
            assert e["state"] == "dropped" and e["reason"] == o.status, (rid, e)
        else:
            assert e["state"] == "trained", (rid, e)
    per_step = {}
    for rid, e in consumed.items():
        per_step.setdefault(e["step"], []).append(rid)
    assert sorted(per_step) == list(range(STEPS)), per_step
    assert all(len(v) == ROLLOUTS_PER_STEP for v in per_step.values()), per_step


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    """One kill -9 at step PAUSE and one rerun in the same workdir, with what the store held between."""
    wd = str(tmp_path_factory.mktemp("resume"))
    mode_dir = os.path.join(wd, "colocate")
    lines = _run_and_kill(wd)
    at_kill = _store_view(mode_dir)
    checkpoints_at_kill = sorted(int(d) for d in os.listdir(os.path.join(mode_dir, "checkpoints")) if d.isdigit())
    out = _run_to_end(wd, "resumed.stderr")
    return dict(mode_dir=mode_dir, killed_lines=lines, at_kill=at_kill, checkpoints_at_kill=checkpoints_at_kill,
                resumed_out=out, after=_store_view(mode_dir))


def test_kill9_mid_step_resumes_without_losing_or_retraining(killed_and_resumed):
    r = killed_and_resumed
    # Killed during step PAUSE: checkpoints up to PAUSE (one per finished step), none after.
    assert r["checkpoints_at_kill"][-1] == PAUSE, r["checkpoints_at_kill"]
    outs_kill, consumed_kill = r["at_kill"]
    # Colocate: step PAUSE's groups had all finished before its training started; none trained yet.
    assert len(outs_kill) == (PAUSE + 1) * ROLLOUTS_PER_STEP, sorted(outs_kill)
    assert {e["step"] for e in consumed_kill.values()} == set(range(PAUSE)), consumed_kill
    pending_at_kill = set(outs_kill) - set(consumed_kill)
    assert len(pending_at_kill) == ROLLOUTS_PER_STEP

    # (a) the rerun resumed from the checkpoint of step PAUSE with exactly those rollouts pending.
    m = re.search(r"^rl: resumed from checkpoint step (\d+) \((\d+) finished rollouts to train in (\d+) groups;",
                  r["resumed_out"], re.M)
    assert m, r["resumed_out"][-2000:]
    assert (int(m.group(1)), int(m.group(2)), int(m.group(3))) == (PAUSE, ROLLOUTS_PER_STEP, 2)

    # (b) by rollout id, across both processes: what the killed run consumed is unchanged
    # (not trained again), the rollouts it finished but did not train are trained in step
    # PAUSE of the rerun (not lost, not regenerated), and every finished rollout is consumed once.
    outs, consumed = r["after"]
    assert set(outs_kill) <= set(outs) and len(outs) == STEPS * ROLLOUTS_PER_STEP
    for rid, e in consumed_kill.items():
        assert consumed[rid] == e, (rid, consumed[rid], e)
    assert {rid for rid, e in consumed.items() if e["step"] == PAUSE} == pending_at_kill
    assert all(consumed[rid]["state"] == "trained" for rid in pending_at_kill if not outs[rid].is_failure)
    _check_consumed(outs, consumed)
    assert [s for s, *_ in _losses(r["mode_dir"])] == list(range(STEPS))


@pytest.mark.slow
def test_resumed_losses_equal_an_uninterrupted_run(killed_and_resumed, tmp_path):
    """(c) per-step losses of the resumed lineage == a reference run's; (d) same rollouts per step."""
    _run_to_end(str(tmp_path), "reference.stderr")
    ref_dir = os.path.join(tmp_path, "colocate")
    ref_outs, ref_consumed = _store_view(ref_dir)
    _check_consumed(ref_outs, ref_consumed)
    outs, consumed = killed_and_resumed["after"]
    assert {rid: e["step"] for rid, e in consumed.items()} == {rid: e["step"] for rid, e in ref_consumed.items()}
    assert {rid: (o.status, o.score) for rid, o in outs.items()} == {rid: (o.status, o.score)
                                                                    for rid, o in ref_outs.items()}
    # Exact: same rollouts (greedy, same params), same packing order (sorted by id), same
    # compiled programs, gradients summed in micro-batch order, bit-exact checkpoint restore.
    resumed, ref = _losses(killed_and_resumed["mode_dir"]), _losses(ref_dir)
    losses = [loss for _, loss, _ in ref]
    assert all(loss != 0.0 for loss in losses) and len(set(losses)) == STEPS, ref  # not a vacuous comparison
    assert resumed == ref


def test_the_resumed_runs_summary_and_timeline_cover_both_attempts(killed_and_resumed):
    """summary.json's top level and timeline.png are the whole run's, the killed attempt's steps and time
    included (they covered the resumed part alone: steps 2-3 here); ``attempt`` is the resumed part."""
    mode_dir = killed_and_resumed["mode_dir"]
    with open(os.path.join(mode_dir, "summary.json")) as f:
        summary = json.load(f)
    assert (summary["steps"], summary.get("first_step")) == (STEPS, 0), summary  # the resumed part: 2 steps
    assert summary["attempts"] == 2
    assert (summary["attempt"]["steps"], summary["attempt"]["first_step"]) == (STEPS - PAUSE, PAUSE)
    with open(os.path.join(mode_dir, "metrics.jsonl")) as f:
        rewards = {r["step"]: r["reward"] for r in map(json.loads, f)}
    assert summary["reward_first"] == pytest.approx(rewards[0])  # the killed attempt's first step
    # What timeline.png is drawn from: both attempts on one axis, the restart at the killed one's end.
    from gyre_jax.rl import attempts as attempts_lib

    attempts = attempts_lib.read_all(mode_dir)
    assert [a["status"] for a in attempts] == ["killed", "finished"], attempts
    segments, step_ends, restarts, total = attempts_lib.whole_timeline(attempts)
    assert [s for s, _ in step_ends] == list(range(STEPS)), step_ends
    assert [(a, s) for _, a, s in restarts] == [(1, PAUSE)]
    assert min(t0 for _, t0, _, _ in segments) < restarts[0][0] < max(t1 for _, _, t1, _ in segments)
    assert summary["rl_s"] == pytest.approx(total) and summary["rl_s"] > summary["attempt"]["rl_s"]
    assert os.path.getsize(os.path.join(mode_dir, "timeline.png")) > 1000
