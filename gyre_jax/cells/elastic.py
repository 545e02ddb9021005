"""Dynamic data parallelism: satellites join a training step in progress.

A step is a queue of micro-batches whose loss weights are already normalized
over the global step. The core cell starts pulling at once; a satellite may
``join`` at any moment: it takes a snapshot of the params of the step's
version (``jax.device_put`` to its own shardings), then pulls micro-batches
from the same queue (work-stealing, so all cells finish together), computes
gradients with the same jitted ``grad_step`` and sends each micro-batch's
gradient to the core (``jax.device_put`` to the core's shardings). The core
sums them and applies the optax update once every micro-batch is in. A
satellite may also ``leave`` mid-step (the scheduler wants it back for
rollout): it stops pulling, finishes what it holds, and the others take the rest.

Streaming. A step may start before all its micro-batches exist
(``start_step(..., more=True)``): ``add`` appends micro-batches as rollouts
finish, cells that run dry wait for more, and ``close`` says the step is
complete (optionally with a ``grad_scale``, for a step whose normalizer, the
number of trained rollouts, was only known at its end).

Failure model. ``join`` and ``leave`` are legal in any order and from any
thread: joining twice is a no-op, a cell that left may join again (it keeps
its snapshot if its worker is still finishing, or takes a new one), leaving a
cell that is not training returns a finished future, and a step that is over
refuses a join by returning False. A satellite that fails (its device, its
thread) does not fail the step: the micro-batches it had pulled and not
delivered go back to the queue, the other cells compute them, and the report
names the failed cell (``StepReport.failed_cells``) so the caller can take it
out of service. A failure on the core fails the step: ``wait`` re-raises and
the trainer's state is untouched (the update never ran).

Determinism. Gradients are summed on the core strictly in micro-batch index
order (``acc = g0; acc = acc + g1; ...``) by one reducer, so the new params do
not depend on which cell computed which micro-batch, nor on when a satellite
joined, left or failed. The cost: one gradient-sized transfer per micro-batch
a satellite computes, instead of one per satellite.

Other processes. ``join`` also takes a cell that lives in another process
(``gyre_jax.pods.RemoteCell``: no local devices, a ``link``). Its worker here
mails it each micro-batch it pulls and pulls the gradient back onto the core's
shardings (``jax.experimental.transfer``); the params snapshot goes with its
first micro-batch. A micro-batch is delivered only once its gradient is on the
core, so a killed satellite process (its pull fails) hands all it held back.

Overlap. Each cell runs in its own thread and keeps up to ``in_flight``
micro-batches dispatched (JAX async dispatch), so cells compute concurrently
and the reducer's additions overlap with them; a cell only blocks to learn that
its oldest micro-batch is finished before it pulls more, which is what makes
work-stealing balance the cells.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from gyre_jax.cells.mesh import Cell
from gyre_jax.cells.publish import TO_TRAIN, MoveStats, move
from gyre_jax.cells.train_state import TrainState
from gyre_jax.cells.train_step import CellSteps, check_versions, combine_stats, device_micro_batch, staleness

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepReport:
    """Host-side result of one elastic step."""

    version: int  # policy version the gradients were taken at (new params are version + 1)
    loss: float  # sum of micro-batch losses, in index order (times grad_scale)
    stats: dict[str, float]  # every stat combined over micro-batches (CellSteps.reductions), in index order
    grad_norm: float
    update_norm: float
    learning_rate: float
    staleness_mean: float  # over trained tokens: version - target_version
    staleness_max: float
    cell_of: tuple[int, ...]  # cell index that computed each micro-batch
    timeline: tuple[tuple[int, float, float], ...]  # per micro-batch: (cell, pulled_s, done_s) since start
    snapshots: tuple[MoveStats, ...]  # params snapshots sent to satellites that joined
    seconds: float  # start_step to new state ready
    failed_cells: tuple[tuple[int, str], ...] = ()  # satellites whose worker failed: (cell, error)
    grad_scale: float = 1.0  # factor applied to the summed gradient (close(grad_scale=...))

    @property
    def num_micro_batches(self) -> int:
        return len(self.cell_of)

    @property
    def busy_cell_s(self) -> float:
        """Cell-seconds spent computing the micro-batches: per cell, the length of the union of its
        micro-batches' [pulled, done] intervals (up to ``in_flight`` of them overlap), summed over cells.
        Not ``seconds`` x cells: a streamed step stays open while its groups still arrive, and that
        wait is no training work (counted as work, it made training look several times dearer)."""
        return busy_cell_seconds(self.timeline)


_NOTHING_YET = -1  # ElasticStep._pull(wait=False): nothing to hand out at the moment


def busy_cell_seconds(timeline) -> float:
    """``StepReport.busy_cell_s`` of a timeline of (cell, pulled_s, done_s); cell -1: not computed."""
    by_cell: dict[int, list[tuple[float, float]]] = collections.defaultdict(list)
    for cell, pulled, done in timeline:
        if cell >= 0:
            by_cell[cell].append((pulled, done))
    total = 0.0
    for spans in by_cell.values():
        end = -math.inf
        for a, b in sorted(spans):
            if b > end:
                total += b - max(a, end)
                end = b
    return total


class ElasticTrainer:
    """Owns the core's TrainState; runs elastic steps on it one at a time."""

    def __init__(self, steps: CellSteps, core: Cell, state: TrainState, *, in_flight: int = 2):
        if in_flight < 1:
            raise ValueError(f"ElasticTrainer: in_flight must be >= 1, got {in_flight}")
        self.steps = steps
        self.core = core
        self._state = state
        self._version = int(jax.device_get(state.policy_version))
        self.in_flight = in_flight
        self._running: ElasticStep | None = None

    @property
    def state(self) -> TrainState:
        if self._running is not None:
            raise RuntimeError("ElasticTrainer.state: a step is in progress (its update will donate the params)")
        return self._state

    @property
    def version(self) -> int:
        return self._version

    @property
    def step_open(self) -> bool:
        """A step was started and has not finished or failed (its update would donate the params)."""
        return self._running is not None

    def start_step(
        self,
        micro_batches: Sequence[Mapping[str, Any]] = (),
        *,
        more: bool = False,
        on_pull: Callable[[int, int], None] | None = None,
        on_done: Callable[[int, int], None] | None = None,
    ) -> "ElasticStep":
        """Start a step; the core begins pulling at once. Returns a handle to join/leave/add/wait.

        ``more=True``: the step stays open for ``add`` until ``close``. Hooks run in
        the pulling cell's thread: ``on_pull(cell_index, mb_index)`` after a pull
        (it may block, e.g. to pace a test; an exception there is that cell's
        failure), ``on_done(cell_index, mb_index)`` once that micro-batch's
        gradient is computed on its cell.
        """
        if self._running is not None:
            raise RuntimeError("start_step: the previous step has not been waited for")
        if not micro_batches and not more:
            raise ValueError("start_step: no micro-batches")
        step = ElasticStep(self, self._state, self._end_step, on_pull, on_done)
        step.add(micro_batches)
        if not more:
            step.close()
        self._running = step
        step.start()
        return step

    def run_step(self, micro_batches, satellites: Sequence[Cell] = ()) -> StepReport:
        """A step with every given satellite joining from the start."""
        step = self.start_step(micro_batches)
        for cell in satellites:
            step.join(cell)
        return step.wait()

    def _end_step(self, state: TrainState | None) -> None:
        """The running step's end, called by it: its new state, or None when it failed."""
        if state is not None:
            self._state = state
            self._version += 1
        self._running = None


class ElasticStep:
    """One step in progress. ``join`` / ``leave`` / ``add`` / ``close`` from any thread; ``wait`` once."""

    def __init__(self, trainer: ElasticTrainer, state: TrainState, on_end: Callable[[TrainState | None], None],
                 on_pull, on_done):
        self._t = trainer  # its public steps, core and version; the state and the step's end come in explicitly
        self._state0 = state  # the step's starting state (its params are what every worker computes with)
        self._version0 = trainer.version
        self._on_end = on_end  # the trainer's: the new state, or None when the step failed
        self._on_pull = on_pull
        self._on_done = on_done
        self._t0 = time.perf_counter()
        self._cv = threading.Condition()
        self._mbs: list[dict] = []
        self._open = True
        self._grad_scale = 1.0
        self._next = 0
        self._retry: collections.deque = collections.deque()  # pulled by a failed satellite, not delivered
        self._pulled_by: dict[int, set[int]] = collections.defaultdict(set)  # cell -> pulled, not yet delivered
        self._results: dict[int, tuple[Any, Any]] = {}
        self._cell_of: list[int] = []
        self._timeline: list[tuple[int, float, float]] = []
        self._error: BaseException | None = None  # the core's failure: fails the step
        self._failed: list[tuple[int, str]] = []
        self._closed = False  # wait() has collected: no more joins
        self._snapshots: list[MoveStats] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="elastic")
        self._leaving: set[int] = set()
        self._workers: dict[int, concurrent.futures.Future] = {}  # cell index -> its current worker
        self._all_workers: list[concurrent.futures.Future] = []
        self._reducer: concurrent.futures.Future | None = None

    def start(self) -> None:
        core = self._t.core
        with self._cv:
            self._spawn(core.index, self._work_loop, core, self._state0.params)
        self._reducer = self._pool.submit(self._reduce)

    # ---- queue ---------------------------------------------------------------
    def add(self, micro_batches: Sequence[Mapping[str, Any]]) -> None:
        """Append micro-batches to an open step (checked like ``start_step``'s)."""
        checked: list[dict[str, Any]] = []
        with self._cv:
            n0 = len(self._mbs)
        for j, m in enumerate(micro_batches):
            where = f"micro-batch {n0 + j}"
            mb = device_micro_batch(m, where=where)
            check_versions(mb, self._t.version, where=where)
            ref = self._mbs[0] if self._mbs else (checked[0] if checked else None)
            if ref is not None and any(mb[k].shape != ref[k].shape or mb[k].dtype != ref[k].dtype for k in mb):
                raise ValueError(
                    f"{where}: shapes/dtypes differ from micro-batch 0 "
                    f"({ {k: (v.shape, str(v.dtype)) for k, v in mb.items()} } vs "
                    f"{ {k: (v.shape, str(v.dtype)) for k, v in ref.items()} }); one step compiles one shape"
                )
            checked.append(mb)
        with self._cv:
            if not self._open:
                raise RuntimeError("ElasticStep.add: the step is closed")
            for mb in checked:
                self._mbs.append(mb)
                self._cell_of.append(-1)
                self._timeline.append((-1, 0.0, 0.0))
            self._cv.notify_all()

    def close(self, grad_scale: float = 1.0) -> None:
        """No more micro-batches; the summed gradient (and loss stats) are multiplied by ``grad_scale``."""
        with self._cv:
            if not self._open:
                raise RuntimeError("ElasticStep.close: already closed")
            if not self._mbs:
                raise ValueError("ElasticStep.close: the step has no micro-batches")
            if not (np.isfinite(grad_scale) and grad_scale > 0):
                raise ValueError(f"ElasticStep.close: grad_scale must be finite and > 0, got {grad_scale}")
            self._open = False
            self._grad_scale = float(grad_scale)
            self._cv.notify_all()

    def abort(self, reason: str) -> None:
        """Fail the step from outside (the run is stopping): every worker and the reducer stop
        waiting for micro-batches, ``wait`` raises, the state is left as it was."""
        with self._cv:
            if self._error is None:
                self._error = RuntimeError(f"elastic step aborted: {reason}")
            self._open = False
            self._cv.notify_all()

    def _exhausted(self, cell: Cell) -> bool:
        """Nothing left for ``cell`` (call under the lock). The core stays until every
        satellite has delivered: a satellite that fails hands its work back to it."""
        if self._open or self._next < len(self._mbs) or self._retry:
            return False
        core = self._t.core.index
        return cell.index != core or not any(v for c, v in self._pulled_by.items() if c != core)

    def _pull(self, cell: Cell, wait: bool = True) -> int | None:
        """The next micro-batch for ``cell``; None: the cell stops pulling (step over, leaving, error);
        ``_NOTHING_YET`` (only with ``wait=False``): an open step has nothing to hand out now."""
        with self._cv:
            while True:
                if self._error is not None or cell.index in self._leaving or self._exhausted(cell):
                    return None
                if self._retry:
                    i = self._retry.popleft()
                elif self._next < len(self._mbs):
                    i = self._next
                    self._next += 1
                elif not wait:
                    return _NOTHING_YET
                else:
                    self._cv.wait()
                    continue
                self._pulled_by[cell.index].add(i)
                return i

    def remaining(self) -> int:
        """Micro-batches added and not yet pulled (an open step may get more)."""
        with self._cv:
            return len(self._mbs) - self._next + len(self._retry)

    def _spawn(self, index: int, fn, *args) -> None:
        fut = self._pool.submit(self._guarded, index, fn, *args)
        self._workers[index] = fut
        self._all_workers.append(fut)

    def join(self, cell: Cell) -> bool:
        """Add ``cell`` as a training satellite; True if it trains in this step.

        False (never an exception) when the step is over or has nothing left for
        it. Joining while already training is a no-op; joining after ``leave``
        cancels the leave if the cell is still finishing, else starts it again.
        """
        if set(cell.devices) & set(self._t.core.devices):
            raise ValueError(f"join: {cell} shares devices with the core {self._t.core}")
        with self._cv:
            if self._closed or self._error is not None:
                return False
            fut = self._workers.get(cell.index)
            if fut is not None and not fut.done():
                self._leaving.discard(cell.index)  # a rejoin before the worker stopped: it keeps pulling
                return True
            if self._exhausted(cell):
                return False
            self._leaving.discard(cell.index)
            params = self._state0.params  # the step's version: the update waits for every worker
            self._spawn(cell.index, self._satellite, cell, params)
        return True

    def leave(self, cell: Cell) -> concurrent.futures.Future:
        """Stop ``cell`` pulling; it finishes (and sends) what it already pulled.

        Returns a future that is done once the cell no longer works for this step
        (already done if it was not training), e.g. so the scheduler can hand it
        back to rollout before the step ends. The rest goes to the other cells.
        """
        if cell.index == self._t.core.index:
            raise ValueError("leave: the core cannot leave its own step")
        with self._cv:
            fut = self._workers.get(cell.index)
            if fut is None or fut.done():
                done: concurrent.futures.Future = concurrent.futures.Future()
                done.set_result(None)
                return done
            self._leaving.add(cell.index)
            self._cv.notify_all()  # a worker waiting for more micro-batches wakes up and stops
            return fut

    # ---- workers -------------------------------------------------------------
    def _guarded(self, index: int, fn, *args) -> None:
        """Run a worker. A satellite's failure requeues its undelivered micro-batches; the core's fails the step."""
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - classified below
            with self._cv:
                if index == self._t.core.index:
                    if self._error is None:
                        self._error = e
                else:
                    lost = sorted(self._pulled_by.pop(index, set()))
                    self._retry.extend(lost)
                    self._failed.append((index, repr(e)))
                    log.warning("elastic step: satellite cell %d failed (%r); %d micro-batches go to the other cells",
                                index, e, len(lost))
                self._cv.notify_all()
            if index == self._t.core.index:
                raise

    def _satellite(self, cell: Cell, core_params) -> None:
        if getattr(cell, "link", None) is not None:  # a cell in another process (gyre_jax.pods.RemoteCell)
            self._remote_loop(cell, core_params)
            return
        snap, stats = move(
            core_params,
            self._t.steps.param_shardings(cell.train_mesh),
            kind=TO_TRAIN,
            version=self._t.version,
            cell_index=cell.index,
        )
        with self._cv:
            self._snapshots.append(stats)
        self._work_loop(cell, snap)

    def _work_loop(self, cell: Cell, params) -> None:
        steps = self._t.steps
        mesh = cell.train_mesh
        grad_step = steps.grad_step(mesh)
        bsh = steps.batch_sharding(mesh)
        is_core = cell is self._t.core
        core_ps = steps.param_shardings(self._t.core.train_mesh)

        def dispatch(i):
            grads, stats = grad_step(params, jax.device_put(self._mbs[i], bsh))
            if not is_core:
                grads = jax.device_put(grads, core_ps)
            with self._cv:
                self._results[i] = (grads, stats)
                self._cell_of[i] = cell.index
                self._pulled_by[cell.index].discard(i)
                self._cv.notify_all()
            return stats  # wait on stats, never on grads: the reducer may already have donated them

        self._pull_loop(cell, dispatch, lambda i, stats, t_pull: self._done(cell, i, stats, t_pull))

    def _remote_loop(self, cell, core_params) -> None:
        """A satellite in another process: mail it micro-batches, pull back (grads, stats) onto the core.

        A micro-batch counts as delivered only once its gradient is on the core, so
        a satellite that dies mid-step (its pull raises) hands back everything it held.
        """
        link = cell.link
        began = [False]

        def dispatch(i):
            first = not began[0]
            if first:  # offered with the first micro-batch: a satellite that gets none pulls nothing
                link.begin(core_params, self._t.version)
                began[0] = True
            return link.submit(i, self._mbs[i]), first

        self._pull_loop(cell, dispatch, lambda i, sent, t_pull: self._deliver_remote(cell, i, sent[0], sent[1], t_pull))

    def _pull_loop(self, cell, dispatch, finish) -> None:
        """Pull, ``dispatch(i)``, keep up to ``in_flight`` dispatched; ``finish`` the oldest before pulling more."""
        pending: collections.deque = collections.deque()
        try:
            self._pull_until_stopped(cell, dispatch, finish, pending)
        except BaseException:
            self._close_delivered(cell, pending)
            raise

    def _close_delivered(self, cell, pending) -> None:
        """A worker failing with micro-batches dispatched: those whose results are already stored (local
        cells store at dispatch) are reduced into the step, so their busy time counts; until their end (now)."""
        now = time.perf_counter() - self._t0
        with self._cv:
            for i, _, t_pull in pending:
                if self._cell_of[i] == cell.index and self._timeline[i][0] == -1:
                    self._timeline[i] = (cell.index, t_pull, now)

    def _pull_until_stopped(self, cell, dispatch, finish, pending: collections.deque) -> None:
        while True:
            i = self._pull(cell, wait=not pending)
            if i == _NOTHING_YET:
                # An open step waits for its next groups: finish what is dispatched first, so its results
                # are reduced now and its end time is when it was computed, not when more data came.
                while pending:
                    finish(*pending.popleft())
                continue
            if i is None:
                while pending:
                    finish(*pending.popleft())
                if self._stopping(cell):
                    return
                continue
            t_pull = time.perf_counter() - self._t0
            if self._on_pull is not None:
                self._on_pull(cell.index, i)
            pending.append((i, dispatch(i), t_pull))
            while len(pending) >= self._t.in_flight:
                finish(*pending.popleft())

    def _stopping(self, cell) -> bool:
        """After a pull found nothing: whether the worker ends (a join may have cancelled the leave meanwhile)."""
        with self._cv:
            if cell.index in self._leaving or self._error is not None:
                self._leaving.discard(cell.index)
                return True
            return self._exhausted(cell)

    def _deliver_remote(self, cell, i: int, result, first: bool, t_pull: float) -> None:
        grads, stats = cell.link.collect(result)
        snap = cell.link.snapshot_stats(self._t.version, cell.index) if first else None  # pulled before this result
        with self._cv:
            self._results[i] = (grads, stats)
            self._cell_of[i] = cell.index
            self._pulled_by[cell.index].discard(i)
            if snap is not None:
                self._snapshots.append(snap)
            self._cv.notify_all()
        self._timeline[i] = (cell.index, t_pull, time.perf_counter() - self._t0)
        if self._on_done is not None:
            self._on_done(cell.index, i)

    def _done(self, cell: Cell, i: int, stats, t_pull: float) -> None:
        jax.block_until_ready(stats)
        self._timeline[i] = (cell.index, t_pull, time.perf_counter() - self._t0)
        if self._on_done is not None:
            self._on_done(cell.index, i)

    def _reduce(self):
        add = self._t.steps.accumulate(self._t.core.train_mesh)
        acc = None
        stats = []
        i = 0
        while True:
            with self._cv:
                while i not in self._results and self._error is None and (self._open or i < len(self._mbs)):
                    self._cv.wait()
                if self._error is not None:
                    raise RuntimeError("elastic step aborted: the core cell failed") from self._error
                if i not in self._results:  # closed and every micro-batch reduced
                    return acc, stats
                g, s = self._results.pop(i)
            acc = g if acc is None else add(acc, g)
            stats.append(s)
            i += 1

    # ---- finish --------------------------------------------------------------
    def wait(self) -> StepReport:
        """Wait for every micro-batch, apply the update on the core, return the report."""
        try:
            grads, stats = self._collect()
            scale = self._grad_scale
            if scale != 1.0:  # only an open step closed with a scale pays for this (exact 1.0 otherwise)
                grads = self._t.steps.scale(self._t.core.train_mesh)(grads, np.float32(scale))
            new_state, metrics = self._t.steps.apply_update(self._t.core.train_mesh)(self._state0, grads)
            metrics, stats = jax.device_get((metrics, stats))
        except BaseException:
            self._on_end(None)
            raise
        finally:
            self._pool.shutdown(wait=True)
        summed: dict[str, Any] = {k: np.float64(v) for k, v in stats[0].items()}
        for s in stats[1:]:  # index order, float64 on the host
            summed = combine_stats(summed, {k: np.float64(v) for k, v in s.items()}, self._t.steps.reductions, host=True)
        summed = {k: float(v) * (scale if _sums(k, self._t.steps.reductions) else 1.0) for k, v in summed.items()}
        tv = np.concatenate([m["target_version"].ravel() for m in self._mbs])
        lm = np.concatenate([m["loss_mask"].ravel() for m in self._mbs])
        st_mean, st_max = staleness(tv, lm, self._version0)
        self._on_end(new_state)
        return StepReport(
            version=self._version0,
            loss=summed["loss"],
            stats=summed,
            grad_norm=float(metrics["grad_norm"]),
            update_norm=float(metrics["update_norm"]),
            learning_rate=float(metrics["learning_rate"]),
            staleness_mean=float(st_mean),
            staleness_max=float(st_max),
            cell_of=tuple(self._cell_of),
            timeline=tuple(self._timeline),
            snapshots=tuple(self._snapshots),
            seconds=time.perf_counter() - self._t0,
            failed_cells=tuple(self._failed),
            grad_scale=scale,
        )

    def _collect(self):
        """The reducer's (grads, stats) once every worker has stopped; the core's error wins."""
        try:
            return self._reducer.result()
        finally:
            with self._cv:
                self._closed = True
                if self._error is not None:
                    self._cv.notify_all()
            while True:  # a join may add a worker until _closed; after it the list is final
                with self._cv:
                    workers = [f for f in self._all_workers if not f.done()]
                if not workers:
                    break
                concurrent.futures.wait(workers)
            for f in list(self._all_workers):
                if f.exception() is not None and f is self._workers.get(self._t.core.index):
                    raise f.exception()


def _sums(key: str, reductions: Mapping[str, str] | None) -> bool:
    """Whether a stat is a sum over micro-batches (so it scales with the gradient)."""
    return reductions is None or reductions.get(key) == "sum"
