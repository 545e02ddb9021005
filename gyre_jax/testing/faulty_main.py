"""A write-fault injector (a test fake): ``launch.main`` with one write site of the run made to fail.

  python -m gyre_jax.testing.faulty_main [--fault=SITE:N] [--fake-engines] [launch.main flags...]

From the N-th write at SITE on (1-based), every write there fails with the site's error, as a broken
disk stays broken; the first failure prints ``faulty_main: injected <ERRNO> at <SITE> (write N)`` on
stderr. Nothing in the library knows about it: the injector wraps the functions a write goes through,
below the code that turns an OSError into the run's ``StorageError``, so that code is what is tested.

Sites (``SITES``), each with its error:
  call        the proxy's call record: the store's frame write (os.writev) for a ModelCallRecord, ENOSPC
  outcome     the grader's outcome: the store's frame write for a RolloutOutcome, EIO
  log_sync    the store's fsync of its log after a frame (every ``fsync_interval_s``), EIO
  cursor      the store's cursor journal line (``TrajectoryStore.journal_write``), ENOSPC
  checkpoint  Orbax's checkpoint save (``CheckpointManager.save``), ENOSPC
  publisher   a weight publication into a serving cell (``WeightPublisher.publish``), EIO: retried,
              then the cell goes out of service, and with every serving cell out the run stops

``--fake-engines``: the RL job's engines are ``gyre_jax.testing.fake_engine``'s (no JAX decode), so a
whole attempt runs in seconds; everything else (cells, steps, proxy, harness, store, checkpoints) is real.
Without ``--fault`` nothing is injected (``tools/bench_chaos.py --fake-engines`` runs its attempts so).

Used by ``tools/bench_chaos.py --write-faults`` and tests/test_write_faults.py.
"""
from __future__ import annotations

import errno
import os
import sys
import threading
from typing import Callable

SITES = ("call", "outcome", "log_sync", "cursor", "checkpoint", "publisher")
ERRNO = {"call": errno.ENOSPC, "outcome": errno.EIO, "log_sync": errno.EIO, "cursor": errno.ENOSPC,
         "checkpoint": errno.ENOSPC, "publisher": errno.EIO}
INJECTED = "faulty_main: injected"  # the line's prefix, for the bench


class FaultPlan:
    """Counts writes at one site and fails the N-th and every later one."""

    def __init__(self, site: str, n: int):
        if site not in SITES:
            raise ValueError(f"--fault={site}:{n}: unknown site {site!r}; known: {', '.join(SITES)}")
        if n < 1:
            raise ValueError(f"--fault={site}:{n}: N counts writes from 1")
        self.site, self.n, self.count = site, n, 0
        self._lock = threading.Lock()

    def write(self, site: str) -> None:
        """One write at ``site`` is about to happen: raise its error if it is the N-th or later."""
        if site != self.site:
            return
        with self._lock:
            self.count += 1
            k = self.count
        if k < self.n:
            return
        code = ERRNO[site]
        if k == self.n:
            print(f"{INJECTED} {errno.errorcode[code]} at {site} (write {k})", file=sys.stderr, flush=True)
        raise OSError(code, f"{os.strerror(code)} (injected by faulty_main at {site})")


class _FaultyOS:
    """The frame log module's ``os``: every name is the real one's, except the frame write and fsync, which ask
    the plan first when they run inside an append (the thread-local site says which record it writes)."""

    def __init__(self, real, plan: FaultPlan, where: threading.local):
        self._real, self._plan, self._where = real, plan, where

    def __getattr__(self, name):
        return getattr(self._real, name)

    def writev(self, fd, bufs):
        site = getattr(self._where, "site", None)
        if site is not None:
            self._plan.write(site)
        return self._real.writev(fd, bufs)

    def fsync(self, fd):
        if getattr(self._where, "site", None) is not None:  # the log's fsync: only _write syncs inside an append
            self._plan.write("log_sync")
        return self._real.fsync(fd)


def install(plan: FaultPlan) -> Callable[[], None]:
    """Wrap the write functions of every site (a wrapper counts only its own site's writes); returns the undo."""
    import orbax.checkpoint as ocp

    from gyre_jax.cells import publish
    from gyre_jax.trajectory import frame_log
    from gyre_jax.trajectory import store as store_mod
    from gyre_jax.trajectory.records import ModelCallRecord, RolloutOutcome

    where = threading.local()
    saved = [(frame_log, "os", frame_log.os), (store_mod.TrajectoryStore, "append", store_mod.TrajectoryStore.append),
             (store_mod.TrajectoryStore, "journal_write", store_mod.TrajectoryStore.__dict__["journal_write"]),
             (ocp.CheckpointManager, "save", ocp.CheckpointManager.save),
             (publish.WeightPublisher, "publish", publish.WeightPublisher.publish)]
    frame_log.os = _FaultyOS(os, plan, where)  # type: ignore[assignment]
    real_append = store_mod.TrajectoryStore.append

    def append(self, record):
        kind = ("call" if isinstance(record, ModelCallRecord) else "outcome" if isinstance(record, RolloutOutcome)
                else None)
        where.site = kind
        try:
            return real_append(self, record)
        finally:
            where.site = None

    store_mod.TrajectoryStore.append = append  # type: ignore[method-assign]
    real_journal = store_mod.TrajectoryStore.journal_write

    def journal_write(fd, line, offset):
        plan.write("cursor")
        return real_journal(fd, line, offset)

    store_mod.TrajectoryStore.journal_write = staticmethod(journal_write)  # type: ignore[method-assign]
    _wrap(ocp.CheckpointManager, "save", lambda: plan.write("checkpoint"))
    _wrap(publish.WeightPublisher, "publish", lambda: plan.write("publisher"))

    def undo() -> None:
        for owner, name, value in saved:
            setattr(owner, name, value)

    return undo


def _wrap(cls, name: str, before: Callable[[], None]) -> None:
    real = getattr(cls, name)

    def wrapped(self, *a, **kw):
        before()
        return real(self, *a, **kw)

    setattr(cls, name, wrapped)


def parse(argv: list[str], *, optional: bool = False) -> tuple[FaultPlan | None, list[str]]:
    """(the plan, the other arguments) from ``--fault=SITE:N`` among launch.main's (``optional``: none is
    no plan)."""
    faults = [a for a in argv if a.startswith("--fault=")]
    if optional and not faults:
        return None, list(argv)
    if len(faults) != 1:
        raise SystemExit(f"faulty_main: give exactly one --fault=SITE:N (sites: {', '.join(SITES)})")
    site, _, n = faults[0][len("--fault="):].partition(":")
    try:
        plan = FaultPlan(site, int(n))
    except ValueError as e:
        raise SystemExit(f"faulty_main: {e}") from None
    return plan, [a for a in argv if a is not faults[0]]


def use_fake_engines() -> None:
    """The RL job builds its engines with ``fake_engine.fake_tiny_backend`` (``--fake-engines``)."""
    import functools

    from gyre_jax.rl import build, loop
    from gyre_jax.testing.fake_engine import fake_tiny_backend

    loop.build = functools.partial(build.build, make_backend=fake_tiny_backend)  # type: ignore[assignment]


def main() -> None:
    from launch import early_stop

    early_stop.install()  # as launch.main does first: a stop during the imports is one line
    fake = "--fake-engines" in sys.argv[1:]
    plan, argv = parse([a for a in sys.argv[1:] if a != "--fake-engines"], optional=fake)
    from absl import app

    from launch import cli_errors
    from launch import main as launch_main

    if plan is not None:
        install(plan)
    if fake:
        use_fake_engines()
    sys.argv = [sys.argv[0], *argv]
    cli_errors.precheck(argv)
    app.run(launch_main.main)


if __name__ == "__main__":
    main()
