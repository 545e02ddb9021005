"""Many threads dispatching multi-device programs must not deadlock XLA:CPU's client pool.

The RL loop dispatches to 2-device cells from ~25 threads. When a device has 32
computations in flight, XLA:CPU blocks a pool thread per launch; with every pool
thread so blocked, a running all-gather's peer never gets a thread and XLA aborts
the process after 40 s (how the demo died on a loaded machine).
``gyre_jax.distributed.size_cpu_client_threads`` sizes the pool for this.

Each case runs in a subprocess (an abort would take the test run with it), with
XLA's termination timeout cut to 8 s so a deadlock fails fast.
"""
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# 8 threads, two per 2-device cell, each running ~100 all-gather programs ahead of the host.
SCRIPT = textwrap.dedent("""
    import sys, threading, time
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from gyre_jax.distributed import ensure_cpu_devices
    ensure_cpu_devices(8)
    import os
    print("PJRT_NPROC", os.environ.get("PJRT_NPROC"), flush=True)
    devs = jax.devices()
    cells = [Mesh(np.array(devs[2 * i:2 * i + 2]), ("fsdp",)) for i in range(4)]
    THREADS, AHEAD, ROUNDS = 8, 100, 3

    def program(mesh):
        sh, rep = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P())
        f = jax.jit(lambda w, x: jax.lax.with_sharding_constraint(
            jnp.tanh(x @ jax.lax.with_sharding_constraint(w, rep)), sh))
        w = jax.device_put(np.eye(64, dtype=np.float32), sh)
        x = jax.device_put(np.ones((64, 64), np.float32), sh)
        return f, w, x

    progs = [program(c) for c in cells]
    for f, w, x in progs:
        f(w, x).block_until_ready()  # compile before the race
    done = [0] * THREADS

    def run(t):
        f, w, x = progs[t % 4]
        for _ in range(ROUNDS):
            for _ in range(AHEAD):
                x = f(w, x)
                done[t] += 1
            x.block_until_ready()

    threads = [threading.Thread(target=run, args=(t,)) for t in range(THREADS)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    print("done", done, flush=True)
    assert done == [AHEAD * ROUNDS] * THREADS, done
""")


def _run(extra_env):
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "XLA_FLAGS")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               XLA_FLAGS="--xla_cpu_collective_call_terminate_timeout_seconds=8 "
                         "--xla_cpu_collective_call_warn_stuck_timeout_seconds=4", **extra_env)
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=240)


def test_sized_pool_survives_deep_dispatch_from_many_threads():
    r = _run({})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "PJRT_NPROC 128" in r.stdout  # 16 per device for 8 devices
    assert "done [300, 300, 300, 300, 300, 300, 300, 300]" in r.stdout


@pytest.mark.slow
def test_default_sized_pool_deadlocks_the_same_threads():
    """The contrast: a pool of 8 (what XLA picks for 8 devices on a small machine) aborts."""
    r = _run({"PJRT_NPROC": "8"})
    assert r.returncode != 0, r.stdout[-2000:]
    assert "Termination timeout" in r.stderr, r.stderr[-3000:]
