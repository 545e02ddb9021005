"""The trainer thread (``gyre-trainer``): packed rows -> the elastic step -> the update -> a ``StepDone``.

It reads the grain ``StreamingDataset`` iterator (``RowStream.take`` waits for the processor),
starts an ``ElasticStep`` on the core at a step's first micro-batch (every cell in train role
joins), adds micro-batches as they come, and at the step's last batch takes the step's
``StepInput`` from the processor, closes the step (``grad_scale``), waits for the update, marks the
step's rollouts in the store (one line: trained, dropped with their failure class, and the step's
record, which a resume replays), runs ``after_update`` (the checkpoint) and puts one frozen
``StepDone`` on ``done``. It alone owns the running step, the latest params and the versions the
per-step pass reads; the group queue learns of each step's end through its ``StepOwner`` side.
A resume's replay drives ``on_batch`` itself before the thread starts (``rl.replay``).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Protocol

import jax
import numpy as np

from gyre_jax.cells.elastic import ElasticStep, ElasticTrainer, StepReport
from gyre_jax.cells.fingerprint import params_hash
from gyre_jax.cells.train_step import ADAPTER_KEY, MICRO_BATCH_KEYS, ROUTING_KEY
from gyre_jax.rl.groups import WorkEstimate
from gyre_jax.rl.step_events import StepDone, StepInput, StepTotals, TrainerSnapshot
from gyre_jax.scheduler.vocab import TRAIN

log = logging.getLogger(__name__)


class StepOwner(Protocol):
    """Who takes groups into steps (the group queue; a replay's plan): told when each step is trained."""

    def step_trained(self) -> tuple[int, float]:
        """The update is applied: (groups dynamic sampling dropped since the last step, when the step took its
        last group, perf_counter)."""
        ...

    def step_done(self, version: int) -> None:
        """The step's ``StepDone`` is out: the next step may be taken."""
        ...

    def buffered_rollouts(self) -> list[str]:
        """Finished rollouts not yet trained (a checkpoint's buffer)."""
        ...


class StepRunner:
    def __init__(self, *, trainer: ElasticTrainer, store, iterator, inputs: "queue.Queue[StepInput]",
                 micro_batch_rows: int, groups_per_step: int, cells, cell_roles: Callable[[], list[str]],
                 work: WorkEstimate, keep_versions: int = 0,
                 after_update: Callable[[int, TrainerSnapshot], None] | None = None,
                 on_step_started: Callable[[int], None] | None = None,
                 on_pull_for_step: Callable[[int], Callable[[int, int], None] | None] | None = None,
                 versions: dict | None = None):
        """``inputs``: the processor's outbox; ``keep_versions``: the last versions' params kept for the per-step
        pass (a mismatch correction); ``versions``: params of earlier versions to keep (a replay's);
        ``after_update(version, snapshot)``: the checkpoint, on this thread, before the next step may be taken;
        ``on_step_started``/``on_pull_for_step``: fault injection (``rl.faults``; None in real runs)."""
        self.trainer, self.store, self.it, self.inputs = trainer, store, iterator, inputs
        self.b, self.G, self.cells, self.cell_roles, self.work = micro_batch_rows, groups_per_step, cells, cell_roles, work
        self.keep_versions = keep_versions
        self.after_update, self.on_step_started, self.on_pull_for_step = after_update, on_step_started, on_pull_for_step
        self.owner: StepOwner | None = None  # set by whoever takes the groups (the adapter, or a replay)
        self.done: queue.SimpleQueue[StepDone] = queue.SimpleQueue()  # one per update, drained by the loop
        self._lock = threading.Lock()  # the running step, the latest params and the versions
        self._step: ElasticStep | None = None
        self._latest = (trainer.version, jax.tree.map(lambda x: x.copy(), trainer.state.params))
        self._versions = dict(versions or {})
        self._versions[self._latest[0]] = self._latest[1]
        self._cursor_version = trainer.version
        self._t0, self._n_mb = 0.0, 0  # the running step's start and micro-batches
        self.replaying = False  # the steps run now are a resume's replay (their StepDone says so)

    # -- what other threads ask --
    def latest_params(self):
        with self._lock:
            return self._latest

    def params_of(self, version: int):
        with self._lock:
            return self._versions.get(version)

    def kept_versions(self) -> dict:
        with self._lock:
            return dict(self._versions)

    def cursor_version(self) -> int:
        with self._lock:
            return self._cursor_version

    def remaining_work_s(self) -> float:
        with self._lock:
            step = self._step
        return step.remaining() * self.b * self.work.per_row if step is not None else 0.0

    def join(self, cell: int) -> None:
        with self._lock:
            if self._step is not None and cell != 0:
                self._step.join(self.cells[cell])

    def leave(self, cell: int):
        with self._lock:
            return self._step.leave(self.cells[cell]) if self._step is not None and cell != 0 else None

    def abort(self, why: str) -> None:
        with self._lock:
            step = self._step
        if step is not None:
            step.abort(why)

    def end_aborted(self) -> None:
        """After ``abort`` with the thread gone: end the step nobody ended (its update is not applied)."""
        with self._lock:
            step = self._step
        if step is not None and self.trainer.step_open:  # the thread was waiting for rows, so nobody ended it
            try:
                step.wait()
            except Exception:  # noqa: BLE001 - aborted, as asked: its update is not applied
                pass

    # -- the thread --
    def run(self) -> None:
        for batch in self.it:
            self.on_batch(batch)

    def on_batch(self, batch) -> None:
        """One micro-batch of the stream: start, feed or finish the step."""
        step = int(batch["step"][0])
        if step != self.trainer.version:
            raise RuntimeError(f"data position is at step {step} but the trainer is at version "
                               f"{self.trainer.version}: checkpoint and data iterator disagree")
        mb = {k: np.asarray(batch[k]) for k in MICRO_BATCH_KEYS + (ROUTING_KEY, ADAPTER_KEY) if k in batch}
        with self._lock:
            if self._step is None:
                self._t0, self._n_mb = time.perf_counter(), 0
                on_pull = self.on_pull_for_step(step) if self.on_pull_for_step is not None else None
                self._step = self.trainer.start_step([mb], more=True, on_pull=on_pull)
                for c, role in enumerate(self.cell_roles()):
                    if c != 0 and role == TRAIN:
                        self._step.join(self.cells[c])
            else:
                self._step.add([mb])
            self._n_mb += 1
        if bool(batch["last_in_step"][0]):
            self._finish(step)

    def _finish(self, step: int) -> None:
        data = self.inputs.get()
        if data.step != step:
            raise RuntimeError(f"trainer: step {step}'s last rows came with step {data.step}'s data")
        with self._lock:
            running = self._step
        if running is None:  # the step's first micro-batch started it (on_batch)
            raise RuntimeError(f"trainer: step {step}'s last rows came with no step running")
        running.close(grad_scale=data.grad_scale)
        if self.on_step_started is not None:
            self.on_step_started(step)  # the step runs; its update is neither kept nor saved yet
        report: StepReport = running.wait()
        version = self.trainer.version
        self._mark_consumed(data, version - 1)
        params = jax.tree.map(lambda x: x.copy(), self.trainer.state.params)
        digest = params_hash(params)
        # Busy cell-seconds, not the step's wall time x cells: a streamed step is open while its groups
        # arrive, and counting that wait as work fed back (training looked dearer, the policy moved more
        # cells to it, rollouts slowed, the open step waited longer: 0.4 -> 1.9 cell-s per rollout).
        self.work.measured(report.busy_cell_s / max(self._n_mb * self.b, 1))
        with self._lock:
            self._cursor_version = version  # the store's cursor now covers every update up to this version
            self._latest = (version, params)
            self._versions[version] = params  # the same copy as _latest: no extra memory for the step's own
            for v in [v for v in self._versions if v < version - self.keep_versions]:
                del self._versions[v]
            self._step = None
            n_mb, t0 = self._n_mb, self._t0
        owner = self._owner()
        dropped, last_group_t = owner.step_trained()
        done = StepDone(
            step=version - 1, version=version, params=params, groups=tuple(g.group_id for g in data.groups),
            group_versions=tuple(g.version for g in data.groups), rollouts=len(data.outcomes), report=report,
            totals=StepTotals.merge(data.stats), scores=tuple(o.score for o in data.outcomes if not o.is_failure),
            rows=n_mb * self.b, micro_batches=n_mb, process_s=data.process_s, step_s=time.perf_counter() - t0,
            cells_used=tuple(sorted(set(report.cell_of))), row_chunks=len(data.stats),
            after_last_group_s=time.perf_counter() - last_group_t, score=data.score, dropped_groups=dropped,
            extra_groups=max(0, len(data.groups) - self.G), params_hash=digest, replayed=self.replaying,
            outcomes=tuple(data.outcomes))
        if self.after_update is not None:
            self.after_update(version, self.snapshot())  # checkpoint: before the policy may take the next step
        self.done.put(done)  # before steps_done moves: a loop that sees the last step done has its record
        owner.step_done(version)

    def _owner(self) -> StepOwner:
        if self.owner is None:
            raise RuntimeError("StepRunner: no owner (the group queue or a replay) was attached")
        return self.owner

    def snapshot(self) -> TrainerSnapshot:
        """The state, the buffered rollouts and the data position, for a checkpoint (no step may be open)."""
        return TrainerSnapshot(state=self.trainer.state, buffered_rollouts=tuple(self._owner().buffered_rollouts()),
                               data_iterator=self.it)

    def _mark_consumed(self, data: StepInput, step: int) -> None:
        """The step's rollouts in the store, in one line: trained, or dropped with their failure class, with the
        step's record (what a resume needs to replay it)."""
        trained = [o.rollout_id for o in data.outcomes if not o.is_failure]
        dropped = {o.rollout_id: o.status for o in data.outcomes if o.is_failure}
        self.store.mark_step(step, trained=trained, dropped=dropped, record=data.record())
