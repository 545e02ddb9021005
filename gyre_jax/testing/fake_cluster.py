"""Fakes of the controller's Protocols on a virtual clock (for controller tests).

Each fake honours one Protocol of ``gyre_jax.scheduler.interfaces`` and is written
independently of the simulator, object by object, the way a real component would
be: ``FakeCellPool`` (roles, switch delays, publishing), ``FakeProxy`` (slots per
cell, a FIFO queue, drain that moves in-flight calls), ``FakeLauncher`` (agents
that alternate model calls and tool calls from a scripted ``Rollouts`` sample, with
a deadline), ``FakeTrainer`` (buffer of finished groups, the open step, training
work shared by the cells in 'train' role, the core's update). Their semantics are
the simulator's, documented in ``gyre_jax.scheduler.simulator`` and
``workloads``; a test drives ``Controller`` over them and compares its decisions
with the simulator's for the same sample.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable

from gyre_jax.scheduler.interfaces import TrainProgress
from gyre_jax.scheduler.policy import ReadyGroup
from gyre_jax.scheduler.vocab import ELASTIC, ROLLOUT, TO_ROLLOUT, TO_TRAIN, TRAIN
from gyre_jax.scheduler.workloads import Rollouts, SimConfig


class FakeClock:
    """Virtual time: callbacks scheduled at absolute times, run in (time, order) order."""

    def __init__(self):
        self._t = 0.0
        self._heap: list = []
        self._n = 0

    def now(self) -> float:
        return self._t

    def at(self, t: float, fn: Callable[[], None]) -> None:
        if t < self._t:
            raise ValueError(f"FakeClock.at({t}): in the past (now {self._t})")
        self._n += 1
        heapq.heappush(self._heap, (t, self._n, fn))

    def advance(self) -> bool:
        """Run every callback due at the next time (and any they add for that time)."""
        if not self._heap:
            return False
        self._t = self._heap[0][0]
        while self._heap and self._heap[0][0] == self._t:
            heapq.heappop(self._heap)[2]()
        return True


@dataclasses.dataclass(eq=False)
class _Call:
    rid: int
    end: float = 0.0
    cell: int = -1
    remaining: float = -1.0  # set while waiting in the queue
    live: bool = True  # False once finished, cut or moved (its pending callback is stale)
    on_end: Callable[[], None] = lambda: None  # the launcher's callback when the call finishes


class FakeProxy:
    def __init__(self, clock: FakeClock, n_cells: int, slots: int, routable: list[bool], kv_move_s: float):
        self.clock, self.slots, self.kv_move_s = clock, slots, kv_move_s
        self._routable = list(routable)
        self._on_cell: list[dict[int, _Call]] = [{} for _ in range(n_cells)]
        self._queue: list[_Call] = []
        self.log: list[tuple[str, int]] = []  # (op, cell) for drain/admit, in order

    # Proxy protocol
    def drain(self, cell: int) -> None:
        self.log.append(("drain", cell))
        if not self._routable[cell]:
            return
        self._routable[cell] = False
        now = self.clock.now()
        moved = [self._on_cell[cell][r] for r in sorted(self._on_cell[cell])]
        self._on_cell[cell].clear()
        waiting = []
        for call in moved:
            call.live = False
            new = _Call(call.rid, cell=-1, remaining=call.end - now + self.kv_move_s)
            new.on_end = call.on_end
            if self._free_cell() is not None:
                self._place(new, self._free_cell(), new.remaining)
            else:
                waiting.append(new)
        self._queue[:0] = waiting

    def admit(self, cell: int) -> None:
        self.log.append(("admit", cell))
        self._routable[cell] = True
        self._pump()

    def routable(self, cell: int) -> bool:
        return self._routable[cell]

    def in_flight_calls(self, cell: int) -> int:
        return len(self._on_cell[cell])

    def queued_calls(self) -> int:
        return len(self._queue)

    # used by FakeLauncher
    def request(self, rid: int, seconds: float, on_end: Callable[[], None]) -> _Call:
        call = _Call(rid, remaining=seconds)
        call.on_end = on_end
        cell = self._free_cell()
        if cell is None:
            self._queue.append(call)
        else:
            self._place(call, cell, seconds)
        return call

    def cancel(self, call: _Call) -> None:
        """The agent is gone (deadline): free its slot or its queue place."""
        if call.cell >= 0 and call.live:
            self._on_cell[call.cell].pop(call.rid)
        elif call in self._queue:
            self._queue.remove(call)
        call.live = False
        self._pump()

    def current(self, call: _Call) -> _Call:
        """A moved call is re-created; follow it by rollout id."""
        for d in self._on_cell:
            if call.rid in d:
                return d[call.rid]
        for c in self._queue:
            if c.rid == call.rid:
                return c
        return call

    def _free_cell(self):
        for c, ok in enumerate(self._routable):
            if ok and len(self._on_cell[c]) < self.slots:
                return c
        return None

    def _place(self, call: _Call, cell: int, seconds: float) -> None:
        call.cell, call.end, call.remaining = cell, self.clock.now() + seconds, -1.0
        self._on_cell[cell][call.rid] = call
        self.clock.at(call.end, lambda: self._end(call))

    def _end(self, call: _Call) -> None:
        if not call.live:
            return
        call.live = False
        del self._on_cell[call.cell][call.rid]
        call.on_end()
        self._pump()

    def _pump(self) -> None:
        while self._queue and self._free_cell() is not None:
            call = self._queue.pop(0)
            self._place(call, self._free_cell(), call.remaining)


class FakeTrainer:
    def __init__(self, clock: FakeClock, config: SimConfig, rate: int):
        self.clock, self.config = clock, config
        self._rate = rate  # cells in 'train' role
        self._buffer: list[tuple[int, int, float]] = []  # (version, gid, tokens)
        self.steps_done = 0
        self._taken = 0
        self._pending = 0.0
        self._t = 0.0
        self._update = False
        self._work_id = 0
        self.staleness: list[int] = []

    # Trainer protocol
    def progress(self) -> TrainProgress:
        left = self._pending
        if self._rate and left > 0:
            left = max(0.0, left - self._rate * (self.clock.now() - self._t))
        tps = self.config.workload.train_tokens_per_s_per_cell
        return TrainProgress(steps_done=self.steps_done, open_step_taken=self._taken, pending_work_s=left,
                             update_in_progress=self._update,
                             ready_groups=tuple(ReadyGroup(version=v, work_s=tok / tps) for v, _, tok in self._buffer))

    def take_groups(self, n: int) -> None:
        G = self.config.policy.groups_per_step
        assert n <= len(self._buffer) and self._taken + n <= G and not self._update, (n, self._taken)
        self._catch_up()
        tps = self.config.workload.train_tokens_per_s_per_cell
        for v, _, tok in self._buffer[:n]:
            self.staleness.append(self.steps_done - v)
            self._pending += tok / tps
        del self._buffer[:n]
        self._taken += n
        self._replan()
        if self._taken == G and self._pending <= 0.0:
            self._begin_update()

    # used by the other fakes
    def group_finished(self, version: int, gid: int, tokens: float) -> None:
        self._buffer.append((version, gid, tokens))
        self._buffer.sort(key=lambda x: (x[0], x[1]))

    def rate_changed(self, delta: int) -> None:
        self._catch_up()
        self._rate += delta
        self._replan()

    def _catch_up(self):
        if self._rate and self._pending > 0:
            self._pending -= min(self._pending, self._rate * (self.clock.now() - self._t))
        self._t = self.clock.now()

    def _replan(self):
        self._work_id += 1
        if self._pending > 0 and self._rate:
            wid = self._work_id
            self.clock.at(self.clock.now() + self._pending / self._rate, lambda: self._work_done(wid))

    def _work_done(self, wid):
        if wid != self._work_id:
            return
        self._catch_up()
        self._pending = 0.0
        if self._taken == self.config.policy.groups_per_step:
            self._begin_update()

    def _begin_update(self):
        self._update = True
        self.clock.at(self.clock.now() + self.config.workload.optimizer_s, self._update_done)

    def _update_done(self):
        self._update = False
        self.steps_done += 1
        self._taken = 0


class FakeCellPool:
    def __init__(self, clock: FakeClock, config: SimConfig, roles: tuple[str, ...], proxy: FakeProxy, trainer: FakeTrainer):
        self.clock, self.config, self.proxy, self.trainer = clock, config, proxy, trainer
        self._roles = list(roles)
        self._published = 0
        self._publishing = False

    def cell_ids(self):
        return list(range(len(self._roles)))

    def core_cell(self) -> int:
        return 0

    def role(self, cell: int) -> str:
        return self._roles[cell]

    def slots(self, cell: int) -> int:
        return self.config.cluster.slots_per_cell

    def switch_to_train(self, cell: int) -> None:
        assert self._roles[cell] == ROLLOUT and not self.proxy.routable(cell) and not self.proxy.in_flight_calls(cell)
        self._roles[cell] = TO_TRAIN
        self.clock.at(self.clock.now() + self.config.cluster.switch_to_train_s, lambda: self._arrive(cell, TRAIN))

    def switch_to_rollout(self, cell: int) -> None:
        assert self._roles[cell] == TRAIN
        self._roles[cell] = TO_ROLLOUT
        self.trainer.rate_changed(-1)
        self.clock.at(self.clock.now() + self.config.cluster.switch_to_rollout_s, lambda: self._arrive(cell, ROLLOUT))

    def _arrive(self, cell, role):
        self._roles[cell] = role
        if role == TRAIN:
            self.trainer.rate_changed(+1)

    def publish(self, version: int) -> None:
        self._publishing = True

        def done():
            self._published, self._publishing = version, False

        self.clock.at(self.clock.now() + self.config.publish_delay_s, done)

    def published_version(self) -> int:
        return self._published

    def publish_in_progress(self) -> bool:
        return self._publishing


class FakeLauncher:
    def __init__(self, clock: FakeClock, config: SimConfig, rollouts: Rollouts, proxy: FakeProxy, trainer: FakeTrainer):
        self.clock, self.config, self.ro, self.proxy, self.trainer = clock, config, rollouts, proxy, trainer
        self._groups: list[dict] = []
        self._running = 0
        self.truncated = 0

    def launch(self, n_groups: int, version: int) -> None:
        k = self.config.policy.group_size
        for _ in range(n_groups):
            gid = len(self._groups)
            self._groups.append({"version": version, "left": k, "tokens": 0.0})
            for j in range(k):
                self._start_agent(gid * k + j, gid)
        self._running += n_groups * k

    def _start_agent(self, rid, gid):
        agent = {"rid": rid, "gid": gid, "i": self.ro.offsets[rid], "tokens": 0.0, "call": None, "alive": True}
        self._next_call(agent)
        timeout = self.config.workload.rollout_timeout_s
        if timeout != math.inf:
            self.clock.at(self.clock.now() + timeout, lambda: self._deadline(agent))

    def _next_call(self, agent):
        if not agent["alive"]:
            return
        agent["tool"] = False
        agent["call"] = self.proxy.request(agent["rid"], self.ro.call_s[agent["i"]], lambda: self._call_done(agent))

    def _call_done(self, agent):
        i = agent["i"]
        agent["tokens"] += self.ro.tokens[i]
        agent["i"] = i + 1
        agent["call"] = None
        if agent["i"] == self.ro.offsets[agent["rid"] + 1]:
            self._finish(agent)
        else:
            agent["tool"] = True
            self.clock.at(self.clock.now() + self.ro.tool_s[i], lambda: self._next_call(agent))

    def _deadline(self, agent):
        if not agent["alive"]:
            return
        if agent["call"] is not None:
            self.proxy.cancel(self.proxy.current(agent["call"]))
        self.truncated += 1
        self._finish(agent)

    def _finish(self, agent):
        agent["alive"] = False
        self._running -= 1
        g = self._groups[agent["gid"]]
        g["tokens"] += agent["tokens"]
        g["left"] -= 1
        if g["left"] == 0:
            self.trainer.group_finished(g["version"], agent["gid"], g["tokens"])

    def launched_groups(self) -> int:
        return len(self._groups)

    def running_rollouts(self) -> int:
        return self._running

    def running_groups(self):
        out: dict[int, int] = {}
        for g in self._groups:
            if g["left"]:
                out[g["version"]] = out.get(g["version"], 0) + 1
        return out


@dataclasses.dataclass
class FakeCluster:
    clock: FakeClock
    cells: FakeCellPool
    proxy: FakeProxy
    rollouts: FakeLauncher
    trainer: FakeTrainer


def fake_cluster(config: SimConfig, rollouts: Rollouts, roles: tuple[str, ...]) -> FakeCluster:
    clock = FakeClock()
    n = config.cluster.n_cells
    proxy = FakeProxy(clock, n, config.cluster.slots_per_cell, [r == ROLLOUT for r in roles], config.cluster.kv_move_s)
    trainer = FakeTrainer(clock, config, sum(r == TRAIN for r in roles))
    cells = FakeCellPool(clock, config, roles, proxy, trainer)
    launcher = FakeLauncher(clock, config, rollouts, proxy, trainer)
    return FakeCluster(clock, cells, proxy, launcher, trainer)


def tiny_sim_config(mode: str = ELASTIC, **over) -> SimConfig:
    """A cluster and workload small enough for unit tests (8 cells of 1 accelerator,
    2 slots each; agents of ~6 calls, a tail cut by a 150 s deadline; training work
    comparable to serving work so cells do switch)."""
    from gyre_jax.scheduler.policy import PolicyConfig
    from gyre_jax.scheduler.workloads import ClusterConfig, WorkloadConfig

    cfg = SimConfig(
        cluster=ClusterConfig(accelerators=8, cell_size=1, slots_per_cell=2, publish_s=1.0),
        workload=WorkloadConfig(name="tiny", calls_median=6, calls_shape=0.8, calls_max=40,
                                decode_tokens_median=100, decode_tokens_sigma=0.5, context_tokens_median=200,
                                context_tokens_sigma=0.5, decode_tok_s=20, prefill_tok_s=1000, tool_s_median=3,
                                tool_s_sigma=1.0, rollout_timeout_s=150, train_tokens_per_s_per_cell=60,
                                optimizer_s=2.0),
        policy=PolicyConfig(mode=mode, total_steps=6, groups_per_step=4, group_size=2, staleness_bound=1,
                            async_train_cells=3, serve_reserve=0.5),
        seed=0,
    )
    return cfg.replace(**over) if over else cfg
