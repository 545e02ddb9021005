"""Job 'pods_dp' (configs/pods_dp.py): elastic training steps with satellites in other processes.

Process 0 is the core cell: it owns the train state and runs ``ElasticTrainer``
steps on synthetic policy-loss micro-batches; every other process is a
training satellite (``pods.satellite.serve``). Each step, once the core has
computed ``join_after`` micro-batches, the satellites join it (mid-step); the
core then waits until each has pulled one micro-batch (so the split is visible
in a short demo) and everyone steals work from the queue until it is empty.

``build`` and ``micro_batches`` are shared with the tests, which run the same
steps in one process and compare params bit for bit.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import threading
import time
from typing import Any

import jax
import ml_collections
import numpy as np

from gyre_jax import cells
from gyre_jax.errors import ConfigError
from gyre_jax.pods.satellite import RemoteCell, hold_forever, say_done, serve
from gyre_jax.pods.transport import Transport, get

log = logging.getLogger(__name__)

BYE = "pods/bye/{process}"
JOIN_WAIT_S = 600  # deadlock guard for the demo pacing (never reached when every satellite answers)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PodsDPConfig:
    seed: int = 0
    steps: int = 3
    micro_batches: int = 8
    rows: int = 2
    row_len: int = 32
    join_after: int = 2
    in_flight: int = 2
    hold_satellite: int = -1
    min_satellites: int = 0
    rejoin_wait_s: float = 300.0
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    model: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for name in ("steps", "micro_batches", "rows", "row_len", "in_flight"):
            if getattr(self, name) < 1:
                raise ConfigError(f"config.{name} must be >= 1, got {getattr(self, name)}")
        if self.min_satellites < 0 or not self.rejoin_wait_s > 0:
            raise ConfigError(f"config.min_satellites must be >= 0 and rejoin_wait_s > 0, got "
                              f"{self.min_satellites}, {self.rejoin_wait_s}")
        if not 0 <= self.join_after < self.micro_batches:
            raise ConfigError(f"config.join_after must be in [0, micro_batches={self.micro_batches}), got {self.join_after}")

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict) -> "PodsDPConfig":
        d = config.to_dict()
        for k in ("job", "recoverable_processes", "num_cpu_devices", "workdir"):
            d.pop(k, None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"pods_dp: unknown config keys {unknown}")
        return cls(**d)


def build(cfg: PodsDPConfig):
    """(model config, StateSpec, CellSteps) for ``cfg``: the same in every process."""
    from gyre_jax.cells.loss import policy_loss_fn
    from gyre_jax.losses import METRIC_REDUCTIONS, PolicyLossConfig
    from gyre_jax.model import init_boxed, model_config_tiny, param_logical_axes

    model = model_config_tiny(**cfg.model)
    opt = cells.OptimizerConfig(learning_rate=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                max_grad_norm=cfg.max_grad_norm)
    spec = cells.StateSpec.create(functools.partial(init_boxed, model), cells.make_optimizer(opt, param_logical_axes(model)))
    steps = cells.CellSteps(spec, policy_loss_fn(model, PolicyLossConfig()), cells.make_schedule(opt),
                            reductions=METRIC_REDUCTIONS)
    return model, spec, steps


def micro_batches(cfg: PodsDPConfig, model, step: int, version: int) -> list[dict[str, np.ndarray]]:
    """Step ``step``'s micro-batches: packed trees (a prompt, two trainable retries) sampled by ``version``,
    loss weights summing to 1 over the step, random advantages. Deterministic in (seed, step)."""
    from gyre_jax.trajectory.node import TreeNode
    from gyre_jax.trajectory.serialize import pack_rows, serialize_tree

    rng = np.random.default_rng([cfg.seed, step])

    def span(n, trainable):
        toks = rng.integers(1, model.vocab_size, n)
        lp = (np.log(1.0 / model.vocab_size) + 0.05 * rng.standard_normal(n)).astype(np.float32)
        return TreeNode.span(toks, trainable=trainable, logprobs=lp, policy_version=version)

    def tree():
        root = span(4, False)
        root.children = [span(int(rng.integers(3, 7)), True), span(int(rng.integers(2, 5)), True)]
        return serialize_tree(root)

    n_rows = cfg.micro_batches * cfg.rows
    rows = [[tree(), tree()] for _ in range(n_rows)]
    packed = pack_rows(rows, cfg.row_len)
    n_rollouts = 2 * n_rows
    adv = rng.standard_normal(n_rollouts).astype(np.float32)
    for r, trees in enumerate(rows):
        for s, t in enumerate(trees):
            seg = packed.segment_ids[r] == s + 1
            packed.loss_weights[r, seg & packed.loss_mask[r]] = 1.0 / (t.num_trainable * n_rollouts)
            packed.advantages[r, seg] = adv[2 * r + s]
    d = packed.as_dict()
    b = cfg.rows
    return [{k: v[i * b : (i + 1) * b] for k, v in d.items()} for i in range(cfg.micro_batches)]


def local_cell() -> cells.Cell:
    """This process's devices as one cell (index = process index)."""
    devs = jax.local_devices()
    cell = cells.split_cells(cells.CellConfig(cell_size=len(devs)), devs)[0]
    return dataclasses.replace(cell, index=jax.process_index())


def flat_params(params) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}


def run(config, workdir: str) -> dict:
    cfg = PodsDPConfig.from_config(config)
    if jax.process_count() < 2:
        raise ConfigError("pods_dp needs >= 2 processes (a core and satellites): "
                          "python tools/launch_local.py -n 3 -- --config configs/pods_dp.py")
    transport = Transport()
    model, spec, steps = build(cfg)
    cell = local_cell()
    if jax.process_index() == 0:
        return _core(cfg, model, spec, steps, cell, transport, workdir)
    return _satellite(cfg, steps, cell, transport)


def _satellite(cfg, steps, cell, transport) -> dict:
    me = transport.process

    def on_grad(n, i):
        if me == cfg.hold_satellite and n == 0:
            hold_forever(f"pods satellite {me}: holding micro-batch {i} (fault injection)")

    publisher = cells.WeightPublisher(steps.spec.logical_params, steps.spec.abstract_params)
    done = serve(transport, steps, cell.train_mesh, serve_shardings=publisher.shardings(cell, cells.Role.ROLLOUT),
                 on_grad=on_grad)
    say_done(transport, BYE, done)
    return done


def _core(cfg, model, spec, steps, core, transport, workdir) -> dict:
    os.makedirs(workdir, exist_ok=True)
    trainer = cells.ElasticTrainer(steps, core, spec.init_state(jax.random.key(cfg.seed), core.train_mesh),
                                   in_flight=cfg.in_flight)
    remotes = [RemoteCell.connect(transport, p, steps, core.train_mesh) for p in range(1, jax.process_count())]
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    lines = []
    t_run = time.perf_counter()
    gone: list[RemoteCell] = []  # satellites that failed; a restarted one (new hello) rejoins at a step boundary
    for s in range(cfg.steps):
        remotes, gone = _rejoin(cfg, transport, steps, core, remotes, gone)
        report = _one_step(cfg, trainer, core, remotes, micro_batches(cfg, model, s, trainer.version))
        dead = {c for c, _ in report.failed_cells}
        for r in remotes:
            if r.index in dead:  # its server is gone: never connect to it again (a connect could hang)
                transport.forget(r.process)
        gone += [r for r in remotes if r.index in dead]
        remotes = [r for r in remotes if r.index not in dead]
        # Publish the new version to every live satellite's serving layout (as to its engine).
        pubs = [r.link.publish(trainer.state.params, trainer.version, r.index) for r in remotes]
        by_cell = {c: report.cell_of.count(c) for c in sorted(set(report.cell_of))}
        snaps = [dict(cell=m.cell_index, bytes=m.bytes, seconds=m.seconds, gbps=m.gbps) for m in report.snapshots]
        line = dict(step=s, version=report.version, loss=report.loss, grad_norm=report.grad_norm,
                    cell_of=list(report.cell_of), failed_cells=[list(f) for f in report.failed_cells],
                    snapshots=snaps, seconds=report.seconds,
                    published=[dict(cell=m.cell_index, version=m.version, bytes=m.bytes, seconds=m.seconds) for m in pubs],
                    satellites=sorted(r.index for r in remotes))
        lines.append(line)
        with open(metrics_path, "a") as f:
            f.write(json.dumps(line) + "\n")
        pulls = ", ".join(f"cell {m['cell']} {m['bytes'] / 1e6:.2f} MB {m['gbps']:.2f} GB/s" for m in snaps)
        failed_note = f" failed {report.failed_cells}" if report.failed_cells else ""
        pub = ", ".join(f"cell {m.cell_index} {m.bytes / 1e6:.2f} MB {m.seconds:.3f} s" for m in pubs)
        print(f"pods_dp: step {s} loss {report.loss:.6f} grad_norm {report.grad_norm:.4f} micro-batches by cell "
              f"{by_cell} snapshots [{pulls}] published v{trainer.version} [{pub}]{failed_note} {report.seconds:.2f} s",
              flush=True)
    failed = {c for ln in lines for c, _ in ln["failed_cells"]}
    for r in remotes:
        r.link.stop()
    for r in remotes:  # the coordination service lives in this process: live satellites shut down first
        get(transport.kv, BYE.format(process=r.process), timeout_s=120)
        transport.wait_gone(r.process)
    final: dict[str, Any] = flat_params(trainer.state.params)  # savez's stub would take an array for allow_pickle
    np.savez(os.path.join(workdir, "params.npz"), **final)
    summary = dict(steps=cfg.steps, processes=jax.process_count(), seconds=time.perf_counter() - t_run,
                   failed_cells=sorted(failed), final_loss=lines[-1]["loss"])
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"pods_dp: done {json.dumps(summary)}", flush=True)
    return summary


def _rejoin(cfg, transport, steps, core, remotes, gone):
    """Reconnect restarted satellites; with ``min_satellites``, wait (up to ``rejoin_wait_s``) until that many are live."""
    deadline = time.monotonic() + cfg.rejoin_wait_s
    while True:
        for r in list(gone):
            back = RemoteCell.reconnect(transport, r, steps, core.train_mesh)
            if back is not None:
                print(f"pods_dp: satellite {r.index} rejoined (process restarted)", flush=True)
                gone.remove(r)
                remotes = remotes + [back]
        if len(remotes) >= cfg.min_satellites or not gone:
            return remotes, gone
        if time.monotonic() > deadline:
            log.warning("pods_dp: %d satellites live after %.0f s, config.min_satellites=%d; going on without %s",
                        len(remotes), cfg.rejoin_wait_s, cfg.min_satellites, [r.index for r in gone])
            return remotes, gone
        time.sleep(0.5)  # polls the KV store for a restarted satellite's hello


def _one_step(cfg, trainer, core, remotes, mbs):
    """One elastic step: the satellites join after the core has done ``join_after`` micro-batches."""
    cv = threading.Condition()
    core_done = [0]
    remote_pulled: set[int] = set()
    joined = [False]

    expected: set[int] = set()  # satellites that joined with work left for them

    def on_pull(c, i):
        with cv:
            if c != core.index:
                remote_pulled.add(c)
                cv.notify_all()
            elif joined[0] or core_done[0] >= cfg.join_after:
                # Demo pacing: let each joined satellite take one micro-batch before the core goes on.
                ok = cv.wait_for(lambda: joined[0] and remote_pulled >= expected, JOIN_WAIT_S)
                if not ok:
                    raise TimeoutError(f"pods_dp: satellites {[r.index for r in remotes]} took no work in {JOIN_WAIT_S} s")

    def on_done(c, i):
        if c == core.index:
            with cv:
                core_done[0] += 1
                cv.notify_all()

    step = trainer.start_step(mbs, on_pull=on_pull, on_done=on_done)
    with cv:
        cv.wait_for(lambda: core_done[0] >= cfg.join_after, JOIN_WAIT_S)
    for r in remotes:
        if step.join(r):
            with cv:
                expected.add(r.index)
    with cv:
        joined[0] = True
        cv.notify_all()
    return step.wait()
