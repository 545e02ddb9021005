"""Arrays and control messages between processes, on JAX's own distributed runtime.

Arrays: ``jax.experimental.transfer``. Every process starts one transfer server
on its local devices; the owner of a pytree *offers* it under a uuid
(``await_pull``), the other side *pulls* it with a pytree of
``ShapeDtypeStruct``s whose shardings are where it should land (its own
devices, its own layout). The bytes go device to device over the servers'
sockets; nothing here touches them.

Control: the key-value store of ``jax.distributed`` (the coordination service
process 0 runs). Each process publishes its transfer server's address under
``pods/addr/<process>``; a ``Mailbox`` is an ordered queue of small JSON
messages to one process (``pods/mail/<process>/<n>``), read in order and
deleted once read.

Failure: ``jax.distributed`` must run with ``jax_enable_recoverability`` (so
one process's death is not everyone's; ``gyre_jax.distributed.initialize``
sets it with ``recoverable=True``). A pull from a peer that is killed while the
pull waits fails within about a second (the server's socket closes): that is
how the core learns a satellite died. Connecting to a peer that is already
dead can hang, so connections are made once, when the peer says hello.

Speed: ``TransferConfig`` (constructor argument ``transfer=``, or the
``GYRE_TRANSFER`` environment variable for operators, e.g.
``GYRE_TRANSFER="sockets=2,transfer_size=256M,parallel_copies=8"``) sets how
many sockets carry the bulk bytes between two servers (transport addresses),
the staging chunk size, how many chunks are in flight and whether the sender
reads the arrays' own memory (raw buffers) instead of first copying each chunk
to staging. The defaults (2 sockets, 4 MiB chunks, 8 in flight, staged) come
from ``tools/bench_role_switch.py --sweep`` for 623 MB of params between two
processes on loopback (numbers in that file's docstring): small chunks gave most
of the gain over jax's own defaults (1 socket, 256 MiB chunks; 0.36-0.81 GB/s,
raw loopback TCP 0.7-1.3 GB/s on a loaded 2-core machine), and jax's defaults
map 6 GiB of staging per server where these map 96 MiB.

Raw buffers (``raw_buffers=1`` in ``GYRE_TRANSFER``) were faster still in 3 of
4 runs (1.1x-1.7x; 0.91-1.04 GB/s in all) but are not the default: an offered
pytree must then be neither donated nor deleted until its pull is complete, or
the pull carries whatever its memory holds by then, silently, where a staged
pull fails loudly ("deleted or donated"). The pods keep to that rule today (a
publication is a copy the core waits on, a step's snapshot is pulled before the
gradients the update waits for), but weights that are silently wrong are the
one failure an RL run must never have, so the speed is an operator's opt-in.

Uuids are unique per run: the high bits are the allocating process, the low
bits a counter, so two processes never offer under the same uuid.
"""
from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import os
import socket
import threading
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import transfer
from jax.sharding import SingleDeviceSharding

from gyre_jax.cells.publish import tree_bytes

ENV = "GYRE_TRANSFER"  # operators' override of TransferConfig: "sockets=N,transfer_size=64M,parallel_copies=N"
ADDR = "pods/addr/{process}"
MAIL = "pods/mail/{process}/{generation}/{n}"
POLL_MS = 60_000  # a blocking KV read waits this long per try, then looks again


def kv_client():
    """The ``jax.distributed`` client of this process (its key-value store); raises if there is none."""
    from jax._src.distributed import global_state  # the KV store has no public accessor yet

    if global_state.client is None:
        raise RuntimeError(
            "pods: JAX's distributed runtime is not initialized; start every process with "
            "--coordinator_address/--num_processes/--process_id (or tools/launch_local.py)"
        )
    return global_state.client


def transfer_host() -> str:
    """The address this process's transfer server binds and announces: ``GYRE_TRANSFER_HOST`` if set, loopback when
    the coordinator is on loopback (one machine), else this host's address (a cluster: peers on other hosts)."""
    from jax._src.distributed import global_state

    if os.environ.get("GYRE_TRANSFER_HOST"):
        return os.environ["GYRE_TRANSFER_HOST"]
    coord = global_state.coordinator_address or "127.0.0.1:0"
    if coord.rsplit(":", 1)[0] in ("127.0.0.1", "localhost", "[::1]"):
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())


@dataclasses.dataclass(frozen=True)
class PullStats:
    """One pytree moved between processes: bytes and the seconds until it was on this side's devices."""

    uuid: int
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


_SIZE_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransferConfig:
    """How a transfer server moves bulk bytes (``jax.experimental.transfer.start_transfer_server``'s knobs).

    ``sockets``: transport addresses, i.e. parallel sockets per connection (the
    bytes of one pull are spread over them); ``transfer_size``: bytes per staging
    chunk; ``parallel_copies``: chunks in flight at once; ``raw_buffers``: send
    from the arrays' own buffers (no staging copy; offered arrays must then not
    be donated before they are pulled). Defaults: measured, see the module docstring.
    """

    sockets: int = 2
    transfer_size: int = 4 << 20
    parallel_copies: int = 8
    raw_buffers: bool = False  # opt-in: faster, but a donated offer is pulled silently wrong (module docstring)

    def __post_init__(self):
        for name in ("sockets", "transfer_size", "parallel_copies"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"TransferConfig.{name} must be a positive int, got {v!r}")

    @classmethod
    def parse(cls, text: str, *, where: str = ENV) -> "TransferConfig":
        """``"sockets=4,transfer_size=64M,parallel_copies=8,raw_buffers=0"`` (any subset; sizes take K/M/G)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {}
        for item in filter(None, (x.strip() for x in text.split(","))):
            key, eq, val = item.partition("=")
            key, val = key.strip(), val.strip()
            if not eq or key not in fields:
                raise ValueError(f"{where}: {item!r} is not one of {sorted(fields)} as key=value (in {text!r})")
            try:
                if key == "raw_buffers":
                    if val not in ("0", "1", "true", "false"):
                        raise ValueError(val)
                    kw[key] = val in ("1", "true")
                else:
                    unit = val[-1:].upper() if val[-1:].upper() in _SIZE_SUFFIX else ""
                    kw[key] = int(val[: len(val) - len(unit)]) * _SIZE_SUFFIX[unit]
            except ValueError:
                raise ValueError(f"{where}: {key}={val!r} is not a number (in {text!r})") from None
        try:
            return cls(**kw)
        except ValueError as e:
            raise ValueError(f"{where}: {e} (in {text!r})") from None

    @classmethod
    def from_env(cls) -> "TransferConfig":
        """``GYRE_TRANSFER`` if set, else the defaults."""
        return cls.parse(os.environ[ENV]) if os.environ.get(ENV) else cls()

    def start(self, host: str):
        """A transfer server on this process's local devices, bound to ``host`` (any free ports)."""
        return transfer.start_transfer_server(
            jax.local_devices()[0].client, f"{host}:0", [f"{host}:0"] * self.sockets,
            max_num_parallel_copies=self.parallel_copies, transfer_size=self.transfer_size,
            use_raw_buffers=self.raw_buffers)


def abstract(tree, shardings) -> Any:
    """ShapeDtypeStructs of ``tree`` (arrays or ShapeDtypeStructs) placed on ``shardings`` (a pytree or one)."""
    if not isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree)


class Transport:
    """This process's end: a transfer server, a KV client, connections to peers by process index."""

    def __init__(self, *, host: str | None = None, client=None, process_index: int | None = None,
                 transfer: TransferConfig | None = None):
        """``transfer``: the server's speed knobs (default ``TransferConfig.from_env()``)."""
        self.kv = kv_client() if client is None else client
        host = host or transfer_host()
        self.process = jax.process_index() if process_index is None else int(process_index)
        self.transfer = TransferConfig.from_env() if transfer is None else transfer
        self.server = self.transfer.start(host)
        self._counter = itertools.count(1)
        self._conns: dict[int, Any] = {}
        self._lock = threading.Lock()
        self.kv.key_value_set(ADDR.format(process=self.process), self.server.address(), allow_overwrite=True)

    def new_uuid(self) -> int:
        return (self.process + 1) << 40 | next(self._counter)

    # ---- arrays ----------------------------------------------------------------
    def offer(self, uuid: int, tree) -> None:
        """Let a peer pull ``tree`` once under ``uuid`` (returns at once; the server holds the arrays until then).

        Do not donate or delete ``tree`` before the pull is complete (raw buffers: see the module docstring)."""
        self.server.await_pull(uuid, tree)

    def connect(self, process: int, *, timeout_s: float = 300.0):
        """The connection to ``process``'s server (waits for its address; made once per process)."""
        with self._lock:
            conn = self._conns.get(process)
        if conn is None:
            addr = get(self.kv, ADDR.format(process=process), timeout_s=timeout_s)
            conn = self.server.connect(addr)
            with self._lock:
                self._conns[process] = conn
        return conn

    def forget(self, process: int) -> None:
        """Drop the connection to a peer that died (a restarted one publishes a new address)."""
        with self._lock:
            self._conns.pop(process, None)

    def pull(self, process: int, uuid: int, like) -> Any:
        """Start pulling ``uuid`` from ``process`` into ``like``'s shapes and shardings; returns arrays at once
        (they become ready when the bytes are in; ``block_until_ready`` raises if the peer died)."""
        return self.connect(process).pull(uuid, like)

    def wait_gone(self, process: int, *, timeout_s: float = 120.0) -> str:
        """Block until ``process`` has exited (its transfer server's socket closes); the error that said so.

        Pulls a uuid nobody offers: the pull can only end by the peer going away (or
        the timeout). The core runs the coordination service, so it must outlive every
        satellite's own ``jax.distributed`` shutdown; a KV message cannot say "I am gone".
        """
        like = jax.ShapeDtypeStruct((1,), np.int8, sharding=SingleDeviceSharding(jax.local_devices()[0]))
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        try:
            jax.block_until_ready(self.connect(process).pull(self.new_uuid(), {"x": like}, timeout=deadline))
        except Exception as e:  # noqa: BLE001 - the expected way out
            return str(e)
        raise RuntimeError(f"pods: process {process} answered a pull nobody offered")

    def pull_ready(self, process: int, uuid: int, like) -> tuple[Any, PullStats]:
        """``pull`` and wait: (arrays, stats)."""
        t0 = time.perf_counter()
        out = jax.block_until_ready(self.pull(process, uuid, like))
        return out, PullStats(uuid, tree_bytes(like), time.perf_counter() - t0)


def get(kv, key: str, *, timeout_s: float | None = None) -> str:
    """Blocking KV read; ``timeout_s=None`` waits for ever (in POLL_MS slices, so a stuck wait stays visible)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        left_ms = POLL_MS if deadline is None else int(max(1, min(POLL_MS, (deadline - time.monotonic()) * 1000)))
        try:
            return kv.blocking_key_value_get(key, left_ms)
        except Exception as e:  # the runtime raises JaxRuntimeError(DEADLINE_EXCEEDED) on timeout
            if "DEADLINE_EXCEEDED" not in str(e):
                raise
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"pods: no value for {key!r} after {timeout_s:.0f} s") from None


class Mailbox:
    """Ordered JSON messages to one process over the KV store: ``send`` from anyone, ``recv`` by the owner.

    One sender per mailbox (the core): it numbers the messages itself. ``generation``
    names one life of the receiving process: a restarted satellite reads a fresh queue.
    """

    def __init__(self, kv, process: int, generation: str = "0"):
        self.kv = kv
        self.process = int(process)
        self.generation = str(generation)
        self._sent = 0
        self._read = 0
        self._lock = threading.Lock()

    def send(self, msg: dict) -> None:
        with self._lock:
            n = self._sent
            self._sent += 1
            self.kv.key_value_set(MAIL.format(process=self.process, generation=self.generation, n=n), json.dumps(msg))

    def recv(self, *, timeout_s: float | None = None) -> dict:
        key = MAIL.format(process=self.process, generation=self.generation, n=self._read)
        msg = json.loads(get(self.kv, key, timeout_s=timeout_s))
        self.kv.key_value_delete(key)
        self._read += 1
        return msg
