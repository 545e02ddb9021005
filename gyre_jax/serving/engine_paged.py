"""The paged-cache half of GyreEngine's host side (a mixin: the same object, one job per file).

GyreEngine(kv_cache="paged") keeps a PagePool (serving/pages.py) beside its decode state.
Threads: JetStream's prefill thread must never wait for the generate thread (in
interleaved mode that thread waits for the prefill thread while requests are queued), so
everything that touches the pool's pages runs on the generate thread:
  * ``_prefill_paged`` (prefill thread) prefills as usual, except that a prompt whose
    leading full pages are cached is left for admission, where only its rest is computed;
  * ``insert`` queues the call as waiting (its slot held: no tokens, never expiring) and
    ``_admit_waiting`` admits waiting calls, oldest first, while the pages for their prompt
    and all they may still generate are free, mapping their prompt's cached pages;
  * ``_grow_pages`` hands out pages just before the decode call that writes them;
  * ``_free_pages`` returns a finished call's pages (its prompt's full pages stay in the
    prefix cache while nobody needs the room, and, when ``release`` is given the call's tokens,
    the full pages of its answer too: ``_keep_sequence_pages``).
"""
from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from gyre_jax.serving.engine_state import DecodeState, KVBlock, Prefix, PrefillInput
from gyre_jax.serving.pages import PagePool, PrefixPages, pages_for

if TYPE_CHECKING:  # engine.py imports this module
    from gyre_jax.serving.engine import ParamsRef

log = logging.getLogger("gyre_jax.serving.engine")


class PagedSlots:
    # What this mixin uses of GyreEngine (engine.py sets them in __init__, the jitted device
    # functions in _build_jits from engine_state.device_fns), declared for the type checker.
    name: str
    max_len: int
    tokens_per_call: int
    params_ref: ParamsRef
    counters: dict[str, Any]
    _pool: PagePool | None  # None: a contiguous cache (only _grow_pages, _free_pages, kv_stats run then; they check)
    _prefix_pages: PrefixPages | None  # None exactly when _pool is
    _pending_pages: dict[str, tuple[np.ndarray, PrefillInput | None]]
    _waiting: collections.deque[tuple[Prefix, int]]
    _host_len: np.ndarray
    _host_live: np.ndarray
    _gather: Callable[..., tuple[Any, Any]]
    _set_table: Callable[..., DecodeState]
    _stop_slot: Callable[..., DecodeState]

    _prefill: Callable[[Any, PrefillInput], Prefix]  # GyreEngine's methods, engine.py
    _prefix_out: Callable[[Any, Any, PrefillInput, int], Prefix]
    _insert_now: Callable[..., DecodeState]
    _fail: Callable[[str, str], None]
    _wake: Callable[[], None]

    def _prefill_paged(self, params, inp: PrefillInput) -> Prefix:
        """Paged cache, on JetStream's prefill thread, which must never wait for the generate
        thread (in interleaved mode that thread waits for this one while requests are queued).
        A prompt that starts with cached full pages (PrefixPages) is computed at admission, on
        the generate thread, which owns the pool; any other is prefilled here as usual."""
        assert self._prefix_pages is not None  # GyreEngine.prefill calls this only for a paged cache
        rid, tokens = inp.request_id, np.asarray(inp.tokens, np.int32)
        # Only a look: a waiting call holds no pages (it could block the calls ahead of it).
        if inp.kv is None and self._prefix_pages.cached_pages(tokens):
            self._pending_pages[rid] = (tokens, inp)
            return self._prefix_out(None, None, inp, len(tokens))
        self._pending_pages[rid] = (tokens, None)
        return self._prefill(params, inp)

    def _grow_pages(self, ds: DecodeState) -> DecodeState:
        """Before a decode call: pages for the tokens it may write (tokens_per_call per live slot),
        then the device's page table if anything changed."""
        if self._pool is None:
            return ds
        k = self.tokens_per_call
        for s in np.flatnonzero(self._host_live):
            self._pool.grow(int(s), int(min(self._host_len[s] + k, self.max_len)))
            self._host_len[s] = min(self._host_len[s] + k, self.max_len - 1)
        if self._pool.dirty:
            self._pool.dirty = False
            ds = self._set_table(ds, self._pool.table.copy())
        return ds

    def _admit_waiting(self, ds: DecodeState) -> DecodeState:
        """Insert waiting calls, oldest first, while pages for their prompt and all they may still
        generate are free (cached prefixes nobody maps are dropped to make room). A waiting call
        keeps its slot as a held one (no tokens, never expires), so JetStream does not reuse it."""
        while self._waiting:
            assert self._pool is not None and self._prefix_pages is not None  # only a paged engine queues calls
            prefix, slot = self._waiting[0]
            rid = prefix.request_id
            tokens, inp = self._pending_pages[rid]
            n = int(prefix.scalars_i[0])
            remaining = max(0, int(prefix.scalars_i[3]) - int(prefix.scalars_i[2]))
            total = pages_for(min(n + 1 + remaining, self.max_len), self._pool.page_size)
            if total > self._pool.usable_pages:
                self._waiting.popleft()
                del self._pending_pages[rid]
                self._fail(rid, f"{n} tokens + {remaining} to generate need {total} pages of "
                                f"{self._pool.page_size} tokens; the engine's pool has {self._pool.usable_pages}")
                ds = self._stop_slot(ds, np.int32(slot))
                continue
            # Cached pages of its prompt are mapped, not stored again, even when the prompt was already
            # computed (prefills run ahead of admission, so a rollout's calls often all miss at prefill).
            shared = self._prefix_pages.lookup(tokens)
            if not self._pool.reserve(rid, total - len(shared)):
                self._pool.release_pages(shared)
                if self._prefix_pages.evict(total - len(shared) - self._pool.available()):
                    continue
                return ds
            self._waiting.popleft()
            del self._pending_pages[rid]
            try:
                if inp is not None and len(shared):  # its cached prefix pages, gathered, then only the rest computed
                    pad = np.zeros((self._pool.pages_per_slot if len(shared) > self._pool.pages_per_slot // 2
                                    else 1 << (len(shared) - 1).bit_length(),), np.int32)
                    pad[: len(shared)] = shared
                    k, v = self._gather(ds, pad)
                    inp.kv = KVBlock(k, v, len(shared) * self._pool.page_size)
                if inp is not None:  # computed here (its cached pages may have gone meanwhile: then all of it)
                    prefix = self._prefill(self.params_ref.value, inp)
                first = self._pool.bind(rid, slot, tokens=n, shared_pages=shared)
                self.counters["shared_page_tokens"] += first  # tokens on pages it shares, stored once
                ds = self._insert_now(ds, prefix, slot, (self._pool.table[slot].copy(), np.int32(first)))
                self._prefix_pages.register(tokens[:n], self._pool.table[slot])  # for the next call with it
            except Exception as e:  # noqa: BLE001
                log.exception("%s: admission of %s failed", self.name, rid)
                self._pool.unreserve(rid)
                self._fail(rid, f"prefill failed: {type(e).__name__}: {e}")
                ds = self._stop_slot(ds, np.int32(slot))
            finally:
                self._pool.release_pages(shared)  # the slot holds them now (or nobody does)
        return ds

    def _keep_sequence_pages(self, tokens: np.ndarray, slot: int, length: int) -> None:
        """A finished call's full pages, prompt and generated tokens alike, into the prefix cache
        (keyed by the tokens they hold), so the rollout's next call, which re-sends this answer,
        maps them: a conversation's pages are computed and stored once, however many turns."""
        if length > tokens.shape[0]:  # not the sequence the slot holds: keep nothing
            return
        assert self._pool is not None and self._prefix_pages is not None  # called only for a paged cache
        self._prefix_pages.register(tokens[:length], self._pool.table[slot])

    def _waiting_slot(self, slot: int) -> tuple[int, Prefix] | None:
        """(index in the queue, prefix) of the call waiting for pages in ``slot``, if one is."""
        for i, (prefix, s) in enumerate(self._waiting):
            if s == slot:
                return i, prefix
        return None

    def _drop_waiting(self) -> None:
        while self._waiting:
            prefix, _ = self._waiting.popleft()
            self._pending_pages.pop(prefix.request_id, None)

    def _free_pages(self, slot: int) -> None:
        self._host_live[slot] = False
        if self._pool is None or not self._pool.owned[slot]:
            return
        self._pool.free_slot(slot)
        self._wake()  # a prefill may be waiting for pages

    def kv_stats(self) -> dict[str, int]:
        """Pages in use / free / promised (paged cache), and the live tokens they hold."""
        if self._pool is None or self._prefix_pages is None:
            return {}
        out = self._pool.stats()
        out["page_size"] = self._pool.page_size
        out["prefix_cache_pages"] = len(self._prefix_pages)
        return out

