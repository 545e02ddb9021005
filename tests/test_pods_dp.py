"""Pods: elastic steps with satellites in separate processes (tools/launch_local.py, job 'pods_dp').

``test_satellite_process_matches_one_process`` (default run): 1 core + 1
satellite process, one step, bit-identical to the one-process run (below).

``test_satellite_processes_match_one_process`` (slow): 1 core + 2 satellite processes
(2 CPU devices each, jax.distributed on loopback, arrays on
``jax.experimental.transfer``) that join each step after the core's first
micro-batches give params bit-identical to ``ElasticTrainer`` in this one
process with the core alone, on the same micro-batches; the satellites did
compute some of them.

``test_killed_satellite`` (slow): satellite 2 stops at its first micro-batch,
the test kills it with SIGKILL; the step completes on the others, names cell 2
as failed, every micro-batch is computed exactly once (cell 0 or 1) and the
params are still bit-identical to the one-process run (a micro-batch summed
twice or never would change them). The test restarts process 2 with the same
command; it rejoins and trains in the next step.
"""
import json
import os
import re
import signal
import subprocess
import sys
import threading

import jax
import ml_collections
import numpy as np
import pytest

from gyre_jax import cells
from gyre_jax.pods.dp_job import PodsDPConfig, build, flat_params, micro_batches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, MBS, JOIN_AFTER = 2, 6, 1
FLAGS = ["--config=configs/pods_dp.py", f"--config.micro_batches={MBS}", f"--config.join_after={JOIN_AFTER}"]
PID_LINE = re.compile(r"^launch_local: process (\d+) pid (\d+)$")
TIMEOUT_S = 240  # deadlock guard; a healthy run takes ~30-40 s here


def _config(steps=STEPS, **over) -> PodsDPConfig:
    import importlib.util

    spec = importlib.util.spec_from_file_location("pods_dp_config", os.path.join(ROOT, "configs/pods_dp.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c: ml_collections.ConfigDict = mod.get_config()
    c.update(dict(steps=steps, micro_batches=MBS, join_after=JOIN_AFTER, **over))
    return PodsDPConfig.from_config(c)


def one_process_reference(cfg: PodsDPConfig):
    """The same steps by ElasticTrainer in this process, core cell (2 devices) alone: (flat params, losses)."""
    model, spec, steps = build(cfg)
    core = cells.split_cells(cells.CellConfig(cell_size=2))[0]
    trainer = cells.ElasticTrainer(steps, core, spec.init_state(jax.random.key(cfg.seed), core.train_mesh),
                                   in_flight=cfg.in_flight)
    losses = []
    for s in range(cfg.steps):
        report = trainer.run_step(micro_batches(cfg, model, s, trainer.version))
        assert set(report.cell_of) == {0}
        losses.append(report.loss)
    return flat_params(trainer.state.params), losses


def _env():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    return env


def run_launch_local(args, *, timeout_s=TIMEOUT_S, on_line=None):
    """Run ``tools/launch_local.py *args``; (exit code, output lines). ``on_line(line, pids)`` sees each line as it
    comes (``pids``: process index -> pid, from the launcher's own lines). Shared with tests/test_pods_rl.py."""
    p = subprocess.Popen([sys.executable, "tools/launch_local.py", *args], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines, pids = [], {}

    def read():
        for line in iter(p.stdout.readline, ""):
            lines.append(line)
            m = PID_LINE.match(line.strip())
            if m:
                pids[int(m.group(1))] = int(m.group(2))
            if on_line is not None:
                on_line(line, pids)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    try:
        rc = p.wait(timeout=timeout_s)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        t.join(timeout=10)
    return rc, lines


def _launch(workdir, n=3, steps=STEPS, extra=(), launcher=(), on_line=None):
    return run_launch_local(["-n", str(n), *launcher, "--", *FLAGS, f"--config.steps={steps}", f"--workdir={workdir}",
                             *extra], on_line=on_line)


def _results(workdir):
    metrics = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    with np.load(workdir / "params.npz") as z:
        params = {k: z[k] for k in z.files}
    return metrics, params


def _assert_bit_identical(params, want):
    assert sorted(params) == sorted(want)
    for k in want:
        assert params[k].dtype == want[k].dtype and params[k].shape == want[k].shape, k
        assert np.array_equal(params[k].view(np.uint32), want[k].view(np.uint32)), f"{k} differs"


@pytest.mark.slow  # ~22 s; satellites joining a step across processes stay in the default run via test_pods_rl
def test_satellite_process_matches_one_process(tmp_path):
    cfg = _config(steps=1)
    rc, lines = _launch(tmp_path, n=2, steps=1)
    out = "".join(lines)
    assert rc == 0, out[-6000:]
    (m,), params = _results(tmp_path)
    want_params, want_losses = one_process_reference(cfg)
    _assert_bit_identical(params, want_params)
    assert m["loss"] == want_losses[0]
    assert len(m["cell_of"]) == MBS and set(m["cell_of"]) == {0, 1} and m["cell_of"][:JOIN_AFTER] == [0] * JOIN_AFTER
    assert [s["cell"] for s in m["snapshots"]] == [1] and not m["failed_cells"]
    # The new version published to the satellite's serving layout (a reshard on the way), every byte.
    assert [(p["cell"], p["version"], p["bytes"]) for p in m["published"]] == [(1, 1, sum(v.nbytes for v in want_params.values()))]
    assert "serving version 1 " in out


@pytest.mark.slow
def test_satellite_processes_match_one_process(tmp_path):
    cfg = _config()
    rc, lines = _launch(tmp_path)
    out = "".join(lines)
    assert rc == 0, out[-6000:]
    metrics, params = _results(tmp_path)
    want_params, want_losses = one_process_reference(cfg)
    _assert_bit_identical(params, want_params)
    assert [m["loss"] for m in metrics] == want_losses
    for m in metrics:
        assert len(m["cell_of"]) == MBS and set(m["cell_of"]) == {0, 1, 2}, m["cell_of"]  # both satellites trained
        assert m["cell_of"][:JOIN_AFTER] == [0] * JOIN_AFTER  # they joined mid-step, after the core began
        assert not m["failed_cells"]
        assert sorted(s["cell"] for s in m["snapshots"]) == [1, 2]  # one params pull per satellite per step
        assert all(s["bytes"] == sum(v.nbytes for v in want_params.values()) for s in m["snapshots"])
    assert "pods satellite 1:" in out and "pods satellite 2:" in out


@pytest.mark.slow
def test_killed_satellite(tmp_path):
    """Kill -9 satellite 2 mid-step, restart it: step 0 completes without it, step 1 waits for it
    (``min_satellites=2``) and trains with it again; params bit-identical throughout."""
    cfg = _config()
    killed, restarted, port = [], [], []

    def on_line(line, pids):
        m = re.match(r"^launch_local: coordinator (\S+)$", line.strip())
        if m:
            port.append(m.group(1))
        if line.startswith("[p2] pods satellite 2: holding") and not killed:
            os.kill(pids[2], signal.SIGKILL)  # kill -9, mid-step: it holds micro-batches it never returns
            killed.append(pids[2])
            # The same command again, as a cluster's restart would run it (without the fault).
            cmd = [sys.executable, "-m", "launch.main", *FLAGS, f"--config.steps={STEPS}", "--config.min_satellites=2",
                   f"--workdir={tmp_path}", f"--coordinator_address={port[0]}", "--num_processes=3", "--process_id=2"]
            restarted.append(subprocess.Popen(cmd, cwd=ROOT, env={**_env(), "JAX_NUM_CPU_DEVICES": "2"},
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))

    try:
        rc, lines = _launch(tmp_path, extra=["--config.hold_satellite=2", "--config.min_satellites=2"],
                            launcher=["--expendable=2"], on_line=on_line)
        out = "".join(lines)
        assert rc == 0, out[-6000:]
        assert killed and restarted, out[-4000:]
        r_out, _ = restarted[0].communicate(timeout=TIMEOUT_S)
        assert restarted[0].returncode == 0, r_out[-4000:]
    finally:
        for p in restarted:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert "launch_local: process 2 exited -9 (expendable" in out
    assert "pods_dp: satellite 2 rejoined" in out
    assert "pods satellite 2: " in r_out and "micro-batches" in r_out
    metrics, params = _results(tmp_path)
    first, second = metrics
    assert [c for c, _ in first["failed_cells"]] == [2]
    assert len(first["cell_of"]) == MBS and set(first["cell_of"]) <= {0, 1} and 1 in first["cell_of"]
    assert first["satellites"] == [1]
    assert second["satellites"] == [1, 2] and set(second["cell_of"]) == {0, 1, 2} and not second["failed_cells"]
    want_params, want_losses = one_process_reference(cfg)
    _assert_bit_identical(params, want_params)
    assert [m["loss"] for m in metrics] == want_losses
