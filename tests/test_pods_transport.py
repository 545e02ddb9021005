"""gyre_jax.pods.transport in one process: two Transports (two transfer servers) on one coordination service.

The multi-process paths are in tests/test_pods_dp.py; here the pieces, fast:
a pytree of sharded arrays offered on one server and pulled by the other onto
other devices, bit for bit; pull uuids from different processes never collide;
the mailbox keeps order and deletes what it delivered; a KV wait names its key
when it times out.
"""
import socket

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from gyre_jax.pods.transport import Mailbox, TransferConfig, Transport, abstract, get


@pytest.fixture(scope="module")
def kv():
    from jax._src.lib import _jax  # the runtime jax.distributed.initialize starts, without making this process global

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    service = _jax.get_distributed_runtime_service(f"127.0.0.1:{port}", 1)
    client = _jax.get_distributed_runtime_client(f"127.0.0.1:{port}", 0, init_timeout=60)
    client.connect()
    yield client
    client.shutdown()
    service.shutdown()


@pytest.mark.parametrize("knobs", ["", "sockets=3,transfer_size=1K,parallel_copies=2"])
def test_pull_pytree_onto_other_devices(kv, knobs, monkeypatch):
    # The second case spreads the bytes over 3 sockets in 1 KiB chunks, 2 in flight: still bit for bit.
    monkeypatch.setenv("GYRE_TRANSFER", knobs)
    a, b = Transport(client=kv, process_index=0), Transport(client=kv, process_index=1)
    assert a.transfer == TransferConfig.parse(knobs)
    devs = jax.devices()
    src = NamedSharding(Mesh(np.array(devs[:2]), ("x",)), P("x"))
    dst = NamedSharding(Mesh(np.array(devs[2:4]), ("x",)), P("x"))
    rng = np.random.default_rng(0)
    host = {"w": rng.standard_normal((4, 600)).astype(np.float32), "b": rng.integers(0, 9, (2,)).astype(np.int32)}
    tree = jax.device_put(host, src)
    uuid = a.new_uuid()
    assert uuid != b.new_uuid()  # per-process high bits
    a.offer(uuid, tree)
    out, st = b.pull_ready(0, uuid, abstract(tree, dst))
    assert st.bytes == sum(v.nbytes for v in host.values())
    for k in host:
        assert out[k].sharding == dst
        assert {d for d in out[k].devices()} == set(devs[2:4])
        np.testing.assert_array_equal(np.asarray(out[k]), host[k])


def test_mailbox_order_and_timeout(kv):
    out, inbox = Mailbox(kv, 7), Mailbox(kv, 7)
    for i in range(3):
        out.send({"op": "grad", "i": i})
    assert [inbox.recv(timeout_s=5)["i"] for _ in range(3)] == [0, 1, 2]
    with pytest.raises(Exception, match="NOT_FOUND"):  # delivered messages are gone from the store
        kv.key_value_try_get("pods/mail/7/0/0")
    with pytest.raises(TimeoutError, match="pods/mail/7/0/3"):
        inbox.recv(timeout_s=0.2)
    with pytest.raises(TimeoutError, match="no value for 'nothing/here'"):
        get(kv, "nothing/here", timeout_s=0.2)


def test_transfer_config_from_text_and_its_errors():
    assert TransferConfig.parse("sockets=4, transfer_size=64M,parallel_copies=16,raw_buffers=1") == TransferConfig(
        sockets=4, transfer_size=64 << 20, parallel_copies=16, raw_buffers=True)
    assert TransferConfig.parse("") == TransferConfig()
    with pytest.raises(ValueError, match=r"GYRE_TRANSFER: 'socket=4' is not one of"):
        TransferConfig.parse("socket=4")
    with pytest.raises(ValueError, match=r"GYRE_TRANSFER: transfer_size='big' is not a number"):
        TransferConfig.parse("transfer_size=big")
    with pytest.raises(ValueError, match=r"GYRE_TRANSFER: TransferConfig.sockets must be a positive int, got 0"):
        TransferConfig.parse("sockets=0")


def test_an_offered_array_donated_before_its_pull(kv):
    """Why the pods never donate what they offer until it is pulled (publications are copies the core waits on;
    a step's snapshot is pulled before the satellite's gradients, which the update waits for): without raw
    buffers such a pull fails loudly; with them (the default) it silently carries whatever that memory holds by
    then (the donating computation's output or the old bytes: both were seen here)."""
    dev_a, dev_b = jax.devices()[0], jax.devices()[1]
    like = [jax.ShapeDtypeStruct((1024,), np.float32, sharding=SingleDeviceSharding(dev_b))]
    overwrite = jax.jit(lambda v: v * 0 - 1, donate_argnums=0)
    for raw in (False, True):
        cfg = TransferConfig(raw_buffers=raw)
        a, b = Transport(client=kv, process_index=0, transfer=cfg), Transport(client=kv, process_index=1, transfer=cfg)
        x = jax.device_put(np.arange(1024, dtype=np.float32), dev_a)
        uuid = a.new_uuid()
        a.offer(uuid, [x])
        jax.block_until_ready(overwrite(x))
        if raw:
            (out,), _ = b.pull_ready(0, uuid, like)  # no error: nothing tells the puller
            assert out.shape == (1024,)
        else:
            with pytest.raises(Exception, match="deleted or donated"):
                b.pull_ready(0, uuid, like)
