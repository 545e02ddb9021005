"""Multi-process JAX: ``initialize`` calls ``jax.distributed.initialize`` when, and only when, needed.

``launch/main.py`` builds a ``DistributedConfig`` from its flags and calls
``maybe_initialize`` (``initialize``, then ``layout``: log the process index and
devices) before any job runs; nothing here reads flags. Not RL-specific: every
job that uses JAX starts this way.

Three ways a run becomes multi-process:

  * explicit: ``coordinator_address`` ("host:port" of process 0),
    ``num_processes`` and ``process_id`` all set (e.g. from absl flags);
    ``num_processes == 1`` is a single process and initializes nothing.
  * detected (``cluster='auto'``, the default, with the fields unset): the
    environment of a multi-process launcher says so and JAX's own cluster
    detection fills in the fields: SLURM (``SLURM_JOB_ID`` ... with
    ``SLURM_NTASKS`` > 1: one process per task, GPU clusters), Open MPI
    (``OMPI_COMM_WORLD_SIZE`` > 1), multi-host TPU (``TPU_WORKER_HOSTNAMES``
    with more than one host, as on GKE), or ``JAX_COORDINATOR_ADDRESS`` with
    ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` (a plain launcher's convention).
    Only environment variables are read: no metadata-server query, so a laptop
    never waits on the network.
  * forced: ``cluster='jax'`` calls ``jax.distributed.initialize()`` and lets JAX
    detect everything (a Cloud TPU VM pod, whose workers learn their ids from
    the metadata server), or a JAX method name ('slurm', 'ompi', 'gcetpu',
    'gketpu', 'mpi4py') to use that one.

Otherwise the run is one process and nothing is initialized (``cluster='none'``
makes that explicit even inside a launcher).

CPU: a multi-process CPU run needs a cross-process collectives implementation;
``cpu_collectives='gloo'`` (the default) sets ``jax_cpu_collectives_implementation``
before the backend starts. ``initialize`` must run before any JAX computation
(the backend and its collectives are fixed at first use; it raises otherwise),
and does not start the backend itself: ``jax_num_cpu_devices`` can still be set
after it. ``layout`` starts the backend (it asks for the devices).
"""
from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import socket
from typing import Any, Mapping

import jax

from gyre_jax.errors import ConfigError

log = logging.getLogger(__name__)

CLUSTERS = ("auto", "none", "jax", "slurm", "ompi", "gcetpu", "gketpu", "mpi4py")
CPU_COLLECTIVES = ("gloo", "mpi", "none")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    coordinator_address: str | None = None  # "host:port" of process 0; None = detect or single process
    num_processes: int | None = None  # total processes (hosts) in the run
    process_id: int | None = None  # this process's index in [0, num_processes)
    local_device_ids: tuple[int, ...] | None = None  # devices this process drives (None = all visible)
    cluster: str = "auto"  # see module docstring: auto | none | jax | a JAX cluster method name
    cpu_collectives: str = "gloo"  # CPU cross-process collectives: gloo | mpi | none
    initialization_timeout_s: int = 300  # how long processes wait for each other at start
    recoverable: bool = False  # the run survives a process's death (pods: satellites are expendable)
    heartbeat_timeout_s: int = 100  # after this long without heartbeats a process counts as dead
    # "host:port" process 0's coordinator listens on; None: the coordinator's own address when
    # its host is an IP literal or localhost (127.0.0.1 stays on loopback), else all
    # interfaces as JAX does (a DNS name may resolve to an address the host does not own)
    coordinator_bind_address: str | None = None

    def __post_init__(self):
        w = "DistributedConfig"
        if self.cluster not in CLUSTERS:
            raise ValueError(f"{w}.cluster={self.cluster!r}; known: {CLUSTERS}")
        if self.cpu_collectives not in CPU_COLLECTIVES:
            raise ValueError(f"{w}.cpu_collectives={self.cpu_collectives!r}; known: {CPU_COLLECTIVES}")
        if self.coordinator_address is not None:
            host, sep, port = str(self.coordinator_address).rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{w}.coordinator_address={self.coordinator_address!r} must be 'host:port'")
        for name in ("num_processes", "process_id"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"{w}.{name} must be an int >= 0 or None, got {v!r}")
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"{w}.num_processes must be >= 1, got {self.num_processes}")
        if self.process_id is not None and self.num_processes is not None and self.process_id >= self.num_processes:
            raise ValueError(f"{w}.process_id={self.process_id} must be < num_processes={self.num_processes}")
        explicit = [self.coordinator_address is not None, self.num_processes is not None, self.process_id is not None]
        if any(explicit) and not all(explicit) and not (self.num_processes == 1 and self.coordinator_address is None):
            raise ValueError(
                f"{w}: coordinator_address, num_processes and process_id go together "
                f"(got {self.coordinator_address!r}, {self.num_processes!r}, {self.process_id!r}); "
                "leave all three unset to detect them"
            )
        if self.local_device_ids is not None:
            object.__setattr__(self, "local_device_ids", tuple(int(i) for i in self.local_device_ids))
        if not self.heartbeat_timeout_s > 0:
            raise ValueError(f"{w}.heartbeat_timeout_s must be > 0, got {self.heartbeat_timeout_s}")
        if not self.initialization_timeout_s > 0:
            raise ValueError(f"{w}.initialization_timeout_s must be > 0, got {self.initialization_timeout_s}")

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any] | None) -> "DistributedConfig":
        """From an ml_collections ConfigDict / dict; unknown keys are an error."""
        if m is None:
            return cls()
        d = dict(m.to_dict() if hasattr(m, "to_dict") else m)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"distributed config: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class DistributedInfo:
    process_index: int
    process_count: int
    local_devices: tuple
    global_device_count: int
    initialized_here: bool  # this call ran jax.distributed.initialize
    how: str  # 'single', 'explicit', 'detected:<name>', 'jax', 'already'


def _int_env(env, name) -> int:
    try:
        return int(env.get(name, "1") or 1)
    except ValueError:
        return 1


def detect_cluster(env: Mapping[str, str] | None = None) -> str | None:
    """The multi-process launcher the environment shows (None = a single process). Reads env only."""
    env = os.environ if env is None else env
    if env.get("JAX_COORDINATOR_ADDRESS") and _int_env(env, "JAX_NUM_PROCESSES") > 1:
        return "jax_env"
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(k in env for k in slurm) and _int_env(env, "SLURM_NTASKS") > 1:
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in env and _int_env(env, "OMPI_COMM_WORLD_SIZE") > 1:
        return "ompi"
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if len(hosts) > 1:
        return "tpu"
    return None


def _backend_started() -> bool:
    from jax._src import xla_bridge  # no public API says whether the backend exists yet

    return xla_bridge.backends_are_initialized()


def layout(how: str = "single") -> DistributedInfo:
    """Who this process is and which devices it sees. Starts JAX's backend (it asks for devices)."""
    info = DistributedInfo(
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        local_devices=tuple(jax.local_devices()),
        global_device_count=jax.device_count(),
        initialized_here=how not in ("single", "already"),
        how=how,
    )
    log.debug(  # launch.main prints the same in one line; the device list is for --verbosity=1
        "process %d of %d (%s): %d local devices %s, %d global",
        info.process_index, info.process_count, how, len(info.local_devices),
        [str(d) for d in info.local_devices], info.global_device_count,
    )
    return info


def bind_address(coordinator_address: str | None, configured: str | None, env: Mapping[str, str]) -> str | None:
    """The address process 0's coordinator binds, or None to leave it to JAX.

    JAX binds ``[::]:port`` (every interface) unless told otherwise, even for a coordinator
    at 127.0.0.1: anyone who can reach the host could join or stall the run (the coordination
    service has no authentication). So it binds the address peers use to reach it: an IP
    literal or localhost as given; a host name (SLURM's first node, a Kubernetes service, this
    host's name) as the address of this host it resolves to (127.0.0.1 when the name is this
    host's loopback alias: one machine). A name that resolves to no address of this host names
    another machine (a process that is not the coordinator) or a forwarder: JAX's default then.
    JAX_COORDINATOR_BIND_ADDRESS still wins."""
    if configured is not None:
        return configured
    if coordinator_address is None or env.get("JAX_COORDINATOR_BIND_ADDRESS"):
        return None
    host, _, port = coordinator_address.rpartition(":")
    host = host.strip("[]")
    if host == "localhost":
        return coordinator_address
    try:
        ipaddress.ip_address(host)
        return coordinator_address
    except ValueError:
        pass
    local = local_address_of(host)
    if local is None:
        return None
    return f"[{local}]:{port}" if ":" in local else f"{local}:{port}"


def local_address_of(host: str) -> str | None:
    """The first address ``host`` resolves to that a socket on this machine can bind (None: none, or no
    answer). Loopback answers come first, so a name of this machine that maps to loopback stays there."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return None
    addrs = sorted({(fam, str(sa[0])) for fam, _, _, _, sa in infos},
                   key=lambda a: (not ipaddress.ip_address(a[1].split("%")[0]).is_loopback, a[1]))
    for fam, addr in addrs:
        try:
            with socket.socket(fam, socket.SOCK_STREAM) as sk:
                sk.bind((addr, 0))
        except OSError:
            continue
        return addr
    return None


def _detected(method: str | None, local_device_ids, timeout_s: int) -> dict[str, Any]:
    """The coordinator address, process count and id JAX's cluster detection finds (``method``: a JAX cluster
    method name, None for JAX's own order), so the coordinator's bind address can be chosen from them; {} where
    detection fails here (JAX then detects again, and says why)."""
    from jax._src import clusters  # the detection JAX runs inside initialize; no public API returns its answer

    try:
        addr, n, pid, ids = clusters.ClusterEnv.auto_detect_unset_distributed_params(
            None, None, None, local_device_ids, method, timeout_s)
    except Exception as e:  # noqa: BLE001 - JAX's initialize runs the same detection and reports it
        log.warning("cluster detection (%s) failed before initialize (%s); the coordinator binds JAX's default", method,
                    e)
        return {}
    if addr is None or n is None or pid is None:
        return {}
    return dict(coordinator_address=addr, num_processes=int(n), process_id=int(pid),
                **({"local_device_ids": list(ids)} if ids is not None else {}))


def initialize(config: DistributedConfig | Mapping[str, Any] | None = None, *, env: Mapping[str, str] | None = None) -> str:
    """Call ``jax.distributed.initialize`` if the config or the environment asks for it; return how.

    ``how`` is 'single' (nothing to do), 'already' (JAX's distributed system was
    up before this call), 'explicit', 'detected:<name>', 'jax' or a JAX cluster
    method name. Never starts JAX's backend itself, so the caller can still set
    backend options (e.g. ``jax_num_cpu_devices``) afterwards; it raises if the
    backend is already running when an initialization is needed.
    """
    cfg = config if isinstance(config, DistributedConfig) else DistributedConfig.from_mapping(config)
    env = os.environ if env is None else env
    if jax.distributed.is_initialized():
        return "already"
    planned = _how_to_initialize(cfg, env)
    if planned is None:
        return "single"
    how, kwargs = planned
    if cfg.local_device_ids is not None:
        kwargs["local_device_ids"] = list(cfg.local_device_ids)
    bind = bind_address(kwargs.get("coordinator_address"), cfg.coordinator_bind_address, env)
    if bind is not None:
        kwargs["coordinator_bind_address"] = bind
    if _backend_started():
        raise RuntimeError(
            f"distributed.initialize ({how}): JAX's backend is already running (a JAX computation or "
            "jax.devices() ran first); initialize at the start of the program (launch/main.py does)"
        )
    if cfg.cpu_collectives != "none":
        # Only the CPU backend reads it; on GPU/TPU it is harmless and covers host-side CPU arrays.
        jax.config.update("jax_cpu_collectives_implementation", cfg.cpu_collectives)
    # Recoverable: the coordination service does not take every process down with one that
    # died (without it, a killed satellite ends the run); set before the service starts.
    jax.config.update("jax_enable_recoverability", bool(cfg.recoverable))
    log.info("jax.distributed.initialize(%s) [%s]", kwargs, how)
    jax.distributed.initialize(initialization_timeout=int(cfg.initialization_timeout_s),
                               heartbeat_timeout_seconds=int(cfg.heartbeat_timeout_s), **kwargs)
    return how


def _how_to_initialize(cfg: DistributedConfig, env: Mapping[str, str]) -> tuple[str, dict[str, Any]] | None:
    """(how, ``jax.distributed.initialize``'s cluster arguments), or None for one process (see ``initialize``)."""
    kwargs: dict[str, Any] = {}
    if cfg.coordinator_address is not None:
        if cfg.num_processes == 1:
            return None
        return "explicit", dict(coordinator_address=cfg.coordinator_address, num_processes=cfg.num_processes,
                                process_id=cfg.process_id)
    if cfg.num_processes == 1 or cfg.cluster == "none":
        return None
    if cfg.cluster == "auto":
        found = detect_cluster(env)
        if found is None:
            return None
        if found == "jax_env":
            try:
                kwargs = dict(coordinator_address=env["JAX_COORDINATOR_ADDRESS"], num_processes=int(env["JAX_NUM_PROCESSES"]),
                              process_id=int(env["JAX_PROCESS_ID"]))
            except (KeyError, ValueError) as e:
                raise ValueError(f"JAX_COORDINATOR_ADDRESS is set: JAX_NUM_PROCESSES and JAX_PROCESS_ID must be ints ({e!r})") from None
            DistributedConfig(**kwargs)  # same checks as flags (address form, id < count)
        else:  # SLURM, Open MPI, a TPU pod: JAX's detection, run here so the bind address is known
            kwargs = _detected(None, cfg.local_device_ids, cfg.initialization_timeout_s)
        return f"detected:{found}", kwargs
    kwargs = _detected(None if cfg.cluster == "jax" else cfg.cluster, cfg.local_device_ids, cfg.initialization_timeout_s)
    if not kwargs and cfg.cluster != "jax":
        kwargs["cluster_detection_method"] = cfg.cluster
    return cfg.cluster, kwargs


def maybe_initialize(config: DistributedConfig | Mapping[str, Any] | None = None, *, env: Mapping[str, str] | None = None) -> DistributedInfo:
    """``initialize`` then ``layout``: initialize multi-process JAX if asked, log who we are.

    Idempotent: a second call (or a run where something else initialized JAX's
    distributed system) returns the current layout.
    """
    return layout(initialize(config, env=env))


# XLA:CPU runs every multi-device program's per-device parts on one client thread
# pool (PJRT_NPROC threads, default: the core count, at least the device count), and a
# launch blocks a pool thread while its device already has 32 computations in flight.
# Once every pool thread is held by such launches, the part of a running collective
# that still needs a thread never gets one: its all-gather peer waits 40 s and XLA
# aborts the process ("Termination timeout for `all gather ...`"). The RL loop has ~25
# threads that dispatch to 2-device cells (4 JetStream driver threads per engine, a
# worker per training cell, the reducer, the publisher), and a loaded machine lets the
# queues fill: that is how the demo died at step 55 with two busy loops beside it.
# tests/test_cpu_dispatch.py reproduces it in 8 threads (a pool of 2 x threads or less
# deadlocks; one of more does not). The pool is sized for the threads, not the cores:
# idle threads cost nothing, and the larger pool cost ~10% on tiny matmul programs.
CPU_THREADS_PER_DEVICE = 16
MAX_CPU_CLIENT_THREADS = 256


def cpu_client_threads(n_devices: int) -> int:
    """Threads for XLA:CPU's client pool with ``n_devices`` host devices (see the note above)."""
    return min(MAX_CPU_CLIENT_THREADS, max(os.cpu_count() or 1, CPU_THREADS_PER_DEVICE * max(1, int(n_devices))))


def size_cpu_client_threads(n_devices: int) -> None:
    """Set ``PJRT_NPROC`` before the CPU backend starts, unless the user set it (then theirs wins).

    No effect once a backend runs (XLA reads it when the client is made); harmless on
    GPU/TPU, whose clients only size host-side helper pools from it."""
    if "PJRT_NPROC" not in os.environ and not _backend_started():
        os.environ["PJRT_NPROC"] = str(cpu_client_threads(n_devices))


def ensure_cpu_devices(n: int) -> None:
    """Ask for ``n`` host devices before JAX starts its CPU backend (no effect on GPU/TPU).

    If a backend is already up (e.g. tests: conftest sets 8), the count must match."""
    size_cpu_client_threads(n)
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except Exception:  # noqa: BLE001 - backend already initialised
        pass
    if jax.default_backend() == "cpu" and len(jax.devices()) != n:
        raise ConfigError(f"config.num_cpu_devices={n} but JAX already runs with {len(jax.devices())} CPU devices "
                          "(the count is fixed once JAX starts)")
