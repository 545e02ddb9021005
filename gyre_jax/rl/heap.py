"""Give freed heap back to the OS (glibc's ``malloc_trim``) when the RL process holds much of it.

Why: an RL process frees hundreds of MB (the SFT warm start's batches and compiles, then each step's packed
rows, host copies and records), and glibc keeps freed chunks in its arenas: the run's RSS sat 200-600 MB
above what it used (issue 33), which on a shared host looks like a leak and counts against memory limits.
``malloc_trim(0)`` returns the free pages of every arena (``madvise(DONTNEED)``), taking each arena's lock
in turn.

Not after every step: measured on the demo (Dec 4, load ~18 on 2 cores; docs/design.md "Memory"), a trim
after each step took 180-320 ms of the loop's thread against steps of 6-17 s (1.5-3%, over the 1% we allow
for it) and gave back 50-70 MB each time. ``HeapTrimmer`` trims at the first step (the warm start's
garbage: 1,678 -> 873 MB in 1.0 s) and then whenever RSS has grown ``threshold_mb`` past what the last trim
left, so the heap held back stays under that bound at a cost of one trim per several steps. Metrics per step:
``mem/rss_mb``; at a trim also ``mem/rss_trimmed_mb`` and ``mem/trim_ms``. Not glibc (musl, macOS): no trim,
the RSS still reported where /proc has it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import platform
import time

_TRIM = None
if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
    try:
        _TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        _TRIM.argtypes, _TRIM.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):  # no malloc_trim in this libc: nothing to trim with
        _TRIM = None


def rss_mb() -> float | None:
    """This process's resident set (VmRSS), or None where /proc does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class HeapTrimmer:
    """``after_step()`` once per recorded step, on the loop's thread (see the module docstring)."""

    def __init__(self, threshold_mb: float = 256.0):
        self.threshold_mb = threshold_mb
        self._last: float | None = None  # RSS the last trim left; None: no trim yet

    def after_step(self) -> dict[str, float]:
        before = rss_mb()
        out: dict[str, float] = {} if before is None else {"mem/rss_mb": round(before, 1)}
        if _TRIM is None or (self._last is not None and (before is None or before - self._last < self.threshold_mb)):
            return out
        t0 = time.perf_counter()
        _TRIM(0)
        out["mem/trim_ms"] = round(1e3 * (time.perf_counter() - t0), 2)
        after = rss_mb()
        self._last = after if after is not None else 0.0
        if after is not None:
            out["mem/rss_trimmed_mb"] = round(after, 1)
        return out
