"""Routing calls over rollout cells; drain and re-route live calls; admit cells back.

* Placement: a call with an affinity key (its rollout) goes to the cell that
  served that rollout last, which holds its KV prefix, unless that cell is not
  admitting or is full while another admitting cell has a free slot; otherwise
  to the least-loaded admitting cell (active calls / slots; ties by name).
* ``drain(cell)``: the cell stops admitting at once; every call running there is
  exported (Backend.export: stopped at a token boundary with its KV prefix) and
  continues on another admitting cell, which imports the KV instead of
  recomputing it. If the import fails the call is recomputed from its tokens
  there (same tokens, same sampling state: sampling depends only on the seed and
  the token count). ``RoutedCall`` is one uninterrupted stream of tokens to its
  consumer whatever moves happen underneath, so the proxy writes its record once.
  If no cell is admitting, moved and new calls wait (up to ``wait_for_cell_s``)
  for ``admit``. A KV prefix is only imported by a cell serving the same policy
  version; on a cell with other weights the call is recomputed there.
* ``admit(cell)``: the cell takes calls again (e.g. after a weight publication).
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from typing import AsyncIterator, Iterable

import numpy as np

from gyre_jax.serving.backend import Backend, EngineError, GenerateRequest, TokenEvent

log = logging.getLogger(__name__)


class NoCellError(RuntimeError):
    """No admitting cell became available in time."""


class RoutedCall:
    """One logical call; iterate it for its TokenEvents (the whole output)."""

    def __init__(self, router: "Router", request: GenerateRequest, affinity: str | None):
        self.request, self.affinity = request, affinity
        self._r = router
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.routing: list = []  # per token: its TokenEvent.routing (None where the engine recorded none)
        self.finish: str | None = None
        self.cells: list[str] = []  # every cell that served part of it, in order
        self.policy_version: int | None = None  # of the cell that produced the first token
        self.moves_kv = 0
        self.moves_recompute = 0
        self._backend: Backend | None = None
        self._cancelled = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def cell(self) -> str | None:
        return None if self._backend is None else self._backend.name

    def cancel(self) -> None:
        self._cancelled = True
        if self._backend is not None and self.finish is None:
            self._backend.cancel(self.request_id)

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        req = self.request
        backend = await self._r.acquire(self.affinity)
        stream = self._submit(backend, req)
        fresh_import = False
        try:
            while True:
                try:
                    async for ev in stream:
                        fresh_import = False
                        if self.policy_version is None:
                            self.policy_version = backend.policy_version
                        self.tokens.append(ev.token_id)
                        self.logprobs.append(ev.logprob)
                        self.routing.append(ev.routing)
                        yield ev
                except EngineError:
                    if not (fresh_import and req.resume is not None and req.resume.kv is not None):
                        raise
                    log.warning("%s: KV import on %s failed; recomputing", self.request_id, backend.name)
                    self._r.leave_call(self, backend)
                    self.moves_kv -= 1
                    self.moves_recompute += 1
                    self._r.counters["moves_kv"] -= 1
                    self._r.counters["moves_recompute"] += 1
                    req = dataclasses.replace(req, resume=req.resume.without_kv())
                    stream = self._submit(backend, req)
                    continue
                self._r.leave_call(self, backend)
                if stream.finish != "moved" or self._cancelled:
                    self.finish = "cancelled" if self._cancelled else stream.finish
                    return
                state = stream.resume
                if not np.array_equal(state.output_ids, np.asarray(self.tokens, np.int32)):
                    raise EngineError(f"{self.request_id}: moved with {state.num_generated} tokens, "
                                      f"consumer saw {len(self.tokens)}")
                kv_version = backend.policy_version
                backend = await self._r.acquire(self.affinity)
                if state.kv is not None and backend.policy_version != kv_version:
                    state = state.without_kv()  # the KV was computed by other weights: recompute it
                req = dataclasses.replace(self.request, resume=state)
                fresh_import = state.kv is not None
                if fresh_import:
                    self.moves_kv += 1
                    self._r.counters["moves_kv"] += 1
                else:
                    self.moves_recompute += 1
                    self._r.counters["moves_recompute"] += 1
                stream = self._submit(backend, req)
        finally:
            if self.finish is None:  # consumer stopped early or an error: free the slot
                self.finish = "cancelled"
                if self._backend is not None:
                    self._backend.cancel(self.request_id)
                    self._r.leave_call(self, self._backend)

    def _submit(self, backend: Backend, req: GenerateRequest):
        stream = backend.submit(req)
        self._backend = backend
        self.cells.append(backend.name)
        self._r.join_call(self, backend)
        return stream


class Router:
    def __init__(self, backends: Iterable[Backend], *, wait_for_cell_s: float = 120.0, max_affinity: int = 100_000):
        self.cells: dict[str, Backend] = {}
        for b in backends:
            if b.name in self.cells:
                raise ValueError(f"Router: two backends named {b.name!r}")
            self.cells[b.name] = b
        if not self.cells:
            raise ValueError("Router: needs at least one backend")
        self._admitting = set(self.cells)
        self._calls: dict[str, set[RoutedCall]] = {n: set() for n in self.cells}
        self._affinity: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._max_affinity = max_affinity
        self._wait_s = wait_for_cell_s
        self._changed: asyncio.Condition | None = None
        self.counters: collections.Counter[str] = collections.Counter()

    # ---- placement ---------------------------------------------------------------
    def admitting(self) -> list[str]:
        return sorted(self._admitting)

    def _load(self, name: str) -> float:
        b = self.cells[name]
        return len(self._calls[name]) / max(1, b.capacity)

    def pick(self, affinity: str | None = None) -> Backend | None:
        names = sorted(self._admitting)
        if not names:
            return None
        best = min(names, key=lambda n: (self._load(n), n))
        home = self._affinity.get(affinity) if affinity else None
        if home in self._admitting:
            full = len(self._calls[home]) >= self.cells[home].capacity
            if not (full and self._load(best) < 1.0):
                best = home
        return self.cells[best]

    def _cond(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def _notify(self):
        async with self._cond():
            self._cond().notify_all()

    async def acquire(self, affinity: str | None) -> Backend:
        """A cell for a call (``RoutedCall``), waiting for one to admit calls; remembers the affinity's choice."""
        b = self.pick(affinity)
        if b is None:
            self.counters["waited_for_cell"] += 1
            async with self._cond():
                try:
                    await asyncio.wait_for(self._cond().wait_for(lambda: self.pick(affinity) is not None), self._wait_s)
                except asyncio.TimeoutError:
                    raise NoCellError(f"no rollout cell admitted calls within {self._wait_s}s") from None
            b = self.pick(affinity)
            if b is None:  # not after the wait above (no await in between); said, not assumed
                raise NoCellError("no rollout cell admits calls")
        if affinity:
            self._affinity[affinity] = b.name
            self._affinity.move_to_end(affinity)
            while len(self._affinity) > self._max_affinity:
                self._affinity.popitem(last=False)
        return b

    def forget_affinity(self, affinity: str) -> None:
        """The calls that shared ``affinity`` are over (their rollout ended): drop its cell choice."""
        self._affinity.pop(affinity, None)

    def affinity_count(self) -> int:
        return len(self._affinity)

    def join_call(self, call: RoutedCall, backend: Backend):
        """``call`` runs on ``backend`` (counted until ``leave_call``: a drain waits for it)."""
        self._calls[backend.name].add(call)

    def leave_call(self, call: RoutedCall, backend: Backend):
        s = self._calls[backend.name]
        if call in s:
            s.discard(call)
            if not s:
                asyncio.get_running_loop().create_task(self._notify())

    # ---- the API -------------------------------------------------------------------
    def start(self, request: GenerateRequest, *, affinity: str | None = None) -> RoutedCall:
        self.counters["calls"] += 1
        return RoutedCall(self, request, affinity)

    async def share_prefill(self, request: GenerateRequest, *, affinity: str) -> bool:
        """Prefill ``request``'s prompt once on the cell ``affinity`` leads to, leaving its KV in that
        backend's prefix cache under ``request.cache_key``: the n samples of one prompt, started next
        with the same affinity, then each prefill only its last token instead of the whole prompt.

        Best effort (False when not done): a backend without a prefix cache (no ``settle``), no cache
        key, or an engine error leaves the samples to prefill on their own."""
        backend = await self.acquire(affinity)
        if not request.cache_key or not hasattr(backend, "settle"):
            return False
        warm = dataclasses.replace(request, request_id=f"{request.request_id}-prefill",
                                   sampling=dataclasses.replace(request.sampling, max_tokens=1))
        try:
            async for _ in backend.submit(warm):
                pass
            await backend.settle()  # the finished call's KV is in the cache
        except (EngineError, ValueError) as e:
            log.warning("shared prefill of %s on %s failed (%s); its samples prefill on their own",
                        request.request_id, backend.name, e)
            return False
        self.counters["shared_prefills"] += 1
        return True

    async def drain(self, cell: str) -> dict[str, int]:
        """Stop admitting on ``cell`` and move its running calls elsewhere; returns
        once no call runs there. Counts: exported (moved with KV or recompute) and
        finished_in_place (completed before they could be stopped)."""
        if cell not in self.cells:
            raise KeyError(f"unknown cell {cell!r}; cells: {sorted(self.cells)}")
        self._admitting.discard(cell)
        backend = self.cells[cell]
        calls = list(self._calls[cell])
        results = await asyncio.gather(*(backend.export(c.request_id) for c in calls), return_exceptions=True)
        for c, r in zip(calls, results):
            if isinstance(r, BaseException):
                log.error("drain %s: export of %s raised %r", cell, c.request_id, r)
        async with self._cond():
            await self._cond().wait_for(lambda: not self._calls[cell])
        out = {"exported": sum(r is True for r in results), "finished_in_place": sum(r is False for r in results)}
        self.counters["drains"] += 1
        return out

    async def admit(self, cell: str) -> None:
        if cell not in self.cells:
            raise KeyError(f"unknown cell {cell!r}; cells: {sorted(self.cells)}")
        self._admitting.add(cell)
        await self._notify()

    def stats(self) -> dict[str, float]:
        out = {k: float(v) for k, v in self.counters.items()}
        for n in self.cells:
            out[f"cell_active{{cell={n}}}"] = float(len(self._calls[n]))
            out[f"cell_admitting{{cell={n}}}"] = float(n in self._admitting)
        return out

    async def close(self) -> None:
        await asyncio.gather(*(b.close() for b in self.cells.values()))
