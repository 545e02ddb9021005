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
# compile is cached (no 1 s floor: the tiny shapes compile in less), and a size bound turns on
# JAX's file lock, so a process never reads an entry another process is still writing.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="gyre-tests-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))
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
