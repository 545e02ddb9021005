"""A training satellite in another process: the core's handle (``RemoteCell``) and the satellite's loop (``serve``).

The core's ``ElasticStep`` treats a ``RemoteCell`` like a local satellite
(``join``, ``leave``, work-stealing, failure requeue; cells/elastic.py), but its
worker drives a ``SatelliteLink`` instead of computing: for every micro-batch it
pulls from the step's queue, it offers the micro-batch on the core's transfer
server, mails the satellite a ``grad`` message and starts pulling the result
into the core's layout. The satellite process, in ``serve``, pulls the step's
params snapshot once (the ``params`` message, sent with its first micro-batch
of a step), then for each ``grad`` message pulls the micro-batch, runs the same
jitted ``CellSteps.grad_step`` as a local cell, and offers (grads, stats) back.
The core's reducer sums them in micro-batch index order with everyone else's,
so the new params are bit-identical to a single-process step.

Publication: ``SatelliteLink.publish`` offers a new policy version; the
satellite pulls it in the training layout (a pull cannot change the layout),
reshards it locally into its *serving* layout (train fsdp -> serve tensor) and
reports bytes and seconds (``published``), as an engine there would load it.
The version it held stays in until the new one is (``serve(keep_serving=)``):
calls keep being served during the pull.

Messages (``Mailbox``, JSON): ``{"op": "params", "uuid", "version", "core"}``,
``{"op": "grad", "i", "in", "out", "shapes", "core"}``, ``{"op": "publish",
"uuid", "version", "core"}``, ``{"op": "stop"}``.

A satellite killed mid-step: the core's pull of its result fails when its
server's socket closes, the worker raises, and ``ElasticStep`` gives the
micro-batches it held to the other cells (``StepReport.failed_cells``).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
import uuid as uuid_lib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from gyre_jax.cells.publish import TO_ROLLOUT, TO_TRAIN, MoveStats, tree_bytes
from gyre_jax.cells.train_step import CellSteps
from gyre_jax.pods.transport import Mailbox, PullStats, Transport, abstract, get

log = logging.getLogger(__name__)

HELLO = "pods/hello/{process}"  # a satellite's "serving": JSON {"process", "generation", "devices"}
SNAPSHOT = "pods/snapshot/{process}/{uuid}"  # a satellite's params pull: JSON PullStats fields
PUBLISHED = "pods/published/{process}/{version}"  # a satellite holds this version for serving: JSON PullStats fields


class SatelliteLink:
    """The core's side of one satellite process: offers, mails and pulls for ``ElasticStep``."""

    def __init__(self, transport: Transport, process: int, steps: CellSteps, core_mesh, generation: str = "0"):
        self.t = transport
        self.process = int(process)
        self.generation = str(generation)
        self.steps = steps
        self.core_mesh = core_mesh
        self.mail = Mailbox(transport.kv, process, generation)
        self._grads_like = abstract(steps.spec.abstract_params, steps.param_shardings(core_mesh))
        self._stats_like: dict[tuple, Any] = {}
        self._snapshot_uuid: int | None = None

    def begin(self, params, version: int) -> None:
        """Offer the step's params snapshot; the satellite pulls it before its first micro-batch."""
        uuid = self.t.new_uuid()
        self.t.offer(uuid, params)
        self._snapshot_uuid = uuid
        self.mail.send({"op": "params", "uuid": uuid, "version": int(version), "core": self.t.process})

    def snapshot_stats(self, version: int, cell_index: int) -> MoveStats | None:
        """The satellite's own measure of its last snapshot pull (after its first result came back)."""
        if self._snapshot_uuid is None:
            return None
        raw = self.t.kv.key_value_try_get(SNAPSHOT.format(process=self.process, uuid=self._snapshot_uuid))
        d = json.loads(raw)
        return MoveStats(TO_TRAIN, int(version), cell_index, int(d["bytes"]), float(d["seconds"]))

    def submit(self, i: int, mb: Mapping[str, np.ndarray]):
        """Send micro-batch ``i``; returns its (grads, stats), still arriving (``collect`` waits)."""
        bsh = self.steps.batch_sharding(self.core_mesh)
        on_core = jax.device_put(dict(mb), bsh)
        uin, uout = self.t.new_uuid(), self.t.new_uuid()
        self.t.offer(uin, on_core)
        shapes = {k: [list(v.shape), str(v.dtype)] for k, v in mb.items()}
        self.mail.send({"op": "grad", "i": int(i), "in": uin, "out": uout, "shapes": shapes, "core": self.t.process})
        return self.t.pull(self.process, uout, (self._grads_like, self._stats_for(mb)))

    @staticmethod
    def collect(result):
        """Wait for a submitted micro-batch's (grads, stats); raises if the satellite died meanwhile."""
        return jax.block_until_ready(result)

    def publish(self, params, version: int, cell_index: int, *, timeout_s: float = 300.0) -> MoveStats:
        """Move policy ``version`` to the satellite's serving layout; returns once it holds it (its bytes, seconds)."""
        uuid = self.t.new_uuid()
        self.t.offer(uuid, params)
        self.mail.send({"op": "publish", "uuid": uuid, "version": int(version), "core": self.t.process})
        d = json.loads(get(self.t.kv, PUBLISHED.format(process=self.process, version=int(version)), timeout_s=timeout_s))
        return MoveStats(TO_ROLLOUT, int(version), cell_index, int(d["bytes"]), float(d["seconds"]))

    def stop(self) -> None:
        self.mail.send({"op": "stop"})

    def _stats_for(self, mb):
        key = tuple((k, v.shape, str(v.dtype)) for k, v in sorted(mb.items()))
        if key not in self._stats_like:
            mb_like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in mb.items()}
            _, stats = jax.eval_shape(self.steps.grad_fn, self.steps.spec.abstract_params, mb_like)
            self._stats_like[key] = abstract(stats, NamedSharding(self.core_mesh, PartitionSpec()))
        return self._stats_like[key]


@dataclasses.dataclass(eq=False)
class RemoteCell:
    """A cell that lives in another process, as ``ElasticStep.join`` sees it (no local devices)."""

    index: int
    process: int
    link: SatelliteLink
    devices: tuple = ()

    @classmethod
    def connect(cls, transport: Transport, process: int, steps: CellSteps, core_mesh, *, index: int | None = None,
                timeout_s: float = 300.0) -> "RemoteCell":
        """Wait for ``process`` to serve (its hello), connect to it; ``index`` defaults to the process index."""
        hello = json.loads(get(transport.kv, HELLO.format(process=process), timeout_s=timeout_s))
        return cls._from_hello(transport, process, steps, core_mesh, hello, index, timeout_s)

    @classmethod
    def reconnect(cls, transport: Transport, dead: "RemoteCell", steps: CellSteps, core_mesh) -> "RemoteCell | None":
        """The satellite ``dead`` again if its process was restarted (a hello of a new generation), else None."""
        try:
            hello = json.loads(transport.kv.key_value_try_get(HELLO.format(process=dead.process)))
        except Exception:  # noqa: BLE001 - NOT_FOUND: never said hello
            return None
        if hello["generation"] == dead.link.generation:
            return None
        transport.forget(dead.process)  # its new server has a new address
        return cls._from_hello(transport, dead.process, steps, core_mesh, hello, dead.index, 300.0)

    @classmethod
    def _from_hello(cls, transport, process, steps, core_mesh, hello, index, timeout_s) -> "RemoteCell":
        transport.connect(process, timeout_s=timeout_s)
        log.info("pods: satellite process %d (generation %s) serving on %d devices", process, hello["generation"],
                 len(hello["devices"]))
        return cls(index=process if index is None else index, process=process,
                   link=SatelliteLink(transport, process, steps, core_mesh, hello["generation"]))

    def __repr__(self) -> str:
        return f"RemoteCell({self.index}, process={self.process})"


def serve(transport: Transport, steps: CellSteps, mesh, *, serve_shardings=None,
          on_grad: Callable[[int, int], None] | None = None,
          on_publish: Callable[[int, Any], None] | None = None, generation: str | None = None,
          keep_serving: bool = True) -> dict[str, Any]:
    """Serve the core's messages until ``stop``: the satellite process's main loop.

    ``mesh``: the cell's training mesh; ``serve_shardings``: the params' serving
    layout (``WeightPublisher.shardings(cell, Role.ROLLOUT)``), where publications
    land (default: the training layout). ``on_grad(n, i)`` runs before the n-th
    micro-batch (index ``i``) is computed (fault injection and pacing).
    ``on_publish(version, params)`` gets each publication in the serving layout
    (the rl job loads it into this process's engine) before the core hears it is
    held. Returns
    counts and the latest published version for the caller's summary.

    ``keep_serving``: a publication replaces the version held here only once the
    new one is in, so an engine here serves the old one meanwhile (the engine
    keeps its own reference until ``on_publish`` hands it the new one, so this is
    so for it either way). Peak device memory during a publication: the old
    version (serving layout) + the new one in the training layout + the new one
    in the serving layout while the reshard runs, 3x the params' bytes (plus the
    last training snapshot if this cell trained). ``keep_serving=False`` drops
    this loop's reference first (2x when nothing else holds the old version): for
    a process that serves nothing and has no memory for two versions.
    """
    me = transport.process
    generation = generation or uuid_lib.uuid4().hex  # this life of the process: a restart gets a fresh mailbox
    mail = Mailbox(transport.kv, me, generation)
    loop = _Serving(transport, abstract(steps.spec.abstract_params, steps.param_shardings(mesh)),
                    steps.batch_sharding(mesh), steps.grad_step(mesh), serve_shardings, on_grad, on_publish,
                    keep_serving)
    transport.kv.key_value_set(HELLO.format(process=me), json.dumps(
        {"process": me, "generation": generation, "devices": [d.id for d in mesh.devices.flat]}), allow_overwrite=True)
    while True:
        msg = mail.recv()
        op = msg.get("op")
        if op == "stop":
            return loop.done
        if op == "params":
            loop.snapshot(msg)
        elif op == "publish":
            loop.publish(msg)
        elif op == "grad":
            loop.grad(msg)
        else:
            raise ValueError(f"pods satellite {me}: unknown message {msg!r}")


@dataclasses.dataclass(eq=False)
class _Serving:
    """``serve``'s state and what it does per message: the training snapshot it computes micro-batches
    with, the version it serves, and the counts it returns."""

    transport: Transport
    params_like: Any  # the params' abstract tree in the training layout
    batch_sharding: Any
    grad_step: Callable[..., Any]
    serve_shardings: Any
    on_grad: Callable[[int, int], None] | None
    on_publish: Callable[[int, Any], None] | None
    keep_serving: bool
    params: Any = None  # the latest training snapshot
    version: int | None = None
    published: tuple[int, Any] | None = None  # (version, params in the serving layout): what an engine here serves
    done: dict[str, Any] = dataclasses.field(default_factory=lambda: {
        "micro_batches": 0, "snapshots": 0, "snapshot_bytes": 0, "snapshot_seconds": 0.0,
        "published_version": None, "publish_bytes": 0, "publish_seconds": 0.0})

    @property
    def me(self) -> int:
        return self.transport.process

    def snapshot(self, msg: dict) -> None:
        """The core's params for the micro-batches of a step: pulled, acknowledged with their transfer stats."""
        self.params, st = self.transport.pull_ready(int(msg["core"]), int(msg["uuid"]), self.params_like)
        self.version = int(msg["version"])
        self.transport.kv.key_value_set(SNAPSHOT.format(process=self.me, uuid=msg["uuid"]),
                                        json.dumps({"bytes": st.bytes, "seconds": st.seconds}))
        self.done["snapshots"] += 1
        self.done["snapshot_bytes"] += st.bytes
        self.done["snapshot_seconds"] += st.seconds
        log.info("pods satellite %d: params v%d pulled, %.2f MB in %.3f s (%.2f GB/s)",
                 self.me, self.version, st.bytes / 1e6, st.seconds, st.gbps)

    def publish(self, msg: dict) -> None:
        """A new version to serve: pulled in the core's layout, resharded to the serving one, handed to
        ``on_publish``, then acknowledged (serve's docstring: memory while it lands)."""
        if not self.keep_serving:
            self.published = None  # no engine here reads it: free it before the new version lands
        t0 = time.perf_counter()
        # A pull cannot change the layout (jax 0.10.2: "Async transfer object was deleted before transfers
        # completed" when the target sharding differs), so: the core's layout across, the reshard here.
        pending = self.transport.pull(int(msg["core"]), int(msg["uuid"]), self.params_like)  # in flight from here
        log.info("pods satellite %d: pulling v%d, serving v%s meanwhile", self.me, int(msg["version"]),
                 None if self.published is None else self.published[0])
        p = jax.block_until_ready(pending)
        st = PullStats(int(msg["uuid"]), tree_bytes(self.params_like), time.perf_counter() - t0)
        if self.serve_shardings is not None:
            p = jax.block_until_ready(jax.device_put(p, self.serve_shardings))
        seconds = time.perf_counter() - t0
        if self.on_publish is not None:
            self.on_publish(int(msg["version"]), p)
        self.published = (int(msg["version"]), p)
        self.transport.kv.key_value_set(PUBLISHED.format(process=self.me, version=self.published[0]),
                                        json.dumps({"bytes": st.bytes, "seconds": seconds, "pull_seconds": st.seconds}),
                                        allow_overwrite=True)
        self.done["published_version"] = self.published[0]
        self.done["publish_bytes"] += st.bytes
        self.done["publish_seconds"] += seconds

    def grad(self, msg: dict) -> None:
        """One micro-batch: pulled, its gradient computed on the snapshot and offered back to the core."""
        if self.params is None:
            raise RuntimeError(f"pods satellite {self.me}: micro-batch {msg['i']} before any params snapshot")
        if self.on_grad is not None:
            self.on_grad(self.done["micro_batches"], int(msg["i"]))
        like = {k: jax.ShapeDtypeStruct(tuple(s), np.dtype(d), sharding=self.batch_sharding)
                for k, (s, d) in msg["shapes"].items()}
        mb = self.transport.pull(int(msg["core"]), int(msg["in"]), like)
        self.transport.offer(int(msg["out"]), self.grad_step(self.params, mb))
        self.done["micro_batches"] += 1


def hold_forever(reason: str) -> None:
    """Block this thread for good (a fault-injection point: the test kills the process here)."""
    print(reason, flush=True)
    threading.Event().wait()


def say_done(transport: Transport, bye_key: str, done: dict[str, Any]) -> None:
    """Print what ``serve`` did in this process (its counts) and leave ``bye_key`` in the KV store for the core."""
    me = transport.process
    print(f"pods satellite {me}: {done['micro_batches']} micro-batches trained, {done['snapshots']} snapshots "
          f"({done['snapshot_bytes'] / 1e6:.2f} MB in {done['snapshot_seconds']:.3f} s), serving version "
          f"{done['published_version']} ({done['publish_bytes'] / 1e6:.2f} MB published in "
          f"{done['publish_seconds']:.3f} s)", flush=True)
    transport.kv.key_value_set(bye_key.format(process=me), "1", allow_overwrite=True)
