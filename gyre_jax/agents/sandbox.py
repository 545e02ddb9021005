"""Where a rollout's tool commands run: one sandbox per rollout, chosen in the harness config.

Under RL the policy is optimised to raise its reward, so its commands are treated as hostile:
they must not write outside their workspace, read other rollouts or the trainer's files,
reach the network (the proxy included) or the grader, or starve the host.

Kinds (``SandboxConfig.kind``):

  bubblewrap  ``bwrap`` per command: the system dirs (/usr, /etc) read-only, nothing else of
              the host (no /home, /root, /work: not the venv, the repo or other workspaces),
              the workspace bound at /workspace as the only writable place, a private
              size-limited /tmp, a fresh /proc and /dev, an empty environment, every
              namespace unshared (a fresh loopback: no network, no proxy) unless the task
              family allows the network. The command runs as pid 2 of its own pid namespace
              whose init dies with it, so no process of a command (background, setsid'd,
              SIGTERM-ignoring) outlives it; on a timeout the whole group is SIGKILLed.
  docker /    a fresh container per command (``run --rm --init``, an image per task family,
  podman      ``--network none``, ``--read-only``, ``--pids-limit``, ``--memory``, dropped
              capabilities): for clusters. Not runnable on the dev machine; its command line
              is unit-tested.
  none        ``bash -c`` on the host, as the trainer's user: for debugging only; loudly
              warned about.
  auto        bubblewrap where ``bwrap`` works, else none (with the warning).

Limits (``SandboxLimits``): wall time is the harness's command timeout; CPU time, address
space, open files, file size and processes are rlimits set by ``ulimit`` inside the sandbox
(the shell builtin: no extra binary needed). Memory: RLIMIT_AS does not count pages held in a
memfd, a SysV segment or a tmpfs, so the sandbox as a whole gets a cgroup capped at the memory
limit (``sandbox_cgroup``: every page its processes own counts); where no cgroup can be made,
a seccomp filter refuses ``memfd_create``/``memfd_secret``/``shmget`` (``sandbox_seccomp``),
/tmp and /dev/shm are size-limited tmpfs mounts and the rest of /dev is read-only, so what a
command holds is its address space plus those sizes. Processes are an rlimit per *user*, so when the
trainer runs as root each rollout gets its own uid (``uid_base`` + slot) and its workspace is
owned by it; run as another user, the limit is set above that user's current process count.
The workspace's disk size is bounded by mounting a size-limited tmpfs on it (root only: a
per-rollout quota without any filesystem support; its pages are RAM, so the default is small);
without root it is measured after every command and reported as a limit hit.

Every command's refusals (writes to read-only places, network attempts) and limits hit are
counted from the error messages they print (a lower bound: a command can hide them) in
``SandboxStats``, which the harness records per rollout.
"""
from __future__ import annotations

import collections
import ctypes
import dataclasses
import logging
import os
import re
import shlex
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Mapping

from gyre_jax.agents.sandbox_cgroup import CgroupCap, make_cap
from gyre_jax.agents.sandbox_seccomp import filter_path

log = logging.getLogger(__name__)

KINDS = ("auto", "bubblewrap", "docker", "podman", "none")
WORKSPACE_MOUNT = "/workspace"  # where the workspace is inside a sandbox
SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Host dirs a bubblewrap sandbox sees read-only (those that exist); everything else is absent.
SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
NONE_WARNING = ("SANDBOX DISABLED (sandbox.kind='none'): tool commands run on the host as the trainer's user; "
                "a policy can edit its grader, read credentials and reach the network. Debugging only.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    cpu_s: int = 120  # CPU seconds per process (RLIMIT_CPU)
    memory_bytes: int = 4 << 30  # address space per process (RLIMIT_AS)
    processes: int = 256  # processes + threads of the sandbox's user (RLIMIT_NPROC)
    open_files: int = 1024  # RLIMIT_NOFILE
    file_bytes: int = 128 << 20  # largest file a command may write (RLIMIT_FSIZE)
    disk_bytes: int = 256 << 20  # the workspace in total (tmpfs size, or checked after each command)
    tmp_bytes: int = 64 << 20  # the private /tmp (a tmpfs)
    max_files: int = 65536  # files + dirs in the workspace (tmpfs inodes; the snapshot copies no more)
    # The whole sandbox (every process, its tmpfs, memfd and shared-memory pages): a cgroup where one
    # can be made (sandbox_cgroup.py); RLIMIT_AS alone does not count tmpfs or memfd pages. None: the
    # memory limit itself (memory_bytes), so one number bounds what a command can hold in any form
    # (a separate, larger cap let a command hold 600 MiB in memfds past a 512 MiB memory_bytes).
    sandbox_memory_bytes: int | None = None

    def __post_init__(self):
        if self.sandbox_memory_bytes is None:
            object.__setattr__(self, "sandbox_memory_bytes", self.memory_bytes)
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"SandboxLimits.{f.name} must be a positive int, got {v!r}")
        if self.file_bytes < 1024:
            raise ValueError(f"SandboxLimits.file_bytes must be >= 1024, got {self.file_bytes}")

    @property
    def cap_bytes(self) -> int:
        """What the sandbox as a whole may hold (``sandbox_memory_bytes``, resolved)."""
        return int(self.sandbox_memory_bytes or self.memory_bytes)

    def ulimit_args(self, processes: int) -> str:
        """``ulimit`` flags (bash units: -v KiB, -f 1024-byte blocks), hard and soft."""
        return (f"-t {self.cpu_s} -v {self.memory_bytes // 1024} -u {processes} -n {self.open_files} "
                f"-f {self.file_bytes // 1024}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    kind: str = "auto"
    limits: SandboxLimits = SandboxLimits()
    # Task families whose commands may use the network (also a family module's SANDBOX_NETWORK = True).
    # Network on means the host's network namespace: the proxy on 127.0.0.1 is reachable too.
    network_families: tuple[str, ...] = ()
    # Containers: the image per task family, else default_image.
    images: Mapping[str, str] = dataclasses.field(default_factory=dict)
    default_image: str = "python:3.11-slim"
    # Extra host paths visible read-only in a bubblewrap sandbox (e.g. a toolchain under /opt).
    extra_ro_paths: tuple[str, ...] = ()
    # First uid of the per-rollout users when the trainer runs as root (bubblewrap, containers).
    uid_base: int = 1 << 30

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"SandboxConfig.kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.limits, SandboxLimits):
            raise ValueError(f"SandboxConfig.limits must be a SandboxLimits, got {type(self.limits).__name__}")
        object.__setattr__(self, "network_families", tuple(self.network_families))
        object.__setattr__(self, "extra_ro_paths", tuple(self.extra_ro_paths))
        for p in self.extra_ro_paths:
            if not os.path.isabs(p):
                raise ValueError(f"SandboxConfig.extra_ro_paths: {p!r} is not an absolute path")
        object.__setattr__(self, "images", dict(self.images))
        if not 1000 <= self.uid_base <= (1 << 31) - (1 << 27):
            raise ValueError(f"SandboxConfig.uid_base must be in [1000, 2**31 - 2**27], got {self.uid_base}")


@dataclasses.dataclass
class SandboxStats:
    """What one rollout's commands did (all its agents share it)."""
    kind: str
    commands: int = 0
    violations: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    limits_hit: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    # how the sandbox as a whole is capped: "v1: ..." / "v2: ...", or "none: <why>; per-process
    # rlimits only" ("" until a command ran)
    cgroup: str = ""
    peak_memory_bytes: int | None = None  # the most the sandbox held at once (cgroup), if known

    def to_dict(self) -> dict:
        return {"kind": self.kind, "commands": self.commands, "violations": dict(self.violations),
                "limits_hit": dict(self.limits_hit), "cgroup": self.cgroup,
                "peak_memory_bytes": self.peak_memory_bytes}


# Error text -> what was refused / which limit was hit. Counted once per command and kind.
_VIOLATIONS = {
    "write_outside_workspace": re.compile(r"Read-only file system|EROFS"),
    "permission_denied": re.compile(r"Permission denied|EACCES|Operation not permitted|EPERM"),
    "network": re.compile(r"Network is unreachable|Connection refused|Temporary failure in name resolution|"
                          r"Could not resolve host|Name or service not known|ENETUNREACH|ECONNREFUSED"),
}
_LIMITS = {
    "cpu_time": re.compile(r"CPU time limit exceeded"),
    "file_size": re.compile(r"File size limit exceeded|File too large"),
    "processes": re.compile(r"fork: (retry: )?Resource temporarily unavailable|can't fork|"
                            r"Resource temporarily unavailable.*fork|BlockingIOError: \[Errno 11\]"),
    "memory": re.compile(r"Cannot allocate memory|MemoryError|bad_alloc|out of memory"),
    "disk": re.compile(r"No space left on device|Disk quota exceeded"),
}


def classify(output: str, *, network: bool) -> tuple[list[str], list[str]]:
    """(violations, limits) named in a command's output. With the network allowed a refused
    connection is ordinary, not a violation."""
    v = [k for k, rx in _VIOLATIONS.items() if rx.search(output) and (k != "network" or not network)]
    return v, [k for k, rx in _LIMITS.items() if rx.search(output)]


@dataclasses.dataclass(frozen=True)
class Launch:
    """How to start one command: the argv, and the argv that stops it where killing our child
    is not enough (a container outlives its client); ``env``: the process's environment
    (None: inherit; a bubblewrap sandbox sets its own inside)."""
    argv: list[str]
    kill_argv: list[str] | None = None
    env: Mapping[str, str] | None = None


_LIBC = ctypes.CDLL(None, use_errno=True)
_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2


def mount_tmpfs(path: str | os.PathLike, options: str) -> str | None:
    """A size-limited tmpfs on ``path`` (root only); why not, or None."""
    return _mount_tmpfs(Path(path), options)


def unmount(path: str | os.PathLike) -> None:
    if _LIBC.umount2(os.fsencode(path), _MNT_DETACH) != 0:
        log.warning("sandbox: umount %s failed: %s", path, os.strerror(ctypes.get_errno()))


def _mount_tmpfs(path: Path, options: str) -> str | None:
    """mount(2) a tmpfs (the syscall: a mount binary per rollout costs ~ms of CPU); the error or None."""
    rc = _LIBC.mount(b"gyre-workspace", os.fsencode(path), b"tmpfs", ctypes.c_ulong(_MS_NOSUID | _MS_NODEV),
                     options.encode())
    return None if rc == 0 else os.strerror(ctypes.get_errno())


class _UidPool:
    """Per-rollout uids for a root trainer: unique among this process's live rollouts, and
    (through the pid) unlikely to meet another trainer's on the same host."""

    def __init__(self):
        self._lock = threading.Lock()
        self._used: set[int] = set()

    def take(self, base: int) -> int:
        start = base + ((os.getpid() & 0xFFFF) << 11)
        with self._lock:
            for uid in range(start, start + (1 << 11)):
                if uid not in self._used:
                    self._used.add(uid)
                    return uid
        raise RuntimeError("sandbox: more than 2048 rollouts at once in one process")

    def give(self, uid: int) -> None:
        with self._lock:
            self._used.discard(uid)


_UIDS = _UidPool()


def take_uid() -> int:
    """A fresh per-sandbox uid for a root trainer (a grader's sandbox takes one too)."""
    return _UIDS.take(SandboxConfig().uid_base)


def give_uid(uid: int) -> None:
    _UIDS.give(uid)
_warned_none = False
_warned_cgroup = False


def _warn_no_cgroup(why: str) -> None:
    global _warned_cgroup
    if not _warned_cgroup:  # once per process: every sandbox finds the same
        _warned_cgroup = True
        log.warning("sandbox: no cgroup for a per-sandbox memory/pids cap (%s); per-process rlimits, and "
                    "memfd_create/shmget refused", why)


def bwrap_usable() -> tuple[bool, str]:
    """Whether ``bwrap`` is installed and can build our sandbox here (why not, if not)."""
    if shutil.which("bwrap") is None:
        return False, "bwrap is not installed (apt-get install bubblewrap)"
    uid = None
    if os.geteuid() == 0:
        uid = _UIDS.take(SandboxConfig().uid_base)
    global _seccomp_refused
    try:
        argv = bwrap_argv(network=False, uid=uid, tmp_bytes=1 << 20) + ["true"]
        r = subprocess.run(argv, capture_output=True, timeout=20)
        if r.returncode != 0 and "--seccomp" in argv:  # a kernel or a container that refuses the filter
            _seccomp_refused = r.stderr.decode(errors="replace").strip()[-200:] or f"exit {r.returncode}"
            r = subprocess.run(bwrap_argv(network=False, uid=uid, tmp_bytes=1 << 20) + ["true"],
                               capture_output=True, timeout=20)
            if r.returncode == 0:
                log.warning("sandbox: the seccomp filter against user namespaces is refused here (%s); "
                            "sandboxes go without it (their cgroup still caps memory)", _seccomp_refused)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"bwrap failed to start: {e}"
    finally:
        if uid is not None:
            _UIDS.give(uid)
    if r.returncode != 0:
        return False, f"bwrap cannot build a sandbox here: {r.stderr.decode(errors='replace').strip()[-300:]}"
    return True, ""


_usable_cache: tuple[bool, str] | None = None
_warned_fallback = False


def resolve_kind(kind: str) -> str:
    """``auto`` -> bubblewrap if usable, else none (warned); an explicit bubblewrap that cannot
    work is an error naming why."""
    global _usable_cache
    if kind in ("auto", "bubblewrap"):
        if _usable_cache is None:
            _usable_cache = bwrap_usable()
        ok, why = _usable_cache
        if ok:
            return "bubblewrap"
        if kind == "bubblewrap":
            raise RuntimeError(f"sandbox.kind='bubblewrap' but {why}")
        global _warned_fallback
        if not _warned_fallback:  # once per process: it is resolved for every rollout
            _warned_fallback = True
            log.warning("sandbox.kind='auto': %s; falling back to kind='none'", why)
        return "none"
    return kind


def _merged_usr_links() -> list[str]:
    """/bin, /lib... as the host has them: symlinks into /usr (merged /usr) or bound dirs."""
    out = []
    for d in SYSTEM_DIRS[2:]:
        if os.path.islink(d):
            out += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            out += ["--ro-bind", d, d]
    return out


def processes_of(uid: int) -> int:
    """Processes + threads ``uid`` owns now (what RLIMIT_NPROC counts)."""
    return _tasks_of_uid(uid)


def warn_no_cgroup(why: str) -> None:
    _warn_no_cgroup(why)


def _tasks_of_uid(uid: int) -> int:
    """Processes + threads the user owns now (what RLIMIT_NPROC counts)."""
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                status = f.read()
        except OSError:
            continue
        m_uid = re.search(r"^Uid:\s+(\d+)", status, re.M)
        m_thr = re.search(r"^Threads:\s+(\d+)", status, re.M)
        if m_uid and int(m_uid.group(1)) == uid:
            n += int(m_thr.group(1)) if m_thr else 1
    return n


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
            except OSError:
                pass
    return total


class Sandbox:
    """One rollout's sandbox: ``prepare`` its workspace, ``launch`` each command, ``release``
    at the rollout's end. Subclasses build the command line."""

    kind = "none"
    _cap: CgroupCap | None = None  # its cgroup, made at the first command where one can be
    _oom_kills = 0  # the cap's OOM kills already reported

    def __init__(self, config: SandboxConfig, workspace: Path, *, network: bool = False, image: str | None = None,
                 commands: bool = True):
        self.config, self.limits = config, config.limits
        self.commands = commands  # False: the task has no `run` tool, so nothing of the agent's ever executes
        self.workspace = Path(workspace)
        self.network, self.image = network, image
        self.stats = SandboxStats(self.kind)
        self.uid: int | None = None  # the rollout's own uid (root trainer), else None
        self.tmpfs = False  # the workspace is a size-limited tmpfs we mounted

    # -- per rollout --
    def prepare(self) -> None:
        """Own the (still empty) workspace: a fresh uid and a size-limited tmpfs when root."""
        if os.geteuid() != 0 or self.kind == "none" or not self.commands:
            return
        if any(self.workspace.iterdir()):
            raise FileExistsError(f"sandbox: workspace {self.workspace} must be empty before prepare()")
        self.uid = _UIDS.take(self.config.uid_base)
        error = _mount_tmpfs(self.workspace, f"size={self.limits.disk_bytes},nr_inodes={self.limits.max_files},"
                                             f"mode=0700,uid={self.uid},gid={self.uid}")
        self.tmpfs = error is None
        if error is not None:
            log.warning("sandbox: cannot mount a tmpfs on %s (%s); the workspace size is checked after each "
                        "command instead", self.workspace, error)
            os.chown(self.workspace, self.uid, self.uid)
            os.chmod(self.workspace, 0o700)

    def chown_tree(self, path: Path) -> None:
        """Give ``path`` (and what is under it) to the rollout's uid: files the harness writes
        (write_file runs in the trainer) must stay writable to the agent's commands."""
        if self.uid is None:
            return
        for dirpath, dirnames, files in os.walk(path):
            for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + files)]:
                os.lchown(name, self.uid, self.uid)
        if path.is_file():
            os.lchown(path, self.uid, self.uid)

    def chown_new(self, path: Path) -> None:
        """After the harness wrote ``path``: chown it and the parent dirs it may have made."""
        if self.uid is None:
            return
        p = path
        while p != self.workspace and self.workspace in p.parents:
            os.lchown(p, self.uid, self.uid)
            p = p.parent

    def release(self) -> None:
        """End of the rollout (after the snapshot): end the cgroup, unmount the tmpfs, free the uid."""
        cap = self._cap
        if cap is not None:
            self.stats.peak_memory_bytes = cap.peak_memory()
            cap.release()
            self._cap = None
        if self.tmpfs:
            if _LIBC.umount2(os.fsencode(self.workspace), _MNT_DETACH) != 0:
                log.warning("sandbox: umount %s failed: %s", self.workspace, os.strerror(ctypes.get_errno()))
            self.tmpfs = False
        if self.uid is not None:
            _UIDS.give(self.uid)
            self.uid = None

    # -- per command --
    def launch(self, command: str) -> Launch:
        raise NotImplementedError

    def launch_harness(self, argv: list[str], *, env: Mapping[str, str], limits: SandboxLimits,
                       ro_paths: tuple[str, ...] = (), binds: tuple[tuple[str, str, str], ...] = ()) -> Launch:
        """How to start a whole harness process (``argv``, run in the workspace) inside this sandbox:
        a private network namespace whatever the task family allows (the harness reaches the proxy
        through ``binds``, never the host's network), ``ro_paths`` visible read-only (its
        installation), ``env`` set, ``limits`` for its processes."""
        raise NotImplementedError(f"sandbox kind {self.kind!r} cannot run a command harness yet; use bubblewrap "
                                  "(or none, for debugging)")

    def _check_commands(self) -> None:
        if not self.commands:
            raise RuntimeError(f"sandbox of {self.workspace}: made for a task without commands")

    def _nproc(self, limits: SandboxLimits | None = None) -> int:
        limits = limits or self.limits
        if self.uid is not None:
            return limits.processes
        return _tasks_of_uid(os.getuid()) + limits.processes  # shared with the trainer's own

    def _limited(self, command: str) -> list[str]:
        return limited_shell(self.limits, self._nproc(), ["bash", "-c", command])

    def observe(self, output: str, *, timed_out: bool, truncated: bool) -> str:
        """Count what the command ran into; returns a note for the agent ('' if none)."""
        self.stats.commands += 1
        violations, limits = classify(output, network=self.network)
        self.stats.violations.update(violations)
        limits += ["wall_time"] * timed_out + ["output_size"] * truncated
        note = ""
        if not self.tmpfs and self.kind != "none":
            used = _tree_bytes(self.workspace)
            if used > self.limits.disk_bytes:
                limits.append("disk")
                note = (f"\n[sandbox: the workspace holds {used} bytes, over its limit of "
                        f"{self.limits.disk_bytes}; delete files]")
        if self._cap is not None:
            kills = self._cap.oom_kills()
            if kills > self._oom_kills:  # the kernel, not the command, says so: name it for the agent
                self._oom_kills = kills
                limits.append("memory")
                note += f"\n[sandbox: killed at the sandbox's memory cap of {self._cap.memory_bytes} bytes]"
        self.stats.limits_hit.update(set(limits))
        return note


class NoSandbox(Sandbox):
    kind = "none"

    def launch(self, command: str) -> Launch:
        return Launch(["bash", "-c", command])

    def launch_harness(self, argv: list[str], *, env: Mapping[str, str], limits: SandboxLimits,
                       ro_paths: tuple[str, ...] = (), binds: tuple[tuple[str, str, str], ...] = ()) -> Launch:
        return Launch(list(argv), env={**os.environ, **env})

    def observe(self, output: str, *, timed_out: bool, truncated: bool) -> str:
        self.stats.commands += 1
        self.stats.limits_hit.update(["wall_time"] * timed_out + ["output_size"] * truncated)
        return ""


def bwrap_argv(*, network: bool, uid: int | None, tmp_bytes: int, extra_ro_paths=(),
               binds: tuple[tuple[str, str, str], ...] = (), env: Mapping[str, str] | None = None,
               deny_shared_memory: bool = False, overlays: tuple[tuple[str, str, str], ...] = ()) -> list[str]:
    """bwrap up to (and including) the command's user switch. ``binds``: (option, host path,
    sandbox path), e.g. ("--bind", workspace, "/workspace"); ``overlays``: binds over paths that
    exist inside an earlier bind (a hidden file read-only inside the writable workspace), after them.
    ``deny_shared_memory``: the sandbox has no cgroup counting its memory, so memfds and SysV
    segments are refused (``sandbox_seccomp``).

    As root (``uid`` set) bwrap runs privileged without a user namespace, so the command's
    kernel uid really is ``uid`` (RLIMIT_NPROC counts per kernel uid; inside a user namespace
    made by root it would still be uid 0, which the limit exempts): setpriv switches to it,
    the only capabilities kept for that being SETUID/SETGID, lost at the switch; a seccomp
    filter (``sandbox_seccomp``) forbids user namespaces inside. Otherwise bwrap makes a user
    namespace (``--unshare-all``, ``--disable-userns``) and the command keeps our uid."""
    argv = ["bwrap", *_namespaces(uid, network), "--die-with-parent", "--new-session", "--clearenv", "--setenv", "PATH", SANDBOX_PATH,
            "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
            "--hostname", "sandbox"]
    for k, v in (env or {}).items():
        argv += ["--setenv", k, v]
    made: set[str] = set()

    def parents(path: str) -> list[str]:
        # Mount points' parents (e.g. /root for a pyenv Python) would be made 0700, so the sandbox's
        # uid could not reach the bound path: make them 0755 (empty: only what is bound shows).
        out = []
        for q in (str(q) for q in reversed(Path(path).parents) if str(q) != "/"):
            if q not in made and q not in SYSTEM_DIRS:
                made.add(q)
                out += ["--perms", "0755", "--dir", q]
        return out

    for d in SYSTEM_DIRS[:2]:
        argv += parents(d) + ["--ro-bind-try", d, d]
    argv += _merged_usr_links()
    # /dev is a tmpfs of bwrap's (no size: half the host's RAM, writable by a non-root trainer's
    # sandbox, whose user owns it): /dev/shm gets a sized tmpfs of its own, then /dev goes read-only.
    argv += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(tmp_bytes), "--tmpfs", "/dev/shm",
             "--remount-ro", "/dev", "--perms", "1777", "--size", str(tmp_bytes), "--tmpfs", "/tmp"]
    made.add("/tmp")  # the private tmpfs: a read-only path under the host's /tmp is bound on top of it
    for d in extra_ro_paths:
        argv += parents(d) + ["--ro-bind-try", d, d]
    for opt, src, dst in binds:
        argv += parents(dst) + [opt, src, dst]
    for opt, src, dst in overlays:
        argv += [opt, src, dst]
    # Started in /: bwrap itself (root without CAP_DAC_OVERRIDE) may not enter the uid's 0700
    # workspace; the command's shell does, as that uid (see ``limited_shell``).
    argv += ["--chdir", "/", "--"]
    if uid is not None:
        argv += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--"]
    return _with_seccomp(argv, uid, deny_shared_memory)


def _namespaces(uid: int | None, network: bool) -> list[str]:
    if uid is not None:
        return ["--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try",
                *([] if network else ["--unshare-net"]), "--cap-drop", "ALL", "--cap-add", "CAP_SETUID",
                "--cap-add", "CAP_SETGID"]
    # no user namespaces inside (a namespace of its own lets a command mount tmpfs at will);
    # bwrap >= 0.8 can forbid them, only together with the user namespace it made
    return ["--unshare-all", *(["--share-net"] if network else []), *_disable_userns()]


def _with_seccomp(argv: list[str], uid: int | None, deny_shared_memory: bool) -> list[str]:
    """No user namespaces inside a root trainer's sandbox; no uncounted memory in one without a cgroup."""
    rules = [*(["userns"] if uid is not None else []), *(["shared_memory"] if deny_shared_memory else [])]
    seccomp = None if _seccomp_refused else filter_path(*rules)
    if seccomp is None:
        return argv
    return ["sh", "-c", 'exec "$@" 9< "$0"', seccomp, argv[0], "--seccomp", "9", *argv[1:]]


_userns_flag: list[str] | None = None
_seccomp_refused: str | None = None  # why bwrap refused the filter here (bwrap_usable), if it did


def seccomp_refused() -> str | None:
    return _seccomp_refused


def note_seccomp_refused(why: str) -> None:
    """The trainer found the filter refused here (a grader subprocess learns it from its spec)."""
    global _seccomp_refused
    if _seccomp_refused is None:
        _seccomp_refused = why


def _disable_userns() -> list[str]:
    """``--disable-userns`` if the installed bwrap has it (0.8+), else nothing."""
    global _userns_flag
    if _userns_flag is None:
        try:
            out = subprocess.run(["bwrap", "--help"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        _userns_flag = ["--disable-userns"] if "--disable-userns" in out else []
    return _userns_flag


def limited_shell(limits: SandboxLimits, nproc: int, argv: list[str]) -> list[str]:
    """bash that enters the workspace, sets the rlimits, then execs ``argv`` (no extra process)."""
    return ["bash", "-c", f"cd {WORKSPACE_MOUNT} && ulimit -S -H {limits.ulimit_args(nproc)} && exec \"$@\"",
            "gyre-sandbox", *argv]


class BubblewrapSandbox(Sandbox):
    kind = "bubblewrap"

    def launch(self, command: str) -> Launch:
        self._check_commands()
        uncapped = self._make_cap(self.limits)
        argv = bwrap_argv(network=self.network, uid=self.uid, tmp_bytes=self.limits.tmp_bytes,
                          extra_ro_paths=self.config.extra_ro_paths,
                          binds=(("--bind", str(self.workspace), WORKSPACE_MOUNT),), deny_shared_memory=uncapped)
        return Launch(self._capped(argv + self._limited(command)))

    def launch_harness(self, argv: list[str], *, env: Mapping[str, str], limits: SandboxLimits,
                       ro_paths: tuple[str, ...] = (), binds: tuple[tuple[str, str, str], ...] = ()) -> Launch:
        self._check_commands()
        uncapped = self._make_cap(limits)
        outer = bwrap_argv(network=False, uid=self.uid, tmp_bytes=limits.tmp_bytes,
                           extra_ro_paths=(*self.config.extra_ro_paths, *ro_paths), env=env,
                           binds=(("--bind", str(self.workspace), WORKSPACE_MOUNT), *binds),
                           deny_shared_memory=uncapped)
        return Launch(self._capped(outer + limited_shell(limits, self._nproc(limits), list(argv))))

    def _make_cap(self, limits: SandboxLimits) -> bool:
        """The sandbox's cgroup, made at its first command (one for all its commands and agents); True if
        there is none (the stats say why: its commands then get no memfds or SysV segments)."""
        if not self.stats.cgroup:
            cap, why = make_cap(limits.cap_bytes, limits.processes)
            self._cap = cap
            self.stats.cgroup = (cap.describe() if cap is not None else
                                 f"none: {why}; per-process rlimits, memfd and shmget refused")
            if cap is None:
                _warn_no_cgroup(why)
        return self._cap is None

    def _capped(self, argv: list[str]) -> list[str]:
        """``argv`` inside the sandbox's cgroup, or as is where none can be made."""
        return self._cap.wrap(argv) if self._cap is not None else argv


class ContainerSandbox(Sandbox):
    """docker / podman: a fresh container per command, so a command's processes end with it
    (``--init`` reaps, ``--rm`` removes). ``kill_argv`` stops it on a timeout: killing the
    client does not stop the container."""

    def __init__(self, config: SandboxConfig, workspace: Path, *, runtime: str, network: bool = False,
                 image: str | None = None, name: str = "gyre", commands: bool = True):
        self.kind = runtime
        super().__init__(config, workspace, network=network, image=image or config.default_image, commands=commands)
        self.image: str = image or config.default_image
        self.name_prefix = re.sub(r"[^a-zA-Z0-9_.-]", "_", name)
        self._n = 0

    def launch(self, command: str) -> Launch:
        self._check_commands()
        self._n += 1
        name = f"{self.name_prefix}-{self._n}"
        lim = self.limits
        user = self.uid if self.uid is not None else os.getuid()  # owns the workspace
        argv = [self.kind, "run", "--rm", "--init", "--name", name, "--network", "bridge" if self.network else "none",
                "--read-only", "--tmpfs", f"/tmp:rw,nosuid,nodev,size={lim.tmp_bytes},mode=1777",
                "--volume", f"{self.workspace}:{WORKSPACE_MOUNT}:rw", "--workdir", WORKSPACE_MOUNT,
                "--user", f"{user}:{user}", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                "--pids-limit", str(lim.processes), "--memory", str(lim.memory_bytes),
                "--memory-swap", str(lim.memory_bytes), "--ulimit", f"cpu={lim.cpu_s}:{lim.cpu_s}",
                "--ulimit", f"fsize={lim.file_bytes}:{lim.file_bytes}",
                "--ulimit", f"nofile={lim.open_files}:{lim.open_files}",
                "--env", "HOME=/tmp", "--env", "PYTHONDONTWRITEBYTECODE=1", self.image, "bash", "-c", command]
        return Launch(argv, kill_argv=[self.kind, "kill", name])


def make_sandbox(config: SandboxConfig, workspace: Path, *, family: str, name: str, commands: bool = True) -> Sandbox:
    """The sandbox for one rollout of a task of ``family`` (``name``: the rollout id).
    ``commands=False`` (the task offers no `run` tool): no uid or tmpfs is set up."""
    kind = resolve_kind(config.kind)
    network = family in config.network_families or family_allows_network(family)
    if kind == "none":
        global _warned_none
        if not _warned_none:
            log.warning(NONE_WARNING)
            _warned_none = True
        return NoSandbox(config, workspace, network=True, commands=commands)
    if kind == "bubblewrap":
        return BubblewrapSandbox(config, workspace, network=network, commands=commands)
    return ContainerSandbox(config, workspace, runtime=kind, network=network, commands=commands,
                            image=config.images.get(family), name=f"gyre-{name}")


def family_allows_network(family: str) -> bool:
    """A task family module may declare ``SANDBOX_NETWORK = True``."""
    from gyre_jax.agents import tasks
    if family not in tasks.FAMILIES:
        return False
    return bool(getattr(tasks.family(family), "SANDBOX_NETWORK", False))


def describe(launch: Launch) -> str:
    """The command line, for logs and errors."""
    return shlex.join(launch.argv)


# set by graders.run_grader: {"kind", "limits", "image", "seccomp", "ro_paths"}; read by gyre_jax.agents.grader_sandbox
GRADER_SANDBOX_ENV = "GYRE_GRADER_SANDBOX"
