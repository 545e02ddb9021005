"""The controller: observe the cluster through the Protocols, ask the policy, act.

The same class runs the simulator (on simulated cells) and a real cluster (on
adapters over ``gyre_jax.cells`` and ``gyre_jax.serving``); only the objects it is
given differ. It holds no scheduling logic of its own beyond the mechanics of a
switch: drain a cell before it leaves rollout, admit it to routing once it is back.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable

from gyre_jax.scheduler import policy as policy_lib
from gyre_jax.scheduler.estimates import OnlineEstimates
from gyre_jax.scheduler.interfaces import CellPool, Clock, Proxy, RolloutLauncher, Trainer
from gyre_jax.scheduler.policy import ClusterState, PolicyConfig
from gyre_jax.scheduler.vocab import ROLLOUT, TO_ROLLOUT, TO_TRAIN, TRAIN

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Decision:
    time: float
    actions: tuple[policy_lib.Action, ...]


class Controller:
    """Observe, decide, act. A tick re-reads only the cells that may have changed when the
    cell pool can say which (an optional ``changed_cells()`` method: the simulator has it),
    so at scale a tick costs O(changed cells), not O(cells); without it every cell is read
    (the RL loop's handful). The policy's only per-cell input that changes without a role
    change, a cell's in-flight calls, picks which spare cell to drain: those are re-read
    for every serving cell just before a move to training is applied."""

    def __init__(
        self,
        config: PolicyConfig,
        *,
        cells: CellPool,
        proxy: Proxy,
        rollouts: RolloutLauncher,
        trainer: Trainer,
        clock: Clock,
        record: bool = True,
        estimate: bool = True,
        sample_s: float = 5.0,
    ):
        for name, obj, proto in (
            ("cells", cells, CellPool),
            ("proxy", proxy, Proxy),
            ("rollouts", rollouts, RolloutLauncher),
            ("trainer", trainer, Trainer),
            ("clock", clock, Clock),
        ):
            if not isinstance(obj, proto):
                raise TypeError(f"Controller({name}=...): {type(obj).__name__} does not implement {proto.__name__}")
        self.config = config
        self.cells, self.proxy, self.rollouts, self.trainer, self.clock = cells, proxy, rollouts, trainer, clock
        self.record = record
        self.decisions: list[Decision] = []
        self.switches = 0
        self._ids = list(cells.cell_ids())
        self._index = {c: i for i, c in enumerate(self._ids)}
        self._core = cells.core_cell()
        self._views = [self._view(c) for c in self._ids]
        self._views_tuple: tuple | None = None  # the same tuple until a view changes (the policy caches on it)
        self._changed = getattr(cells, "changed_cells", None)
        self._switching: dict[int, tuple[str, float]] = {}  # cell -> (role it is switching to, when asked)
        self._sample_due = False
        self.last_state: ClusterState | None = None  # what the last tick decided on (for reports)
        # estimate=False: the config's priors only (a reproducible policy for tests of it).
        # sample_s: the load-sampling grid (estimates.py); a clock that only ticks on events
        # (the simulator) schedules a tick on it.
        self.sample_s = sample_s
        self.estimates = OnlineEstimates(group_size=config.group_size, slots_per_cell=cells.slots(self._ids[0]),
                                         sample_s=sample_s) if estimate else None

    def _view(self, c: int) -> policy_lib.CellView:
        return policy_lib.CellView(id=c, role=self.cells.role(c), is_core=c == self._core, slots=self.cells.slots(c),
                                   active_calls=self.proxy.in_flight_calls(c))

    def _read(self, c: int) -> None:
        i = self._index[c]
        v = self._views[i]
        role, calls = self.cells.role(c), self.proxy.in_flight_calls(c)
        if role != v.role or calls != v.active_calls:
            self._views[i] = dataclasses.replace(v, role=role, active_calls=calls)
            self._views_tuple = None

    def reconcile(self) -> None:
        """Admit cells that finished switching to rollout (mechanics, not policy), and
        re-read the cells that may have changed."""
        todo: Iterable[int] = self._ids
        if self._changed is not None:
            todo = set(self._changed()) | set(self._switching)
        for c in todo:
            if self.cells.role(c) == ROLLOUT and not self.proxy.routable(c):
                self.proxy.admit(c)
        for c in todo:
            self._read(c)
        now = self.clock.now()
        for c, (target, t0) in list(self._switching.items()):
            role = self._views[self._index[c]].role
            if role == target:
                if self.estimates is not None:
                    self.estimates.on_switch_done(target, now - t0)
                del self._switching[c]
            elif role not in (TO_TRAIN, TO_ROLLOUT):  # failed, or out of service: nothing to time
                del self._switching[c]

    def observe(self) -> ClusterState:
        prog = self.trainer.progress()
        running = self.rollouts.running_rollouts()
        launched = self.rollouts.launched_groups()
        measured = policy_lib.NOT_MEASURED
        if self.estimates is not None:
            self._sample_due = self.estimates.on_tick(
                self.clock.now(), finished=launched * self.config.group_size - running, steps_done=prog.steps_done,
                update_in_progress=prog.update_in_progress,
                switch_since=min((t0 for _, t0 in self._switching.values()), default=None))
            measured = self.estimates.measured()
        if self._views_tuple is None:
            self._views_tuple = tuple(self._views)
        return ClusterState(
            cells=self._views_tuple,
            queued_calls=self.proxy.queued_calls(),
            running_rollouts=running,
            running_groups=tuple(sorted(self.rollouts.running_groups().items())),
            ready_groups=prog.ready_groups,
            launched_groups=launched - prog.dropped_groups,  # a dropped group (dynamic sampling) gets a replacement
            steps_done=prog.steps_done,
            open_step_taken=prog.open_step_taken,
            pending_work_s=prog.pending_work_s,
            update_in_progress=prog.update_in_progress,
            published_version=self.cells.published_version(),
            publish_in_progress=self.cells.publish_in_progress(),
            measured=measured,
            ready_work_s=prog.ready_work_s,
            step_sizes=prog.step_sizes,
        )

    def _sample_load(self, estimates: OnlineEstimates) -> None:
        # After the tick's actions (launched agents' first calls included): the load that
        # holds until the next sample. A read of every cell, once per estimates.sample_every finishes.
        running = self.rollouts.running_rollouts()
        estimates.sample(self.clock.now(), finished=self.rollouts.launched_groups() * self.config.group_size - running,
                              in_flight=sum(self.proxy.in_flight_calls(c) for c in self._ids),
                              queued=self.proxy.queued_calls(), running=running)

    def apply(self, actions, state: ClusterState | None = None) -> None:
        now = self.clock.now()
        for a in actions:
            if isinstance(a, policy_lib.Publish):
                self.cells.publish(a.version)
            elif isinstance(a, policy_lib.TakeGroups):
                if self.estimates is not None and state is not None:
                    self.estimates.on_taken(sum(g.work_s for g in state.ready_groups[: a.n]), a.n)
                self.trainer.take_groups(a.n)
            elif isinstance(a, policy_lib.Launch):
                self.rollouts.launch(a.n_groups, a.version)
            elif isinstance(a, policy_lib.ToTrain):
                self.proxy.drain(a.cell)
                self.cells.switch_to_train(a.cell)
                self._switching[a.cell] = (TRAIN, now)
                self.switches += 1
            elif isinstance(a, policy_lib.ToRollout):
                self.cells.switch_to_rollout(a.cell)
                self._switching[a.cell] = (ROLLOUT, now)
                self.switches += 1
            else:
                raise TypeError(f"Controller.apply: unknown action {a!r}")
        for a in actions:
            if isinstance(a, (policy_lib.ToTrain, policy_lib.ToRollout)):
                self._read(a.cell)

    def tick(self) -> tuple[policy_lib.Action, ...]:
        self.reconcile()
        state = self.observe()
        actions = policy_lib.decide(state, self.config)
        if self._changed is not None and any(isinstance(a, policy_lib.ToTrain) for a in actions):
            # which cells to drain depends on their in-flight calls: read them fresh, decide again
            for v in state.cells:
                if v.role == ROLLOUT:
                    self._read(v.id)
            if self._views_tuple is None:
                self._views_tuple = tuple(self._views)
            state = dataclasses.replace(state, cells=self._views_tuple)
            actions = policy_lib.decide(state, self.config)
        self.last_state = state
        self.apply(actions, state)
        if self.estimates is not None:
            if any(isinstance(a, policy_lib.TakeGroups) for a in actions) and self.trainer.progress().update_in_progress:
                self.estimates.on_update_started(self.clock.now())  # time the update from its start, not the next tick
            if self._sample_due:
                self._sample_load(self.estimates)
        if actions and self.record:
            self.decisions.append(Decision(self.clock.now(), actions))
        return actions

    def done(self) -> bool:
        return self.trainer.progress().steps_done >= self.config.total_steps

    def run(self, *, poll_s: float = 1.0, wait: Callable[[float], None] = time.sleep, max_s: float | None = None) -> None:
        """Real-clock loop: decide, then wait `poll_s` (or until `wait` returns early,
        e.g. an event that a rollout or a switch finished)."""
        start = self.clock.now()
        while not self.done():
            actions = self.tick()
            if actions:
                log.info("t=%.1fs %s", self.clock.now(), actions)
            if max_s is not None and self.clock.now() - start > max_s:
                raise TimeoutError(f"Controller.run: {self.config.total_steps} steps not done after {max_s} s")
            wait(poll_s)
