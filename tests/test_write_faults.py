"""The write-fault injector (gyre_jax.testing.faulty_main) at each write site, on the real parts.

Default (seconds): each store site's injected error becomes the store's StorageError naming its file, the
store's memory stays what its disk says, a broken site stays broken, and undoing the injection makes the
same writes succeed; the checkpoint site becomes a StorageError naming the checkpoint directory; the
publisher site fails the publication. Slow: a whole demo attempt through ``python -m
gyre_jax.testing.faulty_main`` stops by itself with one ``error:`` line and exit 3, and ``launch.main`` on the
same workdir resumes to the end with nothing lost, trained twice or short (``gyre_jax.rl.audit``).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import jax.numpy as jnp
import pytest

from gyre_jax.errors import StorageError
from gyre_jax.testing import faulty_main
from gyre_jax.trajectory.store import LOG_NAME, StoreConfig, TrajectoryStore
from test_store import call, outcome

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Injector:
    def __init__(self):
        self._undo: list = []

    def __call__(self, site: str, n: int) -> faulty_main.FaultPlan:
        plan = faulty_main.FaultPlan(site, n)
        self._undo.append(faulty_main.install(plan))
        return plan

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()


@pytest.fixture
def inject():
    i = _Injector()
    yield i
    i.undo()


@pytest.mark.parametrize("site, write, errtext", [
    ("call", lambda s, r: s.append(call(r, 0)), "No space left on device"),
    ("outcome", lambda s, r: s.append(outcome(r)), "Input/output error"),
    ("log_sync", lambda s, r: s.append(call(r, 0)), "Input/output error"),
])
def test_a_store_frame_fault_is_a_storage_error_and_memory_stays_as_on_disk(tmp_path, inject, capsys, site, write,
                                                                            errtext):
    d = str(tmp_path)
    st = TrajectoryStore(d, run_id="run", config=StoreConfig(fsync="always"))
    st.append(call("a", 0))
    inject(site, 1)
    with pytest.raises(StorageError, match=errtext) as e:
        write(st, "a" if site == "outcome" else "b")
    assert os.path.join(d, LOG_NAME) in str(e.value)
    assert f"{faulty_main.INJECTED} {'ENOSPC' if site == 'call' else 'EIO'} at {site} (write 1)" in capsys.readouterr().err
    with TrajectoryStore(d, writable=False) as disk:
        on_disk = sorted(disk.rollout_ids()), disk.outcome("a")
    if site != "log_sync":  # the frame was cut back: memory and disk agree that it never happened
        assert (sorted(st.rollout_ids()), st.outcome("a")) == on_disk == (["a"], None)
    with pytest.raises(StorageError):  # a broken disk stays broken
        write(st, "c")


def test_a_cursor_fault_un_consumes_and_the_checkpoint_and_publisher_faults_raise(tmp_path, inject, capsys):
    from gyre_jax.cells.publish import WeightPublisher
    from gyre_jax.rl.checkpoint import CheckpointConfig, Checkpointer

    d = str(tmp_path / "store")
    st = TrajectoryStore(d, run_id="run")
    for r in ("a", "b"):
        st.append(call(r, 0))
        st.append(outcome(r))
    inject("cursor", 2)
    st.mark_trained(["a"], step=0)
    with pytest.raises(StorageError, match="cursor.jsonl.*No space left"):
        st.mark_trained(["b"], step=1)
    assert sorted(st.consumed()) == ["a"]
    with TrajectoryStore(d, writable=False) as disk:
        assert sorted(disk.consumed()) == ["a"]

    inject("checkpoint", 1)
    ck = Checkpointer(CheckpointConfig(directory=str(tmp_path / "ckpt"), async_save=False))
    with pytest.raises(StorageError, match="writing a checkpoint in .*ckpt: No space left on device"):
        ck.save(0, train_state={"w": jnp.zeros(2)}, store_cursor=st.cursor_state(), force=True)
    assert ck.all_steps() == []
    ck.close()

    inject("publisher", 1)
    with pytest.raises(OSError, match="injected by faulty_main at publisher"):
        WeightPublisher(None, None).publish(None, 1, None)
    err = capsys.readouterr().err
    assert all(f"at {s} (write" in err for s in ("cursor", "checkpoint", "publisher")), err
    st.close()


def test_bad_fault_flags_are_one_line():
    for arg, text in (("--fault=disk:1", "unknown site 'disk'"), ("--fault=call:0", "counts writes from 1")):
        with pytest.raises(SystemExit, match=text):
            faulty_main.parse([arg])
    with pytest.raises(SystemExit, match="exactly one"):
        faulty_main.parse(["--config", "x"])


@pytest.mark.slow  # a demo attempt and its rerun: ~1 min of CPU
def test_an_injected_outcome_fault_stops_the_demo_and_the_rerun_resumes(tmp_path):
    from configs import demo as demo_config
    from gyre_jax.rl.audit import audit_workdir
    from test_rl_stop import TINY

    wd = str(tmp_path)
    flags = ["--config", "configs/demo.py", "--workdir", wd, *TINY, "--config.steps=3", "--config.sft.steps=2",
             "--config.progress=False"]
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "gyre_jax.testing.faulty_main", "--fault=outcome:6", *flags], cwd=ROOT,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 3, (p.returncode, p.stderr[-3000:])
    assert lines[-1].startswith("error: storage failed: appending to") and "Input/output error" in lines[-1], lines[-5:]
    assert sum(x.startswith("error:") for x in lines) == 1 and any(faulty_main.INJECTED in x for x in lines)
    assert time.monotonic() - t0 < 600
    done = subprocess.run([sys.executable, "-m", "launch.main", *flags], cwd=ROOT, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    au = audit_workdir(os.path.join(wd, "elastic"), group_size=4,
                       staleness_bound=demo_config.get_config().scheduler.staleness_bound)
    assert (au["rollouts_lost"], au["rollouts_trained_twice"], au["groups_short"], au["duplicate_steps"]) == (0, 0, 0, 0)


@pytest.mark.slow  # two short runs of the loop on fake engines: ~1-3 min under load
def test_a_fault_before_the_first_periodic_checkpoint_loses_nothing(tmp_path, inject):
    """The fifth outcome fails (step 0 has two groups of four: the first group is finished, the second cut
    short) before any update: the rerun must resume from the starting policy's checkpoint 0 and train the
    finished group, not start afresh past the store's finished rollouts (which lost them: audit lost=5 in
    bench_chaos's outcome trial)."""
    from gyre_jax.rl.build import build
    from gyre_jax.rl.loop import drive
    from gyre_jax.testing.fake_engine import fake_tiny_backend
    from test_rl_failures import assert_consumed_once, fake_config, store_view

    wd = str(tmp_path / "elastic")
    inject("outcome", 5)
    with pytest.raises(StorageError, match="Input/output error"):
        drive(build(fake_config(2), wd, make_backend=fake_tiny_backend))
    outs_at_stop, _, _ = store_view(wd)
    assert len(outs_at_stop) == 4
    inject.undo()
    summary = drive(build(fake_config(2), wd, make_backend=fake_tiny_backend))
    assert summary["steps"] == 2
    outs, consumed, unfinished = store_view(wd)
    assert unfinished == [] and set(outs_at_stop) <= set(consumed)
    assert_consumed_once(outs, consumed)


def _drive_within(c, seconds: float) -> dict:
    """``drive(c)``, stopped with RunFailed naming the stall if it is not done within ``seconds``."""
    import threading

    from gyre_jax.rl.loop import drive

    def stall():
        c.launcher.errors.append(TimeoutError(f"stalled: not done after {seconds:.0f}s at step "
                                              f"{c.trainer.steps_done}, in_flight={c.launcher.running_rollouts()}"))
        c.wake.set()

    timer = threading.Timer(seconds, stall)
    timer.start()
    try:
        return drive(c)
    finally:
        timer.cancel()


def test_a_resume_from_checkpoint_0_past_the_bound_trains_everything_within_the_bound(tmp_path, inject, capsys):
    """A stop in step 1 or 2 (a kill: no save after it) with only checkpoint 0 on disk: the rerun rewinds to version 0 with more
    groups (finished, and cut short) than steps 0..S hold, none old enough to be a must-take at step 0.
    The take rule refused them all and nothing was launched: the run sat at step 0 with in_flight=0
    (bench_chaos's outcome trial, 13 min, twice). Then the oldest were taken and the excess trained a step
    late (bench_chaos: staleness 2, bound 1). Now steps 0..S take more groups each (policy.resume_step_sizes):
    every finished rollout is consumed once and every trained one within the bound."""
    from gyre_jax.rl.audit import audit_workdir
    from gyre_jax.rl.build import build
    from gyre_jax.rl.loop import drive
    from gyre_jax.testing.fake_engine import fake_tiny_backend
    from test_rl_failures import assert_consumed_once, fake_config, store_view

    wd = str(tmp_path / "elastic")
    cfg = fake_config(4, checkpoint_every=100)  # checkpoint 0 and the last: a stop in between rewinds to 0
    inject("outcome", 21)  # 20 outcomes written: past step 0's 8 rollouts, in steps 1-2
    with pytest.raises(StorageError, match="Input/output error"):
        drive(build(cfg, wd, make_backend=fake_tiny_backend))
    ckpts = os.path.join(wd, "checkpoints")
    for step in os.listdir(ckpts):  # what a kill -9 leaves: no save after the failure, only checkpoint 0
        if step.isdigit() and int(step) > 0:
            shutil.rmtree(os.path.join(ckpts, step))
    outs_at_stop, _, _ = store_view(wd)
    inject.undo()
    capsys.readouterr()
    c = build(cfg, wd, make_backend=fake_tiny_backend)
    resumed = capsys.readouterr().out
    s = cfg.scheduler
    groups = len(c.trainer.progress().ready_groups) + sum(c.launcher.running_groups().values())
    assert "resumed from checkpoint step 0" in resumed and groups > s.groups_per_step * (1 + s.staleness_bound), \
        (groups, resumed)  # the rewind really is past the bound (else this tests nothing)
    summary = _drive_within(c, 240)  # ~35 s under load; the stall waited for ever
    assert summary["steps"] == 4
    outs, consumed, unfinished = store_view(wd)
    assert unfinished == [] and set(outs_at_stop) <= set(consumed)
    assert_consumed_once(outs, consumed)
    au = audit_workdir(wd, group_size=s.group_size, staleness_bound=s.staleness_bound)
    assert au["max_staleness_over_bound"] == 0 and au["groups_short"] == 0, au
    assert au["rollouts_trained_twice"] == 0 and au["duplicate_steps"] == 0, au
    # the trainer's own staleness (the lost lineage's tokens dated by the restored version) holds the bound too
    recs = [json.loads(line) for line in open(os.path.join(wd, "metrics.jsonl")) if line.strip()]
    assert max(r["staleness_max"] for r in recs) <= s.staleness_bound, [r["staleness_max"] for r in recs]
    assert au["oversized_steps"] >= 1 and au["extra_groups"] > 0, au  # steps 0..S really were oversized
