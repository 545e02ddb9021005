"""Benchmark: host memory and speed of loading a sharded HF checkpoint onto a device mesh.

Writes a Qwen3-shaped checkpoint (default: Qwen3-0.6B's shapes -- vocab 151936, d 1024,
28 layers, 16 q / 8 kv heads of 128, MLP 3072, tied -- random bf16, ~1.2 GB) split into
safetensors shards of at most --shard_mb plus model.safetensors.index.json, then loads
it in a fresh child process two ways onto 8 host devices as (fsdp=4, tensor=2):

  * stream (gyre_jax.model.hf.load_pretrained): one tensor at a time from disk onto its
    sharding, per-layer tensors written into the stacked [layers, ...] params on device;
  * naive (the usual baseline): ``safetensors.numpy.load_file`` every shard into a host
    dict, stack the layers on the host, then ``jax.device_put`` the whole tree.

Host memory: on CPU the "devices" live in host memory too, so RSS grows by the model
either way. What the loader itself holds on the host is measured with tracemalloc
(numpy reports its buffers to it; XLA's device buffers are not Python allocations), and
the RSS numbers are printed beside it: peak RSS minus the RSS once loading finished
(what was transient). On GPU/TPU the whole RSS rise is host staging and is what the JSON
reports there. Target: peak_host_over_largest_shard < 1.5 (stream).

    python tools/bench_hf_load.py                  # ~1.2 GB checkpoint, ~1 min on 2 cores, ~3.5 GB RSS peak (naive)
    python tools/bench_hf_load.py --layers 4 --vocab 32000   # small
    python tools/bench_hf_load.py --quick                    # a smoke run: 2 layers, vocab 512, d 64
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import benchkit


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class _RssPeak:
    """Samples VmRSS every 2 ms on a thread (ru_maxrss cannot be reset between phases)."""

    def __init__(self):
        self.peak, self._stop = _rss(), threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.002)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())


def write_checkpoint(path, args):
    import ml_dtypes
    import numpy as np

    from gyre_jax.model.hf.config_map import config_from_hf, hf_config
    from gyre_jax.model.hf.st_io import write_safetensors
    from gyre_jax.model.hf.tensors import entries
    from gyre_jax.testing.tiny_hf_checkpoint import tiny_hf_config

    hf = tiny_hf_config("qwen3", vocab_size=args.vocab, hidden_size=args.d_model, layers=args.layers, heads=16,
                        kv_heads=8, head_dim=128, intermediate_size=args.d_ff, tie=True, dtype="bfloat16")
    cfg = config_from_hf(hf)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    specs = []
    for e in entries(cfg):
        for i in range(cfg.n_layers) if e.per_layer else [None]:
            specs.append((e.name(i), e.hf_shape))
    shards, cur, size = [], [], 0
    for name, shape in specs:
        nb = int(np.prod(shape)) * 2
        if cur and size + nb > args.shard_mb * 2**20:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += nb
    shards.append(cur)
    rng = np.random.default_rng(0)
    wm, sizes = {}, []
    for j, sh in enumerate(shards):
        fn = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
        gen = ((rng.standard_normal(shape, np.float32) * 0.02).astype(bf16) for _, shape in sh)
        write_safetensors(os.path.join(path, fn), [(n, s, bf16) for n, s in sh], gen)
        wm.update({n: fn for n, _ in sh})
        sizes.append(os.path.getsize(os.path.join(path, fn)))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(sizes)}, "weight_map": wm}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config(cfg, hf), f)
    return sizes


def child(path, mode):
    """Runs in a fresh process: load once, print one JSON line of measurements."""
    import tracemalloc

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    from jax.sharding import Mesh

    from gyre_jax.cells.mesh import FSDP, TENSOR
    from gyre_jax.model.hf import load_pretrained

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), (FSDP, TENSOR))
    jax.jit(lambda x: x + 1)(np.zeros(4))  # backend up before the baseline
    base = _rss()
    tracemalloc.start()
    with _RssPeak() as peak, benchkit.Stopwatch() as sw:
        if mode == "stream":
            _, params = load_pretrained(path, mesh=mesh)
        else:
            params = _naive(path, mesh)
        jax.block_until_ready(params)
    dt = sw.s
    _, py_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    dev = sum(x.nbytes for x in jax.tree.leaves(params))
    print(json.dumps(dict(mode=mode, seconds=dt, py_peak=py_peak, rss_base=base, rss_peak=peak.peak, rss_end=_rss(),
                          device_bytes=dev, backend=jax.default_backend())), flush=True)


def _naive(path, mesh):
    import jax
    import numpy as np
    from safetensors.numpy import load_file

    from gyre_jax.model.hf.checkpoint import read_config
    from gyre_jax.model.hf.config_map import config_from_hf
    from gyre_jax.model.hf.tensors import entries
    from gyre_jax.model.transformer import init_params, param_logical_axes
    from gyre_jax.sharding import tree_shardings

    cfg = config_from_hf(read_config(path))
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    host = {}
    for fn in files:
        host.update(load_file(os.path.join(path, fn)))
    tree: dict = {}
    for e in entries(cfg):
        if e.per_layer:
            a = np.stack([e.to_ours(host[e.name(i)]) for i in range(cfg.n_layers)])
        else:
            a = e.to_ours(host[e.name()])
        node = tree
        for k in e.path[:-1]:
            node = node.setdefault(k, {})
        node[e.path[-1]] = a
    abstract = jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))["params"]
    sh = tree_shardings(param_logical_axes(cfg)["params"], mesh, abstract)
    return {"params": jax.device_put(tree, sh)}


def main(argv=None) -> dict | None:
    bench = benchkit.Bench(__file__, __doc__, quick=dict(layers=2, vocab=512, d_model=64, d_ff=128, shard_mb=1))
    p = bench.parser
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--d_model", type=int, default=1024)
    p.add_argument("--d_ff", type=int, default=3072)
    p.add_argument("--shard_mb", type=int, default=300)
    p.add_argument("--skip_naive", action="store_true")
    p.add_argument("--_child", nargs=2, metavar=("PATH", "MODE"), help=argparse.SUPPRESS)
    args = bench.parse(argv)
    if args._child:
        return child(*args._child)
    with tempfile.TemporaryDirectory(prefix="gyre_hf_bench_") as d:
        sizes, write_s = benchkit.timed(write_checkpoint, d, args)
        total, largest = sum(sizes), max(sizes)
        print(f"checkpoint: Qwen3-shaped, {args.layers} layers, vocab {args.vocab}, d {args.d_model}, bf16; "
              f"{len(sizes)} shards, {total / 2**20:.0f} MiB total, largest {largest / 2**20:.0f} MiB "
              f"(written in {write_s:.1f}s)", flush=True)
        res = {}
        for mode in ["stream"] + ([] if args.skip_naive else ["naive"]):
            out = subprocess.run([sys.executable, __file__, "--_child", d, mode], capture_output=True, text=True,
                                 check=True, env={**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "")})
            res[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\n{'mode':8} {'load_s':>7} {'GB/s':>6} {'host_peak_MiB':>14} {'x_largest':>10} {'rss_rise_MiB':>13} "
          f"{'rss_transient_MiB':>18} {'device_MiB':>11}")
    for mode, r in res.items():
        rise, trans = r["rss_peak"] - r["rss_base"], r["rss_peak"] - r["rss_end"]
        print(f"{mode:8} {r['seconds']:7.1f} {total / r['seconds'] / 1e9:6.2f} {r['py_peak'] / 2**20:14.0f} "
              f"{r['py_peak'] / largest:10.2f} {rise / 2**20:13.0f} {trans / 2**20:18.0f} {r['device_bytes'] / 2**20:11.0f}")
    s = res["stream"]
    on_cpu = s["backend"] == "cpu"
    host_peak = s["py_peak"] if on_cpu else s["rss_peak"] - s["rss_base"]
    final = dict(
        peak_host_over_largest_shard=round(host_peak / largest, 3),
        host_measure="tracemalloc (numpy host buffers; CPU devices share host RAM)" if on_cpu else "RSS rise",
        rss_transient_over_largest_shard=round((s["rss_peak"] - s["rss_end"]) / largest, 3),
        load_s=round(s["seconds"], 2), load_gbps=round(total / s["seconds"] / 1e9, 3),
        checkpoint_mib=round(total / 2**20), largest_shard_mib=round(largest / 2**20), shards=len(sizes),
        layers=args.layers, vocab=args.vocab, d_model=args.d_model,
    )
    if "naive" in res:
        n = res["naive"]
        final.update(naive_peak_host_over_largest_shard=round(n["py_peak"] / largest, 3),
                     naive_load_s=round(n["seconds"], 2))
    return bench.emit(final, sizes=dict(layers=args.layers, vocab=args.vocab, d_model=args.d_model, d_ff=args.d_ff,
                                        shard_mb=args.shard_mb, shards=len(sizes), checkpoint_mib=round(total / 2**20),
                                        skip_naive=args.skip_naive))


if __name__ == "__main__":
    main()
