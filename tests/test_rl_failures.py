"""The loop's failure model and modes, on the real cells with fake engines (fast):

* streaming (elastic) vs batch (async) modes at one update per publication: a chunk of
  rows per group, rescaled by nominal / trained rollouts, vs one chunk per step;
* multi-step mode (k = 2 updates per publication): rows stream into running steps,
  the engines only ever load every k-th version, staleness stays within S, grader
  crashes make the step's trained rollouts fewer than nominal and the update is
  rescaled (grad_scale), every finished rollout is consumed once;
* a failure the run cannot survive (the core fails when a step starts): drive saves
  what it can and raises RunFailed with one line; the same config run again resumes,
  re-runs the rollouts the stop cut off so no group trains short, and every finished
  rollout is consumed exactly once;
* ``resume_plan`` on a store a stop left behind: complete groups train, short ones
  (some rollouts finished, some cut off in flight, some never recorded) get their cut-off
  attempts an ``infra_error`` outcome and their missing slots new attempt ids;
* bad config values through ``python -m launch.main``: exit 2 within seconds, one line
  naming the field; ``--help`` lists the distributed flags;
* progress off a terminal: one line per step, no carriage returns.
"""
from __future__ import annotations

import collections
import dataclasses
import io
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from configs import demo as demo_config
from gyre_jax.errors import RunFailed
from gyre_jax.rl.build import build
from gyre_jax.rl.config import RLConfig
from gyre_jax.rl.loop import drive
from gyre_jax.rl.progress import Progress
from gyre_jax.testing.fake_engine import fake_tiny_backend
from gyre_jax.trajectory.store import TrajectoryStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fake_config(steps: int, **over) -> RLConfig:
    c = demo_config.get_config()
    c.update(dict(steps=steps, progress=False, checkpoint_every=1, first_last=1))
    c.model.update(dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64))
    c.cells.update(dict(cell_size=2, max_slots=4))
    c.scheduler.update(dict(groups_per_step=2, group_size=4, min_work_per_switch_s=0.0))
    c.sft.steps = 0
    c.eval.every = 0
    for k, v in over.items():
        section, _, field = k.partition(".")
        if field:
            c[section][field] = v
        else:
            c[section] = v
    return RLConfig.from_config(c)


def store_view(wd: str):
    with TrajectoryStore(os.path.join(wd, "store"), run_id="rl", writable=False) as store:
        outs = {r: store.outcome(r) for r in store.complete_rollouts()}
        return outs, store.consumed(), store.unfinished_rollouts()


def assert_consumed_once(outs, consumed):
    assert set(consumed) == set(outs), (sorted(set(outs) - set(consumed)), sorted(set(consumed) - set(outs)))
    for rid, o in outs.items():
        assert consumed[rid]["state"] == ("dropped" if o.is_failure else "trained"), (rid, consumed[rid])


def test_multi_step_mode_streams_rows_and_publishes_every_k(tmp_path):
    cfg = fake_config(4, **{"scheduler.updates_per_publication": 2, "scheduler.staleness_bound": 1,
                            "faults.grader_crash_every": 3})
    c = build(cfg, str(tmp_path / "elastic"), make_backend=fake_tiny_backend)
    engines = dict(c.pool.backends)
    summary = drive(c)
    assert summary["steps"] == 4 and summary["updates_per_publication"] == 2
    assert 0 <= summary["staleness_mean"] <= summary["staleness_max"] <= 1  # reported, and within S
    lines = [json.loads(x) for x in open(tmp_path / "elastic" / "metrics.jsonl")]
    # Grader crashes: fewer trained rollouts than nominal, the update rescaled by exactly that ratio.
    for r in lines:
        assert r["grad_scale"] == pytest.approx(8 / r["trained_rollouts"]), r
        # The step's weights, rescaled, sum to 1 (rollout-first mean over the global step): the reported
        # scale alone passes a step whose rows were normalised wrongly, which AdamW then hides.
        assert r["loss/weight_sum"] == pytest.approx(1.0, rel=1e-5), r
    assert any(r["grad_scale"] > 1 for r in lines)
    for e in engines.values():  # publications every 2 updates: engines never see an odd version
        assert all(v % 2 == 0 for v in e.engine.loads), e.engine.loads
    assert any(e.engine.loads for e in engines.values())
    outs, consumed, unfinished = store_view(str(tmp_path / "elastic"))
    assert unfinished == [] and len(outs) == 4 * 8
    assert_consumed_once(outs, consumed)


@pytest.mark.parametrize("mode", ["elastic", "async"])
def test_streaming_modes_train_each_group_as_taken_batch_modes_the_whole_step(tmp_path, mode):
    """One update per publication. elastic (streaming): each group is a chunk of rows the
    running step trains while later groups run, and the update is rescaled by nominal /
    trained rollouts (grader crashes make them fewer); async (a batch mode): the whole
    step is one globally shuffled chunk, normalized over its trained rollouts."""
    # Two steps: the second streams into a run whose first update is out; 16 rollouts, crashes at #3, 6, ... 15.
    cfg = fake_config(2, **{"scheduler.mode": mode, "faults.grader_crash_every": 3})
    summary = drive(build(cfg, str(tmp_path / mode), make_backend=fake_tiny_backend))
    assert summary["steps"] == 2
    lines = [json.loads(x) for x in open(tmp_path / mode / "metrics.jsonl")]
    assert len(lines) == 2
    for r in lines:
        assert r["after_last_group_s"] >= 0, r
        assert r["loss/weight_sum"] == pytest.approx(1.0, rel=1e-5), r  # normalised over the global step
        if mode == "elastic":
            assert r["row_chunks"] == 2, r  # groups_per_step
            assert r["grad_scale"] == pytest.approx(8 / r["trained_rollouts"]), r
        else:
            assert r["row_chunks"] == 1 and r["grad_scale"] == 1.0, r
    assert any(r["trained_rollouts"] < 8 for r in lines)  # the crashes reached a step
    outs, consumed, unfinished = store_view(str(tmp_path / mode))
    assert unfinished == [] and len(outs) == 2 * 8
    assert_consumed_once(outs, consumed)


@pytest.mark.slow  # ~95 s; resume after a crash stays in the default run (test_rl_resume, test_pods_rl)
def test_an_unsurvivable_failure_saves_and_the_rerun_resumes(tmp_path):
    wd = str(tmp_path / "elastic")
    failing = fake_config(4, **{"faults.core_fail_at_step": 2})
    with pytest.raises(RunFailed) as e:
        drive(build(failing, wd, make_backend=fake_tiny_backend))
    msg = str(e.value)
    assert "\n" not in msg and "step 2" in msg and "injected failure of the core" in msg and "rerun" in msg, msg
    outs_at_stop, consumed_at_stop, _ = store_view(wd)
    assert {e["step"] for e in consumed_at_stop.values()} == {0, 1}
    # What a kill mid-rollout leaves (here, deterministically): the next group's rollout 1
    # has a recorded call and no outcome; its other slots never reached the model.
    with TrajectoryStore(os.path.join(wd, "store"), run_id="rl") as store:
        n = 1 + max(int(r[1:6]) for r in store.rollout_ids())
        gid = f"g{n:05d}"
        store.append(dataclasses.replace(_call(f"{gid}-1", gid, 2), task_id=failing.group_task(n).task_id))

    # The same command, resumed (one step more, so the group added above fits the run's G x N groups).
    summary = drive(build(fake_config(5), wd, make_backend=fake_tiny_backend))
    assert summary["attempt"]["steps"] == 3  # this attempt trained steps 2, 3 and 4
    assert summary["steps"] == 5 and summary["first_step"] == 0 and summary["attempts"] == 2  # the run's
    assert summary["trees"]["trained_rollouts"] > summary["attempt"]["trees"]["trained_rollouts"]
    outs, consumed, unfinished = store_view(wd)
    assert unfinished == []
    for rid, entry in consumed_at_stop.items():
        assert consumed[rid] == entry  # nothing trained twice
    assert_consumed_once(outs, consumed)
    # No group trained short: every slot of every group has one rollout that was not cut off.
    slots = collections.defaultdict(set)
    for rid, o in outs.items():
        if "abandoned" not in (o.details.get("error") or ""):
            slots[o.group_id].add(rid.split("-")[1].split(".")[0])
    assert slots and all(len(s) == 4 for s in slots.values()), slots
    reruns = sorted(r for r in outs if ".r" in r)
    abandoned = [r for r, o in outs.items() if "abandoned" in (o.details.get("error") or "")]
    assert f"{gid}-1" in abandoned and consumed[f"{gid}-1"]["state"] == "dropped"
    assert [r for r in reruns if r.startswith(gid)] == [f"{gid}-{k}.r1" for k in range(4)]
    assert summary["attempt"]["rerun_rollouts"] == summary["rerun_rollouts"] == len(reruns)
    assert len(abandoned) <= len(reruns)
    # Once more: the run is finished; nothing is trained and its summary is kept as it was.
    assert drive(build(fake_config(5), wd, make_backend=fake_tiny_backend)) == summary
    with open(os.path.join(wd, "summary.json")) as f:
        assert json.load(f) == summary


@pytest.mark.slow  # two runs of the loop on fake engines: ~30 CPU-s with a cold compile cache
def test_a_failure_while_a_step_runs_saves_the_last_update_and_the_rerun_resumes_there(tmp_path, capsys):
    """A streaming run has a step open most of the time; a failure then (a write fault, SIGTERM) saved
    nothing, and the rerun rewound to the last periodic checkpoint (here 0), past the staleness bound. Now
    the open step is abandoned (its update not applied, its rollouts buffered) and the last update saved."""
    wd = str(tmp_path / "elastic")
    cfg = fake_config(4, checkpoint_every=100)  # periodic saves: only checkpoint 0 (and the last)
    c = build(cfg, wd, make_backend=fake_tiny_backend)
    released = threading.Event()

    def mid_step(step: int) -> None:  # the trainer thread, step 2 closed and running, its update not applied
        if step == 2:
            c.launcher.errors.append(RuntimeError("injected failure while step 2 runs"))
            c.wake.set()
            released.wait(120)  # held open until the run stops the trainer (so the old code saw it open)

    stop = c.trainer.stop

    def stop_and_release() -> None:
        released.set()
        stop()

    c.trainer.on_step_started = mid_step
    c.trainer.stop = stop_and_release  # type: ignore[method-assign]
    with pytest.raises(RunFailed, match="injected failure while step 2 runs"):
        drive(c)
    saved = sorted(int(x) for x in os.listdir(os.path.join(wd, "checkpoints")) if x.isdigit())
    assert saved[-1] >= 2, saved
    _, consumed_at_stop, _ = store_view(wd)
    capsys.readouterr()
    summary = drive(build(cfg, wd, make_backend=fake_tiny_backend))
    assert f"resumed from checkpoint step {saved[-1]}" in capsys.readouterr().out
    assert summary["steps"] == 4 - saved[-1]
    outs, consumed, unfinished = store_view(wd)
    assert unfinished == []
    for rid, entry in consumed_at_stop.items():
        if entry["step"] < saved[-1]:
            assert consumed[rid] == entry  # trained before the save: not again
    assert_consumed_once(outs, consumed)


def _launch(*args, timeout=60):
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "launch.main", "--config", "configs/demo.py", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    return p, time.monotonic() - t0


@pytest.mark.parametrize("flags, field", [
    (["--config.scheduler.serve_reserve=2"], "config.scheduler.serve_reserve"),
    (["--config.train.advantage=bogus"], "config.train.advantage"),
    (["--config.scheduler.mode=async", "--config.scheduler.async_train_cells=4"], "config.scheduler.async_train_cells"),
    (["--config.task.family=bogus", "--config.eval.every=0"], "config.task"),
])
def test_bad_values_exit_in_seconds_naming_the_field(tmp_path, flags, field):
    p, seconds = _launch("--workdir", str(tmp_path), *flags)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and last.startswith(f"error: {field}"), (p.returncode, p.stderr[-2000:])
    assert seconds < 30
    assert not os.path.exists(tmp_path / "elastic" / "checkpoints")  # failed before any work


def test_help_lists_the_distributed_flags():
    p, _ = _launch("--help")
    for flag in ("--coordinator_address", "--num_processes", "--process_id", "--cluster"):
        assert flag in p.stdout, flag


def test_progress_off_a_terminal_is_one_line_per_step():
    out = io.StringIO()  # not a TTY
    bar = Progress(total=3, initial=1, desc="rl[elastic]", enabled=True, every_s=3600.0, stream=out)
    bar.set_status("reward=0.5")
    bar.step()
    bar.set_status("reward=0.7")
    bar.step()
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 2, lines
    assert lines[0].startswith("rl[elastic]: step 2/3 | reward=0.5 |") and "ETA" in lines[0]
    assert lines[1].startswith("rl[elastic]: step 3/3 | reward=0.7 |")
    quiet = io.StringIO()
    sft = Progress(total=100, desc="sft", enabled=True, every_s=3600.0, line_per_step=False, stream=quiet)
    for _ in range(100):
        sft.step()
    assert len(quiet.getvalue().splitlines()) == 1  # fast loops: the last line only (and one per every_s)
    # A report's build counts rollouts, many a second: the line names them and their rate.
    built = io.StringIO()
    report = Progress(total=50, desc="report", enabled=True, every_s=3600.0, line_per_step=False, stream=built,
                      unit="rollout")
    report.step(50)
    (line,) = built.getvalue().splitlines()
    assert line.startswith("report: rollout 50/50 |") and " rollouts/s, ETA 0s" in line, line


def _call(rid, gid, version):
    import numpy as np

    from gyre_jax.trajectory.records import ModelCallRecord

    return ModelCallRecord(run_id="rl", rollout_id=rid, task_id="t-" + gid, group_id=gid, agent_id=0,
                           parent_agent_id=None, role="main", call_index=0, prompt_ids=np.arange(1, 4, dtype=np.int32),
                           output_ids=np.arange(5, 7, dtype=np.int32), output_logprobs=np.full(2, -0.5, np.float32),
                           policy_version=version, t_start=1.0, t_end=2.0, finish_reason="stop")


def _outcome(rid, gid, version):
    from gyre_jax.trajectory.records import RolloutOutcome

    return RolloutOutcome(run_id="rl", rollout_id=rid, task_id="t-" + gid, group_id=gid, status="completed",
                          score=0.5, policy_versions=(version,), t_end=2.0, num_calls=1)


def test_resume_plan_finishes_groups_a_stop_cut_short(tmp_path):
    from gyre_jax.rl.launcher import resume_plan

    with TrajectoryStore(str(tmp_path / "store"), run_id="rl") as store:
        # g00001: all 4 finished. g00002: slots 0, 1 finished, 2 in flight (a call, no outcome),
        # 3 never recorded; slot 1's first attempt was cut off by an earlier stop and re-run.
        # g00003: only in flight. g00004: finished but already trained (not pending).
        for k in range(4):
            store.append(_call(f"g00001-{k}", "g00001", 3))
            store.append(_outcome(f"g00001-{k}", "g00001", 3))
        for rid in ("g00002-0", "g00002-1.r1"):
            store.append(_call(rid, "g00002", 4))
            store.append(_outcome(rid, "g00002", 4))
        store.append(_call("g00002-2", "g00002", 2))
        store.append(_call("g00003-1", "g00003", 5))
        store.append(_call("g00004-0", "g00004", 3))
        store.append(_outcome("g00004-0", "g00004", 3))
        store.mark_trained(["g00004-0"], step=3)
        # g00005: a group a first resume finished, its original rollouts at version 4 and its re-run slots
        # at the restored version 2; a second stop before the next checkpoint rewinds to step 2 again.
        for rid, v in (("g00005-0", 4), ("g00005-1", 4), ("g00005-2.r1", 2), ("g00005-3.r1", 2)):
            store.append(_call(rid, "g00005", v))
            store.append(_outcome(rid, "g00005", v))
        pending = store.pending_rollouts()
        complete, short = resume_plan(store, "rl", 4, 5, pending)
        g5 = [g for g in complete if g.group_id == "g00005"]
        assert [g.version for g in g5] == [2]  # the bound counts from its oldest tokens
        complete = [g for g in complete if g.group_id != "g00005"]
        assert [(g.group_id, g.version, g.rollout_ids) for g in complete] == [
            ("g00001", 3, [f"g00001-{k}" for k in range(4)])]
        by_id = {g.group_id: g for g in short}
        assert sorted(by_id) == ["g00002", "g00003"]
        g2, g3 = by_id["g00002"], by_id["g00003"]
        # Dated by its oldest tokens (version 4); its re-runs are sampled now, at step 5.
        assert (g2.number, g2.version, g2.finished, g2.abandoned) == (2, 4, ("g00002-0", "g00002-1.r1"), ("g00002-2",))
        assert g2.rerun == ("g00002-2.r1", "g00002-3.r1")
        assert (g3.version, g3.finished, g3.abandoned) == (5, (), ("g00003-1",))
        assert g3.rerun == ("g00003-0.r1", "g00003-1.r1", "g00003-2.r1", "g00003-3.r1")
        # The cut-off attempts now have an outcome: infra_error, never trained, and nothing is unfinished.
        assert store.unfinished_rollouts() == []
        for rid in ("g00002-2", "g00003-1"):
            o = store.outcome(rid)
            assert o.status == "infra_error" and o.score is None and "abandoned" in o.details["error"]
            assert o.num_calls == 1
        # Stopped again before any re-run finished: the abandoned outcomes are pending now, but they do not
        # fill their slots, so the groups are still short and those slots run again (not trained 3 of 4).
        complete2, short2 = resume_plan(store, "rl", 4, 5, store.pending_rollouts())
        by_id = {g.group_id: g for g in short2}
        assert sorted(by_id) == ["g00002", "g00003"], ([g.group_id for g in complete2], sorted(by_id))
        assert by_id["g00002"].rerun == ("g00002-2.r1", "g00002-3.r1")
        assert by_id["g00002"].finished == ("g00002-0", "g00002-1.r1", "g00002-2")  # dropped with the group
        assert len(by_id["g00003"].rerun) == 4
        # Rewound further, to step 3: tokens of versions 4 came from policies the stop lost; they count as the
        # restored policy's (3), so no group waits for version numbers this lineage has yet to reach.
        complete3, short3 = resume_plan(store, "rl", 4, 3, store.pending_rollouts())
        assert [g.version for g in complete3 if g.group_id == "g00001"] == [3]
        assert {g.group_id: g.version for g in short3}["g00002"] == 3
        from gyre_jax.rl.launcher import lineage_calls

        calls = store.calls("g00002-0") + store.calls("g00001-0")
        assert [c.policy_version for c in lineage_calls(calls, 3)] == [3, 3]
        assert [c.policy_version for c in lineage_calls(calls, 5)] == [4, 3]
        assert [(c.rollout_id, c.call_index) for c in lineage_calls(calls, 3)] == [(c.rollout_id, c.call_index) for c in calls]


def test_a_full_disk_stops_the_run_naming_the_path_and_the_rerun_resumes(tmp_path):
    """Our storage failing is never a rollout's failure: the run stops in seconds with a StorageError
    (no infra_error outcome, no short group), and once there is room the same command resumes."""
    from gyre_jax.errors import StorageError

    wd = str(tmp_path / "elastic")
    c = build(fake_config(2), wd, make_backend=fake_tiny_backend)  # 2 steps: the stop comes at the first append
    # From now on every frame the store appends meets a real ENOSPC (/dev/full), as on a full disk.
    healthy_fd, c.store._wfd = c.store._wfd, os.open("/dev/full", os.O_WRONLY)
    result: list = []

    def run():
        try:
            drive(c)  # closes the store (and with it /dev/full's descriptor)
            result.append(None)
        except BaseException as e:  # noqa: BLE001 - checked below
            result.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(180)  # a run that hangs on its failed write (the bug this pins) fails here, not by hanging CI
    os.close(healthy_fd)
    assert not t.is_alive(), "the run did not stop after its store failed"
    assert isinstance(result[0], StorageError), result
    msg = str(result[0])
    assert "No space left on device" in msg and os.path.join(wd, "store") in msg and "\n" not in msg, msg
    outs, consumed, _ = store_view(wd)
    assert outs == {} and consumed == {}  # nothing became data: no outcome, failed or not
    summary = drive(build(fake_config(2), wd, make_backend=fake_tiny_backend))
    assert summary["steps"] == 2
    outs, consumed, unfinished = store_view(wd)
    assert unfinished == [] and all(not o.is_failure or "abandoned" in (o.details.get("error") or "")
                                    for o in outs.values())
    assert_consumed_once(outs, consumed)


@pytest.mark.parametrize("args, expect", [
    (["--config", "configs/nope.py"], "error: --config=configs/nope.py: no such file"),
    (["--config", "configs/demo.py", "--config.train.learnin_rate=1"], "did you mean config.train.learning_rate?"),
    (["--config", "configs/demo.py", "--config.trian.row_len=1"], "config has no field 'trian'; did you mean config.train?"),
])
def test_bad_command_lines_are_one_line_in_seconds(args, expect):
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "launch.main", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and expect in lines[0], (p.returncode, p.stderr[-2000:])
    assert time.monotonic() - t0 < 30


def test_a_workdir_that_is_a_file_is_one_line(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    p, seconds = _launch("--workdir", str(f))
    assert p.returncode == 2 and p.stderr.strip() == f"error: --workdir={f}: exists and is not a directory", p.stderr


@pytest.mark.slow  # ~30 s; the label check is also exercised by the damaged-checkpoint test
def test_a_failed_checkpoint_save_does_not_brick_the_workdir(tmp_path, monkeypatch):
    """The periodic save after update 2 (every 2 steps: none before it) fails once: the run stops with one
    line, no checkpoint is labelled with another version than its state's (asserted at save and load),
    and the same command resumes and completes with every rollout consumed once."""
    from gyre_jax.rl.checkpoint import Checkpointer

    wd = str(tmp_path / "elastic")
    real_save, calls = Checkpointer.save, []

    def save_failing_once(self, step, **kw):
        calls.append(step)
        if step == 2 and calls.count(2) == 1:
            raise OSError(5, "Input/output error")  # injected at the checkpoint's write site
        return real_save(self, step, **kw)

    monkeypatch.setattr(Checkpointer, "save", save_failing_once)
    with pytest.raises(RunFailed):
        drive(build(fake_config(4, checkpoint_every=2), wd, make_backend=fake_tiny_backend))
    monkeypatch.undo()
    summary = drive(build(fake_config(4, checkpoint_every=2), wd, make_backend=fake_tiny_backend))
    assert summary["steps"] >= 2
    outs, consumed, unfinished = store_view(wd)
    assert unfinished == []
    assert_consumed_once(outs, consumed)
    assert sorted({e["step"] for e in consumed.values()}) == [0, 1, 2, 3]


def test_a_damaged_newest_checkpoint_falls_back_to_an_intact_one(tmp_path, capsys):
    wd = str(tmp_path / "elastic")
    drive(build(fake_config(2), wd, make_backend=fake_tiny_backend))
    newest = os.path.join(wd, "checkpoints", "2")
    assert os.path.isdir(newest), os.listdir(os.path.join(wd, "checkpoints"))
    for root, _, files in os.walk(os.path.join(newest, "state")):
        for f in files:  # every file of the state item cut to nothing, as a torn copy would leave it
            open(os.path.join(root, f), "w").close()
    summary = drive(build(fake_config(3), wd, make_backend=fake_tiny_backend))
    assert "resumed from step 1" in capsys.readouterr().out
    assert summary["attempt"]["steps"] == 2  # steps 1 and 2 again: step 2's update was lost with its checkpoint
    assert summary["steps"] == 3  # the run's: step 0 of the first attempt, then these
    outs, consumed, unfinished = store_view(wd)
    assert unfinished == []
    assert_consumed_once(outs, consumed)


def test_a_second_run_on_a_busy_workdir_is_refused_in_seconds(tmp_path):
    with TrajectoryStore(str(tmp_path / "elastic" / "store"), run_id="rl"):  # a run holding the workdir
        p, seconds = _launch("--workdir", str(tmp_path), "--config.sft.steps=0")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, (p.returncode, p.stderr[-2000:])
    assert lines[0].startswith(f"error: --workdir={tmp_path}: another run is using it"), lines
    assert seconds < 30
