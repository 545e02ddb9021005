"""Cells that share a shape compile once (gyre_jax/compile_cache.py).

The conftest's persistent cache is on for the whole run. With ``share_across_devices`` a program
compiled for one cell's devices is loaded for another cell's (and a permuted order of them), runs
there, and gives numpy's answer; two cells compiling the same program at once compile it once.
Without it every device set compiles again (the last test: what the sharing removes).
"""
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import monitoring
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gyre_jax import compile_cache

REQUEST, HIT = "/jax/compilation_cache/compile_requests_use_cache", "/jax/compilation_cache/cache_hits"


@pytest.fixture
def shared():
    compile_cache.share_across_devices()
    yield
    compile_cache.unshare()


class Compiles:
    """Programs compiled (not loaded from the persistent cache) while it listens, every thread's."""

    def __init__(self):
        self.requests = self.hits = 0
        monitoring.register_event_listener(self._on)

    def _on(self, event, **_):
        self.requests += event == REQUEST
        self.hits += event == HIT

    @property
    def n(self) -> int:
        return self.requests - self.hits

    def close(self):
        monitoring.unregister_event_listener(self._on)


def _program(salt: float):
    """A sharded matmul + reduction (an all-reduce across the cell) whose constant makes its key new."""
    def f(x, w):
        y = jnp.tanh(x @ w * salt)
        return y.sum(axis=0), y
    return jax.jit(f)


def _run(fn, salt, device_ids):
    devs = jax.devices()
    mesh = Mesh(np.array([devs[i] for i in device_ids]), ("d",))
    x_np = np.arange(16 * 8, dtype=np.float32).reshape(16, 8) / 100
    w_np = np.linspace(-1, 1, 8 * 4, dtype=np.float32).reshape(8, 4)
    x = jax.device_put(x_np, NamedSharding(mesh, P("d")))
    w = jax.device_put(w_np, NamedSharding(mesh, P()))
    s, y = fn(x, w)
    ref = np.tanh(x_np.astype(np.float64) @ w_np.astype(np.float64) * np.float32(salt))
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(s), ref.sum(0), rtol=1e-5, atol=1e-5)
    assert [sh.device.id for sh in y.addressable_shards] == list(device_ids)
    return y


def test_a_cells_program_runs_on_another_cells_devices(shared):
    salt = float(np.random.default_rng().uniform(1, 2))
    count = Compiles()
    try:
        for ids in ([0, 1], [2, 3], [3, 2]):
            _run(_program(salt), salt, ids)  # a fresh jit each time: the persistent cache is what is shared
    finally:
        count.close()
    assert count.n == 1


def test_cells_compiling_at_once_compile_once(shared):
    salt = float(np.random.default_rng().uniform(2, 3))
    count = Compiles()
    errors: list[BaseException] = []
    start = threading.Barrier(3)

    def cell(ids):
        try:
            start.wait()
            _run(_program(salt), salt, ids)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=cell, args=(ids,)) for ids in ([0, 1], [2, 3], [4, 5])]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        count.close()
    assert not errors, errors
    assert count.n == 1


def test_without_sharing_each_device_set_compiles():
    salt = float(np.random.default_rng().uniform(3, 4))
    count = Compiles()
    try:
        for ids in ([0, 1], [2, 3]):
            _run(_program(salt), salt, ids)
    finally:
        count.close()
    assert count.n == 2
