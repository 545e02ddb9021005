"""GyreEngine with kv_cache="paged": the same outputs as the full-forward reference (as the
contiguous engine gives), pages for live tokens only, all returned when calls end, and
admission by free pages rather than by slots x max_len."""
from __future__ import annotations

import numpy as np
import pytest

from gyre_jax.serving.engine import GyreEngine
from gyre_jax.testing.tiny_serving_model import CFG
from tests.test_serving_engine import (  # noqa: F401
    MAX_LEN,
    Runner,
    params,
    pinput,
    prompts,
    ref_greedy,
    ref_logits,
    turn_two_on_exported_kv,
)

G = 8  # tokens per page: small, so every call spans several pages and crosses page boundaries


@pytest.fixture(scope="module")
def engine(params):  # noqa: F811
    # 16 slots but 48 pages of 8 tokens (384 tokens): a contiguous cache would hold 16 x 256.
    return GyreEngine(CFG, params, max_slots=16, max_len=MAX_LEN, kv_cache="paged", page_size=G, kv_pages=49)


def _release(r, engine, *rids):
    futs = [engine.release(rid, snapshot=False) for rid in rids]
    r.ds = engine._service(r.ds)
    for f in futs:
        assert f is None or f.result(timeout=30)


def test_paged_continuous_batching_equals_reference_and_frees_every_page(engine, ref_logits):  # noqa: F811
    ps = prompts(4)
    r = Runner(engine)
    r.insert(0, pinput("a", ps[0], max_tokens=12, temperature=0.0))
    r.insert(5, pinput("b", ps[1], max_tokens=12, temperature=0.0))
    live = sum(len(p) - 1 for p in ps[:2])
    assert engine.kv_stats()["pages_in_use"] == sum(-(-(len(p) - 1) // G) for p in ps[:2])  # live tokens only
    r.step(4)
    r.insert(9, pinput("c", ps[2], max_tokens=9, temperature=0.0))  # joins mid-flight
    r.step(3)
    r.insert(1, pinput("d", ps[3], max_tokens=5, temperature=0.7, seed=3))
    r.step(12)
    assert not r.live - {1}
    for slot, p, n in ((0, ps[0], 12), (5, ps[1], 12), (9, ps[2], 9)):
        assert [t for t, _ in r.out[slot]] == ref_greedy(ref_logits, p, n)
    live = sum(len(p) - 1 for p in ps) + 12 + 12 + 9 + 5
    assert engine.kv_stats()["pages_in_use"] * G < live + 4 * G  # at most one partial page per call
    _release(r, engine, "a", "b", "c", "d")
    st = engine.kv_stats()  # what is left: the prompts' full pages, held by the prefix cache alone
    assert st["pages_in_use"] == st["prefix_cache_pages"] == sum((len(p) - 1) // G for p in ps)
    assert st["pages_free"] + st["pages_in_use"] == st["pages_total"] == 48 and st["pages_reserved"] == 0
    engine._prefix_pages.clear()
    assert engine.kv_stats()["pages_in_use"] == 0


def test_paged_prefix_export_and_reuse(engine, ref_logits):  # noqa: F811
    """test_serving_engine's turn 2 on turn 1's exported KV, on pages: between the turns only
    the prompt's full pages stay, held by the prefix cache; after turn 2 nothing else does."""

    def only_the_prefix_cache_holds_pages(p1):
        assert engine.kv_stats()["pages_in_use"] == engine.kv_stats()["prefix_cache_pages"] == (len(p1) - 1) // G

    r = turn_two_on_exported_kv(engine, ref_logits, after_release=only_the_prefix_cache_holds_pages)
    _release(r, engine, "t2")
    assert engine.kv_stats()["pages_in_use"] == engine.kv_stats()["prefix_cache_pages"]


def test_admission_waits_for_pages_not_slots(params, ref_logits):  # noqa: F811
    """Two calls each needing 5 of the pool's 6 pages: the second gets a slot but waits (no
    tokens) until the first call's pages come back, then decodes correctly."""
    eng = GyreEngine(CFG, params, max_slots=4, max_len=MAX_LEN, kv_cache="paged", page_size=G, kv_pages=7)
    p1, p2 = (np.arange(1, 30, dtype=np.int32) * k % 256 for k in (3, 5))  # 29 tokens + 10 new = 5 pages
    r = Runner(eng)
    r.insert(0, pinput("x", p1, max_tokens=10, temperature=0.0))
    r.insert(1, pinput("y", p2, max_tokens=10, temperature=0.0))
    assert eng.counters["page_waits"] == 1 and eng.kv_stats()["pages_in_use"] == 4  # x's prompt only
    r.step(11)
    assert [tok for tok, _ in r.out[0]] == ref_greedy(ref_logits, p1, 10)
    assert r.out[1] == [] and 1 in r.held  # y kept its slot (held markers) and made no token
    _release(r, eng, "x")  # the generate thread frees x's pages; its next call admits y
    r.held.discard(1)
    r.live.add(1)
    r.step(11)
    assert [tok for tok, _ in r.out[1]] == ref_greedy(ref_logits, p2, 10)
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        GyreEngine(CFG, params, max_slots=4, max_len=MAX_LEN, kv_cache="vllm")
    with pytest.raises(ValueError, match="must be a multiple of page_size=7"):
        GyreEngine(CFG, params, max_slots=4, max_len=MAX_LEN, kv_cache="paged", page_size=7)


def test_calls_with_a_common_prefix_share_its_pages(engine, ref_logits):  # noqa: F811
    """Two calls of one rollout open with the same 43 tokens: the second maps the first one's 5
    full prefix pages (counted once, not recomputed) and decodes exactly as if alone."""
    rs = np.random.RandomState(7)
    common = rs.randint(0, 256, size=43).astype(np.int32)
    pa = np.concatenate([common, rs.randint(0, 256, size=6).astype(np.int32)])
    pb = np.concatenate([common, rs.randint(0, 256, size=9).astype(np.int32)])
    r = Runner(engine)
    r.insert(2, pinput("sa", pa, max_tokens=6, temperature=0.0))
    r.step(1)  # a's prompt pages are written and cached
    before = engine.counters["prefill_tokens"]
    in_use_a = engine.kv_stats()["pages_in_use"]
    r.insert(3, pinput("sb", pb, max_tokens=6, temperature=0.0))
    assert engine.counters["prefill_tokens"] - before == len(pb) - 1 - 40  # 5 pages of 8 were shared
    # b's own pages: its 51 prompt tokens minus the 40 shared (2 pages); the 5 shared counted once
    assert engine.kv_stats()["pages_in_use"] == in_use_a + 2
    r.step(8)
    assert [t for t, _ in r.out[2]] == ref_greedy(ref_logits, pa, 6)
    assert [t for t, _ in r.out[3]] == ref_greedy(ref_logits, pb, 6)
    _release(r, engine, "sa", "sb")
    st = engine.kv_stats()
    assert st["pages_in_use"] == st["prefix_cache_pages"] and st["pages_reserved"] == 0  # only the cache's own
    # A fresh decode state is a fresh pool: the cached pages must not be mapped into it.
    r2 = Runner(engine)
    assert engine.kv_stats()["prefix_cache_pages"] == 0
    r2.insert(2, pinput("sa2", pa, max_tokens=6, temperature=0.0))
    r2.step(7)
    assert [t for t, _ in r2.out[2]] == ref_greedy(ref_logits, pa, 6)
    _release(r2, engine, "sa2")


def test_answer_pages_enter_the_prefix_cache(engine, ref_logits):  # noqa: F811
    """A rollout's next call re-sends the previous answer: released with its tokens, a call leaves
    the full pages of its answer (not only of its prompt) in the prefix cache, so the next call
    maps them, computes only what follows, and decodes exactly as if alone."""
    p1 = prompts(1, seed=9)[0]
    r = Runner(engine)  # a fresh state: a fresh pool and prefix cache
    r.insert(4, pinput("u1", p1, max_tokens=20, temperature=0.0))
    r.step(21)
    out1 = [t for t, _ in r.out[4]]
    assert out1 == ref_greedy(ref_logits, p1, 20)
    seq1 = np.concatenate([p1, out1]).astype(np.int32)
    fut = engine.release("u1", snapshot=False, tokens=seq1)
    r.ds = engine._service(r.ds)
    assert fut.result(timeout=30)
    kept = (len(seq1) - 1) // G  # the slot computed every token but the answer's last
    st = engine.kv_stats()
    assert kept > (len(p1) - 1) // G and st["pages_in_use"] == st["prefix_cache_pages"] == kept
    p2 = np.concatenate([seq1, np.arange(50, 60, dtype=np.int32)])
    prefilled, shared = engine.counters["prefill_tokens"], engine.counters["shared_page_tokens"]
    r.insert(5, pinput("u2", p2, max_tokens=6, temperature=0.0))
    assert engine.counters["shared_page_tokens"] - shared == kept * G
    assert engine.counters["prefill_tokens"] - prefilled == len(p2) - 1 - kept * G
    r.step(7)
    assert [t for t, _ in r.out[5]] == ref_greedy(ref_logits, p2, 6)
    _release(r, engine, "u2")
    st = engine.kv_stats()
    assert st["pages_in_use"] == st["prefix_cache_pages"] and st["pages_reserved"] == 0
