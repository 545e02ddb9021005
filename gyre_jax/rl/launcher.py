"""Groups of harness rollouts behind the scheduler's ``RolloutLauncher``, and their resume.

A group is ``group_size`` rollouts of one task (rollout ids ``<group>-<k>``); when
all of them have an outcome in the store, the group goes to the trainer. The
harness runs on its own event loop (``LoopThread``) and talks to the proxy over
HTTP like any other harness.

Resume. A run killed mid-group leaves groups with some rollouts finished and some
not: in flight (calls recorded, no outcome) or never started. Training such a
group short would silently change its advantage baseline, so ``resume_plan``
finds them in the store, gives every abandoned attempt an ``infra_error`` outcome
(recorded, never trained, dropped with its reason), and the launcher re-runs each
missing rollout under a new attempt id ``<group>-<k>.r<n>`` before the group goes
to training whole.

Failures. A harness error the rollout itself did not catch (a bug, a broken
session) must not hang the policy, which counts the group as running: every
rollout of the group without an outcome gets an ``infra_error`` outcome and the
group is reported with what it has (``group_failures`` counts them).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import re
import threading
import time
from typing import Any, Callable, Sequence

import aiohttp

from gyre_jax.agents.harness import RolloutRequest, group_requests, iter_rollouts
from gyre_jax.errors import RunFailed, StorageError
from gyre_jax.rl.groups import Group, lineage_calls, lineage_version  # noqa: F401 - importable from here too
from gyre_jax.trajectory.records import RolloutOutcome
from gyre_jax.trajectory.vocab import FAILURE_STATUSES, STATUS_INFRA_ERROR

log = logging.getLogger(__name__)
_ROLLOUT_ID = re.compile(r"^(g\d+)-(\d+)(?:\.r(\d+))?$")
ABANDONED = "abandoned:"  # how the error of an attempt a stop cut off begins (resume_plan)


@dataclasses.dataclass(frozen=True)
class ResumedGroup:
    """A group the killed run left short: what finished, and which slots to run again."""

    group_id: str
    number: int  # g in the group id (the task seed)
    version: int  # oldest policy version of the tokens it will train (lineage_version): the bound counts from it
    finished: tuple[str, ...]  # rollout ids with an outcome (kept)
    rerun: tuple[str, ...]  # new rollout ids for the missing slots
    abandoned: tuple[str, ...]  # attempts that were in flight at the kill (infra_error outcomes now)


def _abandoned(store, rid: str) -> bool:
    o = store.outcome(rid)
    return o.status == STATUS_INFRA_ERROR and str(o.details.get("error", "")).startswith(ABANDONED)


def group_number(group_id: str) -> int:
    return int(group_id[1:])


def infra_error_outcome(run_id: str, rid: str, task_id: str, group_id: str, calls, error: str) -> RolloutOutcome:
    """The outcome of a rollout the infrastructure cut off: recorded with its calls, never trained."""
    return RolloutOutcome(run_id=run_id, rollout_id=rid, task_id=task_id, group_id=group_id, status=STATUS_INFRA_ERROR,
                          score=None, details={"error": error},
                          policy_versions=tuple(sorted({c.policy_version for c in calls})), t_end=time.time(),
                          num_calls=len(calls))


def resume_plan(store, run_id: str, group_size: int, steps_done: int, pending: Sequence[str]):
    """(complete groups of ``pending`` rollout ids, short groups to finish) after a restart.

    ``pending``: finished, untrained rollout ids (``resume_store``'s order). A group
    with any rollout finished or in flight at the stop was admitted: it is finished
    (its missing slots re-run), never dropped. Writes an ``infra_error`` outcome for
    every attempt the stop cut off.
    """
    unfinished = set(store.unfinished_rollouts())
    slots: dict[str, dict[int, list[str]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    order: list[str] = []
    for rid in list(pending) + sorted(unfinished):
        m = _ROLLOUT_ID.match(rid)
        if m is None:
            continue  # not a launcher rollout (e.g. a harness pointed at the proxy by hand)
        gid = m.group(1)
        if gid not in slots:
            order.append(gid)
        slots[gid][int(m.group(2))].append(rid)
    pending_set = set(pending)
    complete, short = [], []
    for gid in order:
        by_slot = slots[gid]
        finished = [r for k in sorted(by_slot) for r in by_slot[k] if r in pending_set]
        # A slot is done when an attempt finished for real. An attempt an earlier resume marked abandoned is
        # pending too (an outcome, not yet dropped), but it does not fill its slot: counting it let a group
        # stopped again before its re-runs finished train short (a second kill inside one interval).
        done_slots = {k for k, ids in by_slot.items() if any(r in pending_set and not _abandoned(store, r) for r in ids)}
        # Dated by the oldest policy that sampled a token it will train: the staleness bound counts from it,
        # as for any group. Tokens sampled after the restored checkpoint came from the lost lineage's newer
        # policies, which this lineage never has: they count as sampled by the restored one (the trainer
        # re-dates them the same way, lineage_versions). Waiting for the trainer to reach their version
        # numbers instead trained the group's oldest tokens up to 2x the bound late, or (a step that could
        # take only such groups, with launches held back by the bound) stalled the run.
        # (An abandoned attempt is consumed with its group, never trained: its tokens do not date it.)
        versions = [lineage_version(v, steps_done) for r in finished if not _abandoned(store, r)
                    for v in store.outcome(r).policy_versions]
        if len(done_slots) >= group_size:
            complete.append(Group(gid, min(versions, default=steps_done), finished, 0.0))
            continue
        version = min(versions + [steps_done])  # re-run slots are sampled now, at steps_done
        abandoned = tuple(r for k in sorted(by_slot) for r in by_slot[k] if r in unfinished)
        rerun = []
        for k in range(group_size):
            if k in done_slots:
                continue
            attempts = [int(m.group(3) or 0) for r in by_slot.get(k, []) if (m := _ROLLOUT_ID.match(r))]
            rerun.append(f"{gid}-{k}.r{max(attempts, default=0) + 1}")
        short.append(ResumedGroup(gid, group_number(gid), version, tuple(finished), tuple(rerun), abandoned))
    for rid in sorted(unfinished):  # every attempt the stop cut off gets its outcome now, once
        calls = store.calls(rid)
        store.append(infra_error_outcome(run_id, rid, calls[0].task_id, calls[0].group_id, calls,
                                         f"{ABANDONED} the run stopped while this rollout was in flight; "
                                         "its slot is run again"))
    return complete, short


class RolloutsFailed(RunFailed):
    """A step's worth of rollouts in a row failed (``FailureWindow``): the run stops, naming why."""


class FailureWindow:
    """The last ``size`` finished rollouts; ``add`` returns why the run must stop, or None.

    A run whose rollouts all fail trains on nothing (every rollout excluded) or on nothing but a
    broken harness's zeros: a step's worth in a row that failed, none able to train or all for one
    reason, stops it with that reason, an example log and the end of its output (a harness command
    that does not exist stops after one step's worth, not after the run's budget of rollouts)."""

    def __init__(self, size: int):
        self.size = size
        self.recent: collections.deque = collections.deque(maxlen=max(size, 1))

    @staticmethod
    def failed(result: dict) -> bool:
        """Excluded from training, or a 0 the rollout runner gave without grading (a failed harness)."""
        return result["status"] in FAILURE_STATUSES or (result.get("reason") is not None and not result.get("score"))

    def add(self, result: dict) -> str | None:
        if self.size <= 0:
            return None
        self.recent.append(result)
        if len(self.recent) < self.size or not all(self.failed(r) for r in self.recent):
            return None
        reasons = collections.Counter(f"{r['status']}: {r.get('reason') or 'no reason recorded'}" for r in self.recent)
        excluded = all(r["status"] in FAILURE_STATUSES for r in self.recent)
        if len(reasons) > 1 and not excluded:
            return None
        (top, n), = reasons.most_common(1)
        example = self.recent[-1]
        out = (f"every one of the last {len(self.recent)} rollouts failed"
               + (f": {top}" if len(reasons) == 1 else f" (none can train): {dict(reasons.most_common(3))}")
               + (f"; e.g. {example['log_path']}" if example.get("log_path") else ""))
        tail = str(example.get("output_tail") or "").strip().splitlines()
        return out + (f" (its output ends: {tail[-1][:200]!r})" if tail else "")


class Launcher:
    """Starts groups of harness rollouts (``scheduler.interfaces.RolloutLauncher``)."""

    def __init__(self, *, loop, harness_config, store, run_id: str, task_fn: Callable[[int], Any],
                 group_size: int, workspace_root: str, on_group: Callable[[Group], None],
                 work_s: Callable[[int], float], next_group: int = 0, launched: int = 0, faults=None,
                 harness=None, keys=None, on_error: Callable[[], None] | None = None, failure_window: int = 0):
        """``harness``: what runs each rollout (gyre_jax.agents.harnesses; None: the built-in agent);
        ``keys``: who issues and revokes rollout keys (the proxy; None: the plain gyre:run:rollout form);
        ``failure_window``: a step's worth of rollouts; when that many in a row failed (none can train,
        or all for one reason) the run stops with that reason (``FailureWindow``; 0: never)."""
        self.loop, self.hc, self.store, self.run_id = loop, harness_config, store, run_id
        self.harness, self.keys = harness, keys
        self.task_fn, self.group_size, self.workspace_root = task_fn, group_size, workspace_root
        self.on_group, self.work_s, self.faults = on_group, work_s, faults
        self._lock = threading.Lock()
        self._next_group = next_group
        self._launched = launched
        self._running = 0
        self._groups_by_version: collections.Counter = collections.Counter()
        self._rollouts_launched = 0
        self.statuses: collections.Counter = collections.Counter()
        self.results: list[dict] = []  # per finished rollout: small dict for metrics
        self.group_failures: list[tuple[str, str]] = []  # (group id, error) of groups the harness could not run
        self.rerun_rollouts = 0  # rollouts re-run at resume (their first attempt was cut off)
        self._session: aiohttp.ClientSession | None = None
        self._futures: list[concurrent.futures.Future] = []
        self.errors: list[BaseException] = []  # failures no group can survive (drive stops the run on them)
        self.on_error = on_error  # wakes the loop
        self.failures = FailureWindow(failure_window)

    # -- Protocol --
    def launch(self, n_groups: int, version: int) -> None:
        for _ in range(n_groups):
            with self._lock:
                g = self._next_group
                self._next_group += 1
            self._start(f"g{g:05d}", g, version, group_requests(self.task_fn(g), self.group_size, group_id=f"g{g:05d}"))

    def resume(self, groups: Sequence[ResumedGroup]) -> None:
        """Finish groups a killed run left short (``resume_plan``): run their missing slots."""
        for rg in groups:
            task = self.task_fn(rg.number)
            reqs = [RolloutRequest(rollout_id=rid, task=task, group_id=rg.group_id) for rid in rg.rerun]
            self.rerun_rollouts += len(reqs)
            log.info("resume: group %s had %d of %d rollouts; running %s", rg.group_id, len(rg.finished),
                     self.group_size, list(rg.rerun))
            # The cut-off attempts belong to the group too: consumed (dropped, infra_error) with it.
            self._start(rg.group_id, rg.number, rg.version, reqs, finished=list(rg.finished) + list(rg.abandoned))

    def _start(self, gid: str, number: int, version: int, reqs, finished: Sequence[str] = ()) -> None:
        with self._lock:
            self._launched += 1
            self._running += len(reqs)
            self._groups_by_version[version] += 1
        if self.faults is not None:
            reqs = [self.faults.apply(r, self) for r in reqs]
        fut = self.loop.submit(self._run_group(gid, version, reqs, list(finished)))
        fut.add_done_callback(self._group_done)
        self._futures.append(fut)

    def launched_groups(self) -> int:
        return self._launched

    def running_rollouts(self) -> int:
        return self._running

    def running_groups(self):
        with self._lock:
            return {v: n for v, n in self._groups_by_version.items() if n > 0}

    def next_rollout_number(self) -> int:
        with self._lock:
            self._rollouts_launched += 1
            return self._rollouts_launched

    # -- the group coroutine (harness loop) --
    async def _run_group(self, gid: str, version: int, reqs, finished: list[str]) -> None:
        ids, tokens = list(finished), 0
        left = {r.rollout_id: r for r in reqs}
        try:
            if self._session is None:
                self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
            async for res in iter_rollouts(reqs, self.hc, workspace_root=self.workspace_root, session=self._session,
                                           harness=self.harness, keys=self.keys, progress_log=False):
                calls = await asyncio.to_thread(self._calls_of, res.rollout_id)
                outcome = res.to_outcome(self.run_id, policy_versions=sorted({c.policy_version for c in calls}),
                                         num_calls=len(calls))
                await asyncio.to_thread(self.store.append, outcome)
                left.pop(res.rollout_id, None)
                tokens += sum(int(c.prompt_ids.shape[0] + c.output_ids.shape[0]) for c in calls)
                ids.append(res.rollout_id)
                self._finished(res.rollout_id, res.status, dict(
                    rollout_id=res.rollout_id, status=res.status, score=res.score, retries=res.retries,
                    calls=len(calls), version=version, gen_tokens=sum(int(c.output_ids.shape[0]) for c in calls),
                    exact=bool(res.grader_details.get("exact", False)), sandbox_commands=res.sandbox.get("commands", 0),
                    sandbox_violations=sum(res.sandbox.get("violations", {}).values()),
                    sandbox_limits_hit=sum(res.sandbox.get("limits_hit", {}).values()), reason=res.reason,
                    agent_s=res.agent_time_s, grader_s=res.grader_time_s,  # the step's time split (rl/report.py)
                    model_s=sum(max(0.0, c.t_end - c.t_start) for c in calls),
                    log_path=res.log_path or res.snapshot, output_tail=res.output_tail[-300:]))
        except asyncio.CancelledError:
            raise  # the loop is closing
        except StorageError as e:  # our disk, not the rollouts': no outcome is written, the run stops
            self._fail(e)
            return
        except Exception as e:  # noqa: BLE001 - the group must still end, or the policy waits for it forever
            log.exception("group %s: the harness failed; %d rollouts recorded as infra_error", gid, len(left))
            self.group_failures.append((gid, repr(e)))
            try:
                for rid, req in left.items():
                    await asyncio.to_thread(self._record_failure, rid, req, gid, e)
                    ids.append(rid)
                    self._finished(rid, STATUS_INFRA_ERROR, dict(rollout_id=rid, status=STATUS_INFRA_ERROR, score=None,
                                                                 retries=0, calls=0, version=version, gen_tokens=0,
                                                                 exact=False, reason=f"harness group failed: "
                                                                 f"{type(e).__name__}"))
            except Exception as e2:  # noqa: BLE001 - recording the failure failed: the run must hear of it
                self._fail(e2)
                return
        # Ready before it stops counting as running: the policy must never see the group in
        # neither place, or it fills a step with a newer group and this one trains a step late.
        self.on_group(Group(gid, version, ids, self.work_s(tokens)))
        with self._lock:
            self._groups_by_version[version] -= 1

    def _fail(self, e: BaseException) -> None:
        """A group that cannot end: ``drive`` stops the run on ``errors`` at its next tick (never a short group).
        Said once per distinct error: on a full disk every running group meets the same one."""
        if all(str(e) != str(seen) for seen in self.errors):
            log.error("launcher: %s", e)
        self.errors.append(e)
        if self.on_error is not None:
            self.on_error()

    def _group_done(self, fut: concurrent.futures.Future) -> None:
        """Whatever escaped a group coroutine reaches ``errors`` (nobody else reads its future)."""
        if fut.cancelled():
            return
        e = fut.exception()
        if e is not None:
            self._fail(e)

    def _finished(self, rid: str, status: str, result: dict) -> None:
        with self._lock:
            self._running -= 1
            self.statuses[status] += 1
            self.results.append(result)
            stop = self.failures.add(result)
        if stop is not None:
            self._fail(RolloutsFailed(stop))

    def _record_failure(self, rid: str, req, gid: str, error: BaseException) -> None:
        self.store.append(infra_error_outcome(self.run_id, rid, req.task.task_id, gid, self._calls_of(rid),
                                              f"harness failed: {error!r}"))

    def _calls_of(self, rollout_id: str):
        try:
            return self.store.calls(rollout_id)
        except KeyError:  # no call recorded (e.g. stalled until the deadline)
            return []

    def close(self) -> None:
        for f in self._futures:
            f.cancel()
        if self._session is not None:
            self.loop.submit(self._session.close()).result(10)
