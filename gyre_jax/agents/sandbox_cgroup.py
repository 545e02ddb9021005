"""One memory and process cap for a whole sandbox: a cgroup per rollout.

Per-process rlimits do not bound a sandbox: RLIMIT_AS does not count pages a process
writes into a memfd or a tmpfs (measured here: 400 MiB held in a memfd under a 256 MiB
RLIMIT_AS), and RLIMIT_NPROC counts per kernel uid. A cgroup's memory limit charges
every page the sandbox's processes own (anonymous memory, tmpfs and memfd pages alike)
and its pids limit counts its tasks, so the sandbox as a whole is capped.

``make_cap`` creates ``gyre-<pid>-<n>`` under this process's own cgroup: cgroup v2
(``memory.max``, ``memory.swap.max``, ``pids.max``) where its hierarchy delegates the
memory and pids controllers to us, else the v1 ``memory`` and ``pids`` hierarchies where
they are mounted and writable. Where neither is, it returns None and why; the caller
says so in the sandbox's stats and keeps the rlimits. A command joins the cap through
``wrap`` (its first process writes itself into ``cgroup.procs`` and execs the command,
so everything it starts is inside); ``release`` kills what is left and removes it.
"""
from __future__ import annotations

import itertools
import os
import shlex
import signal
import time

_COUNTER = itertools.count()
_CLEANED: set[str] = set()


def _clean_once(parent: str) -> None:
    if parent not in _CLEANED:
        _CLEANED.add(parent)
        _remove_stale(parent)


class CgroupCap:
    def __init__(self, version: int, dirs: tuple[str, ...], memory_bytes: int, pids: int):
        self.version, self.dirs, self.memory_bytes, self.pids = version, dirs, memory_bytes, pids

    def describe(self) -> str:
        return f"v{self.version}: memory {self.memory_bytes} bytes, {self.pids} pids for the whole sandbox"

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` started inside the cap (the join fails closed: no cap, no command)."""
        join = " && ".join(f"echo $$ > {shlex.quote(os.path.join(d, 'cgroup.procs'))}" for d in self.dirs)
        return ["sh", "-c", f'{join} && exec "$@"', "gyre-cgroup", *argv]

    def peak_memory(self) -> int | None:
        """The most memory the sandbox held at once, if the kernel says."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int(_read(os.path.join(self.dirs[0], name)))
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int:
        """How many of the sandbox's processes the kernel killed at the memory cap so far."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            for line in _read(os.path.join(self.dirs[0], name)).splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def release(self) -> None:
        for d in self.dirs:
            try:
                if os.path.exists(os.path.join(d, "cgroup.kill")):
                    _write(os.path.join(d, "cgroup.kill"), "1")
                else:
                    for pid in _read(os.path.join(d, "cgroup.procs")).split():
                        try:
                            os.kill(int(pid), signal.SIGKILL)
                        except ProcessLookupError:
                            pass
            except OSError:
                pass
        for d in self.dirs:
            for _ in range(50):  # a killed task leaves the cgroup as it is reaped
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fstype, super options) of the cgroup file systems."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            fields, words = pre.split(), post.split()
            if len(words) >= 3 and words[0] in ("cgroup", "cgroup2"):
                out.append((fields[4], words[0], set(words[2].split(","))))
    return out


def _own_paths() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and '' -> its v2 path."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in (controllers.split(",") if controllers else [""]):
                out[c] = path
    return out


def _try_v2(name: str, memory_bytes: int, pids: int) -> tuple[CgroupCap | None, str]:
    own = _own_paths().get("")
    mounts = [m for m, fs, _ in _mounts() if fs == "cgroup2"]
    if own is None or not mounts:
        return None, "no cgroup v2 hierarchy"
    parent = os.path.join(mounts[0], own.lstrip("/"))
    try:
        available = _read(os.path.join(parent, "cgroup.controllers")).split()
        if not {"memory", "pids"} <= set(available):
            return None, f"cgroup v2 at {parent} offers {available or 'no controllers'}, not memory and pids"
        enabled = set(_read(os.path.join(parent, "cgroup.subtree_control")).split())
        if not {"memory", "pids"} <= enabled:
            _write(os.path.join(parent, "cgroup.subtree_control"), "+memory +pids")
        _clean_once(parent)
        d = os.path.join(parent, name)
        os.mkdir(d)
    except OSError as e:
        return None, f"cgroup v2 at {parent} is not delegated to us ({e.strerror})"
    try:
        _write(os.path.join(d, "memory.max"), str(memory_bytes))
        if os.path.exists(os.path.join(d, "memory.swap.max")):
            _write(os.path.join(d, "memory.swap.max"), "0")
        _write(os.path.join(d, "pids.max"), str(pids))
    except OSError as e:
        os.rmdir(d)
        return None, f"cgroup v2 {d}: cannot set limits ({e.strerror})"
    return CgroupCap(2, (d,), memory_bytes, pids), ""


def _try_v1(name: str, memory_bytes: int, pids: int) -> tuple[CgroupCap | None, str]:
    own = _own_paths()
    made: list[str] = []
    try:
        for controller in ("memory", "pids"):
            mount = next((m for m, fs, opts in _mounts() if fs == "cgroup" and controller in opts), None)
            if mount is None or controller not in own:
                raise LookupError(f"no cgroup v1 {controller} hierarchy")
            _clean_once(os.path.join(mount, own[controller].lstrip("/")))
            d = os.path.join(mount, own[controller].lstrip("/"), name)
            os.mkdir(d)
            made.append(d)
        mem, pid = made
        _write(os.path.join(mem, "memory.limit_in_bytes"), str(memory_bytes))
        if os.path.exists(os.path.join(mem, "memory.memsw.limit_in_bytes")):  # no escape into swap
            _write(os.path.join(mem, "memory.memsw.limit_in_bytes"), str(memory_bytes))
        _write(os.path.join(pid, "pids.max"), str(pids))
    except (LookupError, OSError) as e:
        for d in made:
            try:
                os.rmdir(d)
            except OSError:
                pass
        return None, str(e) if isinstance(e, LookupError) else f"cgroup v1 is not writable here ({e.strerror})"
    return CgroupCap(1, tuple(made), memory_bytes, pids), ""


def _remove_stale(parent: str) -> None:
    """Empty ``gyre-<pid>-<n>`` cgroups of trainers that are gone (a kill -9 skips release)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != "gyre" or not parts[1].isdigit() or int(parts[1]) == os.getpid():
            continue
        try:
            os.kill(int(parts[1]), 0)
            continue  # its trainer lives
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            os.rmdir(os.path.join(parent, name))  # refused while a task is still in it
        except OSError:
            pass


def make_cap(memory_bytes: int, pids: int) -> tuple[CgroupCap | None, str]:
    """A fresh cgroup capping a sandbox at ``memory_bytes`` and ``pids`` tasks, or (None, why not)."""
    name = f"gyre-{os.getpid()}-{next(_COUNTER)}"
    try:
        cap, why2 = _try_v2(name, memory_bytes, pids)
        if cap is not None:
            return cap, ""
        cap, why1 = _try_v1(name, memory_bytes, pids)
    except OSError as e:  # no /proc/self/cgroup or mountinfo
        return None, f"cgroups unreadable ({e})"
    if cap is not None:
        return cap, ""
    return None, f"{why2}; {why1}"
