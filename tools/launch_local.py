"""Start N processes of ``python -m launch.main`` on this machine, as a cluster launcher would.

    python tools/launch_local.py -n 3 -- --config configs/pods_dp.py --workdir /tmp/pods_dp

Each process gets ``--coordinator_address=127.0.0.1:PORT --num_processes=N
--process_id=I`` (a free port unless ``--port``) and ``JAX_NUM_CPU_DEVICES``
host devices (``--devices_per_process``, default 2; for a config with a
``num_cpu_devices`` field the launcher passes ``--config.num_cpu_devices=D`` too,
unless the flags set it: the RL demo's 8 devices in one process become N
processes of D, one cell each). Their stdout and stderr are streamed line by line
with a ``[pI]`` prefix. If a process exits non-zero, every other one is killed
and this launcher exits with that code, unless the process is listed in
``--expendable`` (satellites whose death the run survives: the launcher logs it
and goes on). Each process's pid is printed at start (``launch_local: process I
pid P``) so a test can kill one.

On a cluster, the same per-process command comes from the cluster's launcher:
SLURM (``srun``, one task per host; ``--cluster=auto`` reads SLURM_*) or a
Kubernetes JobSet (one pod per host, JAX_COORDINATOR_ADDRESS etc. in its env).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import benchkit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with_device_flag(flags: list[str], devices: int) -> list[str]:
    """``flags`` plus ``--config.num_cpu_devices=devices`` when the config has that field and the flags leave it."""
    import importlib.util

    if any(f.startswith("--config.num_cpu_devices") for f in flags):
        return flags
    path = next((f.split("=", 1)[1] for f in flags if f.startswith("--config=")), None)
    if path is None and "--config" in flags and flags.index("--config") + 1 < len(flags):
        path = flags[flags.index("--config") + 1]
    if path is None:
        return flags
    spec = importlib.util.spec_from_file_location("_launch_local_config", os.path.join(ROOT, path))
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, ROOT)
    try:
        spec.loader.exec_module(mod)
        has = "num_cpu_devices" in mod.get_config()
    finally:
        sys.path.remove(ROOT)
    return [*flags, f"--config.num_cpu_devices={devices}"] if has else flags


def _stream(i: int, pipe, lock: threading.Lock) -> None:
    for line in iter(pipe.readline, ""):
        with lock:
            sys.stdout.write(f"[p{i}] {line}")
            sys.stdout.flush()
    pipe.close()


def launch(n: int, flags: list[str], *, port: int | None = None, devices_per_process: int = 2,
           expendable: frozenset[int] = frozenset(), python: str = sys.executable) -> int:
    """Run the N processes to the end; 0 if every non-expendable process exited 0, else the first failure's code."""
    port = port or free_port()
    flags = _with_device_flag(flags, devices_per_process)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROC", "JAX_PROCESS"))}
    env.pop("XLA_FLAGS", None)  # the device count comes from JAX_NUM_CPU_DEVICES (or the config)
    env.update(JAX_NUM_CPU_DEVICES=str(devices_per_process), PYTHONUNBUFFERED="1",
               PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    lock = threading.Lock()
    procs, threads = [], []
    print(f"launch_local: coordinator 127.0.0.1:{port}", flush=True)  # a restarted process joins with it
    for i in range(n):
        cmd = [python, "-m", "launch.main", *flags, f"--coordinator_address=127.0.0.1:{port}",
               f"--num_processes={n}", f"--process_id={i}"]
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        print(f"launch_local: process {i} pid {p.pid}", flush=True)
        t = threading.Thread(target=_stream, args=(i, p.stdout, lock), daemon=True)
        t.start()
        procs.append(p)
        threads.append(t)
    code = 0
    live = set(range(n))
    try:
        while live:
            for i in sorted(live):
                rc = procs[i].poll()
                if rc is None:
                    continue
                live.discard(i)
                if rc == 0:
                    continue
                if i in expendable:
                    print(f"launch_local: process {i} exited {rc} (expendable: the run goes on)", flush=True)
                    continue
                print(f"launch_local: process {i} exited {rc}: stopping the others", flush=True)
                code = rc if rc > 0 else 1
                live.clear()
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # each child leads its own session: nothing of it survives
                p.wait()
        for t in threads:
            t.join(timeout=5)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: launch_local.py -n N [--port P] [--devices_per_process D] [--expendable 1,2] -- <launch.main flags>",
              file=sys.stderr)
        return 2
    cut = argv.index("--")
    ap = benchkit.tool_parser(__file__, __doc__)
    ap.add_argument("-n", "--num_processes", type=int, required=True)
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--devices_per_process", type=int, default=2)
    ap.add_argument("--expendable", default="", help="comma-separated process ids whose death the run survives")
    args = ap.parse_args(argv[:cut])
    if args.num_processes < 1:
        ap.error(f"-n must be >= 1, got {args.num_processes}")
    try:
        expendable = frozenset(int(x) for x in args.expendable.split(",") if x.strip())
    except ValueError:
        ap.error(f"--expendable must be comma-separated ints, got {args.expendable!r}")
    if 0 in expendable:
        ap.error("--expendable: process 0 runs the coordination service and cannot be expendable")
    return launch(args.num_processes, argv[cut + 1 :], port=args.port, devices_per_process=args.devices_per_process,
                  expendable=expendable)


if __name__ == "__main__":
    sys.exit(main())
