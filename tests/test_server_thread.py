"""ServerThread.start's deadline: a build that is not ready in time is a RunFailed (the launcher prints one
``error:`` line and exits 1; before, a bare TimeoutError went through interpreter teardown beside a thread still
compiling and aborted the process, rc 134), and the late build's server is stopped once it is up."""
import asyncio
import threading

import pytest

from gyre_jax.errors import RunFailed
from gyre_jax.serving.server_thread import ServerThread, StartTimeout


class _SlowProxy:
    def __init__(self):
        self.started = threading.Event()
        self.stopped = threading.Event()

    async def start(self):
        self.started.set()
        return "http://127.0.0.1:1"

    async def stop(self):
        self.stopped.set()

    @property
    def router(self):
        proxy = self

        class _R:
            async def close(self):
                proxy.stopped.set()

        return _R()


def test_start_deadline_is_a_run_failure_and_the_late_server_stops():
    proxy = _SlowProxy()

    async def build():
        await asyncio.sleep(1.0)  # engines compiling past the deadline
        return proxy

    st = ServerThread(build)
    with pytest.raises(StartTimeout, match=r"not ready within 0 s.*config.cells.start_timeout_s") as e:
        st.start(0.2, "the rollout engines")
    assert isinstance(e.value, RunFailed)
    assert proxy.started.wait(10) and proxy.stopped.wait(10)  # up late, then stopped by itself
    st._thread.join(10)
    assert not st._thread.is_alive()
