"""The proxy holds per-rollout state only for rollouts that are running: a finished rollout
(its key revoked) leaves nothing behind, and rollouts that are never revoked (header-bound)
are capped. Issue 27: RSS grew with every rollout served over a soak."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import aiohttp
import numpy as np
import pytest

from gyre_jax.serving.api_common import ApiError
from gyre_jax.serving.proxy import Proxy, ProxyConfig
from gyre_jax.serving.proxy_identity import Binding
from gyre_jax.serving.proxy_ledger import CallLedger
from gyre_jax.serving.router import Router
from gyre_jax.serving.server_thread import ServerThread
from gyre_jax.serving.tokenizer import ByteTokenizer
from gyre_jax.testing.fake_backend import FakeBackend
from gyre_jax.trajectory.records import ModelCallRecord, RolloutOutcome
from gyre_jax.trajectory.store import TrajectoryStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROLLOUTS = 6


def _binding(rollout: str, call: int | None = None, attempt: int = 0, run: str = "run1") -> Binding:
    return Binding(run, rollout, "t", "g", 0, None, "main", call, attempt)


def test_finished_rollouts_leave_nothing_in_the_proxy(tmp_path):
    store = TrajectoryStore(str(tmp_path / "store"), run_id="run1")

    async def build():
        return Proxy(Router([FakeBackend("A")]), ByteTokenizer(), store,
                     ProxyConfig(auth_token="s3cret-token", max_tokens_cap=8))

    st = ServerThread(build)
    st.start()

    async def rollouts():
        async with aiohttp.ClientSession() as s:
            for i in range(ROLLOUTS):
                rid = f"r{i}"
                key = st.proxy.issue("run1", rid, "t", "g")  # from this thread, as a rollout runner's would be
                for k in range(2):
                    body = {"model": "gyre", "messages": [{"role": "user", "content": f"{rid} turn {k}"}],
                            "max_tokens": 4, "stream": k == 1}
                    async with s.post(st.url + "/v1/chat/completions", json=body,
                                      headers={"Authorization": f"Bearer {key}"}) as r:
                        assert r.status == 200, await r.text()
                        await r.read()
                store.append(RolloutOutcome(run_id="run1", rollout_id=rid, task_id="t", group_id="g",
                                            status="completed", score=1.0, num_calls=2))
                st.proxy.revoke(key)

    try:
        asyncio.run(rollouts())
        held = st.run(_held(st.proxy))  # read on the server's loop, after the revocations queued there
    finally:
        st.stop()
    assert [len(store.calls(f"r{i}")) for i in range(ROLLOUTS)] == [2] * ROLLOUTS
    store.close()
    assert held == {"keys": 0, "registered": 0, "ledger": 0, "affinity": 0}


async def _held(proxy):
    return proxy.held()


def test_ledger_forgets_a_rollout_after_its_last_call_in_flight(tmp_path):
    store = TrajectoryStore(str(tmp_path / "store"), run_id="run1")
    led = CallLedger(store)
    b = led.claim(_binding("r0"), 1)
    led.forget("run1", "r0")  # revoked while its call is still being served
    assert len(led) == 1
    led.recorded("run1", "r0", b.call_index)
    led.release(b, 1)
    assert len(led) == 0
    store.close()


def test_ledger_cap_keeps_what_the_store_knows(tmp_path):
    store = TrajectoryStore(str(tmp_path / "store"), run_id="run1")
    led = CallLedger(store, max_entries=3)
    for i in range(8):  # header-bound rollouts: never revoked
        b = led.claim(_binding(f"r{i}"), 1)
        store.append(ModelCallRecord(run_id="run1", rollout_id=f"r{i}", task_id="t", group_id="g", agent_id=0,
                                     parent_agent_id=None, role="main", call_index=b.call_index,
                                     prompt_ids=np.arange(4, dtype=np.int32), output_ids=np.arange(2, dtype=np.int32),
                                     output_logprobs=np.zeros(2, np.float32), policy_version=0, t_start=0.0,
                                     t_end=0.0, finish_reason="stop"))
        led.recorded("run1", f"r{i}", b.call_index)
        led.release(b, 1)
    assert len(led) <= 3
    # r0 was dropped; it comes back from the store: its next call is 1 and a first attempt of call 0 is refused
    assert led.claim(_binding("r0"), 1).call_index == 1
    with pytest.raises(ApiError) as e:
        led.claim(_binding("r0", call=0), 1)
    assert e.value.status == 409
    store.close()


def test_ledger_without_a_readable_sink_forgets_nothing():
    class ListSink(list):
        append = list.append

    led = CallLedger(ListSink(), max_entries=1)
    for i in range(3):
        led.release(led.claim(_binding(f"r{i}"), 1), 1)
        led.forget("run1", f"r{i}")
    assert len(led) == 3  # nothing could rebuild them: a dropped entry would renumber calls from 0


@pytest.mark.slow
def test_soak_bench_smoke():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_proxy_soak.py"), "--calls", "200",
                          "--warmup", "40", "--every", "100", "--clients", "8"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["calls"] == 200 and res["errors"] == 0
    assert res["ledger"] <= 8 and res["registered"] <= 8 and res["affinity"] <= 8  # at most the running rollouts
    assert res["store_rollouts"] == res["rollouts"]
