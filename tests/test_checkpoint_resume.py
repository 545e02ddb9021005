"""Resume at library level: crash mid-step, rerun, same losses, every finished rollout trained exactly once.

The file is also the worker: ``python tests/test_checkpoint_resume.py WORKDIR
STEPS [--pause-at STEP:PHASE] [--async-save]`` runs a tiny training loop with the
real pieces (TrajectoryStore with synthetic rollouts, a grain task sampler, an
optax state, a JAX RNG, Checkpointer saving every step) and, at the pause point,
prints ``PAUSED STEP PHASE`` and blocks on stdin, so the test can ``kill -9`` it
at an exact point of the step (no sleeps, no race). A rerun of the same command
resumes from the last checkpoint.

Per step s: draw GEN tasks from the grain iterator and an RNG key per rollout,
append the rollouts to the store unless they are already there (a rerun finds
the ones that finished before the crash), train on the oldest TRAIN buffered
rollouts, mark them trained, save checkpoint s+1. Phases (pause points):
'generated' (rollouts durable, not trained), 'trained' (update applied in
memory, not marked), 'marked' (store cursor ahead of the last checkpoint),
'saved' (after save returned; with --async-save the write may be in flight).
"""
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

GEN, TRAIN, V, D, L, P_LEN, O_LEN = 3, 2, 16, 8, 8, 3, 4
PHASES = ("generated", "trained", "marked", "saved")


class Crash(Exception):
    """In-process stand-in for a kill at a pause point (the fast test)."""


def run(workdir, steps, *, pause_at=None, async_save=False, on_pause=None):
    """The loop. Returns the final lineage's history: [{"step", "loss", "rollouts"}]."""
    import grain
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import SingleDeviceSharding

    from gyre_jax.rl.checkpoint import CheckpointConfig, Checkpointer, abstract_like, resume_store
    from gyre_jax.trajectory.records import ModelCallRecord, RolloutOutcome
    from gyre_jax.trajectory.store import StoreConfig, TrajectoryStore

    tx = optax.adam(0.05)

    def init():
        k1, k2 = jax.random.split(jax.random.key(0))
        params = {"E_VxD": jax.random.normal(k1, (V, D)) * 0.3, "W_DxV": jax.random.normal(k2, (D, V)) * 0.3}
        return {"step": jnp.int32(0), "policy_version": jnp.int32(0), "params": params, "opt_state": tx.init(params)}

    @jax.jit
    def train_step(state, tokens_BxL, mask_BxL, score_B):
        def loss_fn(params):
            logits = params["E_VxD"][tokens_BxL[:, :-1]] @ params["W_DxV"]
            logp = jax.nn.log_softmax(logits)
            nll = -jnp.take_along_axis(logp, tokens_BxL[:, 1:, None], -1)[..., 0]
            m = mask_BxL[:, 1:]
            return jnp.sum(nll * m * score_B[:, None]) / jnp.sum(m)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt = tx.update(grads, state["opt_state"], state["params"])
        return dict(step=state["step"] + 1, policy_version=state["policy_version"] + 1,
                    params=optax.apply_updates(state["params"], updates), opt_state=opt), loss

    def pause(step, phase):
        if pause_at == (step, phase):
            if on_pause is not None:
                on_pause(step, phase)
            print(f"PAUSED {step} {phase}", flush=True)
            sys.stdin.readline()  # the test kills us here
            raise SystemExit("pause point reached but not killed")

    store = TrajectoryStore(os.path.join(workdir, "store"), run_id="resume-test", config=StoreConfig(fsync="always"))
    ckpt = Checkpointer(CheckpointConfig(directory=os.path.join(workdir, "ckpt"), max_to_keep=2, async_save=async_save))
    try:
        tasks = iter(grain.MapDataset.range(1000).shuffle(seed=7).map(lambda t: int(t) % 50).to_iter_dataset())
        dev = SingleDeviceSharding(jax.devices()[0])
        abstract = abstract_like(jax.eval_shape(init), jax.tree.map(lambda _: dev, jax.eval_shape(init)))
        restored = ckpt.restore_latest(abstract, data_iterator=tasks)
        if restored is None:
            state, rng, buffer, history, start = jax.device_put(init(), dev), jax.random.key(1), [], [], 0
        else:
            state, rng, history, start = restored.train_state, restored.rng, restored.meta["history"], restored.step
            buffer = resume_store(store, restored)
        print(f"START {start}", flush=True)
        for s in range(start, steps):
            done = set(store.complete_rollouts())
            for i in range(GEN):
                task = next(tasks)
                rng, sub = jax.random.split(rng)
                rid = f"s{s}-{i}"
                if rid in done:
                    continue  # finished before a crash: durable, already pending (in buffer)
                # (a crash between its call and its outcome: the call's exact re-send is deduplicated)
                seq = np.array(jax.random.randint(sub, (P_LEN + O_LEN,), 1, V), np.int32)
                seq[0] = task % V
                store.append(ModelCallRecord(
                    run_id=store.run_id, rollout_id=rid, task_id=f"t{task}", group_id=f"g{s}", agent_id=0,
                    parent_agent_id=None, role="main", call_index=0, prompt_ids=seq[:P_LEN], output_ids=seq[P_LEN:],
                    output_logprobs=np.full(O_LEN, -1.0, np.float32), policy_version=int(state["policy_version"]),
                    t_start=1.0, t_end=2.0, finish_reason="stop"))
                store.append(RolloutOutcome(run_id=store.run_id, rollout_id=rid, task_id=f"t{task}", group_id=f"g{s}",
                                            status="completed", score=float((task % 5) / 4), t_end=2.0, num_calls=1))
                buffer.append(rid)
            pause(s, "generated")
            take, buffer = buffer[:TRAIN], buffer[TRAIN:]
            tokens = np.zeros((TRAIN, L), np.int32)
            mask = np.zeros((TRAIN, L), np.float32)
            for b, rid in enumerate(take):
                (call,) = store.calls(rid)
                tokens[b, : P_LEN + O_LEN] = call.sequence
                mask[b, P_LEN : P_LEN + O_LEN] = 1.0
            score = np.asarray([store.outcome(r).score for r in take], np.float32)
            state, loss = train_step(state, tokens, mask, score)
            pause(s, "trained")
            store.mark_trained(take, step=s)
            history = history + [{"step": s, "loss": float(loss), "rollouts": take}]
            pause(s, "marked")
            ckpt.save(s + 1, train_state=state, rng=rng, store_cursor=store.cursor_state(), buffer=buffer,
                      data_iterator=tasks, meta={"history": history})
            pause(s, "saved")
        ckpt.wait_until_finished()
        return {"history": history, "buffer": buffer}
    finally:
        ckpt.close()
        store.close()


# ---------------------------------------------------------------------------- checks

def check_lineage(workdir, result, reference, steps):
    """Same losses as the uninterrupted run; each finished rollout trained once (by id) or still buffered."""
    from gyre_jax.trajectory.store import TrajectoryStore

    assert result["history"] == reference["history"]  # losses compared exactly (same bits)
    trained = [r for h in result["history"] for r in h["rollouts"]]
    assert len(trained) == len(set(trained)) == steps * TRAIN, "a rollout trained twice"
    store = TrajectoryStore(os.path.join(workdir, "store"), writable=False)
    finished = set(store.complete_rollouts())
    assert finished == {f"s{s}-{i}" for s in range(steps) for i in range(GEN)}
    assert set(trained) | set(result["buffer"]) == finished, "a finished rollout was lost"
    assert not set(trained) & set(result["buffer"])
    consumed = store.consumed()
    assert set(consumed) == set(trained)
    for h in result["history"]:
        for r in h["rollouts"]:
            assert consumed[r]["step"] == h["step"]
    store.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    steps = 5
    return steps, run(str(tmp_path_factory.mktemp("ref")), steps)


@pytest.mark.parametrize("step,phase", [
    (2, "marked"),
    pytest.param(1, "trained", marks=pytest.mark.slow),
    pytest.param(3, "generated", marks=pytest.mark.slow),
])
def test_crash_in_process_then_resume(reference, tmp_path, step, phase):
    """Fast: abandon the run at a pause point (exception), rerun; the logic of resume, no kill."""
    steps, ref = reference
    seen = {}

    def crash(s, p):
        from gyre_jax.trajectory.store import TrajectoryStore
        with TrajectoryStore(os.path.join(tmp_path, "store"), writable=False) as disk:  # the cursor on disk
            seen["cursor"] = set(disk.consumed())
        raise Crash()

    with pytest.raises(Crash):
        run(str(tmp_path), steps, pause_at=(step, phase), on_pause=crash)
    if phase == "marked":  # the window that matters: the store's cursor is ahead of the last checkpoint
        assert set(ref["history"][step]["rollouts"]) <= seen["cursor"]
    check_lineage(str(tmp_path), run(str(tmp_path), steps), ref, steps)


def _spawn(workdir, steps, *args):
    return subprocess.Popen(
        [sys.executable, __file__, workdir, str(steps), *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )


def _kill_at(workdir, steps, step, phase, *extra):
    p = _spawn(workdir, steps, "--pause-at", f"{step}:{phase}", *extra)
    lines = []
    for line in p.stdout:
        lines.append(line.strip())
        if line.startswith("PAUSED"):
            os.kill(p.pid, signal.SIGKILL)
            break
    p.wait()
    assert p.returncode == -signal.SIGKILL, (p.returncode, lines, p.stderr.read()[-3000:])
    return lines


@pytest.mark.slow
def test_kill9_mid_step_then_resume(reference, tmp_path):
    """Real SIGKILLs at three points of three steps (one during an async save); the rerun finishes."""
    steps, ref = reference
    wd = str(tmp_path)
    lines = _kill_at(wd, steps, 1, "marked")
    assert lines[0] == "START 0" and lines[-1] == "PAUSED 1 marked"
    from gyre_jax.trajectory.store import TrajectoryStore
    with TrajectoryStore(os.path.join(wd, "store"), writable=False) as disk:  # cursor ran ahead of checkpoint 1
        assert set(ref["history"][1]["rollouts"]) <= set(disk.consumed())
    lines = _kill_at(wd, steps, 2, "trained")
    assert lines[0] == "START 1", lines  # checkpoint 1 = after step 0; step 1 was trained again
    lines = _kill_at(wd, steps, 3, "saved", "--async-save")  # the save of checkpoint 4 may or may not be final
    assert lines[0] == "START 2", lines
    p = _spawn(wd, steps)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
    assert out.splitlines()[0] in ("START 3", "START 4"), out
    with open(os.path.join(wd, "result.json")) as f:
        check_lineage(wd, json.load(f), ref, steps)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("workdir")
    ap.add_argument("steps", type=int)
    ap.add_argument("--pause-at", default=None)
    ap.add_argument("--async-save", action="store_true")
    a = ap.parse_args()
    pause_at = None
    if a.pause_at:
        s, ph = a.pause_at.split(":")
        assert ph in PHASES, ph
        pause_at = (int(s), ph)
    sys.path.insert(0, os.getcwd())
    res = run(a.workdir, a.steps, pause_at=pause_at, async_save=a.async_save)
    with open(os.path.join(a.workdir, "result.json"), "w") as f:
        json.dump(res, f)
