"""Held-out eval of whole episodes through the run's own harness, at one fixed policy version.

``EpisodeEval(...)(params, version) -> {"eval_reward", "eval_exact", "eval_pass_at_k", ...}``

Why a dedicated engine: the serving cells move on to newer versions while an eval runs, and
an eval must score exactly one version. So the eval owns one engine (by default on the core
cell's devices) behind its own proxy (whose sink only counts calls: eval calls are never
trained; each episode's workspace, snapshot and harness log stay under
``<workdir>/eval/v<version>/``), loads ``params`` into it, and runs ``samples_per_task``
episodes of every held-out task with the harness the run trains (built-in, python or
command: the same ``run_rollouts`` path, sandbox and grader as training rollouts). Each
version is its own run id (``eval-v<version>``) with the same rollout ids
(``e<task>-<sample>``), and the proxy derives each call's seed from rollout id and call
index (``ProxyConfig.seed_salt``), so two versions draw the same randomness: their numbers
differ by their params (and by what the episodes did differently).

Metrics, over the episodes the grader scored (infra and verifier failures are counted, never
zeros): ``eval_reward`` mean score; ``eval_exact`` pass@1 (the mean over tasks of the fraction
of samples scoring >= ``pass_score``); ``eval_pass_at_k`` the unbiased pass@k estimator
(Chen et al. 2021: 1 - C(n-c, k) / C(n, k) per task, k = n = samples_per_task: any sample
passed); ``eval_calls`` recorded model calls per episode; ``eval_subagents``, ``eval_compactions``
per episode (how the episodes branched); ``eval_failed`` episodes not scored. Every episode's score
is kept in ``v<version>/episodes.jsonl`` (a comparison of two versions or runs needs their noise).

``BackgroundEval`` runs it on its own thread so the RL loop's controller never waits for an
eval: ``submit(version, params)`` (params are copied to the host first: the trainer may donate
its buffers at the next step), results in ``results`` and ``eval.jsonl`` as they finish.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import queue
import secrets
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import jax
import numpy as np

if TYPE_CHECKING:  # imported where used: serving pulls in the engine, metrics TensorBoard
    from gyre_jax.rl.metrics import MetricsWriter
    from gyre_jax.serving.server_thread import ServerThread

log = logging.getLogger(__name__)


class CallCounter:
    """The eval proxy's record sink: counts each episode's calls under the current version's run id."""

    def __init__(self):
        self.run_id = "eval-v0"
        self._n: dict[str, int] = {}
        self._lock = threading.Lock()

    def append(self, rec) -> None:
        with self._lock:
            self._n[rec.rollout_id] = self._n.get(rec.rollout_id, 0) + 1

    def start_version(self, version: int) -> None:
        with self._lock:
            self.run_id, self._n = f"eval-v{version}", {}

    def calls_by_rollout(self) -> dict[str, int]:
        with self._lock:
            return dict(self._n)


def write_episodes(path: str, results: Sequence, calls: dict[str, int]) -> None:
    """One line per episode (which held-out tasks fail, and the per-episode scores a comparison of two
    versions or two runs needs for its noise: the mean alone hides it)."""
    with open(path, "w") as f:
        for r in sorted(results, key=lambda r: r.rollout_id):
            f.write(json.dumps(dict(rollout_id=r.rollout_id, task_id=r.task_id, status=r.status, score=r.score,
                                    calls=calls.get(r.rollout_id, 0), subagents=r.subagents,
                                    compactions=r.compactions, wall_time_s=round(r.wall_time_s, 3))) + "\n")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of a task with ``c`` of ``n`` samples passing."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def episode_metrics(results: Sequence, tasks: Sequence, k: int, pass_score: float, calls: dict[str, int]) -> dict:
    """The eval's numbers from its RolloutResults (see the module docstring)."""
    by_task: dict[str, list] = {t.task_id: [] for t in tasks}
    for r in results:
        by_task[r.task_id].append(r)
    scored = [r for r in results if r.score is not None]
    p1, pk = [], []
    for rs in by_task.values():
        ok = [r for r in rs if r.score is not None]
        if not ok:
            continue
        c = sum(r.score >= pass_score for r in ok)
        p1.append(c / len(ok))
        pk.append(pass_at_k(len(ok), c, min(k, len(ok))))
    statuses: dict[str, int] = {}
    for r in results:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    return {
        "eval_reward": float(np.mean([r.score for r in scored])) if scored else float("nan"),
        "eval_exact": float(np.mean(p1)) if p1 else float("nan"),
        "eval_pass_at_k": float(np.mean(pk)) if pk else float("nan"),
        "eval_k": k,
        "eval_tasks": len(by_task),  # held-out tasks run (eval.tasks caps it; a smaller file runs them all)
        "eval_episodes": len(results),
        "eval_failed": len(results) - len(scored),
        "eval_grader_errors": statuses.get("verifier_error", 0),
        "eval_timeouts": statuses.get("timeout", 0),
        "eval_calls": float(np.mean([calls.get(r.rollout_id, 0) for r in results])) if results else 0.0,
        # how the episodes branched: sub-agents run and contexts compacted per episode
        "eval_subagents": float(np.mean([r.subagents for r in results])) if results else 0.0,
        "eval_compactions": float(np.mean([r.compactions for r in results])) if results else 0.0,
        "eval_format": float(np.mean([r.status == "completed" for r in results])) if results else float("nan"),
    }


class EvalCancelled(Exception):
    """The run is closing: the eval of this version was cut short (its episodes cancelled, their
    commands stopped); a resumed run evaluates the version again from the start."""


class CancellableRun:
    """``run(coro)`` runs a coroutine on a fresh event loop in the calling thread; ``cancel()``, from
    any thread, cancels it there (and every later ``run``) and ``run`` raises :class:`EvalCancelled`.

    Why: a stop (SIGTERM, Ctrl-C, a failure) closes the eval, and an eval of 64 whole episodes runs
    for one to several minutes; waiting for it held the process that long after the run had saved
    (40 s measured on the learning bench, up to the 120 s close timeout under load), past e.g. a
    Kubernetes grace period. Cancelling reaches each episode's own cleanup (a running command is
    stopped, the rollout's tasks are gathered)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._cancelled = False
        self._running: tuple[asyncio.AbstractEventLoop, asyncio.Task] | None = None

    def run(self, coro):
        async def main():
            with self._lock:
                if self._cancelled:
                    raise EvalCancelled("the eval was cancelled before it started")
                self._running = (asyncio.get_running_loop(), asyncio.current_task())
            try:
                return await coro
            finally:
                with self._lock:
                    self._running = None

        try:
            return asyncio.run(main())
        except asyncio.CancelledError as e:
            if self.cancelled:
                raise EvalCancelled("the eval was cancelled: the run is closing") from None
            # Not our cancel (e.g. a rollout's task cancelled by a library): a failure of this eval, reported
            # as one, never read as the run closing.
            raise RuntimeError("the eval was cancelled, but not by the run's close") from e
        finally:
            coro.close()  # never started (cancelled before): no "never awaited" warning

    @property
    def cancelled(self) -> bool:
        with self._lock:
            return self._cancelled

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            running = self._running
        if running is not None:
            loop, task = running
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # the loop closed meanwhile: nothing left to cancel
                pass


class EpisodeEval:
    """Whole episodes of ``tasks`` x ``samples_per_task`` at one version (module docstring)."""

    def __init__(self, *, tasks: Sequence, samples_per_task: int, pass_score: float, harness_config,
                 make_harness: Callable[[str], Any], make_backend: Callable[[Any, int], Any], tokenizer,
                 workdir: str, seed: int, max_tokens_cap: int, start_timeout_s: float = 300.0):
        if not tasks:
            raise ValueError("EpisodeEval: no held-out tasks")
        self.tasks, self.k, self.pass_score = list(tasks), samples_per_task, pass_score
        self.hc, self._make_harness, self._make_backend = harness_config, make_harness, make_backend
        self.tok, self.workdir, self.seed, self.cap = tokenizer, workdir, seed, max_tokens_cap
        self._server: ServerThread | None = None
        self._backend: Any = None
        self._sock_dir: str | None = None
        self._runner = CancellableRun()
        self.start_timeout_s = start_timeout_s

    def cancel(self) -> None:
        """Cut the eval running now short (and refuse later ones): the run is closing."""
        self._runner.cancel()

    def _start(self, params, version: int) -> ServerThread:
        from gyre_jax.serving.proxy import Proxy, ProxyConfig
        from gyre_jax.serving.router import Router
        from gyre_jax.serving.server_thread import ServerThread

        sock = os.path.join(self.workdir, "eval.sock")
        if len(sock.encode()) > 100:
            self._sock_dir = tempfile.mkdtemp(prefix="gyre-eval-")
            sock = os.path.join(self._sock_dir, "eval.sock")
        self._backend = self._make_backend(params, version)
        backend = self._backend

        async def build():
            return Proxy(Router([backend]), self.tok, CallCounter(),
                         ProxyConfig(auth_token=secrets.token_hex(16), unix_path=sock, max_tokens_cap=self.cap,
                                     clamp_max_tokens=True, model_aliases=("*",), seed_salt=self.seed))

        self._server = ServerThread(build)
        url = self._server.start(self.start_timeout_s, "the held-out eval's engine")
        self._url, self._sock = url, sock
        return self._server

    def __call__(self, params, version: int) -> dict:
        import dataclasses

        from gyre_jax.agents.harness import RolloutRequest, run_rollouts

        t0 = time.perf_counter()
        if self._runner.cancelled:
            raise EvalCancelled("the eval was cancelled before it started")
        if self._server is None:
            server = self._start(params, version)
            if self._runner.cancelled:
                # The run closed while the engine and server were built: its close() found no server to
                # stop (the cancel comes before the close), so this one is stopped here, not leaked.
                self.close()
                raise EvalCancelled("the eval was cancelled while its engine started")
        else:
            server = self._server
            self._backend.engine.publish(params, version)
        sink = server.proxy.sink
        sink.start_version(version)
        hc = dataclasses.replace(self.hc, base_url=self._url + "/v1", run_id=sink.run_id)
        reqs = [RolloutRequest(rollout_id=f"e{i:04d}-{j}", task=t, group_id=f"e{i:04d}")
                for i, t in enumerate(self.tasks) for j in range(self.k)]
        root = os.path.join(self.workdir, f"v{version:06d}")
        if os.path.exists(root):  # an eval of this version cut short by a stop: start it over
            import shutil
            shutil.rmtree(root, ignore_errors=True)
        results = self._runner.run(run_rollouts(reqs, hc, workspace_root=root, harness=self._make_harness(self._sock),
                                                keys=server.proxy))
        calls = sink.calls_by_rollout()
        out = episode_metrics(results, self.tasks, self.k, self.pass_score, calls)
        out["eval_s"] = time.perf_counter() - t0
        write_episodes(os.path.join(root, "episodes.jsonl"), results, calls)
        return out

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._sock_dir is not None:
            import shutil
            shutil.rmtree(self._sock_dir, ignore_errors=True)


class BackgroundEval:
    """Runs an evaluator (``fn(params, version) -> dict``) on its own thread, one version at a time."""

    background = True

    def __init__(self, fn: Callable[[Any, int], dict], *, log_dir: str | None = None,
                 on_close: Sequence[Callable[[], None]] = ()):
        """log_dir: where eval.jsonl and TensorBoard events go (one line per version: ``eval/<metric>``)."""
        self.fn, self.log_dir, self.on_close = fn, log_dir, tuple(on_close)
        self.writer: MetricsWriter | None = None
        self.done_through: int | None = None  # versions up to this one were evaluated by an earlier attempt
        self.results: list[dict] = []
        self.errors: list[tuple[int, BaseException]] = []
        self._q: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self, resume_step: int | None = None) -> None:
        """Open the log (a resumed run from checkpoint ``resume_step``: drop the lines of versions after it,
        whose params were lost, and keep the others, which are not evaluated again) and start the thread."""
        if self.log_dir is not None:
            from gyre_jax.rl.metrics import MetricsWriter

            self.writer = MetricsWriter(self.log_dir, jsonl_name="eval.jsonl",
                                        purge_step=None if resume_step is None else resume_step + 1)
            self.done_through = self.writer.last_step
        self._thread = threading.Thread(target=self._main, name="gyre-eval", daemon=True)
        self._thread.start()

    def evaluate(self, version: int, params) -> dict:
        """The ``Evaluator`` call (gyre_jax.rl.evaluators): queued; its numbers reach eval.jsonl, not the step."""
        self.submit(version, params)
        return {}

    def submit(self, version: int, params) -> None:
        """Queue an eval of ``params`` (copied to the host now) as ``version``."""
        if self.done_through is not None and version <= self.done_through:
            log.info("rl: version %d was evaluated before the restart (eval.jsonl); not again", version)
            return
        self._q.put((version, jax.device_get(params)))

    def _main(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            version, params = item
            try:
                r = self.fn(params, version)
            except EvalCancelled:
                log.info("rl: the eval of version %d was cut short: the run is closing", version)
                continue
            except Exception as e:  # noqa: BLE001 - a measurement; the run goes on without it
                log.exception("held-out eval at version %d failed", version)
                with self._lock:
                    self.errors.append((version, e))
                continue
            with self._lock:
                self.results.append({"version": version, **r})
            log.info("rl: eval at version %d: score %.3f, pass@1 %.3f, pass@%d %.3f (%d episodes, %.1fs)", version,
                     r["eval_reward"], r["eval_exact"], r["eval_k"], r["eval_pass_at_k"], r["eval_episodes"],
                     r["eval_s"])
            if self.writer is not None:
                self.writer.write(version, {("eval/" + k[5:] if k.startswith("eval_") else "eval/" + k): v
                                            for k, v in r.items()})

    def finish(self, timeout: float | None = None) -> list[dict]:
        """Wait for every queued eval; the results, oldest version first."""
        if self._thread is not None and self._thread.is_alive():
            self._q.put(None)
            self._thread.join(timeout)
        with self._lock:
            return sorted(self.results, key=lambda r: r["version"])

    def close(self) -> None:
        """Drop queued evals (a failing run does not wait for them), cut the running one short (an
        evaluator with ``cancel()``: CancellableRun), stop the engine and the writer."""
        while True:
            try:
                self._q.get_nowait()
            except queue.Empty:
                break
        cancel = getattr(self.fn, "cancel", None)
        if cancel is not None:
            cancel()
        self.finish(timeout=120)
        for fn in (*self.on_close, *((self.writer.close,) if self.writer is not None else ())):
            try:
                fn()
            except Exception:  # noqa: BLE001 - close the rest
                log.exception("closing the eval failed")
