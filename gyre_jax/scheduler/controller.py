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
from collections.abc import Callable

from gyre_jax.scheduler import policy as policy_lib
from gyre_jax.scheduler.interfaces import CellPool, Clock, Proxy, RolloutLauncher, Trainer
from gyre_jax.scheduler.policy import ClusterState, PolicyConfig
from gyre_jax.scheduler.vocab import ROLLOUT

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Decision:
    time: float
    actions: tuple[policy_lib.Action, ...]


class Controller:
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

    def observe(self) -> ClusterState:
        cells, proxy = self.cells, self.proxy
        core = cells.core_cell()
        views = tuple(
            policy_lib.CellView(
                id=c,
                role=cells.role(c),
                is_core=c == core,
                slots=cells.slots(c),
                active_calls=proxy.in_flight_calls(c),
            )
            for c in cells.cell_ids()
        )
        prog = self.trainer.progress()
        return ClusterState(
            cells=views,
            queued_calls=proxy.queued_calls(),
            running_rollouts=self.rollouts.running_rollouts(),
            running_groups=tuple(sorted(self.rollouts.running_groups().items())),
            ready_groups=prog.ready_groups,
            launched_groups=self.rollouts.launched_groups(),
            steps_done=prog.steps_done,
            open_step_taken=prog.open_step_taken,
            pending_work_s=prog.pending_work_s,
            update_in_progress=prog.update_in_progress,
            published_version=cells.published_version(),
            publish_in_progress=cells.publish_in_progress(),
        )

    def reconcile(self) -> None:
        """Admit cells that finished switching to rollout (mechanics, not policy)."""
        for c in self.cells.cell_ids():
            if self.cells.role(c) == ROLLOUT and not self.proxy.routable(c):
                self.proxy.admit(c)

    def apply(self, actions) -> None:
        for a in actions:
            if isinstance(a, policy_lib.Publish):
                self.cells.publish(a.version)
            elif isinstance(a, policy_lib.TakeGroups):
                self.trainer.take_groups(a.n)
            elif isinstance(a, policy_lib.Launch):
                self.rollouts.launch(a.n_groups, a.version)
            elif isinstance(a, policy_lib.ToTrain):
                self.proxy.drain(a.cell)
                self.cells.switch_to_train(a.cell)
                self.switches += 1
            elif isinstance(a, policy_lib.ToRollout):
                self.cells.switch_to_rollout(a.cell)
                self.switches += 1
            else:
                raise TypeError(f"Controller.apply: unknown action {a!r}")

    def tick(self) -> tuple[policy_lib.Action, ...]:
        self.reconcile()
        actions = policy_lib.decide(self.observe(), self.config)
        self.apply(actions)
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
