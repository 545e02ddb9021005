"""The processor thread (``gyre-processor``): the groups a step took -> packed rows in the stream.

Its inbox carries frozen ``Taken`` events (from the group queue, or from a resume's replay): a
streamed group (``group``), a whole step's groups (``step``), or a streamed step's end (``end``).
For each chunk it reads the rollouts from the store, runs ``process_step`` (advantages, trees,
Jmax paths, weights), the per-step pass if the objective reads one (``cells.score.StepScorer``),
and adds the rows to the ``RowStream``; at a step's end it hands the step's data, frozen, to the
step runner (``outbox``) and only then lets the step's last rows out (``RowStream.end_step``).

It alone touches the open step's data (``_OpenStep``). Whole steps sort their groups (and each
group its rollouts) by id, so the rows are a function of the step's rollouts alone; streamed
groups are packed in the order the step took them, weighted over the step's nominal rollout count
``size x group_size``, and the runner rescales the update by nominal / trained (``grad_scale``).
"""
from __future__ import annotations

import dataclasses
import queue
import time
from typing import Callable, Mapping

import numpy as np

from gyre_jax.rl.groups import Group, redated_calls
from gyre_jax.rl.step_events import StepInput
from gyre_jax.trajectory.processor import ProcessorConfig, StepStats, process_step
from gyre_jax.trajectory.serialize import pack_rows

GROUP, STEP, END = "group", "step", "end"


@dataclasses.dataclass(frozen=True)
class Taken:
    """Groups a step took, for the processor. ``group``: one streamed group; ``step``: a whole step's groups
    at once; ``end``: a streamed step's last group is already in. ``size``: the groups the step holds (its
    nominal normaliser); ``redate``: rollout id -> lineage version for this step's rollouts (None: the
    processor's own, set at a resume)."""

    kind: str
    step: int
    groups: tuple[Group, ...] = ()
    size: int = 0
    redate: Mapping[str, int] | None = None


@dataclasses.dataclass
class _OpenStep:
    """A step's data while the processor thread builds it (that thread alone touches it)."""

    step: int
    size: int
    streamed: bool = False
    groups: list[Group] = dataclasses.field(default_factory=list)
    outcomes: list = dataclasses.field(default_factory=list)
    stats: list[StepStats] = dataclasses.field(default_factory=list)
    rows: int = 0
    process_s: float = 0.0
    offset: int = 0  # rollout index of the next streamed chunk's first rollout
    score: dict = dataclasses.field(default_factory=dict)  # the per-step pass, summed over chunks
    redated: dict = dataclasses.field(default_factory=dict)  # rollout id -> the version its late tokens count as

    def frozen(self, grad_scale: float) -> StepInput:
        return StepInput(step=self.step, groups=tuple(self.groups), outcomes=tuple(self.outcomes),
                         stats=tuple(self.stats), rows=self.rows, process_s=self.process_s, grad_scale=grad_scale,
                         score=dict(self.score), size=self.size, streamed=self.streamed, redated=dict(self.redated))


class StepProcessor:
    """Taken groups -> rows in ``stream`` and one ``StepInput`` per step on ``outbox`` (module docstring)."""

    def __init__(self, *, store, config: ProcessorConfig, stream, micro_batch_rows: int, group_size: int,
                 redate: Mapping[str, int] | None = None, scorer=None,
                 params_of: Callable[[int], object | None] = lambda v: None,
                 on_processed: Callable[[list[Group]], None] = lambda groups: None,
                 adapter_of: Callable[[str], int] | None = None):
        """``redate``: the rollouts a resume found untrained, each with the version its lineage reached (their
        tokens sampled later count as sampled by it); ``params_of(version)``: the kept params the per-step pass
        reads; ``on_processed(groups)``: the groups' rows are in the stream (the group queue's queued work);
        ``adapter_of``: multi-LoRA, a group id's adapter: every packed token carries its rollout's (rows'
        ``adapter`` field)."""
        self.store, self.pc, self.stream = store, config, stream
        self.b, self.group_size = int(micro_batch_rows), int(group_size)
        self.redate = dict(redate or {})
        self.scorer = scorer if scorer is not None and scorer.needed else None
        self.params_of, self.on_processed = params_of, on_processed
        self.adapter_of = adapter_of
        self.inbox: queue.Queue[Taken | None] = queue.Queue()  # None: stop
        self.outbox: queue.Queue[StepInput] = queue.Queue()  # each step's data, at its end (the runner's inbox)
        self._open: _OpenStep | None = None

    def warm(self, params) -> None:
        """Compile the per-step pass while no group is in yet."""
        if self.scorer is not None:
            warm = pack_rows([[]] * self.b, self.pc.row_len, routing_width=self.pc.routing_width).as_dict()
            self.scorer.warm(warm, params)

    def run(self) -> None:
        """The thread: events until a None."""
        while True:
            ev = self.inbox.get()
            if ev is None:
                return
            self.handle(ev)

    def handle(self, ev: Taken) -> None:
        """One event (the thread's loop; a resume's replay calls it directly, before the thread starts)."""
        data = self._open
        if data is None or data.step != ev.step:
            data = self._open = _OpenStep(ev.step, ev.size)
        if ev.kind != END:  # "end" (streamed groups): the step's last group is already in
            data.streamed = data.streamed or ev.kind == GROUP
            self._process(ev, data)
        if ev.kind != GROUP:
            self._end_step(data)
            self._open = None

    def _process(self, ev: Taken, data: _OpenStep) -> None:
        """One chunk (a whole step, or one streamed group): rewards -> trees -> packed rows in the stream."""
        t0 = time.perf_counter()
        groups = list(ev.groups)
        # Whole steps: groups (and rollouts within a group) arrive in finishing order; sorting
        # by id makes the packed rows, hence the losses, a function of the step's rollouts
        # alone (a resumed run reproduces an uninterrupted one).
        groups = sorted(groups, key=lambda g: g.group_id) if ev.kind == STEP else groups
        redate = self.redate if ev.redate is None else ev.redate
        rids = [r for g in groups for r in sorted(g.rollout_ids)]
        outcomes = [self.store.outcome(r) for r in rids]
        calls = []
        for r in rids:
            cs, moved = redated_calls(self._calls(r), redate, r)
            calls += cs
            if moved:
                data.redated[r] = redate[r]
        offset = 0 if ev.kind == STEP else data.offset
        if ev.kind == STEP:
            batch = process_step(calls, outcomes, self.pc)
        else:
            batch = process_step(calls, outcomes, self.pc, num_step_rollouts=data.size * self.group_size,
                                 rollout_index_offset=data.offset)
            data.offset += len(batch.rollout_ids)
        if self.adapter_of is not None:  # multi-LoRA: each token trains its rollout's adapter
            group_of = {o.rollout_id: o.group_id for o in outcomes}
            per = np.asarray([self.adapter_of(group_of[r]) for r in batch.rollout_ids] + [0], np.int32)
            local = np.where(batch.rollout_index >= 0, batch.rollout_index - offset, -1)
            batch.rows.adapter = per[local]  # -1 (padding) reads the appended 0
        if self.scorer is not None and batch.rows.tokens.shape[0]:
            for k, v in self.scorer.score(batch.rows, batch.rollout_index, version=data.step,
                                          params_of=self.params_of).items():
                data.score[k] = data.score.get(k, 0) + v
        data.groups += groups
        data.outcomes += outcomes
        data.stats.append(batch.stats)
        data.process_s += time.perf_counter() - t0
        rows = int(batch.rows.tokens.shape[0])
        if rows:
            data.rows += rows
            self.stream.add(data.step, batch.rows, batch.rollout_index)
        self.on_processed(groups)

    def _end_step(self, data: _OpenStep) -> None:
        """Hand the step's data to the runner, then let its last rows out of the stream."""
        if not data.rows:  # every rollout failed: one empty row, so the step still runs (and counts)
            empty = pack_rows([[]], self.pc.row_len, routing_width=self.pc.routing_width)
            if self.adapter_of is not None:
                empty.adapter = np.zeros(empty.tokens.shape, np.int32)
            self.stream.add(data.step, empty, np.full(empty.tokens.shape, -1, np.int32))
            data.rows = 1
        units = sum(s.weight_units for s in data.stats)
        grad_scale = 1.0
        if data.streamed and units:  # weights were divided by a nominal normaliser: the actual one now
            # every chunk with rollouts used the same nominal normaliser (a chunk of failures alone: 0)
            grad_scale = max(s.weight_normalizer for s in data.stats) / units
        self.outbox.put(data.frozen(grad_scale))  # before end_step: the runner reads it at the last batch
        self.stream.end_step(data.step)

    def _calls(self, rid: str):
        try:
            return self.store.calls(rid)
        except KeyError:  # a rollout that never reached the model
            return []
