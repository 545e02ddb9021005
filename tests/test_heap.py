"""rl/heap.py: the first step trims freed heap back to the OS, later steps only once RSS grew past the bound."""
import gc

import pytest

from gyre_jax.rl import heap


@pytest.mark.skipif(heap._TRIM is None, reason="malloc_trim is glibc's")
def test_the_trimmer_gives_freed_heap_back_and_then_waits_for_growth():
    # Earlier tests leave cycles holding freed-to-be heap; a collection triggered by this test's own
    # allocations would free them between the trims and let `kept` reuse that memory without growing RSS
    # (CI, stop 41). Collect them first and keep the collector out of the measured window.
    gc.collect()
    gc.disable()
    try:
        _trim_then_wait_for_growth()
    finally:
        gc.enable()


def _trim_then_wait_for_growth():
    trimmer = heap.HeapTrimmer(threshold_mb=64)
    garbage = [bytearray(2000) for _ in range(100_000)]  # ~200 MB of small chunks
    pins = garbage[::32]  # one in 32 stays: the freed chunks sit between live ones, which glibc keeps
    del garbage
    first = trimmer.after_step()
    assert first["mem/rss_mb"] - first["mem/rss_trimmed_mb"] > 100, first
    assert "mem/trim_ms" not in trimmer.after_step()  # nothing grew: no trim
    kept = [bytearray(2000) for _ in range(50_000)]  # ~100 MB more, still in use
    assert heap.rss_mb() - first["mem/rss_trimmed_mb"] > 64  # the premise: RSS did grow past the bound
    grown = trimmer.after_step()
    assert "mem/trim_ms" in grown and grown["mem/rss_trimmed_mb"] >= grown["mem/rss_mb"] - 16, grown
    del kept, pins
