"""The real cells and the proxy's routing behind the scheduler's ``CellPool`` and ``Proxy``.

The controller only calls non-blocking methods; a switch or a publication runs in
a small thread pool and reports through ``role()`` / ``published_version()`` and
a ``notify()`` that wakes the loop.

Placement. The loop starts from a ``CellLayout`` (``gyre_jax.cells.mesh``) and its
role -> mesh map: a cell serves on ``cell.mesh(Role.ROLLOUT)`` and trains on
``cell.mesh(Role.TRAIN)``. From then on a cell's role is the scheduler's
(``rollout``, ``train``, ``to_train``, ``to_rollout``, ``out``), held here.

One publication path. Every weight move to a serving cell, a publication to all
of them or the load of a cell that just turned to rollout, goes through one
``WeightPublisher`` (the cell's serving shardings from the rules table, bytes and
seconds measured, never an older version than the cell holds) and then into the
cell's engine. Cells always serve the *published* version (multi-step mode keeps
k updates between publications; a cell coming back does not skip ahead).

Failures. A switch or a load that raises is retried (``retries`` times); a cell
whose attempts all fail, or whose training worker failed in more than
``retries`` steps, is taken out of service: drained for good, role ``out``, no
more work from the policy. The core cannot be taken out, and a run with no cell
left to serve cannot go on: both are the run's failure (``errors``).
"""
from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
from typing import Any, Callable, Protocol, Sequence

from gyre_jax.cells.mesh import CellLayout, Role
from gyre_jax.cells.publish import MoveStats, WeightPublisher
from gyre_jax.scheduler.vocab import OUT, ROLLOUT, SERVING_ROLES, TO_ROLLOUT, TO_TRAIN, TRAIN

log = logging.getLogger(__name__)


class ProxyAdapter:
    """Routing side of the recording proxy (``scheduler.interfaces.Proxy``)."""

    def __init__(self, server, names: dict[int, str], routable: Sequence[int]):
        self.server, self.names = server, names
        self.router = server.proxy.router
        self._routable = set(routable)
        self._drains: dict[int, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        for c in names:  # start consistent with the initial roles (no calls yet: instant)
            if c not in self._routable:
                server.run(self.router.drain(names[c]), timeout=60)

    def drain(self, cell: int) -> None:
        with self._lock:
            self._routable.discard(cell)
            if cell in self.names:
                self._drains[cell] = self.server.submit(self.router.drain(self.names[cell]))

    def wait_drained(self, cell: int, timeout: float = 300.0) -> None:
        """Wait for the drain the controller started (or drain again: a retry after a failure)."""
        with self._lock:
            fut = self._drains.pop(cell, None)
        if fut is None and cell in self.names:
            fut = self.server.submit(self.router.drain(self.names[cell]))
        if fut is not None:
            fut.result(timeout)

    def admit(self, cell: int) -> None:
        if cell not in self.names:
            raise ValueError(f"cell {cell} has no engine (mode does not serve on it)")
        with self._lock:
            self._routable.add(cell)
        self.server.run(self.router.admit(self.names[cell]), timeout=60)

    def routable(self, cell: int) -> bool:
        return cell in self._routable

    def in_flight_calls(self, cell: int) -> int:
        b = self.router.cells.get(self.names.get(cell, ""))
        return 0 if b is None else b.num_active()

    def queued_calls(self) -> int:
        return 0  # the router keeps no queue we can count without waiting on it; calls wait for a cell


class RoleTable:
    """Each cell's role, shared: the pool writes it (a switch's thread), the trainer and the loop read it.

    Built before either of them, so neither needs the other to exist to know the roles."""

    def __init__(self, roles: Sequence[str], timeline, notify: Callable[[], None]):
        self.timeline, self.notify = timeline, notify
        self._roles = list(roles)
        self._lock = threading.Lock()

    def get(self, cell: int) -> str:
        with self._lock:
            return self._roles[cell]

    def all(self) -> list[str]:
        with self._lock:
            return list(self._roles)

    def set(self, cell: int, role: str) -> None:
        with self._lock:
            self._roles[cell] = role
        self.timeline.set(cell, role)
        self.notify()


class TrainerLink(Protocol):
    """What the pool asks of the trainer (``rl.trainer.TrainerAdapter``): built first, passed in."""

    def on_train_cell(self, cell: int) -> None: ...
    def leave_step(self, cell: int): ...
    def wait_cell_free(self, cell: int) -> None: ...
    def latest_params(self) -> tuple[int, Any]: ...


class CellPoolAdapter:
    """Cells, roles, switches and weight publication (``scheduler.interfaces.CellPool``)."""

    def __init__(self, *, layout: CellLayout, roles: RoleTable, trainer: TrainerLink, backends: dict[int, Any],
                 proxy: ProxyAdapter, notify: Callable[[], None], publisher: WeightPublisher,
                 published: tuple[int, Any], slots: int, retries: int, chaos=None, remote: dict[int, Any] | None = None):
        self.cells, self.backends, self.proxy, self.notify = layout.cells, backends, proxy, notify
        self.publisher, self.retries, self.chaos = publisher, retries, chaos
        self.trainer = trainer
        self._roles = roles
        self._slots = slots
        self._published = published  # (version, params): what serving cells load
        self._publishing = False
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="switch")
        self._load_lock = threading.RLock()  # held across a whole publication: a cell never loads a version being replaced
        self._lock = threading.Lock()
        self.errors: list[BaseException] = []  # failures the run cannot survive (the core's)
        self.failures: list[tuple[int, str, str]] = []  # (cell, what, error) of every failed attempt
        self.out: dict[int, str] = {}  # cell -> why it was taken out of service
        self._train_failures: dict[int, int] = {}
        # Pods: cells in satellite processes, cell -> (gyre_jax.pods RemoteCell, RemoteBackend); their weights move
        # on the transfer server (SatelliteLink.publish). _remote_held: the version each one's engine serves.
        self.remote = dict(remote or {})
        self._remote_held = {c: published[0] for c in self.remote}
        self._remote_moves: list[MoveStats] = []

    # -- Protocol --
    def cell_ids(self):
        return range(len(self.cells))

    def core_cell(self) -> int:
        return 0

    def role(self, cell: int) -> str:
        return self._roles.get(cell)

    def roles(self) -> list[str]:
        return self._roles.all()

    def slots(self, cell: int) -> int:
        return self._slots

    def _set(self, cell: int, role: str) -> None:
        self._roles.set(cell, role)

    def _retried(self, what: str, cell: int, attempt: Callable[[], object], *, chaos: bool) -> None:
        """``attempt()``, retried; out of service (or a run error, for the core) if it keeps failing.
        ``chaos``: the injected switch delays and failures (config.faults) apply to it."""
        err = None
        for n in range(self.retries + 1):
            try:
                if chaos and self.chaos is not None:
                    self.chaos.delay()
                    self.chaos.switch_attempt(cell, what)
                attempt()
                return
            except Exception as e:  # noqa: BLE001 - retried, then the cell goes out of service
                err = e
                self.failures.append((cell, what, repr(e)))
                log.warning("cell %d: %s failed (attempt %d of %d): %r", cell, what, n + 1, self.retries + 1, e)
        self.take_out(cell, f"{what} failed {self.retries + 1} times, last: {err!r}", err)

    def _run(self, what: str, cell: int, attempt: Callable[[], None]) -> None:
        """A switch: ``attempt`` in the pool, retried (``_retried``)."""
        self._pool.submit(self._retried, what, cell, attempt, chaos=True)

    def training_failed(self, cell: int, why: str) -> None:
        """A satellite's worker failed in a step (its work went to the other cells): the cell
        keeps its role and rejoins later steps, until it has failed ``retries + 1`` times."""
        with self._lock:
            self._train_failures[cell] = self._train_failures.get(cell, 0) + 1
            n = self._train_failures[cell]
        self.failures.append((cell, "training", why))
        if n > self.retries:
            self.take_out(cell, f"training failed {n} times, last: {why}")
        else:
            log.warning("cell %d: %s (failure %d of %d allowed)", cell, why, n, self.retries + 1)

    def take_out(self, cell: int, why: str, error: BaseException | None = None) -> None:
        """Out of service: never routed again, leaves any step, gets no work from the policy."""
        if cell == 0:
            self.errors.append(error or RuntimeError(why))
            self.notify()
            return
        with self._lock:
            if cell in self.out:
                return
            self.out[cell] = why
        log.error("cell %d taken out of service: %s", cell, why)
        if cell in self.proxy.names:
            try:
                self.proxy.drain(cell)
            except Exception:  # noqa: BLE001 - the server may be stopping; the cell gets no work anyway
                log.exception("cell %d: drain while taking it out failed", cell)
        self.trainer.leave_step(cell)
        self._set(cell, OUT)
        if all(c in self.out for c in self.backends):
            self.errors.append(RuntimeError(f"no cell left to serve rollouts: {self.out}"))
            self.notify()

    def switch_to_train(self, cell: int) -> None:
        self._set(cell, TO_TRAIN)
        self._run("switch to train", cell, lambda: self._to_train(cell))

    def _to_train(self, cell: int) -> None:
        self.proxy.wait_drained(cell)
        if self.chaos is not None:
            self.chaos.delay()
        self._set(cell, TRAIN)
        self.trainer.on_train_cell(cell)

    def switch_to_rollout(self, cell: int) -> None:
        self._set(cell, TO_ROLLOUT)
        self._run("switch to rollout", cell, lambda: self._to_rollout(cell))

    def _to_rollout(self, cell: int) -> None:
        self.trainer.wait_cell_free(cell)  # a satellite finishes its micro-batches of the running step
        with self._load_lock:
            version, params = self._published
            self._load(cell, version, params)
            self._set(cell, ROLLOUT)

    def _load(self, cell: int, version: int, params) -> MoveStats | None:
        """Move ``params`` (policy ``version``) into the cell's engine, unless it already holds it."""
        with self._load_lock:
            if cell in self.remote:
                if self._remote_held[cell] >= version:
                    return None
                rcell, rbackend = self.remote[cell]
                move = rcell.link.publish(params, version, cell)
                self._remote_held[cell] = version
                self._remote_moves.append(move)
                rbackend.set_version(version)
                return move
            held = self.publisher.latest(self.cells[cell])
            if held is not None and held.version >= version:
                return None
            pub = self.publisher.publish(params, version, self.cells[cell], Role.ROLLOUT)
            self.backends[cell].engine.publish(pub.params, version)
            return pub.move

    def publish(self, version: int) -> None:
        self._publishing = True
        self._pool.submit(self._publish, version)

    def _publish(self, version: int) -> None:
        # The swap is not preceded by a drain: a call already in a slot finishes on the new
        # weights (its record carries the version of its first token; the behavior
        # log-probs are the ones actually sampled, so the importance ratio stays exact).
        # Draining every serving cell per publication would stall all agents here.
        try:
            have, params = self.trainer.latest_params()
            if have < version:
                self.errors.append(RuntimeError(f"publish({version}): the trainer only has version {have}"))
                return
            with self._load_lock:  # a cell turning to rollout meanwhile loads after us, the new version
                for c in self.backends:
                    if self._roles.get(c) in SERVING_ROLES:
                        self._retried(f"publish of version {have}", c,
                                      functools.partial(self._load, c, have, params), chaos=False)
                self._published = (have, params)
        finally:
            self._publishing = False
            self.notify()

    def published_version(self) -> int:
        return self._published[0]

    def publish_in_progress(self) -> bool:
        return self._publishing

    def moves(self) -> list[MoveStats]:
        return list(self.publisher.history) + list(self._remote_moves)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
