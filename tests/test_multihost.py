"""Multi-process JAX: the launcher on two real processes over loopback (gloo), and gyre_jax.distributed.

``test_launcher_two_processes_match_one`` starts ``python -m launch.main`` twice
(``--coordinator_address/--num_processes/--process_id``) on the data-parallel
``train_synthetic`` job and compares it with one process of 4 devices.

``test_two_processes_on_loopback`` covers what the job does not: env detection
(JAX_COORDINATOR_ADDRESS/...), collectives on a hand-built global array, and one
Orbax checkpoint (Checkpointer) written by both processes and restored onto
another layout. Its worker is this file: ``python tests/test_multihost.py PORT
PROCESS_ID MODE CKPT_DIR`` starts one process with 2 CPU devices; MODE 'flags'
passes the coordinator in the config, MODE 'env' leaves the config empty and
sets JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID.
"""
import ipaddress
import json
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

from gyre_jax.distributed import DistributedConfig, detect_cluster, initialize, layout, maybe_initialize

ROWS, COLS, LOCAL_DEVICES = 2, 3, 2


def local_rows(pid):
    """This process's rows of the global [2 * ROWS, COLS] array (distinct per process)."""
    return (np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS) + 10.0 * pid) * (pid + 1)


def test_single_process_is_a_noop():
    import jax

    info = maybe_initialize(None)
    assert (info.process_index, info.process_count, info.initialized_here, info.how) == (0, 1, False, "single")
    assert info.global_device_count == len(jax.devices())
    info = maybe_initialize({"num_processes": 1}, env={})
    assert info.how == "single" and not jax.distributed.is_initialized()
    # A launcher environment that says "one task" is still a single process.
    assert maybe_initialize(None, env={"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "n", "SLURM_NTASKS": "1",
                                       "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}).how == "single"


def test_detect_cluster_from_env():
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}
    assert detect_cluster(slurm) == "slurm"
    assert detect_cluster({**slurm, "SLURM_NTASKS": "1"}) is None
    assert detect_cluster({k: v for k, v in slurm.items() if k != "SLURM_PROCID"}) is None
    assert detect_cluster({"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "4"}) == "ompi"
    assert detect_cluster({"TPU_WORKER_HOSTNAMES": "h0,h1"}) == "tpu"
    assert detect_cluster({"TPU_WORKER_HOSTNAMES": "h0"}) is None
    assert detect_cluster({"JAX_COORDINATOR_ADDRESS": "a:1", "JAX_NUM_PROCESSES": "2"}) == "jax_env"
    assert detect_cluster({}) is None


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="go together"):
        DistributedConfig(coordinator_address="127.0.0.1:1234")
    with pytest.raises(ValueError, match="must be 'host:port'"):
        DistributedConfig(coordinator_address="localhost", num_processes=2, process_id=0)
    with pytest.raises(ValueError, match="process_id=2 must be < num_processes=2"):
        DistributedConfig(coordinator_address="h:1", num_processes=2, process_id=2)
    with pytest.raises(ValueError, match="cluster='slrum'"):
        DistributedConfig(cluster="slrum")
    with pytest.raises(ValueError, match=r"unknown keys \['num_process'\]"):
        DistributedConfig.from_mapping({"num_process": 2})
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES and JAX_PROCESS_ID must be ints"):
        maybe_initialize(None, env={"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"})
    # The test process's backend is running (conftest): initializing now would be too late.
    with pytest.raises(RuntimeError, match="backend is already running"):
        maybe_initialize(DistributedConfig(coordinator_address="127.0.0.1:1", num_processes=2, process_id=0))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child_env():
    """The test's environment minus its device count and any JAX_* coordinator: children set their own."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROC", "JAX_PROCESS")) and k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def _finish(procs, timeout=180):
    """(stdout, stderr) of each process; every one must exit 0. Kills the rest on failure."""
    outs = []
    try:
        for i, p in enumerate(procs):
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{out[-2000:]}\n{err[-4000:]}"
            outs.append((out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


LAUNCH_LINE = re.compile(r"^launch: process (\d+) of (\d+) \((\S+)\): (\d+) local devices \(cpu\), (\d+) global;", re.M)
STEPS = 4
# A tiny train_synthetic: 4 rows (one per device), a few steps; every field is a --config flag.
SMALL = ["--config=configs/synthetic_train.py", f"--config.steps={STEPS}", "--config.log_every=2", "--config.rows=4",
         "--config.row_len=64", "--config.prompt_len=8", "--config.node_len=4", "--config.model.d_model=32",
         "--config.model.head_dim=8", "--config.model.d_ff=64", "--config.model.max_seq_len=64",
         "--config.save_params=True"]


_LISTEN = """
import os, socket, sys, threading, time
from gyre_jax import distributed
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
host = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1"
if host == "slurm":  # one node of a 2-task SLURM job, found by --cluster=auto: JAX's detection names the node
    os.environ.update(SLURM_JOB_ID="7", SLURM_STEP_NODELIST=socket.gethostname(), SLURM_NTASKS="2", SLURM_PROCID="0",
                      SLURM_LOCALID="0", JAX_COORDINATOR_PORT=str(port))
    cfg = distributed.DistributedConfig(initialization_timeout_s=60)
else:
    cfg = distributed.DistributedConfig(coordinator_address=f"{host}:{port}", num_processes=2, process_id=0,
                                        initialization_timeout_s=60)
threading.Thread(target=distributed.initialize, args=(cfg,), daemon=True).start()
want = f"{port:04X}"
for _ in range(400):  # the coordinator listens before it waits for process 1
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in open(table).read().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            if state == "0A" and local.endswith(":" + want):
                found.append(local.split(":")[0])
    if found:
        print(",".join(found), flush=True)
        os._exit(0)
    time.sleep(0.05)
os._exit(3)
"""
# 127.0.0.1 in /proc/net/tcp's byte order, or as ::ffff:127.0.0.1 in tcp6 (not [::], all zeros)
_LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F"}


def _listening(host: str | None = None) -> set[str]:
    env = {"PYTHONPATH": os.getcwd(), **{k: v for k, v in os.environ.items() if k != "JAX_COORDINATOR_BIND_ADDRESS"
                                         and not k.startswith("SLURM_")}}
    proc = subprocess.run([sys.executable, "-c", _LISTEN, *([host] if host else [])], capture_output=True, text=True,
                          timeout=300, env=env)  # JAX imports slowly on a loaded host
    assert proc.returncode == 0, proc.stderr[-2000:]
    return set(proc.stdout.split()[-1].split(","))


def test_coordinator_binds_the_address_it_was_given():
    # A coordinator at 127.0.0.1 listens on loopback only (JAX's default is every interface:
    # anyone reaching the host could join or stall the run).
    from gyre_jax.distributed import bind_address
    assert _listening() <= _LOOPBACK
    assert bind_address("10.0.0.5:1234", None, {}) == "10.0.0.5:1234"
    assert bind_address("[::1]:1234", None, {}) == "[::1]:1234"
    assert bind_address("localhost:1234", None, {}) == "localhost:1234"
    assert bind_address("node0.invalid:1234", None, {}) is None  # a name of no address here: JAX's default
    assert bind_address("127.0.0.1:1234", None, {"JAX_COORDINATOR_BIND_ADDRESS": "[::]:1"}) is None
    assert bind_address("127.0.0.1:1234", "0.0.0.0:1234", {}) == "0.0.0.0:1234"


@pytest.mark.parametrize("how", ["hostname", "slurm"])
def test_a_coordinator_named_by_host_name_binds_that_hosts_address_not_every_interface(how):
    """A coordinator named by a host name (a JobSet service, this machine's name) or found by SLURM's detection
    (its first node's name) bound every interface ([::], JAX's default for anything but an address): it binds
    the address of this host the name resolves to (here the machine's name is a loopback alias)."""
    try:
        local = socket.gethostbyname(socket.gethostname())
        socket.create_server((local, 0)).close()
    except OSError:
        pytest.skip(f"this host's name {socket.gethostname()!r} resolves to no address of its own")
    got = _listening(socket.gethostname() if how == "hostname" else "slurm")
    assert "0" * 8 not in got and "0" * 32 not in got, got  # not 0.0.0.0, not [::]
    if ipaddress.ip_address(local).is_loopback:
        assert got <= _LOOPBACK, got


@pytest.mark.slow  # ~20 s; test_two_processes_on_loopback keeps two real processes in the default run
def test_launcher_two_processes_match_one(tmp_path):
    """``python -m launch.main`` as 2 processes x 2 CPU devices trains like 1 process x 4 devices.

    Same job, same config, same global mesh of 4 devices; only the process
    layout differs. Checked: both processes exit 0 and report their index, 2
    local and 4 global devices; only process 0 writes files; per step the same
    batches and accuracy, the loss and gradient norm to 2 ulps, and the final
    params to 1e-6 (they move ~1e-2 in these steps: a wrong row, shard or
    reduction would be off by orders more). Not bit for bit: gradients, loss
    and norm are all-reduced over the 4 devices, summed in XLA's in-process
    order in one process and in gloo's order across processes; float32
    addition is not associative, so last bits may differ (measured Dec 2 on an
    AMD EPYC host: 1 ulp in loss and norm, params within 6e-8; Nov's host
    happened to round alike).
    """
    port = _free_port()
    env = _child_env()
    launch = [sys.executable, "-m", "launch.main", *SMALL]
    run = lambda args: subprocess.Popen(launch + args, env=env, cwd=ROOT, stdout=subprocess.PIPE,  # noqa: E731
                                        stderr=subprocess.PIPE, text=True)
    procs = [run(["--config.num_cpu_devices=2", f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                  f"--process_id={i}", f"--workdir={tmp_path / f'p{i}'}", "--distributed_timeout_s=120"]) for i in (0, 1)]
    procs.append(run(["--config.num_cpu_devices=4", f"--workdir={tmp_path / 'single'}"]))
    outs = _finish(procs)
    layouts = [LAUNCH_LINE.findall(out) for out, _ in outs]
    assert layouts == [[("0", "2", "explicit", "2", "4")], [("1", "2", "explicit", "2", "4")],
                       [("0", "1", "single", "4", "4")]], [out[-2000:] for out, _ in outs]
    assert not (tmp_path / "p1").exists()  # process 1 trains but writes nothing (and prints no progress)
    assert "train_synthetic: loss" not in outs[1][0] and "train_synthetic: loss" in outs[0][0]
    read = lambda d: [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    multi, single = read("p0"), read("single")
    assert [r["step"] for r in multi] == [r["step"] for r in single] == list(range(STEPS))
    assert [r["accuracy"] for r in multi] == [r["accuracy"] for r in single]
    for key in ("loss", "grad_norm"):
        np.testing.assert_array_max_ulp(np.float32([r[key] for r in multi]), np.float32([r[key] for r in single]),
                                        maxulp=2)
    assert [r["trainable_tokens"] for r in multi] == [r["trainable_tokens"] for r in single]  # same batches
    final_multi, final_single = np.load(tmp_path / "p0" / "params.npz"), np.load(tmp_path / "single" / "params.npz")
    assert sorted(final_multi) == sorted(final_single) and len(final_single) > 5
    for name in final_single:
        np.testing.assert_allclose(final_multi[name], final_single[name], rtol=0, atol=1e-6, err_msg=name)


def test_two_processes_on_loopback(tmp_path):  # two real processes, a few seconds: in the default run
    port = _free_port()
    ckpt_dir = tmp_path / "ckpt"  # both processes write one checkpoint of the global array here
    root = ROOT
    base = _child_env()  # the worker sets its device count itself, after initialize
    procs = []
    for pid, mode in ((0, "flags"), (1, "env")):
        env = dict(base)
        if mode == "env":
            env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(pid))
        procs.append(subprocess.Popen([sys.executable, __file__, str(port), str(pid), mode, str(ckpt_dir)], env=env, cwd=root,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = {}
    try:
        for pid, p in enumerate(procs):
            out, err = p.communicate(timeout=180)
            assert p.returncode == 0, f"process {pid} exited {p.returncode}:\n{err[-4000:]}"
            line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            assert line, f"process {pid} printed no RESULT:\n{out}\n{err[-2000:]}"
            results[pid] = json.loads(line[-1][len("RESULT "):])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    want_sum = float(np.concatenate([local_rows(0), local_rows(1)]).astype(np.float64).sum())
    want_rows = np.concatenate([local_rows(0), local_rows(1)]).sum(axis=1).tolist()
    for pid in (0, 1):
        r = results[pid]
        assert (r["process_index"], r["process_count"]) == (pid, 2)
        assert (r["local_devices"], r["global_devices"]) == (LOCAL_DEVICES, 2 * LOCAL_DEVICES)
        assert r["how"] == ("explicit" if pid == 0 else "detected:jax_env")
        assert not r["started_by_initialize"]  # jax.distributed.initialize leaves the backend to the job
        assert r["sum"] == want_sum  # small integers in float32: exact
        assert r["row_sums"] == want_rows
        assert r["gathered_ids"] == [0, 1]
        assert r["restored_equal"] and r["restored_sharding"] == "P(None, 'x')"
    assert sorted(os.listdir(ckpt_dir)) == ["1"]


def worker(port, pid, mode, ckpt_dir):
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    cfg = DistributedConfig(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid) if mode == "flags" else None
    how = initialize(cfg)
    from jax._src import xla_bridge

    started_by_initialize = xla_bridge.backends_are_initialized()
    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)  # still possible: initialize left the backend alone
    info = layout(how)
    mesh = Mesh(np.array(jax.devices()), ("x",))  # all 4 devices of both processes
    g = multihost_utils.host_local_array_to_global_array(local_rows(pid), mesh, P("x"))
    assert g.shape == (2 * ROWS, COLS), g.shape
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(g)
    rows = jax.jit(lambda a: a.sum(axis=1), out_shardings=NamedSharding(mesh, P()))(g)
    ids = multihost_utils.process_allgather(np.int32(info.process_index))

    # One checkpoint written by both processes (each its shards; JSON items by process 0),
    # restored onto another layout (columns instead of rows over the 4 devices).
    from gyre_jax.rl.checkpoint import CheckpointConfig, Checkpointer, abstract_like

    g2 = jax.jit(lambda a: jnp.tile(a, (1, 4)), out_shardings=NamedSharding(mesh, P("x")))(g)  # [4, 12]
    v = jax.device_put(jnp.int32(7), NamedSharding(mesh, P()))
    with Checkpointer(CheckpointConfig(directory=ckpt_dir)) as ck:
        try:  # a process-local leaf cannot be saved by several processes: named, not Orbax's deep error
            ck.save(0, train_state={"w": g2, "local": jnp.int32(7)}, rng=jax.random.key(3), store_cursor={"consumed": {}})
            local_error = ""
        except ValueError as e:
            local_error = str(e)
        ck.save(1, train_state={"w": g2, "v": v}, rng=jax.random.key(3), store_cursor={"consumed": {}},
                buffer=["r1"], meta={"pid_saved": 0})
    col = NamedSharding(mesh, P(None, "x"))
    target = abstract_like({"w": g2, "v": jnp.int32(7)}, {"w": col, "v": NamedSharding(mesh, P())})
    with Checkpointer(CheckpointConfig(directory=ckpt_dir)) as ck:
        r = ck.restore_latest(target)
    w = r.train_state["w"]
    want = np.tile(np.concatenate([local_rows(0), local_rows(1)]), (1, 4))
    equal = all(np.array_equal(np.asarray(s.data), want[s.index]) for s in w.addressable_shards)
    equal = equal and int(r.train_state["v"]) == 7 and r.buffer == ["r1"]
    equal = equal and "['local']" in local_error and "process-local" in local_error
    print("RESULT " + json.dumps({
        "started_by_initialize": started_by_initialize, "process_index": info.process_index, "process_count": info.process_count, "how": info.how,
        "local_devices": len(info.local_devices), "global_devices": info.global_device_count,
        "sum": float(total), "row_sums": np.asarray(rows).tolist(), "gathered_ids": np.asarray(ids).tolist(),
        "restored_equal": bool(equal), "restored_sharding": str(w.sharding.spec),
    }), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
