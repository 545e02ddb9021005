"""The real cells, proxy, harness and trainer behind the scheduler's Protocols.

The controller (``gyre_jax.scheduler.controller``) only calls non-blocking
methods; each adapter starts the work in a thread and reports completion through
its state (``role``, ``published_version``, ``progress``) and a ``notify()``
callback that wakes the loop. Threads:

* the proxy's event loop (``ServerThread``): routing, engines (JetStream threads);
* the harness event loop (``LoopThread``): agents, HTTP client, grader subprocesses;
* a small pool for switches and publications (device copies);
* the trainer thread: process a full step's groups, run the elastic step, mark
  its rollouts trained in the store, copy the new params for publication.

Staleness is bounded by the policy's admission (``Launch``); every finished
rollout is trained (or, for infra/verifier failures, marked dropped with its
status as the reason) exactly once.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import math
import queue
import threading
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from gyre_jax.scheduler.interfaces import TrainProgress
from gyre_jax.scheduler.policy import ReadyGroup

log = logging.getLogger(__name__)


class RealClock:
    def __init__(self):
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0


class LoopThread:
    """An asyncio loop in a daemon thread (the harness runs here)."""

    def __init__(self, name: str = "gyre-harness"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


class Timeline:
    """Role segments per cell (cell, t0, t1, role) and completed switch durations."""

    def __init__(self, clock: RealClock, roles: Sequence[str]):
        self.clock = clock
        self._lock = threading.Lock()
        self._open = {c: (r, 0.0) for c, r in enumerate(roles)}
        self.segments: list[tuple[int, float, float, str]] = []
        self.switches: list[tuple[int, str, float, float]] = []  # (cell, to_role, t_start, seconds)

    def set(self, cell: int, role: str) -> None:
        now = self.clock.now()
        with self._lock:
            prev, t0 = self._open[cell]
            self.segments.append((cell, t0, now, prev))
            self._open[cell] = (role, now)
            if prev in ("to_train", "to_rollout") and role in ("train", "rollout"):
                self.switches.append((cell, role, t0, now - t0))

    def close(self) -> list[tuple[int, float, float, str]]:
        now = self.clock.now()
        with self._lock:
            for c, (r, t0) in self._open.items():
                self.segments.append((c, t0, now, r))
                self._open[c] = (r, now)
            return list(self.segments)


@dataclasses.dataclass
class Group:
    group_id: str
    version: int  # published policy version when it was admitted
    rollout_ids: list[str]
    work_s: float  # estimated training cell-seconds


# ---------------------------------------------------------------------------- proxy
class ProxyAdapter:
    """Routing side of the recording proxy (``scheduler.interfaces.Proxy``)."""

    def __init__(self, server, names: dict[int, str], routable: Sequence[int]):
        self.server, self.names = server, names
        self.router = server.proxy.router
        self._routable = set(routable)
        self._drains: dict[int, concurrent.futures.Future] = {}
        for c in names:  # start consistent with the initial roles (no calls yet: instant)
            if c not in self._routable:
                server.run(self.router.drain(names[c]), timeout=60)

    def drain(self, cell: int) -> None:
        self._routable.discard(cell)
        if cell in self.names:
            self._drains[cell] = self.server.submit(self.router.drain(self.names[cell]))

    def wait_drained(self, cell: int, timeout: float = 300.0) -> None:
        fut = self._drains.pop(cell, None)
        if fut is not None:
            fut.result(timeout)

    def admit(self, cell: int) -> None:
        if cell not in self.names:
            raise ValueError(f"cell {cell} has no engine (mode does not serve on it)")
        self._routable.add(cell)
        self.server.run(self.router.admit(self.names[cell]), timeout=60)

    def routable(self, cell: int) -> bool:
        return cell in self._routable

    def in_flight_calls(self, cell: int) -> int:
        b = self.router.cells.get(self.names.get(cell, ""))
        return 0 if b is None else b.num_active()

    def queued_calls(self) -> int:
        return 0  # the router keeps no queue we can count without waiting on it; calls wait for a cell


# ---------------------------------------------------------------------------- cells
class CellPoolAdapter:
    """Cells, roles, switches and weight publication (``scheduler.interfaces.CellPool``)."""

    def __init__(self, *, cells, roles: Sequence[str], backends: dict[int, Any], proxy: ProxyAdapter,
                 timeline: Timeline, notify: Callable[[], None], version: int, slots: int):
        self.cells, self.backends, self.proxy, self.timeline, self.notify = cells, backends, proxy, timeline, notify
        self._roles = list(roles)
        self._slots = slots
        self._published = version
        self._publishing = False
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="switch")
        self._load_lock = threading.Lock()
        self.trainer: TrainerAdapter | None = None  # set by the loop (they refer to each other)
        self.errors: list[BaseException] = []

    # -- Protocol --
    def cell_ids(self):
        return range(len(self.cells))

    def core_cell(self) -> int:
        return 0

    def role(self, cell: int) -> str:
        return self._roles[cell]

    def roles(self) -> list[str]:
        return list(self._roles)

    def slots(self, cell: int) -> int:
        return self._slots

    def _set(self, cell: int, role: str) -> None:
        self._roles[cell] = role
        self.timeline.set(cell, role)
        self.notify()

    def _run(self, fn, *args) -> None:
        def guarded():
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - surfaced by the loop
                log.exception("switch/publish failed")
                self.errors.append(e)
                self.notify()

        self._pool.submit(guarded)

    def switch_to_train(self, cell: int) -> None:
        self._set(cell, "to_train")
        self._run(self._to_train, cell)

    def _to_train(self, cell: int) -> None:
        self.proxy.wait_drained(cell)
        self._set(cell, "train")
        self.trainer.on_train_cell(cell)

    def switch_to_rollout(self, cell: int) -> None:
        self._set(cell, "to_rollout")
        self._run(self._to_rollout, cell)

    def _to_rollout(self, cell: int) -> None:
        self.trainer.wait_cell_free(cell)  # a satellite finishes its micro-batches of the running step
        self._load(cell)
        self._set(cell, "rollout")

    def _load(self, cell: int) -> None:
        """Give the cell's engine the newest published params (never an older version)."""
        with self._load_lock:
            # The newest trained params: never older than the published version, and a
            # newer one only makes the cell's rollouts fresher.
            version, params = self.trainer.latest_params()
            engine = self.backends[cell].engine
            if engine.params_ref.version < version:
                engine.publish(params, version)

    def publish(self, version: int) -> None:
        self._publishing = True
        self._run(self._publish, version)

    def _publish(self, version: int) -> None:
        # The swap is not preceded by a drain: a call already in a slot finishes on the new
        # weights (its record carries the version of its first token; the behavior
        # log-probs are the ones actually sampled, so the importance ratio stays exact).
        # Draining every serving cell per publication would stall all agents here.
        try:
            have, params = self.trainer.latest_params()
            if have < version:
                raise RuntimeError(f"publish({version}): the trainer only has version {have}")
            with self._load_lock:
                for c, backend in self.backends.items():
                    if self._roles[c] in ("rollout", "to_rollout") and backend.engine.params_ref.version < have:
                        backend.engine.publish(params, have)
                self._published = have
        finally:
            self._publishing = False
            self.notify()

    def published_version(self) -> int:
        return self._published

    def publish_in_progress(self) -> bool:
        return self._publishing

    def close(self) -> None:
        self._pool.shutdown(wait=True)


# ---------------------------------------------------------------------------- rollouts
class Launcher:
    """Starts groups of harness rollouts (``scheduler.interfaces.RolloutLauncher``)."""

    def __init__(self, *, loop: LoopThread, harness_config, store, run_id: str, task_fn: Callable[[int], Any],
                 group_size: int, workspace_root: str, on_group: Callable[[Group], None],
                 work_s: Callable[[int], float], next_group: int = 0, faults=None):
        self.loop, self.hc, self.store, self.run_id = loop, harness_config, store, run_id
        self.task_fn, self.group_size, self.workspace_root = task_fn, group_size, workspace_root
        self.on_group, self.work_s, self.faults = on_group, work_s, faults
        self._lock = threading.Lock()
        self._next_group = next_group
        self._launched = 0
        self._running = 0
        self._groups_by_version: collections.Counter = collections.Counter()
        self._rollouts_launched = 0
        self.statuses: collections.Counter = collections.Counter()
        self.results: list[dict] = []  # per finished rollout: small dict for metrics
        self.errors: list[BaseException] = []
        self._session = None
        self._futures: list[concurrent.futures.Future] = []

    def set_launched(self, n: int) -> None:
        with self._lock:
            self._launched = n

    # -- Protocol --
    def launch(self, n_groups: int, version: int) -> None:
        from gyre_jax.agents.harness import group_requests

        for _ in range(n_groups):
            with self._lock:
                g = self._next_group
                self._next_group += 1
                self._launched += 1
                self._running += self.group_size
                self._groups_by_version[version] += 1
            gid = f"g{g:05d}"
            task = self.task_fn(g)
            reqs = group_requests(task, self.group_size, group_id=gid)
            if self.faults is not None:
                reqs = [self.faults.apply(r, self) for r in reqs]
            self._futures.append(self.loop.submit(self._run_group(gid, version, reqs)))

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
    async def _run_group(self, gid: str, version: int, reqs) -> None:
        import aiohttp

        from gyre_jax.agents.harness import iter_rollouts

        try:
            if self._session is None:
                self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
            ids, tokens = [], 0
            async for res in iter_rollouts(reqs, self.hc, workspace_root=self.workspace_root, session=self._session):
                calls = await asyncio.to_thread(self._calls_of, res.rollout_id)
                outcome = res.to_outcome(self.run_id, policy_versions=sorted({c.policy_version for c in calls}),
                                         num_calls=len(calls))
                await asyncio.to_thread(self.store.append, outcome)
                tokens += sum(int(c.prompt_ids.shape[0] + c.output_ids.shape[0]) for c in calls)
                ids.append(res.rollout_id)
                with self._lock:
                    self._running -= 1
                    self.statuses[res.status] += 1
                    self.results.append(dict(rollout_id=res.rollout_id, status=res.status, score=res.score,
                                             retries=res.retries, calls=res.calls, version=version,
                                             gen_tokens=sum(int(c.output_ids.shape[0]) for c in calls),
                                             exact=bool(res.grader_details.get("exact", False))))
            with self._lock:
                self._groups_by_version[version] -= 1
            self.on_group(Group(gid, version, ids, self.work_s(tokens)))
        except BaseException as e:  # noqa: BLE001 - a harness bug must stop the run, loudly
            log.exception("group %s failed", gid)
            self.errors.append(e)
            self.on_group(None)

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


# ---------------------------------------------------------------------------- trainer
class TrainerAdapter:
    """Finished groups -> the open step -> an elastic update (``scheduler.interfaces.Trainer``).

    Groups are taken into the open step as the policy says; once the step holds
    ``groups_per_step`` groups the trainer thread processes them (one
    ``process_step`` over the step's rollouts, so loss weights sum to 1 over the
    global step) and runs the elastic step: the core pulls micro-batches at once,
    every cell in train role joins (also cells that finish switching meanwhile).
    """

    def __init__(self, *, trainer, store, processor_config, groups_per_step: int, micro_batch_rows: int,
                 cells, cell_roles: Callable[[], list[str]], notify: Callable[[], None],
                 on_step: Callable[[dict], None], work_s_per_row: float, row_len: int,
                 steps_done: int = 0, ready: Sequence[Group] = (), after_update: Callable[[int], None] | None = None,
                 on_step_started: Callable[[int], None] | None = None):
        self.trainer, self.store, self.pc = trainer, store, processor_config
        self.G, self.b, self.cells, self.cell_roles = groups_per_step, micro_batch_rows, cells, cell_roles
        self.notify, self.on_step, self.after_update = notify, on_step, after_update
        self.on_step_started = on_step_started  # test hook (FaultConfig.pause_at_step); None in real runs
        self.work_s_per_row, self.row_len = work_s_per_row, row_len
        self._lock = threading.RLock()
        self._ready: list[Group] = sorted(ready, key=lambda g: g.version)
        self._taken: list[Group] = []
        self._steps_done = steps_done
        self._updating = False
        self._step = None  # ElasticStep in progress
        self._joined: set[int] = set()
        self._q: queue.Queue = queue.Queue()
        self._latest = (trainer.version, jax.tree.map(lambda x: x.copy(), trainer.state.params))
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._main, name="gyre-trainer", daemon=True)
        self._thread.start()

    # -- Protocol --
    def progress(self) -> TrainProgress:
        with self._lock:
            return TrainProgress(
                steps_done=self._steps_done,
                open_step_taken=self.G if self._updating else len(self._taken),
                pending_work_s=sum(g.work_s for g in self._taken) + (self._pending_running_s() if self._updating else 0.0),
                update_in_progress=self._updating,
                ready_groups=tuple(ReadyGroup(version=g.version, work_s=g.work_s) for g in self._ready),
            )

    def _pending_running_s(self) -> float:
        step = self._step
        return 0.0 if step is None else step.remaining() * self.b * self.work_s_per_row

    def take_groups(self, n: int) -> None:
        with self._lock:
            if self._updating or n > len(self._ready) or len(self._taken) + n > self.G:
                raise RuntimeError(f"take_groups({n}): {len(self._ready)} ready, {len(self._taken)} taken, "
                                   f"updating={self._updating}")
            self._taken += self._ready[:n]
            del self._ready[:n]
            if len(self._taken) == self.G:
                self._updating = True
                self._q.put(list(self._taken))
                self._taken = []

    # -- inputs from other adapters --
    def add_group(self, group: Group) -> None:
        with self._lock:
            # oldest version first, FIFO within a version (the policy's ordering)
            i = len(self._ready)
            while i > 0 and self._ready[i - 1].version > group.version:
                i -= 1
            self._ready.insert(i, group)
        self.notify()

    def buffered_rollouts(self) -> list[str]:
        with self._lock:
            return [r for g in self._taken + self._ready for r in g.rollout_ids]

    def on_train_cell(self, cell: int) -> None:
        """A satellite finished switching to train: join the step in progress, if any."""
        with self._lock:
            step = self._step
            if step is None or cell == 0 or cell in self._joined:
                return
            try:
                if step.join(self.cells[cell]):
                    self._joined.add(cell)
            except RuntimeError:  # the step finished meanwhile
                pass

    def wait_cell_free(self, cell: int) -> None:
        """A satellite wanted back for rollout leaves the running step: it finishes what it
        pulled, the core and other cells take the rest (``ElasticStep.leave``)."""
        with self._lock:
            step = self._step if cell in self._joined else None
            fut = None
            if step is not None:
                try:
                    fut = step.leave(self.cells[cell])
                except ValueError:  # already done with this step
                    fut = None
        if fut is not None:
            fut.result()
        with self._lock:
            self._joined.discard(cell)

    def latest_params(self):
        with self._lock:
            return self._latest

    @property
    def steps_done(self) -> int:
        return self._steps_done

    def stop(self) -> None:
        self._q.put(None)
        self._thread.join(60)

    # -- trainer thread --
    def _main(self) -> None:
        while True:
            groups = self._q.get()
            if groups is None:
                return
            try:
                self._train(groups)
            except BaseException as e:  # noqa: BLE001 - surfaced by the loop
                log.exception("training step failed")
                self.errors.append(e)
                self.notify()
                return

    def _batch(self, rids):
        from gyre_jax.trajectory.processor import process_step

        outcomes = [self.store.outcome(r) for r in rids]
        calls = []
        for r in rids:
            try:
                calls += self.store.calls(r)
            except KeyError:
                pass
        batch = process_step(calls, outcomes, self.pc)
        B = batch.rows.tokens.shape[0]
        if B == 0 or B % self.b:
            need = max(1, math.ceil(B / self.b)) * self.b
            batch = process_step(calls, outcomes, dataclasses.replace(self.pc, min_rows=need))
        return batch, outcomes

    def _train(self, groups: list[Group]) -> None:
        from gyre_jax.cells.train_step import MICRO_BATCH_KEYS

        t0 = time.perf_counter()
        # Groups (and rollouts within a group) arrive in finishing order; sorting by id makes
        # the packed rows, hence the losses, a function of the step's rollouts alone (a resumed
        # run reproduces an uninterrupted one). Nothing downstream depends on arrival order.
        groups = sorted(groups, key=lambda g: g.group_id)
        rids = [r for g in groups for r in sorted(g.rollout_ids)]
        batch, outcomes = self._batch(rids)
        rows = batch.rows.as_dict() if hasattr(batch.rows, "as_dict") else dataclasses.asdict(batch.rows)
        B = rows["tokens"].shape[0]
        mbs = [{k: np.asarray(rows[k][i:i + self.b]) for k in MICRO_BATCH_KEYS} for i in range(0, B, self.b)]
        t_proc = time.perf_counter() - t0
        with self._lock:
            self._step = self.trainer.start_step(mbs)
            self._joined = set()
            roles = self.cell_roles()
        for c, role in enumerate(roles):
            if c != 0 and role == "train":
                self.on_train_cell(c)
        if self.on_step_started is not None:
            self.on_step_started(self._steps_done)  # the step runs; its update is neither kept nor saved yet
        report = self._step.wait()
        version = self.trainer.version
        trained = [o.rollout_id for o in outcomes if not o.is_failure]
        failed = [o for o in outcomes if o.is_failure]
        if trained:
            self.store.mark_trained(trained, step=version - 1)
        for status in sorted({o.status for o in failed}):
            self.store.mark_dropped([o.rollout_id for o in failed if o.status == status], step=version - 1,
                                    reason=status)
        params = jax.tree.map(lambda x: x.copy(), self.trainer.state.params)
        cells_used = max(1, len(set(report.cell_of)))
        measured = report.seconds * cells_used / max(B, 1)
        self.work_s_per_row = 0.7 * self.work_s_per_row + 0.3 * measured
        scores = [o.score for o in outcomes if not o.is_failure]
        info = dict(step=version - 1, version=version, groups=[g.group_id for g in groups],
                    group_versions=[g.version for g in groups], rollouts=len(outcomes), report=report,
                    stats=batch.stats, scores=scores, rows=B, micro_batches=len(mbs), process_s=t_proc,
                    step_s=time.perf_counter() - t0, cells_used=sorted(set(report.cell_of)))
        with self._lock:
            self._latest = (version, params)
            self._step = None
            self._joined = set()
        if self.after_update is not None:
            self.after_update(version)  # checkpoint: before the policy may take the next step
        with self._lock:
            self._steps_done = version
            self._updating = False
        self.on_step(info)
        self.notify()
