"""The harness every script under tools/ shares: one argument parser with a ``--quick`` mode,
timing and medians, the machine's load, and one JSON header on each bench's final line.

A bench reads::

    bench = benchkit.Bench(__file__, __doc__, quick={"steps": 2, "repeats": 1})
    bench.parser.add_argument("--steps", type=int, default=48)
    args = bench.parse(argv)                     # --quick sets the fields above that were left at their default
    seconds = benchkit.best_of(lambda: work(args), args.repeats, warmup=1)
    bench.emit({"seconds": seconds}, sizes={"steps": args.steps})

and its last stdout line is ``{"bench": "bench_x", "commit": ..., "host": {...}, "load": {...},
"sizes": {...}, "quick": false, <the bench's own fields>}``. The header's fields come first and the
bench's own field names are unchanged, so readers of older lines still find them.

``--quick`` is a smoke run: tiny sizes, a few seconds, its numbers are not the benchmark's.
tests/test_tools.py runs every bench's ``--quick`` in the default suite, so none of them rots.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER_FIELDS = ("bench", "commit", "host", "load", "sizes", "quick")


# ---- timing ------------------------------------------------------------------------------
def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """(fn's result, wall seconds it took). Block on device work inside ``fn`` (jax.block_until_ready)."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


def samples(fn: Callable[[], Any], repeats: int, *, warmup: int = 0) -> list[float]:
    """Wall seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones (compiles, caches)."""
    for _ in range(warmup):
        fn()
    return [timed(fn)[1] for _ in range(repeats)]


def best_of(fn: Callable[[], Any], repeats: int, *, warmup: int = 0) -> float:
    """The fastest of ``repeats`` timed calls: the least disturbed run on a shared machine."""
    return min(samples(fn, repeats, warmup=warmup))


def median_of(fn: Callable[[], Any], repeats: int, *, warmup: int = 0) -> float:
    """The median of ``repeats`` timed calls."""
    return median(samples(fn, repeats, warmup=warmup))


def median(xs: Iterable[float]) -> float:
    """The median (the mean of the middle two for an even count); a clear error on no samples."""
    xs = list(xs)
    if not xs:
        raise ValueError("median of no samples")
    return float(statistics.median(xs))


class Stopwatch:
    """``with Stopwatch() as sw: ...`` then ``sw.s``: the seconds the block took (so far, inside it).
    ``Stopwatch.started()`` starts one without a block (a span across awaits or branches)."""

    def __init__(self) -> None:
        self.t0, self.end = time.perf_counter(), None

    @classmethod
    def started(cls) -> Stopwatch:
        return cls()

    def __enter__(self) -> Stopwatch:
        self.t0, self.end = time.perf_counter(), None
        return self

    def __exit__(self, *exc: object) -> None:
        self.end = time.perf_counter()

    @property
    def s(self) -> float:
        return (self.end if self.end is not None else time.perf_counter()) - self.t0


# ---- the machine -------------------------------------------------------------------------
def load() -> list[float]:
    """1, 5 and 15 minute load averages (runnable processes; compare with ``host.cpus``)."""
    return [round(x, 2) for x in os.getloadavg()]


def commit() -> str | None:
    """The checkout's commit, ``+dirty`` when files differ from it; None outside a git checkout."""
    def git(*a: str) -> str | None:
        try:
            p = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return p.stdout.strip() if p.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    if sha is None:
        return None
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return sha + ("+dirty" if dirty else "")


def host() -> dict[str, Any]:
    """Where it ran: host name, CPU count, OS, Python, and JAX's backend when the bench imported JAX."""
    out: dict[str, Any] = {"name": socket.gethostname(), "cpus": os.cpu_count(), "platform": platform.platform(),
                           "python": platform.python_version()}
    jax = sys.modules.get("jax")
    if jax is not None:
        try:
            devs = jax.devices()
            out.update(jax=jax.__version__, backend=jax.default_backend(), devices=len(devs),
                       device_kind=devs[0].device_kind)
        except Exception as e:  # a bench whose JAX failed still reports its numbers
            out["jax_error"] = f"{type(e).__name__}: {e}"
    return out


# ---- arguments and the final line ----------------------------------------------------------
def tool_parser(file: str, doc: str | None) -> argparse.ArgumentParser:
    """The parser every script under tools/ starts from: its file name as ``prog``, its docstring as the help."""
    return argparse.ArgumentParser(prog=os.path.basename(file), description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


class Bench:
    """One bench run: its parser (``--quick`` included), the load when it started, its final JSON line."""

    def __init__(self, file: str, doc: str | None, *, quick: dict[str, Any] | None = None,
                 quick_help: str | None = None, name: str | None = None):
        self.name = name or os.path.splitext(os.path.basename(file))[0]
        self.quick = dict(quick or {})
        self.parser = tool_parser(file, doc)
        shrunk = ", ".join(f"{k}={v}" for k, v in self.quick.items())
        self.parser.add_argument("--quick", action="store_true", help=quick_help or (
            "a smoke run of a few seconds" + (f" ({shrunk})" if shrunk else "") + "; its numbers are not the benchmark's"))
        self.args: argparse.Namespace | None = None
        self.t0 = time.perf_counter()
        self.load_before = load()

    def parse(self, argv: list[str] | None = None) -> argparse.Namespace:
        """Parse; with ``--quick``, each field of ``quick`` left at its default takes the quick value."""
        args = self.parser.parse_args(argv)
        if args.quick:
            for dest, value in self.quick.items():
                if getattr(args, dest) == self.parser.get_default(dest):
                    setattr(args, dest, value)
        self.args, self.t0, self.load_before = args, time.perf_counter(), load()
        return args

    def default_sizes(self) -> dict[str, Any]:
        """The run's settings: every parsed argument of a JSON scalar type (or list of them)."""
        scalar = (int, float, str, bool, type(None))
        return {k: v for k, v in vars(self.args or argparse.Namespace()).items()
                if isinstance(v, scalar) or (isinstance(v, (list, tuple)) and all(isinstance(x, scalar) for x in v))}

    def header(self, sizes: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"bench": self.name, "commit": commit(), "host": host(),
                "load": {"before": self.load_before, "after": load(), "wall_s": round(time.perf_counter() - self.t0, 2)},
                "sizes": self.default_sizes() if sizes is None else sizes,
                "quick": bool(getattr(self.args, "quick", False))}

    def emit(self, fields: dict[str, Any], *, sizes: dict[str, Any] | None = None) -> dict[str, Any]:
        """Print the final line (header, then ``fields``) and return it. A field named like a header
        field must agree with it (``sizes`` may instead be given only in ``fields``)."""
        if sizes is None and "sizes" in fields:
            sizes = fields["sizes"]
        out = self.header(sizes)
        for k, v in fields.items():
            if k in out and k != "bench" and out[k] != v:
                raise ValueError(f"{self.name}: field {k!r}={v!r} disagrees with the header's {out[k]!r}")
        out.update({k: v for k, v in fields.items() if k not in HEADER_FIELDS})
        print(json.dumps(out), flush=True)
        return out
