"""The RL job (job 'rl') across processes: process 0 is the core, every other process one satellite cell.

Process 0 (``gyre_jax.rl.build`` with ``jax.process_count() > 1``) runs the
controller, proxy, store, processor, trainer and checkpoints on its own cell
(cell 0). Process ``k`` is cell ``k``: it runs ``satellite_main`` here, which

* trains: ``pods.satellite.serve`` answers the core's ``params``/``grad``
  messages (``RemoteCell``: the core's ``ElasticStep`` sums its gradients in
  micro-batch index order, so params are bit-identical to one process);
* serves: the first publication (the core's starting policy) builds a JetStream
  engine on this cell's serving mesh and an ``EngineServer`` (HTTP on aiohttp)
  in front of it; its address goes to the KV store (``ENGINE``). The core's
  router reaches it through a ``RemoteBackend``. Each later publication is
  pulled on ``jax.experimental.transfer``, resharded to the serving layout and
  loaded into the engine (``engine.publish``), bytes and seconds reported back.

Which of the two a satellite does at a moment is the core's controller's
decision (its roles): the core drains the cell's calls before it trains and
publishes the current version to it before it serves again, exactly as for a
cell in its own process.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
import uuid

import jax

from gyre_jax import cells as cells_lib
from gyre_jax.cells.frozen_base import Adapted
from gyre_jax.cells.mesh import Role
from gyre_jax.errors import ConfigError
from gyre_jax.pods.remote_engine import EngineServer, RemoteBackend
from gyre_jax.pods.satellite import RemoteCell, say_done, serve
from gyre_jax.pods.transport import Transport, get, transfer_host
from gyre_jax.scheduler.modes import get_mode, mode_names

log = logging.getLogger(__name__)

ENGINE = "pods/engine/{process}/{generation}"  # JSON {"url", "token", "max_context", "capacity"}
BYE = "pods/rl_bye/{process}"


def check_layout(cfg, cs) -> None:
    """Each process is exactly one cell, cell k on process k (ConfigError otherwise)."""
    n = jax.process_count()
    local = len(jax.local_devices())
    if local != cfg.cells.cell_size:
        raise ConfigError(f"the rl job across {n} processes runs one cell per process: config.cells.cell_size="
                          f"{cfg.cells.cell_size} but this process has {local} devices (launch_local: "
                          f"--devices_per_process={cfg.cells.cell_size})")
    for c in cs:
        procs = {d.process_index for d in c.devices}
        if procs != {c.index}:
            raise ConfigError(f"cell {c.index} spans processes {sorted(procs)}: the rl job across processes needs "
                              f"cell k on process k")
    if not get_mode(cfg.scheduler.mode).across_processes:
        ok = [m for m in mode_names() if get_mode(m).across_processes]
        raise ConfigError(f"the rl job across processes runs scheduler.mode={'|'.join(ok)} (cell 0 trains, the "
                          f"satellite processes serve or train); got {cfg.scheduler.mode!r}")


def satellite_main(cfg, steps, make_backend, tok) -> dict:
    """A satellite process of the rl job: train and serve on the core's word until it says stop."""
    transport = Transport()
    me = transport.process
    cell = dataclasses.replace(cells_lib.split_cells(cfg.cells, jax.local_devices())[0], index=me)
    publisher = cells_lib.WeightPublisher(steps.spec.logical_params, steps.spec.abstract_params)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="gyre-engine", daemon=True)
    thread.start()
    box: dict = {}

    def on_publish(version: int, params) -> None:
        if "backend" not in box:  # the core's starting policy: build the engine on it
            t0 = time.perf_counter()

            # A LoRA run: the satellite holds the frozen base (steps.base); what arrives is adapters.
            first = params if steps.base is None else Adapted(steps.base, params)

            async def make():
                backend = make_backend(cfg, cell, first, version, f"cell{me}", tok)
                server = EngineServer(backend)
                url = await server.start(transfer_host())
                return backend, server, url

            backend, server, url = asyncio.run_coroutine_threadsafe(make(), loop).result(900)
            box.update(backend=backend, server=server)
            transport.kv.key_value_set(ENGINE.format(process=me, generation=box["generation"]), json.dumps(
                {"url": url, "token": server.token, "max_context": backend.max_context, "capacity": backend.capacity}),
                allow_overwrite=True)
            print(f"pods satellite {me}: engine on cell {me} serving v{version} at {url} "
                  f"({time.perf_counter() - t0:.1f}s)", flush=True)
        else:
            box["backend"].engine.publish(params, version)

    box["generation"] = uuid.uuid4().hex  # this life of the process (a restarted one gets a new mailbox)
    try:
        done = serve(transport, steps, cell.mesh(Role.TRAIN), serve_shardings=publisher.shardings(cell, Role.ROLLOUT),
                     on_publish=on_publish, generation=box["generation"])
    finally:
        if "server" in box:
            asyncio.run_coroutine_threadsafe(box["server"].stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
    say_done(transport, BYE, done)
    return done


class Satellites:
    """The core's view of the satellite processes: a ``RemoteCell`` (training) and a ``RemoteBackend`` (serving) each."""

    def __init__(self, steps, core_mesh, *, timeout_s: float = 600.0):
        self.transport = Transport()
        self.remotes: dict[int, RemoteCell] = {}
        for p in range(1, jax.process_count()):
            self.remotes[p] = RemoteCell.connect(self.transport, p, steps, core_mesh, index=p, timeout_s=timeout_s)
            print(f"rl: satellite process {p} connected (cell {p})", flush=True)

    def start_engines(self, params, version: int, *, timeout_s: float = 900.0) -> dict[int, RemoteBackend]:
        """Publish the starting policy to every satellite (which builds its engine on it); their backends."""
        backends = {}
        for p, r in self.remotes.items():
            move = r.link.publish(params, version, p, timeout_s=timeout_s)
            d = json.loads(get(self.transport.kv, ENGINE.format(process=p, generation=r.link.generation),
                               timeout_s=timeout_s))
            backends[p] = RemoteBackend(f"cell{p}", d["url"], token=d.get("token"), max_context=d["max_context"], capacity=d["capacity"],
                                        version=version)
            print(f"rl: satellite {p} engine at {d['url']}: v{version} published ({move.bytes / 1e6:.2f} MB in "
                  f"{move.seconds:.3f} s)", flush=True)
        return backends

    def stop(self, *, timeout_s: float = 120.0) -> None:
        """Stop every satellite and wait until each has shut down (the core's coordination service outlives them)."""
        for r in self.remotes.values():
            try:
                r.link.stop()
            except Exception:  # noqa: BLE001 - the KV store may be going
                log.exception("stopping satellite %d", r.process)
        for r in self.remotes.values():
            # Gone first: a live satellite exits after its bye, a killed one is gone already (no bye to wait for).
            self.transport.wait_gone(r.process, timeout_s=timeout_s)
            try:
                get(self.transport.kv, BYE.format(process=r.process), timeout_s=1.0)
            except Exception as e:  # noqa: BLE001 - a dead satellite says no bye
                log.warning("satellite %d exited without its bye (killed?): %r", r.process, e)
