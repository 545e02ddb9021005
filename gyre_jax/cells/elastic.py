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

Determinism. Gradients are summed on the core strictly in micro-batch index
order (``acc = g0; acc = acc + g1; ...``) by one reducer, so the new params do
not depend on which cell computed which micro-batch, nor on when a satellite
joined. The cost: one gradient-sized transfer per micro-batch a satellite
computes, instead of one per satellite.

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


@dataclasses.dataclass(frozen=True)
class StepReport:
    """Host-side result of one elastic step."""

    version: int  # policy version the gradients were taken at (new params are version + 1)
    loss: float  # sum of micro-batch losses, in index order
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

    @property
    def num_micro_batches(self) -> int:
        return len(self.cell_of)


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

    def start_step(
        self,
        micro_batches: Sequence[Mapping[str, Any]],
        *,
        on_pull: Callable[[int, int], None] | None = None,
        on_done: Callable[[int, int], None] | None = None,
    ) -> "ElasticStep":
        """Start a step; the core begins pulling at once. Returns a handle to join/wait.

        Hooks run in the pulling cell's thread: ``on_pull(cell_index, mb_index)``
        after a pull (it may block, e.g. to pace a test), ``on_done(cell_index,
        mb_index)`` once that micro-batch's gradient is computed on its cell.
        """
        if self._running is not None:
            raise RuntimeError("start_step: the previous step has not been waited for")
        if not micro_batches:
            raise ValueError("start_step: no micro-batches")
        mbs = []
        for i, m in enumerate(micro_batches):
            mb = device_micro_batch(m, where=f"micro-batch {i}")
            check_versions(mb, self._version, where=f"micro-batch {i}")
            if i and any(mb[k].shape != mbs[0][k].shape or mb[k].dtype != mbs[0][k].dtype for k in mb):
                raise ValueError(
                    f"micro-batch {i}: shapes/dtypes differ from micro-batch 0 "
                    f"({ {k: (v.shape, str(v.dtype)) for k, v in mb.items()} } vs "
                    f"{ {k: (v.shape, str(v.dtype)) for k, v in mbs[0].items()} }); one step compiles one shape"
                )
            mbs.append(mb)
        self._running = ElasticStep(self, mbs, on_pull, on_done)
        return self._running

    def run_step(self, micro_batches, satellites: Sequence[Cell] = ()) -> StepReport:
        """A step with every given satellite joining from the start."""
        step = self.start_step(micro_batches)
        for cell in satellites:
            step.join(cell)
        return step.wait()

    def _finish(self, state: TrainState) -> None:
        self._state = state
        self._version += 1
        self._running = None


class ElasticStep:
    """One step in progress. ``join`` / ``leave`` from any thread; ``wait`` once."""

    def __init__(self, trainer: ElasticTrainer, mbs, on_pull, on_done):
        self._t = trainer
        self._mbs = mbs
        self._on_pull = on_pull
        self._on_done = on_done
        self._t0 = time.perf_counter()
        self._cv = threading.Condition()
        self._next = 0
        self._results: dict[int, tuple[Any, Any]] = {}
        self._cell_of = [-1] * len(mbs)
        self._timeline = [(-1, 0.0, 0.0)] * len(mbs)
        self._error: BaseException | None = None
        self._closed = False
        self._snapshots: list[MoveStats] = []
        tv = np.concatenate([m["target_version"].ravel() for m in mbs])
        lm = np.concatenate([m["loss_mask"].ravel() for m in mbs])
        self._staleness = tuple(float(x) for x in staleness(tv, lm, trainer.version))
        self._pool = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="elastic")
        self._leaving: set[int] = set()
        self._workers = {  # cell index -> its worker
            trainer.core.index: self._pool.submit(self._guarded, self._work_loop, trainer.core, trainer._state.params)
        }
        self._reducer = self._pool.submit(self._reduce)

    # ---- queue ---------------------------------------------------------------
    def _pull(self, cell: Cell) -> int | None:
        with self._cv:
            if self._error is not None or self._next >= len(self._mbs) or cell.index in self._leaving:
                return None
            i = self._next
            self._next += 1
            return i

    def remaining(self) -> int:
        with self._cv:
            return len(self._mbs) - self._next

    def join(self, cell: Cell) -> bool:
        """Add ``cell`` as a training satellite. False if nothing is left to pull."""
        if set(cell.devices) & set(self._t.core.devices):
            raise ValueError(f"join: {cell} shares devices with the core {self._t.core}")
        with self._cv:
            if cell.index in self._leaving:
                raise ValueError(f"join: cell {cell.index} left this step; it can train again from the next one")
            if cell.index in self._workers:
                raise ValueError(f"join: cell {cell.index} is already training in this step (or is the core)")
            if self._closed:
                raise RuntimeError("join: the step is already finished")
            if self._next >= len(self._mbs):
                return False
            params = self._t._state.params  # the step's version: the update waits for every worker
            self._workers[cell.index] = self._pool.submit(self._guarded, self._satellite, cell, params)
        return True

    def leave(self, cell: Cell) -> concurrent.futures.Future:
        """Stop ``cell`` pulling; it finishes (and sends) what it already pulled.

        Returns a future that is done once the cell no longer works for this step,
        e.g. so the scheduler can hand it back to rollout before the step ends.
        The remaining micro-batches go to the cells still training.
        """
        with self._cv:
            if cell.index == self._t.core.index:
                raise ValueError("leave: the core cannot leave its own step")
            if cell.index not in self._workers:
                raise ValueError(f"leave: cell {cell.index} is not training in this step")
            self._leaving.add(cell.index)
            return self._workers[cell.index]

    # ---- workers -------------------------------------------------------------
    def _guarded(self, fn, *args) -> None:
        """Run a worker; on error stop everyone pulling and wake the reducer (wait() re-raises)."""
        try:
            fn(*args)
        except BaseException as e:
            with self._cv:
                if self._error is None:
                    self._error = e
                self._cv.notify_all()
            raise

    def _satellite(self, cell: Cell, core_params) -> None:
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
        pending: collections.deque = collections.deque()
        while True:
            i = self._pull(cell)
            if i is None:
                break
            t_pull = time.perf_counter() - self._t0
            if self._on_pull is not None:
                self._on_pull(cell.index, i)
            grads, stats = grad_step(params, jax.device_put(self._mbs[i], bsh))
            if not is_core:
                grads = jax.device_put(grads, core_ps)
            with self._cv:
                self._results[i] = (grads, stats)
                self._cell_of[i] = cell.index
                self._cv.notify_all()
            # Wait on stats, never on grads: the reducer may already have donated them.
            pending.append((i, stats, t_pull))
            while len(pending) >= self._t.in_flight:
                self._done(cell, *pending.popleft())
        while pending:
            self._done(cell, *pending.popleft())

    def _done(self, cell: Cell, i: int, stats, t_pull: float) -> None:
        jax.block_until_ready(stats)
        self._timeline[i] = (cell.index, t_pull, time.perf_counter() - self._t0)
        if self._on_done is not None:
            self._on_done(cell.index, i)

    def _reduce(self):
        add = self._t.steps.accumulate(self._t.core.train_mesh)
        acc = None
        stats = []
        for i in range(len(self._mbs)):
            with self._cv:
                while i not in self._results and self._error is None:
                    self._cv.wait()
                if self._error is not None:
                    raise RuntimeError("elastic step aborted: a cell failed") from self._error
                g, s = self._results.pop(i)
            acc = g if acc is None else add(acc, g)
            stats.append(s)
        return acc, stats

    # ---- finish --------------------------------------------------------------
    def wait(self) -> StepReport:
        """Wait for every micro-batch, apply the update on the core, return the report."""
        try:
            grads, stats = self._collect()
            new_state, metrics = self._t.steps.apply_update(self._t.core.train_mesh)(self._t._state, grads)
            metrics, stats = jax.device_get((metrics, stats))
        except BaseException:
            self._t._running = None
            raise
        finally:
            self._pool.shutdown(wait=True)
        summed = {k: np.float64(v) for k, v in stats[0].items()}
        for s in stats[1:]:  # index order, float64 on the host
            summed = combine_stats(summed, {k: np.float64(v) for k, v in s.items()}, self._t.steps.reductions, host=True)
        summed = {k: float(v) for k, v in summed.items()}
        self._t._finish(new_state)
        return StepReport(
            version=self._t.version - 1,
            loss=summed["loss"],
            stats=summed,
            grad_norm=float(metrics["grad_norm"]),
            update_norm=float(metrics["update_norm"]),
            learning_rate=float(metrics["learning_rate"]),
            staleness_mean=self._staleness[0],
            staleness_max=self._staleness[1],
            cell_of=tuple(self._cell_of),
            timeline=tuple(self._timeline),
            snapshots=tuple(self._snapshots),
            seconds=time.perf_counter() - self._t0,
        )

    def _collect(self):
        """The reducer's (grads, stats) once every worker has stopped; a worker's error wins."""
        try:
            return self._reducer.result()
        finally:
            with self._cv:
                self._closed = True
                workers = list(self._workers.values())
            for f in workers:
                f.result()
