"""Finished groups -> the grain pipeline -> elastic steps (``scheduler.interfaces.Trainer``).

Three stages, each on its own thread, connected by the dataset of packed rows:

    take_groups (controller)  ->  processor thread: store -> process_step -> RowStream.add
                              ->  trainer thread: StreamingDataset iterator -> ElasticStep

* Whole steps (``stream_groups=False``: the batch modes colocate, async and
  elastic_no_stream, one update per publication): once the open step holds
  ``groups_per_step`` groups, the processor packs the step's rollouts together
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
from gyre_jax.cells.train_step import MICRO_BATCH_KEYS
from gyre_jax.scheduler.interfaces import TrainProgress
from gyre_jax.scheduler.policy import ReadyGroup
from gyre_jax.scheduler.vocab import TRAIN
from gyre_jax.rl.launcher import Group
from gyre_jax.trajectory.processor import ProcessorConfig, StepStats, process_step
from gyre_jax.trajectory.rewards import has_signal
from gyre_jax.trajectory.serialize import pack_rows

log = logging.getLogger(__name__)
NO_SIGNAL = "no_signal"  # the store's drop reason for DAPO's dynamic sampling


@dataclasses.dataclass
class _StepData:
    """What the processor learned about a step (read by the trainer at its last batch)."""

    groups: list[Group] = dataclasses.field(default_factory=list)
    outcomes: list = dataclasses.field(default_factory=list)
    stats: list[StepStats] = dataclasses.field(default_factory=list)
    rows: int = 0
    process_s: float = 0.0
    grad_scale: float = 1.0
    score: dict = dataclasses.field(default_factory=dict)  # the per-step pass, summed over chunks


def merge_stats(stats: Sequence[StepStats]) -> dict:
    """One step's numbers from the StepStats of its chunks (one for a whole step)."""
    out: dict = {}
    for k in ("rollouts", "trained_rollouts", "packed_tokens", "expanded_tokens", "trainable_targets", "paths_total",
              "paths_selected", "trainable_unique", "trainable_selected", "trainable_dropped", "rollouts_truncated",
              "branching_rollouts", "branch_points", "compaction_calls", "subagent_calls", "retried_calls"):
        out[k] = int(sum(getattr(s, k) for s in stats))
    failures: dict = {}
    for s in stats:
        for k, v in s.failures.items():
            failures[k] = failures.get(k, 0) + v
    out["failures"] = failures
    out["dedup_factor"] = out["expanded_tokens"] / out["packed_tokens"] if out["packed_tokens"] else 0.0
    worst = max(stats, key=lambda s: s.max_dropped_fraction, default=None)
    out["max_dropped_fraction"] = worst.max_dropped_fraction if worst is not None else 0.0
    out["max_dropped_rollout"] = worst.max_dropped_rollout if worst is not None else None
    adv: dict = {}
    for s in stats:  # the estimator's counts, summed over the step's chunks
        for k, v in s.advantage_metrics.items():
            adv[k] = adv.get(k, 0.0) + v
    out["advantage_metrics"] = adv
    return out


class TrainerAdapter:
    def __init__(self, *, trainer: ElasticTrainer, store, processor_config: ProcessorConfig, groups_per_step: int,
                 group_size: int, micro_batch_rows: int, cells, cell_roles: Callable[[], list[str]],
                 notify: Callable[[], None], on_step: Callable[[dict], None], work_s_per_row: float,
                 stream, data_iterator, stream_groups: bool, steps_done: int = 0, ready: Sequence[Group] = (),
                 after_update: Callable[[int], None] | None = None,
                 on_step_started: Callable[[int], None] | None = None,
                 on_failed_cell: Callable[[int, str], None] | None = None,
                 on_pull_for_step: Callable[[int], Callable[[int, int], None] | None] | None = None,
                 scorer=None, keep_versions: int = 0, dynamic_sampling_budget: int = 0):
        self.trainer, self.store, self.pc = trainer, store, processor_config
        self.G, self.group_size, self.b = groups_per_step, group_size, micro_batch_rows
        self.cells, self.cell_roles, self.stream_groups = cells, cell_roles, stream_groups
        self.notify, self.on_step, self.after_update = notify, on_step, after_update
        self.on_step_started = on_step_started  # FaultConfig.pause_at_step; None in real runs
        self.on_failed_cell, self.on_pull_for_step = on_failed_cell, on_pull_for_step  # chaos (rl.faults)
        self.work_s_per_row = work_s_per_row
        self.stream, self.it = stream, data_iterator
        self._lock = threading.RLock()
        self._ready: list[Group] = []
        self._taken: list[Group] = []  # in the open step, not yet handed to the processor (whole steps)
        self._in_step: list[Group] = []  # handed to the processor for the open step, not yet trained
        self._queued_work_s = 0.0  # taken, not yet in the stream
        self._steps_done = steps_done
        self._cursor_version = steps_done
        self._updating = False
        self._last_group_t = 0.0  # when the open step took its last group (its training's remaining part starts)
        self._step: ElasticStep | None = None
        self._data: dict[int, _StepData] = {}
        self._proc_q: queue.Queue = queue.Queue()
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
        self._threads = [threading.Thread(target=self._guard, args=(self._process_main, "processing"),
                                          name="gyre-processor", daemon=True),
                         threading.Thread(target=self._guard, args=(self._train_main, "training"),
                                          name="gyre-trainer", daemon=True)]
        for g in sorted(ready, key=lambda g: g.version):  # a resumed run's groups pass the same filter
            if self._admit(g):
                self._ready.append(g)
        for t in self._threads:
            t.start()

    # -- Protocol --
    def progress(self) -> TrainProgress:
        with self._lock:
            step = self._step
            running = step.remaining() * self.b * self.work_s_per_row if step is not None else 0.0
            return TrainProgress(
                steps_done=self._steps_done,
                open_step_taken=self.G if self._updating else len(self._taken) + len(self._in_step),
                pending_work_s=self._queued_work_s + running,
                update_in_progress=self._updating,
                ready_groups=tuple(ReadyGroup(version=g.version, work_s=g.work_s, earliest=g.earliest)
                                   for g in self._ready),
                dropped_groups=self._dropped_groups,
            )

    def take_groups(self, n: int) -> None:
        with self._lock:
            open_taken = len(self._taken) + len(self._in_step)
            # The policy's rule (takeable_groups): the n oldest that this step may train, in buffer order.
            eligible = [i for i, g in enumerate(self._ready) if g.earliest <= self._steps_done][:n]
            if self._updating or n > len(eligible) or open_taken + n > self.G:
                raise RuntimeError(f"take_groups({n}): {len(eligible)} of {len(self._ready)} ready may be taken, "
                                   f"{open_taken} taken, updating={self._updating}")
            chosen = set(eligible)
            groups = [self._ready[i] for i in eligible]
            self._ready = [g for i, g in enumerate(self._ready) if i not in chosen]
            self._queued_work_s += sum(g.work_s for g in groups)
            step = self._steps_done
            if self.stream_groups:
                self._in_step += groups
                for g in groups:
                    self._proc_q.put(("group", step, [g]))
            else:
                self._taken += groups
            if open_taken + n == self.G:
                self._updating = True
                self._last_group_t = time.perf_counter()
                if self.stream_groups:
                    self._proc_q.put(("end", step, []))
                else:
                    self._in_step, self._taken = self._taken, []
                    self._proc_q.put(("step", step, list(self._in_step)))

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
        return self._steps_done

    def cursor_version(self) -> int:
        """The newest policy version whose rollouts the store's cursor marks consumed (what a save may label)."""
        return self._cursor_version

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

    def _process_main(self) -> None:
        offsets: dict[int, int] = {}
        if self.scorer is not None:  # compile the per-step pass while no group is in yet
            warm = pack_rows([[]] * self.b, self.pc.row_len).as_dict()
            self.scorer.warm(warm, self._latest[1])
        while True:
            ev = self._proc_q.get()
            if ev is None:
                return
            kind, step, groups = ev
            with self._lock:  # the training thread pops it (_finish); RowStream's end_step orders the fields
                data = self._data.setdefault(step, _StepData())
            if kind == "end":  # multi-step: the step's last group is in
                self._end_step(step, data)
                continue
            t0 = time.perf_counter()
            # Whole steps: groups (and rollouts within a group) arrive in finishing order; sorting
            # by id makes the packed rows, hence the losses, a function of the step's rollouts
            # alone (a resumed run reproduces an uninterrupted one).
            groups = sorted(groups, key=lambda g: g.group_id) if kind == "step" else groups
            rids = [r for g in groups for r in sorted(g.rollout_ids)]
            outcomes = [self.store.outcome(r) for r in rids]
            calls = [c for r in rids for c in self._calls(r)]
            if kind == "step":
                batch = process_step(calls, outcomes, self.pc)
            else:
                batch = process_step(calls, outcomes, self.pc, num_step_rollouts=self.G * self.group_size,
                                     rollout_index_offset=offsets.get(step, 0))
                offsets[step] = offsets.get(step, 0) + len(batch.rollout_ids)
            if self.scorer is not None and batch.rows.tokens.shape[0]:
                for k, v in self.scorer.score(batch.rows, batch.rollout_index, version=step,
                                              params_of=self._params_of).items():
                    data.score[k] = data.score.get(k, 0) + v
            data.groups += groups
            data.outcomes += outcomes
            data.stats.append(batch.stats)
            data.process_s += time.perf_counter() - t0
            rows = int(batch.rows.tokens.shape[0])
            if rows:
                data.rows += rows
                self.stream.add(step, batch.rows, batch.rollout_index)
            with self._lock:
                self._queued_work_s = max(0.0, self._queued_work_s - sum(g.work_s for g in groups))
            if kind == "step":
                self._end_step(step, data)

    def _end_step(self, step: int, data: _StepData) -> None:
        if not data.rows:  # every rollout failed: one empty row, so the step still runs (and counts)
            empty = pack_rows([[]], self.pc.row_len)
            self.stream.add(step, empty, np.full(empty.tokens.shape, -1, np.int32))
            data.rows = 1
        units = sum(s.weight_units for s in data.stats)
        if self.stream_groups and units:  # weights were divided by a nominal normaliser: the actual one now
            # every chunk with rollouts used the same nominal normaliser (a chunk of failures alone: 0)
            data.grad_scale = max(s.weight_normalizer for s in data.stats) / units
        self.stream.end_step(step)

    def _calls(self, rid: str):
        try:
            return self.store.calls(rid)
        except KeyError:  # a rollout that never reached the model
            return []

    def _train_main(self) -> None:
        t0 = None
        n_mb = 0
        for batch in self.it:
            step = int(batch["step"][0])
            if step != self.trainer.version:
                raise RuntimeError(f"data position is at step {step} but the trainer is at version "
                                   f"{self.trainer.version}: checkpoint and data iterator disagree")
            mb = {k: np.asarray(batch[k]) for k in MICRO_BATCH_KEYS}
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
        with self._lock:
            data = self._data.pop(step)
        self._step.close(grad_scale=data.grad_scale)
        if self.on_step_started is not None:
            self.on_step_started(step)  # the step runs; its update is neither kept nor saved yet
        report: StepReport = self._step.wait()
        version = self.trainer.version
        outcomes = data.outcomes
        trained = [o.rollout_id for o in outcomes if not o.is_failure]
        failed = [o for o in outcomes if o.is_failure]
        if trained:
            self.store.mark_trained(trained, step=version - 1)
        for status in sorted({o.status for o in failed}):
            self.store.mark_dropped([o.rollout_id for o in failed if o.status == status], step=version - 1,
                                    reason=status)
        self._cursor_version = version  # the store's cursor now covers every update up to this version
        for cell, err in report.failed_cells:
            if self.on_failed_cell is not None:
                self.on_failed_cell(cell, f"training failed in step {step}: {err}")
        params = jax.tree.map(lambda x: x.copy(), self.trainer.state.params)
        cells_used = max(1, len(set(report.cell_of)))
        measured = report.seconds * cells_used / max(n_mb * self.b, 1)
        self.work_s_per_row = 0.7 * self.work_s_per_row + 0.3 * measured
        scores = [o.score for o in outcomes if not o.is_failure]
        info = dict(step=version - 1, version=version, groups=[g.group_id for g in data.groups],
                    group_versions=[g.version for g in data.groups], rollouts=len(outcomes), report=report,
                    stats=merge_stats(data.stats), scores=scores, rows=n_mb * self.b, micro_batches=n_mb,
                    process_s=data.process_s, step_s=time.perf_counter() - t0, cells_used=sorted(set(report.cell_of)),
                    row_chunks=len(data.stats), after_last_group_s=time.perf_counter() - self._last_group_t,
                    score=dict(data.score))
        with self._lock:
            info["dropped_groups"] = self._dropped_groups - self._dropped_reported  # since the last step
            self._dropped_reported = self._dropped_groups
            self._latest = (version, params)
            self._versions[version] = params  # the same copy as _latest: no extra memory for the step's own
            for v in [v for v in self._versions if v < version - self.keep_versions]:
                del self._versions[v]
            self._step = None
            self._in_step = []
        if self.after_update is not None:
            self.after_update(version)  # checkpoint: before the policy may take the next step
        self.on_step(info)  # before steps_done moves: a loop that sees the last step done has its record
        with self._lock:
            self._steps_done = version
            self._updating = False
        self.notify()
