"""Whole-run test setup: 8 host CPU devices, set once before JAX picks a backend.

XLA reads the device count once per process, so it lives here and nowhere else
(never per test file). Meshes, cells and resharding in the tests are then real.
"""
import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One compilation cache for the whole run, its processes included (the RL jobs the tests launch
# inherit the environment): dozens of tests build the same tiny model's steps, and compiling them
# again was most of the default run's time. Fresh per run (a run measures a cold start, as CI
# does) and removed after it; a caller's own JAX_COMPILATION_CACHE_DIR is used as is. Every
# compile is cached (no 1 s floor: the tiny shapes compile in less). No size bound: a bound turns
# on JAX's LRU eviction, which lists and stats every entry at every write (jax/_src/lru_cache.py),
# so a run's N entries cost O(N^2): 2,000 writes took 64 CPU-s here, and the late tests of a full
# run (thousands of entries) paid most of it. Without the bound there is no file lock either; a
# process that reads an entry another is still writing gets a truncated zlib stream, which JAX
# reports as a warning and compiles anew (compiler._cache_read), never a wrong executable.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="gyre-tests-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# No user-wide cache of task checks either (rl/task_gate.py): each test's runs check their tasks.
os.environ.setdefault("GYRE_TASK_CHECK_CACHE", "")
# Set before jax is imported anywhere in the run; jax_num_cpu_devices below is the
# supported way, the flag covers libraries that initialise XLA on their own.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
from gyre_jax.distributed import size_cpu_client_threads  # noqa: E402

size_cpu_client_threads(8)  # as launch.main does: the RL-loop tests dispatch from many threads
jax.config.update("jax_enable_x64", False)

NUM_TEST_DEVICES = 8


def pytest_sessionstart(session):
    n = len(jax.devices())
    assert n == NUM_TEST_DEVICES, f"tests need {NUM_TEST_DEVICES} host devices, got {n}"
