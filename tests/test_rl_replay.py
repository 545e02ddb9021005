"""A resume replays what a rewind removed: kill -9 at step j with the last checkpoint at k < j, and the
resumed run's versions k+1..j equal the crashed run's, bit for bit (the params hash per version in
metrics.jsonl), with the same groups in the same order, and no step resized.

The real loop (cells, elastic steps, proxy, harness, graders, store, checkpoints) on fake engines
(``gyre_jax.testing.fake_engine``), streaming (elastic mode: a step's groups are the ones that
finished first, so the crashed run's steps cannot be rebuilt from the rollouts alone). The first
attempt runs in a child process that stops at step j (``faults.pause_at_step`` prints ``PAUSED j``
with the step's update not yet kept) and is killed with SIGKILL there; the resume runs in this one.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

from test_rl_failures import assert_consumed_once, fake_config, store_view

from gyre_jax.rl.audit import audit_workdir
from gyre_jax.rl.build import build
from gyre_jax.rl.loop import drive
from gyre_jax.testing.fake_engine import fake_tiny_backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, EVERY, KILL_AT = 6, 3, 5  # checkpoints 0, 3, (6); killed in step 5: versions 4 and 5 are lost with it
ATTEMPT = f"""
import sys
sys.path.insert(0, "tests")
from gyre_jax.rl.build import build
from gyre_jax.rl.loop import drive
from gyre_jax.testing.fake_engine import fake_tiny_backend
from test_rl_failures import fake_config
drive(build(fake_config({STEPS}, checkpoint_every={EVERY}, **{{"faults.pause_at_step": {KILL_AT}}}), sys.argv[1],
            make_backend=fake_tiny_backend))
"""


def _records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _kill_at_pause(wd: str) -> None:
    err = open(os.path.join(os.path.dirname(wd), "attempt1.stderr"), "w")
    p = subprocess.Popen([sys.executable, "-c", ATTEMPT, wd], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=err, text=True)
    err.close()
    watchdog = threading.Timer(600, p.kill)
    watchdog.start()
    try:
        for line in p.stdout:
            if line.startswith("PAUSED"):
                os.kill(p.pid, signal.SIGKILL)
                break
        p.wait()
    finally:
        watchdog.cancel()
    assert p.returncode == -signal.SIGKILL, open(os.path.join(os.path.dirname(wd), "attempt1.stderr")).read()[-3000:]


def test_a_kill_9_resume_replays_the_lost_steps_bit_for_bit(tmp_path, capsys):
    wd = str(tmp_path / "elastic")
    _kill_at_pause(wd)
    crashed = {r["step"]: r for r in _records(os.path.join(wd, "metrics.jsonl"))}
    assert sorted(crashed) == list(range(KILL_AT))  # steps 0..4 recorded, step 5 killed before its update
    ckpts = sorted(int(d) for d in os.listdir(os.path.join(wd, "checkpoints")) if d.isdigit())
    assert ckpts[-1] == EVERY, ckpts  # the rewind goes to checkpoint 3: versions 4 and 5 are lost

    summary = drive(build(fake_config(STEPS, checkpoint_every=EVERY), wd, make_backend=fake_tiny_backend))
    out = capsys.readouterr().out
    assert summary["attempt"]["steps"] == STEPS - EVERY  # this attempt recorded steps 3..5: two replayed, one new
    assert summary["steps"] == STEPS and summary["attempts"] == 2  # the run's: the lost steps counted once
    assert f"replayed steps {EVERY}..{KILL_AT - 1} from their records" in out, out[-3000:]
    final = {r["step"]: r for r in _records(os.path.join(wd, "metrics.jsonl"))}
    assert sorted(final) == list(range(STEPS))
    for s in range(EVERY, KILL_AT):  # versions k+1..j: the crashed run's, bit for bit, from the same groups
        assert final[s]["resume/replayed"] == 1, final[s]
        assert (final[s]["groups"], final[s]["params_hash"]) == (crashed[s]["groups"], crashed[s]["params_hash"]), s
        assert final[s]["loss"] == crashed[s]["loss"], s
    for s in range(EVERY):
        assert final[s]["params_hash"] == crashed[s]["params_hash"]  # kept as they were
    assert all(final[s]["resume/replayed"] == 0 for s in range(KILL_AT, STEPS))
    assert len({r["params_hash"] for r in final.values()}) == STEPS  # the hash tells versions apart
    purged = _records(os.path.join(wd, "metrics.purged.jsonl"))  # the crashed run's lines of the lost steps
    assert {r["step"]: r["params_hash"] for r in purged} == {s: crashed[s]["params_hash"] for s in range(EVERY, KILL_AT)}

    outs, consumed, unfinished = store_view(wd)
    assert unfinished == []
    assert_consumed_once(outs, consumed)
    s = fake_config(STEPS).scheduler
    au = audit_workdir(wd, group_size=s.group_size, staleness_bound=s.staleness_bound)
    assert (au["rollouts_lost"], au["rollouts_trained_twice"], au["groups_short"], au["duplicate_steps"]) == (0, 0, 0, 0)
    assert au["oversized_steps"] == 0, au  # nothing resized: every lost step was replayed
    assert au["replayed_steps"] == KILL_AT - EVERY and au["params_hash_differ"] == 0, au
    assert au["params_hash_equal"] == KILL_AT - EVERY, au
    assert not os.path.exists(os.path.join(wd, "replay_plan.json"))  # dropped once the replay is done
