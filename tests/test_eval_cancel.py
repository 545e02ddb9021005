"""rl/episode_eval.py: a closing run cuts the running held-out eval short instead of waiting for it."""
from __future__ import annotations

import asyncio
import os
import subprocess
import threading

import pytest

from gyre_jax.rl.episode_eval import BackgroundEval, CancellableRun, EvalCancelled

WAIT_S = 30.0


class _SlowEval:
    """An evaluator whose episodes would run for a minute: one real child process each, stopped
    by the episode's own cleanup when cancelled (as a sandboxed command is)."""

    def __init__(self):
        self.runner = CancellableRun()
        self.started = threading.Event()
        self.stopped: list[int] = []

    def cancel(self):
        self.runner.cancel()

    def __call__(self, params, version):
        async def episodes():
            proc = await asyncio.create_subprocess_exec("sleep", "60")
            try:
                self.started.set()
                await proc.wait()
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
                self.stopped.append(proc.returncode)
            return {"eval_reward": 1.0}

        return self.runner.run(episodes())


def test_cancel_from_another_thread_stops_the_run_and_its_cleanup_runs():
    ev = _SlowEval()
    out: list[BaseException] = []

    def target():
        try:
            ev(None, 0)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            out.append(e)

    t = threading.Thread(target=target)
    t.start()
    assert ev.started.wait(WAIT_S)
    ev.cancel()
    t.join(WAIT_S)
    assert not t.is_alive()
    assert len(out) == 1 and isinstance(out[0], EvalCancelled), out
    assert ev.stopped == [-9]  # the child was killed by the episode's cleanup, not left running
    with pytest.raises(EvalCancelled, match="before it started"):  # and later runs are refused
        ev(None, 1)


def test_closing_a_background_eval_cuts_the_running_eval_short(tmp_path):
    ev = _SlowEval()
    bg = BackgroundEval(ev, log_dir=str(tmp_path))
    bg.start()
    bg.submit(0, {})
    bg.submit(4, {})  # queued: dropped
    assert ev.started.wait(WAIT_S)
    bg.close()  # returns once the thread ended: without the cancel it waits for the minute-long eval
    assert bg._thread is not None and not bg._thread.is_alive()
    assert bg.results == [] and bg.errors == [] and ev.stopped == [-9]
    assert not (tmp_path / "eval.jsonl").exists() or (tmp_path / "eval.jsonl").read_text() == ""
    assert subprocess.run(["pgrep", "-f", "^sleep 60$", "-P", str(os.getpid())],
                          capture_output=True).returncode == 1  # no child left


def test_a_cancel_that_is_not_the_runs_close_is_a_failure_not_a_stop():
    """A CancelledError from inside the eval (not from cancel()) must not be read as the run closing:
    that would log a real failure as a stop and drop the version's eval without an error."""
    async def cancels_itself():
        asyncio.current_task().cancel()
        await asyncio.sleep(0)

    with pytest.raises(RuntimeError, match="not by the run's close") as e:
        CancellableRun().run(cancels_itself())
    assert not isinstance(e.value, EvalCancelled)


def test_a_cancel_while_the_eval_engine_starts_stops_the_server_it_built():
    """The close comes after the cancel; if both land while the first eval builds its engine and
    server, the close finds no server yet: the eval stops the one it built instead of leaking it."""
    from gyre_jax.rl.episode_eval import EpisodeEval

    class _Server:
        stopped = 0

        def stop(self):
            self.stopped += 1

    server = _Server()

    class _Eval(EpisodeEval):
        def _start(self, params, version):
            self.cancel()  # the run closes meanwhile
            self.close()  # ... and its close finds nothing to stop yet
            self._server = server
            return server

    ev = _Eval(tasks=[object()], samples_per_task=1, pass_score=1.0, harness_config=None, make_harness=None,
               make_backend=None, tokenizer=None, workdir="/nonexistent", seed=0, max_tokens_cap=8)
    with pytest.raises(EvalCancelled, match="while its engine started"):
        ev(None, 0)
    assert server.stopped == 1 and ev._server is None
    with pytest.raises(EvalCancelled, match="before it started"):
        ev(None, 1)
