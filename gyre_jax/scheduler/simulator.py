"""Discrete-event simulator of a cell cluster, driven by the real controller.

``SimCluster`` implements the controller's Protocols (CellPool, Proxy,
RolloutLauncher, Trainer, Clock) on a simulated cluster, so a simulation is the
production ``Controller`` + ``policy.decide`` running against simulated cells: the
one-policy invariant holds by construction.

Why our own heapq loop and not SimPy: the hot path is two events per model call
(millions for 48 steps at 1,024 accelerators); a (time, seq) heap with inline
handlers costs a few microseconds per event, whereas SimPy's generator processes
cost several times that, and a drain that moves running calls between cells would
need interrupts on every moved call. The seq number also makes ties, and so whole
runs, deterministic.

Model (see workloads.py): model calls hold one slot of a rollout cell, lowest cell
id first (which packs load onto few cells so the rest can leave); calls beyond the
free slots wait in one FIFO queue at the proxy. A drained cell's calls move, with
their remaining time plus ``kv_move_s``, to free slots or to the queue head.
Training is fluid: the open step's assigned work (cell-seconds) is computed at a
rate equal to the number of cells in 'train' role (micro-batches handed out by
progress, so all cells finish together); then the core applies the update.

The controller is consulted after each instant at which something it reads
changed (a rollout or group finished, a switch/publish/update/training work
finished), never on plain call events, which it does not read.
"""
from __future__ import annotations

import bisect
import collections
import dataclasses
import heapq
import itertools
import math
import time

from gyre_jax.scheduler import policy as policy_lib
from gyre_jax.scheduler.controller import Controller
from gyre_jax.scheduler.costs import model_split
from gyre_jax.scheduler.interfaces import TrainProgress
from gyre_jax.scheduler.policy import ReadyGroup
from gyre_jax.scheduler.results import STATES, SimResult, lower_bound
from gyre_jax.scheduler.vocab import ASYNC, ASYNC_STREAM, ROLLOUT, TO_ROLLOUT, TO_TRAIN, TRAIN, TRAIN_IDLE
from gyre_jax.scheduler.workloads import (
    Rollouts,
    SimConfig,
    balanced_async_split,
    first_steps,
    pilot_priors,
    rollouts_for,
)

# A model call's two events first: the loop checks their token with one comparison (kind <= _CALL_END).
_CALL_READY, _CALL_END, _DEADLINE, _SWITCH_DONE, _WORK_DONE, _UPDATE_DONE, _PUBLISH_DONE, _POLL = range(8)


class SimCluster:
    """The simulated cluster; every public method is one of the controller's Protocols."""

    def __init__(self, config: SimConfig, rollouts: Rollouts, roles: tuple[str, ...]):
        cl, p = config.cluster, config.policy
        if rollouts.n < p.total_steps * p.groups_per_step * p.group_size:
            raise ValueError(f"SimCluster: {rollouts.n} sampled rollouts < the {p.total_steps * p.groups_per_step * p.group_size} the run needs")
        self.config, self._ro = config, rollouts
        n = cl.n_cells
        self._slots = cl.slots_per_cell
        self._role = list(roles)
        self._routable = [r == ROLLOUT for r in roles]
        self._active = [0] * n
        self._open = [c for c in range(n) if self._routable[c]]  # routable with a free slot, sorted
        self._queue: collections.deque[int] = collections.deque()
        self._n_queued = 0
        R = rollouts.n
        self._r_idx = list(rollouts.offsets[:-1])
        self._r_stop = list(rollouts.offsets[1:])
        self._r_token = [0] * R
        self._r_cell = [-1] * R
        self._r_end = [0.0] * R
        self._r_rem = [-1.0] * R  # remaining slot time of a moved call waiting in the queue
        self._r_queued = [False] * R
        self._r_done = [False] * R
        self._r_tokens = [0.0] * R
        self._next_rollout = self._running_rollouts = 0
        self._g_version: list[int] = []  # per group: its version, its rollouts still running, its tokens
        self._g_left: list[int] = []
        self._g_tokens: list[float] = []
        self._running_groups: dict[int, int] = {}
        self._ready: list[tuple[int, int]] = []  # (version, gid), FIFO within version
        self._ready_view: list[ReadyGroup] = []  # the same groups, as the policy sees them
        self._ready_work = 0.0  # their summed work_s
        self._steps_done = self._taken = 0  # steps applied, groups taken into the open one
        self._pending = 0.0
        self._t_work = 0.0
        self._rate = sum(1 for r in roles if r == TRAIN)
        self._work_token = 0
        self._update = False
        self._published = 0
        self._publishing = False
        self._heap: list = []
        self._seq = itertools.count(1)  # tie-breaker: same-time events in push order (deterministic)
        self._now = 0.0
        # metrics
        self._busy_slot_s = 0.0  # slot-seconds served: + a call's time at start, - what a cut removes
        self._train_work_s = 0.0
        self._staleness: list[int] = []  # per group, weighted by group_size later
        self._truncated = self._moved = 0  # rollouts cut by their deadline, calls moved off drained cells
        self._step_end: list[float] = []
        self._seg_state = [self._cell_state(c) for c in range(n)]
        self._seg_t0 = [0.0] * n
        self._segments: list[tuple[int, float, float, str]] = []
        self._state_time = dict.fromkeys(STATES, 0.0)
        self._series: list[tuple[float, int, int, int, int]] = []
        self.events = 0
        self._changed: set[int] = set()  # cells whose role changed since the controller last asked
        # run's: the controller's load-sampling grid (s); when it began, when to print progress (perf_counter)
        self._poll_s = self._wall0 = self._log_at = 0.0

    # ---- Clock
    def now(self) -> float:
        return self._now

    # ---- CellPool
    def cell_ids(self):
        return range(len(self._role))

    def core_cell(self) -> int:
        return 0

    def role(self, cell: int) -> str:
        return self._role[cell]

    def changed_cells(self) -> set[int]:
        """Cells whose role changed since the last call (lets a controller tick stay O(changed))."""
        out, self._changed = self._changed, set()
        return out

    def slots(self, cell: int) -> int:
        return self._slots

    def switch_to_train(self, cell: int) -> None:
        if self._role[cell] != ROLLOUT or self._routable[cell] or self._active[cell]:
            raise RuntimeError(f"switch_to_train({cell}): role {self._role[cell]}, routable {self._routable[cell]}, "
                               f"{self._active[cell]} calls; drain it first")
        self._role[cell] = TO_TRAIN
        self._changed.add(cell)
        self._touch(cell)
        self._push(self._now + self.config.cluster.switch_to_train_s, _SWITCH_DONE, cell, 0)

    def switch_to_rollout(self, cell: int) -> None:
        if self._role[cell] != TRAIN:
            raise RuntimeError(f"switch_to_rollout({cell}): role is {self._role[cell]}, not 'train'")
        self._advance()
        self._role[cell] = TO_ROLLOUT
        self._changed.add(cell)
        self._rate -= 1
        self._reschedule()
        self._touch(cell)
        self._push(self._now + self.config.cluster.switch_to_rollout_s, _SWITCH_DONE, cell, 0)

    def publish(self, version: int) -> None:
        self._publishing = True
        self._push(self._now + self.config.publish_delay_s, _PUBLISH_DONE, version, 0)

    def published_version(self) -> int:
        return self._published

    def publish_in_progress(self) -> bool:
        return self._publishing

    # ---- Proxy
    def routable(self, cell: int) -> bool:
        return self._routable[cell]

    def in_flight_calls(self, cell: int) -> int:
        return self._active[cell]

    def queued_calls(self) -> int:
        return self._n_queued

    def drain(self, cell: int) -> None:
        if not self._routable[cell]:
            return
        self._routable[cell] = False
        i = bisect.bisect_left(self._open, cell)
        if i < len(self._open) and self._open[i] == cell:
            del self._open[i]
        now, move = self._now, self.config.cluster.kv_move_s
        waiting = []
        r_cell = self._r_cell
        for rid in [r for r in range(self._next_rollout) if r_cell[r] == cell]:
            rem = self._r_end[rid] - now + move
            self._moved += 1
            self._release(cell, rid, cut=True)
            self._r_token[rid] += 1
            if self._open:
                self._start(rid, self._open[0], now + rem)
            else:
                self._r_rem[rid] = rem
                self._r_queued[rid] = True
                self._n_queued += 1
                waiting.append(rid)
        self._queue.extendleft(reversed(waiting))

    def admit(self, cell: int) -> None:
        if self._role[cell] != ROLLOUT:
            raise RuntimeError(f"admit({cell}): role is {self._role[cell]}, not 'rollout'")
        self._routable[cell] = True
        if self._active[cell] < self._slots:
            bisect.insort(self._open, cell)
        self._fill()

    # ---- RolloutLauncher
    def launch(self, n_groups: int, version: int) -> None:
        k = self.config.policy.group_size
        timeout = self.config.workload.rollout_timeout_s
        for _ in range(n_groups):
            self._g_version.append(version)
            self._g_left.append(k)
            self._g_tokens.append(0.0)
            self._running_groups[version] = self._running_groups.get(version, 0) + 1
            for _ in range(k):
                rid = self._next_rollout
                self._next_rollout += 1
                # the first call is requested at once (as a harness does), so the load a
                # controller sees after launching includes it
                if self._open:
                    self._start(rid, self._open[0], self._now + self._ro.call_s[self._r_idx[rid]])
                else:
                    self._queue.append(rid)
                    self._r_queued[rid] = True
                    self._n_queued += 1
                if timeout != math.inf:
                    self._push(self._now + timeout, _DEADLINE, rid, 0)
        self._running_rollouts += n_groups * k

    def launched_groups(self) -> int:
        return len(self._g_version)

    def running_rollouts(self) -> int:
        return self._running_rollouts

    def running_groups(self):
        return dict(self._running_groups)

    # ---- Trainer
    def progress(self) -> TrainProgress:
        pending = self._pending
        if self._rate and pending > 0:
            pending = max(0.0, pending - self._rate * (self._now - self._t_work))
        return TrainProgress(
            steps_done=self._steps_done,
            open_step_taken=self._taken,
            pending_work_s=pending,
            update_in_progress=self._update,
            ready_groups=tuple(self._ready_view),
            ready_work_s=self._ready_work,
        )

    def take_groups(self, n: int) -> None:
        G = self.config.policy.groups_per_step
        if n > len(self._ready) or self._taken + n > G or self._update:
            raise RuntimeError(f"take_groups({n}): {len(self._ready)} ready, {self._taken}/{G} taken, update {self._update}")
        self._advance()
        rate = self.config.workload.train_tokens_per_s_per_cell
        for v, g in self._ready[:n]:
            self._staleness.append(self._steps_done - v)
            self._pending += self._g_tokens[g] / rate
        self._ready_work -= sum(g.work_s for g in self._ready_view[:n])
        if not self._ready_view[n:]:
            self._ready_work = 0.0  # no rounding residue once the buffer is empty
        del self._ready[:n]
        del self._ready_view[:n]
        self._taken += n
        self._reschedule()
        self._touch_train()
        if self._taken == G and self._pending <= 0.0:
            self._start_update()

    # ---- internals
    def _push(self, t, kind, a, b):
        heapq.heappush(self._heap, (t, next(self._seq), kind, a, b))

    def _start(self, rid, cell, end):
        # (the hot copy of this is inlined in _event_loop)
        self._busy_slot_s += end - self._now
        self._active[cell] += 1
        if self._active[cell] == self._slots:
            del self._open[bisect.bisect_left(self._open, cell)]
        self._r_cell[rid] = cell
        self._r_end[rid] = end
        self._push(end, _CALL_END, rid, self._r_token[rid])

    def _release(self, cell, rid, *, cut: bool):
        if cut:  # the call stops before its end: it did not use the rest of its slot time
            self._busy_slot_s -= self._r_end[rid] - self._now
        if self._active[cell] == self._slots and self._routable[cell]:
            bisect.insort(self._open, cell)
        self._active[cell] -= 1
        self._r_cell[rid] = -1

    def _fill(self):
        q, ro = self._queue, self._ro
        while q and self._open:
            rid = q.popleft()
            if not self._r_queued[rid]:
                continue
            self._r_queued[rid] = False
            self._n_queued -= 1
            rem = self._r_rem[rid]
            self._start(rid, self._open[0], self._now + (rem if rem >= 0 else ro.call_s[self._r_idx[rid]]))
            self._r_rem[rid] = -1.0

    def _finish(self, rid):
        self._r_done[rid] = True
        self._running_rollouts -= 1
        g = rid // self.config.policy.group_size
        self._g_tokens[g] += self._r_tokens[rid]
        self._g_left[g] -= 1
        if self._g_left[g] == 0:
            v = self._g_version[g]
            self._running_groups[v] -= 1
            if not self._running_groups[v]:
                del self._running_groups[v]
            i = bisect.bisect(self._ready, (v, g))
            self._ready.insert(i, (v, g))
            work = self._g_tokens[g] / self.config.workload.train_tokens_per_s_per_cell
            self._ready_view.insert(i, ReadyGroup(version=v, work_s=work))
            self._ready_work += work

    def _advance(self):
        if self._rate and self._pending > 0:
            done = min(self._pending, self._rate * (self._now - self._t_work))
            self._pending -= done
            self._train_work_s += done
        self._t_work = self._now

    def _reschedule(self):
        self._work_token += 1
        if self._pending > 0 and self._rate:
            self._push(self._now + self._pending / self._rate, _WORK_DONE, self._work_token, 0)

    def _start_update(self):
        self._update = True
        self._push(self._now + self.config.workload.optimizer_s, _UPDATE_DONE, 0, 0)

    def _cell_state(self, c):
        r = self._role[c]
        if r == TRAIN:
            return TRAIN if self._pending > 0 else TRAIN_IDLE
        return r

    def _touch(self, c):
        s = self._cell_state(c)
        if s != self._seg_state[c]:
            t0 = self._seg_t0[c]
            if self._now > t0:
                self._segments.append((c, t0, self._now, self._seg_state[c]))
                self._state_time[self._seg_state[c]] += self._now - t0
            self._seg_state[c], self._seg_t0[c] = s, self._now

    def _touch_train(self):
        for c, r in enumerate(self._role):
            if r == TRAIN:
                self._touch(c)

    # ---- the event loop
    def run(self, controller: Controller, *, progress: bool = False) -> None:
        """Drive the cluster with ``controller`` until the last step is done."""
        self._wall0 = time.perf_counter()
        self._poll_s = controller.sample_s if controller.estimates is not None else 0.0
        if self._poll_s > 0:  # the controller samples load on a grid: tick there (a real loop polls)
            self._push(self._poll_s, _POLL, 0, 0)
        controller.tick()
        self._record_series()
        self._event_loop(controller, progress)
        self._advance()
        for c in range(len(self._role)):
            self._segments.append((c, self._seg_t0[c], self._now, self._seg_state[c]))
            self._state_time[self._seg_state[c]] += self._now - self._seg_t0[c]

    def _event_loop(self, controller: Controller, progress: bool) -> None:
        """Pop events in (time, push order); once an instant's events are all handled, tick the controller
        if one of them changed what it reads. A model call's two events (tens of millions at scale) are
        handled inline on locals."""
        heap, pop, push, nseq = self._heap, heapq.heappop, heapq.heappush, self._seq.__next__
        call_s, tool_s, tokens = self._ro.call_s, self._ro.tool_s, self._ro.tokens
        r_token, r_idx, r_stop, r_cell, r_end, r_tokens = (self._r_token, self._r_idx, self._r_stop, self._r_cell,
                                                          self._r_end, self._r_tokens)
        active, routable, open_, queue, slots, insort = (self._active, self._routable, self._open, self._queue,
                                                         self._slots, bisect.insort)
        call_end, call_ready = _CALL_END, _CALL_READY  # locals: read tens of millions of times
        self._log_at = (self._wall0 + 5.0) if progress else math.inf
        relevant, events = False, 0
        while heap:
            t, _, kind, a, b = pop(heap)
            events += 1
            if kind == call_end:
                if b == r_token[a]:  # (else a call cut by a drain or a deadline)
                    c = r_cell[a]  # release the slot (inlined _release)
                    if active[c] == slots and routable[c]:
                        insort(open_, c)
                    active[c] -= 1
                    r_cell[a] = -1
                    i = r_idx[a]
                    r_tokens[a] += tokens[i]
                    r_idx[a] = i + 1
                    if i + 1 == r_stop[a]:
                        self._finish(a)
                        relevant = True
                    else:
                        push(heap, (t + tool_s[i], nseq(), call_ready, a, b))
                    if queue and open_:  # a slot is free: start the oldest queued calls
                        self._start_queued(t)
            elif kind == call_ready:
                if b != r_token[a]:
                    pass
                elif open_:  # start on the lowest free cell (inlined _start)
                    c = open_[0]
                    d = call_s[r_idx[a]]
                    self._busy_slot_s += d
                    active[c] += 1
                    if active[c] == slots:
                        del open_[0]
                    r_cell[a] = c
                    r_end[a] = t + d
                    push(heap, (t + d, nseq(), call_end, a, b))
                else:
                    self._enqueue(a)
            else:
                self._now = t
                relevant = self._on_event(kind, a, t) or relevant
            if relevant and (not heap or heap[0][0] != t):  # the instant is over
                relevant = False
                if self._end_instant(controller, t, events):
                    break
        else:
            raise self._stuck(controller)
        self.events = events

    def _end_instant(self, controller: Controller, t: float, events: int) -> bool:
        """Tick the controller on what the instant's events changed; True once the last step is done."""
        self._now, self.events = t, events
        controller.tick()
        self._record_series()
        if self._steps_done >= self.config.policy.total_steps:
            return True
        if time.perf_counter() > self._log_at:
            self._log_at = time.perf_counter() + 5.0
            N, done, elapsed = self.config.policy.total_steps, self._steps_done, time.perf_counter() - self._wall0
            print(f"  [{self.config.policy.mode}] step {done}/{N} sim t={t / 3600:.2f} h events={events} "
                  f"({events / elapsed:,.0f}/s) ETA {elapsed / max(done, 1) * (N - done):.0f}s", flush=True)
        return False

    def _stuck(self, controller: Controller) -> RuntimeError:
        return RuntimeError(f"simulation stuck at t={self._now:.1f}s: no events, {self._steps_done}/"
                            f"{self.config.policy.total_steps} steps; state={controller.observe()}")

    def _enqueue(self, rid: int) -> None:
        self._queue.append(rid)
        self._r_queued[rid] = True
        self._n_queued += 1


    def _start_queued(self, t: float) -> None:
        """Start the oldest queued calls on the free slots (a call's own event left a slot free)."""
        queue, open_, active, slots = self._queue, self._open, self._active, self._slots
        while queue and open_:
            q = queue.popleft()
            if not self._r_queued[q]:
                continue
            self._r_queued[q] = False
            self._n_queued -= 1
            rem = self._r_rem[q]
            if rem >= 0:
                self._r_rem[q] = -1.0
            else:
                rem = self._ro.call_s[self._r_idx[q]]
            c = open_[0]
            self._busy_slot_s += rem
            active[c] += 1
            if active[c] == slots:
                del open_[0]
            self._r_cell[q] = c
            self._r_end[q] = t + rem
            heapq.heappush(self._heap, (t + rem, next(self._seq), _CALL_END, q, self._r_token[q]))

    def _on_event(self, kind: int, a: int, t: float) -> bool:
        """Every event but a model call's end and a rollout's next call; True if the controller reads
        what it changed."""
        if kind == _DEADLINE:
            if self._r_done[a]:
                return False
            if self._r_cell[a] >= 0:
                self._release(self._r_cell[a], a, cut=True)
            elif self._r_queued[a]:
                self._r_queued[a] = False
                self._n_queued -= 1
            self._r_token[a] += 1
            self._truncated += 1
            self._finish(a)
            self._fill()
        elif kind == _WORK_DONE:
            if a != self._work_token:
                return False
            self._advance()
            self._train_work_s += self._pending
            self._pending = 0.0
            self._touch_train()
            if self._taken == self.config.policy.groups_per_step:
                self._start_update()
        elif kind == _SWITCH_DONE:
            self._on_switch_done(a)
        elif kind == _UPDATE_DONE:
            self._update = False
            self._steps_done += 1
            self._taken = 0
            self._step_end.append(t)
        elif kind == _PUBLISH_DONE:
            self._published = a
            self._publishing = False
        elif kind == _POLL and self._heap:  # (nothing else pending: let the stuck check see it)
            self._push(t + self._poll_s, _POLL, 0, 0)
        return True

    def _on_switch_done(self, cell: int) -> None:
        if self._role[cell] == TO_TRAIN:
            self._advance()
            self._role[cell] = TRAIN
            self._rate += 1
            self._reschedule()
        else:
            self._role[cell] = ROLLOUT
        self._changed.add(cell)
        self._touch(cell)

    def _record_series(self):
        self._series.append((self._now, self._running_rollouts, sum(self._active), self._n_queued, self._rate))

    def result(self, controller: Controller, *, wall0: float, cpu0: float) -> SimResult:
        """The finished run (after ``run``) as a SimResult; wall0/cpu0: when the simulation began
        (perf_counter, process_time)."""
        k = self.config.policy.group_size
        stale = self._staleness
        lb, kind = lower_bound(self.config, self._ro, self._busy_slot_s, self._train_work_s)
        return SimResult(
            config=self.config,
            makespan_s=self._now,
            step_end_s=tuple(self._step_end),
            staleness_mean=sum(stale) / len(stale),
            staleness_max=max(stale),
            switches=controller.switches,
            truncated_rollouts=self._truncated,
            moved_calls=self._moved,
            rollouts_trained=len(stale) * k,
            state_time_s=dict(self._state_time),
            serving_slot_s=self._busy_slot_s,
            train_work_s=self._train_work_s,
            lower_bound_s=lb,
            lower_bound_kind=kind,
            segments=tuple(self._segments),
            series=tuple(self._series),
            decisions=tuple(controller.decisions),
            events=self.events,
            wall_s=time.perf_counter() - wall0,
            cpu_s=time.process_time() - cpu0,
        )


def resolve(config: SimConfig, rollouts: Rollouts) -> SimConfig:
    """What the config leaves to the workload: async's balanced split (async_train_cells=0)
    and elastic's priors (model_priors; with the pilot's split where a switch outlasts a step).
    Anything that drives the controller on these rollouts (the simulator, the fakes) runs the
    resolved config."""
    if config.policy.strategy.fixed_split and config.policy.async_train_cells == 0:
        config = config.replace(**{"policy.async_train_cells": balanced_async_split(config, rollouts)})
    if config.model_priors and config.policy.priors is policy_lib.NOT_MEASURED:
        config = config.replace(**{"policy.priors": pilot_priors(config, rollouts)})
        n = config.cluster.n_cells
        if config.policy.strategy.switches_satellites and policy_lib.priors_apply(config.policy, n):
            split = pilot_split(config, rollouts)
            config = config.replace(**{"policy.priors": dataclasses.replace(config.policy.priors, pilot_split=split)})
    return config


PILOT_STEPS = 4  # steps a pilot runs each candidate split for: the first, then enough to see the pace
PILOT_REACH = 3  # candidate splits: the step model's, and this many on either side


def pilot_split(config: SimConfig, rollouts: Rollouts) -> int:
    """The fixed split (training cells, core included) that runs the pilot's rollouts fastest: the
    first step's rollouts, repeated for up to PILOT_STEPS steps, in the fixed-split mode that streams
    as ``config``'s mode does, at the step model's split and its neighbours; a longer run's length
    extrapolated at the pace of the pilot's middle steps. What elastic starts at when a
    switch outlasts a step (``costs.priors_split``): the step model alone missed the best split by
    a cell on workloads it does not see (admission by whole groups on a few slots, the staleness
    bound's pipeline, publication stalls), a fixed commitment 10-25% slower (issue 46)."""
    p, n = config.policy, config.cluster.n_cells
    steps = min(p.total_steps, PILOT_STEPS)
    pilot = first_steps(rollouts, p.groups_per_step * p.group_size, steps)
    base = config.replace(**{"policy.mode": ASYNC_STREAM if p.strategy.streams else ASYNC, "policy.total_steps": steps,
                             "model_priors": False, "policy.async_split_by_step": ()})
    model = model_split(p.priors, p, n)
    assert model is not None, "pilot_split needs the pilot's per-rollout costs"

    def run_s(k: int) -> float:
        ends = simulate(base.replace(**{"policy.async_train_cells": k}), rollouts=pilot,
                        record_decisions=False).step_end_s
        if steps == p.total_steps:
            return ends[-1]
        # The steps between the first (nothing to train beside it) and the last (nothing to serve
        # beside it) set the pace of the steps the pilot did not run.
        return ends[-1] + (p.total_steps - steps) * (ends[-2] - ends[0]) / (steps - 2)

    times = {k: run_s(k) for k in range(max(1, model - PILOT_REACH), min(n - 1, model + PILOT_REACH) + 1)}
    best = min(times, key=lambda k: (times[k], abs(k - model)))
    # The pilot saw one step's rollouts: it overrules the model only by more than that sample's noise,
    # half the standard error of its mean rollout length (the candidates run the same rollouts, so their
    # difference is less noisy than either), at least 1%. On 8 heavy-tailed rollouts a 2% lead was the
    # sample's, not the split's; on 48 a 5% one was the split's.
    lengths = [sum(pilot.call_s[pilot.offsets[r]:pilot.offsets[r + 1]]) + sum(pilot.tool_s[pilot.offsets[r]:
               pilot.offsets[r + 1] - 1]) for r in range(p.groups_per_step * p.group_size)]
    mean = sum(lengths) / len(lengths)
    sd = math.sqrt(sum((x - mean) ** 2 for x in lengths) / len(lengths))
    noise = max(0.01, 0.5 * sd / mean / math.sqrt(len(lengths)) if mean > 0 else 0.0)
    return best if times[best] * (1 + noise) < times[model] else model


def simulate(config: SimConfig, *, rollouts: Rollouts | None = None, progress: bool = False,
             record_decisions: bool = True) -> SimResult:
    """Run one simulation: sample (or take) the rollouts, drive the cluster with the controller."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    rollouts = rollouts if rollouts is not None else rollouts_for(config)
    config = resolve(config, rollouts)
    roles = policy_lib.initial_roles(config.policy, config.cluster.n_cells)
    cluster = SimCluster(config, rollouts, roles)
    ctl = Controller(config.policy, cells=cluster, proxy=cluster, rollouts=cluster, trainer=cluster,
                     clock=cluster, record=record_decisions)
    cluster.run(ctl, progress=progress)
    return cluster.result(ctl, wall0=wall0, cpu0=cpu0)
