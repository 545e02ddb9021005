"""Finished groups -> the grain pipeline -> elastic steps (``scheduler.interfaces.Trainer``).

Three parts, one per thread that owns their state, connected by queues and the dataset of
packed rows:

    GroupQueue (controller, harness)  --Taken-->  StepProcessor (gyre-processor): store ->
    process_step -> RowStream.add  --StepInput-->  StepRunner (gyre-trainer): StreamingDataset
    iterator -> ElasticStep -> update -> StepDone on ``done``

* ``rl/group_queue.py``: ready groups (dynamic sampling's admission), the open step's take
  (streamed: each group as it is taken; whole steps: all of a step's groups once it holds its size).
* ``rl/step_processor.py``: each chunk's rows, and the step's frozen ``StepInput`` at its end.
* ``rl/step_runner.py``: the running ``ElasticStep``, the update, the store's record of the step,
  the checkpoint (``after_update``), the latest params and the versions the per-step pass reads.

``TrainerAdapter`` puts them behind the scheduler's Protocol and starts their threads
(``start()``; constructors start nothing). Both threads read the same ``StreamingDataset``
iterator, whose position is saved in every checkpoint; after an update it is the next step's
start. Staleness is bounded by the policy's admission; every finished rollout is trained (or,
for infra/verifier failures and dynamic sampling's drops, marked dropped with its reason)
exactly once. A satellite that fails in a step is reported (the ``StepDone``'s report) and the
step goes on; a failure of the core's step is the run's (``errors``).
"""
from __future__ import annotations

import logging
import threading

from gyre_jax.rl.group_queue import GroupQueue
from gyre_jax.rl.groups import Group
from gyre_jax.rl.step_events import StepDone, TrainerSnapshot
from gyre_jax.rl.step_processor import StepProcessor
from gyre_jax.rl.step_runner import StepRunner
from gyre_jax.scheduler.interfaces import TrainProgress

log = logging.getLogger(__name__)


class TrainerAdapter:
    def __init__(self, queue: GroupQueue, processor: StepProcessor, runner: StepRunner,
                 replayed: tuple[StepDone, ...] = ()):
        """``replayed``: the steps a resume trained again before this run takes any (``rl.replay``): the loop
        records them first."""
        self.queue, self.processor, self.runner = queue, processor, runner
        runner.owner = queue
        self.trainer, self.store, self.it = runner.trainer, runner.store, runner.it
        self.stream = processor.stream
        self.done = runner.done
        for d in replayed:
            self.done.put(d)
        self.errors: list[BaseException] = []
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Start the processor and trainer threads (once)."""
        if self._threads:
            raise RuntimeError("TrainerAdapter.start: already started")
        self._threads = [threading.Thread(target=self._guard, args=(self._process_main, "processing"),
                                          name="gyre-processor", daemon=True),
                         threading.Thread(target=self._guard, args=(self.runner.run, "training"),
                                          name="gyre-trainer", daemon=True)]
        for t in self._threads:
            t.start()

    def _process_main(self) -> None:
        self.processor.warm(self.runner.latest_params()[1])
        self.processor.run()

    # -- Protocol --
    def progress(self) -> TrainProgress:
        return self.queue.progress(self.runner.remaining_work_s())

    def take_groups(self, n: int) -> None:
        self.queue.take_groups(n)

    @property
    def step_sizes(self):
        return self.queue.step_sizes

    @property
    def on_step_started(self):
        """Fault injection (``FaultConfig.pause_at_step``): called once a step runs, before its update is kept."""
        return self.runner.on_step_started

    @on_step_started.setter
    def on_step_started(self, hook) -> None:
        self.runner.on_step_started = hook

    # -- inputs from other adapters --
    def add_group(self, group: Group) -> None:
        self.queue.add_group(group)

    def buffered_rollouts(self) -> list[str]:
        """Finished rollouts not yet trained: the open step's, then the ready ones."""
        return self.queue.buffered_rollouts()

    def on_train_cell(self, cell: int) -> None:
        """A satellite finished switching to train: join the step in progress, if any."""
        self.runner.join(cell)

    def leave_step(self, cell: int):
        return self.runner.leave(cell)

    def wait_cell_free(self, cell: int) -> None:
        """A satellite wanted back for rollout leaves the running step: it finishes what it
        pulled, the core and other cells take the rest (``ElasticStep.leave``)."""
        fut = self.leave_step(cell)
        if fut is not None:
            fut.result()

    def latest_params(self):
        return self.runner.latest_params()

    @property
    def steps_done(self) -> int:
        return self.queue.steps_done

    def cursor_version(self) -> int:
        """The newest policy version whose rollouts the store's cursor marks consumed (what a save may label)."""
        return self.runner.cursor_version()

    def work_s(self, tokens: int, row_len: int) -> float:
        """The measured training time of a group of ``tokens`` tokens (rows of ``row_len``)."""
        return self.runner.work.work_s(tokens, row_len)

    def snapshot(self) -> TrainerSnapshot:
        """The state, the buffered rollouts and the data position, for a checkpoint (no step may be open)."""
        return self.runner.snapshot()

    def stop(self) -> None:
        """End both threads; an open step is aborted (its update is not applied), so nothing waits for
        micro-batches that will never come and the process can exit."""
        self.processor.inbox.put(None)
        self.stream.close()
        self.runner.abort("the run is stopping")
        for t in self._threads:
            t.join(60)
            if t.is_alive():
                log.error("trainer: thread %s did not stop within 60 s", t.name)

    def abandon_step(self) -> bool:
        """The run is failing: stop both threads and end the open step without its update, so the state is
        the last update's and may be saved. A streaming run has a step open most of the time, and a failure
        then saved nothing: the rerun rewound to the last periodic checkpoint, past the staleness bound
        (bench_chaos's outcome fault: 32 groups dated 0). False if a thread did not stop (save nothing)."""
        self.stop()
        if any(t.is_alive() for t in self._threads):
            return False
        self.runner.end_aborted()
        return not self.trainer.step_open

    def _guard(self, main, what: str) -> None:
        try:
            main()
        except BaseException as e:  # noqa: BLE001 - surfaced by the loop, which ends the run
            log.error("trainer: %s failed: %s: %s", what, type(e).__name__, e)  # the traceback: the run's error file
            self.errors.append(e)
            self.queue.notify()
