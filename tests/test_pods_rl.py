"""The RL job across processes (gyre_jax.pods.rl_job): `tools/launch_local.py -n 2 -- --config configs/demo.py`.

Process 0 is the core (controller, proxy, store, trainer, checkpoints on cell 0);
process 1 is cell 1 in its own JAX program: its JetStream engine answers every model
call of the run (the core never serves in elastic mode) behind an HTTP server, gets
each new policy over jax.experimental.transfer, and trains micro-batches when the
controller switches it. A rerun of the same command resumes from the core's checkpoint.
"""
import json
import os
import re
import signal
import threading
import time

import pytest

from tests.test_pods_dp import run_launch_local
from tests.test_rl_loop import _check_run

TIMEOUT_S = 420  # deadlock guard; a healthy run takes ~2 min here
# tests/test_rl_loop.tiny_config as flags, with one 2-device cell per process.
FLAGS = [
    "--config=configs/demo.py", "--config.progress=False", "--config.checkpoint_every=1", "--config.first_last=1",
    "--config.model.d_model=32", "--config.model.n_layers=1", "--config.model.n_heads=2", "--config.model.n_kv_heads=1",
    "--config.model.head_dim=16", "--config.model.d_ff=64", "--config.model.max_seq_len=96",
    "--config.cells.cell_size=2", "--config.cells.max_slots=8", "--config.cells.max_len=96", "--config.train.row_len=96",
    "--config.scheduler.groups_per_step=2", "--config.scheduler.group_size=4",
    "--config.scheduler.min_work_per_switch_s=0.0", "--config.harness.max_tokens=12", "--config.harness.deadline_s=20.0",
    "--config.train.micro_batch_rows=2", "--config.sft.steps=0", "--config.eval.every=0",
]


def _launch(workdir, steps, n=2, launcher=(), on_line=None, extra=()):
    rc, lines = run_launch_local(["-n", str(n), *launcher, "--", *FLAGS, f"--config.steps={steps}",
                                  f"--workdir={workdir}", *extra], timeout_s=TIMEOUT_S, on_line=on_line)
    return rc, "".join(lines)


def test_rl_job_runs_with_a_satellite_process_and_resumes(tmp_path):
    workdir = str(tmp_path / "run")
    rc, out = _launch(workdir, steps=2)
    assert rc == 0, out[-6000:]
    assert "launch: process 1 of 2" in out
    assert re.search(r"\[p1\] pods satellite 1: engine on cell 1 serving v0 at http://", out), out[-4000:]
    assert "rl: satellite process 1 connected (cell 1)" in out
    bye = re.search(r"\[p1\] pods satellite 1: (\d+) micro-batches trained, (\d+) snapshots", out)
    assert bye, out[-4000:]
    run = os.path.join(workdir, "elastic")
    summary = json.load(open(os.path.join(run, "summary.json")))
    rollouts = 2 * 2 * 4  # steps x groups_per_step x group_size
    # Every model call went to the satellite's engine (the core cell trains only): all rollouts answered.
    lines, outs = _check_run(run, summary, steps=2, rollouts=rollouts)
    assert all(not o.is_failure for o in outs.values()), {r: o.status for r, o in outs.items()}
    # The satellite's own count of micro-batches agrees with the core's record of which cells trained.
    joined = any("1" in r["cells_trained"].split(",") for r in lines)
    assert (int(bye.group(1)) > 0) == joined, (bye.group(0), [r["cells_trained"] for r in lines])

    # The same command with more steps resumes from the core's checkpoint (step 2), not from scratch.
    rc, out = _launch(workdir, steps=3)
    assert rc == 0, out[-6000:]
    assert "rl: resumed from checkpoint step 2" in out, out[-4000:]
    summary = json.load(open(os.path.join(run, "summary.json")))
    lines = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    assert [r["step"] for r in lines] == [0, 1, 2]
    assert os.path.isdir(os.path.join(run, "checkpoints", "3"))


@pytest.mark.slow  # ~75 s (as test_pods_dp.py::test_killed_satellite)
def test_satellite_process_killed_mid_run_every_rollout_trained_once(tmp_path):
    """kill -9 satellite 2 of 3 processes after the first step: the run finishes on the core and satellite 1."""
    workdir = str(tmp_path / "run")
    metrics = os.path.join(workdir, "elastic", "metrics.jsonl")
    killed, pids_box, done = [], {}, threading.Event()

    def kill_after_first_step():  # polls: the core prints little while it runs
        while not done.wait(0.2):
            if 2 in pids_box and os.path.exists(metrics) and os.path.getsize(metrics) > 0:
                os.kill(pids_box[2], signal.SIGKILL)
                killed.append(pids_box[2])
                return

    watcher = threading.Thread(target=kill_after_first_step, daemon=True)
    watcher.start()
    try:
        rc, out = _launch(workdir, steps=3, n=3, launcher=["--expendable=2"],
                          on_line=lambda line, pids: pids_box.update(pids))
    finally:
        done.set()
        watcher.join()
    assert killed, out[-4000:]
    assert rc == 0, out[-6000:]
    assert "launch_local: process 2 exited -9 (expendable" in out
    # The core saw it go (a training share moved to the other cells, or its engine's calls failed over) before the end.
    assert re.search(r"satellite cell 2 failed|cell 2 taken out of service|cell2 \(\S+\) unreachable|"
                     r"cell2: stream of \S+ cut off", out), out[-6000:]
    assert not re.search(r"\[p2\] pods satellite 2: \d+ micro-batches trained", out)  # killed before its end
    run = os.path.join(workdir, "elastic")
    summary = json.load(open(os.path.join(run, "summary.json")))
    # Every rollout of the 3 steps finished and was consumed exactly once, the killed cell's share included.
    _check_run(run, summary, steps=3, rollouts=3 * 2 * 4)


def _processes_under(workdir: str) -> list[str]:
    """Live processes whose command line or working directory names ``workdir`` (the run's, and their children)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue  # a zombie has exited; only its parent's wait is missing
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if workdir in cmd or cwd.startswith(workdir):
            out.append(f"{pid}: {cmd[:200]}")
    return out


@pytest.mark.slow  # ~60-90 s: a pods run up to its first step
def test_a_failing_core_ends_the_whole_pods_run_in_seconds_with_no_orphan(tmp_path):
    """The core fails when step 1 starts (not survivable): its error: line, then the launcher exits non-zero within
    seconds, and no process of the run (core, satellite, their children) is left."""
    workdir = str(tmp_path / "run")
    seen = {}

    def on_line(line, pids):
        seen["pids"] = dict(pids)
        if line.startswith("[p0] error:") and "error_at" not in seen:
            seen["error_at"] = time.monotonic()

    rc, out = _launch(workdir, steps=3, on_line=on_line, extra=["--config.faults.core_fail_at_step=1"])
    ended = time.monotonic()
    assert rc == 1, out[-6000:]  # errors.EXIT_FAILED, passed on by the launcher
    assert "error_at" in seen, out[-6000:]
    assert ended - seen["error_at"] < 30, (ended - seen["error_at"], out[-4000:])  # measured 1.5 s; the exit watchdog: 30 s
    assert len(seen["pids"]) == 2
    for pid in seen["pids"].values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert _processes_under(workdir) == []
    assert "rerun the same command" in out or "resume" in out, out[-3000:]
