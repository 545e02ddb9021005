"""Benchmark: the weight moves of a role switch, against a plain device-to-device copy.

Two cells of 4 CPU devices each (8 host devices). The core cell holds the
model's params in the training layout (fsdp=4 over 'embed'). We time, from
dispatch until the target cell holds every byte:

  * to_train   (rollout -> train): snapshot of the core's params onto the
               satellite in the training layout (what a satellite joining a step
               receives, gyre_jax.cells.elastic);
  * to_rollout (train -> rollout): publication of the core's params onto the
               satellite in the serving layout (tensor=4 over heads/mlp/vocab),
               a real reshard, not just a copy;
  * plain copy: float32 arrays of the same total bytes (64 MB each, close to
               the params' shard sizes), sharded over the core's 4 devices, copied
               to the same sharding on the satellite's 4 devices in one batched
               device_put. Same bytes, same devices, no layout change: the limit.

  * cross_process: the same params pulled by another process (a satellite
               cell of 4 CPU devices, its own JAX program) from the core's
               process, in the training layout, on gyre_jax.pods' transport
               (jax.experimental.transfer over loopback, control on the
               jax.distributed KV store). Two child processes of 4 devices each
               (--cross_process 0 skips them); cross_process_gbps = param bytes /
               median pull seconds (offer to every byte on the satellite's devices).
               Target: >= 0.3 x plain copy.

Each kind of move runs in blocks of --repeats, the kinds alternating over
--rounds; times are medians over all blocks. The first move of each kind is
shown apart (it includes one-time work such as compiling the slices of a
reshard). Each role-switch move starts with the cell holding
nothing for its old role, as in a real switch (the plain copy likewise). copy_gbps uses
the slower of the two moves: param_bytes / max(to_train_s, to_rollout_s).
Target: copy_gbps >= 0.5 * plain_copy_gbps.

    python tools/bench_role_switch.py     # ~490 MB model, ~1.5 min on 2 cores; ~3 GB of host memory in all
    python tools/bench_role_switch.py --n_layers 2 --vocab 8192   # smaller, faster
"""
from __future__ import annotations

import os
import sys

import jax

# Before any backend use: 8 host devices = two cells of 4 (a cross-process peer: 4, after its initialize).
PEER = "--_peer" in sys.argv
if not PEER:
    jax.config.update("jax_num_cpu_devices", 8)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import jax.numpy as jnp  # noqa: E402
from flax import linen as nn  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

# Run from a checkout without installing: put the repo root on the path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gyre_jax import cells  # noqa: E402
from gyre_jax.cells import Role  # noqa: E402
from gyre_jax.model import ModelConfig, init_boxed, param_logical_axes  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--d_model", type=int, default=1024)
    p.add_argument("--n_layers", type=int, default=8)
    p.add_argument("--n_heads", type=int, default=16)
    p.add_argument("--n_kv_heads", type=int, default=4, help="must divide by the serving tensor degree (4)")
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--d_ff", type=int, default=2816)
    p.add_argument("--repeats", type=int, default=5, help="timed moves per block")
    p.add_argument("--rounds", type=int, default=3, help="blocks of each kind, alternating")
    p.add_argument("--cross_process", type=int, default=1, help="1: also time the move between two processes")
    p.add_argument("--_peer", nargs=2, type=int, metavar=("PROCESS_ID", "PORT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def model_config(args) -> ModelConfig:
    return ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                       n_kv_heads=args.n_kv_heads, head_dim=args.head_dim, d_ff=args.d_ff, tie_embeddings=False)


def cross_process(args, argv) -> dict:
    """Start the two peer processes (core, satellite); the satellite's pull times, as the core prints them."""
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv, "--_peer", str(i), str(port)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    try:
        outs = [p.communicate(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, (p, (out, err)) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            raise RuntimeError(f"cross-process peer {i} exited {p.returncode}:\n{err[-3000:]}")
    line = [ln for ln in outs[0][0].splitlines() if ln.startswith("PEER ")]
    return json.loads(line[-1][len("PEER "):])


def peer(args) -> None:
    """One of the two cross-process peers: 0 = core (offers its params), 1 = satellite (pulls them)."""
    from gyre_jax import distributed
    from gyre_jax.pods.transport import Mailbox, Transport, abstract, get

    pid, port = args._peer
    distributed.initialize(distributed.DistributedConfig(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid))
    jax.config.update("jax_num_cpu_devices", 4)
    t = Transport()
    (cell,) = cells.split_cells(cells.CellConfig(cell_size=4, train_tensor=1, serve_tensor=4), jax.local_devices())
    model = model_config(args)
    spec = cells.StateSpec.create(functools.partial(init_boxed, model), cells.make_optimizer(
        cells.OptimizerConfig(learning_rate=1e-4), param_logical_axes(model)))
    shardings = spec.param_shardings(cell.train_mesh)
    n = 1 + args.rounds * args.repeats
    if pid == 0:
        params = jax.jit(lambda r: nn.unbox(init_boxed(model, r)), out_shardings=shardings)(jax.random.key(0))
        params = jax.block_until_ready(params)
        mail = Mailbox(t.kv, 1)
        for _ in range(n):  # offered at once: the server only keeps references until each is pulled
            uuid = t.new_uuid()
            t.offer(uuid, params)
            mail.send({"uuid": uuid})
        times = json.loads(get(t.kv, "bench/pull_times", timeout_s=900))
        print("PEER " + json.dumps({"param_bytes": cells.tree_bytes(params), "times": times}), flush=True)
    else:
        mail = Mailbox(t.kv, 1)
        like = abstract(spec.abstract_params, shardings)
        times = []
        for _ in range(n):
            uuid = mail.recv(timeout_s=900)["uuid"]
            out, st = t.pull_ready(0, uuid, like)
            times.append(st.seconds)
            del out
        t.kv.key_value_set("bench/pull_times", json.dumps(times))


def timed(fn):
    """Seconds of ``fn()``, which blocks until its copy is complete; the copy is dropped after."""
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    del out
    return dt


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args._peer is not None:
        peer(args)
        return
    model = model_config(args)
    core, sat = cells.split_cells(cells.CellConfig(cell_size=4, train_tensor=1, serve_tensor=4))
    logical = param_logical_axes(model)
    spec = cells.StateSpec.create(functools.partial(init_boxed, model), cells.make_optimizer(
        cells.OptimizerConfig(learning_rate=1e-4), logical))
    publisher = cells.WeightPublisher(spec.logical_params, spec.abstract_params)

    t0 = time.perf_counter()
    params = jax.jit(lambda r: nn.unbox(init_boxed(model, r)), out_shardings=spec.param_shardings(core.train_mesh))(
        jax.random.key(0)
    )
    params = jax.block_until_ready(params)
    param_bytes = cells.tree_bytes(params)
    n_leaves = len(jax.tree.leaves(params))
    print(f"model: {param_bytes / 1e6:.0f} MB in {n_leaves} arrays, born sharded on the core "
          f"in {time.perf_counter() - t0:.1f} s", flush=True)

    # The limit: the same bytes as plain float32 arrays of 64 MB (16 MB per shard, about
    # the params' shard sizes, so both sides see the same allocator behaviour), same
    # sharding on both sides, copied in one batched device_put.
    chunk = 16 * 1024 * 1024  # floats per array
    n = param_bytes // 4
    sizes = [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])
    src_sharding = NamedSharding(core.train_mesh, P("fsdp"))
    src = [
        jax.jit(functools.partial(jnp.ones, (4, s // 4), jnp.float32), out_shardings=src_sharding)()
        for s in sizes
    ]
    src = jax.block_until_ready(src)
    dst_sharding = NamedSharding(sat.train_mesh, P("fsdp"))
    plain_bytes = sum(x.size * 4 for x in src)

    version = [0]

    def switch(role):
        # A role switch: the cell has already dropped what it held for its old role
        # (publisher.forget, outside the timing, as for the plain copy's del).
        version[0] += 1
        return publisher.publish(params, version[0], sat, role).params

    moves = {
        "plain": lambda: jax.block_until_ready(jax.device_put(src, dst_sharding)),
        "to_train": lambda: switch(Role.TRAIN),
        "to_rollout": lambda: switch(Role.ROLLOUT),
    }
    # Blocks of --repeats moves of one kind (the allocator settles into each pattern),
    # the three kinds alternating over --rounds so load changes on a shared machine hit
    # all alike. The very first move of each kind includes one-time work (compiling the
    # slices of a reshard) and is shown apart; so is each block's settling move.
    times: dict[str, list[float]] = {k: [] for k in moves}
    first: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, fn in moves.items():
            publisher.forget(sat)
            dt = timed(fn)
            first.setdefault(name, dt)
            for _ in range(args.repeats):
                publisher.forget(sat)
                times[name].append(timed(fn))
    publisher.forget(sat)
    med = {k: statistics.median(v) for k, v in times.items()}
    mins = {k: min(v) for k, v in times.items()}
    to_train_s, to_rollout_s, plain_s = med["to_train"], med["to_rollout"], med["plain"]

    gb = 1e9
    rows_out = [
        ("to_train (rollout->train)", "train fsdp=4 -> train fsdp=4", param_bytes, "to_train"),
        ("to_rollout (train->rollout)", "train fsdp=4 -> serve tensor=4", param_bytes, "to_rollout"),
        ("plain device-to-device copy", f"{len(src)} arrays, same sharding", plain_bytes, "plain"),
    ]
    print(f"\n{'move':30s} {'layouts':34s} {'MB':>7s} {'first s':>8s} {'median s':>9s} {'min s':>7s} {'GB/s':>6s}")
    for name, lay, b, k in rows_out:
        print(f"{name:30s} {lay:34s} {b / 1e6:7.1f} {first[k]:8.3f} {med[k]:9.4f} {mins[k]:7.4f} {b / med[k] / gb:6.2f}")
    copy_gbps = param_bytes / max(to_train_s, to_rollout_s) / gb
    plain_gbps = plain_bytes / plain_s / gb
    ratio = copy_gbps / plain_gbps
    print(f"\ncopy_gbps (slower move) = {copy_gbps:.2f} GB/s = {ratio:.2f} x plain copy "
          f"({'meets' if ratio >= 0.5 else 'MISSES'} target 0.5x)")
    xp = {}
    if args.cross_process:
        del src, params  # the peers hold their own copies
        res = cross_process(args, argv)
        xt = res["times"][1:]
        xp = {"cross_process_s": statistics.median(xt), "cross_process_first_s": res["times"][0],
              "cross_process_gbps": res["param_bytes"] / statistics.median(xt) / gb}
        xr = xp["cross_process_gbps"] / plain_gbps
        print(f"cross-process pull (train fsdp=4 in process 0 -> train fsdp=4 in process 1): {res['param_bytes'] / 1e6:.1f} MB, "
              f"first {res['times'][0]:.3f} s, median {xp['cross_process_s']:.4f} s, min {min(xt):.4f} s, "
              f"{xp['cross_process_gbps']:.2f} GB/s = {xr:.2f} x plain copy ({'meets' if xr >= 0.3 else 'MISSES'} target 0.3x)")
        xp = {k: round(v, 4) for k, v in xp.items()} | {"cross_process_ratio": round(xr, 3)}
    print(json.dumps({
        "param_bytes": int(param_bytes),
        "to_train_s": round(to_train_s, 5),
        "to_rollout_s": round(to_rollout_s, 5),
        "copy_gbps": round(copy_gbps, 3),
        "plain_copy_gbps": round(plain_gbps, 3),
        "ratio": round(ratio, 3),
        "to_train_first_s": round(first["to_train"], 4),
        "to_rollout_first_s": round(first["to_rollout"], 4),
        "n_arrays": n_leaves,
        "devices_per_cell": 4,
        **xp,
    }))


if __name__ == "__main__":
    main()
