"""Host side of the paged KV cache: a free list, refcounts and one page table per slot (numpy).

The device holds a pool of ``num_pages`` fixed-size pages (model/paged.py); this object
decides which slot's token lives on which page. Page 0 is the trash page and is never
handed out. Rules:

* admission by pages: a call is admitted when the pages it may need (its tokens now plus
  the tokens it may still generate) are free beyond what admitted calls have reserved;
  slots are cheap (a page-table row), so the engine can have many more slots than
  ``slots x max_len`` memory would allow;
* pages are handed to live tokens only: a slot owns pages for the tokens it holds (plus
  the decode steps already dispatched), taken from its reservation as it grows;
* shared prefix pages: a full page can be held by several slots and by the prefix cache
  (refcounted, counted once); a slot never writes a page it shares (the first page a
  slot may write is the one after its shared prefix: ``writable_from``);
* a slot's pages are returned when its call ends (``free_slot``); a page goes back to
  the free list when its last holder lets go.

Everything here runs on the thread that owns the engine's decode state (JetStream's
generate thread) except ``reserve``/``unreserve``, which the prefill thread calls; one
lock guards the counts.
"""
from __future__ import annotations

import hashlib
import threading

import numpy as np

TRASH_PAGE = 0


def pages_for(tokens: int, page_size: int) -> int:
    return -(-int(tokens) // int(page_size))


class PagePool:
    def __init__(self, num_pages: int, page_size: int, slots: int, max_len: int):
        if num_pages < 2 or page_size < 1 or slots < 1 or max_len < page_size or max_len % page_size:
            raise ValueError(f"PagePool: need num_pages >= 2 (page 0 is trash), page_size >= 1, slots >= 1 and "
                             f"max_len a multiple of page_size; got {num_pages}, {page_size}, {slots}, {max_len}")
        self.num_pages, self.page_size, self.slots, self.max_len = int(num_pages), int(page_size), int(slots), int(max_len)
        self.pages_per_slot = max_len // page_size
        self.table = np.zeros((slots, self.pages_per_slot), np.int32)  # what the device's page table must say
        self.owned = np.zeros((slots,), np.int32)  # table entries in use per slot
        self.shared = np.zeros((slots,), np.int32)  # leading entries shared with others (read-only to the slot)
        self.refcount = np.zeros((num_pages,), np.int32)
        self._free = list(range(num_pages - 1, 0, -1))  # a stack: the lowest ids go out first
        self._reserved: dict[str, int] = {}  # request id -> pages promised, not yet bound to a slot
        self._slot_reserve = np.zeros((slots,), np.int32)  # pages promised to a slot, not yet allocated
        self.dirty = False  # the device's table is stale
        self._lock = threading.Lock()

    # ---- admission (prefill thread) -----------------------------------------------
    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1

    def available(self) -> int:
        """Free pages not promised to an admitted call."""
        with self._lock:
            return len(self._free) - sum(self._reserved.values()) - int(self._slot_reserve.sum())

    def reserve(self, request_id: str, pages: int) -> bool:
        """Promise ``pages`` to a call about to be inserted; False if they are not free now."""
        if pages > self.usable_pages:
            raise ValueError(f"PagePool: a call needing {pages} pages of {self.page_size} tokens can never fit the "
                             f"pool of {self.usable_pages} pages; raise the KV budget or lower max_tokens")
        with self._lock:
            free = len(self._free) - sum(self._reserved.values()) - int(self._slot_reserve.sum())
            if pages > free:
                return False
            self._reserved[request_id] = self._reserved.get(request_id, 0) + int(pages)
            return True

    def unreserve(self, request_id: str) -> None:
        with self._lock:
            self._reserved.pop(request_id, None)

    # ---- slots (the thread that owns the decode state) ------------------------------
    def bind(self, request_id: str, slot: int, tokens: int, shared_pages=()) -> int:
        """Give ``slot`` (freed before) the shared prefix pages, then pages for ``tokens`` tokens, from
        the call's reservation. Returns the first token position the slot may write."""
        if self.owned[slot]:
            raise RuntimeError(f"PagePool.bind: slot {slot} still holds {self.owned[slot]} pages")
        shared_pages = np.asarray(shared_pages, np.int32)
        with self._lock:
            promised = self._reserved.pop(request_id, 0)
            for p in shared_pages:
                self.refcount[p] += 1
            n = len(shared_pages)
            self.table[slot, :n] = shared_pages
            self.owned[slot] = self.shared[slot] = n
            self._slot_reserve[slot] = promised
        self.grow(slot, tokens)
        self.dirty = True
        return n * self.page_size

    def grow(self, slot: int, tokens: int) -> None:
        """Pages so that ``slot`` covers token positions 0..tokens-1 (capped at max_len). Draws on the
        slot's reservation first; past it (a host over-estimate of a finished call) only free pages."""
        need = min(pages_for(tokens, self.page_size), self.pages_per_slot)
        with self._lock:
            while self.owned[slot] < need:
                if self._slot_reserve[slot] > 0:
                    self._slot_reserve[slot] -= 1
                elif len(self._free) <= sum(self._reserved.values()) + int(self._slot_reserve.sum()):
                    return  # every free page is promised elsewhere: writes past here go to trash
                page = self._free.pop()
                self.refcount[page] = 1
                self.table[slot, self.owned[slot]] = page
                self.owned[slot] += 1
                self.dirty = True

    def free_slot(self, slot: int) -> None:
        """The call in ``slot`` ended: drop its pages (shared ones stay with their other holders)."""
        with self._lock:
            self._unref(self.table[slot, : self.owned[slot]])
            self.table[slot] = TRASH_PAGE
            self.owned[slot] = self.shared[slot] = 0
            self._slot_reserve[slot] = 0
            self.dirty = True

    def retain(self, slot: int, tokens: int) -> np.ndarray:
        """Hold the full pages of the slot's first ``tokens`` tokens for the prefix cache (refcount +1)."""
        n = min(int(tokens) // self.page_size, int(self.owned[slot]))
        pages = self.table[slot, :n].copy()
        with self._lock:
            self.refcount[pages] += 1
        return pages

    def retain_pages(self, pages) -> None:
        """One more holder of pages someone already holds (a call reusing a cached prefix)."""
        with self._lock:
            self.refcount[np.asarray(pages, np.int32)] += 1

    def release_pages(self, pages) -> None:
        """Drop a prefix cache entry's (or a call's) hold on ``pages``."""
        with self._lock:
            self._unref(np.asarray(pages, np.int32))

    def _unref(self, pages: np.ndarray) -> None:
        for p in pages.tolist():
            if p == TRASH_PAGE:
                continue
            if self.refcount[p] <= 0:
                raise RuntimeError(f"PagePool: page {p} released more often than held")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)

    # ---- accounting ----------------------------------------------------------------
    def pages_in_use(self) -> int:
        """Pages held by anyone (a page shared by many holders counts once)."""
        return int((self.refcount[1:] > 0).sum())

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"pages_in_use": self.pages_in_use(), "pages_free": len(self._free),
                    "pages_reserved": sum(self._reserved.values()) + int(self._slot_reserve.sum()),
                    "pages_total": self.usable_pages}


class PrefixPages:
    """Full pages of prompts already in the pool, found by their tokens (page-granular prefix cache).

    Page i of a sequence is keyed by a hash chained over tokens[0 : (i+1) * G], so a key names
    the whole prefix up to that page, not the page's tokens alone. The cache holds one
    reference on each page it lists (the pool's refcount), so a page outlives the call that
    wrote it and later calls with the same prefix (the calls of one rollout, the samples of
    one group) map it instead of computing and storing it again. Entries are dropped least
    recently used first when admission needs pages, and all at once when the weights change.
    """

    def __init__(self, pool: PagePool):
        self.pool = pool
        self._pages: dict[bytes, int] = {}  # insertion order = LRU order (a hit moves the key to the end)
        self._lock = threading.Lock()

    def keys(self, tokens: np.ndarray) -> list[bytes]:
        g, out, h = self.pool.page_size, [], b""
        toks = np.asarray(tokens, np.int32)
        for i in range(toks.shape[0] // g):
            h = hashlib.blake2b(h + toks[i * g:(i + 1) * g].tobytes(), digest_size=16).digest()
            out.append(h)
        return out

    def lookup(self, tokens: np.ndarray) -> np.ndarray:
        """Pages holding the longest cached full-page prefix of ``tokens``, held once more for the
        caller (``pool.release_pages`` them when done)."""
        pages = []
        with self._lock:
            for key in self.keys(tokens):
                page = self._pages.pop(key, None)
                if page is None:
                    break
                self._pages[key] = page  # most recently used
                pages.append(page)
            out = np.asarray(pages, np.int32)
            self.pool.retain_pages(out)
        return out

    def cached_pages(self, tokens: np.ndarray) -> int:
        """How many leading full pages of ``tokens`` are cached now (a look: nothing is held)."""
        n = 0
        with self._lock:
            for key in self.keys(tokens):
                if key not in self._pages:
                    break
                n += 1
        return n

    def register(self, tokens: np.ndarray, row: np.ndarray) -> None:
        """A slot's full prompt pages (row = its page-table row), for later calls to share."""
        with self._lock:
            for i, key in enumerate(self.keys(tokens)):
                if key not in self._pages:
                    self._pages[key] = int(row[i])
                    self.pool.retain_pages([int(row[i])])

    def evict(self, pages_wanted: int) -> int:
        """Drop least recently used entries only the cache still holds, until ``pages_wanted`` pages
        are freed (or none is left to drop). Returns the pages freed."""
        freed = 0
        with self._lock:
            for key in list(self._pages):
                if freed >= pages_wanted:
                    break
                page = self._pages[key]
                if self.pool.refcount[page] == 1:
                    del self._pages[key]
                    self.pool.release_pages([page])
                    freed += 1
        return freed

    def clear(self) -> None:
        with self._lock:
            pages = list(self._pages.values())
            self._pages.clear()
            self.pool.release_pages(pages)

    def __len__(self) -> int:
        return len(self._pages)
