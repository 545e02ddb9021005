"""Finished groups -> the grain pipeline -> elastic steps (``scheduler.interfaces.Trainer``).

Three stages, each on its own thread, connected by the dataset of packed rows:

    take_groups (controller)  ->  processor thread: store -> process_step -> RowStream.add
                              ->  trainer thread: StreamingDataset iterator -> ElasticStep

* Whole steps (``stream_groups=False``: the batch modes colocate, async and
  elastic_no_stream, one update per publication): once the open step holds
  its size (``groups_per_step`` groups; more after a resume past the bound), the processor packs the step's rollouts together
  (weights normalized over the step's trained rollouts) and adds them as one
  chunk: the step is globally shuffled and its rows are a function of its
  rollouts alone. The trainer reads batches until ``last_in_step`` and runs the
  update; all of the step's training comes after its last group.
* Streamed groups (the streaming modes elastic and async_stream, and multi-step
  mode): each group is packed and added as soon as it is taken, so the core (and
  every cell in train role) computes its micro-batches while later groups still
  run, and only the last group's rows and the update remain once it is in. Its
  rows are weighted over the step's nominal rollout count ``G x group_size``;
  when the step's last group is in, the update is scaled by nominal / trained
  rollouts (``ElasticStep.close(grad_scale=...)``), so a step's gradient is the
  rollout-first mean over exactly the rollouts it trained: with one update per
  publication the same gradient as the whole step's (a sum over micro-batches
  does not depend on how rows were grouped), summed in arrival order.

Threads (docs/design.md has the whole run's map). ``start()`` starts both; the constructor
starts nothing. The processor thread owns each open step's data and hands it over,
frozen, on ``_inputs`` (a queue) before the step's last rows enter the stream; the
trainer thread owns the running ``ElasticStep`` and puts one frozen ``StepDone`` per
update on ``done`` (a queue the loop drains). Everything the controller's thread reads
(``progress``, ``take_groups``) is under ``_lock``.

Both read the same ``StreamingDataset`` iterator, whose position is saved in
every checkpoint; after an update it is the next step's start.

The per-step pass (``cells.score.StepScorer``, when the objective reads more than the
current log-probs: decoupled PPO's proximal policy, GSPO's sequence ratio, a mismatch
correction's behaviour-version log-probs, KL's reference) runs on each chunk's rows in
the processor thread, before they enter the stream; the adapter keeps the params of the
last ``staleness_bound`` versions for it when a correction needs them.

DAPO's dynamic sampling (``dynamic_sampling_budget > 0``): a finished group whose valid
rollouts' rewards are all equal carries no signal under a group baseline; it is marked
dropped (reason ``no_signal``, failures with their status) instead of becoming ready,
and ``TrainProgress.dropped_groups`` tells the controller, which admits a replacement
for each (the launch count nets them out). The budget caps the drops over the run, so a
policy that solves everything cannot loop forever; past it such groups train (with
advantage 0) as before.

Staleness is bounded by the policy's admission; every finished rollout is trained
(or, for infra/verifier failures and dynamic sampling's drops, marked dropped with its
reason) exactly once. A satellite that fails in a step is reported (``on_failed_cell``)
and the step goes on; a failure of the core's step is the run's (``errors``).
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Callable, Sequence

import jax
import numpy as np

from gyre_jax.cells.elastic import ElasticStep, ElasticTrainer, StepReport
from gyre_jax.cells.train_step import ADAPTER_KEY, MICRO_BATCH_KEYS, ROUTING_KEY
from gyre_jax.rl.launcher import Group, lineage_calls
from gyre_jax.rl.step_events import StepDone, StepInput, StepTotals, TrainerSnapshot
from gyre_jax.scheduler.interfaces import TrainProgress
from gyre_jax.scheduler.policy import NOMINAL, ReadyGroup, StepSizes
from gyre_jax.scheduler.vocab import TRAIN
from gyre_jax.trajectory.processor import ProcessorConfig, StepStats, process_step
from gyre_jax.trajectory.rewards import has_signal
from gyre_jax.trajectory.serialize import pack_rows

log = logging.getLogger(__name__)
NO_SIGNAL = "no_signal"  # the store's drop reason for DAPO's dynamic sampling


@dataclasses.dataclass(frozen=True)
class Taken:
    """Controller -> processor: groups the open step took. ``group``: one streamed group; ``step``: a whole
    step's groups at once; ``end``: a streamed step's last group is already in."""

    kind: str
    step: int
    groups: tuple[Group, ...] = ()


@dataclasses.dataclass
class _OpenStep:
    """A step's data while the processor thread builds it (that thread alone touches it)."""

    step: int
    groups: list[Group] = dataclasses.field(default_factory=list)
    outcomes: list = dataclasses.field(default_factory=list)
    stats: list[StepStats] = dataclasses.field(default_factory=list)
    rows: int = 0
    process_s: float = 0.0
    offset: int = 0  # rollout index of the next streamed chunk's first rollout
    score: dict = dataclasses.field(default_factory=dict)  # the per-step pass, summed over chunks

    def frozen(self, grad_scale: float) -> StepInput:
        return StepInput(step=self.step, groups=tuple(self.groups), outcomes=tuple(self.outcomes),
                         stats=tuple(self.stats), rows=self.rows, process_s=self.process_s, grad_scale=grad_scale,
                         score=dict(self.score))


def merge_stats(stats: Sequence[StepStats]) -> StepTotals:
    """One step's numbers from the StepStats of its chunks (one for a whole step)."""
    return StepTotals.merge(stats)


class TrainerAdapter:
    def __init__(self, *, trainer: ElasticTrainer, store, processor_config: ProcessorConfig, groups_per_step: int,
                 group_size: int, micro_batch_rows: int, cells, cell_roles: Callable[[], list[str]],
                 notify: Callable[[], None], work_s_per_row: float,
                 stream, data_iterator, stream_groups: bool, steps_done: int = 0, ready: Sequence[Group] = (),
                 after_update: Callable[[int, TrainerSnapshot], None] | None = None,
                 on_step_started: Callable[[int], None] | None = None,
                 on_pull_for_step: Callable[[int], Callable[[int, int], None] | None] | None = None,
                 scorer=None, keep_versions: int = 0, dynamic_sampling_budget: int = 0,
                 restored_rollouts: frozenset[str] = frozenset(), step_sizes: StepSizes = NOMINAL,
                 adapter_of: Callable[[str], int] | None = None):
        """``restored_rollouts``: the finished rollouts a resume at ``steps_done`` found untrained; their tokens
        sampled after that checkpoint count as sampled by it (``launcher.lineage_version``). ``step_sizes``: the
        steps that hold more than ``groups_per_step`` groups (``policy.resume_step_sizes``). ``adapter_of``:
        multi-LoRA, a group id's adapter: every packed token carries its rollout's (rows' ``adapter`` field)."""
        self.adapter_of = adapter_of
        self.trainer, self.store, self.pc = trainer, store, processor_config
        self.G, self.group_size, self.b = groups_per_step, group_size, micro_batch_rows
        self.cells, self.cell_roles, self.stream_groups = cells, cell_roles, stream_groups
        self.notify, self.after_update = notify, after_update  # after_update: the checkpoint, on the trainer thread
        self.on_step_started = on_step_started  # FaultConfig.pause_at_step; None in real runs
        self.on_pull_for_step = on_pull_for_step  # chaos (rl.faults)
        self.stream, self.it = stream, data_iterator
        self.done: queue.SimpleQueue[StepDone] = queue.SimpleQueue()  # one per update, drained by the loop
        self._lock = threading.RLock()  # everything below that two threads touch
        self._work_s_per_row = work_s_per_row
        self._ready: list[Group] = []
        self._taken: list[Group] = []  # in the open step, not yet handed to the processor (whole steps)
        self._in_step: list[Group] = []  # handed to the processor for the open step, not yet trained
        self._queued_work_s = 0.0  # taken, not yet in the stream
        self._steps_done = steps_done
        self._cursor_version = steps_done
        self._restored, self._restored_step = restored_rollouts, steps_done
        self.step_sizes = step_sizes
        self._updating = False
        self._last_group_t = 0.0  # when the open step took its last group (its training's remaining part starts)
        self._step: ElasticStep | None = None
        self._proc_q: queue.Queue[Taken | None] = queue.Queue()  # controller -> processor; None: stop
        self._inputs: queue.Queue[StepInput] = queue.Queue()  # processor -> trainer: each step's data, at its end
        self._latest = (trainer.version, jax.tree.map(lambda x: x.copy(), trainer.state.params))
        # The per-step pass (cells.score.StepScorer) and the versions it reads: the step's own
        # (the _latest copy, shared) and, for a mismatch correction, the last keep_versions ones.
        self.scorer = scorer if scorer is not None and scorer.needed else None
        self.keep_versions = keep_versions if self.scorer is not None and self.scorer.keeps_versions else 0
        self._versions = {self._latest[0]: self._latest[1]}
        # DAPO dynamic sampling: groups without signal dropped (and replaced), at most this many.
        self.drop_budget = int(dynamic_sampling_budget)
        self._dropped_groups = 0  # by this process: what the controller nets out of its launch count
        # Spent before a resume counts against the budget too (the store keeps the reasons).
        self._dropped_before = len({r.split("-")[0] for r, e in store.consumed().items()
                                    if e.get("reason") == NO_SIGNAL}) if self.drop_budget else 0
        self._dropped_reported = 0
        self.errors: list[BaseException] = []
        self._threads: list[threading.Thread] = []
        for g in sorted(ready, key=lambda g: g.version):  # a resumed run's groups pass the same filter
            if self._admit(g):
                self._ready.append(g)

    def start(self) -> None:
        """Start the processor and trainer threads (once)."""
        if self._threads:
            raise RuntimeError("TrainerAdapter.start: already started")
        self._threads = [threading.Thread(target=self._guard, args=(self._process_main, "processing"),
                                          name="gyre-processor", daemon=True),
                         threading.Thread(target=self._guard, args=(self._train_main, "training"),
                                          name="gyre-trainer", daemon=True)]
        for t in self._threads:
            t.start()

    # -- Protocol --
    def progress(self) -> TrainProgress:
        with self._lock:
            step = self._step
            running = step.remaining() * self.b * self._work_s_per_row if step is not None else 0.0
            return TrainProgress(
                steps_done=self._steps_done,
                open_step_taken=self._size(self._steps_done) if self._updating else len(self._taken) + len(self._in_step),
                pending_work_s=self._queued_work_s + running,
                update_in_progress=self._updating,
                ready_groups=tuple(ReadyGroup(version=g.version, work_s=g.work_s) for g in self._ready),
                dropped_groups=self._dropped_groups,
                step_sizes=self.step_sizes,
            )

    def _size(self, step: int) -> int:
        """Groups step ``step`` holds: G, or more after a resume past the bound (``StepSizes``)."""
        return self.step_sizes.of(step, self.G)

    def take_groups(self, n: int) -> None:
        with self._lock:
            open_taken = len(self._taken) + len(self._in_step)
            size = self._size(self._steps_done)
            if self._updating or n > len(self._ready) or open_taken + n > size:
                raise RuntimeError(f"take_groups({n}): {len(self._ready)} ready, {open_taken} taken, "
                                   f"updating={self._updating}")
            groups, self._ready = self._ready[:n], self._ready[n:]
            self._queued_work_s += sum(g.work_s for g in groups)
            step = self._steps_done
            if self.stream_groups:
                self._in_step += groups
                for g in groups:
                    self._proc_q.put(Taken("group", step, (g,)))
            else:
                self._taken += groups
            if open_taken + n == size:
                self._updating = True
                self._last_group_t = time.perf_counter()
                if self.stream_groups:
                    self._proc_q.put(Taken("end", step))
                else:
                    self._in_step, self._taken = self._taken, []
                    self._proc_q.put(Taken("step", step, tuple(self._in_step)))

    # -- inputs from other adapters --
    def add_group(self, group: Group) -> None:
        if not self._admit(group):
            self.notify()  # the controller admits a replacement
            return
        with self._lock:
            # oldest version first, FIFO within a version (the policy's ordering)
            i = len(self._ready)
            while i > 0 and self._ready[i - 1].version > group.version:
                i -= 1
            self._ready.insert(i, group)
        self.notify()

    def _admit(self, group: Group) -> bool:
        """DAPO dynamic sampling: False (the group marked dropped) if it has no signal and budget is left."""
        if not self.drop_budget or self._dropped_before + self._dropped_groups >= self.drop_budget:
            return True
        outcomes = [self.store.outcome(r) for r in group.rollout_ids]
        lengths = None
        if self.pc.advantage.overlong:
            lengths = [sum(int(c.output_ids.shape[0]) for c in self._calls(r)) for r in group.rollout_ids]
        if has_signal(outcomes, self.pc.advantage, lengths):
            return True
        with self._lock:
            step = self._steps_done
        valid = [o.rollout_id for o in outcomes if not o.is_failure]
        if valid:
            self.store.mark_dropped(valid, step=step, reason=NO_SIGNAL)
        for status in sorted({o.status for o in outcomes if o.is_failure}):
            self.store.mark_dropped([o.rollout_id for o in outcomes if o.status == status], step=step, reason=status)
        with self._lock:
            self._dropped_groups += 1
            n = self._dropped_before + self._dropped_groups
        log.info("dynamic sampling: group %s has no signal (rewards all equal); dropped, %d of %d so far",
                 group.group_id, n, self.drop_budget)
        if n == self.drop_budget:
            log.warning("dynamic sampling: budget of %d dropped groups spent; groups without signal train from now on",
                        self.drop_budget)
        return False

    def buffered_rollouts(self) -> list[str]:
        """Finished rollouts not yet trained: the open step's, then the ready ones."""
        with self._lock:
            return [r for g in self._in_step + self._taken + self._ready for r in g.rollout_ids]

    def on_train_cell(self, cell: int) -> None:
        """A satellite finished switching to train: join the step in progress, if any."""
        with self._lock:
            if self._step is not None and cell != 0:
                self._step.join(self.cells[cell])

    def leave_step(self, cell: int):
        with self._lock:
            return self._step.leave(self.cells[cell]) if self._step is not None and cell != 0 else None

    def wait_cell_free(self, cell: int) -> None:
        """A satellite wanted back for rollout leaves the running step: it finishes what it
        pulled, the core and other cells take the rest (``ElasticStep.leave``)."""
        fut = self.leave_step(cell)
        if fut is not None:
            fut.result()

    def latest_params(self):
        with self._lock:
            return self._latest

    @property
    def steps_done(self) -> int:
        with self._lock:
            return self._steps_done

    def cursor_version(self) -> int:
        """The newest policy version whose rollouts the store's cursor marks consumed (what a save may label)."""
        with self._lock:
            return self._cursor_version

    def work_s(self, tokens: int, row_len: int) -> float:
        """The measured training time of a group of ``tokens`` tokens (rows of ``row_len``)."""
        with self._lock:
            return self._work_s_per_row * max(1.0, tokens / row_len)

    def snapshot(self) -> TrainerSnapshot:
        """The state, the buffered rollouts and the data position, for a checkpoint (no step may be open)."""
        return TrainerSnapshot(state=self.trainer.state, buffered_rollouts=tuple(self.buffered_rollouts()),
                               data_iterator=self.it)

    def stop(self) -> None:
        """End both threads; an open step is aborted (its update is not applied), so nothing waits for
        micro-batches that will never come and the process can exit."""
        self._proc_q.put(None)
        self.stream.close()
        with self._lock:
            step = self._step
        if step is not None:
            step.abort("the run is stopping")
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
        with self._lock:
            step = self._step
        if step is not None and self.trainer.step_open:  # the thread was waiting for rows, so nobody ended it
            try:
                step.wait()
            except Exception:  # noqa: BLE001 - aborted, as asked: its update is not applied
                pass
        return not self.trainer.step_open

    # -- threads --
    def _guard(self, main, what: str) -> None:
        try:
            main()
        except BaseException as e:  # noqa: BLE001 - surfaced by the loop, which ends the run
            log.exception("%s failed", what)
            self.errors.append(e)
            self.notify()

    def _params_of(self, version: int):
        with self._lock:
            return self._versions.get(version)

    # -- the processor thread: groups -> packed rows in the stream; each step's data to _inputs --
    def _process_main(self) -> None:
        if self.scorer is not None:  # compile the per-step pass while no group is in yet
            warm = pack_rows([[]] * self.b, self.pc.row_len, routing_width=self.pc.routing_width).as_dict()
            self.scorer.warm(warm, self.latest_params()[1])
        data: _OpenStep | None = None
        while True:
            ev = self._proc_q.get()
            if ev is None:
                return
            if data is None or data.step != ev.step:
                data = _OpenStep(ev.step)
            if ev.kind != "end":  # "end" (streamed groups): the step's last group is already in
                self._process(ev.kind, data, list(ev.groups))
            if ev.kind != "group":
                self._end_step(data)
                data = None

    def _process(self, kind: str, data: _OpenStep, groups: list[Group]) -> None:
        """One chunk (a whole step, or one streamed group): rewards -> trees -> packed rows in the stream."""
        t0 = time.perf_counter()
        # Whole steps: groups (and rollouts within a group) arrive in finishing order; sorting
        # by id makes the packed rows, hence the losses, a function of the step's rollouts
        # alone (a resumed run reproduces an uninterrupted one).
        groups = sorted(groups, key=lambda g: g.group_id) if kind == "step" else groups
        rids = [r for g in groups for r in sorted(g.rollout_ids)]
        outcomes = [self.store.outcome(r) for r in rids]
        calls = [c for r in rids for c in self._calls(r)]
        offset = 0 if kind == "step" else data.offset
        if kind == "step":
            batch = process_step(calls, outcomes, self.pc)
        else:
            batch = process_step(calls, outcomes, self.pc, num_step_rollouts=self._size(data.step) * self.group_size,
                                 rollout_index_offset=data.offset)
            data.offset += len(batch.rollout_ids)
        if self.adapter_of is not None:  # multi-LoRA: each token trains its rollout's adapter
            group_of = {o.rollout_id: o.group_id for o in outcomes}
            per = np.asarray([self.adapter_of(group_of[r]) for r in batch.rollout_ids] + [0], np.int32)
            local = np.where(batch.rollout_index >= 0, batch.rollout_index - offset, -1)
            batch.rows.adapter = per[local]  # -1 (padding) reads the appended 0
        if self.scorer is not None and batch.rows.tokens.shape[0]:
            for k, v in self.scorer.score(batch.rows, batch.rollout_index, version=data.step,
                                          params_of=self._params_of).items():
                data.score[k] = data.score.get(k, 0) + v
        data.groups += groups
        data.outcomes += outcomes
        data.stats.append(batch.stats)
        data.process_s += time.perf_counter() - t0
        rows = int(batch.rows.tokens.shape[0])
        if rows:
            data.rows += rows
            self.stream.add(data.step, batch.rows, batch.rollout_index)
        with self._lock:
            self._queued_work_s = max(0.0, self._queued_work_s - sum(g.work_s for g in groups))

    def _end_step(self, data: _OpenStep) -> None:
        """Hand the step's data to the trainer thread, then let its last rows out of the stream."""
        if not data.rows:  # every rollout failed: one empty row, so the step still runs (and counts)
            empty = pack_rows([[]], self.pc.row_len, routing_width=self.pc.routing_width)
            if self.adapter_of is not None:
                empty.adapter = np.zeros(empty.tokens.shape, np.int32)
            self.stream.add(data.step, empty, np.full(empty.tokens.shape, -1, np.int32))
            data.rows = 1
        units = sum(s.weight_units for s in data.stats)
        grad_scale = 1.0
        if self.stream_groups and units:  # weights were divided by a nominal normaliser: the actual one now
            # every chunk with rollouts used the same nominal normaliser (a chunk of failures alone: 0)
            grad_scale = max(s.weight_normalizer for s in data.stats) / units
        self._inputs.put(data.frozen(grad_scale))  # before end_step: the trainer reads it at the last batch
        self.stream.end_step(data.step)

    def _calls(self, rid: str):
        try:
            calls = self.store.calls(rid)
        except KeyError:  # a rollout that never reached the model
            return []
        if rid in self._restored:  # the lost lineage's versions count as the restored one (resume_plan dates so)
            calls = lineage_calls(calls, self._restored_step)
        return calls

    # -- the trainer thread: packed rows -> the elastic step -> the update, a StepDone on done --
    def _train_main(self) -> None:
        t0 = 0.0  # set when a step's first micro-batch starts it
        n_mb = 0
        for batch in self.it:
            step = int(batch["step"][0])
            if step != self.trainer.version:
                raise RuntimeError(f"data position is at step {step} but the trainer is at version "
                                   f"{self.trainer.version}: checkpoint and data iterator disagree")
            mb = {k: np.asarray(batch[k]) for k in MICRO_BATCH_KEYS + (ROUTING_KEY, ADAPTER_KEY) if k in batch}
            with self._lock:
                if self._step is None:
                    t0, n_mb = time.perf_counter(), 0
                    on_pull = self.on_pull_for_step(step) if self.on_pull_for_step is not None else None
                    self._step = self.trainer.start_step([mb], more=True, on_pull=on_pull)
                    for c, role in enumerate(self.cell_roles()):
                        if c != 0 and role == TRAIN:
                            self._step.join(self.cells[c])
                else:
                    self._step.add([mb])
                n_mb += 1
            if bool(batch["last_in_step"][0]):
                self._finish(step, t0, n_mb)

    def _finish(self, step: int, t0: float, n_mb: int) -> None:
        data = self._inputs.get()
        if data.step != step:
            raise RuntimeError(f"trainer: step {step}'s last rows came with step {data.step}'s data")
        with self._lock:
            running = self._step
        if running is None:  # the step's first micro-batch started it (_train_main)
            raise RuntimeError(f"trainer: step {step}'s last rows came with no step running")
        running.close(grad_scale=data.grad_scale)
        if self.on_step_started is not None:
            self.on_step_started(step)  # the step runs; its update is neither kept nor saved yet
        report: StepReport = running.wait()
        version = self.trainer.version
        self._mark_consumed(data.outcomes, version - 1)
        params = jax.tree.map(lambda x: x.copy(), self.trainer.state.params)
        # Busy cell-seconds, not the step's wall time x cells: a streamed step is open while its groups
        # arrive, and counting that wait as work fed back (training looked dearer, the policy moved more
        # cells to it, rollouts slowed, the open step waited longer: 0.4 -> 1.9 cell-s per rollout).
        measured = report.busy_cell_s / max(n_mb * self.b, 1)
        with self._lock:
            self._cursor_version = version  # the store's cursor now covers every update up to this version
            self._work_s_per_row = 0.7 * self._work_s_per_row + 0.3 * measured
            dropped = self._dropped_groups - self._dropped_reported  # since the last step
            self._dropped_reported = self._dropped_groups
            self._latest = (version, params)
            self._versions[version] = params  # the same copy as _latest: no extra memory for the step's own
            for v in [v for v in self._versions if v < version - self.keep_versions]:
                del self._versions[v]
            self._step = None
            self._in_step = []
            after_last_group_s = time.perf_counter() - self._last_group_t
        done = StepDone(
            step=version - 1, version=version, params=params, groups=tuple(g.group_id for g in data.groups),
            group_versions=tuple(g.version for g in data.groups), rollouts=len(data.outcomes), report=report,
            totals=merge_stats(data.stats), scores=tuple(o.score for o in data.outcomes if not o.is_failure),
            rows=n_mb * self.b, micro_batches=n_mb, process_s=data.process_s, step_s=time.perf_counter() - t0,
            cells_used=tuple(sorted(set(report.cell_of))), row_chunks=len(data.stats),
            after_last_group_s=after_last_group_s, score=data.score, dropped_groups=dropped,
            extra_groups=max(0, len(data.groups) - self.G), outcomes=tuple(data.outcomes))
        if self.after_update is not None:
            self.after_update(version, self.snapshot())  # checkpoint: before the policy may take the next step
        self.done.put(done)  # before steps_done moves: a loop that sees the last step done has its record
        with self._lock:
            self._steps_done = version
            self._updating = False
        self.notify()

    def _mark_consumed(self, outcomes, step: int) -> None:
        """The step's rollouts in the store: trained, or dropped with their failure class."""
        trained = [o.rollout_id for o in outcomes if not o.is_failure]
        failed = [o for o in outcomes if o.is_failure]
        if trained:
            self.store.mark_trained(trained, step=step)
        for status in sorted({o.status for o in failed}):
            self.store.mark_dropped([o.rollout_id for o in failed if o.status == status], step=step, reason=status)
