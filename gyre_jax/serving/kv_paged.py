"""The paged KV layout of a GyreEngine (kv_cache="paged"): a PagePool (serving/pages.py) beside
the decode state, admission by pages, and a prefix cache of full pages.

Threads: JetStream's prefill thread must never wait for the generate thread (in interleaved
mode that thread waits for the prefill thread while requests are queued), so everything that
touches the pool's pages runs on the generate thread:
  * ``prefill`` (prefill thread) prefills as usual, except that a prompt whose leading full
    pages are cached is left for admission, where only its rest is computed;
  * ``insert`` queues the call as waiting (its slot held: no tokens, never expiring) and
    ``admit`` admits waiting calls, oldest first, while the pages for their prompt and all
    they may still generate are free, mapping their prompt's cached pages;
  * ``grow`` hands out pages just before the decode call that writes them;
  * ``free`` returns a finished call's pages (its prompt's full pages stay in the prefix
    cache while nobody needs the room, and, when the engine's ``release`` is given the call's
    tokens, the full pages of its answer too: ``keep_sequence``).
"""
from __future__ import annotations

import collections
import logging

import jax.numpy as jnp
import numpy as np

from gyre_jax.serving.engine_state import DecodeState, KVBlock, PrefillInput, Prefix
from gyre_jax.serving.kv_layout import EngineHooks
from gyre_jax.serving.pages import PagePool, PrefixPages, pages_for

log = logging.getLogger("gyre_jax.serving.engine")


class PagedKV:
    """KVLayout over a pool of ``num_pages`` pages of ``page_size`` tokens (page 0 is never used)."""

    kind = "paged"
    keeps_sequences = True

    def __init__(self, hooks: EngineHooks, *, num_pages: int, page_size: int, max_slots: int, max_len: int,
                 tokens_per_call: int):
        self.hooks, self.max_len, self.tokens_per_call = hooks, max_len, tokens_per_call
        self.pool = PagePool(num_pages, page_size, max_slots, max_len)
        self.prefix_pages: PrefixPages | None = PrefixPages(self.pool)
        # Per request between prefill and insert: its prompt tokens, and its input when admission computes it.
        self.pending: dict[str, tuple[np.ndarray, PrefillInput | None]] = {}
        self.waiting: collections.deque[tuple[Prefix, int]] = collections.deque()  # inserted, waiting for pages
        # Host bound on each slot's length (pages are handed out before the decode call that writes
        # them) and whether the slot may still be generating.
        self.host_len = np.zeros((max_slots,), np.int64)
        self.host_live = np.zeros((max_slots,), bool)

    @property
    def cache(self) -> PrefixPages:
        assert self.prefix_pages is not None  # set in __init__; Optional only to match the KVLayout protocol
        return self.prefix_pages

    def prefill(self, params, inp: PrefillInput) -> Prefix:
        """On JetStream's prefill thread, which must never wait for the generate thread. A prompt
        that starts with cached full pages (PrefixPages) is computed at admission, on the generate
        thread, which owns the pool; any other is prefilled here as usual."""
        rid, tokens = inp.request_id, np.asarray(inp.tokens, np.int32)
        # Only a look: a waiting call holds no pages (it could block the calls ahead of it).
        if inp.kv is None and self.cache.cached_pages(tokens):
            self.pending[rid] = (tokens, inp)
            return self.hooks.prefix_out(None, None, inp, len(tokens))
        self.pending[rid] = (tokens, None)
        return self.hooks.prefill(params, inp)

    def insert(self, ds: DecodeState, prefix: Prefix, slot: int, *, cancelled: bool) -> DecodeState:
        rid = prefix.request_id
        pending = self.pending.get(rid)
        deferred_compute = pending is not None and pending[1] is not None
        if self.pool.owned[slot]:  # left by a call JetStream freed on its own
            self.free(slot)
        if (prefix.k is None and not deferred_compute) or cancelled:
            self.pending.pop(rid, None)
            return self.hooks.stop_slot(ds, np.int32(slot))
        # Admitted when its pages are free (admit). JetStream deletes a prefix's arrays once insert
        # returns (k and v are None together).
        if prefix.k is not None and prefix.v is not None:
            prefix = prefix.replace(k=jnp.copy(prefix.k), v=jnp.copy(prefix.v))
        self.waiting.append((prefix, slot))
        ds = self.admit(self.hooks.hold_slot(ds, np.int32(slot), prefix.scalars_i[2]))
        if self.waiting and self.waiting[-1][1] == slot:
            self.hooks.counters["page_waits"] += 1  # admission by pages: it waits, though it has a slot
        return ds

    def grow(self, ds: DecodeState) -> DecodeState:
        """Before a decode call: pages for the tokens it may write (tokens_per_call per live slot),
        then the device's page table if anything changed."""
        k = self.tokens_per_call
        for s in np.flatnonzero(self.host_live):
            self.pool.grow(int(s), int(min(self.host_len[s] + k, self.max_len)))
            self.host_len[s] = min(self.host_len[s] + k, self.max_len - 1)
        if self.pool.dirty:
            self.pool.dirty = False
            ds = self.hooks.set_table(ds, self.pool.table.copy())
        return ds

    def admit(self, ds: DecodeState) -> DecodeState:
        """Insert waiting calls, oldest first, while pages for their prompt and all they may still
        generate are free (cached prefixes nobody maps are dropped to make room). A waiting call
        keeps its slot as a held one (no tokens, never expires), so JetStream does not reuse it."""
        while self.waiting:
            prefix, slot = self.waiting[0]
            total = self._pages_needed(prefix)
            if total > self.pool.usable_pages:
                ds = self._refuse(ds, prefix, slot, total)
                continue
            # Cached pages of its prompt are mapped, not stored again, even when the prompt was already
            # computed (prefills run ahead of admission, so a rollout's calls often all miss at prefill).
            tokens, inp = self.pending[prefix.request_id]
            shared = self.cache.lookup(tokens)
            if not self.pool.reserve(prefix.request_id, total - len(shared)):
                self.pool.release_pages(shared)
                if self.cache.evict(total - len(shared) - self.pool.available()):
                    continue
                return ds
            self.waiting.popleft()
            del self.pending[prefix.request_id]
            ds = self._admit_one(ds, prefix, slot, tokens, inp, shared)
        return ds

    def _pages_needed(self, prefix: Prefix) -> int:
        """Pages for a call's prompt and all it may still generate."""
        n = int(prefix.scalars_i[0])
        remaining = max(0, int(prefix.scalars_i[3]) - int(prefix.scalars_i[2]))
        return pages_for(min(n + 1 + remaining, self.max_len), self.pool.page_size)

    def _refuse(self, ds: DecodeState, prefix: Prefix, slot: int, total: int) -> DecodeState:
        """A call that needs more pages than the whole pool: failed, its slot stopped."""
        rid, n = prefix.request_id, int(prefix.scalars_i[0])
        remaining = max(0, int(prefix.scalars_i[3]) - int(prefix.scalars_i[2]))
        self.waiting.popleft()
        del self.pending[rid]
        self.hooks.fail(rid, f"{n} tokens + {remaining} to generate need {total} pages of "
                             f"{self.pool.page_size} tokens; the engine's pool has {self.pool.usable_pages}")
        return self.hooks.stop_slot(ds, np.int32(slot))

    def _admit_one(self, ds: DecodeState, prefix: Prefix, slot: int, tokens: np.ndarray, inp: PrefillInput | None,
                   shared: np.ndarray) -> DecodeState:
        """Into its slot, on its reserved pages: its prompt computed now if prefill left it (only what
        its cached pages do not hold), the prompt's full pages registered for the next call."""
        rid, n = prefix.request_id, int(prefix.scalars_i[0])
        try:
            if inp is not None and len(shared):  # its cached prefix pages, gathered, then only the rest computed
                pad = np.zeros((self.pool.pages_per_slot if len(shared) > self.pool.pages_per_slot // 2
                                else 1 << (len(shared) - 1).bit_length(),), np.int32)
                pad[: len(shared)] = shared
                k, v = self.hooks.gather(ds, pad)
                inp.kv = KVBlock(k, v, len(shared) * self.pool.page_size)
            if inp is not None:  # computed here (its cached pages may have gone meanwhile: then all of it)
                prefix = self.hooks.prefill(self.hooks.params(), inp)
            first = self.pool.bind(rid, slot, tokens=n, shared_pages=shared)
            self.hooks.counters["shared_page_tokens"] += first  # tokens on pages it shares, stored once
            self.host_len[slot], self.host_live[slot] = n, True
            ds = self.hooks.insert_now(ds, prefix, slot, (self.pool.table[slot].copy(), np.int32(first)))
            self.cache.register(tokens[:n], self.pool.table[slot])  # for the next call with it
        except Exception as e:  # noqa: BLE001
            log.exception("%s: admission of %s failed", self.hooks.name, rid)
            self.pool.unreserve(rid)
            self.hooks.fail(rid, f"prefill failed: {type(e).__name__}: {e}")
            ds = self.hooks.stop_slot(ds, np.int32(slot))
        finally:
            self.pool.release_pages(shared)  # the slot holds them now (or nobody does)
        return ds

    def track(self, active_S: np.ndarray, len_S: np.ndarray | None = None) -> None:
        if len_S is None:
            self.host_live &= active_S  # a finished slot grows no more pages
        else:
            self.host_len[:] = len_S
            self.host_live[:] = active_S

    def withdraw(self, slot: int) -> tuple[Prefix, PrefillInput | None] | None:
        for i, (prefix, s) in enumerate(self.waiting):
            if s == slot:
                del self.waiting[i]
                _, inp = self.pending.pop(prefix.request_id, (None, None))
                return prefix, inp
        return None

    def keep_sequence(self, tokens: np.ndarray, slot: int, length: int) -> None:
        """A finished call's full pages, prompt and generated tokens alike, into the prefix cache
        (keyed by the tokens they hold), so the rollout's next call, which re-sends this answer,
        maps them: a conversation's pages are computed and stored once, however many turns."""
        if length > tokens.shape[0]:  # not the sequence the slot holds: keep nothing
            return
        self.cache.register(tokens[:length], self.pool.table[slot])

    def free(self, slot: int) -> None:
        self.host_live[slot] = False
        if not self.pool.owned[slot]:
            return
        self.pool.free_slot(slot)
        self.hooks.wake()  # a prefill may be waiting for pages

    def forget_cached(self) -> None:
        self.cache.clear()

    def reset(self) -> None:
        for s in range(self.host_live.shape[0]):
            self.free(s)
        while self.waiting:
            prefix, _ = self.waiting.popleft()
            self.pending.pop(prefix.request_id, None)
        self.cache.clear()

    def stats(self) -> dict[str, int]:
        """Pages in use / free / promised, and the live tokens they hold."""
        out = self.pool.stats()
        out["page_size"] = self.pool.page_size
        out["prefix_cache_pages"] = len(self.cache)
        return out
