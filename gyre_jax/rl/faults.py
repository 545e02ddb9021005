"""Fault injection for the RL loop (``config.faults``): what breaks, where, and how often.

It lives with the loop, not in ``gyre_jax.testing``: the faults act inside the real
path (the real proxy, engines, harness, graders and cells), and a user can turn
them on from the command line to see the loop survive them
(``--config.faults.switch_fail_every=3``).

Rollout faults. ``RLFaults(FaultConfig)`` marks every k-th launched rollout
(1-based, counted by the launcher) with a fault and wraps each serving backend so
the marks take effect inside the real proxy/engine path:

* grader crash: the task's grader is replaced by :func:`crashing_grader` (runs in
  the grader subprocess and raises) -> ``verifier_error``, never a score;
* timeout: the rollout's model calls stall until the harness deadline cancels
  them; its workspace starts with half of the expected answer, so grading the
  kept workspace gives partial credit -> ``timeout`` with 0 < score < 1;
* engine error: the rollout's first model call fails with ``EngineError`` at its
  first token (the proxy answers 500 for that call only); the harness retries and
  the rollout completes -> counted in the proxy's ``engine_errors`` and the
  rollout's ``retries``.

Calls are tied to rollouts by the proxy's ``cache_key`` (``run/rollout/agent``).

Cell chaos. ``Chaos(FaultConfig)`` perturbs the cells' timing and health: a
random wait in ``[0, switch_delay_s)`` at random points of every role switch,
join and leave; every k-th switch attempt raises once (the loop retries it);
every k-th micro-batch a satellite pulls fails that satellite (its work goes back
to the other cells; a cell that fails more than ``cells.switch_retries`` times is
taken out of service); ``core_fail_at_step`` fails the core (the run cannot
survive it: it saves what it can and stops, and a rerun resumes).

:func:`pause_at_step` (``FaultConfig.pause_at_step``) is the kill -9 hook of the
resume test: the trainer calls it when a step has started; at the chosen step it
prints ``PAUSED <step>`` and blocks on stdin, so the test kills the process at an
exact point of the real loop, with no sleep and no race.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import random
import sys
import threading
import time
from typing import ClassVar

from gyre_jax.schema import check_ints, check_positive
from gyre_jax.serving.backend import Backend, EngineError, GenerateRequest, TokenStream


@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultConfig:
    """Injected faults (gyre_jax.rl.faults); 0 = off. Every k-th rollout launched (1-based) gets it."""

    SECTION: ClassVar[str] = "faults"
    grader_crash_every: int = 0  # its grader raises -> verifier_error
    timeout_every: int = 0  # its calls stall past the deadline -> timeout, graded for partial credit
    engine_error_every: int = 0  # its first model call fails in the engine -> 500, the harness retries
    # Not a rollout fault: the trainer prints "PAUSED <step>" once that step (0-based, so
    # step 0 cannot be paused) has started on the cells and blocks before its update is
    # kept or checkpointed, so a test can kill -9 the run mid-step (tests/test_rl_resume.py).
    pause_at_step: int = 0
    # Chaos in the cells' timing (the loop's stress test): each role switch, step join
    # and leave waits a random time in [0, switch_delay_s) at a random point.
    switch_delay_s: float = 0.0
    switch_fail_every: int = 0  # every k-th switch attempt raises once (transient: it is retried)
    satellite_fail_every: int = 0  # every k-th micro-batch a satellite pulls fails it (work handed back)
    chaos_seed: int = 0  # seeds the random delays
    # Not survivable: the core fails when step k starts (k >= 1), so the run saves what it can
    # and stops with RunFailed; rerunning without it resumes (the failure path's test).
    core_fail_at_step: int = 0

    def __post_init__(self):
        check_ints(self, ("grader_crash_every", "timeout_every", "engine_error_every", "pause_at_step",
                     "switch_fail_every", "satellite_fail_every", "chaos_seed", "core_fail_at_step"))
        check_positive(self, ("grader_crash_every", "timeout_every", "engine_error_every", "pause_at_step",
                         "switch_delay_s", "switch_fail_every", "satellite_fail_every", "chaos_seed",
                         "core_fail_at_step"), allow_zero=True)

    @property
    def any(self) -> bool:
        """Whether rollouts are marked and backends wrapped (RLFaults); the pause needs neither."""
        return bool(self.grader_crash_every or self.timeout_every or self.engine_error_every)

    @property
    def chaos(self) -> bool:
        """Whether the cells' switches and steps get random delays or failures."""
        return bool(self.switch_delay_s or self.switch_fail_every or self.satellite_fail_every
                    or self.core_fail_at_step)



class InjectedFault(RuntimeError):
    """A failure the loop's own fault injection raised (config.faults)."""


def crashing_grader(task, workspace):
    raise RuntimeError(f"injected grader crash for {task.task_id}")


def pause_at_step(at: int, step: int) -> None:
    """At ``step == at``: print ``PAUSED <step>`` and block until stdin has a line or closes,
    then end the process at once (the test means to kill it first; a parent that went away
    closes the pipe, so an abandoned run never lingers)."""
    if step != at:
        return
    print(f"PAUSED {step}", flush=True)
    sys.stdin.readline()
    print(f"pause_at_step: released at step {step} without being killed; exiting", file=sys.stderr, flush=True)
    os._exit(3)


def _rollout_of(request: GenerateRequest) -> str | None:
    key = request.cache_key or ""
    parts = key.split("/")
    return parts[1] if len(parts) == 3 else None


class RLFaults:
    def __init__(self, config):
        self.config = config
        self._lock = threading.Lock()
        self.stall: set[str] = set()
        self.error_once: set[str] = set()
        self.injected = {"grader_crash": 0, "timeout": 0, "engine_error": 0}

    def apply(self, request, launcher):
        """Mark ``request`` (a RolloutRequest) if its number is due; returns the request to run."""
        n = launcher.next_rollout_number()
        cfg, task = self.config, request.task
        with self._lock:
            if cfg.grader_crash_every and n % cfg.grader_crash_every == 0:
                task = dataclasses.replace(task, grader=f"{__name__}:crashing_grader")
                self.injected["grader_crash"] += 1
            elif cfg.timeout_every and n % cfg.timeout_every == 0:
                expected = str(task.params.get("expected", ""))
                partial = expected[: max(1, len(expected) // 2)]
                task = dataclasses.replace(task, setup_files={**task.setup_files, "answer.txt": partial})
                self.stall.add(request.rollout_id)
                self.injected["timeout"] += 1
            elif cfg.engine_error_every and n % cfg.engine_error_every == 0:
                self.error_once.add(request.rollout_id)
                self.injected["engine_error"] += 1
        return dataclasses.replace(request, task=task)

    def take_error(self, rollout: str | None) -> bool:
        with self._lock:
            if rollout in self.error_once:
                self.error_once.discard(rollout)
                return True
            return False

    def wrap(self, backend: Backend) -> "FaultyBackend":
        return FaultyBackend(backend, self)


class _FaultStream(TokenStream):
    def __init__(self, inner: TokenStream | None, request_id: str, mode: str | None):
        self._inner, self.request_id, self._mode = inner, request_id, mode
        self.finish = None
        self.resume = None

    async def __anext__(self):
        if self._mode == "error":
            raise EngineError(f"injected engine error for request {self.request_id}")
        if self._mode == "stall":
            await asyncio.sleep(3600)  # cancelled when the harness deadline abandons the call
        try:
            ev = await self._inner.__anext__()
        except StopAsyncIteration:
            self.finish, self.resume = self._inner.finish, self._inner.resume
            raise
        return ev


class FaultyBackend(Backend):
    """Delegates to ``inner``; applies the faults marked for the call's rollout."""

    def __init__(self, inner: Backend, faults: RLFaults):
        self.inner, self.faults = inner, faults
        self.name, self.max_context, self.capacity = inner.name, inner.max_context, inner.capacity
        self.vocab_size = getattr(inner, "vocab_size", None)
        self.engine = getattr(inner, "engine", None)

    def submit(self, request: GenerateRequest) -> TokenStream:
        rollout = _rollout_of(request)
        if rollout in self.faults.stall:
            return _FaultStream(None, request.request_id, "stall")
        if self.faults.take_error(rollout):
            return _FaultStream(None, request.request_id, "error")
        return _FaultStream(self.inner.submit(request), request.request_id, None)

    def cancel(self, request_id: str) -> None:
        self.inner.cancel(request_id)

    async def export(self, request_id: str):
        return await self.inner.export(request_id)

    def num_active(self) -> int:
        return self.inner.num_active()

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    def stats(self) -> dict[str, float]:
        return self.inner.stats()

    async def close(self) -> None:
        await self.inner.close()


class Chaos:
    """Random delays and transient failures in the cells' switches and steps (module docstring)."""

    def __init__(self, config):
        self.config = config
        self._rng = random.Random(config.chaos_seed)
        self._lock = threading.Lock()
        self._switches = 0
        self._pulls: collections.Counter = collections.Counter()
        self.injected: collections.Counter = collections.Counter()

    def delay(self) -> None:
        """Maybe wait a random time (a switch, join or leave taking its time)."""
        if not self.config.switch_delay_s:
            return
        with self._lock:
            s = self._rng.random() * self.config.switch_delay_s if self._rng.random() < 0.5 else 0.0
        if s:
            time.sleep(s)

    def switch_attempt(self, cell: int, to_role: str) -> None:
        """Called once per switch attempt; every k-th raises (the caller retries)."""
        k = self.config.switch_fail_every
        with self._lock:
            self._switches += 1
            fail = bool(k) and self._switches % k == 0
            if fail:
                self.injected["switch_failure"] += 1
        if fail:
            raise InjectedFault(f"injected failure of switch #{self._switches} (cell {cell} -> {to_role})")

    def on_pull_for_step(self, step: int):
        """The ElasticStep ``on_pull`` hook for ``step`` (the core fails at ``core_fail_at_step``)."""
        if not self.config.core_fail_at_step or step != self.config.core_fail_at_step:
            return self.on_pull

        def fail_core(cell: int, mb_index: int) -> None:
            if cell == 0:
                self.injected["core_failure"] += 1
                raise InjectedFault(f"injected failure of the core cell at step {step}")
            self.on_pull(cell, mb_index)

        return fail_core

    def on_pull(self, cell: int, mb_index: int) -> None:
        """ElasticStep hook on every pull: satellites may fail, pulls may be slow."""
        if cell == 0:
            return
        k = self.config.satellite_fail_every
        with self._lock:
            self._pulls[cell] += 1
            n = sum(self._pulls.values())
            fail = bool(k) and n % k == 0
            if fail:
                self.injected["satellite_failure"] += 1
        self.delay()
        if fail:
            raise InjectedFault(f"injected failure of satellite cell {cell} at micro-batch {mb_index}")
