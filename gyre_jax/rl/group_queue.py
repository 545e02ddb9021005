"""Finished groups waiting for a step, and the open step's admission (the controller's side of the trainer).

The harness thread hands each finished group in (``add_group``: DAPO's dynamic sampling may drop it
first); the controller's thread reads ``progress`` and takes groups into the open step
(``take_groups``), which sends them to the processor as frozen ``Taken`` events: each group as it is
taken when steps stream (``stream_groups``), or the step's groups together once it holds its size.
The step runner tells it when the step is trained (``step_trained``) and done (``step_done``). Every
field is under one lock; no other object reads them.

DAPO's dynamic sampling (``dynamic_sampling_budget > 0``): a finished group whose valid rollouts'
rewards are all equal carries no signal under a group baseline; it is marked dropped (reason
``no_signal``, failures with their status) instead of becoming ready, and ``dropped_groups`` tells
the controller, which admits a replacement for each. The budget caps the drops over the run (ones
spent before a resume count, the store keeps the reasons); past it such groups train as before.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

from gyre_jax.rl.groups import NO_SIGNAL, Group, WorkEstimate
from gyre_jax.rl.step_processor import END, GROUP, STEP, Taken
from gyre_jax.scheduler.interfaces import TrainProgress
from gyre_jax.scheduler.policy import NOMINAL, ReadyGroup, StepSizes
from gyre_jax.trajectory.rewards import has_signal

log = logging.getLogger(__name__)


class GroupQueue:
    def __init__(self, *, store, advantage, groups_per_step: int, stream_groups: bool, send: Callable[[Taken], None],
                 notify: Callable[[], None], work: WorkEstimate, steps_done: int = 0, ready: Sequence[Group] = (),
                 step_sizes: StepSizes = NOMINAL, dynamic_sampling_budget: int = 0,
                 calls_of: Callable[[str], list] = lambda rid: []):
        """``advantage``: the estimator's config (dynamic sampling asks it whether a group has signal);
        ``send``: the processor's inbox; ``step_sizes``: the steps that hold more than ``groups_per_step``
        groups (``policy.resume_step_sizes``); ``calls_of``: a rollout's calls (overlong shaping's lengths)."""
        self.store, self.advantage, self.G, self.stream_groups = store, advantage, groups_per_step, stream_groups
        self.send, self.notify, self.work, self.calls_of = send, notify, work, calls_of
        self.step_sizes = step_sizes
        self._lock = threading.Lock()
        self._ready: list[Group] = []
        self._taken: list[Group] = []  # in the open step, not yet handed to the processor (whole steps)
        self._in_step: list[Group] = []  # handed to the processor for the open step, not yet trained
        self._queued_work_s = 0.0  # taken, not yet in the stream
        self._steps_done = steps_done
        self._updating = False
        self._last_group_t = 0.0  # when the open step took its last group (its training's remaining part starts)
        self.drop_budget = int(dynamic_sampling_budget)
        self._dropped_groups = 0  # by this process: what the controller nets out of its launch count
        # Spent before a resume counts against the budget too (the store keeps the reasons).
        self._dropped_before = len({r.split("-")[0] for r, e in store.consumed().items()
                                    if e.get("reason") == NO_SIGNAL}) if self.drop_budget else 0
        self._dropped_reported = 0
        for g in sorted(ready, key=lambda g: g.version):  # a resumed run's groups pass the same filter
            if self._admit(g):
                self._ready.append(g)

    def size(self, step: int) -> int:
        """Groups step ``step`` holds: G, or more after a resume past the bound (``StepSizes``)."""
        return self.step_sizes.of(step, self.G)

    def progress(self, running_work_s: float) -> TrainProgress:
        with self._lock:
            return TrainProgress(
                steps_done=self._steps_done,
                open_step_taken=self.size(self._steps_done) if self._updating else len(self._taken) + len(self._in_step),
                pending_work_s=self._queued_work_s + running_work_s,
                update_in_progress=self._updating,
                ready_groups=tuple(ReadyGroup(version=g.version, work_s=g.work_s) for g in self._ready),
                dropped_groups=self._dropped_groups,
                step_sizes=self.step_sizes,
            )

    @property
    def steps_done(self) -> int:
        with self._lock:
            return self._steps_done

    def take_groups(self, n: int) -> None:
        with self._lock:
            open_taken = len(self._taken) + len(self._in_step)
            size = self.size(self._steps_done)
            if self._updating or n > len(self._ready) or open_taken + n > size:
                raise RuntimeError(f"take_groups({n}): {len(self._ready)} ready, {open_taken} taken, "
                                   f"updating={self._updating}")
            groups, self._ready = self._ready[:n], self._ready[n:]
            self._queued_work_s += sum(g.work_s for g in groups)
            step = self._steps_done
            if self.stream_groups:
                self._in_step += groups
                for g in groups:
                    self.send(Taken(GROUP, step, (g,), size=size))
            else:
                self._taken += groups
            if open_taken + n == size:
                self._updating = True
                self._last_group_t = time.perf_counter()
                if self.stream_groups:
                    self.send(Taken(END, step, size=size))
                else:
                    self._in_step, self._taken = self._taken, []
                    self.send(Taken(STEP, step, tuple(self._in_step), size=size))

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
        with self._lock:
            spent = self._dropped_before + self._dropped_groups
        if not self.drop_budget or spent >= self.drop_budget:
            return True
        outcomes = [self.store.outcome(r) for r in group.rollout_ids]
        lengths = None
        if self.advantage.overlong:
            lengths = [sum(int(c.output_ids.shape[0]) for c in self.calls_of(r)) for r in group.rollout_ids]
        if has_signal(outcomes, self.advantage, lengths):
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

    def processed(self, groups: Sequence[Group]) -> None:
        """The processor put these groups' rows in the stream."""
        with self._lock:
            self._queued_work_s = max(0.0, self._queued_work_s - sum(g.work_s for g in groups))

    def buffered_rollouts(self) -> list[str]:
        """Finished rollouts not yet trained: the open step's, then the ready ones."""
        with self._lock:
            return [r for g in self._in_step + self._taken + self._ready for r in g.rollout_ids]

    # -- the step runner's side (StepOwner) --
    def step_trained(self) -> tuple[int, float]:
        with self._lock:
            self._in_step = []
            dropped = self._dropped_groups - self._dropped_reported  # since the last step
            self._dropped_reported = self._dropped_groups
            return dropped, self._last_group_t

    def step_done(self, version: int) -> None:
        with self._lock:
            self._steps_done = version
            self._updating = False
        self.notify()
