"""The host page pool: admission by free pages, pages for live tokens only, shared prefix pages
counted once and freed by their last holder."""

import numpy as np
import pytest

from gyre_jax.serving.pages import PagePool


def test_admission_growth_and_free():
    pool = PagePool(num_pages=9, page_size=4, slots=4, max_len=16)  # 8 usable pages
    assert pool.reserve("a", 3)  # 10 tokens now + 2 to come
    assert pool.reserve("b", 4)
    assert not pool.reserve("c", 2)  # 1 page left unpromised
    assert pool.bind("a", 0, tokens=10) == 0
    assert pool.owned[0] == 3 and pool.pages_in_use() == 3  # pages for live tokens only
    pool.bind("b", 1, tokens=5)
    assert pool.owned[1] == 2 and pool.pages_in_use() == 5  # b's other 2 pages stay promised
    assert pool.available() == 1
    pool.grow(1, 12)
    assert pool.owned[1] == 3 and pool.available() == 1  # growth drew on b's reservation
    assert len(set(pool.table[0, :3]) | set(pool.table[1, :3])) == 6  # no page given twice
    assert 0 not in pool.table[0, :3]  # the trash page is never handed out
    pool.free_slot(0)
    assert pool.pages_in_use() == 3 and pool.available() == 4 and (pool.table[0] == 0).all()
    assert pool.reserve("c", 4)
    assert pool.dirty


def test_shared_prefix_pages_counted_once_and_freed_by_last_holder():
    pool = PagePool(num_pages=17, page_size=4, slots=3, max_len=32)
    assert pool.reserve("a", 4)
    pool.bind("a", 0, tokens=14)  # pages for 14 tokens: 3 full + 1 partial
    cached = pool.retain(0, 14)  # the prefix cache keeps the 3 full pages
    assert cached.tolist() == pool.table[0, :3].tolist()
    pool.free_slot(0)
    assert pool.pages_in_use() == 3  # only the cached pages survive the call
    assert pool.reserve("b", 2) and pool.reserve("c", 2)
    # Two calls of the rollout reuse the cached prefix: each writes from token 12 on.
    assert pool.bind("b", 1, tokens=15, shared_pages=cached) == 12
    assert pool.bind("c", 2, tokens=13, shared_pages=cached) == 12
    assert pool.pages_in_use() == 3 + 2  # shared pages once, plus one private page each
    assert pool.table[1, 3] != pool.table[2, 3]
    pool.release_pages(cached)  # the cache evicts the entry: the calls still hold the pages
    pool.free_slot(1)
    assert pool.pages_in_use() == 4
    pool.free_slot(2)
    assert pool.pages_in_use() == 0 and pool.available() == 16
    with pytest.raises(RuntimeError, match="released more often than held"):
        pool.release_pages(cached)


def test_a_call_that_can_never_fit_is_named():
    pool = PagePool(num_pages=5, page_size=4, slots=2, max_len=16)
    with pytest.raises(ValueError, match="can never fit the pool of 4 pages"):
        pool.reserve("big", 5)
    with pytest.raises(ValueError, match="max_len a multiple of page_size"):
        PagePool(num_pages=5, page_size=4, slots=2, max_len=10)
    assert np.all(pool.refcount == 0)
