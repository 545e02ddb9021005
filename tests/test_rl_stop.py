"""SIGTERM during the SFT warm start: the process ends as a stop during RL does (exit 143, one
``stopped:`` line, no C++ abort from threads still compiling), and the same workdir runs again to the end.

The run is ``python -m launch.main --config configs/demo.py`` with a tiny model and an SFT phase far
longer than the test, so the stop lands in it; the gyre-warm thread compiles the cells' training steps
meanwhile (what aborted the process when it ended through interpreter teardown). Both slow (a real launch and its compiles); the second adds the rerun to the end.
A stop earlier still, during the imports, is answered the same way (launch/early_stop.py; seconds, default run).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--config.model.d_model=32", "--config.model.n_layers=1", "--config.model.n_heads=2",
        "--config.model.n_kv_heads=1", "--config.model.head_dim=16", "--config.model.d_ff=64",
        "--config.cells.max_slots=4", "--config.scheduler.groups_per_step=1",
        "--config.scheduler.group_size=4", "--config.scheduler.min_work_per_switch_s=0.0",
        "--config.eval.every=0", "--config.checkpoint_every=1", "--config.harness.max_tokens=12"]
TIMEOUT_S = 300  # a hung child is killed (and the test fails) rather than hanging the run


def _cmd(workdir: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "launch.main", "--config", "configs/demo.py", "--workdir", workdir, *TINY, *extra]


def _stop_during_sft(wd: str) -> None:
    p = subprocess.Popen(_cmd(wd, "--config.steps=1", "--config.sft.steps=100000", "--config.sft.rows=2",
                              "--config.sft.demos=16", "--config.progress=True"),
                         cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True)
    watchdog = threading.Timer(TIMEOUT_S, p.kill)
    watchdog.start()
    lines = []
    try:
        for line in p.stderr:  # off a terminal the warm start prints "sft warm start: step k/N" lines
            lines.append(line.rstrip("\n"))
            if line.startswith("sft warm start: step"):
                p.send_signal(signal.SIGTERM)
                break
        lines += p.stderr.read().splitlines()
        p.wait()
    finally:
        watchdog.cancel()
    tail = "\n".join(lines[-15:])
    assert any(x.startswith("sft warm start: step") for x in lines), tail
    assert p.returncode == 143, (p.returncode, tail)
    assert lines[-1].startswith("stopped: SIGTERM"), tail
    assert not any("terminate called" in x or "Fatal Python error" in x for x in lines), tail


@pytest.mark.slow  # ~20 s of CPU (imports, the SFT and warm-up compiles), 2 min at load 18
def test_sigterm_during_the_sft_warm_start_stops_cleanly(tmp_path):
    _stop_during_sft(str(tmp_path))


@pytest.mark.slow
def test_after_a_stop_during_the_sft_warm_start_the_rerun_completes(tmp_path):
    wd = str(tmp_path)
    _stop_during_sft(wd)
    # The same workdir, a short warm start this time: nothing of the stopped attempt stands in the way.
    done = subprocess.run(_cmd(wd, "--config.steps=1", "--config.sft.steps=2", "--config.progress=False"), cwd=ROOT,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    assert os.path.exists(os.path.join(wd, "elastic", "summary.json"))


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stop_during_the_imports_is_one_line_and_the_documented_code(tmp_path, sig, code):
    """A stop before the job runs (here: once absl is imported, while the rest of the imports and JAX's
    start run) found Python's defaults: SIGTERM killed the process with no line (rc -15), SIGINT raised
    KeyboardInterrupt out of an import (a traceback). ``-X importtime`` says when an import finished."""
    p = subprocess.Popen([sys.executable, "-X", "importtime", *_cmd(str(tmp_path), "--config.steps=1")[1:]], cwd=ROOT,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(TIMEOUT_S, p.kill)
    watchdog.start()
    said = []
    try:
        for line in p.stderr:
            if line.rstrip().endswith("| absl.app"):  # launch.main's imports are under way
                p.send_signal(sig)
                break
            said.append(line.rstrip("\n"))
        said += p.stderr.read().splitlines()
        p.wait()
    finally:
        watchdog.cancel()
    said = [x for x in said if not x.startswith("import time:")]
    assert p.returncode == code, (p.returncode, said[-10:])
    assert said and said[-1].startswith(f"stopped: {sig.name} while starting"), said[-10:]
    assert not any("Traceback" in x for x in said), said[-10:]
    assert os.listdir(tmp_path) == []  # nothing written
