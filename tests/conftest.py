"""Whole-run test setup: 8 host CPU devices, set once before JAX picks a backend.

XLA reads the device count once per process, so it lives here and nowhere else
(never per test file). Meshes, cells and resharding in the tests are then real.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
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
